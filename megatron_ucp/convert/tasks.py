"""What to convert: one task per canonical parameter, decided from the source's shard list before any
tensor is read (every expected parameter present once, on every TP rank of its split, with its expected
local shape, in one optimizer param group).

Mixture of experts: a routed expert's parameter has one place, its EP rank (rulebook expert_location),
and is split over the expert-TP group; its optimizer param group is one of the expert optimizer's when
the source layout chains one (rulebook experts_in_own_optimizer): the universal metadata then lists the
dense optimizer's groups followed by the expert optimizer's (megatron-core's ChainedOptimizer order).
Persistent buffers (the router's expert_bias) are converted without optimizer state or param group."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_ucp.adapters.gpt import (
    UnknownParameterError, canonical_name, expected_parameters, group_identity, group_overrides,
    in_expert_optimizer, is_buffer, is_expert, local_name, local_spelling, megatron_param_groups, pattern_for,
    tp_size_of)
from megatron_ucp.formats import CheckpointReader, ShardRef
from megatron_ucp.formats.bucket_layout import BufferParam
from megatron_ucp.core.layout import LayoutError
from megatron_ucp.core.patterns import Pattern

# Keys that decide which Megatron param group a parameter belongs to (megatron-core's ParamKey fields).
GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "optimizer")


class ConversionError(ValueError):
    """The source cannot be converted as asked; the message names the checkpoint, the parameter and the fix."""


@dataclass(frozen=True)
class ParamTask:
    """Everything needed to convert one canonical parameter, without tensors.

    `places` holds, per place the model keeps the parameter (one; two for a tied embedding whose last
    pipeline stage keeps `output_layer.weight`), the TP shards in tp_rank order (expert-TP order for a
    routed expert, all on its EP rank). `buffer`: a persistent buffer (no optimizer state, no group)."""

    name: str
    shape: tuple[int, ...]
    pattern: Pattern
    places: tuple[tuple[ShardRef, ...], ...]
    param_group: dict
    buffer: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4  # fp32 per stored tensor


def _rank_key(ref: ShardRef) -> tuple:
    """The optimizer rank of a shard: (tp, pp) for the dense optimizer, (etp, ep, pp) for the expert one."""
    return (ref.tp_rank, ref.ep_rank, ref.pp_rank)


def _param_groups(ckpt: CheckpointReader, refs: list[ShardRef], saved: Optional[list]) -> dict:
    """(tp, ep, pp, chunk, local name) -> param_group entry, by Megatron's grouping rule (the rulebook's), for
    the dense optimizer and, when the source chains one, the expert optimizer (its groups follow the dense
    ones, as megatron-core's ChainedOptimizer lists them), checked against the saved groups."""
    config, layout = ckpt.config, ckpt.layout
    rank_chunks: dict[tuple, list[list[BufferParam]]] = {}
    for ref in refs:
        if is_buffer(ref.local_name):
            continue
        chunks = rank_chunks.setdefault(_rank_key(ref), [])
        while len(chunks) <= ref.vpp_chunk:
            chunks.append([])
        chunks[ref.vpp_chunk].append(BufferParam(ref.local_name, ref.shape, ref.dtype,
                                                 expert=in_expert_optimizer(ref.local_name, config, layout)))
    out: dict = {}
    entries = {}
    offset = 0
    for experts in (False, True):
        groups_by_rank = megatron_param_groups(rank_chunks, ckpt.args, experts=experts)
        overrides = group_overrides(rank_chunks, ckpt.args, experts=experts)
        for rank, groups in groups_by_rank.items():
            if not any(groups) and experts:
                continue  # a dense rank: no expert parameters
            if saved is not None and offset + len(groups) > len(saved):
                raise ConversionError(
                    f"{ckpt.path}: the optimizer has {len(saved)} param groups but Megatron's grouping rule gives "
                    f"{offset + len(groups)} (rank tp={rank[0]} ep={rank[1]} pp={rank[2]}); custom param-group "
                    f"overrides are not supported")
            for index, members in enumerate(groups):
                for chunk, name in members:
                    out[(*rank, chunk, name)] = offset + index
        for index, override in enumerate(overrides):
            rule = group_identity(override, expert=experts)
            if saved is None:
                entries[offset + index] = rule
                continue
            group = saved[offset + index]
            if float(group.get("wd_mult", 1.0)) != float(rule["wd_mult"]) or bool(
                    group.get("is_expert_parallel", False)) != experts or group.get("optimizer") != rule.get(
                    "optimizer"):
                raise ConversionError(
                    f"{ckpt.path}: optimizer param group {offset + index} has wd_mult={group.get('wd_mult')}, "
                    f"is_expert_parallel={group.get('is_expert_parallel')}, optimizer={group.get('optimizer')} but "
                    f"Megatron's grouping rule puts parameters with wd_mult={rule['wd_mult']}, is_expert_parallel="
                    f"{experts}, optimizer={rule.get('optimizer')} there; the checkpoint was written with custom "
                    f"param-group overrides, which are not supported")
            entries[offset + index] = {"index": offset + index,
                                       **{k: group[k] for k in GROUP_IDENTITY if k in group}}
        offset += len(overrides)
    if saved is not None and offset != len(saved):
        raise ConversionError(f"{ckpt.path}: the optimizer has {len(saved)} param groups but Megatron's grouping rule "
                              f"gives {offset}; custom param-group overrides are not supported")
    return {place: entries[index] for place, index in out.items()}


def conversion_tasks(ckpt: CheckpointReader) -> list[ParamTask]:
    """One task per canonical parameter, in registration order; raises ConversionError unless every
    expected parameter is present exactly once, on every TP rank, with its expected local shape, and the reader
    can give the true state (CheckpointReader.read_problem: e.g. optimizer state its writer saved nowhere)."""
    problem = ckpt.read_problem()
    if problem:
        raise ConversionError(problem)
    config, layout = ckpt.config, ckpt.layout
    try:
        expected = dict(expected_parameters(config, layout))
    except (LayoutError, NotImplementedError, ValueError) as e:
        raise ConversionError(f"{ckpt.path}: {e}") from e
    refs = ckpt.shards()
    placed: dict[str, dict[tuple[int, int, str], dict[int, ShardRef]]] = {}
    for ref in refs:
        where = f"tp={ref.tp_rank} pp={ref.pp_rank}" + (f" ep={ref.ep_rank}" if ref.ep_rank else "")
        try:
            name = canonical_name(ref.local_name, layout, ref.pp_rank, ref.vpp_chunk, config.num_layers,
                                  tied=config.tied, config=config, ep_rank=ref.ep_rank)
            if ref.ep_rank and not is_expert(name):
                raise LayoutError(f"{ref.local_name!r} is listed on EP rank {ref.ep_rank}; only routed experts are "
                                  f"(every other parameter once, at ep_rank 0)")
        except (UnknownParameterError, LayoutError) as e:
            raise ConversionError(f"{ckpt.path}: rank {where}: {e}") from e
        if name is None:
            continue
        if name not in expected:
            raise ConversionError(f"{ckpt.path}: {ref.local_name!r} on {where} is "
                                  f"{name!r}, which the model config ({config.num_layers} layers, "
                                  f"{config.normalization}, bias={config.add_bias_linear}, "
                                  f"num_experts={config.num_experts}) does not have")
        # keyed by the local spelling: files of the TE spec or of older releases spell some names otherwise
        by_tp = placed.setdefault(name, {}).setdefault((ref.pp_rank, ref.vpp_chunk, local_spelling(ref.local_name)), {})
        if ref.tp_rank in by_tp:
            raise ConversionError(f"{ckpt.path}: {ref.local_name!r} appears twice on {where} chunk={ref.vpp_chunk}")
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
        tp = tp_size_of(name, layout)
        local_shape = pattern.local_shape(shape, tp, name=name)
        want_places = local_name(name, layout, config.num_layers, tied=config.tied, config=config)
        if sorted(placed[name]) != sorted(want_places):
            raise ConversionError(f"{ckpt.path}: {name} is stored at {sorted(placed[name])} (pp, chunk, name) but "
                                  f"{layout.describe()} keeps it at {want_places}")
        places = []
        for place in want_places:
            by_tp = placed[name][place]
            split = "expert-TP" if tp != layout.tp or is_expert(name) else "TP"
            if sorted(by_tp) != list(range(tp)):
                raise ConversionError(f"{ckpt.path}: {name} ({place[2]} on pp={place[0]}) has shards for {split} "
                                      f"ranks {sorted(by_tp)}, expected 0..{tp - 1}")
            for ref in by_tp.values():
                if tuple(ref.shape) != local_shape:
                    raise ConversionError(f"{ckpt.path}: {name} on tp={ref.tp_rank} pp={ref.pp_rank} has shape "
                                          f"{tuple(ref.shape)}, expected {local_shape} ({pattern.to_json()} of "
                                          f"{shape} over {split}={tp}); args and weights disagree")
            places.append(tuple(by_tp[t] for t in range(tp)))
        if is_buffer(name):
            tasks.append(ParamTask(name, tuple(shape), pattern, tuple(places), {}, buffer=True))
            continue
        group_entries = [groups[(r.tp_rank, r.ep_rank, r.pp_rank, r.vpp_chunk, r.local_name)]
                         for p in places for r in p]
        if any(g != group_entries[0] for g in group_entries):
            raise ConversionError(f"{ckpt.path}: {name} is in different optimizer param groups on different ranks "
                                  f"({group_entries}); the checkpoint is inconsistent")
        tasks.append(ParamTask(name, tuple(shape), pattern, tuple(places), group_entries[0]))
    return tasks
