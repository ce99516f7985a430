"""What the commands share: opening any checkpoint this project reads (`open_any`: universal, Megatron-LM
`torch` or `torch_dist`, a root or an iteration folder; a staging directory of an unfinished or killed write
is refused whatever it holds), telling them apart, and the text tables and byte counts they print. Commands
import these from here, never from one another."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

from megatron_ucp.formats import megatron_kind, open_checkpoint
from megatron_ucp.formats.common import ITERATION_PREFIX, TRACKER_FILENAME
from megatron_ucp.io.staging import check_not_staging

PathLike = Union[str, os.PathLike]
UNIVERSAL = "universal"


class NotACheckpointError(ValueError):
    """A path that is no checkpoint this tool reads; the message names the path and the fix."""


def _looks_universal(path: Path) -> bool:
    from megatron_ucp.universal import COMPLETE_FILENAME, FORMAT_NAME, METADATA_FILENAME, TENSORS_DIRNAME

    if (path / COMPLETE_FILENAME).is_file() or (path / TENSORS_DIRNAME).is_dir():
        return True
    meta = path / METADATA_FILENAME
    if meta.is_file():  # torch_dist iteration folders have a metadata.json too: look at its format
        try:
            return json.loads(meta.read_text()).get("format") == FORMAT_NAME
        except (ValueError, AttributeError, OSError):
            return False
    return False


def open_any(path: PathLike, iteration: Optional[int] = None, *, validate: bool = True):
    """A UniversalCheckpoint or a MegatronCheckpoint for `path` (see the module docstring); a universal one
    validated (UniversalCheckpoint.open) unless the caller lists its problems itself (`validate=False`)."""
    path = Path(path)
    check_not_staging(path, error=NotACheckpointError)
    if not path.exists():
        raise NotACheckpointError(f"{path}: no such file or directory; pass a universal checkpoint directory, a "
                                  f"Megatron-LM --save directory or one of its iter_XXXXXXX folders")
    if not path.is_dir():
        raise NotACheckpointError(f"{path}: is a file, not a checkpoint directory; pass the directory that holds "
                                  f"it (a universal checkpoint, a Megatron-LM --save root or an iter_XXXXXXX folder)")
    if _looks_universal(path):
        from megatron_ucp.universal import UniversalCheckpoint

        ucp = UniversalCheckpoint.open(path, validate=validate)
        if iteration is not None and iteration != ucp.iteration:
            raise NotACheckpointError(f"{path}: a universal checkpoint holds one iteration ({ucp.iteration}), not "
                                      f"the requested --iteration {iteration}; drop --iteration")
        return ucp
    if not path.name.startswith(ITERATION_PREFIX) and megatron_kind(path) is None:
        raise NotACheckpointError(
            f"{path}: not a checkpoint: no COMPLETE/metadata.json (universal), no {TRACKER_FILENAME} or "
            f"iter_XXXXXXX folders (Megatron-LM); pass the DST of `megatron-ucp to-universal` or a Megatron-LM "
            f"--save directory")
    return open_checkpoint(path, iteration)


def is_universal(ckpt) -> bool:
    from megatron_ucp.universal import UniversalCheckpoint

    return isinstance(ckpt, UniversalCheckpoint)


def checkpoint_format(ckpt) -> str:
    return UNIVERSAL if is_universal(ckpt) else ckpt.format


def text_table(header: tuple, rows: list) -> list[str]:
    """Left-aligned columns (two spaces apart), sized to fit every row: the header line, then one per row."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip()] + [fmt.format(*r).rstrip() for r in rows]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def universal_problems(ucp) -> list[str]:
    """What a universal checkpoint's metadata and file sizes show to be wrong, one line each (the format's one
    validation, `UniversalCheckpoint.problems`): what from-universal and a resume refuse. No tensor byte is
    read (`megatron-ucp check` reads them all)."""
    return ucp.problems()


def add_publication_flags(p, output: str, marker: str) -> None:
    """--overwrite and --clean-stale, as every command that publishes a directory through io/staging.py takes
    them: `output` names what DST holds ("universal checkpoint"), `marker` the file that says this tool wrote it."""
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace an existing {output} at DST (only one megatron-ucp wrote: it has {marker})")
    p.add_argument("--clean-stale", action="store_true",
                   help="remove leftovers of killed writes to DST (DST.partial-*, DST.old-*), which are otherwise "
                        "only reported")


def add_target_layout_arguments(p, *, tp_required: bool) -> None:
    """The target layout's flags, spelled as Megatron-LM spells them (from-universal writes at it, plan checks it):
    TP, PP, DP, CP, VPP, EP, ETP, the distributed optimizer, sequence parallelism and the uneven pipeline split."""
    from megatron_ucp.core.placement import add_split_arguments

    p.add_argument("-t", "--tensor-model-parallel-size", type=int, required=tp_required,
                   **({} if tp_required else {"default": 1}))
    p.add_argument("-p", "--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("-d", "--data-parallel-size", type=int, default=1)
    p.add_argument("-c", "--context-parallel-size", type=int, default=1,
                   help="CP: ranks sharing each sequence (2*CP must divide the sequence length); world = TP x PP x CP "
                        "x DP, the distributed optimizer shards over DP x CP")
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP (models with experts): must divide num_experts; carved out of TP x CP x DP")
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="ETP (default: TP)")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--sequence-parallel", action="store_true")
    add_split_arguments(p)
