"""`megatron-ucp plan`: what loading a checkpoint at a target layout would read, before any data moves.

From metadata only: checks that the target TP x PP (x VPP) x DP layout can hold the model (heads, query
groups, ffn and layers divisible; vocabulary re-padding; batch divisible by DP) and lists, per target
rank, the parameters it loads and the bytes it reads from the universal checkpoint, as
`megatron_ucp.megatron_lm.loader` reads them: without the distributed optimizer the TP slice of each fp32 weight and
Adam moment; with it only the rows covering the rank's DP shard of megatron-core's DDP buffer, for the
fp32 weight and each moment (the param all-gather completes the weights). For a Megatron-LM source the
plan is conversion (to-universal) and then that load. Uneven targets take Megatron-LM's split flags.
With experts (MoE) the target also has EP and ETP: EP must divide the experts (checked first); a rank reads
its EP rank's experts, sliced for its expert-TP rank, and (distributed optimizer) their rows for its
expert-data-parallel shard of the expert buffers.
A universal checkpoint whose tensor files are missing or of the wrong size, or whose parameters do not
match its model (inspect_cmd.universal_problems, from stat() and metadata alone), makes the plan fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from megatron_ucp.adapters.gpt import (check_pipeline, expected_parameters, experts_per_ep_rank, in_expert_optimizer,
                                      is_buffer, is_vocab_parameter, padded_vocab_at, parameters_for_rank, rule_for,
                                      virtual_chunks)
from megatron_ucp.commands.common import (
    add_target_layout_arguments, human_bytes, is_universal, open_any, text_table, universal_problems)
from megatron_ucp.core.optimizers import runs_layer_wise
from megatron_ucp.core.placement import PlacementError, resolve_vpp, split_options
from megatron_ucp.core.layout import LayoutError, ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig


def _divisors(n: int, upto: int = 64) -> list[int]:
    return [d for d in range(1, min(n, upto) + 1) if n % d == 0]


def _model_tps(c: GPTModelConfig) -> list[int]:
    """The TP sizes (up to 64) the model's attention heads, query groups and FFN all divide into."""
    return _divisors(math.gcd(c.num_attention_heads, c.num_query_groups, c.ffn_hidden_size))


@dataclass(frozen=True)
class Target:
    tp: int
    pp: int
    dp: int
    layers_per_virtual_stage: Optional[int] = None
    use_distributed_optimizer: bool = False
    sequence_parallel: bool = False
    # Megatron-LM's uneven pipeline split (layer_placement.SPLIT_FLAGS) and --num-virtual-stages-per-pipeline-rank
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    embedding_in_split: bool = False
    loss_in_split: bool = False
    virtual_stages: Optional[int] = None
    ep: int = 1  # --expert-model-parallel-size
    etp: Optional[int] = None  # --expert-tensor-parallel-size (None: TP)
    cp: int = 1  # --context-parallel-size

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def split(self) -> dict:
        return {"first_stage_layers": self.first_stage_layers, "last_stage_layers": self.last_stage_layers,
                "embedding_in_split": self.embedding_in_split, "loss_in_split": self.loss_in_split}

    @property
    def even(self) -> bool:
        return not any(self.split.values()) and self.virtual_stages is None

    def describe(self) -> str:
        s = f"TP{self.tp} PP{self.pp}" + (f" CP{self.cp}" if self.cp > 1 else "") + f" DP{self.dp}"
        if self.ep > 1 or self.etp not in (None, self.tp):
            s += f" EP{self.ep} ETP{self.etp or self.tp}"
        if self.layers_per_virtual_stage:
            s += f" ({self.layers_per_virtual_stage} layers per virtual stage)"
        if self.virtual_stages:
            s += f" ({self.virtual_stages} virtual stages per rank)"
        split = [f"first stage {self.first_stage_layers} layers" if self.first_stage_layers is not None else "",
                 f"last stage {self.last_stage_layers} layers" if self.last_stage_layers is not None else "",
                 "embedding counted" if self.embedding_in_split else "", "loss counted" if self.loss_in_split else ""]
        if any(split):
            s += " [" + ", ".join(x for x in split if x) + "]"
        if self.sequence_parallel and self.tp > 1:
            s += " +SP"
        return s + (" with the distributed optimizer" if self.use_distributed_optimizer else "")


@dataclass(frozen=True)
class Source:
    """What the plan needs of the checkpoint: config, global shapes, model dtypes, optimizer state, args."""

    path: str
    format: str
    iteration: int
    config: GPTModelConfig
    shapes: dict
    patterns: dict  # canonical name -> the stored pattern (a universal checkpoint's) or the rulebook's
    model_dtypes: dict
    states: dict  # canonical name -> how many optimizer-state tensors it holds besides fp32 (0 without state)
    args: dict
    problems: tuple[str, ...] = ()  # what makes the checkpoint unloadable whatever the layout

    @property
    def has_moments(self) -> bool:
        """Optimizer state to load (Adam's moments, SGD's / Lion's / Muon's momentum: core/optimizers.py)."""
        return any(self.states.values())


def read_source(path, iteration: Optional[int] = None) -> Source:
    ckpt = open_any(path, iteration, validate=False)  # its problems are the plan's
    if is_universal(ckpt):
        params = ckpt.parameters
        return Source(str(ckpt.path), "universal", ckpt.iteration, ckpt.config,
                      {n: p.shape for n, p in params.items()}, {n: p.pattern for n, p in params.items()},
                      {n: p.model_dtype for n, p in params.items()},
                      {n: len(p.tensors) - 1 for n, p in params.items()}, dict(ckpt.args),
                      tuple(universal_problems(ckpt)))
    from megatron_ucp.convert import conversion_tasks
    from megatron_ucp.core.dtypes import dtype_name

    tasks = conversion_tasks(ckpt)  # the conversion would fail here if the source is not convertible
    return Source(str(ckpt.path), ckpt.format, ckpt.iteration, ckpt.config, {t.name: t.shape for t in tasks},
                  {t.name: t.pattern for t in tasks},
                  {t.name: dtype_name(t.places[0][0].dtype) for t in tasks},
                  {t.name: 0 if ckpt.optimizer_kind == "none" or is_buffer(t.name) else
                   len(ckpt.parameter_row(t.places[0][0].local_name, t.places[0][0].shape).states) for t in tasks},
                  dict(ckpt.args))




def check_target(source: Source, target: Target) -> tuple[list[str], list[str], Optional[ParallelLayout], int]:
    """(problems, warnings, layout or None, padded vocab at the target); a problem makes the load impossible."""
    c = source.config
    problems, warnings = list(source.problems), []
    if problems:
        return problems, warnings, None, c.padded_vocab_size
    for name, value in (("--tensor-model-parallel-size", target.tp), ("--pipeline-model-parallel-size", target.pp),
                        ("--data-parallel-size", target.dp), ("--context-parallel-size", target.cp),
                        ("--expert-model-parallel-size", target.ep),
                        ("--expert-tensor-parallel-size", target.etp or target.tp)):
        if value < 1:
            problems.append(f"{name} {value}: must be >= 1")
    if problems:
        return problems, warnings, None, c.padded_vocab_size
    if not c.num_experts and (target.ep > 1 or target.etp not in (None, target.tp)):
        return (["--expert-model-parallel-size / --expert-tensor-parallel-size need a model with experts (this one "
                 "has num_experts=None); drop them"], warnings, None, c.padded_vocab_size)
    if c.num_experts:
        try:  # first: nothing else matters when EP cannot hold the experts
            experts_per_ep_rank(c, target.ep)
        except LayoutError as e:
            return [str(e)], warnings, None, c.padded_vocab_size
        etp = target.etp or target.tp
        if c.moe_ffn_hidden_size % etp:
            problems.append(f"moe_ffn_hidden_size={c.moe_ffn_hidden_size} is not divisible by ETP={etp}; choose "
                            f"--expert-tensor-parallel-size in {_divisors(c.moe_ffn_hidden_size)}")
        stage = target.tp * target.cp * target.dp
        if stage % (etp * target.ep):
            ranks = f"TP x CP x DP = {target.tp} x {target.cp} x {target.dp}" if target.cp > 1 else \
                f"TP x DP = {target.tp} x {target.dp}"
            problems.append(f"{ranks} ranks per stage cannot be split into ETP x EP = {etp} x {target.ep} expert "
                            f"groups; choose EP and ETP whose product divides {stage}")
    t = target.tp
    tps = _model_tps(c)  # every suggestion is a TP the whole model takes
    if c.num_attention_heads % t:
        problems.append(f"num_attention_heads={c.num_attention_heads} is not divisible by TP={t}; "
                        f"choose TP in {tps}")
    if c.num_query_groups % t:
        problems.append(f"num_query_groups={c.num_query_groups} is not divisible by TP={t} (each TP rank holds whole "
                        f"query groups of the fused QKV); choose TP in {tps}")
    if c.ffn_hidden_size % t:
        problems.append(f"ffn_hidden_size={c.ffn_hidden_size} is not divisible by TP={t}; "
                        f"choose TP in {tps}")
    vpp = None
    split = dict(first_stage_layers=target.first_stage_layers, last_stage_layers=target.last_stage_layers,
                 embedding_in_split=target.embedding_in_split, loss_in_split=target.loss_in_split)
    try:
        if target.even:
            vpp = virtual_chunks(c.num_layers, target.pp, target.layers_per_virtual_stage)
        else:
            vpp = resolve_vpp(c.num_layers, target.pp, layers_per_virtual_stage=target.layers_per_virtual_stage,
                              virtual_stages=target.virtual_stages, **target.split)
        check_pipeline(c.num_layers, ParallelLayout(pp=target.pp, vpp=vpp, **target.split))
    except (LayoutError, PlacementError) as e:
        problems.append(str(e))
    padded = padded_vocab_at(c, t)
    if padded != c.padded_vocab_size:
        warnings.append(f"vocabulary padding changes: the stored {c.padded_vocab_size} rows are not divisible by "
                        f"TP={t}, the loader re-pads to {padded} rows (padding rows enter the softmax: the loss "
                        f"shifts slightly); keep it with TP in {[d for d in tps if c.padded_vocab_size % d == 0]}")
    seq_length = source.args.get("seq_length")
    problem = ParallelLayout(cp=target.cp).sequence_problem(
        seq_length if type(seq_length) is int and seq_length > 0 else None)
    if problem:
        problems.append(problem)
    gbs, mbs = source.args.get("global_batch_size"), source.args.get("micro_batch_size")
    if gbs and mbs:
        if gbs % (mbs * target.dp):
            fits = _divisors(gbs // mbs) if gbs % mbs == 0 else []
            problems.append(f"global batch {gbs} is not divisible by micro-batch {mbs} x DP={target.dp}; choose DP in "
                            f"{fits} or another --micro-batch-size (changing --global-batch-size needs "
                            f"--universal-allow-batch-change)")
        elif vpp and (gbs // (mbs * target.dp)) % target.pp:
            problems.append(f"the interleaved schedule needs the number of micro-batches ({gbs // (mbs * target.dp)}) "
                            f"divisible by PP={target.pp}; lower --micro-batch-size or DP, or drop VPP")
    if problems:
        return problems, warnings, None, padded
    layout = ParallelLayout(tp=t, pp=target.pp, dp=target.dp, vpp=vpp, sp=target.sequence_parallel, ep=target.ep,
                            etp=target.etp, cp=target.cp, **target.split)
    try:  # anything the explicit checks above missed
        expected_parameters(dataclasses.replace(c, padded_vocab_size=padded), layout)
    except (LayoutError, ValueError, NotImplementedError) as e:
        problems.append(str(e))
        return problems, warnings, None, padded
    return problems, warnings, layout, padded


def _rows_bytes(source: Source, canonical: str, tp_rank: int, tp: int, start: int, end: int) -> int:
    """Bytes of fp32 the loader reads for flat elements [start, end) of a TP slice: the slice's rows that
    cover them, as the stored pattern places them in the global tensor (Pattern.local_reads)."""
    pattern, shape = source.patterns[canonical], source.shapes[canonical]
    local = pattern.local_shape(shape, tp)
    row = math.prod(local[1:])
    box = (slice(start // row, -(-end // row)),)
    return sum(math.prod(s.stop - s.start for s in src) for src, _ in pattern.local_reads(shape, tp_rank, tp, box)) * 4


@dataclass
class _StageReads:
    """What every rank of one (pp, tp, ep, etp) read set loads: its parameters, the bytes of their slices, and
    per dense-DP rank and per expert-DP rank (distributed optimizer) the fp32 weight and moment bytes of its
    shard; `full_weight`/`full_opt`: what every rank reads whatever its DP rank."""

    names: list
    weight_bytes: int = 0  # the slices' bytes (the stage listing)
    full_weight: int = 0
    full_opt: int = 0
    dense_weight: Optional[list] = None  # per DP rank
    dense_opt: Optional[list] = None
    expert_weight: Optional[list] = None  # per expert-DP rank
    expert_opt: Optional[list] = None


def _stage_reads(source: Source, c: GPTModelConfig, layout: ParallelLayout, padded: int, key: tuple,
                 use_distributed_optimizer: bool) -> _StageReads:
    """With the distributed optimizer and Adam state a rank reads the fp32 weight only where it reads the
    moments (its DP shard's rows) and megatron-core's param all-gather completes the weights, except for a
    re-padded vocabulary tensor, read whole by every rank, and buffers (loader.load_universal_checkpoint)."""
    pp_rank, tp_rank, ep_rank, etp_rank = key
    stored_rows = source.config.padded_vocab_size
    # the distributed optimizer's DP shards; megatron-core 0.19's layer-wise one (Lion / Muon) gives each matrix whole
    # to one DP rank: counted as without it, every rank reading its slices' state (an upper bound)
    layer_wise = use_distributed_optimizer and runs_layer_wise(source.args.get("optimizer"))
    gather = source.has_moments and use_distributed_optimizer and not layer_wise
    stage = _StageReads([], dense_weight=[0] * layout.dp_cp, dense_opt=[0] * layout.dp_cp,
                        expert_weight=[0] * layout.expert_dp, expert_opt=[0] * layout.expert_dp)
    for chunk in range(layout.num_chunks):
        entries = parameters_for_rank(c, layout, pp_rank, chunk if layout.vpp else None, ep_rank=ep_rank,
                                      buffers=True)
        resized, splits = {}, {}
        for local, local_shape, canonical in entries:
            stage.names.append(canonical)
            splits[local] = (etp_rank, layout.expert_tp) if rule_for(canonical).expert_tp else (tp_rank, layout.tp)
            repad = is_vocab_parameter(canonical) and padded != stored_rows
            full = math.prod(source.shapes[canonical]) * 4
            # re-padding reads the whole stored tensor (each key) to re-pad it, then slices
            read = full if repad else math.prod(local_shape) * 4
            stage.weight_bytes += read
            resized[local] = repad
            if not gather or repad or is_buffer(canonical):
                stage.full_weight += read
            if not gather and not is_buffer(canonical):
                stage.full_opt += source.states.get(canonical, 0) * read
        if gather:
            params = [e for e in entries if not is_buffer(e[2])]
            for experts, weight, opt in ((False, stage.dense_weight, stage.dense_opt),
                                         (True, stage.expert_weight, stage.expert_opt)):
                mine = [e for e in params if in_expert_optimizer(e[2], c, layout) == experts]
                if mine:
                    _add_distopt_reads(source, layout, mine, splits, pp_rank, chunk, resized, weight, opt,
                                       experts=experts)
    return stage


def rank_reads(source: Source, layout: ParallelLayout, padded: int,
               use_distributed_optimizer: bool) -> tuple[list, list]:
    """(stages, ranks): per (pp, tp[, ep, etp]) read set its parameters and the bytes of their slices; per
    rank the bytes it reads (_stage_reads)."""
    c = dataclasses.replace(source.config, padded_vocab_size=padded)
    moe = bool(c.num_experts)
    stages: dict = {}
    ranks = []
    for rank in range(layout.world_size):
        tp_rank, dp_cp_rank, pp_rank = layout.coordinates(rank)
        dp_rank, cp_rank = layout.data_coordinates(dp_cp_rank)
        etp_rank, ep_rank, edp_rank, _ = layout.expert_coordinates(rank) if moe else (tp_rank, 0, dp_cp_rank, pp_rank)
        key = (pp_rank, tp_rank, ep_rank, etp_rank)
        if key not in stages:
            stages[key] = _stage_reads(source, c, layout, padded, key, use_distributed_optimizer)
        stage = stages[key]
        weight = stage.full_weight + stage.dense_weight[dp_cp_rank] + stage.expert_weight[edp_rank]
        opt = stage.full_opt + stage.dense_opt[dp_cp_rank] + stage.expert_opt[edp_rank]
        row = {"rank": rank, "tp_rank": tp_rank, "pp_rank": pp_rank, "dp_rank": dp_rank,
               **({"cp_rank": cp_rank} if layout.cp > 1 else {}),
               "num_parameters": len(stage.names), "weight_bytes": weight, "optimizer_bytes": opt,
               "read_bytes": weight + opt}
        if moe:
            row.update(ep_rank=ep_rank, etp_rank=etp_rank, expert_dp_rank=edp_rank)
        ranks.append(row)
    out = []
    for (pp_rank, tp_rank, ep_rank, etp_rank), stage in sorted(stages.items()):
        entry = {"pp_rank": pp_rank, "tp_rank": tp_rank}
        if moe:
            entry.update(ep_rank=ep_rank, etp_rank=etp_rank)
        out.append({**entry, "num_parameters": len(stage.names), "weight_bytes": stage.weight_bytes,
                    "parameters": stage.names})
    return out, ranks


def _add_distopt_reads(source: Source, layout: ParallelLayout, entries, splits: dict, pp_rank: int, chunk: int,
                       resized: dict, weight_bytes: list, opt_bytes: list, *, experts: bool = False) -> None:
    """Bytes read per DP x CP rank with the distributed optimizer: megatron-core gives DP x CP rank r the r-th equal part
    of every bucket of the chunk's DDP buffer (bucket_layout reproduces the buffer's index map; the expert
    buffers are split the same way over the expert-DP group); the rank reads the rows of each parameter's TP
    slice covering its part, for the fp32 weight and each moment (a re-padded vocabulary tensor: the moments
    whole, once; its weight is counted by the caller)."""
    from megatron_ucp.formats.bucket_layout import (BufferParam, DDPBucketConfig, build_chunk_buffers,
                                                    shared_embedding_names)

    local_names = [local for local, _, _ in entries]
    shared = shared_embedding_names(source.args, layout, pp_rank=pp_rank, vpp_chunk=chunk, names=local_names)
    params = [BufferParam(local, tuple(shape), _torch_dtype(source.model_dtypes[canonical]), local in shared,
                          expert=experts) for local, shape, canonical in entries]
    canonicals = {local: canonical for local, _, canonical in entries}
    full_bytes = {local: math.prod(source.shapes[canonical]) * 4 for local, _, canonical in entries}
    dp = layout.expert_dp if experts else layout.dp_cp
    config = DDPBucketConfig(dp_size=dp, use_distributed_optimizer=True, bucket_size=None)
    for buffer in build_chunk_buffers(params, config, experts=experts):
        for bucket_index, bucket in enumerate(buffer.buckets):
            part = bucket.numel // dp
            for dp_rank in range(dp):
                lo, hi = bucket.start + dp_rank * part, bucket.start + (dp_rank + 1) * part
                for span in buffer.params:
                    if span.bucket != bucket_index:
                        continue
                    start, end = max(span.start, lo), min(span.end, hi)
                    if start >= end:
                        continue
                    moments = source.states.get(canonicals[span.name], 0)
                    if resized[span.name]:
                        opt_bytes[dp_rank] += moments * full_bytes[span.name]
                    else:
                        split_rank, split = splits[span.name]
                        rows = _rows_bytes(source, canonicals[span.name], split_rank, split, start - span.start,
                                           end - span.start)
                        weight_bytes[dp_rank] += rows
                        opt_bytes[dp_rank] += moments * rows


def _torch_dtype(name: str):
    """The model dtype as bucket_layout takes it, without importing torch (3.7 s of a 16384-rank plan's 6 s)."""
    from megatron_ucp.core.dtypes import ITEMSIZE
    from megatron_ucp.serialization.safe_pickle import TorchDType

    return TorchDType(name if name in ITEMSIZE else "float32")


def make_plan(src, target: Target, iteration: Optional[int] = None) -> dict:
    source = read_source(src, iteration)
    problems, warnings, layout, padded = check_target(source, target)
    stored_bytes = sum(math.prod(s) * 4 * (1 + source.states.get(n, 0)) for n, s in source.shapes.items())
    plan = {
        "source": {"path": source.path, "format": source.format, "iteration": source.iteration,
                   "optimizer_state": source.has_moments, "universal_bytes": stored_bytes,
                   "num_experts": source.config.num_experts},
        "conversion": None if source.format == "universal" else {
            "command": f"megatron-ucp to-universal {source.path} UCP_DIR", "parameters": len(source.shapes),
            "writes_bytes": stored_bytes},
        "target": {**dataclasses.asdict(target), "world_size": target.world_size,
                   "layout": layout.to_dict() if layout else None, "padded_vocab_size": padded},
        "compatible": not problems,
        "problems": problems,
        "warnings": warnings,
        "exit_code": 1 if problems else 0,
    }
    if layout is not None:
        stages, ranks = rank_reads(source, layout, padded, target.use_distributed_optimizer)
        reads = [r["read_bytes"] for r in ranks]
        plan.update(stages=stages, ranks=ranks, totals={
            "read_bytes": sum(reads), "max_rank_read_bytes": max(reads), "min_rank_read_bytes": min(reads),
            "parameters": len(source.shapes)})
    return plan


def format_report(plan: dict) -> str:
    src, tgt = plan["source"], plan["target"]
    lines = [f"source: {src['path']} ({src['format']}, iteration {src['iteration']}"
             + ("" if src["optimizer_state"] else ", no optimizer state") + ")"]
    if plan["conversion"]:
        conv = plan["conversion"]
        lines.append(f"step 1: convert ({conv['command']}): writes {conv['parameters']} parameters, "
                     f"{human_bytes(conv['writes_bytes'])}")
        lines.append("step 2: load at the target layout from the universal checkpoint")
    lines.append(f"target: {Target(**{k: tgt[k] for k in Target.__dataclass_fields__}).describe()} = "
                 f"{tgt['world_size']} ranks")
    for w in plan["warnings"]:
        lines.append(f"warning: {w}")
    if not plan["compatible"]:
        lines += [f"incompatible: {p}" for p in plan["problems"]]
        return "\n".join(lines)
    shards = tgt["dp"] * tgt.get("cp", 1)

    def stage_key(r: dict) -> tuple:
        return r["pp_rank"], r["tp_rank"], r.get("ep_rank"), r.get("etp_rank")

    by_stage: dict = {}
    for r in plan["ranks"]:
        by_stage.setdefault(stage_key(r), []).append(r)
    rows = []
    for stage in plan["stages"]:
        rs = by_stage[stage_key(stage)]
        opt = [r["optimizer_bytes"] for r in rs]
        opt_text = human_bytes(opt[0]) if min(opt) == max(opt) else f"{human_bytes(min(opt))} - {human_bytes(max(opt))}"
        label = f"pp={stage['pp_rank']} tp={stage['tp_rank']}"
        if "ep_rank" in stage:
            label += f" ep={stage['ep_rank']} etp={stage['etp_rank']}"
        rows.append((label, str(stage["num_parameters"]),
                     human_bytes(stage["weight_bytes"]), opt_text, human_bytes(max(r["read_bytes"] for r in rs))))
    over = f" (over {shards} DP x CP ranks)" if tgt.get("cp", 1) > 1 else f" (over {shards} DP ranks)"
    header = ("stage", "params", "weights/rank", "optimizer/rank" + (over if shards > 1 else ""),
              "max read/rank")
    shown = 32
    lines += [""] + text_table(header, rows)[:1 + shown]
    if len(rows) > shown:
        lines.append(f"... {len(rows) - shown} more stages (--json lists all)")
    t = plan["totals"]
    lines += ["", f"compatible: {tgt['world_size']} ranks read {human_bytes(t['read_bytes'])} in total "
                  f"(at most {human_bytes(t['max_rank_read_bytes'])} per rank) of a "
                  f"{human_bytes(src['universal_bytes'])} universal checkpoint"]
    return "\n".join(lines)


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "plan", parents=[common], help="check a target layout and show what each rank would read",
        description="Before any data moves: check that a checkpoint can be loaded at a target TP x PP x CP x DP "
                    "(x VPP, x EP x ETP with experts) layout and list what each target rank reads (parameters, "
                    "bytes). Exit status 1 "
                    "when the layout is incompatible.")
    p.add_argument("src", help="universal checkpoint (or a Megatron-LM checkpoint: conversion + load)")
    p.add_argument("--iteration", type=int, default=None, help="iteration of a Megatron-LM root")
    add_target_layout_arguments(p, tp_required=True)
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    target = Target(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                    dp=args.data_parallel_size, layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
                    use_distributed_optimizer=args.use_distributed_optimizer,
                    sequence_parallel=args.sequence_parallel, **split_options(args),
                    ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                    cp=args.context_parallel_size)
    plan = make_plan(args.src, target, args.iteration)
    plan["message"] = format_report(plan)
    return plan
