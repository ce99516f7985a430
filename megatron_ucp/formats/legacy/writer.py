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
rng_state="cpu", the CPU generator's (Megatron-LM on CPU, cpu_shims). rng_state="none" omits it (then resume
with --no-load-rng); rng_state="source" writes the stored states unchanged, for a target at the source
layout (a dropout run then continues exactly).

Streaming: a rank's files are what torch.save of its state dict writes (serialization/torch_save.py, checked byte for
byte against torch.save), but no state dict of tensors is built. Every tensor is a torch_save.StreamedTensor: a TP
shard of a universal tensor (universal_pieces: boxes of the stored tensors, rows past the stored vocabulary
re-padded), cast to its dtype, or a distributed-optimizer buffer (those shards at their coalesced offsets, zeros
between); save_streamed pickles the state (names, shapes, the non-tensor state) and then writes each storage
record band by band, reading it from the universal checkpoint (every block checked) as it goes. Memory: the
pickle and one band (io/byteio.BAND_BYTES), whatever the parameters per rank. Neither torch nor megatron-core is
imported: args' dtypes and megatron enums are pickled as references (torch_save.GlobalRef / EnumMember), as
torch pickles them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import struct
import sys
import threading
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np

from megatron_ucp.adapters.gpt import (MTP_INNER, MTP_PREFIX, expected_parameters, is_buffer, mtp_inner_spelling,
                                       rule_for)
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.core import versions
from megatron_ucp.core.optimizers import OPTIMIZERS, group_optimizer, run_optimizers
from megatron_ucp.formats.bucket_layout import BufferParam
from megatron_ucp.formats.common import TRACKER_FILENAME, iteration_dir_name
from megatron_ucp.formats.legacy.names import DISTRIB_OPTIM_FILENAME, MODEL_FILENAME, rank_dir_name
from megatron_ucp.formats.megatron_state import (
    CHECKPOINT_VERSION, MODEL_DTYPES, TargetGroups, args_values, chunk_buffers, ep_ranks, fresh_rng_state,
    group_hyper, optimizer_index, param_groups_by_rank, rank_buffer_params, rank_chunks, source_rng_state)
from megatron_ucp.serialization.safe_pickle import TorchDType
from megatron_ucp.serialization.torch_save import (
    EnumMember, GlobalRef, Obj, SavedTensor, StreamedTensor, save_streamed, torch_dtype)
from megatron_ucp.formats.universal_pieces import Piece, PieceLayoutError, Sources, local_flat_pieces, piece_chunks
from megatron_ucp.formats.writer_base import CheckpointWriter, PlannedFile, WriteError, WriteTarget, writer_threads
from megatron_ucp.io.byteio import BAND_BYTES

_F32 = MODEL_DTYPES["float32"]
_NAMESPACE = GlobalRef("argparse.Namespace")


class LegacyWriteError(WriteError):
    """The universal checkpoint cannot be written as a legacy checkpoint at this layout (cause + fix)."""


# --------------------------------------------------------------------------------------------------
# Args


def args_namespace(args: Mapping[str, Any], target: WriteTarget) -> Obj:
    """args as the target release's Megatron-LM pickles its argparse.Namespace into model_optim_rng.pt
    (args_values): plain values, dtypes as torch's, megatron enums as references to their classes (one stand-in
    per member, so that pickle refers back to it as it does to the real member); that Megatron-LM, without
    megatron-ucp, unpickles it (its weights_only load allows its SAFE_GLOBALS, and only those are pickled)."""
    member = functools.lru_cache(maxsize=None)(lambda cls, value: EnumMember(GlobalRef(cls), value))
    values = args_values(args, release=target.release, source=target.source_release, dtype=torch_dtype,
                         enum_member=member)
    # setattr interns a Namespace's attribute names: never the objects metadata.json's other keys (param groups)
    # share, so pickle writes those keys again rather than referring back to the args' (as torch.save does)
    return Obj(_NAMESPACE, {sys.intern(key[:1] + key[1:]): value for key, value in values.items()})


# --------------------------------------------------------------------------------------------------
# Plan (pure)


def _model_dtype(ucp, canonical: str) -> TorchDType:
    return MODEL_DTYPES[ucp.parameters[canonical].model_dtype]


def plan(ucp, config: GPTModelConfig, target: WriteTarget) -> list[PlannedFile]:
    """Every file the writer will produce, with the tensor bytes in it (no I/O)."""
    layout = target.layout
    config = replace(config, padded_vocab_size=target.padded_vocab_size)
    has_moments = ucp.has_optimizer_state
    check_layout(config, layout)
    files = []
    it = iteration_dir_name(ucp.iteration)
    for pp_rank in range(layout.pp):
        for ep_rank in ep_ranks(config, layout):
            chunks = rank_buffer_params(ucp, config, layout, pp_rank, ep_rank)
            model_bytes = sum(p.numel * p.dtype.itemsize for c in chunks for p in c)
            fp32_elems = sum(p.numel for c in chunks for p in c)
            half = sum(p.numel for c in chunks for p in c if p.dtype != _F32)
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



def check_layout(config: GPTModelConfig, layout: ParallelLayout) -> None:
    """LegacyWriteError for what Megatron-LM 0.16.1's legacy format cannot hold."""
    if config.num_experts and layout.expert_tp != layout.tp:
        raise LegacyWriteError(
            f"--expert-tensor-parallel-size {layout.expert_tp} != --tensor-model-parallel-size {layout.tp}: "
            f"Megatron-LM 0.16.1's legacy format names folders by the dense TP rank but lets expert-DP rank 0 write "
            f"them, so it cannot hold this layout; use ETP = TP or --ckpt-format torch_dist")


# --------------------------------------------------------------------------------------------------
# One rank's tensors, streamed


class _RankTensors:
    """One TP rank's tensors as StreamedTensors over the universal checkpoint (routed experts: the same rank of
    their expert-TP split, ETP = TP here): a parameter's shard, cast to a dtype, or a distributed-optimizer
    buffer. Nothing is read until the record is written."""

    def __init__(self, sources: Sources, config: GPTModelConfig, layout: ParallelLayout, tp_rank: int, where: str):
        self.sources, self.config, self.layout, self.tp_rank, self.where = sources, config, layout, tp_rank, where
        self.shapes = dict(expected_parameters(config))  # global shapes at the target (padded vocabulary)

    def pieces(self, canonical: str, local_shape: tuple, state: str) -> list[Piece]:
        numel = int(np.prod(local_shape, dtype=np.int64))
        try:
            pieces = local_flat_pieces(self.config, self.layout, canonical, self.shapes[canonical], self.tp_rank,
                                       state, 0, numel)
        except PieceLayoutError as e:
            raise LegacyWriteError(str(e)) from None
        if sum(p.numel for p in pieces) != numel:
            raise LegacyWriteError(f"{canonical}: the shard of {self.where} has {sum(p.numel for p in pieces)} "
                                   f"elements, expected {numel} (shape {tuple(local_shape)})")
        return pieces

    def shard(self, canonical: str, local_shape: tuple, state: str, dtype: TorchDType) -> StreamedTensor:
        """The rank's shard of one universal tensor ('fp32', 'exp_avg', 'exp_avg_sq'), cast to `dtype`."""
        pieces = self.pieces(canonical, local_shape, state)
        return StreamedTensor(dtype.name, tuple(local_shape), lambda: self._bands(pieces, dtype))

    def buffer(self, numel: int, spans: list[tuple[int, str, tuple]], state: str) -> StreamedTensor:
        """A flat fp32 buffer of `numel` elements: each (offset, canonical, local shape) span's shard of
        `state` at its offset, zeros elsewhere."""
        parts: list = []
        at = 0
        for offset, canonical, shape in sorted(spans, key=lambda s: s[0]):
            if offset < at:
                raise LegacyWriteError(f"{canonical}: buffer offset {offset} overlaps the previous parameter "
                                       f"(ends at {at}) in {self.where}")
            parts.append(offset - at)
            pieces = self.pieces(canonical, shape, state)
            parts.append(pieces)
            at = offset + sum(p.numel for p in pieces)
        if at > numel:
            raise LegacyWriteError(f"{self.where}: buffer parameters end at {at}, past its {numel} elements")
        parts.append(numel - at)
        return StreamedTensor("float32", (numel,), lambda: self._buffer_bands(parts))

    def _bands(self, pieces: list[Piece], dtype: TorchDType) -> Iterator:
        for piece in pieces:  # stored runs copied file to file, the rest as cast bands
            yield from piece_chunks(self.sources, piece, dtype)

    def _buffer_bands(self, parts: list) -> Iterator[np.ndarray]:
        for part in parts:
            if isinstance(part, int):  # zeros between parameters
                for lo in range(0, part, BAND_BYTES // 4):
                    yield np.zeros(min(BAND_BYTES // 4, part - lo), dtype=np.float32)
            else:
                yield from self._bands(part, _F32)


# --------------------------------------------------------------------------------------------------
# Building one rank's state


def _model_state(chunk: list[tuple[str, tuple, str]], tensors: dict, *, last: bool,
                 mtp_inner: str = MTP_INNER) -> "OrderedDict[str, Any]":
    """Local-spec state dict: parameters in registration order, `_extra_state` after each linear; an MTP layer's
    transformer layer named as the target release names it (`mtp_inner`)."""
    sd: "OrderedDict[str, Any]" = OrderedDict()
    names = [mtp_inner_spelling(local, mtp_inner) if local.startswith(MTP_PREFIX) else local for local, _, _ in chunk]
    modules = [name.rsplit(".", 1)[0] for name in names]
    for i, (local, _, _) in enumerate(chunk):
        sd[names[i]] = tensors[local]
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
                     pp_rank: int, ep_rank: int, sources: Sources) -> tuple[dict, Optional[Any]]:
    """(model_optim_rng.pt, distrib_optim.pt or None) of one (tp, pp, ep) rank folder, as the values torch.save
    would be given, every tensor a StreamedTensor of its slices (read when written)."""
    layout = target.layout
    chunks = rank_chunks(config, layout, pp_rank, ep_rank)
    with_optim = ucp.has_optimizer_state
    where = f"rank tp={tp_rank} pp={pp_rank}" + (f" ep={ep_rank}" if ep_rank else "")
    tensors = _RankTensors(sources, config, layout, tp_rank, where)

    # Model (and, for the optimizer, each parameter's fp32 master and moments).
    masters: list[dict] = []  # per chunk: local -> {'fp32', and the optimizer's states by name}
    model_chunks = []
    for chunk_index, chunk in enumerate(chunks):
        weights, state = {}, {}
        for local, shape, canonical in chunk:
            fp32 = tensors.shard(canonical, shape, "fp32", _F32)
            dtype = _model_dtype(ucp, canonical)
            weights[local] = fp32 if dtype == _F32 else tensors.shard(canonical, shape, "fp32", dtype)
            entry = {"fp32": fp32}
            if with_optim and not is_buffer(canonical):
                for key in ucp.parameters[canonical].tensors[1:]:  # by name: its own optimizer's states
                    entry[key] = tensors.shard(canonical, shape, key, _F32)
            state[local] = entry
        last = layout.is_last_chunk(pp_rank, chunk_index if layout.vpp else None)
        model_chunks.append(_model_state(chunk, weights, last=last, mtp_inner=target.release.mtp_inner_module))
        masters.append(state)

    args = dict(target.args)
    # the writer of the folder: expert-DP rank 0 of (tp, ep, pp) (with ETP = TP, as the legacy format has it)
    args["rank"] = args["local_rank"] = layout.expert_global_rank(tp_rank, ep_rank, 0, pp_rank)
    sd: dict = {"args": args_namespace(args, target), "checkpoint_version": CHECKPOINT_VERSION, "iteration": ucp.iteration}
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
                distribs.append(_distrib_optim(target, pp_rank, chunks, tensors, ucp, experts=index == 1)
                                if index == 1 or ep_rank == 0 else None)
            else:  # an emerging optimizer's chain: each of its optimizers with its own groups (core/optimizers.py)
                kinds = run_optimizers(ucp.optimizer_type, ucp.args)
                if len(kinds) > 1 and any(_model_dtype(ucp, c) != _F32 for c in mine.values()):
                    raise LegacyWriteError(f"{ucp.path}: {ucp.optimizer_type} state of a 16-bit model: megatron-ucp "
                                           f"writes the emerging optimizers' chain for fp32 models only (no 16-bit "
                                           f"fixture measured it); write --ckpt-format torch_dist "
                                           f"--use-distributed-optimizer (megatron-core 0.19's layer-wise distributed "
                                           f"optimizer), or resume it with --universal-checkpoint")
                for kind in kinds:
                    own = [g for g, identity in enumerate(identities[:len(rank_groups)])
                           if group_optimizer(identity, ucp.optimizer_type) == kind]
                    optimizers.append(_torch_state(ucp, [rank_groups[g] for g in own], mine, masters,
                                                   [identities[g] for g in own], OPTIMIZERS[kind]))
        sd["optimizer"] = optimizers if len(optimizers) > 1 else optimizers[0]
        if target.use_distributed_optimizer:
            distrib = distribs if len(distribs) > 1 else distribs[0]
        for optimizer in optimizers:
            _add_grad_scaler(optimizer, ucp, target)
        if ucp.scheduler_state:
            sd["opt_param_scheduler"] = dict(ucp.scheduler_state)
    if target.rng_state == "source":
        sd["rng_state"] = source_rng_state(ucp, tp_rank, pp_rank, tensor=SavedTensor)
    elif target.rng_state != "none":
        sd["rng_state"] = fresh_rng_state(target.args, ucp.iteration, tp_rank, pp_rank, layout.dp,
                                          target.rng_state, ep_rank, tensor=SavedTensor)
    flops = ucp.metadata.get("num_floating_point_operations_so_far")
    sd["num_floating_point_operations_so_far"] = flops if flops is not None else 0
    return sd, distrib


def _torch_state(ucp, rank_groups, canonicals, masters, identities, row) -> dict:
    """One torch optimizer's state_dict (FP32Optimizer), or Float16OptimizerWithFloat16Params' wrapper for 16-bit
    models; state indices run group by group, each parameter's state by its torch names (`row`, core/optimizers.py:
    Adam: its own step, then exp_avg, exp_avg_sq; SGD's and Muon's momentum_buffer; Lion's exp_avg)."""
    dtypes = {(c, local): _model_dtype(ucp, canonical) for (c, local), canonical in canonicals.items()}
    mixed = any(d != _F32 for d in dtypes.values())
    state, param_groups, fp32_from_16 = {}, [], []
    index = 0
    for g, members in enumerate(rank_groups):
        ids, halves = [], []
        for ref in members:
            chunk, local = ref
            entry = masters[chunk][local]
            info = ucp.parameters[canonicals[ref]]
            if not row.step:
                state[index] = {key: entry[key] for key in row.states}
            elif info.step is not None:  # torch Adam's step: a float32 scalar tensor
                state[index] = {"step": SavedTensor(struct.pack("<f", float(info.step)), "float32", ()),
                                **{key: entry[key] for key in row.states}}
            if dtypes[ref] != _F32:
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
    optimizer["grad_scaler"] = ucp.loss_scaler.to_megatron(SavedTensor)
    optimizer.update(items[1:])


def _distrib_optim(target: WriteTarget, pp_rank: int, chunks, tensors: _RankTensors, ucp, *,
                   experts: bool = False) -> dict:
    """One optimizer's distrib_optim.pt entry: each of its DDP buffers' fp32 master and moments, coalesced over
    buckets (the dense buffers, or the expert-parallel ones)."""
    config, layout = tensors.config, target.layout
    params = [[BufferParam(local, tuple(shape), _model_dtype(ucp, canonical),
                           expert=optimizer_index(canonical, config, layout) == 1)
               for local, shape, canonical in chunk if not is_buffer(canonical)] for chunk in chunks]
    names = [{local: (canonical, tuple(shape)) for local, shape, canonical in chunk} for chunk in chunks]
    out: dict = {"buckets_coalesced": True}
    gbuf = 0
    for chunk_index, buffers in enumerate(chunk_buffers(target, pp_rank, params, experts=experts)):
        for buf in buffers:
            spans = [(buf.coalesced_offset(span), *names[chunk_index][span.name]) for span in buf.params]
            world: dict = {key: tensors.buffer(buf.numel_unpadded, spans, source)
                           for key, source in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))}
            world["numel_unpadded"] = buf.numel_unpadded
            out[gbuf] = {(buf.param_dtype, buf.grad_dtype): world}
            gbuf += 1
    return out


# --------------------------------------------------------------------------------------------------
# Write


def write(ucp, config: GPTModelConfig, target: WriteTarget, root: Path,
          on_file: Optional[Callable[[Path, int], None]] = None, workers: int = 1) -> list[Path]:
    """Write the legacy checkpoint under `root` (a staging directory): every rank's files, by `workers`
    threads (one rank each at a time: copies in the kernel overlap the casting and checksumming of another
    rank), then the tracker file last. Memory: per thread, one rank's pickle and one band of tensor bytes."""
    layout = target.layout
    config = replace(config, padded_vocab_size=target.padded_vocab_size)
    check_layout(config, layout)
    groups = param_groups_by_rank(ucp, config, target) if ucp.has_optimizer_state else None
    iter_dir = Path(root) / iteration_dir_name(ucp.iteration)
    local = threading.local()
    opened: list[Sources] = []
    lock = threading.Lock()

    def write_rank(pp_rank: int, tp_rank: int, ep_rank: int) -> list[Path]:
        sources = getattr(local, "sources", None)
        if sources is None:  # one per thread: its open files are its own (NaN/Inf refused unless allowed)
            sources = local.sources = Sources(ucp, config, allow_non_finite=target.allow_non_finite)
            with lock:
                opened.append(sources)
        rank_dir = iter_dir / rank_dir_name(tp_rank, pp_rank, layout.pp, ep_rank, layout.ep)
        rank_dir.mkdir(parents=True, exist_ok=True)
        state, distrib = build_rank_state(ucp, config, target, groups, tp_rank, pp_rank, ep_rank, sources)
        paths = []
        for filename, obj in ((MODEL_FILENAME, state), (DISTRIB_OPTIM_FILENAME, distrib)):
            if obj is None:
                continue
            path = rank_dir / filename
            with open(path, "wb") as f:  # torch.save to a path names the archive's folder after the file
                save_streamed(obj, f, prefix=path.stem)
            paths.append(path)
        return paths

    def report(paths: list[Path]) -> None:
        for path in paths:
            if on_file:
                on_file(path, path.stat().st_size)

    ranks = [(p, t, e) for p in range(layout.pp) for t in range(layout.tp) for e in ep_ranks(config, layout)]
    written: list[Path] = []
    try:
        if workers <= 1:  # in this thread: each file reported before the next one is started
            for rank in ranks:
                paths = write_rank(*rank)
                report(paths)
                written += paths
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="legacy-writer") as pool:
                futures = [pool.submit(write_rank, *rank) for rank in ranks]
                try:
                    for future in concurrent.futures.as_completed(futures):
                        report(future.result())
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
            written = [path for future in futures for path in future.result()]  # in rank order
    finally:
        for sources in opened:
            sources.close()
    tracker = Path(root) / TRACKER_FILENAME
    tracker.write_text(str(ucp.iteration))
    return [*written, tracker]


class LegacyWriter(CheckpointWriter):
    """`--ckpt-format torch`: offline, one rank's files streamed at a time (see the module docstring).
    megatron-core 0.14 through 0.19 save the same legacy files (the same entries and layout); only the args they
    pickle differ: those of `target.release` (args_namespace), which from_universal chose
    (`megatron_core_version` is checked here)."""

    ckpt_format = "torch"
    OPTIONS = ("megatron_core_version", "workers")

    def __init__(self, megatron_core_version: Optional[str] = None, workers: Optional[int] = None):
        self.workers = writer_threads(workers)
        if megatron_core_version is not None:
            try:
                versions.release(megatron_core_version)
            except ValueError as e:
                raise WriteError(f"--megatron-core-version: {e}") from None

    def plan(self, ucp, target: WriteTarget, notes: list) -> list[PlannedFile]:
        return plan(ucp, ucp.config, target)

    def write(self, ucp, target: WriteTarget, root: Path, on_file=None) -> None:
        write(ucp, ucp.config, target, root, on_file=on_file, workers=self.workers)
