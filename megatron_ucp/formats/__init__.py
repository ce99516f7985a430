"""Readers for Megatron-LM checkpoints (legacy `torch` and `torch_dist`): per-rank local shards with
model weights and exact optimizer state, behind one declared interface (`base.CheckpointReader`).

A format registers here with a cheap file-level test; its module is imported only when a checkpoint
of that format is opened. Nothing here imports torch: opening a checkpoint, its shards and its common
state are torch-free (every pickle is parsed by formats/safe_pickle.py); reading tensors imports it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from megatron_ucp.formats.base import READ_KEYS, CheckpointReader, ShardRef
from megatron_ucp.formats.common import CheckpointFormatError, PickledEnum, resolve_iteration_dir


@dataclass(frozen=True)
class ReaderEntry:
    format: str
    module: str  # imported on first use
    cls: str
    detect: Callable[[Path], bool]  # does this iteration folder hold this format?

    def reader(self) -> type:
        return getattr(importlib.import_module(self.module), self.cls)


READERS = (
    ReaderEntry("torch_dist", "megatron_ucp.formats.torch_dist", "TorchDistCheckpoint",
                lambda d: (d / ".metadata").is_file() or (d / "metadata.json").is_file()),
    ReaderEntry("torch", "megatron_ucp.formats.legacy", "LegacyCheckpoint",
                lambda d: any(p.is_dir() and p.name.startswith("mp_rank_") for p in d.iterdir())),
)


def detect_format(iter_dir: Path) -> ReaderEntry:
    for entry in READERS:
        if entry.detect(iter_dir):
            return entry
    raise CheckpointFormatError(
        f"{iter_dir}: neither a legacy 'torch' checkpoint (mp_rank_* folders) nor a 'torch_dist' one "
        f"(.metadata + metadata.json); it is not a Megatron-LM checkpoint or it is incomplete.")


def open_checkpoint(path: Union[str, Path], iteration: Optional[int] = None) -> CheckpointReader:
    """Open a Megatron-LM checkpoint root (reads the tracker) or one iter_XXXXXXX folder."""
    iter_dir, iteration = resolve_iteration_dir(path, iteration)
    return detect_format(iter_dir).reader()(iter_dir, iteration)


__all__ = ["READERS", "READ_KEYS", "CheckpointFormatError", "CheckpointReader", "PickledEnum", "ShardRef",
           "detect_format", "open_checkpoint"]
