"""What every Megatron checkpoint reader shares: errors, safe unpickling, args and layout, the common
state, and locating iteration folders. A leaf module: it imports no reader."""

from __future__ import annotations

import argparse
import contextlib
import enum
import pathlib
import signal
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_ucp.layout import ParallelLayout

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


class CheckpointFormatError(ValueError):
    """A checkpoint that cannot be read; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------------
# Safe unpickling

@dataclass(frozen=True)
class PickledEnum:
    """A Megatron enum member found in pickled args, kept as (class path, value) without importing
    megatron (e.g. args.attention_backend = PickledEnum('megatron.core.transformer.enums.AttnBackend', 5))."""

    qualname: str
    value: Any


def _enum_stand_in(qualname: str):
    """A callable that unpickles `Enum(value)` for the class named `qualname` as a PickledEnum."""

    def rebuild(value):
        return PickledEnum(qualname, value)

    rebuild.__name__ = qualname.rsplit(".", 1)[1]
    return rebuild


# Megatron-LM pickles these enums inside `args` (see megatron/core/safe_globals.py for its own list).
_MEGATRON_ENUMS = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
)


def _safe_globals() -> list:
    import numpy

    allowed: list = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals,
                     numpy.ndarray, numpy.dtype]
    # numpy arrays in RNG states pickle `_reconstruct` and dtype classes under numpy-version paths.
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    allowed += [(_reconstruct, "numpy._core.multiarray._reconstruct"),
                (_reconstruct, "numpy.core.multiarray._reconstruct")]
    import numpy.dtypes as npd

    allowed += [getattr(npd, n) for n in ("UInt32DType", "Int64DType", "Float64DType") if hasattr(npd, n)]
    allowed += [(_enum_stand_in(q), q) for q in _MEGATRON_ENUMS]
    allowed.append(PickledEnum)  # args re-saved by our own tools
    return allowed


_UNPICKLING = threading.RLock()


@contextlib.contextmanager
def safe_unpickling():
    """Allow exactly the classes Megatron-LM checkpoints pickle (never weights_only=False). torch keeps
    that allow-list process-wide and restores it on exit, so unpickling threads take turns (a lock):
    loads are pickles and mmaps, quick."""
    with _UNPICKLING, torch.serialization.safe_globals(_safe_globals()):
        yield


def load_pickled(path: Path, *, what: str, fix: str = "") -> Any:
    """torch.load(weights_only=True, mmap=True) with Megatron's allow-list; tensors stay on disk
    until touched. Every failure becomes a CheckpointFormatError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: missing {what}. {fix}".strip())
    try:
        with safe_unpickling():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated zip, bad pickle, disallowed global
        text = str(e)
        blocked = next((line.strip() for line in text.splitlines() if "Unsupported global" in line), None)
        if blocked:
            raise CheckpointFormatError(
                f"{path}: cannot read {what}: it pickles a class outside the allow-list ({blocked[:300]}). "
                f"Only plain Megatron-LM checkpoints can be read safely.") from e
        raise CheckpointFormatError(
            f"{path}: cannot read {what} ({type(e).__name__}: {text.splitlines()[0][:300] if text else ''}); "
            f"the file is truncated, corrupt or not a torch.save file. "
            f"{fix or 'Re-copy it from the original checkpoint.'}") from e


def load_pickled_bytes(data, *, what: str) -> Any:
    """Unpickle a torch.save'd object held in memory (DCP BytesIO items)."""
    try:
        with safe_unpickling():
            return torch.load(data, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointFormatError(f"cannot unpickle {what}: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Args, layout, common state

def _plain(value: Any) -> Any:
    if isinstance(value, argparse.Namespace):
        return {k: _plain(v) for k, v in vars(value).items()}
    if isinstance(value, enum.Enum) and not isinstance(value, int):
        return PickledEnum(f"{type(value).__module__}.{type(value).__qualname__}", value.value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def args_to_dict(args: Any, *, source: Path) -> dict:
    if isinstance(args, argparse.Namespace):
        return _plain(args)
    if isinstance(args, dict):
        return _plain(args)
    raise CheckpointFormatError(f"{source}: 'args' is {type(args).__name__}, expected an argparse.Namespace "
                                f"written by Megatron-LM's save_checkpoint.")


# Megatron-LM args that make pipeline stages uneven (not supported by the rulebook's placement yet).
UNEVEN_PIPELINE_ARGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                        "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                        "account_for_loss_in_pipeline_split")


def layout_from_args(args: dict) -> ParallelLayout:
    """The parallel layout a Megatron-LM run had (raises CheckpointFormatError for what is unsupported)."""
    uneven = [name for name in UNEVEN_PIPELINE_ARGS if args.get(name)]
    if uneven:
        raise CheckpointFormatError(f"args.{uneven[0]}={args[uneven[0]]!r}: uneven pipeline splits are not "
                                    f"supported yet; convert a checkpoint saved with evenly split stages")
    tp = args.get("tensor_model_parallel_size") or 1
    pp = args.get("pipeline_model_parallel_size") or 1
    cp = args.get("context_parallel_size") or 1
    world = args.get("world_size") or tp * pp * cp
    return ParallelLayout(
        tp=tp, pp=pp, dp=args.get("data_parallel_size") or world // (tp * pp * cp),
        vpp=args.get("virtual_pipeline_model_parallel_size"),
        sp=bool(args.get("sequence_parallel")),
        ep=args.get("expert_model_parallel_size") or 1,
        etp=args.get("expert_tensor_parallel_size"),
    )


def hyper_parameters(param_groups: list) -> list[dict]:
    """Optimizer param groups without the parameter index lists."""
    return [{k: v for k, v in g.items() if k != "params"} for g in param_groups]


def build_common_state(*, iteration: int, args: dict, checkpoint_version: Any, opt_param_scheduler: Any,
                       param_groups: Optional[list], num_flops: Any) -> dict:
    state = {
        "iteration": iteration,
        "consumed_train_samples": args.get("consumed_train_samples", 0),
        "consumed_valid_samples": args.get("consumed_valid_samples", 0),
        "opt_param_scheduler": opt_param_scheduler,
        "param_groups": hyper_parameters(param_groups) if param_groups is not None else None,
        "checkpoint_version": checkpoint_version,
    }
    if num_flops is not None:
        state["num_floating_point_operations_so_far"] = num_flops
    return state


# ---------------------------------------------------------------------------------------------
# Locating and opening checkpoints

def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def resolve_iteration_dir(path: Union[str, Path], iteration: Optional[int] = None) -> tuple[Path, int]:
    """(iter_XXXXXXX directory, iteration) for a checkpoint root or an iteration directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointFormatError(f"{path}: no such checkpoint directory; pass the --save directory of a "
                                    f"Megatron-LM run or one of its iter_XXXXXXX folders.")
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: is a file; pass the checkpoint directory that holds "
                                    f"{TRACKER_FILENAME} or an iter_XXXXXXX folder.")
    if path.name.startswith("iter_") and not (path / TRACKER_FILENAME).exists():
        try:
            found = int(path.name[len("iter_"):])
        except ValueError:
            raise CheckpointFormatError(f"{path}: folder name is not iter_<7 digits>.") from None
        if iteration is not None and iteration != found:
            raise CheckpointFormatError(f"{path}: is iteration {found}, not the requested {iteration}; pass the "
                                        f"checkpoint root to choose an iteration.")
        return path, found
    if iteration is None:
        tracker = path / TRACKER_FILENAME
        if not tracker.is_file():
            iters = sorted(p.name for p in path.glob("iter_*") if p.is_dir())
            hint = f" Found {', '.join(iters)}: pass iteration=N or one of them." if iters else ""
            raise CheckpointFormatError(f"{tracker}: missing, so {path} is not a Megatron-LM checkpoint root.{hint}")
        text = tracker.read_text().strip()
        if text == "release":
            raise CheckpointFormatError(
                f"{tracker}: says 'release' (a converted/released checkpoint in {path / 'release'}); "
                f"iteration, optimizer and scheduler state are absent. Pass iteration=N of a training "
                f"checkpoint instead.")
        try:
            iteration = int(text)
        except ValueError:
            raise CheckpointFormatError(f"{tracker}: holds {text!r}, expected an iteration number.") from None
    iter_dir = path / iteration_dir_name(iteration)
    if not iter_dir.is_dir():
        raise CheckpointFormatError(f"{iter_dir}: missing; the tracker or iteration={iteration} points to an "
                                    f"iteration that was not saved (or was deleted).")
    return iter_dir, iteration
