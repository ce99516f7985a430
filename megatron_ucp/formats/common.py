"""What every Megatron checkpoint reader shares: errors, loading pickled files through the allow-list
(serialization/safe_pickle.py, with Megatron's PickleFamily: formats/pickles.py), keeping every path inside the checkpoint, args and layout, the common state,
and locating iteration folders. A leaf module: it imports no reader, and not torch (only `load_pickled`,
which gives tensors, imports it).
"""

from __future__ import annotations

import argparse
import enum
import os
import signal
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from megatron_ucp.formats.pickles import MEGATRON, MEGATRON_ENUMS
from megatron_ucp.serialization import safe_pickle
from megatron_ucp.serialization.safe_pickle import (InertRecord, PickledEnum, SafeLoadError, TensorRecord,
                                             TorchDType)
from megatron_ucp.core.layout import LayoutError, ParallelLayout

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
# What a Megatron-LM GPT checkpoint trains in, and what its optimizer state is kept in.
STATE_DTYPE = "float32"


class CheckpointFormatError(ValueError):
    """A checkpoint that cannot be read; the message is one line naming the file, the cause and the fix."""


# ---------------------------------------------------------------------------------------------
# Files: inside the checkpoint, parsed through the allow-list


def inside(root: Path, path: Path) -> Path:
    """`path`, checked to resolve inside the folder `root` (the iteration folder, itself resolved): no `..`,
    no absolute path, no symbolic link out of it, so a checkpoint can only make a reader open its own files."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointFormatError(
            f"{path}: resolves to {real}, outside the checkpoint folder {root}; it was NOT read (a checkpoint may only "
            f"name its own files). Replace the link or path with the real file, copied into the folder.")
    return path


def read_tensor(record: TensorRecord):
    """A saved tensor's values as a new CPU torch tensor (only its bytes are read; the file was checked to hold them
    before anything was allocated); a file changed or shrunk since it was opened is a CheckpointFormatError."""
    try:
        return safe_pickle.to_torch(record)
    except SafeLoadError as e:
        raise CheckpointFormatError(str(e)) from e


def load_archive_file(path: Path, *, what: str, fix: str = "") -> Any:
    """A torch.save file (legacy rank files, common.pt) parsed without torch and without running its code:
    tensors are safe_pickle.TensorRecords (where their bytes are). Every failure is one CheckpointFormatError
    line naming the file; a file whose pickle would run code says so and is not loaded."""
    path = Path(path)
    if not path.is_file():
        if path.is_symlink() or path.exists():
            raise CheckpointFormatError(f"{path}: {what} is not a regular file (a dangling link or a folder); "
                                        f"{fix or 're-copy it from the original checkpoint.'}")
        raise CheckpointFormatError(f"{path}: missing {what}. {fix}".strip())
    try:
        return safe_pickle.load_archive(path, what=what, family=MEGATRON)
    except SafeLoadError as e:
        raise CheckpointFormatError(str(e)) from e


def load_pickled(path: Path, *, what: str, fix: str = "") -> Any:
    """What torch.load(weights_only=True, mmap=True) gives (imports torch): load_archive_file with every tensor
    materialised as a memory-mapped torch tensor (read when touched), dtypes as torch dtypes."""
    tree = load_archive_file(path, what=what, fix=fix)
    try:
        return safe_pickle.materialize(tree)
    except SafeLoadError as e:
        raise CheckpointFormatError(str(e)) from e


def structure_error(path: Any, what: str, found: Any) -> CheckpointFormatError:
    """A file whose content does not have the structure Megatron-LM writes (a key missing, a wrong type)."""
    kind = "nothing" if found is None else f"a {type(found).__name__}"
    return CheckpointFormatError(f"{path}: {what} is missing or malformed (found {kind}); the file is corrupt or was "
                                 f"not written by Megatron-LM's save_checkpoint; re-copy it from the original "
                                 f"checkpoint.")


def entry(container: Any, key: Any, kind: Union[type, tuple], *, path: Any, what: str) -> Any:
    """container[key], checked to exist and to be a `kind`; else structure_error naming `what`."""
    found = container.get(key) if isinstance(container, Mapping) else None
    if not isinstance(found, kind):
        raise structure_error(path, what, found)
    return found


def check_dtype(record: Any, allowed: tuple, *, path: Any, what: str) -> TensorRecord:
    """A saved tensor (a TensorRecord) of one of the `allowed` dtype names; else one line saying what was found."""
    if not isinstance(record, TensorRecord):
        raise structure_error(path, f"{what} (a tensor)", record)
    if record.dtype not in allowed:
        raise CheckpointFormatError(
            f"{path}: {what} is {record.dtype}, expected {' or '.join(allowed)} (what Megatron-LM saves for it); "
            f"the file is corrupt or from another kind of run; re-copy it from the original checkpoint.")
    return record


def scalar(value: Any, *, path: Any, what: str) -> float:
    """A saved number (a Python number or a one-element tensor, e.g. an Adam step), as a float."""
    if isinstance(value, TensorRecord):
        try:
            value = safe_pickle.read_scalar(value)
        except SafeLoadError as e:
            raise CheckpointFormatError(f"{path}: {what}: {e}") from e
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise structure_error(path, f"{what} (a number)", value)
    return float(value)


# ---------------------------------------------------------------------------------------------
# Args, layout, common state

def _plain(value: Any) -> Any:
    """Args as plain values: a Namespace becomes a dict, a torch dtype its spelling 'torch.float32' (as
    metadata.json keeps it), signal numbers signal.Signals, Megatron enums stay PickledEnum (a newer Megatron's
    enum member, loaded as an InertRecord, becomes one too); other inert records stay as they are."""
    if isinstance(value, argparse.Namespace):
        return {k: _plain(v) for k, v in vars(value).items()}
    if isinstance(value, TorchDType) or type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value)
    if isinstance(value, PickledEnum) and value.qualname == "signal.Signals":
        return signal.Signals(value.value)
    if isinstance(value, InertRecord) and value.enum_value is not None:  # a newer Megatron's enum member
        return PickledEnum(value.qualname, value.enum_value)
    if isinstance(value, enum.Enum) and not isinstance(value, int):
        qualname = f"{type(value).__module__}.{type(value).__qualname__}"
        return PickledEnum(qualname, value.value) if qualname in MEGATRON_ENUMS else value
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


_LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "world_size",
                "data_parallel_size", "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                "expert_tensor_parallel_size", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
# args every GPT checkpoint has, as positive integers (the model config is built from them)
_MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads")


def _check_sizes(args: dict, names: tuple, source: Any, *, required: bool) -> None:
    for name in names:
        value = args.get(name)
        if value is None and not required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointFormatError(
                f"{source}: args.{name}={value!r} is not a positive integer; the checkpoint's args are corrupt or it "
                f"was not written by Megatron-LM; re-copy it from the original checkpoint.")


def layout_from_args(args: dict, source: Any = "args") -> ParallelLayout:
    """The parallel layout a Megatron-LM run had (raises CheckpointFormatError for what is unsupported)."""
    _check_sizes(args, _LAYOUT_ARGS, source, required=False)
    if args.get("pipeline_model_parallel_layout"):
        raise CheckpointFormatError(f"{source}: args.pipeline_model_parallel_layout="
                                    f"{args['pipeline_model_parallel_layout']!r}: explicit pipeline layouts are not "
                                    "supported; use --decoder-first/last-pipeline-num-layers or an even split")
    tp = args.get("tensor_model_parallel_size") or 1
    pp = args.get("pipeline_model_parallel_size") or 1
    cp = args.get("context_parallel_size") or 1
    world = args.get("world_size") or tp * pp * cp
    dp = args.get("data_parallel_size")
    if dp and args.get("world_size") and world != tp * pp * cp * dp:
        raise CheckpointFormatError(
            f"{source}: args.world_size={world} is not TP x PP x CP x DP = {tp} x {pp} x {cp} x {dp} (Megatron-LM's "
            f"data_parallel_size excludes CP); the checkpoint's args are corrupt; re-copy it from the original")
    try:
        return ParallelLayout(
            tp=tp, pp=pp, dp=args.get("data_parallel_size") or max(1, world // (tp * pp * cp)),
            vpp=args.get("virtual_pipeline_model_parallel_size"),
            sp=bool(args.get("sequence_parallel")),
            cp=cp,
            # expert sizes mean nothing without experts (Megatron-LM still records ETP = TP in dense runs)
            ep=(args.get("expert_model_parallel_size") or 1) if args.get("num_experts") else 1,
            etp=args.get("expert_tensor_parallel_size") if args.get("num_experts") else None,
            first_stage_layers=args.get("decoder_first_pipeline_num_layers"),
            last_stage_layers=args.get("decoder_last_pipeline_num_layers"),
            embedding_in_split=bool(args.get("account_for_embedding_in_pipeline_split")),
            loss_in_split=bool(args.get("account_for_loss_in_pipeline_split")),
        )
    except LayoutError as e:
        raise CheckpointFormatError(f"{source}: {e}") from e


def optimizer_row(args: dict, source: Any, *, distributed: bool, layer_wise: Optional[str]):
    """The core/optimizers.py row of the optimizer whose state a checkpoint holds (args.optimizer, Adam by default);
    CheckpointFormatError in one line for one whose state is not mapped (yet), and for state a megatron-core release
    cannot have saved (SGD under the distributed optimizer: 0.19's DistributedOptimizer takes Adam or an optimizer
    with an init_state_fn, and its SGD has none). `layer_wise`: why the caller cannot read this checkpoint's
    layer-wise distributed optimizer state (core/optimizers.py), None where it can."""
    from megatron_ucp.core import optimizers

    name = args.get("optimizer", "adam")
    why = optimizers.refusal(name)
    if why is not None:
        raise CheckpointFormatError(f"{source}: args.optimizer={name!r}: {why}")
    if args.get("use_layer_wise_distributed_optimizer"):
        try:
            unmapped = optimizers.layer_wise_refusal(name, args)
        except optimizers.OptimizerNotSupported as e:
            raise CheckpointFormatError(f"{source}: args.optimizer={name!r}: {e}") from None
        if unmapped is not None:
            raise CheckpointFormatError(f"{source}: {unmapped}")
        if layer_wise is not None:
            raise CheckpointFormatError(f"{source}: args.optimizer={name!r}: {layer_wise}")
        distributed = False  # the distributed optimizer of its scalar parameters is the reader's to map
    if distributed and name != "adam":
        raise CheckpointFormatError(
            f"{source}: args.optimizer={name!r} with the distributed optimizer's state; megatron-core 0.19 builds "
            f"{name} without --use-distributed-optimizer only (its DistributedOptimizer asserts Adam or an "
            f"init_state_fn), so megatron-ucp does not read this state; the checkpoint's args do not match its files")
    try:
        optimizers.scalar_optimizer(name, args)
    except optimizers.OptimizerNotSupported as e:
        raise CheckpointFormatError(f"{source}: args.optimizer={name!r}: {e}") from None
    return optimizers.OPTIMIZERS[name]


def model_config_from_args(args: dict, source: Any):
    """The GPT model config of a checkpoint's args, or one CheckpointFormatError naming the file."""
    from megatron_ucp.core.model_config import GPTModelConfig

    _check_sizes(args, _MODEL_ARGS, source, required=True)
    try:
        return GPTModelConfig.from_megatron_args(args)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointFormatError(f"{source}: its args do not describe a GPT model ({e}); the checkpoint is corrupt "
                                    f"or not a Megatron-LM GPT checkpoint.") from e


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

ITERATION_PREFIX = "iter_"


def iteration_dir_name(iteration: int) -> str:
    """Megatron-LM's folder of one saved iteration under the checkpoint root."""
    return f"{ITERATION_PREFIX}{iteration:07d}"


def resolve_iteration_dir(path: Union[str, Path], iteration: Optional[int] = None) -> tuple[Path, int]:
    """(iter_XXXXXXX directory, iteration) for a checkpoint root or an iteration directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointFormatError(f"{path}: no such checkpoint directory; pass the --save directory of a "
                                    f"Megatron-LM run or one of its iter_XXXXXXX folders.")
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: is a file; pass the checkpoint directory that holds "
                                    f"{TRACKER_FILENAME} or an iter_XXXXXXX folder.")
    if path.name.startswith(ITERATION_PREFIX) and not (path / TRACKER_FILENAME).exists():
        try:
            found = int(path.name[len(ITERATION_PREFIX):])
        except ValueError:
            raise CheckpointFormatError(f"{path}: folder name is not iter_<7 digits>.") from None
        if iteration is not None and iteration != found:
            raise CheckpointFormatError(f"{path}: is iteration {found}, not the requested {iteration}; pass the "
                                        f"checkpoint root to choose an iteration.")
        return path, found
    if iteration is None:
        tracker = path / TRACKER_FILENAME
        if not tracker.is_file():
            iters = sorted(p.name for p in path.glob(ITERATION_PREFIX + "*") if p.is_dir())
            hint = f" Found {', '.join(iters)}: pass --iteration N or one of those folders." if iters else ""
            raise CheckpointFormatError(f"{tracker}: missing, so {path} is not a Megatron-LM checkpoint root.{hint}")
        with open(tracker, "rb") as f:  # a number: a few bytes (never read a huge or endless file whole)
            text = f.read(64).decode("utf-8", "replace").strip()
        if text == "release":
            raise CheckpointFormatError(
                f"{tracker}: says 'release' (a converted/released checkpoint in {path / 'release'}); "
                f"iteration, optimizer and scheduler state are absent. Pass --iteration N of a training "
                f"checkpoint instead.")
        try:
            iteration = int(text)
        except ValueError:
            raise CheckpointFormatError(f"{tracker}: holds {text[:40]!r}, expected an iteration number; write the "
                                        f"number of a saved iter_XXXXXXX folder into it, or pass --iteration N."
                                        ) from None
        if iteration < 0:
            raise CheckpointFormatError(f"{tracker}: holds {iteration}, not an iteration; write the number of a saved "
                                        f"iter_XXXXXXX folder into it, or pass --iteration N.")
    iter_dir = path / iteration_dir_name(iteration)
    if not iter_dir.is_dir():
        iters = sorted(p.name for p in path.glob(ITERATION_PREFIX + "*") if p.is_dir())
        raise CheckpointFormatError(f"{iter_dir}: missing; the tracker or --iteration {iteration} points to an "
                                    f"iteration that was not saved (or was deleted); pass --iteration N of a saved one"
                                    f"{' (' + ', '.join(iters) + ')' if iters else ''}.")
    return iter_dir, iteration
