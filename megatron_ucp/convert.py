"""Megatron-LM checkpoint -> universal checkpoint (the `to-universal` conversion).

Planning and I/O are separate: `plan_parameters` groups the source's shards by canonical parameter
and checks completeness before any tensor is read. Each parameter then becomes one safetensors file:

- fast path (`place_parameter`): the reader says where each shard's bytes are in its files
  (`locate`, formats/stored.py); replicas and the tied output-layer copy are compared byte for byte
  in bounded chunks, and the consolidated tensors' bytes are copied file to file into the output
  (copy_file_range, as `cp` does; row-interleaved TP shards through mmaps). No tensor is
  materialised, so memory does not grow with the model.
- otherwise (`consolidate_parameter`: 16-bit weights without optimizer state, --average-replicas, a
  check that failed and needs its detailed error): shards are read as tensors, consolidated with the
  pattern, checked and written.

Parameters are independent, so threads convert them in parallel, sharing the opened checkpoint; under
torchrun the processes split the parameters. Only the bytes the universal checkpoint stores are
read: with optimizer state the fp32 master weight and moments, not the model weight.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import enum
import functools
import inspect
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from tqdm import tqdm

from megatron_ucp.adapters.gpt import (
    UnknownParameterError, canonical_name, expected_parameters, local_name, pattern_for)
from megatron_ucp.formats import MegatronCheckpoint, ShardRef, open_checkpoint
from megatron_ucp.formats.bucket_layout import BufferParam
from megatron_ucp.formats.common import PickledEnum
from megatron_ucp.formats.legacy import megatron_param_groups
from megatron_ucp.layout import LayoutError
from megatron_ucp.patterns import Pattern, PatternError, Replicated, check_copies_agree
from megatron_ucp.formats.stored import Block, FileHandles, Placement, StoredTensor, regions_equal
from megatron_ucp.universal import (
    TENSORS_DIRNAME, UniversalWriter, check_destination, dtype_name, lazy_entry, source_file_stats, write_tensor_file,
    write_tensor_file_placed)

PathLike = Union[str, os.PathLike]
OPTIMIZER_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
# Keys that decide which Megatron param group a parameter belongs to (megatron-core's ParamKey fields).
GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


class ConversionError(ValueError):
    """The source cannot be converted as asked; the message names the checkpoint, the parameter and the fix."""


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


# --------------------------------------------------------------------------------------------------
# Plan


@dataclass(frozen=True)
class ParamTask:
    """Everything needed to convert one canonical parameter, without tensors.

    `places` holds, per place the model keeps the parameter (one; two for a tied embedding whose last
    pipeline stage keeps `output_layer.weight`), the TP shards in tp_rank order."""

    name: str
    shape: tuple[int, ...]
    pattern: Pattern
    places: tuple[tuple[ShardRef, ...], ...]
    param_group: dict

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4  # fp32 per stored tensor


def _param_groups(ckpt: MegatronCheckpoint, refs: list[ShardRef], saved: Optional[list]) -> dict:
    """(tp, pp, chunk, local name) -> param_group entry, by Megatron's grouping rule (no weight decay for
    biases and 1-D params, decoupled LR for embedding/output), checked against the saved groups."""
    rank_chunks: dict[tuple[int, int], list[list[BufferParam]]] = {}
    for ref in refs:
        chunks = rank_chunks.setdefault((ref.tp_rank, ref.pp_rank), [])
        while len(chunks) <= ref.vpp_chunk:
            chunks.append([])
        chunks[ref.vpp_chunk].append(BufferParam(ref.local_name, ref.shape, ref.dtype))
    groups_by_rank = megatron_param_groups(rank_chunks, ckpt.args)
    out: dict = {}
    for (tp_rank, pp_rank), groups in groups_by_rank.items():
        if saved is not None and len(groups) != len(saved):
            raise ConversionError(
                f"{ckpt.path}: the optimizer has {len(saved)} param groups but Megatron's grouping rule gives "
                f"{len(groups)} for rank tp={tp_rank} pp={pp_rank}; custom param-group overrides are not supported")
        for index, members in enumerate(groups):
            for chunk, name in members:
                out[(tp_rank, pp_rank, chunk, name)] = index
    # Each group's identity, from the saved groups when present, else from the rule's override.
    keys = _group_overrides(ckpt, rank_chunks)
    entries = {}
    for index, override in enumerate(keys):
        rule = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
        rule.update({k: v for k, v in (override or ()) if k in rule})
        if override and any(k in ("max_lr", "min_lr") for k, _ in override):
            rule["is_decoupled_lr"] = True
        if saved is None:
            entries[index] = rule
            continue
        group = saved[index]
        if float(group.get("wd_mult", 1.0)) != float(rule["wd_mult"]):
            raise ConversionError(
                f"{ckpt.path}: optimizer param group {index} has wd_mult={group.get('wd_mult')} but Megatron's "
                f"grouping rule puts parameters with wd_mult={rule['wd_mult']} there; the checkpoint was written "
                f"with custom param-group overrides, which are not supported")
        entries[index] = {"index": index, **{k: group[k] for k in GROUP_IDENTITY if k in group}}
    return {place: entries[index] for place, index in out.items()}


def _group_overrides(ckpt: MegatronCheckpoint, rank_chunks) -> list:
    """The sorted override keys megatron_param_groups orders its groups by (None = no override)."""
    from megatron_ucp.formats.legacy import _override_key, _is_embedding_or_output  # the same rule, not a copy

    pp = ckpt.layout.pp
    found = set()
    for (_, pp_rank), chunks in rank_chunks.items():
        for chunk, params in enumerate(chunks):
            pre, post = pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == len(chunks) - 1
            for p in params:
                found.add(_override_key(p.name, p.shape, ckpt.args,
                                        _is_embedding_or_output(p.name, pre_process=pre, post_process=post)))
    return sorted(found, key=lambda k: (k is not None, k or ()))


def plan_parameters(ckpt: MegatronCheckpoint) -> list[ParamTask]:
    """One task per canonical parameter, in registration order; raises ConversionError unless every
    expected parameter is present exactly once, on every TP rank, with its expected local shape."""
    config, layout = ckpt.config, ckpt.layout
    try:
        expected = dict(expected_parameters(config, layout))
    except (LayoutError, NotImplementedError, ValueError) as e:
        raise ConversionError(f"{ckpt.path}: {e}") from e
    refs = ckpt.shards()
    placed: dict[str, dict[tuple[int, int, str], dict[int, ShardRef]]] = {}
    for ref in refs:
        try:
            name = canonical_name(ref.local_name, layout, ref.pp_rank, ref.vpp_chunk, config.num_layers,
                                  tied=config.tied)
        except (UnknownParameterError, LayoutError) as e:
            raise ConversionError(f"{ckpt.path}: rank tp={ref.tp_rank} pp={ref.pp_rank}: {e}") from e
        if name is None:
            continue
        if name not in expected:
            raise ConversionError(f"{ckpt.path}: {ref.local_name!r} on tp={ref.tp_rank} pp={ref.pp_rank} is "
                                  f"{name!r}, which the model config ({config.num_layers} layers, "
                                  f"{config.normalization}, bias={config.add_bias_linear}) does not have")
        by_tp = placed.setdefault(name, {}).setdefault((ref.pp_rank, ref.vpp_chunk, ref.local_name), {})
        if ref.tp_rank in by_tp:
            raise ConversionError(f"{ckpt.path}: {ref.local_name!r} appears twice on tp={ref.tp_rank} "
                                  f"pp={ref.pp_rank} chunk={ref.vpp_chunk}")
        by_tp[ref.tp_rank] = ref
    missing = [n for n in expected if n not in placed]
    if missing:
        raise ConversionError(f"{ckpt.path}: missing parameters {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                              f"the checkpoint is incomplete or does not match its args")
    common = ckpt.common_state()
    groups = _param_groups(ckpt, refs, common.get("param_groups"))
    tasks = []
    for name, shape in expected.items():
        pattern = pattern_for(name, config)
        local_shape = pattern.local_shape(shape, layout.tp, name=name)
        want_places = [(pp, chunk, local) for pp, chunk, local in
                       local_name(name, layout, config.num_layers, tied=config.tied)]
        if sorted(placed[name]) != sorted(want_places):
            raise ConversionError(f"{ckpt.path}: {name} is stored at {sorted(placed[name])} (pp, chunk, name) but "
                                  f"{layout.describe()} keeps it at {want_places}")
        places = []
        for place in want_places:
            by_tp = placed[name][place]
            if sorted(by_tp) != list(range(layout.tp)):
                raise ConversionError(f"{ckpt.path}: {name} ({place[2]} on pp={place[0]}) has shards for TP ranks "
                                      f"{sorted(by_tp)}, expected 0..{layout.tp - 1}")
            for ref in by_tp.values():
                if tuple(ref.shape) != local_shape:
                    raise ConversionError(f"{ckpt.path}: {name} on tp={ref.tp_rank} pp={ref.pp_rank} has shape "
                                          f"{tuple(ref.shape)}, expected {local_shape} ({pattern.to_json()} of "
                                          f"{shape} over TP={layout.tp}); args and weights disagree")
            places.append(tuple(by_tp[t] for t in range(layout.tp)))
        group_entries = [groups[(r.tp_rank, r.pp_rank, r.vpp_chunk, r.local_name)] for p in places for r in p]
        if any(g != group_entries[0] for g in group_entries):
            raise ConversionError(f"{ckpt.path}: {name} is in different optimizer param groups on different ranks "
                                  f"({group_entries}); the checkpoint is inconsistent")
        tasks.append(ParamTask(name, tuple(shape), pattern, tuple(places), group_entries[0]))
    return tasks


# --------------------------------------------------------------------------------------------------
# Consolidate one parameter


def _step(task: ParamTask, states: list[dict], where: str) -> Optional[int]:
    steps = {float(s["step"]) for s in states if "step" in s}
    if not steps:
        return None
    if len(steps) > 1 or len(steps) == 1 and any("step" not in s for s in states):
        raise ConversionError(f"{task.name}: Adam steps disagree across {where}: "
                              f"{[float(s['step']) if 'step' in s else None for s in states]}; the checkpoint is "
                              f"inconsistent")
    step = steps.pop()
    if step != int(step) or step < 0:
        raise ConversionError(f"{task.name}: Adam step {step} is not a non-negative integer")
    return int(step)


def _read_shard(ckpt: MegatronCheckpoint, ref: ShardRef) -> dict[str, torch.Tensor]:
    """ckpt.read(ref), asking a reader that can skip tensors (one with a `keys` argument) only for what the
    universal checkpoint stores: with optimizer state its fp32 master weight (which is the weight itself
    in fp32 training) and moments, not the model weight; without, the model weight."""
    if not _reads_keys(type(ckpt)):
        return ckpt.read(ref)
    return ckpt.read(ref, keys=("param",) if ckpt.optimizer_kind == "none" else OPTIMIZER_KEYS)


@functools.lru_cache(maxsize=None)
def _reads_keys(reader: type) -> bool:
    return "keys" in inspect.signature(reader.read).parameters


def consolidate_parameter(ckpt: MegatronCheckpoint, task: ParamTask, *, average_replicas: bool = False
                          ) -> tuple[dict[str, torch.Tensor], dict]:
    """Read the parameter's shards and return ({'fp32', 'exp_avg', 'exp_avg_sq'} global fp32 tensors, info)."""
    copies: list[dict[str, torch.Tensor]] = []
    steps: list[Optional[int]] = []
    for place in task.places:
        states = [_read_shard(ckpt, ref) for ref in place]
        where = f"TP ranks of {place[0].local_name} on pp={place[0].pp_rank}"
        keys = [tuple(sorted(k for k in s if k in OPTIMIZER_KEYS)) for s in states]
        if len(set(keys)) != 1:
            raise ConversionError(f"{task.name}: TP ranks hold different optimizer state {keys}; the checkpoint "
                                  f"is inconsistent")
        wanted = keys[0] or ("param",)  # no optimizer state: the model weight is the master weight
        if keys[0] and "fp32" not in keys[0]:
            raise ConversionError(f"{task.name}: optimizer state without an fp32 master weight ({keys[0]})")
        steps.append(_step(task, states, where))
        place_tensors = {}
        for key in wanted:
            shards = [s[key] for s in states]
            label = f"{task.name} [{key}] ({place[0].local_name} on pp={place[0].pp_rank})"
            try:
                if isinstance(task.pattern, Replicated):
                    full = task.pattern.consolidate(shards, name=label, check=not average_replicas,
                                                    average=average_replicas)
                else:
                    full = task.pattern.consolidate(shards, name=label)
            except PatternError as e:
                raise ConversionError(f"{e} (CLI: --average-replicas)" if "average=True" in str(e) else str(e)) from e
            place_tensors["fp32" if key == "param" else key] = full.to(torch.float32)
        copies.append(place_tensors)
        del states
    if len(set(steps)) != 1:
        raise ConversionError(f"{task.name}: Adam steps differ between the embedding and its tied output_layer copy "
                              f"({steps}); the checkpoint is inconsistent")
    tensors = copies[0]
    if len(copies) > 1:  # tied embedding: the last stage's output_layer must be the same tensor
        labels = [f"pp={p[0].pp_rank} {p[0].local_name}" for p in task.places]
        for key in tensors:
            values = [c[key] for c in copies]
            if average_replicas:
                tensors[key] = torch.stack([v.to(torch.float64) for v in values]).mean(0).to(torch.float32)
                continue
            try:
                check_copies_agree(values, name=f"{task.name} [{key}] (tied)", labels=labels)
            except PatternError as e:
                raise ConversionError(f"{e}; the tied output_layer copy differs from the embedding, pass "
                                      f"--average-replicas to store their mean") from e
    for key, value in tensors.items():
        if tuple(value.shape) != task.shape:
            raise ConversionError(f"{task.name} [{key}]: consolidated shape {tuple(value.shape)}, expected {task.shape}")
    info = {"model_dtype": dtype_name(task.places[0][0].dtype), "pattern": task.pattern, "step": steps[0],
            "param_group": task.param_group}
    return tensors, info


def _locate_shard(ckpt: MegatronCheckpoint, ref: ShardRef) -> Optional[dict]:
    """ckpt.locate(ref) (where the tensors' bytes are, see formats.stored) for readers that have it."""
    locate = getattr(ckpt, "locate", None)
    if locate is None:
        return None
    return locate(ref, keys=("param",) if ckpt.optimizer_kind == "none" else OPTIMIZER_KEYS)


def placement_for(pattern: Pattern, shape: tuple[int, ...], shards: list[StoredTensor]) -> Placement:
    """How the global tensor is assembled from its TP shards (pattern.slice_ranges, read backwards):
    the blocks of each rank's shard, concatenated along the pattern's dim, land at its ranges."""
    tp = len(shards)
    if pattern.dim is None:  # replicated: one copy (the caller checked they agree)
        whole = tuple(slice(0, n) for n in shape)
        return Placement(shape, shards[0].dtype, (shards[0],), (Block(0, whole, whole),))
    blocks = []
    for rank in range(tp):
        local = 0
        for ranges in pattern.slice_ranges(shape, rank, tp):
            n = ranges[pattern.dim].stop - ranges[pattern.dim].start
            src = list(slice(0, s) for s in shards[rank].shape)
            src[pattern.dim] = slice(local, local + n)
            blocks.append(Block(rank, tuple(ranges), tuple(src)))
            local += n
    return Placement(shape, shards[0].dtype, tuple(shards), tuple(blocks))


def place_parameter(ckpt: MegatronCheckpoint, task: ParamTask, files: FileHandles
                    ) -> Optional[tuple[dict[str, Placement], dict]]:
    """consolidate_parameter without reading tensors: where each consolidated tensor's bytes are in the
    source files, with replicas and the tied output-layer copy compared byte for byte (bounded mmaps).
    None when the reader cannot say where the bytes are, a tensor is not float32, or any check fails:
    consolidate_parameter then does the work (and reports the failure with its details)."""
    placed: list[dict[str, Placement]] = []
    steps: list[Optional[int]] = []
    for place in task.places:
        states = [_locate_shard(ckpt, ref) for ref in place]
        if any(s is None for s in states):
            return None
        keys = {tuple(sorted(k for k in s if k in OPTIMIZER_KEYS)) for s in states}
        if len(keys) != 1:
            return None
        wanted = keys.pop() or ("param",)
        if wanted != ("param",) and "fp32" not in wanted:
            return None
        try:
            steps.append(_step(task, states, "TP ranks"))
        except ConversionError:
            return None
        out = {}
        for key in wanted:
            shards = [s[key] for s in states]
            if any(sh.dtype != torch.float32 or sh.shape != tuple(ref.shape) for sh, ref in zip(shards, place)):
                return None
            if isinstance(task.pattern, Replicated) and not all(
                    regions_equal(files, shards[0].regions, sh.regions) for sh in shards[1:]):
                return None
            out["fp32" if key == "param" else key] = placement_for(task.pattern, task.shape, shards)
        placed.append(out)
    if len(set(steps)) != 1:
        return None
    for copy in placed[1:]:  # tied embedding: the last stage's output_layer must be the same bytes
        for key, placement in placed[0].items():
            a, b = placement.regions(), copy[key].regions()
            if a is None or b is None or not regions_equal(files, a, b):
                return None
    info = {"model_dtype": dtype_name(task.places[0][0].dtype), "pattern": task.pattern, "step": steps[0],
            "param_group": task.param_group}
    return placed[0], info


def convert_parameter(ckpt: MegatronCheckpoint, task: ParamTask, staging_dir: PathLike, *,
                      average_replicas: bool = False, lazy: bool = False) -> dict:
    """Consolidate one parameter and write its file into the staging directory; returns its metadata entry.
    Bytes go file to file when the reader can locate them (place_parameter), else through tensors.
    lazy: write nothing, return an entry that says where the bytes are in the source (lazy_entry)."""
    if lazy:
        with FileHandles() as files:
            placed = place_parameter(ckpt, task, files)
        if placed is None:
            consolidate_parameter(ckpt, task)  # raises the detailed error when a check failed
            raise ConversionError(f"{task.name}: stored in a way a lazy checkpoint cannot reference in place (e.g. "
                                  f"16-bit weights without optimizer state); convert without --lazy")
        return lazy_entry(task.name, placed[0], placed[1], ckpt.path)
    if not average_replicas:  # averaging computes new values: tensors needed
        with FileHandles() as files:
            placed = place_parameter(ckpt, task, files)
            if placed is not None:
                return write_tensor_file_placed(staging_dir, task.name, placed[0], placed[1], files)
    tensors, info = consolidate_parameter(ckpt, task, average_replicas=average_replicas)
    return write_tensor_file(staging_dir, task.name, tensors, info)


# --------------------------------------------------------------------------------------------------
# Metadata


_DROP = object()


def json_safe(value: Any) -> Any:
    """A JSON value for `value`, or _DROP when it has none (non-finite floats become "nan"/"inf"/"-inf")."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__module__}.{type(value).__qualname__}.{value.name}"
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, PickledEnum):
        inner = json_safe(value.value)
        return _DROP if inner is _DROP else {"enum": value.qualname, "value": inner}
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalars
        return json_safe(value.item())
    if isinstance(value, (list, tuple)):
        items = [json_safe(v) for v in value]
        return _DROP if any(v is _DROP for v in items) else items
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return _DROP
        items = {k: json_safe(v) for k, v in value.items()}
        return _DROP if any(v is _DROP for v in items.values()) else items
    return _DROP


def _json_args(args: dict) -> tuple[dict, list[str]]:
    kept, dropped = {}, []
    for key, value in args.items():
        safe = json_safe(value)
        if safe is _DROP:
            dropped.append(key)
        else:
            kept[key] = safe
    return kept, sorted(dropped)


def build_metadata(ckpt: MegatronCheckpoint, *, average_replicas: bool) -> dict:
    common = ckpt.common_state()
    args, dropped = _json_args(ckpt.args)
    groups = common.get("param_groups")
    # `step` is per parameter in the universal format; the rest are the group's hyper-parameters.
    hyper = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups] if groups else []
    param_groups = json_safe(hyper)
    if param_groups is _DROP:
        raise ConversionError(f"{ckpt.path}: optimizer param groups hold values that are not JSON ({hyper})")
    scheduler = json_safe(common.get("opt_param_scheduler") or {})
    if scheduler is _DROP:
        raise ConversionError(f"{ckpt.path}: the scheduler state holds values that are not JSON")
    return {
        "iteration": int(ckpt.iteration),
        "consumed_train_samples": int(common.get("consumed_train_samples") or 0),
        "consumed_valid_samples": int(common.get("consumed_valid_samples") or 0),
        "num_floating_point_operations_so_far": json_safe(common.get("num_floating_point_operations_so_far")),
        "source": {
            "format": ckpt.format,
            "path": str(Path(ckpt.path).resolve()),
            "layout": ckpt.layout.to_dict(),
            "optimizer_kind": ckpt.optimizer_kind,
            "checkpoint_version": json_safe(common.get("checkpoint_version")),
        },
        "model_config": ckpt.config.to_dict(),
        "args": args,
        "args_dropped": dropped,
        "optimizer": {"type": "adam" if ckpt.optimizer_kind != "none" else None, "param_groups": param_groups},
        "scheduler": scheduler,
        "conversion": {"tool": "megatron-ucp to-universal", "average_replicas": bool(average_replicas)},
    }


# --------------------------------------------------------------------------------------------------
# Conversion


@dataclass(frozen=True)
class ConversionSummary:
    path: Path
    source: str
    source_format: str
    iteration: int
    num_parameters: int
    bytes_written: int
    seconds: float
    workers: int
    lazy: bool = False

    def to_dict(self) -> dict:
        return {"path": str(self.path), "source": self.source, "source_format": self.source_format,
                "iteration": self.iteration, "num_parameters": self.num_parameters,
                "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3), "workers": self.workers,
                "lazy": self.lazy}


def _check_not_nested(src: Path, iter_dir: Path, dst: Path) -> None:
    dst = dst.resolve()
    for source in {src.resolve(), iter_dir.resolve()}:
        if dst == source or source in dst.parents or dst in source.parents:
            raise ConversionError(f"{dst}: the destination overlaps the source checkpoint {source}; write the "
                                  f"universal checkpoint outside it (the input is never modified)")


def convert(src: PathLike, dst: PathLike, iteration: Optional[int] = None, workers: Optional[int] = None,
            average_replicas: bool = False, progress: bool = True, overwrite: bool = False,
            lazy: bool = False) -> ConversionSummary:
    """to_universal with a summary of what was written (see to_universal)."""
    start = time.perf_counter()
    if workers is not None and int(workers) < 1:
        raise ConversionError(f"workers={workers}: use at least 1")
    if lazy and average_replicas:
        raise ConversionError("--lazy references the source's bytes, --average-replicas computes new values; "
                              "use one of them")
    check_destination(dst, overwrite)  # fail before the (possibly long) open and plan
    ckpt = open_checkpoint(src, iteration)
    _check_not_nested(Path(src), Path(ckpt.path), Path(dst))
    tasks = plan_parameters(ckpt)
    metadata = build_metadata(ckpt, average_replicas=average_replicas)
    total = sum(t.nbytes * (3 if ckpt.optimizer_kind != "none" else 1) for t in tasks)
    if lazy:
        metadata["conversion"]["lazy"] = True
    if not getattr(ckpt, "thread_safe_reads", False):
        workers = 1  # a reader whose reads share state is used from one thread
    workers = max(1, min(int(workers or default_workers()), len(tasks)))
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="to-universal",
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    written = 0
    with UniversalWriter(dst, overwrite=overwrite) as writer:

        def record(name: str, entry: dict) -> None:
            nonlocal written
            writer.record_parameter(name, entry)
            size = math.prod(entry["shape"]) * 4 * len(entry["tensors"])
            written += 0 if lazy else size
            bar.update(size)
            bar.set_postfix_str(f"{len(writer.parameters)}/{len(tasks)} params", refresh=False)

        try:
            if workers == 1:
                for task in tasks:
                    record(task.name, convert_parameter(ckpt, task, writer.staging_dir,
                                                        average_replicas=average_replicas, lazy=lazy))
            else:
                _convert_in_threads(ckpt, tasks, writer.staging_dir, workers, average_replicas, record, lazy)
        finally:
            bar.close()
        if lazy:
            (writer.staging_dir / TENSORS_DIRNAME).rmdir()
            metadata["lazy"] = {"source": str(Path(ckpt.path).resolve()),
                                "files": source_file_stats(ckpt.path, writer.parameters)}
        path = writer.finish(metadata)
    return ConversionSummary(path=path, source=str(Path(ckpt.path).resolve()), source_format=ckpt.format,
                             iteration=ckpt.iteration, num_parameters=len(tasks), bytes_written=written,
                             seconds=time.perf_counter() - start, workers=workers, lazy=lazy)


def in_torchrun() -> bool:
    """Launched by torchrun with more than one process (WORLD_SIZE/RANK set)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def convert_distributed(src: PathLike, dst: PathLike, iteration: Optional[int] = None,
                        average_replicas: bool = False, progress: bool = True,
                        overwrite: bool = False) -> ConversionSummary:
    """to_universal across the processes of a torchrun job (e.g. one per node on a shared filesystem).

    Rank 0 owns the destination: it checks it, creates the staging directory and, once every rank is
    done, records the parameters and writes metadata.json and COMPLETE. Every rank opens the source,
    plans the same parameter list and converts its share (largest parameters dealt round-robin, so
    shares are balanced), writing tensor files straight into the shared staging directory. An error on
    any rank stops every rank and removes the staging directory.
    """
    import torch.distributed as dist

    start = time.perf_counter()
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo")
    try:
        return _convert_distributed(dist, start, src, dst, iteration, average_replicas, progress, overwrite)
    finally:
        if owns_group:  # a gloo group left to the interpreter's exit can abort the process
            dist.destroy_process_group()


def _convert_distributed(dist, start, src, dst, iteration, average_replicas, progress, overwrite):
    rank, world = dist.get_rank(), dist.get_world_size()

    def agree(error: Optional[str]) -> None:
        """Raise on every rank if any rank failed (the first error, with its rank)."""
        errors = [None] * world
        dist.all_gather_object(errors, error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            r, e = failed[0]
            raise ConversionError(e if r == rank else f"rank {r}: {e}")

    writer = None
    try:
        error = None
        try:
            if rank == 0:
                check_destination(dst, overwrite)
            ckpt = open_checkpoint(src, iteration)
            _check_not_nested(Path(src), Path(ckpt.path), Path(dst))
            tasks = plan_parameters(ckpt)
            if rank == 0:
                writer = UniversalWriter(dst, overwrite=overwrite)
        except Exception as e:  # noqa: BLE001 - reported on every rank by agree()
            error = f"{type(e).__name__}: {e}" if not isinstance(e, (ConversionError, ValueError)) else str(e)
        agree(error)
        staging = [str(writer.staging_dir) if writer else None]
        dist.broadcast_object_list(staging, src=0)
        staging_dir = Path(staging[0])

        ordered = sorted(tasks, key=lambda t: t.nbytes, reverse=True)
        mine = ordered[rank::world]
        entries, error = [], None
        bar = tqdm(total=sum(t.nbytes for t in mine), unit="B", unit_scale=True, unit_divisor=1024,
                   desc=f"to-universal rank {rank}", disable=not progress or rank != 0, file=sys.stderr,
                   dynamic_ncols=True)
        try:
            for task in mine:
                entries.append((task.name, convert_parameter(ckpt, task, staging_dir,
                                                             average_replicas=average_replicas)))
                bar.update(task.nbytes)
        except Exception as e:  # noqa: BLE001
            error = str(e) or type(e).__name__
        finally:
            bar.close()
        agree(error)
        gathered = [None] * world
        dist.gather_object(entries, gathered if rank == 0 else None, dst=0)
        path, error = None, None
        if rank == 0:
            try:
                for rank_entries in gathered:
                    for name, entry in rank_entries:
                        writer.record_parameter(name, entry)
                path = writer.finish(build_metadata(ckpt, average_replicas=average_replicas))
                writer = None
            except Exception as e:  # noqa: BLE001
                error = str(e) or type(e).__name__
        agree(error)
        result = [str(path) if path else None]
        dist.broadcast_object_list(result, src=0)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    written = sum(math.prod(e["shape"]) * 4 * len(e["tensors"]) for _, e in entries)
    return ConversionSummary(path=Path(result[0]), source=str(Path(ckpt.path).resolve()), source_format=ckpt.format,
                             iteration=ckpt.iteration, num_parameters=len(tasks), bytes_written=written,
                             seconds=time.perf_counter() - start, workers=world)


def _convert_in_threads(ckpt: MegatronCheckpoint, tasks: list[ParamTask], staging_dir: Path, workers: int,
                        average_replicas: bool, record, lazy: bool = False) -> None:
    """Threads sharing the opened checkpoint, for readers whose reads are independent (thread_safe_reads):
    no worker start-up (a spawned worker re-imports torch and re-opens the checkpoint, seconds), and the
    bulk of the work (file reads, tensor copies, safetensors writes) runs without the GIL. Largest
    parameters first, so the last ones to finish are small; at most 2 tasks per thread in flight keeps
    memory bounded by a few parameters."""
    pending = iter(sorted(tasks, key=lambda t: t.nbytes, reverse=True))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="to-universal") as pool:
        running: dict = {}  # future -> parameter name
        try:
            while True:
                for task in pending:
                    running[pool.submit(convert_parameter, ckpt, task, staging_dir,
                                        average_replicas=average_replicas, lazy=lazy)] = task.name
                    if len(running) >= 2 * workers:
                        break
                if not running:
                    break
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    record(running.pop(future), future.result())
        finally:
            for future in running:
                future.cancel()


def to_universal(src: PathLike, dst: PathLike, iteration: Optional[int] = None, workers: Optional[int] = None,
                 average_replicas: bool = False, progress: bool = True, overwrite: bool = False,
                 lazy: bool = False) -> Path:
    """Convert the Megatron-LM checkpoint at `src` (a checkpoint root or one iter_XXXXXXX folder, legacy
    `torch` or `torch_dist`) into a universal checkpoint at `dst` and return `dst`.

    Replicated parameters must agree bitwise across TP ranks, and a tied output_layer copy must equal the
    embedding (weights and moments), unless `average_replicas`, which stores their mean. On any error
    nothing is left at `dst` (nor its staging directory) and the source is untouched.

    lazy: write only metadata.json, whose entries say where each consolidated tensor's bytes are in the
    source checkpoint (checked as above; seconds, no copy). Readers then read from the source, which must
    stay where it is, unchanged (checked by size and mtime on open).
    """
    return convert(src, dst, iteration=iteration, workers=workers, average_replicas=average_replicas,
                   progress=progress, overwrite=overwrite, lazy=lazy).path


# --------------------------------------------------------------------------------------------------
# CLI: `megatron-ucp to-universal`


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "to-universal", parents=[common],
        help="convert a Megatron-LM checkpoint into a universal checkpoint",
        description="Convert a Megatron-LM checkpoint (legacy torch or torch_dist, any TP/PP/DP) into a "
                    "parallelism-independent universal checkpoint (docs/FORMAT.md).")
    p.add_argument("src", help="Megatron-LM checkpoint root (with latest_checkpointed_iteration.txt) or an "
                               "iter_XXXXXXX folder")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to convert (default: the tracker's)")
    p.add_argument("--workers", type=int, default=None,
                   help=f"parallel conversion threads (default: min(4, CPUs) = {default_workers()}); across "
                        f"nodes, run under torchrun")
    p.add_argument("--average-replicas", action="store_true",
                   help="store the mean of replicated copies (TP replicas, tied output layer) instead of "
                        "requiring them to agree bitwise")
    p.add_argument("--overwrite", action="store_true", help="replace an existing universal checkpoint at DST")
    p.add_argument("--lazy", action="store_true",
                   help="write only an index (metadata.json) of where each consolidated tensor's bytes are in SRC: "
                        "no copy; SRC must stay in place, unchanged, while the result is used")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    if in_torchrun() and args.lazy:
        raise ConversionError("--lazy copies no bytes and takes seconds: run it in one process, not under torchrun")
    if in_torchrun():  # one process per node (or per core) of a torchrun job, sharing the filesystem
        summary = convert_distributed(args.src, args.dst, iteration=args.iteration,
                                      average_replicas=args.average_replicas, progress=not args.quiet,
                                      overwrite=args.overwrite)
    else:
        summary = convert(args.src, args.dst, iteration=args.iteration, workers=args.workers,
                          average_replicas=args.average_replicas, progress=not args.quiet,
                          overwrite=args.overwrite, lazy=args.lazy)
    result = summary.to_dict()
    if in_torchrun() and int(os.environ["RANK"]) != 0:
        return result  # rank 0 reports
    result["message"] = (f"wrote {summary.path}: {summary.num_parameters} parameters, "
                         f"{summary.bytes_written / 2 ** 20:.1f} MiB, iteration {summary.iteration} "
                         f"({summary.source_format}), {summary.seconds:.1f} s")
    if summary.lazy:
        result["message"] = (f"wrote lazy {summary.path}: an index of {summary.num_parameters} parameters into "
                             f"{summary.source} (iteration {summary.iteration}, {summary.source_format}), "
                             f"{summary.seconds:.1f} s; keep the source in place and unchanged while you use it")
    return result
