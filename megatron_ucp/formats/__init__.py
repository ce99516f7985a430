"""Readers for Megatron-LM checkpoints (legacy `torch` and `torch_dist`): per-rank local shards with
model weights and exact optimizer state, behind one declared interface (`base.CheckpointReader`).

A format registers here with a cheap file-level test; its module is imported only when a checkpoint
of that format is opened. Nothing here imports torch: opening a checkpoint, its shards and its common
state are torch-free (every pickle is parsed by serialization/safe_pickle.py); reading tensors imports it.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from megatron_ucp.formats.base import READ_KEYS, CheckpointReader, ShardRef
from megatron_ucp.formats.common import (
    ITERATION_PREFIX, TRACKER_FILENAME, CheckpointFormatError, PickledEnum, resolve_iteration_dir)
from megatron_ucp.formats.legacy import names as legacy_names
from megatron_ucp.formats.torch_dist import names as torch_dist_names


@dataclass(frozen=True)
class ReaderEntry:
    format: str
    module: str  # imported on first use
    cls: str
    detect: Callable[[Path], bool]  # does this iteration folder hold this format?
    data_file: re.Pattern  # the files (relative to the iteration folder) whose bytes hold its tensors

    def reader(self) -> type:
        return getattr(importlib.import_module(self.module), self.cls)


READERS = (
    ReaderEntry("torch_dist", "megatron_ucp.formats.torch_dist.reader", "TorchDistCheckpoint",
                lambda d: (d / torch_dist_names.DCP_METADATA_FILENAME).is_file()
                or (d / torch_dist_names.METADATA_JSON_FILENAME).is_file(),
                torch_dist_names.DATA_FILE),
    ReaderEntry("torch", "megatron_ucp.formats.legacy.reader", "LegacyCheckpoint",
                lambda d: any(p.is_dir() and legacy_names.is_rank_dir_name(p.name) for p in d.iterdir()),
                legacy_names.DATA_FILE),
)


def detect_format(iter_dir: Path) -> ReaderEntry:
    for entry in READERS:
        if entry.detect(iter_dir):
            return entry
    raise CheckpointFormatError(
        f"{iter_dir}: neither a legacy 'torch' checkpoint (mp_rank_* folders) nor a 'torch_dist' one "
        f"(.metadata + metadata.json); it is not a Megatron-LM checkpoint or it is incomplete.")


def is_data_file(rel: str) -> bool:
    """Whether the path `rel` (relative to an iteration folder) is named as a file of tensor bytes of a
    Megatron-LM checkpoint of a known format: the only files a lazy universal checkpoint may read."""
    return any(entry.data_file.fullmatch(rel) for entry in READERS)


def megatron_kind(path: Path) -> Optional[str]:
    """'a Megatron-LM checkpoint (its --save root)' / '... iteration folder' when `path` looks like one, by
    file names only (for messages that tell a user which kind of folder they passed)."""
    try:
        names = {p.name for p in path.iterdir()}
    except OSError:
        return None
    if TRACKER_FILENAME in names or any(n.startswith(ITERATION_PREFIX) for n in names):
        return "a Megatron-LM checkpoint (its --save root)"
    # (metadata.json alone says nothing: a universal checkpoint has one too)
    if names & {torch_dist_names.COMMON_FILENAME, torch_dist_names.DCP_METADATA_FILENAME} or any(
            torch_dist_names.is_distcp_name(n) or legacy_names.is_rank_dir_name(n) for n in names):
        return "a Megatron-LM checkpoint iteration folder"
    return None


def open_checkpoint(path: Union[str, Path], iteration: Optional[int] = None, *,
                    reset_lost_optimizer_state: bool = False, weights_only: bool = False) -> CheckpointReader:
    """Open a Megatron-LM checkpoint root (reads the tracker) or one iter_XXXXXXX folder; never a staging
    directory of an unfinished write, nor a universal checkpoint (said as such). reset_lost_optimizer_state:
    the reader resets optimizer state its writer saved nowhere instead of refusing it; weights_only: the
    optimizer's state is left unread (CheckpointReader)."""
    from megatron_ucp.io.staging import check_not_staging

    check_not_staging(path, error=CheckpointFormatError)
    _refuse_universal(Path(path))
    iter_dir, iteration = resolve_iteration_dir(path, iteration)
    reader = detect_format(iter_dir).reader()(iter_dir, iteration, weights_only=weights_only)
    reader.reset_lost_optimizer_state = bool(reset_lost_optimizer_state)
    return reader


def _refuse_universal(path: Path) -> None:
    import json

    from megatron_ucp.universal.format import COMPLETE_FILENAME as UNIVERSAL_MARKER_FILENAME
    from megatron_ucp.universal.format import FORMAT_NAME as UNIVERSAL_FORMAT

    try:
        marker = json.loads((path / UNIVERSAL_MARKER_FILENAME).read_bytes()[:4096])
    except (OSError, ValueError):
        return
    if isinstance(marker, dict) and marker.get("format") == UNIVERSAL_FORMAT:
        raise CheckpointFormatError(
            f"{path}: is already a universal checkpoint (it has {UNIVERSAL_MARKER_FILENAME}), not a Megatron-LM "
            f"one; use it as it is (from-universal, export-hf, a resume), or pass the Megatron-LM checkpoint it "
            f"was converted from")


__all__ = ["READERS", "READ_KEYS", "CheckpointFormatError", "CheckpointReader", "PickledEnum", "ShardRef",
           "detect_format", "is_data_file", "megatron_kind", "open_checkpoint"]
