"""Universal checkpoint -> megatron-core `torch_dist` checkpoint, written directly: offline, streaming.

The default `from-universal --ckpt-format torch_dist` writer. It writes what megatron-core 0.16.1's
`dist_checkpointing.save` writes for a local-spec GPTModel trained by Megatron-LM at the target layout
(Megatron-LM's training/checkpointing.py shows how it is called), without building the model: the same DCP
keys, global shapes and chunks, each distinct shard once (megatron-core's main-replica rule), the same
common.pt:

    iter_XXXXXXX/__<rank>_<n>.distcp   items: a torch.save archive per tensor chunk, a torch.save'd
                                       list per ShardedObject (rng_state, _extra_state, optimizer objects)
    iter_XXXXXXX/.metadata             DCP Metadata: state_dict_metadata (chunks), storage_data (where
                                       each item is), storage_meta, version
    iter_XXXXXXX/common.pt             args (target layout), checkpoint_version 3.0, iteration, optimizer
                                       (non-sharded part), opt_param_scheduler, FLOPs, content_metadata
    iter_XXXXXXX/metadata.json         {"sharded_backend": "torch_dist", ...}
    latest_checkpointed_iteration.txt  last

Entries (formats/torch_dist/reader.py documents them as the reader sees them):
- model: the rulebook's `torch_dist_key` (key and leading-axis indices: the global layer when layers are
  stacked, then the global expert); one chunk per block of the parameter's pattern (`rank_blocks`) per
  TP rank (one for replicated parameters); bf16 models store the fp32 main weight cast to bf16. A
  ShardedObject `<module>._extra_state/shard_<lead>_<lead sizes>` (None) per module of the rulebook's
  rows with `linear=True`, per layer (GPTModel drops the output layer's).
- optimizer, by format:
  - "dp_reshardable" (distributed optimizer, megatron-core's default): per model-parallel rank m, DDP
    buffer g and bucket b (formats/bucket_layout.py), `optimizer.distributed.dp_group_idx_m.gbuf_idx_g.
    dtype_(..).bucket_idx_b.{param,exp_avg,exp_avg_sq}` of global shape (bucket numel_unpadded,),
    chunked as DistributedOptimizer.sharded_param_state_dp_reshardable does: each DP rank's equal slice
    of the padded bucket split at parameter boundaries, gaps (64-element alignment) as chunks of their
    own (zeros here), nothing past numel_unpadded; plus the objects `.optimizer` (param groups with
    `step`), `.grad_scaler` (fp16), `.per_bucket_numel`, `.per_bucket_numel_unpadded`. Loads at this
    TP x PP only (any DP).
  - "fully_reshardable": `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`, chunked like the
    model key; param groups in common.pt. megatron-core loads it at any layout.
  - "fully_sharded_model_space" (what megatron-core 0.13/0.14 save and load; the default for them):
    `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>` in megatron-core's nd-flattened form
    (shape (*fragments, shard numel)), each TP shard one chunk at range start 0 (a DP rank's range loads from
    it), `.metadata` with `mcore_data` (each key's original global shape); param groups in common.pt.
  - "adam" (no distributed optimizer, any torch optimizer): `optimizer.state.<state>.<model key>` for each of the
    optimizer's states by its torch name (Adam: exp_avg, exp_avg_sq; SGD: momentum_buffer) (+ `fp32_param`
    for bf16/fp16 models); common.pt holds the param groups and `common_step`.
  - "layer_wise" (Lion / Muon with --use-distributed-optimizer: megatron-core 0.19's layer-wise distributed
    optimizer, args use_layer_wise_distributed_optimizer): the matrices' state in model space prefixed `chained_0.`
    (`fp32_param` for 16-bit models, then the emerging optimizer's states), the scalar parameters' dp_reshardable
    buckets of their own DDP buffers prefixed `chained_1.`; common.pt's optimizer {0: the matrices' groups, 1:
    {'param_state_sharding_type': 'dp_reshardable'}} (what MUB19's own save holds, key for key).
  - None: weights only (args.no_save_optim), when the universal checkpoint has no Adam state.
- `rng_state/shard_<pp>.<tp>_<PP>.<TP>`: a fresh deterministic state per (pp, tp) rank, as the legacy
  writer writes it (formats/megatron_state.py; `rng_state` "cuda" or "cpu"; "source": the stored states,
  at the source layout only; "none" omits it, args.no_save_rng).
- fp16: the loss scaler's state as `grad_scaler` next to the optimizer's param groups (an object of its
  own with dp_reshardable, in common.pt otherwise), where megatron-core's optimizers keep it.

How bytes move (bounded memory, at disk speed): tensor items are torch.save's archive framing without
their data (serialization/torch_save.py: torch.save's format written without torch, checked byte for byte
against torch.save by tests/test_torch_save.py); each item's data is the concatenation of pieces, each a run of
elements of a box of a universal tensor. A run that is contiguous in its universal tensor file and
needs no cast (dim-0 layouts, replicated, whole-width flat bucket ranges) is copied file to file with
copy_file_range (`UniversalCheckpoint.locate`), then the blocks it came from are checked against their
checksums (`verify_copied`, from the page cache); anything else (row-parallel TP slices, bf16 casts,
re-padded vocabulary rows, lazy universal checkpoints) is read in bands of rows through
`UniversalCheckpoint.read`, which checks every block it reads, and written with one pwrite per band.
Output files are written by `workers` threads; under torchrun the processes split the files
(`write_share`) and rank 0 writes .metadata, common.pt, metadata.json and the tracker last.

common.pt's args are Megatron-LM's Namespace at the target layout; its megatron enums (attention_backend,
model_type) are pickled as references to megatron-core's classes. Writing imports neither torch nor
megatron-core (~1.4 s and seconds of every command): every pickle and archive is built by
serialization/torch_save.py, casts to bf16/fp16 are numpy's (rounded as torch rounds), generator states by
run_state.cpu_generator_state.

Model rules (keys, shapes, placement, patterns, registration order, param groups) come from
adapters/gpt.py, the DDP index map from formats/bucket_layout.py; this module only lays out the format.

Mixture of experts (docs/MOE_CHECKPOINTS.md): routed experts' keys carry the global expert axis (after the
layer axis when stacked), chunked over ETP and written by a rank of their EP rank; their `_extra_state`
objects are one per global expert. With experts in their own optimizer (EP > 1 or ETP != TP: megatron-core's
ChainedOptimizer [dense, expert]) dp_reshardable keys are prefixed `chained_0.` (dense buckets over TP x PP
x DP) and `chained_1.` (each EP rank's local experts' buckets, `dp_group_idx` over ETP x EP x PP, chunked
over the expert-DP group), common.pt's optimizer is {0: dense, 1: expert}, and RNG states are sharded per
(pp, tp, dp) rank. tests/test_moe_universal.py compares these with megatron-core's own saves.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import json
import math
import os
import struct
import threading
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from megatron_ucp.adapters.gpt import (
    POST, PRE, emerging_matrix, expected_parameters, expert_location, experts_in_own_optimizer, is_buffer, is_expert, local_name,
    parameters_for_rank, pattern_for, rule_for, torch_dist_key, torch_dist_lead_shape, tp_size_of)
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.core import versions
from megatron_ucp.core.optimizers import OPTIMIZERS, group_optimizer, run_optimizers
from megatron_ucp.formats.common import TRACKER_FILENAME, iteration_dir_name
from megatron_ucp.formats.megatron_state import (
    CHECKPOINT_VERSION, MODEL_DTYPES, TargetGroups, args_values, chunk_buffers, fresh_rng_state, group_hyper,
    param_groups_by_rank, rank_buffer_params, source_rng_state)
from megatron_ucp.serialization.safe_pickle import TorchDType
from megatron_ucp.formats.torch_dist.names import (
    COMMON_FILENAME, COMMON_STATE_ITEM, DCP_METADATA_FILENAME, METADATA_JSON_FILENAME, RERUN_STATE_KEY, RNG_STATE_KEY,
    chained_prefix, distcp_name, distributed_optimizer_object_key, extra_state_key, flat_bucket_key,
    model_space_state_key, parse_model_space_state_key, sharded_object_key)
from megatron_ucp.serialization.torch_save import (
    EnumMember, GlobalRef, Obj, SavedTensor, TorchSize, pickle_bytes, save_bytes, tensor_archive,
    torch_dtype)
from megatron_ucp.formats.writer_base import CheckpointWriter, PlannedFile, WriteError, WriteTarget, writer_threads
from megatron_ucp.io import integrity
from megatron_ucp.formats.universal_pieces import (Gap, Piece, Sources, box_numel, box_of, local_flat_pieces,
                                                   shared_rows_key, write_piece, write_sharing_rows)

# the distributed optimizer's torch_dist formats megatron-ucp writes (core/versions.OPTIMIZER_SHARDINGS)
OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")
_F32 = MODEL_DTYPES["float32"]
_STATE_NAMES = {"fp32": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # universal -> bucket key
# megatron-core 0.19's layer-wise distributed optimizer (Lion / Muon with --use-distributed-optimizer): a
# ChainedOptimizer [LayerWiseDistributedOptimizer([the emerging optimizer]), the scalar parameters' DistributedOptimizer]:
# the matrices' state in model space under 'chained_0.', the scalars' dp_reshardable buckets under 'chained_1.'
LAYER_WISE = "layer_wise"


class TorchDistWriteError(WriteError):
    """The universal checkpoint cannot be written as torch_dist as asked; the message says why and the fix."""


# --------------------------------------------------------------------------------------------------
# megatron-core's spelling of torch_dist entries


def content_metadata(use_distributed_optimizer: bool, optimizer_format: Optional[str]) -> dict:
    """common.pt['content_metadata'] as Megatron-LM 0.16.1 saves it (`_build_sharded_state_dict_metadata`):
    how its load must build the optimizer's sharded state dict."""
    metadata: dict = {}
    if use_distributed_optimizer:  # first, as in Megatron-LM's own saves (fixture B)
        metadata["distrib_optim_sharding_type"] = optimizer_format
        if optimizer_format == "fully_reshardable":
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return {**metadata, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def flattened_state_item(saved: str, global_shape: tuple, offsets: tuple, sizes: tuple, piece: "Piece") -> "TensorItem":
    """fully_sharded_model_space (megatron-core 0.13/0.14): one TP-local shard (a block of the model tensor) of
    optimizer state as megatron-core's nd-flattened reformulation saves it: the tensor has shape (*fragments per
    axis, shard numel), the shard is fragment offsets // sizes, flattened whole (range [0, numel): any DP split
    loads from it); `.metadata` records the original global shape (mcore_data)."""
    grid = tuple(g // n for g, n in zip(global_shape, sizes))
    numel = math.prod(sizes)
    return TensorItem(saved, grid + (numel,), tuple(o // n for o, n in zip(offsets, sizes)) + (0,),
                      (1,) * len(sizes) + (numel,), _F32, (piece,))


# --------------------------------------------------------------------------------------------------
# The plan (pure: from the universal metadata and the rulebook; no tensor is read)


@dataclass(frozen=True)
class TensorItem:
    """One saved chunk of a DCP tensor: its bytes are `pieces` in order, cast to `dtype`."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: TorchDType
    pieces: tuple[Union[Piece, Gap], ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.dtype.itemsize


@dataclass(frozen=True)
class ObjectItem:
    """A megatron-core ShardedObject; `key` is its unique key, the item is torch.save([value])."""

    key: str
    value: Any = field(compare=False)

    nbytes = 0


Item = Union[TensorItem, ObjectItem]


@dataclass(frozen=True)
class OutputFile:
    name: str  # __<rank>_<n>.distcp
    items: tuple[Item, ...]

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)


@dataclass(frozen=True)
class DirectPlan:
    """Every .distcp file with its items, and common.pt's content."""

    files: tuple[OutputFile, ...]
    common: Optional[dict] = field(compare=False)  # common.pt's content; None where it is a ShardedObject item
    iteration: int = 0
    padded_vocab_size: int = 0
    optimizer: Optional[str] = None  # 'dp_reshardable' | 'fully_reshardable' | 'adam' | None (weights only)
    release: versions.MegatronRelease = versions.NEWEST  # the megatron-core release whose save this is
    source_release: Optional[versions.MegatronRelease] = None  # whose run the args come from (WriteTarget)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


@dataclass(frozen=True)
class WrittenItem:
    """Where an item went: DCP's storage_data entry (_StorageInfo), by item key and chunk offsets."""

    key: str
    offsets: Optional[tuple[int, ...]]  # None for objects
    relative_path: str
    offset: int
    length: int


def _model_dtype(ucp, name: str) -> TorchDType:
    return MODEL_DTYPES[ucp.parameters[name].model_dtype]


class _Owners:
    """Which rank writes each item: fixed for data that lives on one DP x CP rank, else the least-loaded rank of its
    (tp, pp) rank's DP x CP group (what megatron-core's fully parallel save balances over: Megatron-LM's
    parallelization group is the data-parallel group with context parallelism)."""

    def __init__(self, layout: ParallelLayout, files_per_rank: int):
        self.layout, self.files_per_rank = layout, files_per_rank
        self.items: dict[int, list] = {}
        self.load: dict[int, int] = {}

    def add(self, item: Item, tp_rank: int, pp_rank: int, dp_cp_rank: Optional[int] = None) -> None:
        if dp_cp_rank is None:
            self.add_any(item, [self.layout.global_rank(tp_rank, pp_rank, d) for d in range(self.layout.dp_cp)])
        else:
            self.add_any(item, [self.layout.global_rank(tp_rank, pp_rank, dp_cp_rank)])

    def add_expert(self, item: Item, etp_rank: int, ep_rank: int, pp_rank: int) -> None:
        """A routed expert's item: written by the least loaded rank of its (expert-TP, EP, PP) rank's expert-DP
        group."""
        self.add_any(item, [self.layout.expert_global_rank(etp_rank, ep_rank, d, pp_rank)
                            for d in range(self.layout.expert_dp)])

    def add_any(self, item: Item, ranks: list) -> None:
        """Written by the least loaded of `ranks` (global ranks)."""
        rank = min(ranks, key=lambda r: (self.load.get(r, 0), r))
        self.items.setdefault(rank, []).append(item)
        self.load[rank] = self.load.get(rank, 0) + item.nbytes

    def files(self) -> tuple[OutputFile, ...]:
        """Each rank's items in `files_per_rank` files (the save strategy's writer threads): objects dealt
        round-robin, tensors largest first into the lightest file (megatron-core's _split_by_size_and_type)."""
        out = []
        per_rank = self.files_per_rank
        for rank in sorted(self.items):
            bins: list[list] = [[] for _ in range(per_rank)]
            objects = [i for i in self.items[rank] if isinstance(i, ObjectItem)]
            tensors = sorted((i for i in self.items[rank] if isinstance(i, TensorItem)), key=lambda i: -i.nbytes)
            for n, item in enumerate(objects):
                bins[n % per_rank].append(item)
            heap = [(0, n) for n in range(per_rank)]
            for item in tensors:
                size, n = heapq.heappop(heap)
                bins[n].append(item)
                heapq.heappush(heap, (size + item.nbytes, n))
            out += [OutputFile(distcp_name(rank, n), tuple(b)) for n, b in enumerate(bins) if b]
        return tuple(out)


def optimizer_kind(ucp, target: WriteTarget, optimizer_format: Optional[str],
                   default: str = "dp_reshardable") -> Optional[str]:
    """The optimizer entries to write: the distributed optimizer's format (default: the target release's, as
    its Megatron-LM saves), 'adam' without it, None when the universal checkpoint holds no Adam state."""
    if optimizer_format is not None and not target.use_distributed_optimizer:
        raise TorchDistWriteError(f"--optimizer-format {optimizer_format} describes the distributed optimizer's "
                                  f"state: add --use-distributed-optimizer, or drop --optimizer-format")
    if not ucp.has_optimizer_state:
        if optimizer_format is not None:
            raise TorchDistWriteError(f"{ucp.path}: holds no optimizer state, so there is no {optimizer_format} "
                                      f"state to write; drop --optimizer-format")
        return None
    if target.use_distributed_optimizer and target.args.get("use_layer_wise_distributed_optimizer"):
        if optimizer_format not in (None, "dp_reshardable"):
            raise TorchDistWriteError(
                f"--optimizer-format {optimizer_format}: megatron-ucp writes the layer-wise distributed optimizer "
                f"(--optimizer {ucp.optimizer_type} with --use-distributed-optimizer) as dp_reshardable only (what "
                f"megatron-core 0.19 saves by default, the measured one); drop --optimizer-format")
        return LAYER_WISE
    if target.use_distributed_optimizer:
        return optimizer_format or default
    return "adam"


def plan_checkpoint(ucp, target: WriteTarget, optimizer_format: Optional[str] = None) -> DirectPlan:
    """Every item of the checkpoint, which file holds it, and the common state, as megatron-core
    `target.release` saves them. Raises TorchDistWriteError."""
    release = target.release
    layout = target.layout
    config = replace(ucp.config, padded_vocab_size=target.padded_vocab_size)
    opt = optimizer_kind(ucp, target, optimizer_format, release.distrib_optim_default)
    refusal = versions.load_refusal(release, "dp_reshardable" if opt == LAYER_WISE else opt) if (
        opt in (*OPTIMIZER_FORMATS, LAYER_WISE)) else None
    if refusal:
        raise TorchDistWriteError(refusal)
    shapes = dict(expected_parameters(config, layout))
    step = _single_step(ucp) if opt is not None else None
    groups = _rank_param_groups(ucp, config, target) if opt is not None else None
    owners = _Owners(layout, versions.torch_dist_files_per_rank(release, target.args))
    if opt in ("dp_reshardable", LAYER_WISE):  # first: their items have fixed owners, the replicated ones balance
        _plan_flat_buckets(ucp, config, target, shapes, step, groups, owners)
    _plan_model(ucp, config, layout, opt, shapes, owners)
    _plan_extra_states(config, layout, shapes, owners)
    if target.rng_state != "none":
        _plan_rng(ucp, config, target, owners, release)
    common = _common_state(ucp, target, opt, step, groups, release)
    if versions.saves_rerun_state(release, target.args):
        world = layout.world_size
        for rank in range(world):
            owners.add_any(ObjectItem(sharded_object_key(RERUN_STATE_KEY, (rank,), (world,)),
                                      _rerun_sharded_state(target.args)), [rank])
    if release.torch_dist_common == "sharded":  # megatron-core >= 0.19: rank 0 saves it as a ShardedObject
        owners.add_any(ObjectItem(COMMON_STATE_ITEM, _common_for_pickle(common, release, target.source_release)), [0])
        common = None
    return DirectPlan(owners.files(), common, ucp.iteration, target.padded_vocab_size, opt, release,
                      target.source_release)


_RERUN = "megatron.core.rerun_state_machine."


def _rerun_sharded_state(args: dict) -> dict:
    """What a rank's rerun state machine saves when no rerun is pending (RerunStateMachine.state_dict: the
    sentinel megatron-core keeps so that every save has the same structure)."""
    injection = args.get("error_injection_type") or "transient_error"
    return {"rerun_requested": False, "checkpoint_requested": False, "restart_again_requested": False,
            "continue_requested": False,
            "error_injector_checkpoint": {"error_injection_rate": args.get("error_injection_rate") or 0,
                                          "error_injection_type": EnumMember(GlobalRef(_RERUN + "RerunDiagnostic"),
                                                                             injection),
                                          "injected_error_type": None},
            "failed_validation_call": None, "initial_result": None, "suspicious_node": None,
            "suspicious_device": None, "data_iterator_checkpoints": None, "large_value_counts": {}, "max_values": {}}


def _plan_rng(ucp, config: GPTModelConfig, target: WriteTarget, owners: _Owners,
              release: versions.MegatronRelease) -> None:
    """`rng_state` objects: one per (pp, tp) rank; with expert parallelism one per (pp, tp, DP x CP) rank where the
    release shards it so (Megatron-LM 0.16: each DP x CP rank has its own expert-parallel stream)."""
    layout = target.layout
    per_dp = bool(config.num_experts) and layout.ep > 1 and release.rng_per_dp_with_experts
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            for dp_rank in (range(layout.dp_cp) if per_dp else (None,)):
                ep_rank = 0
                if per_dp:
                    ep_rank = layout.expert_coordinates(layout.global_rank(tp_rank, pp_rank, dp_rank))[1]
                if target.rng_state == "source":
                    value = source_rng_state(ucp, tp_rank, pp_rank, SavedTensor, dp_rank=dp_rank)
                else:
                    value = fresh_rng_state(target.args, ucp.iteration, tp_rank, pp_rank, layout.dp, target.rng_state,
                                            ep_rank, tensor=SavedTensor)
                if per_dp:
                    key = sharded_object_key(RNG_STATE_KEY, (pp_rank, tp_rank, dp_rank),
                                             (layout.pp, layout.tp, layout.dp_cp))
                else:
                    key = sharded_object_key(RNG_STATE_KEY, (pp_rank, tp_rank), (layout.pp, layout.tp))
                owners.add(ObjectItem(key, value), tp_rank, pp_rank, dp_rank or 0)


def _single_step(ucp) -> Optional[int]:
    # buffers: no Adam state; under an emerging optimizer its own parameters keep no step, its scalar Adam's do
    emerging = len(run_optimizers(ucp.optimizer_type, ucp.args)) > 1
    steps = {info.step for name, info in ucp.parameters.items()
             if not is_buffer(name) and not (emerging and info.step is None)} or {None}
    if len(steps) > 1:
        raise TorchDistWriteError(
            f"{ucp.path}: parameters have different Adam steps {sorted(s for s in steps if s is not None)}; "
            f"megatron-core's torch_dist optimizer state keeps one step: write --ckpt-format torch (one step per "
            f"parameter)")
    return steps.pop()


def _rank_param_groups(ucp, config: GPTModelConfig, target: WriteTarget) -> Optional[TargetGroups]:
    try:
        return param_groups_by_rank(ucp, config, target)
    except WriteError as e:
        raise TorchDistWriteError(str(e)) from e


def _plan_model(ucp, config: GPTModelConfig, layout: ParallelLayout, opt: Optional[str], shapes: dict,
                owners: _Owners) -> None:
    """Model tensors, and model-space optimizer state (fully_reshardable, plain Adam) chunked like them
    (fully_sharded_model_space: each chunk flattened)."""
    for name, shape in shapes.items():
        key, lead = torch_dist_key(name, config)
        pp_rank = local_name(name, layout, config.num_layers, tied=config.tied, config=config)[0][0]
        dtype = _model_dtype(ucp, name)
        global_shape = torch_dist_lead_shape(name, config) + tuple(shape)
        states = []  # (saved key, universal tensor); persistent buffers (MoE's expert_bias) have no optimizer state
        if opt == LAYER_WISE and emerging_matrix(name, shape):  # the layer-wise optimizer's own: model space
            prefix = chained_prefix(0)
            if dtype != _F32:  # Float16OptimizerWithFloat16Params' main weight
                states.append((model_space_state_key("fp32_param", key, prefix), "fp32"))
            states += [(model_space_state_key(s, key, prefix), s) for s in ucp.parameters[name].tensors[1:]]
        if opt in ("fully_reshardable", "fully_sharded_model_space", "adam") and not is_buffer(name):
            if opt in OPTIMIZER_FORMATS:
                main = versions.optimizer_sharding(opt).main_param
                states.append((model_space_state_key(main, key), "fp32"))
            elif dtype != _F32:
                states.append((model_space_state_key("fp32_param", key), "fp32"))
            # by name: the states of the optimizer stepping it (an emerging optimizer's or its scalar one's)
            states += [(model_space_state_key(s, key), s) for s in ucp.parameters[name].tensors[1:]]
        pattern, tp = pattern_for(name, config), tp_size_of(name, layout)
        ep_rank = expert_location(lead[-1], config, layout)[0] if is_expert(name) else None

        def add(item: TensorItem, tp_rank: int) -> None:
            if ep_rank is None:
                owners.add(item, tp_rank, pp_rank)
            else:  # a routed expert's chunk: on the ranks of its EP rank and expert-TP rank
                owners.add_expert(item, tp_rank, ep_rank, pp_rank)

        for tp_rank in range(1 if pattern.dim is None else tp):
            for block in pattern.rank_blocks(shape, tp_rank, tp, name=name):
                box = box_of(block)
                offsets = tuple(lead) + tuple(a for a, _ in box)
                sizes = (1,) * len(lead) + tuple(b - a for a, b in box)
                numel = box_numel(box)
                add(TensorItem(key, global_shape, offsets, sizes, dtype, (Piece(name, "fp32", box, 0, numel),)), tp_rank)
                for saved, state in states:
                    piece = Piece(name, state, box, 0, numel)
                    add(flattened_state_item(saved, global_shape, offsets, sizes, piece)
                        if opt == "fully_sharded_model_space" else
                        TensorItem(saved, global_shape, offsets, sizes, _F32, (piece,)), tp_rank)


def _plan_extra_states(config: GPTModelConfig, layout: ParallelLayout, shapes: dict, owners: _Owners) -> None:
    """megatron-core's local-spec linear modules save an `_extra_state` (None): one ShardedObject per module of
    the rulebook's `linear` rows per layer (and expert), keyed like the module's weight. A load asks for
    them, so they must be written; GPTModel drops the output layer's."""
    seen = set()
    for name in shapes:
        rule = rule_for(name)
        if not rule.linear or rule.scope in (PRE, POST):  # the embedding has none, GPTModel drops the output layer's
            continue
        key, lead = torch_dist_key(name, config)
        offset, sizes = (lead, torch_dist_lead_shape(name, config)) if lead else ((0,), (1,))  # per-layer keys: one object
        object_key = sharded_object_key(extra_state_key(key), offset, sizes)
        if object_key in seen:
            continue
        seen.add(object_key)
        pp_rank = local_name(name, layout, config.num_layers, tied=config.tied, config=config)[0][0]
        owners.add(ObjectItem(object_key, None), 0, pp_rank, 0)


def _rank_buffers(ucp, config: GPTModelConfig, target: WriteTarget, pp_rank: int, ep_rank: int = 0,
                  experts: bool = False) -> tuple[list, list]:
    """(per chunk: [(local name, local shape, canonical)], per chunk: the DDP buffers megatron-core builds) of one
    (pp, ep) rank: the dense buffers, or with `experts` the expert-parallel ones (its local experts)."""
    layout = target.layout
    chunks = [parameters_for_rank(config, layout, pp_rank, chunk if layout.vpp else None, ep_rank=ep_rank)
              for chunk in range(layout.num_chunks)]
    params = rank_buffer_params(ucp, config, layout, pp_rank, ep_rank)
    if target.args.get("use_layer_wise_distributed_optimizer"):  # the scalar parameters' own DDP buffers
        params = [[p for p in chunk if not emerging_matrix(p.name, p.shape)] for chunk in params]
    return chunks, chunk_buffers(target, pp_rank, params, experts=experts)


def _plan_flat_buckets(ucp, config: GPTModelConfig, target: WriteTarget, shapes: dict, step, groups: Optional[TargetGroups],
                       owners: _Owners) -> None:
    """DistributedOptimizer.sharded_param_state_dp_reshardable, for every rank of each optimizer: the dense one
    over (tp, pp) x DP, and with experts in their own optimizer (megatron-core's ChainedOptimizer, keys prefixed
    `chained_<i>.`) the expert one over (etp, ep, pp) x expert-DP."""
    layout = target.layout
    chained = experts_in_own_optimizer(config, layout)
    layer_wise = bool(target.args.get("use_layer_wise_distributed_optimizer"))
    for index in ((0, 1) if chained else (0,)):
        experts = index == 1
        prefix = chained_prefix(1 if layer_wise else index if chained else None)
        for pp_rank in range(layout.pp):
            for ep_rank in (range(layout.ep) if experts else (0,)):
                chunks, buffers = _rank_buffers(ucp, config, target, pp_rank, ep_rank, experts)
                canonical = {(c, local): name for c, chunk in enumerate(chunks) for local, _, name in chunk}
                identities = groups.identities[index][:len(groups.members[index][(0, ep_rank, pp_rank)])]
                if layer_wise:  # the scalar optimizer's groups
                    identities = [i for i in identities if group_optimizer(i, ucp.optimizer_type) != ucp.optimizer_type]
                for tp_rank in range(layout.expert_tp if experts else layout.tp):
                    if experts:
                        mp, dp_size = layout.expert_mp_rank(tp_rank, ep_rank, pp_rank), layout.expert_dp
                        ranks = [layout.expert_global_rank(tp_rank, ep_rank, d, pp_rank) for d in range(dp_size)]
                    else:
                        mp, dp_size = layout.dense_mp_rank(tp_rank, pp_rank), layout.dp_cp
                        ranks = [layout.global_rank(tp_rank, pp_rank, d) for d in range(dp_size)]
                    _plan_rank_buckets(ucp, config, layout, shapes, step, identities, buffers, canonical, prefix, mp,
                                       tp_rank, pp_rank, ranks, owners, _grad_scaler(ucp, target))


def _plan_rank_buckets(ucp, config, layout, shapes, step, identities, buffers, canonical, prefix: str, mp: int,
                       tp_rank: int, pp_rank: int, ranks: list, owners: _Owners, scaler) -> None:
    """One model-parallel rank `mp` of one optimizer: its buckets' chunks per DP rank (`ranks`: the global rank
    of each DP rank of its group, which writes that DP rank's chunks), and its objects (DP rank 0's)."""
    numel, unpadded, gbuf = [], [], 0
    for chunk_index, chunk_buffers_ in enumerate(buffers):
        for buf in chunk_buffers_:
            overrun = buf.dp_reshardable_overrun(len(ranks))
            if overrun is not None:
                raise TorchDistWriteError(
                    f"bucket {overrun} of buffer {gbuf} of {prefix}dp_group_idx_{mp} (pp={pp_rank}): megatron-core "
                    f"0.15-0.19 can neither save nor load it as dp_reshardable (the shared-embedding bucket split "
                    f"leaves numel_unpadded {buf.buckets[overrun].numel_unpadded} past the bucket's last parameter; "
                    f"docs/VERSIONS.md); write --optimizer-format fully_reshardable or --ckpt-format torch")
            dtypes = (buf.param_dtype, buf.grad_dtype)
            numel.append({dtypes: [b.numel for b in buf.buckets]})
            unpadded.append({dtypes: [b.numel_unpadded for b in buf.buckets]})
            for b, bucket in enumerate(buf.buckets):
                spans = [s for s in buf.params if s.bucket == b]

                def flat(span, lo, hi, state, chunk_index=chunk_index):
                    name = canonical[(chunk_index, span.name)]
                    return local_flat_pieces(config, layout, name, shapes[name], tp_rank, state, lo, hi)

                where = f"bucket {b} of buffer {gbuf} of {prefix}dp_group_idx_{mp} (pp={pp_rank})"
                for rank, chunk_list in zip(ranks, _bucket_chunks(bucket, spans, len(ranks), flat, where)):
                    for universal_key, saved_name in _STATE_NAMES.items():
                        for offset, size, pieces in chunk_list:
                            owners.add_any(TensorItem(prefix + flat_bucket_key(mp, gbuf, dtypes, b, saved_name),
                                                      (bucket.numel_unpadded,), (offset,), (size,), _F32,
                                                      pieces(universal_key)), [rank])
            gbuf += 1
    param_groups = [{**group_hyper(ucp, identity), "step": float(step or 0)} for identity in identities]
    objects = [("optimizer", {"param_groups": param_groups})]
    if scaler is not None:  # DistributedOptimizer.state_dict() keeps it next to 'optimizer'
        objects.append(("grad_scaler", scaler))
    for name, value in (*objects, ("per_bucket_numel", numel), ("per_bucket_numel_unpadded", unpadded)):
        owners.add_any(ObjectItem(sharded_object_key(prefix + distributed_optimizer_object_key(mp, name), (0,), (1,)),
                                  value), ranks[:1])


def _bucket_chunks(bucket, spans, dp: int, flat_pieces: Callable, where: str) -> list:
    """Per DP rank: [(chunk offset, chunk size, state -> pieces)] of one bucket, in bucket order.

    DP rank d owns [d*L, (d+1)*L) of the padded bucket (L = numel / dp). Its chunks are the parameters'
    pieces in it, and a gap chunk wherever the next piece (or the slice end) does not follow, unless the
    gap starts at or past numel_unpadded (the bucket-end padding is not saved)."""
    shard = bucket.numel // dp
    out = []
    for d in range(dp):
        lo, hi = bucket.start + d * shard, bucket.start + (d + 1) * shard
        mine = [(s, max(s.start, lo), min(s.end, hi)) for s in spans if s.start < hi and s.end > lo]
        if not mine:
            raise TorchDistWriteError(f"{where}: DP rank {d} of {dp} holds no parameter (only padding), which "
                                      f"megatron-core's distributed optimizer refuses; choose a smaller DP")
        chunks: list = []

        def gap(start: int, stop: int) -> None:
            if stop > start and d * shard + start < bucket.numel_unpadded:
                chunks.append((d * shard + start, stop - start, lambda state, n=stop - start: (Gap(n),)))

        cursor = 0  # in the DP rank's slice
        for span, a, b in mine:
            gap(cursor, a - lo)
            chunks.append((d * shard + a - lo, b - a, lambda state, span=span, a=a, b=b: tuple(
                flat_pieces(span, a - span.start, b - span.start, state))))
            cursor = b - lo
        gap(cursor, shard)
        out.append(chunks)
    return out


def _grad_scaler(ucp, target: WriteTarget) -> Optional[dict]:
    """fp16: the loss scaler's state as megatron-core's optimizers keep it under 'grad_scaler' (None otherwise:
    the run then starts a fresh scaler from its flags)."""
    if not target.args.get("fp16") or ucp.loss_scaler is None:
        return None
    return ucp.loss_scaler.to_megatron(SavedTensor)


def _optimizer_common(ucp, target: WriteTarget, opt: str, step, groups: TargetGroups, index: int, mixed: bool) -> dict:
    """What one optimizer (0 dense, 1 expert) keeps in common.pt: rank 0's param groups (it writes common.pt)."""
    hyper = [group_hyper(ucp, i) for i in groups.identities[index][:len(groups.members[index][(0, 0, 0)])]]
    scaler = _grad_scaler(ucp, target)
    if opt == "dp_reshardable":
        return {"param_state_sharding_type": "dp_reshardable"}
    if opt in ("fully_reshardable", "fully_sharded_model_space"):
        out: dict = {"optimizer": {"param_groups": [{**g, "step": float(step or 0)} for g in hyper]}}
        if scaler is not None:
            out["grad_scaler"] = scaler
        out["param_state_sharding_type"] = opt
        return out
    # FP32Optimizer, or Float16OptimizerWithFloat16Params around it for 16-bit models
    inner: dict = {"state": {}, "param_groups": hyper}
    if step:  # megatron-core saves the shared step only when non-zero
        inner["state"]["common_step"] = SavedTensor(struct.pack("<f", float(step)), "float32", ())
    out = {"optimizer": inner} if mixed else inner
    if mixed and scaler is not None:
        out["grad_scaler"] = scaler
    return out


def _kind_hyper(ucp, groups: TargetGroups, kind: str) -> list:
    """Rank 0's param groups of one optimizer of an emerging optimizer's chain (those of its kind)."""
    identities = groups.identities[0][:len(groups.members[0][(0, 0, 0)])]
    return [group_hyper(ucp, i) for i in identities if group_optimizer(i, ucp.optimizer_type) == kind]


def _emerging_common(ucp, target: WriteTarget, step, groups: TargetGroups, kind: str, mixed: bool) -> dict:
    """One optimizer of an emerging optimizer's chain as megatron-core 0.19 keeps it in the common state: its
    param groups (those of its kind), and for Adam the shared step; the emerging optimizer itself keeps no 'state'
    (LIA19, MUA19)."""
    hyper = _kind_hyper(ucp, groups, kind)
    inner: dict = {"param_groups": hyper}
    if OPTIMIZERS[kind].step:
        inner = {"state": {}, "param_groups": hyper}
        if step:  # megatron-core saves the shared step only when non-zero
            inner["state"]["common_step"] = SavedTensor(struct.pack("<f", float(step)), "float32", ())
    if mixed:
        raise TorchDistWriteError(f"{ucp.path}: {ucp.optimizer_type} state of a 16-bit model without the distributed "
                                  f"optimizer: megatron-ucp writes that chain for fp32 models only (no 16-bit fixture "
                                  f"measured it); add --use-distributed-optimizer (megatron-core 0.19's layer-wise "
                                  f"distributed optimizer, how its 16-bit Lion / Muon runs train), or resume it with "
                                  f"--universal-checkpoint")
    return inner


def _common_state(ucp, target: WriteTarget, opt: Optional[str], step, groups: Optional[TargetGroups],
                  release: versions.MegatronRelease) -> dict:
    """The common state (common.pt or the ShardedObject 'common_state'): what dist_checkpointing.save keeps of
    Megatron-LM's state dict besides sharded entries."""
    args = dict(target.args)
    args["rank"] = args["local_rank"] = 0  # common.pt is rank 0's
    args["dist_ckpt_optim_fully_reshardable"] = opt == "fully_reshardable"
    if opt is None:
        args["no_save_optim"] = True
    if target.rng_state == "none":
        args["no_save_rng"] = True
    common: dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,  # args: a Namespace when written
                    "iteration": ucp.iteration}
    if opt is not None:
        chained = experts_in_own_optimizer(ucp.config, target.layout)
        mixed = any(_model_dtype(ucp, n) != _F32 for n in ucp.parameters)
        kinds = run_optimizers(ucp.optimizer_type, ucp.args)
        if opt == LAYER_WISE:  # {0: the layer-wise optimizer's Float16 wrapper (groups), 1: the DistributedOptimizer's}
            hyper = _kind_hyper(ucp, groups, kinds[0])
            common["optimizer"] = {0: {"optimizer": {"param_groups": hyper}} if mixed else {"param_groups": hyper},
                                   1: {"param_state_sharding_type": "dp_reshardable"}}
        elif len(kinds) > 1:  # an emerging optimizer's ChainedOptimizer: {0: its own, 1: its scalar optimizer}
            common["optimizer"] = dict(enumerate(_emerging_common(ucp, target, step, groups, kind, mixed)
                                                 for kind in kinds))
        else:
            states = [_optimizer_common(ucp, target, opt, step, groups, index, mixed)
                      for index in ((0, 1) if chained else (0,))]
            common["optimizer"] = dict(enumerate(states)) if chained else states[0]  # ChainedOptimizer: {0: .., 1: ..}
        common["opt_param_scheduler"] = dict(ucp.scheduler_state)
    if versions.saves_rerun_state(release, args):  # mode from --rerun-mode; NOT_RUNNING_YET (0) between iterations
        common["rerun_state_machine"] = {
            "mode": EnumMember(GlobalRef(_RERUN + "RerunMode"), args.get("rerun_mode") or "validate_results"),
            "state": EnumMember(GlobalRef(_RERUN + "RerunState"), 0), "current_iteration": ucp.iteration}
    flops = ucp.metadata.get("num_floating_point_operations_so_far")
    common["num_floating_point_operations_so_far"] = flops if flops is not None else 0
    common["content_metadata"] = content_metadata(target.use_distributed_optimizer,
                                                  "dp_reshardable" if opt == LAYER_WISE else opt)
    return common


def _common_for_pickle(common: dict, release: versions.MegatronRelease,
                       source: Optional[versions.MegatronRelease]) -> dict:
    """The common state as it is pickled: args as the Namespace megatron-core `release` pickles."""
    return {**common, "args": _args_for_pickle(common["args"], release, source)}


# --------------------------------------------------------------------------------------------------
# Bytes: pieces of universal tensors into an open file


def _object_bytes(value: Any) -> bytes:
    """A ShardedObject item: megatron-core saves torch.save([data]) (one list entry per local object)."""
    return save_bytes([value])


def _write_own_bytes(sources: Sources, fd: int, out: OutputFile, shared: dict) -> list[WrittenItem]:
    """Write one .distcp file's items one after another (each tensor as torch's framing around its data),
    except the pieces that read rows other files of its unit read too: those go to `shared`
    {shared_rows_key: [(fd, pos, piece, dtype), ...]} for write_unit. Returns where every item went."""
    written, pos = [], 0
    for item in out.items:
        if isinstance(item, ObjectItem):
            data = _object_bytes(item.value)
            integrity.pwrite_hashed(fd, data, pos, None)
            written.append(WrittenItem(item.key, None, out.name, pos, len(data)))
            pos += len(data)
            continue
        archive = tensor_archive(item.sizes, item.dtype.name)
        integrity.pwrite_hashed(fd, archive.head, pos, None)
        at = pos + archive.data_offset
        for piece in item.pieces:  # a Gap is left unwritten: a hole of the new file, zeros
            if isinstance(piece, Piece):
                key = shared_rows_key(sources.ucp.parameters[piece.name].shape, piece, item.dtype)
                if key is None:
                    write_piece(sources, fd, at, piece, item.dtype)
                else:
                    shared.setdefault(key, []).append((fd, at, piece, item.dtype))
            at += piece.numel * item.dtype.itemsize
        integrity.pwrite_hashed(fd, archive.tail, pos + archive.data_offset + archive.nbytes, None)
        written.append(WrittenItem(item.key, item.offsets, out.name, pos, archive.length))
        pos += archive.length
    return written


def write_unit(sources: Sources, iter_dir: Path, unit: Sequence[OutputFile], *, fsync: bool = False,
               on_done: Optional[Callable[[OutputFile], None]] = None) -> list[WrittenItem]:
    """Write a unit of files (share_units: files whose pieces read the same stored rows, e.g. a stage's TP
    ranks) together: each file's own bytes in order, then the pieces they share, rows by rows: each band of
    a row-parallel weight mapped and checked once for all the files' slices of it (write_sharing_rows), at
    the positions the framing left for them. `on_done(out)` as each file is complete."""
    fds: list[int] = []
    written: list[WrittenItem] = []
    shared: dict[tuple, list] = {}
    current = iter_dir
    try:
        for out in unit:
            current = iter_dir / out.name
            fds.append(os.open(current, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644))
            written += _write_own_bytes(sources, fds[-1], out, shared)
        for writes in shared.values():
            current = iter_dir / unit[fds.index(writes[0][0])].name
            write_sharing_rows(sources, writes)
        for fd, out in zip(fds, unit):
            current = iter_dir / out.name
            if fsync:
                os.fsync(fd)
    except OSError as e:
        if e.filename is None:  # name the file (ENOSPC from a copy names none)
            raise OSError(e.errno, e.strerror, str(current)) from e
        raise
    finally:
        for fd in fds:
            os.close(fd)
    if on_done:
        for out in unit:
            on_done(out)
    return written


def write_file(sources: Sources, iter_dir: Path, out: OutputFile, *, fsync: bool = False) -> list[WrittenItem]:
    """Write one .distcp file on its own."""
    return write_unit(sources, iter_dir, [out], fsync=fsync)


def share_units(ucp, files: Sequence[OutputFile]) -> list[list[OutputFile]]:
    """`files` grouped into units whose pieces read the same stored rows (shared_rows_key), found from the
    pieces themselves (no rank geometry here), each in the given order. The heaviest shared rows join their
    files first, and a unit never grows past the most files one key is spread over (TP, where megatron-core's
    distribution of the save puts a key's TP slices in files of different DP ranks): units of a TP group's
    size keep the writer threads busy; rows whose files end up in two units are mapped once per unit."""
    parent, size = list(range(len(files))), [1] * len(files)

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    spread: dict[tuple, list] = {}  # key -> [bytes, file indices]
    for i, out in enumerate(files):
        for item in out.items:
            if isinstance(item, TensorItem):
                for piece in item.pieces:
                    if isinstance(piece, Piece):
                        key = shared_rows_key(ucp.parameters[piece.name].shape, piece, item.dtype)
                        if key is not None:
                            entry = spread.setdefault(key, [0, set()])
                            entry[0] += piece.numel * item.dtype.itemsize
                            entry[1].add(i)
    cap = max((len(found) for _, found in spread.values()), default=1)
    for _, found in sorted(spread.values(), key=lambda e: (-e[0], min(e[1]))):
        roots = {root(i) for i in found}
        if len(roots) > 1 and sum(size[r] for r in roots) <= cap:
            first, *rest = sorted(roots)
            for r in rest:
                parent[r] = first
                size[first] += size[r]
    units: dict[int, list[OutputFile]] = {}
    for i, out in enumerate(files):
        units.setdefault(root(i), []).append(out)
    return list(units.values())


def write_files(ucp, plan: DirectPlan, root: Path, files: Sequence[OutputFile], workers: int, *,
                fsync: bool = False, on_file: Optional[Callable[[Path, int], None]] = None,
                allow_non_finite: bool = False) -> list[WrittenItem]:
    """Write `files` (some or all of the plan's) under `root` with `workers` threads, a unit of files
    (share_units) per task, largest first; returns where every item went. A tensor holding NaN/Inf stops it
    (universal_pieces.NonFiniteError) unless `allow_non_finite`."""
    config = replace(ucp.config, padded_vocab_size=plan.padded_vocab_size)
    iter_dir = Path(root) / iteration_dir_name(plan.iteration)
    iter_dir.mkdir(parents=True, exist_ok=True)
    local = threading.local()
    opened: list[Sources] = []
    lock = threading.Lock()
    done: list[OutputFile] = []

    def run(unit: list[OutputFile]) -> list[WrittenItem]:
        sources = getattr(local, "sources", None)
        if sources is None:
            sources = local.sources = Sources(ucp, config, allow_non_finite=allow_non_finite)
            with lock:
                opened.append(sources)
        return write_unit(sources, iter_dir, unit, fsync=fsync, on_done=done.append)

    written: list[WrittenItem] = []
    units = sorted(share_units(ucp, files), key=lambda u: -sum(f.nbytes for f in u))
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers),
                                                   thread_name_prefix="torch-dist-direct") as pool:
            futures = [pool.submit(run, unit) for unit in units]
            try:
                for future in concurrent.futures.as_completed(futures):
                    written += future.result()
                    while on_file and done:  # list.pop is atomic: files completed by any thread so far
                        path = iter_dir / done.pop(0).name
                        on_file(path, path.stat().st_size)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    finally:
        for sources in opened:
            sources.close()
    return written


# --------------------------------------------------------------------------------------------------
# Metadata, common state, tracker


# DCP's classes, named without importing torch.distributed.checkpoint (~0.7 s of every write): the
# `.metadata` pickle holds references to them, which the reader (megatron-core's load) resolves.
_DCP_META = "torch.distributed.checkpoint.metadata."
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION (torch 2.13)


def dcp_metadata(files: Sequence[OutputFile], written: Sequence[WrittenItem], checkpoint_id: str,
                 mcore_data: Optional[dict] = None) -> Obj:
    """The DCP `.metadata` of the planned files as written (chunks in file order, as megatron-core's
    global plan lists them rank by rank), as the object tree `pickle.dump(Metadata(...))` writes: each
    dataclass as NEWOBJ + BUILD of its state, torch.Size as a reduce of a tuple, dtypes as globals
    (tests/test_torch_dist_direct.py unpickles it with torch and compares it with DCP's own objects)."""
    cls = {name: GlobalRef(_DCP_META + name) for name in (
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata")}
    storage_info = GlobalRef("torch.distributed.checkpoint.filesystem._StorageInfo")
    contiguous = EnumMember(GlobalRef(_DCP_META + "_MEM_FORMAT_ENCODING"), 0)  # TORCH_CONTIGUOUS_FORMAT

    def properties(dtype: TorchDType) -> Obj:  # TensorProperties.__getstate__: (dtype, layout, requires_grad, format, pin)
        return Obj(cls["TensorProperties"], (torch_dtype(dtype.name), _STRIDED, False, contiguous, False))

    def index(key: str, offsets=None) -> Obj:
        return Obj(cls["MetadataIndex"], {"fqn": key, "offset": None if offsets is None else TorchSize(offsets),
                                          "index": None})

    where = {(w.key, w.offsets): w for w in written}
    state_dict_metadata: dict = {}
    storage_data: dict = {}
    for out in files:
        for item in out.items:
            if isinstance(item, ObjectItem):
                state_dict_metadata[item.key] = Obj(cls["BytesStorageMetadata"], {})
                w = where[(item.key, None)]
                storage_data[index(item.key)] = Obj(storage_info, {"relative_path": w.relative_path,
                                                                    "offset": w.offset, "length": w.length})
                continue
            md = state_dict_metadata.get(item.key)
            if md is None:
                md = state_dict_metadata[item.key] = Obj(cls["TensorStorageMetadata"], {
                    "properties": properties(item.dtype), "size": TorchSize(item.global_shape), "chunks": []})
            md.state["chunks"].append(Obj(cls["ChunkStorageMetadata"], {"offsets": TorchSize(item.offsets),
                                                                         "sizes": TorchSize(item.sizes)}))
            w = where[(item.key, item.offsets)]
            storage_data[index(item.key, item.offsets)] = Obj(storage_info, {
                "relative_path": w.relative_path, "offset": w.offset, "length": w.length})
    storage_meta = Obj(cls["StorageMeta"], {"checkpoint_id": checkpoint_id, "save_id": str(uuid.uuid4()),
                                             "load_id": None, "modules": []})
    fields = {"state_dict_metadata": state_dict_metadata, "planner_data": None, "storage_data": storage_data,
              "storage_meta": storage_meta, "version": DCP_VERSION}
    if mcore_data:  # megatron-core's MCoreMetadata field: what its load needs to undo the nd-flattening
        fields["mcore_data"] = {key: {"nd_reformulated_orig_global_shape": tuple(shape)}
                                for key, shape in mcore_data.items()}
    return Obj(cls["Metadata"], fields)


_STRIDED = GlobalRef("torch.strided")
_NAMESPACE = GlobalRef("argparse.Namespace")


def _args_for_pickle(args: dict, release: versions.MegatronRelease,
                     source: Optional[versions.MegatronRelease]) -> Obj:
    """The args as `release`'s Megatron-LM pickles its Namespace (args_values): dtypes as torch's, megatron enums
    as references to megatron-core's classes (megatron-core is not imported)."""
    return Obj(_NAMESPACE, args_values(args, release=release, source=source, dtype=torch_dtype,
                                       enum_member=lambda cls, value: EnumMember(GlobalRef(cls), value)))


def _write_file(path: Path, write: Callable[[Any], None]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _flattened_shapes(plan: DirectPlan) -> dict:
    """fully_sharded_model_space: {state key: the model tensor's global shape} for every flattened state key."""
    if plan.optimizer != "fully_sharded_model_space":
        return {}
    shapes = {i.key: i.global_shape for f in plan.files for i in f.items if isinstance(i, TensorItem)}
    out = {}
    for key in shapes:
        parsed = parse_model_space_state_key(key)
        if parsed and parsed[1] in shapes:
            out[key] = shapes[parsed[1]]
    return out


def finish(root: Path, plan: DirectPlan, written: Sequence[WrittenItem],
           on_file: Optional[Callable[[Path, int], None]] = None) -> None:
    """After every .distcp file is written: .metadata, common.pt, metadata.json, then the tracker."""
    iter_name = iteration_dir_name(plan.iteration)
    iter_dir = Path(root) / iter_name
    metadata = dcp_metadata(plan.files, written, iter_name, _flattened_shapes(plan))
    outputs = [(DCP_METADATA_FILENAME, lambda f: f.write(pickle_bytes(metadata)))]
    if plan.common is not None:  # megatron-core <= 0.18 (0.19: an item of rank 0's .distcp file)
        common = _common_for_pickle(plan.common, plan.release, plan.source_release)
        # common.pt's archive is named after the file, as torch.save(obj, path) names it in megatron-core's save
        outputs.append((COMMON_FILENAME, lambda f: f.write(save_bytes(common, prefix="common"))))
    metadata_json = json.dumps(dict(plan.release.torch_dist_metadata_json)).encode()
    outputs.append((METADATA_JSON_FILENAME, lambda f: f.write(metadata_json)))
    for name, write in outputs:
        _write_file(iter_dir / name, write)
        if on_file:
            on_file(iter_dir / name, (iter_dir / name).stat().st_size)
    _write_file(Path(root) / TRACKER_FILENAME, lambda f: f.write(str(plan.iteration).encode()))


# --------------------------------------------------------------------------------------------------
# The writer


class DirectTorchDistWriter(CheckpointWriter):
    """`--ckpt-format torch_dist` (default route): offline, streaming, a few bands of rows in memory per
    thread; `workers` threads over the output files; under torchrun the processes split the files."""

    ckpt_format = "torch_dist"
    OPTIONS = ("optimizer_format", "workers", "megatron_core_version")
    splits_over_processes = True

    def __init__(self, optimizer_format: Optional[str] = None, workers: Optional[int] = None,
                 megatron_core_version: Optional[str] = None):
        if optimizer_format is not None and optimizer_format not in OPTIMIZER_FORMATS:
            raise TorchDistWriteError(f"--optimizer-format {optimizer_format!r}: choose one of "
                                      f"{', '.join(OPTIMIZER_FORMATS)}")
        self.workers = writer_threads(workers, TorchDistWriteError)
        self.optimizer_format = optimizer_format
        if megatron_core_version is not None:  # the release itself is from_universal's choice (WriteTarget.release)
            try:
                versions.release(megatron_core_version)
            except ValueError as e:
                raise TorchDistWriteError(f"--megatron-core-version: {e}") from None
        self._cached: Optional[tuple] = None  # (ucp, target, plan): plan() and write() share one plan

    def checkpoint_plan(self, ucp, target: WriteTarget) -> DirectPlan:
        """The plan of every item (computed once per universal checkpoint and target)."""
        if self._cached is not None and self._cached[0] is ucp and self._cached[1] == target:
            return self._cached[2]
        plan = plan_checkpoint(ucp, target, self.optimizer_format)
        self._cached = (ucp, target, plan)
        return plan

    def plan(self, ucp, target: WriteTarget, notes: list) -> list[PlannedFile]:
        plan = self.checkpoint_plan(ucp, target)
        if plan.optimizer in plan.release.shifted_shardings and target.args.get("overlap_grad_reduce"):
            # what is written is the true layout, which the release's own load reads right (versions.py's row)
            notes.append(f"megatron-core {plan.release.name} loads this {plan.optimizer} state right, but its own "
                         f"{plan.optimizer} saves with several DDP buckets per buffer (--overlap-grad-reduce) are "
                         f"shifted (docs/VERSIONS.md): let the resumed run save dp_reshardable (without "
                         f"--dist-ckpt-optim-fully-reshardable), or convert its saves with megatron-ucp, which "
                         f"repairs them")
        if target.args.get("fp16") and plan.optimizer and ucp.loss_scaler is None:
            notes.append("fp16 model: this universal checkpoint holds no loss scaler (written before version 2 "
                         "recorded it); megatron-core starts from --initial-loss-scale")
        it = iteration_dir_name(plan.iteration)
        files = [PlannedFile(f"{it}/{f.name}", f.nbytes) for f in plan.files]
        names = (DCP_METADATA_FILENAME,) + ((COMMON_FILENAME,) if plan.common is not None else ()) + (
            METADATA_JSON_FILENAME,)
        files += [PlannedFile(f"{it}/{name}", 0) for name in names]
        return files + [PlannedFile(TRACKER_FILENAME, 0)]

    def describe(self, ucp, target: WriteTarget) -> list[str]:
        plan = self.checkpoint_plan(ucp, target)
        items = sum(len(f.items) for f in plan.files)
        what = plan.optimizer  # 'adam': the torch optimizer's own state; another optimizer's named as such
        if what == "adam" and ucp.optimizer_type != "adam":
            what = f"{ucp.optimizer_type} ({', '.join(ucp.optimizer_state_keys)})"
        elif what == LAYER_WISE:
            what = (f"{ucp.optimizer_type} ({', '.join(ucp.optimizer_state_keys)}) under the layer-wise distributed "
                    f"optimizer (dp_reshardable)")
        return [f"optimizer state: {what or 'none (weights only)'}",
                f"as megatron-core {plan.release.name} saves it",
                f"written directly: {items} items in {len(plan.files)} files, {self.workers} writer threads"]

    def write(self, ucp, target: WriteTarget, root: Path, on_file=None) -> None:
        plan = self.checkpoint_plan(ucp, target)
        written = write_files(ucp, plan, root, plan.files, self.workers, on_file=on_file,
                              allow_non_finite=target.allow_non_finite)
        finish(root, plan, written, on_file)

    def write_share(self, ucp, target: WriteTarget, root: Path, rank: int, world: int, on_file=None) -> list:
        plan = self.checkpoint_plan(ucp, target)
        units = sorted(share_units(ucp, plan.files), key=lambda u: (-sum(f.nbytes for f in u), u[0].name))
        if len(units) >= world:  # units (a TP group's files: rows read once) dealt round-robin, largest first
            mine = [f for unit in units[rank::world] for f in unit]
        else:  # fewer units than processes: every process gets files
            mine = sorted(plan.files, key=lambda f: (-f.nbytes, f.name))[rank::world]
        return write_files(ucp, plan, root, mine, self.workers, fsync=True, on_file=on_file,
                           allow_non_finite=target.allow_non_finite)

    def finish_shares(self, ucp, target: WriteTarget, root: Path, shares: list) -> None:
        plan = self.checkpoint_plan(ucp, target)
        finish(root, plan, [w for share in shares for w in share])
