"""Consolidating one parameter: its TP shards (and a tied output-layer copy) -> one fp32 tensor per key.

Both paths validate the shards with the same function (`_validate`: same optimizer tensors on every
rank, an fp32 main weight with the moments, local shapes, one Adam step), then:

- byte path (`place_parameter`): the reader says where each shard's bytes are (`locate`); replicas and
  the tied output-layer copy are compared byte for byte through bounded mmaps, and the consolidated
  tensor is a `byteio.Placement` (blocks from `Pattern.rank_blocks`), copied file to file into the
  output. No tensor is materialised, so memory does not grow with the model.
- tensor path (`consolidate_parameter`: 16-bit weights without optimizer state, --average-replicas,
  or a byte comparison that failed and needs its detailed error): shards are read as tensors and
  consolidated with the pattern.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Optional, Union

from megatron_ucp.io.byteio import FileHandles, Placement, StoredTensor, regions_equal
from megatron_ucp.core.dtypes import dtype_name
from megatron_ucp.convert.tasks import ConversionError, ParamTask
from megatron_ucp.formats import CheckpointReader
from megatron_ucp.core.patterns import Pattern, PatternError, Replicated, check_copies_agree
from megatron_ucp.universal import lazy_entry, write_tensor_file, write_tensor_file_placed

if TYPE_CHECKING:
    import torch

PathLike = Union[str, os.PathLike]


def source_keys(ckpt: CheckpointReader, task: Optional[ParamTask] = None) -> tuple[str, ...]:
    """What to ask the reader for: with optimizer state the fp32 main weight (which is the weight itself in
    fp32 training) and moments, not the model weight; without, and for a persistent buffer (the router's
    expert_bias: no optimizer state), the model weight. The states are the optimizer's, by name (core/optimizers.py)."""
    if ckpt.optimizer_kind == "none" or (task is not None and task.buffer):
        return ("param",)
    return ("fp32", *ckpt.state_keys)


def _step(task: ParamTask, states: list[dict], where: str) -> Optional[int]:
    steps = {float(s["step"]) for s in states if "step" in s}
    if not steps:
        return None
    if len(steps) > 1 or any("step" not in s for s in states):
        raise ConversionError(f"{task.name}: Adam steps disagree across {where}: "
                              f"{[float(s['step']) if 'step' in s else None for s in states]}; the checkpoint is "
                              f"inconsistent")
    step = steps.pop()
    if step != int(step) or step < 0:
        raise ConversionError(f"{task.name}: Adam step {step} is not a non-negative integer")
    return int(step)


def _validate(task: ParamTask, places_states: list[list[dict]]) -> tuple[list[dict[str, list]], Optional[int]]:
    """The one validation of both paths. `places_states[p][t]` is what the reader gave for TP rank t of
    place p (tensors or StoredTensors). Returns, per place, {output key: shards in TP order}, and the
    parameter's Adam step."""
    steps, out = [], []
    for place, states in zip(task.places, places_states):
        where = f"TP ranks of {place[0].local_name} on pp={place[0].pp_rank}"
        keys = [tuple(sorted(k for k in s if k != "param" and k != "step")) for s in states]
        if len(set(keys)) != 1:
            raise ConversionError(f"{task.name}: TP ranks hold different optimizer state {keys}; the checkpoint "
                                  f"is inconsistent")
        if keys[0] and "fp32" not in keys[0]:
            raise ConversionError(f"{task.name}: optimizer state without an fp32 master weight ({keys[0]})")
        steps.append(_step(task, states, where))
        shards = {}
        for key in keys[0] or ("param",):  # no optimizer state: the model weight is the master weight
            values = [s[key] for s in states]
            for value, ref in zip(values, place):
                if tuple(value.shape) != tuple(ref.shape):
                    raise ConversionError(f"{task.name} [{key}] on tp={ref.tp_rank} pp={ref.pp_rank}: shape "
                                          f"{tuple(value.shape)}, expected {tuple(ref.shape)}; the file does not "
                                          f"match its own index")
            shards["fp32" if key == "param" else key] = values
        out.append(shards)
    if len(set(steps)) != 1:
        raise ConversionError(f"{task.name}: Adam steps differ between the embedding and its tied output_layer copy "
                              f"({steps}); the checkpoint is inconsistent")
    return out, steps[0]


def _info(task: ParamTask, step: Optional[int]) -> dict:
    return {"model_dtype": dtype_name(task.places[0][0].dtype), "pattern": task.pattern, "step": step,
            "param_group": task.param_group}


# --------------------------------------------------------------------------------------------------
# Tensor path


def consolidate_parameter(ckpt: CheckpointReader, task: ParamTask, *, average_replicas: bool = False
                          ) -> tuple[dict[str, "torch.Tensor"], dict]:
    """Read the parameter's shards and return ({'fp32', and the optimizer's states by name} global fp32 tensors,
    info)."""
    import torch

    keys = source_keys(ckpt, task)
    places, step = _validate(task, [[ckpt.read(ref, keys=keys) for ref in place] for place in task.places])
    copies = []
    for place, shards_by_key in zip(task.places, places):
        tensors = {}
        for key, shards in shards_by_key.items():
            label = f"{task.name} [{key}] ({place[0].local_name} on pp={place[0].pp_rank})"
            try:
                if isinstance(task.pattern, Replicated) and not average_replicas:
                    check_copies_agree(shards, name=label, labels=[
                        f"TP rank {ref.tp_rank} ({_shard_file(ckpt, ref, key, keys)})" for ref in place])
                if isinstance(task.pattern, Replicated):
                    full = task.pattern.consolidate(shards, name=label, check=False, average=average_replicas)
                else:
                    full = task.pattern.consolidate(shards, name=label)
            except PatternError as e:
                raise ConversionError(_replicas_differ(e) if "average=True" in str(e) else str(e)) from e
            tensors[key] = full.to(torch.float32)
        copies.append(tensors)
    tensors = copies[0]
    if len(copies) > 1:  # tied embedding: the last stage's output_layer must be the same tensor
        labels = [f"pp={p[0].pp_rank} {p[0].local_name}" for p in task.places]
        for key in tensors:
            values = [c[key] for c in copies]
            if average_replicas:
                tensors[key] = torch.stack([v.to(torch.float64) for v in values]).mean(0).to(torch.float32)
                continue
            try:
                check_copies_agree(values, name=f"{task.name} [{key}] (tied)", labels=[
                    f"{label} ({', '.join(_shard_file(ckpt, ref, key, keys) for ref in place)})"
                    for label, place in zip(labels, task.places)])
            except PatternError as e:
                raise ConversionError(_replicas_differ(e, "the tied output_layer copy differs from the embedding")
                                      ) from e
    for key, value in tensors.items():
        if tuple(value.shape) != task.shape:
            raise ConversionError(f"{task.name} [{key}]: consolidated shape {tuple(value.shape)}, expected {task.shape}")
    return tensors, _info(task, step)


def _shard_file(ckpt: CheckpointReader, ref, key: str, keys: tuple[str, ...]) -> str:
    """The file holding `ref`'s `key` (output key) for messages, or where it is when the reader cannot say."""
    try:
        located = ckpt.locate(ref, keys=keys) or {}
        stored = located.get("param" if keys == ("param",) else key)
        return stored.regions[0].path
    except Exception:  # noqa: BLE001 - a message's detail only
        return f"tp={ref.tp_rank} pp={ref.pp_rank}"


def _replicas_differ(e: PatternError, what: str = "") -> str:
    """Copies that must be equal are not: a damaged copy is restored, not averaged (the mean keeps the damage)."""
    cause = str(e).split("; the checkpoint is inconsistent")[0]
    return (f"{cause}{'; ' + what if what else ''}; if a copy was damaged (a flipped bit, a bad disk), restore the "
            f"checkpoint from a copy (averaging would keep the damage); only for replicas that drifted apart in "
            f"training, --average-replicas stores their mean")


# --------------------------------------------------------------------------------------------------
# Byte path


def placement_for(pattern: Pattern, shape: tuple[int, ...], shards: list[StoredTensor]) -> Placement:
    """How the global tensor is assembled from its TP shards: every rank's pattern blocks (one copy of a
    replicated tensor: the caller checked the copies agree)."""
    tp = len(shards)
    ranks = [0] if pattern.dim is None else range(tp)
    blocks = tuple(b for rank in ranks for b in pattern.rank_blocks(shape, rank, tp))
    return Placement(tuple(shape), shards[0].dtype, tuple(shards), blocks)


def place_parameter(ckpt: CheckpointReader, task: ParamTask, files: FileHandles
                    ) -> Optional[tuple[dict[str, Placement], dict]]:
    """consolidate_parameter without reading tensors: where each consolidated tensor's bytes are in the
    source files, with replicas and the tied output-layer copy compared byte for byte (bounded mmaps).
    None when the reader cannot say where the bytes are, a tensor is not float32, or a byte comparison
    fails: consolidate_parameter then does the work (and reports a failure with its details)."""
    keys = source_keys(ckpt, task)
    located = [[ckpt.locate(ref, keys=keys) for ref in place] for place in task.places]
    if any(s is None for states in located for s in states):
        return None
    places, step = _validate(task, located)
    placed = []
    for shards_by_key in places:
        out = {}
        for key, shards in shards_by_key.items():
            if any(dtype_name(sh.dtype) != "float32" for sh in shards):
                return None
            if isinstance(task.pattern, Replicated) and not all(
                    regions_equal(files, shards[0].regions, sh.regions) for sh in shards[1:]):
                return None
            out[key] = placement_for(task.pattern, task.shape, shards)
        placed.append(out)
    for copy in placed[1:]:  # tied embedding: the last stage's output_layer must be the same bytes
        for key, placement in placed[0].items():
            a, b = placement.regions(), copy[key].regions()
            if a is None or b is None or not regions_equal(files, a, b):
                return None
    info = _info(task, step)
    zeroed = [[ckpt.zeroed(ref, keys) for ref in place] for place in task.places]
    if any(z for place in zeroed for z in place):
        if len(task.places) > 1:
            return None  # a tied copy with reset elements: the tensor path compares the values
        # elements reset to zero whatever their located bytes hold (CheckpointReader.zeroed), in global coordinates
        info["zeroed"] = {key: zeroed_runs(placement, [z.get(key, ()) for z in zeroed[0]])
                          for key, placement in placed[0].items() if any(z.get(key) for z in zeroed[0])}
    return placed[0], info


def zeroed_runs(placement: Placement, shard_runs: list) -> list[list[int]]:
    """[[start, length], ...]: the elements (flat, C order of the global tensor) that the runs `shard_runs[t]`
    (start, length; flat in TP shard t) of the shards become through the placement's blocks."""
    import numpy

    found = []
    for block in placement.blocks:
        runs = shard_runs[block.shard]
        if not runs:
            continue
        flat = numpy.concatenate([numpy.arange(start, start + length) for start, length in runs])
        coords = numpy.unravel_index(flat, placement.shards[block.shard].shape)
        inside = numpy.ones(flat.shape, dtype=bool)
        for c, r in zip(coords, block.src):
            inside &= (c >= r.start) & (c < r.stop)
        dst = tuple(c[inside] - r.start + d.start for c, r, d in zip(coords, block.src, block.dst))
        found.append(numpy.ravel_multi_index(dst, placement.shape))
    elements = numpy.unique(numpy.concatenate(found)) if found else numpy.empty(0, dtype=numpy.int64)
    out: list[list[int]] = []
    for e in elements.tolist():
        if out and out[-1][0] + out[-1][1] == e:
            out[-1][1] += 1
        else:
            out.append([e, 1])
    return out


# --------------------------------------------------------------------------------------------------


def convert_parameter(ckpt: CheckpointReader, task: ParamTask, staging_dir: PathLike, *,
                      average_replicas: bool = False, lazy: bool = False, check_finite: bool = False) -> dict:
    """Consolidate one parameter and write its file into the staging directory; returns its metadata entry.
    Bytes go file to file when the reader can locate them (place_parameter), else through tensors.
    lazy: write nothing, return an entry that says where the bytes are in the source (lazy_entry).
    check_finite: refuse NaN/Inf in what is written (tensorfile.NonFiniteTensorError)."""
    if lazy:
        with FileHandles() as files:
            placed = place_parameter(ckpt, task, files)
        if placed is None:
            consolidate_parameter(ckpt, task)  # raises the detailed error when a check failed
            raise ConversionError(f"{task.name}: stored in a way a lazy checkpoint cannot reference in place (e.g. "
                                  f"16-bit weights without optimizer state, or the fp32 main weights of a 16-bit run "
                                  f"reset from its weights); convert without --lazy")
        return lazy_entry(task.name, placed[0], placed[1], ckpt.path)
    if not average_replicas:  # averaging computes new values: tensors needed
        with FileHandles() as files:
            placed = place_parameter(ckpt, task, files)
            if placed is not None and "zeroed" not in placed[1]:  # reset elements: the tensor path writes zeros
                return write_tensor_file_placed(staging_dir, task.name, placed[0], placed[1], files,
                                                check_finite=check_finite)
    tensors, info = consolidate_parameter(ckpt, task, average_replicas=average_replicas)
    return write_tensor_file(staging_dir, task.name, tensors, info, check_finite=check_finite)
