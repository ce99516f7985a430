"""megatron-core's DDP param/grad buffer index map, reproduced as pure functions.

Rules (megatron/core/distributed/param_and_grad_buffer.py and distributed_data_parallel.py,
core_v0.16.1), all checked against the fixtures:
- One DDP wrapper per model chunk (VPP chunk). Its parameters (`module.named_parameters()` with
  requires_grad) are split into dense (`allreduce` True) and expert-parallel ones; each set is
  grouped by (param dtype, grad dtype) in first-appearance order, grad dtype = fp32 with
  --accumulate-allreduce-grads-in-fp32 else the param dtype. One buffer per group; dense buffers
  of all chunks (chunk order) then come the dense distributed optimizer's gbuf indices, expert
  buffers of all chunks the expert optimizer's (sharded over the expert-DP group, same bucket size).
- Inside a buffer, parameters are laid out in REVERSE registration order.
- With the distributed optimizer every parameter start is rounded up to a multiple of 64 elements,
  and every bucket end is rounded up to a multiple of lcm(dp, 128) (dp: the DP x CP group; lcm(dp, 128, 2**16) with
  --ddp-pad-buckets-for-high-nccl-busbw). Without it there is no padding at all.
- A bucket closes once it holds >= bucket_size elements. bucket_size = --ddp-bucket-size or
  (--ddp-num-buckets: rank's total parameter count // num buckets) or max(4e7, 1e6 * DP x CP); it is
  None (one bucket) without --overlap-grad-reduce, on pipeline stages > 0 and for VPP chunks > 0.
- A `shared_embedding` parameter (with PP > 1, the word embedding and its last-stage copy: the tied output layer
  or the multi-token prediction stage's embedding; LanguageModule.setup_embeddings_and_output_layer) always gets a
  bucket of its own. The bucket before it is closed at the embedding's 64-aligned start, so its numel_unpadded
  counts that alignment padding (megatron-core 0.19.2's dp_reshardable save then fails: `dp_reshardable_saveable`).
- `numel_unpadded` of a bucket = end of its last parameter - bucket start (inner alignment padding
  counts, the bucket-end padding does not).
- The distributed optimizer's buffer state gathered over DP (get_parameter_state_dp_zero: distrib_optim.pt,
  dp_zero_gather_scatter, and what fully_reshardable saves from) is *compact*: the buckets' numel_unpadded
  elements one after the other (`coalesced_offset`). megatron-core 0.15-0.19's fully_reshardable save
  (sharded_param_state_fully_reshardable) slices it with the buffer's own offsets instead, so from bucket 1 on
  each parameter's saved state is the compact tensor's elements at the parameter's buffer offsets, zero-padded
  past its end (fixed on Megatron-LM main, NVIDIA/Megatron-LM#5077): `shifted_save_runs` says where each
  parameter's true state went.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.serialization.safe_pickle import TorchDType

PARAM_START_ALIGNMENT = 64  # elements: 128-byte aligned starts for >= 16-bit params
BUCKET_END_ALIGNMENT = 128  # elements, combined with the DP size via lcm
HIGH_NCCL_BUSBW_ALIGNMENT = 2 ** 16
DEFAULT_BUCKET_SIZE = 40_000_000
DEFAULT_BUCKET_SIZE_PER_DP_RANK = 1_000_000


@dataclass(frozen=True)
class BufferParam:
    """One parameter as DDP sees it, in registration order."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # a torch dtype, or a reader's torch-free safe_pickle.TorchDType
    shared_embedding: bool = False
    expert: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class DDPBucketConfig:
    """The DDP settings that decide the buffer index map of one model chunk."""

    dp_size: int  # size of the (intra) data-parallel x context-parallel group
    use_distributed_optimizer: bool
    bucket_size: Optional[int] = None  # None: one bucket per buffer
    pad_buckets_for_high_nccl_busbw: bool = False
    grad_reduce_in_fp32: bool = False

    @classmethod
    def from_megatron_args(cls, args: Mapping[str, Any], layout: ParallelLayout, *, pp_rank: int, vpp_chunk: int,
                           rank_num_parameters: int, experts: bool = False) -> "DDPBucketConfig":
        """As megatron/training/training.py get_model + DistributedDataParallel.__init__ build it, for the run's
        `layout` (its args' DDP settings from `args`).
        rank_num_parameters: all parameters of this (tp, pp) rank, all chunks (for --ddp-num-buckets).
        experts: the expert-parallel buffers (sharded over the expert-DP group; same bucket size)."""
        instances = args.get("num_distributed_optimizer_instances") or 1
        # the (intra) DP x CP group, or the expert-DP group (carved out of TP x CP x DP): the layout's, never the
        # args' (a writer's args are the source's until written)
        group = (layout.expert_dp if experts else layout.dp_cp) // instances
        bucket_size = None
        if args.get("overlap_grad_reduce") and layout.is_first_chunk(pp_rank, vpp_chunk) \
                and not args.get("overlap_param_gather_with_optimizer_step"):
            if args.get("ddp_num_buckets"):
                bucket_size = rank_num_parameters // args["ddp_num_buckets"]
            elif args.get("ddp_bucket_size") is not None:
                bucket_size = args["ddp_bucket_size"]
            else:
                bucket_size = max(DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_DP_RANK * layout.dp_cp)
        return cls(
            dp_size=group,
            # the layer-wise distributed optimizer (megatron-core 0.19's Lion / Muon with --use-distributed-optimizer)
            # lays out its scalar parameters' buffers for their DistributedOptimizer (the matrices' buffers are its
            # own and hold no checkpointed state)
            use_distributed_optimizer=bool(args.get("use_distributed_optimizer")
                                           or args.get("use_layer_wise_distributed_optimizer")),
            bucket_size=bucket_size,
            pad_buckets_for_high_nccl_busbw=bool(args.get("ddp_pad_buckets_for_high_nccl_busbw")),
            grad_reduce_in_fp32=bool(args.get("accumulate_allreduce_grads_in_fp32")),
        )


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter lives in its buffer: [start, end) in buffer elements."""

    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    bucket: int


@dataclass(frozen=True)
class Bucket:
    start: int
    end: int  # padded end
    numel_unpadded: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BufferLayout:
    """One DDP param/grad buffer: parameter spans (buffer order) and buckets."""

    param_dtype: Any  # of the kind its BufferParams have (torch dtype or TorchDType)
    grad_dtype: Any
    params: tuple[ParamSpan, ...]  # in buffer order (reverse registration order)
    buckets: tuple[Bucket, ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def numel_unpadded(self) -> int:
        return sum(b.numel_unpadded for b in self.buckets)

    def span(self, name: str) -> ParamSpan:
        for s in self.params:
            if s.name == name:
                return s
        raise KeyError(name)

    def coalesced_offset(self, span: ParamSpan) -> int:
        """Offset of `span` in the buffer with bucket-end padding removed (legacy distrib_optim.pt)."""
        removed = sum(b.numel - b.numel_unpadded for b in self.buckets[:span.bucket])
        return span.start - removed

    def padding_before(self, bucket: int) -> int:
        """Bucket-end padding of the buckets before `bucket`: what the compact (gathered) state lacks there."""
        return sum(b.numel - b.numel_unpadded for b in self.buckets[:bucket])

    def offset_in_bucket(self, span: ParamSpan) -> int:
        """Offset of `span` in its bucket's flat tensor (torch_dist dp_reshardable)."""
        return span.start - self.buckets[span.bucket].start

    def dp_reshardable_overrun(self, dp_size: int) -> Optional[int]:
        """The first bucket megatron-core (0.15-0.19) cannot save or load in torch_dist dp_reshardable form, or None.
        DistributedOptimizer.sharded_param_state_dp_reshardable declares each bucket as a tensor of numel_unpadded
        elements and pads the DP shard holding the bucket's last parameter up to the shard's end whenever that
        parameter ends before numel_unpadded; after a shared-embedding bucket split numel_unpadded counts the next
        parameter's alignment padding, and the pad then runs past the declared tensor (torch's planner refuses)."""
        for index, bucket in enumerate(self.buckets):
            ends = [s.end for s in self.params if s.bucket == index]
            last = max(ends) - bucket.start if ends else bucket.numel_unpadded
            local = bucket.numel // dp_size
            shard_end = -(-last // local) * local  # end of the DP shard holding the last parameter's last element
            if last < bucket.numel_unpadded < shard_end:
                return index
        return None


@dataclass(frozen=True)
class SavedRun:
    """`length` elements of one parameter's true state, from element `start` of it (flat, C order of its local
    shape): saved by the shifted save under parameter `source` from its element `source_start`, or nowhere
    (`source` None: the shifted save put buffer padding or another parameter's state in their place)."""

    start: int
    length: int
    source: Optional[str]
    source_start: int = 0


def shifted_save_runs(buffer: BufferLayout) -> dict[str, tuple[SavedRun, ...]]:
    """Where megatron-core 0.15-0.19's fully_reshardable save put each parameter's optimizer state (module
    docstring): parameter q's saved tensor is compact[q.start:q.end] (its buffer offsets applied to the compact
    tensor), while q's true state is compact[q.start - padding_before(q.bucket) : ...]. For every parameter whose
    saved state is not its own (a bucket after one with end padding), the runs of its true state in order, each
    found in the saved tensor of the parameter whose buffer offsets cover those compact elements, or lost where
    they fall on buffer padding. {} when no saved state is shifted."""
    windows = sorted(buffer.params, key=lambda s: s.start)  # the saved windows, in compact coordinates
    starts = [w.start for w in windows]
    out: dict[str, tuple[SavedRun, ...]] = {}
    for span in buffer.params:
        shift = buffer.padding_before(span.bucket)
        if shift == 0:
            continue
        lo, hi = span.start - shift, span.end - shift  # the true state's compact elements
        runs: list[SavedRun] = []
        pos = lo
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while pos < hi:
            w = windows[i] if i < len(windows) else None
            if w is not None and w.end <= pos:
                i += 1
                continue
            if w is None or w.start > pos:  # buffer padding under these compact elements: saved nowhere
                end = min(hi, w.start if w is not None else hi)
                runs.append(SavedRun(pos - lo, end - pos, None))
            else:
                end = min(hi, w.end)
                runs.append(SavedRun(pos - lo, end - pos, w.name, pos - w.start))
            pos = end
        out[span.name] = tuple(runs)
    return out


def _round_up(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def _float32_like(dtype: Any) -> Any:
    """float32 as the same kind of value as `dtype`: a TorchDType, or a torch dtype (torch is imported then)."""
    if isinstance(dtype, TorchDType):
        return TorchDType("float32")
    import torch

    return torch.float32


def build_buffer_layout(params: Sequence[BufferParam], config: DDPBucketConfig,
                        grad_dtype: Any = None) -> BufferLayout:
    """Index map of one buffer holding `params` (given in registration order, one dtype pair)."""
    if not params:
        raise ValueError("a DDP buffer needs at least one parameter")
    param_dtype = params[0].dtype
    grad_dtype = grad_dtype or (_float32_like(param_dtype) if config.grad_reduce_in_fp32 else param_dtype)
    distopt = config.use_distributed_optimizer
    if config.pad_buckets_for_high_nccl_busbw:
        end_divisor = math.lcm(config.dp_size, BUCKET_END_ALIGNMENT, HIGH_NCCL_BUSBW_ALIGNMENT)
    else:
        end_divisor = math.lcm(config.dp_size, BUCKET_END_ALIGNMENT)

    def pad_bucket_end(index: int) -> int:
        return _round_up(index, end_divisor) if distopt else index

    def pad_param_start(index: int) -> int:
        return _round_up(index, PARAM_START_ALIGNMENT) if distopt else index

    spans: list[ParamSpan] = []
    buckets: list[Bucket] = []
    bucket_start = 0
    bucket_count = 0  # params in the open bucket
    start = 0
    end = 0

    def close_bucket(last_param_end: int) -> int:
        nonlocal bucket_start, bucket_count
        bucket_end = pad_bucket_end(last_param_end)
        buckets.append(Bucket(bucket_start, bucket_end, last_param_end - bucket_start))
        bucket_start, bucket_count = bucket_end, 0
        return bucket_end

    for p in reversed(params):
        start = pad_param_start(start)
        own_bucket = p.shared_embedding and distopt
        if own_bucket and bucket_count > 0:
            start = close_bucket(start)
        end = start + p.numel
        spans.append(ParamSpan(p.name, tuple(p.shape), start, end, len(buckets)))
        bucket_count += 1
        if (config.bucket_size is not None and end - bucket_start >= config.bucket_size) or own_bucket:
            start = close_bucket(end)
        else:
            start = end
    if bucket_count > 0:
        close_bucket(end)
    layout = BufferLayout(param_dtype, grad_dtype, tuple(spans), tuple(buckets))
    if distopt:
        assert layout.numel % config.dp_size == 0
    return layout


def build_chunk_buffers(params: Sequence[BufferParam], config: DDPBucketConfig, *,
                        experts: bool = False) -> list[BufferLayout]:
    """All dense buffers of one model chunk, in DDP creation order (first appearance of each
    (param dtype, grad dtype)). Expert-parallel parameters (`expert`) live in separate buffers, returned
    instead with `experts` (megatron-core's expert_parallel_buffers; config then over the expert-DP group)."""
    groups: dict[tuple[Any, Any], list[BufferParam]] = {}
    for p in params:
        if p.expert != experts:
            continue
        grad_dtype = _float32_like(p.dtype) if config.grad_reduce_in_fp32 else p.dtype
        groups.setdefault((p.dtype, grad_dtype), []).append(p)
    return [build_buffer_layout(ps, config, grad_dtype=g) for (_, g), ps in groups.items()]


def shared_embedding_names(args: Mapping[str, Any], layout: ParallelLayout, *, pp_rank: int, vpp_chunk: int,
                           names: Sequence[str]) -> set[str]:
    """Parameters that megatron-core marks `shared_embedding` (LanguageModule.setup_embeddings_and_output_layer):
    with PP > 1 and tied embeddings or multi-token prediction, the first chunk's word embedding and the last
    chunk's copy of it (the MTP stage's own embedding, else the tied output layer)."""
    tied = not args.get("untie_embeddings_and_output_weights", False)
    mtp = bool(args.get("mtp_num_layers"))
    if not (tied or mtp) or layout.pp == 1:
        return set()
    pre, post = layout.is_first_chunk(pp_rank, vpp_chunk), layout.is_last_chunk(pp_rank, vpp_chunk)
    out = set()
    if pre and not post and "embedding.word_embeddings.weight" in names:
        out.add("embedding.word_embeddings.weight")
    if post and not pre:
        copy = "embedding.word_embeddings.weight" if mtp else "output_layer.weight"
        if copy in names:
            out.add(copy)
    return out
