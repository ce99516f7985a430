"""What to convert: one task per canonical parameter, decided from the source's shard list before any
tensor is read (every expected parameter present once, on every TP rank, with its expected local shape,
in one optimizer param group)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_ucp.adapters.gpt import (
    UnknownParameterError, canonical_name, expected_parameters, group_identity, group_overrides, local_name,
    megatron_param_groups, pattern_for)
from megatron_ucp.formats import CheckpointReader, ShardRef
from megatron_ucp.formats.bucket_layout import BufferParam
from megatron_ucp.layout import LayoutError
from megatron_ucp.patterns import Pattern

# Keys that decide which Megatron param group a parameter belongs to (megatron-core's ParamKey fields).
GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


class ConversionError(ValueError):
    """The source cannot be converted as asked; the message names the checkpoint, the parameter and the fix."""


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


def _param_groups(ckpt: CheckpointReader, refs: list[ShardRef], saved: Optional[list]) -> dict:
    """(tp, pp, chunk, local name) -> param_group entry, by Megatron's grouping rule (the rulebook's),
    checked against the saved groups."""
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
    entries = {}
    for index, override in enumerate(group_overrides(rank_chunks, ckpt.args)):
        rule = group_identity(override)
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


def conversion_tasks(ckpt: CheckpointReader) -> list[ParamTask]:
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
                                  tied=config.tied, config=config)
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
        want_places = local_name(name, layout, config.num_layers, tied=config.tied)
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
