"""Universal checkpoint -> Megatron-LM legacy `torch` checkpoint at any TP x PP x DP (x VPP) layout.

Writes what Megatron-LM's save_checkpoint writes with `--ckpt-format torch` (core_v0.16.1), DP rank 0
only, one folder per (tp, pp) rank:

    iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt   args, checkpoint_version 3.0, iteration,
        model | model0..model{V-1} (local names, stage-local layers, registration order, `_extra_state`
        None entries after every linear as megatron-core's local spec has them), optimizer,
        opt_param_scheduler, rng_state, num_floating_point_operations_so_far
    iter_XXXXXXX/mp_rank_TT[_PPP]/distrib_optim.pt     (--use-distributed-optimizer) {'buckets_coalesced': True,
        gbuf_idx: {(param dtype, grad dtype): {'param', 'exp_avg', 'exp_avg_sq': flat fp32 in DDP buffer order
        (bucket_layout.py: reverse registration order, 64-element aligned starts, padding zero, bucket-end
        padding removed), 'numel_unpadded': int}}}: what DistributedOptimizer.load_parameter_state reads.

`optimizer` is, with the distributed optimizer, {'optimizer': {'param_groups': [..., 'step': float]}}
(one Adam step per rank, as DistributedOptimizer.state_dict keeps it); otherwise torch Adam's
state dict indexed group by group (FP32Optimizer), wrapped as {'optimizer': ..., 'fp32_from_fp16_params':
...} for bf16/fp16 models (Float16OptimizerWithFloat16Params), each parameter with its own `step`.

Mixture of experts (Megatron-LM core_v0.16.1's legacy save, docs/MOE_CHECKPOINTS.md): one folder per
(tp, pp, ep) rank, `mp_rank_TT[_PPP][_EEE]`, as expert-data-parallel rank 0 of each writes it: the dense
parameters (DP replicas: the same in every EP folder) and that EP rank's local experts (local index j is
global expert ep*E/EP + j, split over ETP = TP). With experts in their own optimizer (EP > 1) `optimizer`
is the ChainedOptimizer's list [dense, expert] and distrib_optim.pt the list of each optimizer's
coalesced buffers where the writing rank is DP rank 0 of that optimizer's group: [dense, expert] in EP
folder 0, [None, expert] in the others (the expert buffers over the expert-DP group). Param groups are
regrouped by Megatron's rule at the target layout; a group's hyper-parameters come from the universal
checkpoint's group with the same identity (wd_mult, lr_mult, decoupled LR). ETP != TP is refused: Megatron-LM
0.16.1 cannot write it consistently in this format.

fp16: the universal checkpoint's loss-scaler state goes into `optimizer['grad_scaler']` (megatron-core's
optimizers load it from there; each of a ChainedOptimizer's).

RNG: a universal checkpoint's RNG states (docs/FORMAT.md "RNG states") are the source ranks' and mean
nothing at another layout. Megatron-LM's load_checkpoint exits ("Unable to load rng state") when
`rng_state` is missing unless --no-load-rng, so by default a fresh deterministic state is written:
Megatron's own seeding (_set_random_seed + model_parallel_cuda_manual_seed) with seed = args.seed + 7919 *
iteration (+ 100 * pp_rank), in the CUDA generator format (16 bytes: seed, Philox offset) or, with
rng_state="cpu", the CPU generator's (the CPU training harness). rng_state="none" omits it (then resume
with --no-load-rng); rng_state="source" writes the stored states unchanged, for a target at the source
layout (a dropout run then continues exactly).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from megatron_ucp.adapters.gpt import is_buffer, is_vocab_parameter, rule_for, tp_size_of
from megatron_ucp.core.dtypes import PARAM_DTYPES, torch_dtype
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.core.patterns import repadded_shard
from megatron_ucp.core import versions
from megatron_ucp.formats.bucket_layout import BufferParam
from megatron_ucp.formats.common import TRACKER_FILENAME, iteration_dir_name
from megatron_ucp.formats.legacy.names import DISTRIB_OPTIM_FILENAME, MODEL_FILENAME, rank_dir_name
from megatron_ucp.formats.megatron_state import (
    CHECKPOINT_VERSION, TargetGroups, args_values, chunk_buffers, ep_ranks, fresh_rng_state, group_hyper,
    optimizer_index, param_groups_by_rank, rank_buffer_params, rank_chunks, source_rng_state)
from megatron_ucp.formats.writer_base import CheckpointWriter, PlannedFile, WriteError, WriteTarget

_DTYPES = {name: torch_dtype(name) for name in PARAM_DTYPES}


class LegacyWriteError(WriteError):
    """The universal checkpoint cannot be written as a legacy checkpoint at this layout (cause + fix)."""


# --------------------------------------------------------------------------------------------------
# Args


def args_namespace(args: Mapping[str, Any]) -> argparse.Namespace:
    """argparse.Namespace for model_optim_rng.pt: only plain values, torch dtypes and importable
    megatron enums (a Megatron-LM without megatron-ucp must be able to unpickle it)."""
    return argparse.Namespace(**args_values(args, dtype=lambda name: getattr(torch, name)))


# --------------------------------------------------------------------------------------------------
# Plan (pure)


def _model_dtype(ucp, canonical: str) -> torch.dtype:
    return _DTYPES[ucp.parameters[canonical].model_dtype]


def _rank_buffer_params(ucp, config, layout, pp_rank, ep_rank: int = 0) -> list[list[BufferParam]]:
    """Parameters of one (pp, ep) rank per chunk with torch dtypes (they key distrib_optim.pt's buffers)."""
    return rank_buffer_params(ucp, config, layout, pp_rank, ep_rank, dtypes=_DTYPES)


def plan(ucp, config: GPTModelConfig, target: WriteTarget) -> list[PlannedFile]:
    """Every file the writer will produce, with the tensor bytes in it (no I/O)."""
    layout = target.layout
    config = replace(config, padded_vocab_size=target.padded_vocab_size)
    has_moments = _has_moments(ucp)
    check_layout(config, layout)
    files = []
    it = iteration_dir_name(ucp.iteration)
    for pp_rank in range(layout.pp):
        for ep_rank in ep_ranks(config, layout):
            chunks = _rank_buffer_params(ucp, config, layout, pp_rank, ep_rank)
            model_bytes = sum(p.numel * p.dtype.itemsize for c in chunks for p in c)
            fp32_elems = sum(p.numel for c in chunks for p in c)
            half = sum(p.numel for c in chunks for p in c if p.dtype != torch.float32)
            opt_bytes = 0
            distrib_bytes = 0
            if has_moments and target.use_distributed_optimizer:
                buffers = chunk_buffers(target, pp_rank, chunks, experts=True)
                if ep_rank == 0:  # the dense optimizer's DP rank 0 writes into EP folder 0
                    buffers += chunk_buffers(target, pp_rank, chunks)
                distrib_bytes = sum(3 * 4 * b.numel_unpadded for bufs in buffers for b in bufs)
            elif has_moments:
                opt_bytes = 4 * (2 * fp32_elems + half)
            for tp_rank in range(layout.tp):
                rank_dir = f"{it}/{rank_dir_name(tp_rank, pp_rank, layout.pp, ep_rank, layout.ep)}"
                files.append(PlannedFile(f"{rank_dir}/{MODEL_FILENAME}", model_bytes + opt_bytes, tp_rank, pp_rank))
                if distrib_bytes:
                    files.append(PlannedFile(f"{rank_dir}/{DISTRIB_OPTIM_FILENAME}", distrib_bytes, tp_rank,
                                             pp_rank))
    files.append(PlannedFile(TRACKER_FILENAME, 0, -1, -1))
    return files


def _has_moments(ucp) -> bool:
    return all("exp_avg" in info.tensors for name, info in ucp.parameters.items() if not is_buffer(name))


def check_layout(config: GPTModelConfig, layout: ParallelLayout) -> None:
    """LegacyWriteError for what Megatron-LM 0.16.1's legacy format cannot hold."""
    if config.num_experts and layout.expert_tp != layout.tp:
        raise LegacyWriteError(
            f"--expert-tensor-parallel-size {layout.expert_tp} != --tensor-model-parallel-size {layout.tp}: "
            f"Megatron-LM 0.16.1's legacy format names folders by the dense TP rank but lets expert-DP rank 0 write "
            f"them, so it cannot hold this layout; use ETP = TP or --ckpt-format torch_dist")


# --------------------------------------------------------------------------------------------------
# Reading one rank's tensors


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A tensor with its own storage (torch.save writes a view's whole storage)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


class _RankReader:
    """Reads one TP rank's slices from the universal checkpoint, re-padding the vocabulary if needed (routed
    experts: the same rank of their expert-TP split, ETP = TP here)."""

    def __init__(self, ucp, config: GPTModelConfig, padded_vocab_size: int, tp_rank: int, layout: ParallelLayout):
        self.ucp, self.config, self.padded, self.tp_rank, self.layout = ucp, config, padded_vocab_size, tp_rank, layout

    def read(self, canonical: str, key: str) -> torch.Tensor:
        info = self.ucp.parameters[canonical]
        tp = tp_size_of(canonical, self.layout)
        if is_vocab_parameter(canonical) and info.shape[0] != self.padded:
            return repadded_shard(self.ucp.read(canonical, key), info.pattern, self.padded, self.config.vocab_size,
                                  key, self.tp_rank, tp, name=canonical)
        return _owned(self.ucp.read_local(canonical, key, self.tp_rank, tp))


# --------------------------------------------------------------------------------------------------
# Building one rank's state


def _model_state(chunk: list[tuple[str, tuple, str]], tensors: dict, *, last: bool) -> "OrderedDict[str, Any]":
    """Local-spec state dict: parameters in registration order, `_extra_state` after each linear."""
    sd: "OrderedDict[str, Any]" = OrderedDict()
    modules = [local.rsplit(".", 1)[0] for local, _, _ in chunk]
    for i, (local, _, _) in enumerate(chunk):
        sd[local] = tensors[local]
        module = modules[i]
        # megatron-core's local-spec Column/RowParallelLinear save an `_extra_state` (None)
        is_linear = rule_for(local).linear
        if is_linear and (i + 1 == len(chunk) or modules[i + 1] != module):
            sd[f"{module}._extra_state"] = None
    if last and "output_layer._extra_state" not in sd:  # tied on one chunk: the module has no weight
        sd["output_layer._extra_state"] = None
    return sd


def _rank_step(ucp, canonicals: list[str], where: str) -> Optional[int]:
    steps = {ucp.parameters[c].step for c in canonicals}
    if len(steps) > 1:
        raise LegacyWriteError(
            f"{ucp.path}: parameters of {where} have different Adam steps {sorted(s for s in steps if s is not None)}"
            f"; the distributed optimizer keeps one step per rank. Write without --use-distributed-optimizer "
            f"(torch Adam keeps a step per parameter)")
    return steps.pop()


def build_rank_state(ucp, config: GPTModelConfig, target: WriteTarget, groups: Optional[TargetGroups], tp_rank: int,
                     pp_rank: int, ep_rank: int = 0) -> tuple[dict, Optional[Any]]:
    """(model_optim_rng.pt, distrib_optim.pt or None) of one (tp, pp, ep) rank folder; reads only its slices."""
    layout = target.layout
    reader = _RankReader(ucp, config, target.padded_vocab_size, tp_rank, layout)
    chunks = rank_chunks(config, layout, pp_rank, ep_rank)
    with_optim = _has_moments(ucp)
    where = f"rank tp={tp_rank} pp={pp_rank}" + (f" ep={ep_rank}" if ep_rank else "")

    # Model (and, for the optimizer, each parameter's fp32 master and moments).
    masters: list[dict] = []  # per chunk: local -> {'fp32', 'exp_avg', 'exp_avg_sq'}
    model_chunks = []
    for chunk_index, chunk in enumerate(chunks):
        weights, state = {}, {}
        for local, shape, canonical in chunk:
            fp32 = reader.read(canonical, "fp32")
            if tuple(fp32.shape) != tuple(shape):
                raise LegacyWriteError(f"{canonical}: slice for {where} has shape {tuple(fp32.shape)}, expected {shape}")
            dtype = _model_dtype(ucp, canonical)
            weights[local] = fp32 if dtype == torch.float32 else fp32.to(dtype)
            entry = {"fp32": fp32}
            if with_optim and not is_buffer(canonical):
                entry["exp_avg"] = reader.read(canonical, "exp_avg")
                entry["exp_avg_sq"] = reader.read(canonical, "exp_avg_sq")
            state[local] = entry
        last = layout.is_last_chunk(pp_rank, chunk_index if layout.vpp else None)
        model_chunks.append(_model_state(chunk, weights, last=last))
        masters.append(state)

    args = dict(target.args)
    # its writer: expert-DP rank 0 of EP rank ep, i.e. DP rank ep (ETP = TP)
    # the writer of the folder: expert-DP rank 0 of (tp, ep, pp) (with ETP = TP, as the legacy format has it)
    args["rank"] = args["local_rank"] = layout.expert_global_rank(tp_rank, ep_rank, 0, pp_rank)
    sd: dict = {"args": args_namespace(args), "checkpoint_version": CHECKPOINT_VERSION, "iteration": ucp.iteration}
    if len(model_chunks) == 1:
        sd["model"] = model_chunks[0]
    else:
        for i, chunk_sd in enumerate(model_chunks):
            sd[f"model{i}"] = chunk_sd

    distrib = None
    if with_optim:
        canonicals = {(c, local): canonical for c, chunk in enumerate(chunks) for local, _, canonical in chunk
                      if not is_buffer(canonical)}
        optimizers, distribs = [], []
        for index, by_rank in groups.members.items():  # the ChainedOptimizer's order: dense, expert
            rank_groups = by_rank[(tp_rank, ep_rank if index == 1 else 0, pp_rank)]
            mine = {ref: c for ref, c in canonicals.items() if optimizer_index(c, config, layout) == index}
            identities = groups.identities[index]
            if target.use_distributed_optimizer:
                step = _rank_step(ucp, list(mine.values()), where)
                param_groups = [{**group_hyper(ucp, identities[g]), "step": float(step or 0)}
                                for g in range(len(rank_groups))]
                optimizers.append({"optimizer": {"param_groups": param_groups}})
                # written by DP rank 0 of each optimizer's group: the dense one's in EP folder 0 only
                distribs.append(_distrib_optim(target, pp_rank, chunks, masters, ucp, experts=index == 1)
                                if index == 1 or ep_rank == 0 else None)
            else:
                optimizers.append(_torch_adam_state(ucp, rank_groups, mine, masters, identities))
        sd["optimizer"] = optimizers if len(optimizers) > 1 else optimizers[0]
        if target.use_distributed_optimizer:
            distrib = distribs if len(distribs) > 1 else distribs[0]
        for optimizer in optimizers:
            _add_grad_scaler(optimizer, ucp, target)
        if ucp.scheduler_state:
            sd["opt_param_scheduler"] = dict(ucp.scheduler_state)
    if target.rng_state == "source":
        sd["rng_state"] = source_rng_state(ucp, tp_rank, pp_rank)
    elif target.rng_state != "none":
        sd["rng_state"] = fresh_rng_state(target.args, ucp.iteration, tp_rank, pp_rank, layout.dp,
                                          target.rng_state, ep_rank)
    flops = ucp.metadata.get("num_floating_point_operations_so_far")
    sd["num_floating_point_operations_so_far"] = flops if flops is not None else 0
    return sd, distrib


def _torch_adam_state(ucp, rank_groups, canonicals, masters, identities) -> dict:
    """torch Adam state_dict (FP32Optimizer), or Float16OptimizerWithFloat16Params' wrapper for 16-bit
    models; state indices run group by group, every parameter with its own step."""
    dtypes = {(c, local): _model_dtype(ucp, canonical) for (c, local), canonical in canonicals.items()}
    mixed = any(d != torch.float32 for d in dtypes.values())
    state, param_groups, fp32_from_16 = {}, [], []
    index = 0
    for g, members in enumerate(rank_groups):
        ids, halves = [], []
        for ref in members:
            chunk, local = ref
            entry = masters[chunk][local]
            info = ucp.parameters[canonicals[ref]]
            if info.step is not None:
                state[index] = {"step": torch.tensor(float(info.step), dtype=torch.float32),
                                "exp_avg": entry["exp_avg"], "exp_avg_sq": entry["exp_avg_sq"]}
            if dtypes[ref] != torch.float32:
                halves.append(entry["fp32"])
            ids.append(index)
            index += 1
        param_groups.append({**group_hyper(ucp, identities[g]), "params": ids})
        fp32_from_16.append(halves)
    inner = {"state": state, "param_groups": param_groups}
    if not mixed:
        return inner
    return {"optimizer": inner, "fp32_from_fp16_params": fp32_from_16}


def _add_grad_scaler(optimizer: dict, ucp, target: WriteTarget) -> None:
    """fp16: the dynamic loss scaler's state under 'grad_scaler', where megatron-core's optimizers keep it
    (after 'optimizer', before 'fp32_from_fp16_params'); without a stored state the fp16 run starts a
    fresh scaler from its flags (megatron-core logs "found an old checkpoint")."""
    if not target.args.get("fp16") or ucp.loss_scaler is None:
        return
    items = list(optimizer.items())
    optimizer.clear()
    optimizer.update(items[:1])
    optimizer["grad_scaler"] = ucp.loss_scaler.to_megatron()
    optimizer.update(items[1:])


def _distrib_optim(target: WriteTarget, pp_rank: int, chunks, masters, ucp, *, experts: bool = False) -> dict:
    """One optimizer's distrib_optim.pt entry: each of its DDP buffers' fp32 master and moments, coalesced over
    buckets (the dense buffers, or the expert-parallel ones)."""
    config, layout = ucp.config, target.layout
    params = [[BufferParam(local, tuple(shape), _model_dtype(ucp, canonical),
                           expert=optimizer_index(canonical, config, layout) == 1)
               for local, shape, canonical in chunk if not is_buffer(canonical)] for chunk in chunks]
    out: dict = {"buckets_coalesced": True}
    gbuf = 0
    for chunk_index, buffers in enumerate(chunk_buffers(target, pp_rank, params, experts=experts)):
        for buf in buffers:
            world = {key: torch.zeros(buf.numel_unpadded, dtype=torch.float32) for key in ("param", "exp_avg", "exp_avg_sq")}
            for span in buf.params:
                entry = masters[chunk_index][span.name]
                start = buf.coalesced_offset(span)
                numel = span.end - span.start
                for key, source in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                    world[key][start:start + numel].copy_(entry[source].reshape(-1))
            world["numel_unpadded"] = buf.numel_unpadded
            out[gbuf] = {(buf.param_dtype, buf.grad_dtype): world}
            gbuf += 1
    return out


# --------------------------------------------------------------------------------------------------
# Write


def write(ucp, config: GPTModelConfig, target: WriteTarget, root: Path,
          on_file: Optional[Callable[[Path, int], None]] = None) -> list[Path]:
    """Write the legacy checkpoint under `root` (a staging directory): every rank's files, then the
    tracker file last. Memory: one (tp, pp, ep) rank's weights and optimizer state at a time."""
    layout = target.layout
    config = replace(config, padded_vocab_size=target.padded_vocab_size)
    check_layout(config, layout)
    groups = param_groups_by_rank(ucp, config, target) if _has_moments(ucp) else None
    iter_dir = Path(root) / iteration_dir_name(ucp.iteration)
    written = []
    for pp_rank, tp_rank, ep_rank in [(p, t, e) for p in range(layout.pp) for t in range(layout.tp)
                                      for e in ep_ranks(config, layout)]:
        rank_dir = iter_dir / rank_dir_name(tp_rank, pp_rank, layout.pp, ep_rank, layout.ep)
        rank_dir.mkdir(parents=True, exist_ok=True)
        state, distrib = build_rank_state(ucp, config, target, groups, tp_rank, pp_rank, ep_rank)
        for filename, obj in ((MODEL_FILENAME, state), (DISTRIB_OPTIM_FILENAME, distrib)):
            if obj is None:
                continue
            path = rank_dir / filename
            torch.save(obj, path)
            written.append(path)
            if on_file:
                on_file(path, path.stat().st_size)
        del state, distrib
    tracker = Path(root) / TRACKER_FILENAME
    tracker.write_text(str(ucp.iteration))
    written.append(tracker)
    return written


class LegacyWriter(CheckpointWriter):
    """`--ckpt-format torch`: offline, one (tp, pp, ep) rank's state in memory at a time. megatron-core 0.16
    through 0.19 save the same legacy files (the same entries and layout; only the args they pickle differ,
    and those are the universal checkpoint's), so `megatron_core_version` is checked, not branched on."""

    ckpt_format = "torch"
    OPTIONS = ("megatron_core_version",)

    def __init__(self, megatron_core_version: Optional[str] = None):
        if megatron_core_version is not None:
            try:
                versions.release(megatron_core_version)
            except ValueError as e:
                raise WriteError(f"--megatron-core-version: {e}") from None

    def plan(self, ucp, target: WriteTarget, notes: list) -> list[PlannedFile]:
        return plan(ucp, ucp.config, target)

    def write(self, ucp, target: WriteTarget, root: Path, on_file=None) -> None:
        write(ucp, ucp.config, target, root, on_file=on_file)
