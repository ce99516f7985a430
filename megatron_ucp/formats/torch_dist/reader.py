"""Reader for Megatron-LM's `torch_dist` checkpoint format (megatron-core dist_checkpointing on
torch.distributed.checkpoint).

Layout of iter_XXXXXXX/: metadata.json ({"sharded_backend": "torch_dist", ...}), the common state (args,
iteration, opt_param_scheduler, checkpoint_version, content_metadata with 'distrib_optim_sharding_type'):
common.pt up to megatron-core 0.18, the ShardedObject 'common_state/shard_0_1' inside the .distcp files from
0.19 (core/versions.py; "common.pt" below means either), .metadata + __<rank>_<n>.distcp (DCP). Everything is parsed through the
allow-list of serialization/safe_pickle.py, without torch.distributed.checkpoint (and without torch until a
tensor is read): `.metadata` into plain records (every data file it names is a plain file of the
iteration folder holding the bytes it points to), each saved item on first use. A read asks only for the
saved chunks one shard needs; each chunk item is verified (dtype, shape, storage size, contiguity against
the metadata) before its bytes are used, and the chunks must tile the requested box exactly.

Model keys hold GLOBAL tensors:
- Transformer layers are stacked on a leading axis of size num_layers under 'decoder.layers.<suffix>'
  (global layer index); we return stage-local names 'decoder.layers.<i>.<suffix>'. Which parameters a
  rank holds, their order, their torch_dist keys (TE spellings: the local spec saves its norms as
  'self_attention.linear_qkv.layer_norm_weight' etc.) and their patterns come from the GPT rulebook
  (adapters/gpt.py).
- A TP rank's local tensor is the concatenation of its pattern's blocks (Pattern.rank_blocks): each is a
  box of the saved global tensor, read from whichever saved chunks cover it.
- With tied embeddings and PP > 1 the last stage's 'output_layer.weight' is saved under
  'embedding.word_embeddings.weight' (same values).

Optimizer state, by megatron-core optimizer and content_metadata 'distrib_optim_sharding_type':

- Distributed optimizer, 'dp_reshardable' (flat buckets):
'optimizer.distributed.dp_group_idx_<m>.gbuf_idx_<g>.dtype_(<param dtype>, <grad dtype>).bucket_idx_<b>.
{param,exp_avg,exp_avg_sq}' is bucket b of DDP buffer g of model-parallel rank m = tp_rank + TP *
pp_rank, global shape = the bucket's numel_unpadded (inner 64-element alignment padding included,
bucket-end padding excluded), saved as DP shards; 'optimizer.distributed.dp_group_idx_<m>.optimizer'
(a pickled object) holds the param groups with the Adam 'step'.
- Distributed optimizer, 'fully_reshardable' (model space, DistributedOptimizer.
  sharded_param_state_fully_reshardable): 'optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>',
  each with the model key's global shape and chunks (so it is sliced exactly like the weight);
  'param' is the fp32 main weight. common.pt['optimizer'] = {'optimizer': {'param_groups': [... 'step']},
  'param_state_sharding_type': 'fully_reshardable'}.
- Distributed optimizer, 'fully_sharded_model_space' (megatron-core 0.13/0.14's default; DistributedOptimizer.
  sharded_param_state_fs_model_space): 'optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>', each TP-local
  shard of the weight flattened and cut into the DP ranks' ranges, saved in megatron-core's nd-flattened
  reformulation: shape (*fragments per axis, shard numel), chunks (*fragment index, range start). A rank's box
  of the weight is read fragment by fragment, each from its ranges in order; at open every fragment's ranges
  must tile it exactly once. common.pt as for fully_reshardable, with 'param_state_sharding_type'
  'fully_sharded_model_space'.
- Distributed optimizer, 'dp_zero_gather_scatter' (--no-ckpt-fully-parallel-save up to 0.14): per model-parallel
  rank m the object 'optimizer.distributed.dp_group_idx_<m>.param_state/shard_0_1' holds its DDP buffers
  gathered over DP, exactly distrib_optim.pt's content (read as the legacy reader reads it:
  formats/coalesced.py), and '...optimizer/shard_0_1' the param groups. (What each recorded sharding type
  means is core/versions.OPTIMIZER_SHARDINGS; 'fully_sharded_bucket_space' is refused with what to do.)
- No distributed optimizer (FP32Optimizer / Float16OptimizerWithFloat16Params.sharded_state_dict via
  dist_checkpointing.optimizer.optim_state_to_sharding_state): 'optimizer.state.{exp_avg,exp_avg_sq}.
  <model key>' and, with --bf16/--fp16, the fp32 main weights 'optimizer.state.fp32_param.<model key>'.
  The per-parameter Adam step is saved once as common.pt['optimizer']['state']['common_step']
  (FP32Optimizer) or common.pt['optimizer']['optimizer']['state']['common_step'] (Float16), next to
  'param_groups' (without 'params'). FP32Optimizer steps the model weight itself, so 'fp32' is the weight.
- The layer-wise distributed optimizer (megatron-core 0.19's Lion / Muon with --use-distributed-optimizer:
  ChainedOptimizer [LayerWiseDistributedOptimizer([Float16(the emerging optimizer)]), the scalar parameters'
  DistributedOptimizer]), read from its dp_reshardable saves: each matrix (the rulebook's emerging_matrix) in model
  space, 'chained_0.optimizer.state.{fp32_param,<its states>}.<model key>' (whole on the DP rank owning it, the
  model's chunks); the scalar parameters in 'chained_1.optimizer.distributed.dp_group_idx_<m>...' flat buckets of
  their own DDP buffers (the matrices' buffers are the layer-wise optimizer's and save nothing), their groups and
  step in 'chained_1....optimizer'; common.pt['optimizer'] = {0: the matrices' groups, 1: {'param_state_sharding_
  type'}}. Its legacy saves and other shardings are refused (core/optimizers.py).
With tied embeddings and PP > 1 the last stage's output-layer state is saved once, under the word
embedding's key (its gradient is all-reduced over the embedding group, so both copies are equal).

Mixture of experts (docs/MOE_CHECKPOINTS.md): routed experts are saved with their GLOBAL index on a
leading expert axis (after the stacked layer axis, if any), so an expert's shard is a box like any other
(the rulebook's torch_dist_keys give the key and the leading indices); they are split over the
expert-TP group. With experts in their own optimizer (EP > 1 or ETP != TP: rulebook
experts_in_own_optimizer) megatron-core's ChainedOptimizer [dense, expert] saves common.pt['optimizer']
= {0: ..., 1: ...} and, for dp_reshardable, prefixes the flat-bucket keys with 'chained_<i>.': the
dense buckets are 'chained_0....dp_group_idx_<tp + TP*pp>', the expert buckets 'chained_1....
dp_group_idx_<etp + ETP*(ep + EP*pp)>', each expert buffer holding that rank's LOCAL experts in reverse
registration order, sharded over the expert-DP group. Model-space state (fully_reshardable, plain Adam)
has no prefix and carries the expert axis like the weight. The router's `expert_bias` is a persistent
buffer: a weight without optimizer state.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Optional

from megatron_ucp.adapters import gpt as rulebook
from megatron_ucp.core.dtypes import PARAM_DTYPES
from megatron_ucp.core.layout import LayoutError
from megatron_ucp.core import optimizers, versions
from megatron_ucp.serialization.records import box_record, stored_tensor, torch_dtype
from megatron_ucp.formats.base import READ_KEYS, CheckpointReader, ShardRef, unknown_shard
from megatron_ucp.formats.bucket_layout import (
    BufferLayout, BufferParam, DDPBucketConfig, build_chunk_buffers, shared_embedding_names)
from megatron_ucp.formats.pickles import MEGATRON
from megatron_ucp.formats.common import (
    STATE_DTYPE, CheckpointFormatError, args_to_dict, build_common_state, inside, layout_from_args, load_archive_file,
    model_config_from_args, optimizer_row, read_tensor, scalar, structure_error)
from megatron_ucp.formats.coalesced import coalesced_buffers, coalesced_records
from megatron_ucp.serialization.safe_pickle import (
    DcpBytesMeta, DcpIndex, DcpTensorMeta, SafeLoadError, TensorRecord, TorchDType, load_dcp_item, load_dcp_metadata)
from megatron_ucp.formats.torch_dist import names

_MAX_JSON_BYTES = 1 << 20  # metadata.json is a few hundred bytes; never read a huge one whole

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in a saved tensor


@dataclass(frozen=True)
class _Piece:
    """Where a local tensor comes from: saved key, how many leading axes of the saved tensor index it
    (stacked layer, expert: each region has size 1 there), and the global (offsets, sizes) regions to
    concatenate along `axis` (axis counts the leading axes)."""

    key: str
    lead: int
    regions: tuple[Box, ...]
    axis: int


@dataclass
class _RankInfo:
    """One model-parallel rank of one optimizer: the dense optimizer's (tp, pp) or, with experts in their own
    optimizer, the expert optimizer's (etp, ep, pp) holding that EP rank's local experts."""

    params: list[list[BufferParam]]  # per chunk, registration order, local shapes (persistent buffers too)
    ep_rank: int = 0
    optimizer: int = 0  # index in the ChainedOptimizer (0 dense, 1 expert)
    group_idx: int = 0  # its `dp_group_idx` in that optimizer's keys
    prefix: str = ""  # 'chained_<i>.' on that optimizer's flat-bucket keys
    # the ChainedOptimizer index of its flat buckets where it is not `optimizer` (the layer-wise distributed
    # optimizer's: its scalar parameters' DistributedOptimizer is chained second)
    bucket_chain: Optional[int] = None
    sources: dict = field(default_factory=dict)  # (chunk, local name) -> _Piece
    buffers: list[list[BufferLayout]] = field(default_factory=list)
    gbuf_base: list[int] = field(default_factory=list)
    gathered: Optional[dict] = None  # dp_zero_gather_scatter: its parsed 'param_state' object (coalesced buffers)
    step: Optional[float] = None
    param_groups: Optional[list] = None


@dataclass(frozen=True)
class _Overlap:
    """The part of a requested box that one saved chunk holds: `lengths` elements per dim, at `src` in the
    saved chunk and at `dst` in the requested box."""

    chunk: tuple[int, ...]  # the saved chunk's offsets (its item key)
    src: tuple[int, ...]
    dst: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass
class _Requests:
    """What one read()/locate() asks of the checkpoint: boxes per saved key, and how to name them."""

    piece: _Piece
    want: set
    tensors: dict = field(default_factory=dict)  # saved key -> [Box]
    flat: dict = field(default_factory=dict)  # out name -> saved key (flat buckets)
    records: dict = field(default_factory=dict)  # out name -> TensorRecord (dp_zero_gather_scatter)
    states: dict = field(default_factory=dict)  # out name -> saved key (model-space state)
    weight_is_main: bool = False


class _NotContiguous(Exception):
    pass


def _assemble_stored(parts: list, piece: _Piece, shape: Optional[tuple] = None):
    """_assemble for StoredTensors: chunks concatenated along the piece's axis are one run of bytes only
    when every dim before that axis has size 1."""
    from megatron_ucp.io.byteio import concat_stored

    if len(parts) > 1 and math.prod(parts[0].shape[:piece.axis]) != 1:
        raise _NotContiguous(piece.key)
    full = list(parts[0].shape)
    full[piece.axis] = sum(p.shape[piece.axis] for p in parts)
    if shape is None:
        shape = tuple(full[piece.lead:])
    return concat_stored(parts, shape)


def distributed_object_prefix(info: _RankInfo, name: str) -> str:
    """The key prefix of a distributed-optimizer object of one model-parallel rank ('optimizer': param groups;
    'param_state': dp_zero_gather_scatter's gathered buffers), saved as ShardedObject '<prefix><shard>'."""
    return names.distributed_optimizer_object_key(info.group_idx, name, prefix=info.prefix) + "/"


def _intersect(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes, or None."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(end <= start for start, end in zip(lo, hi)):
        return None
    return lo, tuple(end - start for start, end in zip(lo, hi))


class TorchDistCheckpoint(CheckpointReader):
    """A `torch_dist` format checkpoint; see the module docstring."""

    format = "torch_dist"
    # everything is parsed at open; reads only fill caches of verified item records: threads may share one
    thread_safe_reads = True

    def __init__(self, iter_dir: Path, iteration: int, *, weights_only: bool = False):
        self.path = Path(iter_dir)
        self.iteration = iteration
        self.weights_only = bool(weights_only)
        self._check_backend()
        self._metadata = self._open_dcp()
        self._keys = self._metadata.state_dict_metadata
        common, common_file = self._load_common()
        self._common_file = common_file
        if not isinstance(common, dict) or "args" not in common:
            raise CheckpointFormatError(f"{common_file}: has no 'args'; not written by Megatron-LM's save_checkpoint.")
        if common.get("iteration") != iteration:
            raise CheckpointFormatError(
                f"{common_file}: holds iteration {common.get('iteration')} but lives in {self.path.name}; files of "
                f"different iterations were mixed. Re-copy the iteration folder from one save.")
        self.args = args_to_dict(common["args"], source=common_file)
        self.release = versions.detect(self.args)
        self.layout = layout_from_args(self.args, common_file)
        self.config = model_config_from_args(self.args, common_file)
        self._common = {k: v for k, v in common.items() if k not in ("args", "rng_state")}
        del common
        # the distributed optimizer's recorded sharding type (a key of versions.OPTIMIZER_SHARDINGS), else None
        self.distrib_optim_sharding: Optional[str] = None
        self._optim_layout: Optional[versions.OptimizerSharding] = None  # what that sharding type means
        self._row = None  # the optimizer's core/optimizers.py row (None without optimizer state)
        self.optimizer_kind = self._detect_optimizer()
        # LayerWiseDistributedOptimizer (--optimizer lion / muon with --use-distributed-optimizer): the emerging
        # optimizer's matrices in model space under 'chained_0.', its scalar optimizer's flat buckets under 'chained_1.'
        self._layer_wise = self.optimizer_kind != "none" and bool(self.args.get("use_layer_wise_distributed_optimizer"))
        self._flat_buckets = self._optim_space == "buckets"
        # fully_sharded_model_space state keys -> the TP-local fragment shape each flattened range indexes, and
        # -> {fragment index: its saved chunks' offsets in flattened order}
        self._fragments: dict[str, tuple[int, ...]] = {}
        self._fragment_chunks: dict[str, dict[tuple, list]] = {}
        self._buckets = self._index_buckets() if self._flat_buckets else {}
        self._state_keys = self._index_model_space_state() if self._model_space else {}
        self._model_space_groups, self._model_space_step = (
            self._model_space_common() if self._model_space else (None, None))
        self._records: dict = {}  # DcpIndex -> the verified TensorRecord of a saved chunk
        self._chunks_by_offset: dict[str, dict] = {}  # saved key -> {chunk offsets: chunk sizes}
        # ('dense', tp, pp) | ('expert', etp, ep, pp) -> _RankInfo
        self._ranks: dict[tuple, _RankInfo] = {}
        try:
            self._expected_shapes = dict(rulebook.expected_parameters(self.config, self.layout))
        except (ValueError, NotImplementedError) as e:
            raise CheckpointFormatError(f"{common_file}: {e}") from e
        self._chained = rulebook.experts_in_own_optimizer(self.config, self.layout)
        self._check_chaining()
        self._used_keys: set = set()
        layout = self.layout
        for pp_rank in range(layout.pp):
            for tp_rank in range(layout.tp):
                chain = 1 if self._layer_wise else 0 if self._chained else None
                self._ranks[("dense", tp_rank, pp_rank)] = self._rank_info(
                    _RankInfo([], group_idx=layout.dense_mp_rank(tp_rank, pp_rank), prefix=names.chained_prefix(chain),
                              bucket_chain=chain if self._layer_wise else None), tp_rank, pp_rank)
            if not self._chained:
                continue
            for ep_rank in range(layout.ep):
                for etp_rank in range(layout.expert_tp):
                    self._ranks[("expert", etp_rank, ep_rank, pp_rank)] = self._rank_info(
                        _RankInfo([], ep_rank=ep_rank, optimizer=1, prefix=names.chained_prefix(1),
                                  group_idx=layout.expert_mp_rank(etp_rank, ep_rank, pp_rank)),
                        etp_rank, pp_rank)
        self._check_all_keys_used()
        self._shifted = self._find_shifted()  # megatron-core 0.15-0.19's shifted fully_reshardable state

    # -- opening ------------------------------------------------------------------------------

    def _load_common(self) -> tuple[dict, str]:
        """The common state (args, iteration, scheduler, optimizer param groups) and where it was read: a
        `common.pt` beside the .distcp files (megatron-core <= 0.18, and what 0.19 still reads first), or the
        ShardedObject 'common_state' inside them (megatron-core >= 0.19)."""
        common_file = self.path / names.COMMON_FILENAME
        what = "the common state (args, iteration, scheduler)"
        if common_file.exists() or common_file.is_symlink():
            return load_archive_file(inside(self.path, common_file), what=what), str(common_file)
        md = self._keys.get(names.COMMON_STATE_ITEM)
        if md is None:
            raise CheckpointFormatError(
                f"{self.path}: has neither common.pt (megatron-core <= 0.18) nor the sharded object "
                f"{names.COMMON_STATE_ITEM!r} in .metadata (megatron-core >= 0.19), so its args, iteration and "
                f"scheduler are missing; the folder is incomplete, re-copy it from the original checkpoint.")
        if not isinstance(md, DcpBytesMeta):
            raise CheckpointFormatError(f"{self._dcp_index}: {names.COMMON_STATE_ITEM} is a tensor, not the "
                                        f"pickled common state; the metadata is corrupt, re-copy the iteration folder.")
        item = self._metadata.storage_data.get(DcpIndex(names.COMMON_STATE_ITEM))
        where = f"{item.path} (item {names.COMMON_STATE_ITEM})" if item else str(self._dcp_index)
        return self._bytes_item(names.COMMON_STATE_ITEM), where

    def _check_backend(self) -> None:
        meta_json = self.path / names.METADATA_JSON_FILENAME
        if not meta_json.is_file():
            raise CheckpointFormatError(f"{meta_json}: missing; re-copy the torch_dist iteration folder.")
        with open(inside(self.path, meta_json), "rb") as f:
            text = f.read(_MAX_JSON_BYTES + 1)
        try:
            if len(text) > _MAX_JSON_BYTES:
                raise ValueError(f"over {_MAX_JSON_BYTES} bytes")
            found = json.loads(text)
            backend = found.get("sharded_backend") if isinstance(found, dict) else None
        except ValueError as e:
            raise CheckpointFormatError(f"{meta_json}: not valid JSON ({e}); re-copy it.") from e
        if backend != "torch_dist":
            raise CheckpointFormatError(f"{meta_json}: sharded_backend={backend!r}; only 'torch_dist' is supported "
                                        f"(convert zarr checkpoints with Megatron-LM first).")

    def _open_dcp(self):
        """.metadata parsed through the allow-list; load_dcp_metadata checks that every data file it names is a
        plain file of this folder (no path, no link out) holding every item it points to."""
        meta_file = self._dcp_index
        if not meta_file.is_file():
            raise CheckpointFormatError(f"{meta_file}: missing DCP metadata; re-copy the iteration folder.")
        inside(self.path, meta_file)
        try:
            return load_dcp_metadata(self.path, MEGATRON)
        except SafeLoadError as e:
            raise CheckpointFormatError(str(e)) from e

    @property
    def _optim_space(self) -> Optional[str]:
        """The distributed optimizer's layout (versions.OptimizerSharding.space), None without one."""
        return self._optim_layout.space if self._optim_layout else None

    @property
    def _model_space(self) -> bool:
        """Optimizer state saved per parameter: with the model key's shape and chunks, or (fully_sharded_model_space)
        as flattened ranges of the model key's TP-local shards (the layer-wise distributed optimizer: its
        emerging optimizer's matrices, `_in_model_space`)."""
        return self._layer_wise or self.optimizer_kind in ("adam", "mixed_precision") or self._optim_space in ("model", "model_flat")

    def _detect_optimizer(self) -> str:
        opt_keys = [k for k in self._keys if k.startswith(names.OPTIMIZER_PREFIXES)]
        opt_common = self._common.get("optimizer")
        if not opt_keys and opt_common is None:
            return "none"
        if self.weights_only:
            self.skipped_optimizer = str(self.args.get("optimizer", "adam"))
            return "none"
        content = self._common.get("content_metadata") or {}
        if not isinstance(content, dict):
            raise structure_error(self._common_file, "'content_metadata' (a dict)", content)
        sharding = content.get("distrib_optim_sharding_type")
        common_file = self._common_file
        layout = versions.optimizer_sharding(sharding)
        # the optimizer's per-parameter state by name (core/optimizers.py; refused in one line if not mapped)
        self._row = optimizer_row(self.args, common_file, distributed=layout is not None or bool(
            self.args.get("use_distributed_optimizer")), layer_wise=None if sharding == "dp_reshardable" else
            optimizers.layer_wise_sharding_refusal(sharding))
        if any(names.is_distributed_optimizer_key(k) for k in opt_keys) and layout is None:
            raise CheckpointFormatError(
                f"{common_file}: distrib_optim_sharding_type={sharding!r} with flat-bucket optimizer keys; "
                f"not a sharding type any megatron-core release writes ({', '.join(versions.OPTIMIZER_SHARDINGS)}).")
        if layout is not None:
            flat_keys = any(names.parse_flat_bucket_key(k) for k in opt_keys)
            if layout.space is not None and flat_keys != (layout.space == "buckets"):
                raise CheckpointFormatError(
                    f"{common_file}: distrib_optim_sharding_type={sharding!r} but .metadata "
                    f"{'has' if flat_keys else 'has no'} flat-bucket optimizer keys (those are 'dp_reshardable'); "
                    f"common.pt and the .distcp files are from different saves, re-copy the iteration folder.")
            if layout.space is None:
                raise CheckpointFormatError(
                    f"{common_file}: distributed-optimizer state with distrib_optim_sharding_type={sharding!r}, which "
                    f"megatron-ucp does not read: {layout.refusal}.")
            self.distrib_optim_sharding = sharding
            self._optim_layout = layout
            return "distributed"
        if sharding is not None or self.args.get("use_distributed_optimizer"):
            raise CheckpointFormatError(
                f"{common_file}: distributed-optimizer state with distrib_optim_sharding_type={sharding!r}; not a "
                f"sharding type any megatron-core release writes ({', '.join(versions.OPTIMIZER_SHARDINGS)}); the "
                f"common state is corrupt, re-copy common.pt from the original checkpoint.")
        subs = self._optimizer_common_parts()
        # Float16OptimizerWithFloat16Params nests the torch state under 'optimizer'; FP32Optimizer does not
        if any("optimizer" in sub or "fp32_from_fp16_params" in sub for sub in subs) or any(
                (names.parse_model_space_state_key(k) or ("",))[0] == "fp32_param" for k in opt_keys):
            return "mixed_precision"
        return "adam"

    def _optimizer_common_parts(self) -> list[dict]:
        """common.pt['optimizer'] as a list of single-optimizer states (a ChainedOptimizer saves {i: state})."""
        opt = self._common.get("optimizer")
        if opt is None:
            return []
        if not isinstance(opt, dict):
            raise CheckpointFormatError(f"{self._common_file}: 'optimizer' is a {type(opt).__name__}, "
                                        f"expected the dict megatron-core's optimizer.sharded_state_dict leaves.")
        parts = [opt[k] for k in sorted(opt)] if opt and all(isinstance(k, int) for k in opt) else [opt]
        for part in parts:
            if not isinstance(part, dict):
                raise structure_error(self._common_file, "an optimizer entry of 'optimizer' (a dict)", part)
        return parts

    def _index_model_space_state(self) -> dict[str, dict[str, str]]:
        """model key -> {'param' | 'fp32_param' | 'exp_avg' | 'exp_avg_sq': saved key}."""
        out: dict[str, dict[str, str]] = {}
        for key, md in self._keys.items():
            parsed = names.parse_model_space_state_key(key)
            if not parsed or not isinstance(md, DcpTensorMeta):
                continue
            what, model_key = parsed
            self._check_dtype(key, (STATE_DTYPE,))
            if self._layer_wise and not key.startswith(names.chained_prefix(0)):
                raise CheckpointFormatError(
                    f"{self._dcp_index}: {key} is model-space optimizer state outside the layer-wise optimizer's "
                    f"{names.chained_prefix(0)}* (its matrices' optimizer); the checkpoint is not one megatron-core "
                    f"0.19 writes, re-copy the iteration folder.")
            if not isinstance(self._keys.get(model_key), DcpTensorMeta):
                raise CheckpointFormatError(f"{self._dcp_index}: optimizer state {key} belongs to no saved "
                                            f"model tensor {model_key!r}.")
            if self._optim_space == "model_flat":
                self._fragments[key] = self._check_flattened(key, md, self._keys[model_key])
            elif tuple(md.size) != tuple(self._keys[model_key].size):
                raise CheckpointFormatError(
                    f"{self._dcp_index}: {key} has global shape {tuple(md.size)} but the model tensor "
                    f"{model_key} has {tuple(self._keys[model_key].size)}; the checkpoint is inconsistent.")
            if what in out.setdefault(model_key, {}):
                raise CheckpointFormatError(f"{self._dcp_index}: {what} state of {model_key} is saved "
                                            f"twice ({out[model_key][what]}, {key}).")
            out[model_key][what] = key
        main = {self._optim_layout.main_param} if self._optim_layout and not self._layer_wise else set()
        rows = [optimizers.OPTIMIZERS[r] for r in optimizers.run_optimizers(self._row.name, self.args)]
        if self._layer_wise:
            rows = rows[:1]  # the scalar optimizer's state is in flat buckets
        for model_key, found in out.items():
            need = main | ({"fp32_param"} if self._layer_wise and self._keys[model_key].dtype != STATE_DTYPE else set())
            if not any(set(r.states) | need <= set(found) for r in rows):
                expected = " or ".join(str(sorted(set(r.states) | need)) for r in rows)
                raise CheckpointFormatError(
                    f"{self._dcp_index}: optimizer state of {model_key} has {sorted(found)}, expected "
                    f"{expected}; the checkpoint is incomplete or not {self._row.name}'s state.")
        if not out and self._optim_layout and not self._layer_wise:
            raise CheckpointFormatError(f"{self._dcp_index}: distrib_optim_sharding_type="
                                        f"{self.distrib_optim_sharding!r} but no optimizer.state."
                                        f"{self._optim_layout.main_param}.* tensors are saved.")
        return out

    def _model_space_common(self) -> tuple[list, Optional[float]]:
        """(param groups, Adam step) from common.pt for model-space optimizer state."""
        groups: list = []
        steps: set = set()
        common_file = self._common_file
        # the layer-wise distributed optimizer: its emerging optimizer's groups (the scalar optimizer's are the
        # DistributedOptimizer's object, as for any dp_reshardable save)
        for sub in self._optimizer_common_parts()[:1 if self._layer_wise else None]:
            inner = sub.get("optimizer", sub)  # Float16 optimizer and distributed optimizer nest it
            found = inner.get("param_groups") if isinstance(inner, dict) else None
            if not isinstance(found, list) or not all(isinstance(g, dict) for g in found):
                raise structure_error(common_file, "the optimizer's 'param_groups' (a list of dicts)", found)
            groups += found
            steps |= {scalar(g["step"], path=common_file, what="a param group's Adam 'step'")
                      for g in found if g.get("step") is not None}
            state = inner.get("state") or {}
            common_step = state.get("common_step") if isinstance(state, dict) else None
            if common_step is not None:
                steps.add(scalar(common_step, path=common_file, what="the optimizer's 'common_step'"))
        if len(steps) > 1:
            raise CheckpointFormatError(f"{self._common_file}: the optimizer state disagrees on the Adam step "
                                        f"{sorted(steps)}.")
        return groups, (steps.pop() if steps else None)

    def _check_flattened(self, key: str, md: DcpTensorMeta, model: DcpTensorMeta) -> tuple[int, ...]:
        """fully_sharded_model_space: `key` is saved as (*fragments per axis, fragment numel) over the model key's
        global shape (each fragment one TP-local shard); every fragment's flattened ranges must tile [0, numel)
        exactly once (all DP ranks' slices present, none twice). Returns the fragment shape."""
        where = f"{self._dcp_index}: {key}"
        size, global_shape = tuple(md.size), tuple(model.size)
        grid = size[:-1]
        if (len(size) != len(global_shape) + 1 or any(f < 1 or g % f for f, g in zip(grid, global_shape))
                or size[-1] != math.prod(g // f for f, g in zip(grid, global_shape))):
            raise CheckpointFormatError(
                f"{where} has shape {size}, which is not (fragments per axis, fragment numel) of the model tensor's "
                f"{global_shape} (fully_sharded_model_space); the metadata is corrupt, re-copy the iteration folder.")
        ranges: dict[tuple, list] = {}
        for c in md.chunks:
            if any(n != 1 for n in c.sizes[:-1]):
                raise CheckpointFormatError(f"{where}: chunk at {c.offsets} of size {c.sizes} spans several "
                                            f"fragments; the metadata is corrupt, re-copy the iteration folder.")
            ranges.setdefault(c.offsets[:-1], []).append((c.offsets[-1], c.sizes[-1]))
        self._fragment_chunks[key] = {f: [f + (start,) for start, _ in sorted(r)] for f, r in ranges.items()}
        for fragment in itertools.product(*map(range, grid)):
            pos, tiled = 0, True
            for start, length in sorted(ranges.get(fragment, ())):
                tiled = tiled and start == pos
                pos = start + length
            if not tiled or pos != size[-1]:
                raise CheckpointFormatError(
                    f"{where}: the flattened ranges of fragment {fragment} cover "
                    f"{sorted((a, a + n) for a, n in ranges.get(fragment, ()))}, not [0, {size[-1]}) exactly once "
                    f"(a data-parallel rank's slice is missing or doubled); the checkpoint is incomplete, re-copy "
                    f"the iteration folder.")
        return tuple(g // f for f, g in zip(grid, global_shape))

    def _flat_fragments(self, fqn: str, box: Box) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """fully_sharded_model_space: the fragments (their grid index, their offset in the box) that make up a
        box of the model key's global tensor; the box must be made of whole fragments (TP-local shards)."""
        shape = self._fragments[fqn]
        offsets, sizes = box
        if any(o % n or s % n for o, s, n in zip(offsets, sizes, shape)):
            raise CheckpointFormatError(
                f"{self._dcp_index}: {fqn} is saved in fragments of shape {shape} (fully_sharded_model_space) "
                f"but the rank's shard at {offsets} of size {sizes} is not made of whole fragments; the args do not "
                f"match the layout it was saved at.")
        return [(tuple(o // n + i for o, n, i in zip(offsets, shape, index)),
                 tuple(i * n for i, n in zip(index, shape)))
                for index in itertools.product(*(range(s // n) for s, n in zip(sizes, shape)))]

    def _read_flat_box(self, fqn: str, box: Box):
        """A box of whole fragments of a fully_sharded_model_space state key, in the model key's coordinates:
        each fragment's flattened ranges (verified records) concatenated and shaped as the fragment."""
        import torch

        shape = self._fragments[fqn]
        out = torch.empty(box[1], dtype=torch_dtype(self._keys[fqn].dtype))
        for fragment, dst in self._flat_fragments(fqn, box):
            flat = torch.cat([read_tensor(self._record(fqn, c)).reshape(-1) for c in self._fragment_chunks[fqn][fragment]])
            view = out
            for dim, (start, length) in enumerate(zip(dst, shape)):
                view = view.narrow(dim, start, length)
            view.copy_(flat.view(shape))
        return out

    def _locate_flat_box(self, fqn: str, box: Box):
        """Where a one-fragment box's bytes are: its flattened ranges' bytes in order; None for several fragments."""
        from megatron_ucp.io.byteio import concat_stored

        fragments = self._flat_fragments(fqn, box)
        if len(fragments) != 1:
            return None
        parts = [stored_tensor(self._record(fqn, c)) for c in self._fragment_chunks[fqn][fragments[0][0]]]
        if any(p is None for p in parts):
            return None
        return concat_stored(parts, box[1])

    def _check_chaining(self) -> None:
        """The saved optimizer has the dense/expert structure megatron-core builds at the saved layout."""
        if self.optimizer_kind == "none":
            return
        kinds = optimizers.run_optimizers(self._row.name, self.args)
        if len(kinds) > 1:  # an emerging optimizer: megatron-core chains [its own, its scalar optimizer]
            if self._chained:
                raise CheckpointFormatError(
                    f"{self.path}: --optimizer {self._row.name}: {optimizers.EMERGING_WITH_EXPERTS_REFUSAL}")
            parts = len(self._optimizer_common_parts())
            if parts != len(kinds):
                raise CheckpointFormatError(
                    f"{self._common_file}: 'optimizer' holds {parts} optimizer(s) but --optimizer {self._row.name} "
                    f"chains {len(kinds)} ({', '.join(kinds)}); the common state does not match its args.")
            return
        if self._flat_buckets:
            saved = any(k.startswith(names.chained_prefix(1)) for k in self._keys)
        else:
            saved = len(self._optimizer_common_parts()) > 1
        if saved != self._chained:
            layout = self.layout
            raise CheckpointFormatError(
                f"{self.path}: the optimizer state is {'chained [dense, expert]' if saved else 'one optimizer'} but at "
                f"{layout.describe()} (EP={layout.ep}, ETP={layout.expert_tp}, TP={layout.tp}) the experts "
                f"{'share the dense optimizer' if not self._chained else 'have their own optimizer'}; a checkpoint of "
                f"megatron-core 0.16.1 at EP1 with ETP != TP is not supported (its experts were reduced over the "
                f"wrong group): resave it with --expert-model-parallel-size > 1 or ETP = TP.")

    def _index_buckets(self) -> dict:
        """(optimizer index, mp rank, gbuf, (param dtype str, grad dtype str), bucket) -> {state key: saved key}."""
        out: dict = {}
        for key in self._keys:
            k = names.parse_flat_bucket_key(key)
            if k:
                self._check_dtype(key, (STATE_DTYPE,))
                out.setdefault((k.optimizer or 0, k.mp_rank, k.gbuf, k.dtypes, k.bucket), {})[k.what] = key
        if not out:
            raise CheckpointFormatError(f"{self._dcp_index}: no optimizer.distributed.*bucket_idx_* tensors.")
        return out

    def _piece(self, canonical: str, local: str, tp_rank: int) -> _Piece:
        """Where a rank's local tensor is in the saved global tensor: its pattern's blocks, as boxes of
        the saved key (with the stacked layer / expert indices in front)."""
        candidates = rulebook.torch_dist_keys(canonical, self.config)
        key, lead = next(((k, lead) for k, lead in candidates if k in self._keys), candidates[0])
        md = self._keys.get(key)
        where = f"{self._dcp_index}: {key}"
        if not isinstance(md, DcpTensorMeta):
            moe = (f" (num_experts={self.config.num_experts}, moe_layer_freq={self.config.moe_layer_freq})"
                   if rulebook.rule_for(canonical).kind == rulebook.MOE else "")
            raise CheckpointFormatError(f"{where} is missing (needed for {local}); the checkpoint is incomplete or "
                                        f"does not match its args{moe}")
        self._check_dtype(key, PARAM_DTYPES)
        size = tuple(md.size)
        shape = size[len(lead):]
        if len(size) < len(lead) or any(not 0 <= i < n for i, n in zip(lead, size)):
            raise CheckpointFormatError(f"{where} has shape {size}, no index {lead} on its leading axes (needed for "
                                        f"{local}); the checkpoint does not match its args")
        want = self._expected_shapes.get(canonical)
        if want is not None and shape != tuple(want):
            raise CheckpointFormatError(f"{where} has global shape {shape} but the model config gives {tuple(want)} "
                                        f"for {canonical}; args and weights disagree")
        pattern = rulebook.pattern_for(canonical, self.config)
        try:
            blocks = pattern.rank_blocks(shape, tp_rank, rulebook.tp_size_of(canonical, self.layout), name=canonical)
        except (LayoutError, ValueError) as e:
            raise CheckpointFormatError(f"{where}: {e}") from e
        ones = (1,) * len(lead)
        regions = tuple((tuple(lead) + tuple(r.start for r in b.dst), ones + tuple(r.stop - r.start for r in b.dst))
                        for b in blocks)
        return _Piece(key, len(lead), regions, (pattern.dim or 0) + len(lead))

    def _rank_info(self, info: _RankInfo, tp_rank: int, pp_rank: int) -> _RankInfo:
        """The rank's parameters and persistent buffers (the rulebook's, in registration order: the dense ones,
        or with experts in their own optimizer the dense ones and, separately, each EP rank's experts) and where
        each one is saved."""
        expert_rank = info.optimizer == 1
        for chunk in range(self.layout.num_chunks):
            try:
                entries = rulebook.parameters_for_rank(self.config, self.layout, pp_rank,
                                                       chunk if self.layout.vpp else None, ep_rank=info.ep_rank,
                                                       buffers=True)
            except (LayoutError, ValueError, NotImplementedError) as e:
                raise CheckpointFormatError(f"{self.path}: {e}") from e
            params = []
            for local, _, canonical in entries:
                if rulebook.in_expert_optimizer(canonical, self.config, self.layout) != expert_rank:
                    continue
                piece = self._piece(canonical, local, tp_rank)
                shape = list(piece.regions[0][1])
                shape[piece.axis] = sum(r[1][piece.axis] for r in piece.regions)
                shape = shape[piece.lead:]
                params.append(BufferParam(local, tuple(shape), TorchDType(self._keys[piece.key].dtype),
                                          expert=expert_rank))
                info.sources[(chunk, local)] = piece
                self._used_keys.add(piece.key)
            info.params.append(params)
        if self._flat_buckets:
            self._attach_buffers(info, tp_rank, pp_rank)
        elif self._optim_space == "gathered":
            self._attach_gathered(info, tp_rank, pp_rank)
        if self._model_space and (self._layer_wise or not self._flat_buckets):
            self._check_model_space_state(info, tp_rank, pp_rank)
        return info

    def _in_model_space(self, local: str, shape) -> bool:
        """Whether a parameter's optimizer state is in model space in a checkpoint whose distributed optimizer's is
        in flat buckets: the layer-wise distributed optimizer's matrices (its emerging optimizer's, whole per DP
        rank, saved like the weight)."""
        return self._layer_wise and self.parameter_row(local, shape).name == self._row.name

    @staticmethod
    def _chain_of_buckets(info: _RankInfo) -> int:
        return info.optimizer if info.bucket_chain is None else info.bucket_chain

    def _rank_numel(self, pp_rank: int) -> int:
        """Parameters of one global rank of stage `pp_rank`, all chunks, dense and its experts alike (what
        --ddp-num-buckets divides; the same on every rank of the stage)."""
        return sum(math.prod(shape) for chunk in range(self.layout.num_chunks)
                   for _, shape, _ in rulebook.parameters_for_rank(self.config, self.layout, pp_rank,
                                                                   chunk if self.layout.vpp else None))

    def _describe_rank(self, info: _RankInfo, tp_rank: int, pp_rank: int) -> str:
        return (f"expert rank etp={tp_rank} ep={info.ep_rank} pp={pp_rank}" if info.optimizer == 1
                else f"rank tp={tp_rank} pp={pp_rank}")

    def _check_all_keys_used(self) -> None:
        """Every saved model tensor belongs to a parameter the rulebook knows (nothing silently dropped)."""
        not_model = names.OPTIMIZER_PREFIXES + (names.RNG_STATE_KEY,)
        unused = sorted(k for k, v in self._keys.items() if isinstance(v, DcpTensorMeta)
                        and not k.startswith(not_model) and not rulebook.is_ignorable(k) and k not in self._used_keys)
        if unused:
            raise CheckpointFormatError(
                f"{self._dcp_index}: saved tensors {unused[:5]} belong to no parameter of the model its args "
                f"describe (transformer_impl={self.args.get('transformer_impl')!r}); add them to the GPT rulebook "
                f"(megatron_ucp/adapters/gpt.py) if the model really has them")

    def _chunk_buffers(self, info: _RankInfo, pp_rank: int) -> list[list[BufferLayout]]:
        """The DDP buffers of each of the rank's chunks, as the saving run's args and layout built them."""
        num_params = self._rank_numel(pp_rank)
        out = []
        for chunk, params in enumerate(info.params):
            config = DDPBucketConfig.from_megatron_args(self.args, self.layout, pp_rank=pp_rank, vpp_chunk=chunk,
                                                        rank_num_parameters=num_params, experts=info.optimizer == 1)
            shared = shared_embedding_names(self.args, self.layout, pp_rank=pp_rank, vpp_chunk=chunk,
                                            names=[p.name for p in params])
            params = [BufferParam(p.name, p.shape, p.dtype, shared_embedding=p.name in shared, expert=p.expert)
                      for p in params if not rulebook.is_buffer(p.name) and not self._in_model_space(p.name, p.shape)]
            out.append(build_chunk_buffers(params, config, experts=info.optimizer == 1) if params else [])
        return out

    def _find_shifted(self):
        """megatron-core 0.15-0.19's shifted fully_reshardable state (shifted.py), or None."""
        if self.optimizer_kind != "distributed" or self._optim_space != "model":
            return None
        from megatron_ucp.formats.torch_dist.shifted import ShiftedState

        ranks = []
        for key, info in self._ranks.items():
            tp_rank, pp_rank = key[1], key[-1]
            refs = {(chunk, p.name): ShardRef(tp_rank, pp_rank, chunk, p.name, p.shape, p.dtype, info.ep_rank)
                    for chunk, params in enumerate(info.params) for p in params}
            ranks.append((self._describe_rank(info, tp_rank, pp_rank).removeprefix("rank "),
                          self._chunk_buffers(info, pp_rank), lambda chunk, name, refs=refs: refs[(chunk, name)]))
        fp32 = all(str(p.dtype) == "torch.float32" for info in self._ranks.values() for ps in info.params for p in ps)
        return ShiftedState.of(str(self.path), self.release, self.distrib_optim_sharding, ranks, fp32)

    def notices(self) -> list[str]:
        return [self._shifted.notice(self.reset_lost_optimizer_state)] if self._shifted else []

    def read_problem(self) -> Optional[str]:
        return self._shifted.problem(self.reset_lost_optimizer_state) if self._shifted else None

    def _attach_buffers(self, info: _RankInfo, tp_rank: int, pp_rank: int) -> None:
        mp, opt = info.group_idx, self._chain_of_buckets(info)
        where = self._describe_rank(info, tp_rank, pp_rank)
        gbuf = 0
        for chunk, buffers in enumerate(self._chunk_buffers(info, pp_rank)):
            info.gbuf_base.append(gbuf)
            info.buffers.append(buffers)
            for buf in buffers:
                dtypes = (str(buf.param_dtype), str(buf.grad_dtype))
                for b, bucket in enumerate(buf.buckets):
                    keys = self._buckets.get((opt, mp, gbuf, dtypes, b))
                    if keys is None or set(keys) != {"param", "exp_avg", "exp_avg_sq"}:
                        raise CheckpointFormatError(
                            f"{self._dcp_index}: no complete optimizer bucket {info.prefix}dp_group_idx_{mp}."
                            f"gbuf_idx_{gbuf}.dtype_{dtypes}.bucket_idx_{b} for {where}; the DDP settings in args "
                            f"do not match the saved buffers.")
                    md = self._keys[keys["param"]]
                    starts = {c.offsets[0] for c in md.chunks}
                    spans = [s for s in buf.params if s.bucket == b]
                    if tuple(md.size) != (bucket.numel_unpadded,) or any(
                            buf.offset_in_bucket(s) not in starts for s in spans):
                        raise CheckpointFormatError(
                            f"{self._dcp_index}: {keys['param']} has shape {tuple(md.size)} and chunk starts "
                            f"that do not match the 64-aligned layout of {where} "
                            f"(expected {bucket.numel_unpadded} elements); unsupported model or DDP layout.")
                gbuf += 1
        n_saved = len({k[2] for k in self._buckets if k[:2] == (opt, mp)})
        if n_saved != gbuf:
            raise CheckpointFormatError(f"{self._dcp_index}: {info.prefix}dp_group_idx_{mp} has {n_saved} "
                                        f"buffers, the model needs {gbuf} ({where}).")

    def _attach_gathered(self, info: _RankInfo, tp_rank: int, pp_rank: int) -> None:
        """dp_zero_gather_scatter: the rank's object 'optimizer.distributed.dp_group_idx_<m>.param_state' (its
        buffers gathered over DP, as in distrib_optim.pt), parsed through the allow-list and checked against the
        buffer layout the args give before any tensor is read."""
        where = self._describe_rank(info, tp_rank, pp_rank)
        if self._chained:
            raise CheckpointFormatError(
                f"{self._common_file}: dp_zero_gather_scatter state of a chained [dense, expert] optimizer, which "
                f"megatron-ucp has never seen; resave with --ckpt-format torch or Megatron-LM's default sharding.")
        prefix = distributed_object_prefix(info, "param_state")
        keys = [k for k, v in self._keys.items() if k.startswith(prefix) and isinstance(v, DcpBytesMeta)]
        if len(keys) != 1:
            raise CheckpointFormatError(f"{self._dcp_index}: {len(keys)} objects {prefix}* for {where}, "
                                        f"expected one (dp_zero_gather_scatter); the checkpoint is incomplete, re-copy "
                                        f"the iteration folder.")
        item = self._metadata.storage_data.get(DcpIndex(keys[0]))
        source = f"{item.path} (item {keys[0]})" if item else str(self._dcp_index)
        info.gathered = self._bytes_item(keys[0])
        info.gbuf_base, info.buffers = coalesced_buffers(
            info.gathered, info.params, self.args, self.layout, pp_rank=pp_rank, experts=False, where=source,
            what="the gathered distributed-optimizer state")

    def _check_model_space_state(self, info: _RankInfo, tp_rank: int, pp_rank: int) -> None:
        """Every parameter has Adam state (or none has: saved before the first step), and 16-bit ones
        their fp32 main weight; persistent buffers have none."""
        shapes = {(chunk, p.name): p.shape for chunk, params in enumerate(info.params) for p in params}
        for (chunk, name), piece in info.sources.items():
            found = self._state_keys.get(piece.key, {})
            if rulebook.is_buffer(name) or (self._layer_wise and not self._in_model_space(name, shapes[(chunk, name)])):
                if found:
                    raise CheckpointFormatError(f"{self._dcp_index}: {piece.key} has model-space optimizer state "
                                                f"{sorted(found)}, but {'it is a buffer' if rulebook.is_buffer(name) else 'the layer-wise optimizer keeps its state in flat buckets'}; "
                                                f"the checkpoint is inconsistent.")
                continue
            if not found and not self._state_keys:
                continue
            row = self.parameter_row(name, shapes[(chunk, name)])
            need = set(row.states)
            if self._optim_layout and not self._layer_wise:
                need.add(self._optim_layout.main_param)
            elif self._keys[piece.key].dtype in ("float16", "bfloat16"):
                need.add("fp32_param")
            others = set(self.state_keys) - set(row.states)
            if not need <= set(found) or others & set(found):
                raise CheckpointFormatError(
                    f"{self._dcp_index}: {name} ({self._describe_rank(info, tp_rank, pp_rank)} chunk={chunk}, "
                    f"saved as {piece.key}) has optimizer state {sorted(found)}, expected {sorted(need)} ({row.name}'s "
                    f"under --optimizer {self._row.name}); the checkpoint is incomplete or not this run's.")

    def _check_dtype(self, key: str, allowed: tuple) -> None:
        dtype = self._keys[key].dtype
        if dtype not in allowed:
            raise CheckpointFormatError(
                f"{self._dcp_index}: {key} is saved as {dtype}, expected {' or '.join(allowed)} (what "
                f"Megatron-LM saves for it); the metadata is corrupt or from another kind of run; re-copy the "
                f"iteration folder.")

    def _optimizer_groups(self, info: _RankInfo) -> _RankInfo:
        if info.param_groups is None:
            prefix = distributed_object_prefix(info, "optimizer")
            keys = [k for k, v in self._keys.items() if k.startswith(prefix) and isinstance(v, DcpBytesMeta)]
            if not keys:
                raise CheckpointFormatError(f"{self._dcp_index}: missing {prefix}* (optimizer param groups); "
                                            f"the checkpoint is incomplete, re-copy the iteration folder.")
            index = DcpIndex(keys[0])
            item = self._metadata.storage_data.get(index)
            if item is None:
                raise CheckpointFormatError(f"{self._dcp_index}: lists {keys[0]} but not where it is saved; "
                                            f"the metadata is corrupt, re-copy the iteration folder.")
            where = f"{item.path} (item {keys[0]})"
            try:
                obj = load_dcp_item(self._metadata, index)
            except SafeLoadError as e:
                raise CheckpointFormatError(str(e)) from e
            obj = obj[0] if isinstance(obj, list) and obj else obj
            inner = obj.get("optimizer", obj) if isinstance(obj, dict) else None
            groups = inner.get("param_groups") if isinstance(inner, dict) else None
            if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
                raise structure_error(where, "the optimizer's 'param_groups' (a list of dicts)", groups)
            steps = {scalar(g["step"], path=where, what="a param group's Adam 'step'")
                     for g in groups if g.get("step") is not None}
            if len(steps) > 1:
                raise CheckpointFormatError(f"{where}: param groups disagree on the Adam step {sorted(steps)}; the "
                                            f"file is corrupt, re-copy it.")
            info.step = steps.pop() if steps else None
            info.param_groups = groups  # set last: other threads take a set param_groups as done
        return info

    # -- reading ------------------------------------------------------------------------------

    def shards(self) -> list[ShardRef]:
        refs = []
        for key, info in sorted(self._ranks.items(), key=lambda kv: (kv[0][-1], kv[0][0] == "expert", kv[0][1:])):
            t, p = key[1], key[-1]
            for chunk, params in enumerate(info.params):
                refs += [ShardRef(t, p, chunk, q.name, q.shape, q.dtype, info.ep_rank) for q in params]
        return refs

    def _info_for(self, ref: ShardRef) -> Optional[_RankInfo]:
        """The rank holding a shard: its expert rank for a routed expert in the expert optimizer, else its dense
        (tp, pp) rank (ep_rank 0)."""
        try:
            expert = rulebook.is_expert(ref.local_name)
        except rulebook.UnknownParameterError:
            return None
        if expert and self._chained:
            return self._ranks.get(("expert", ref.tp_rank, ref.ep_rank, ref.pp_rank))
        return self._ranks.get(("dense", ref.tp_rank, ref.pp_rank)) if ref.ep_rank == 0 else None

    def _requests(self, ref: ShardRef, keys: Optional[Collection[str]]) -> _Requests:
        want = set(READ_KEYS if keys is None else keys)
        if not want <= set(READ_KEYS):
            raise ValueError(f"keys={sorted(keys)}: choose from {READ_KEYS}")
        info = self._info_for(ref)
        piece = info.sources.get((ref.vpp_chunk, ref.local_name)) if info else None
        if piece is None:
            raise unknown_shard(ref, self.path)
        regions = list(piece.regions)
        req = _Requests(piece=piece, want=want)
        if rulebook.is_buffer(ref.local_name):
            pass  # a persistent buffer: its value, no optimizer state
        elif self._flat_buckets and not self._in_model_space(ref.local_name, ref.shape):
            for what, (key, start, numel) in self._flat_request(info, ref).items():
                name = "fp32" if what == "param" else what
                if name in want:
                    req.flat[name] = key
                    req.tensors[key] = [((start,), (numel,))]
        elif self._optim_space == "gathered":
            found = coalesced_records(info.gathered, info.gbuf_base, info.buffers, ref.vpp_chunk, ref.local_name)
            if found is None:
                raise CheckpointFormatError(f"{self._dcp_index}: {ref.local_name} is in no DDP buffer of "
                                            f"{self._describe_rank(info, ref.tp_rank, ref.pp_rank)}; the checkpoint "
                                            f"does not match its args.")
            req.records = {name: record for name, record in found.items() if name in want}
        elif self._model_space:
            saved = dict(self._state_keys.get(piece.key, {}))
            # fully_reshardable saves the main weight as 'param', the Float16 optimizer as 'fp32_param'
            main = saved.pop("param", None) or saved.pop("fp32_param", None)
            # FP32Optimizer (and fp32 params of the Float16 optimizer) step the model weight itself
            req.weight_is_main = main is None
            if main is not None:
                saved = {"fp32": main, **saved}
            for name, key in saved.items():
                if name in want or keys is None:
                    req.states[name] = key
                    req.tensors[key] = regions  # model-space state is sharded exactly like the weight
        if "param" in want or req.weight_is_main and "fp32" in want:
            req.tensors[piece.key] = regions
        return req

    def _outputs(self, ref: ShardRef, req: _Requests, got: dict, assemble) -> dict:
        """read()/locate() results from the requested boxes `got` (saved key -> list of parts). The Adam 'step'
        is a 0-d float32 tensor for read() and a float for locate() (which needs no torch)."""
        def step_value(step: float):
            if assemble is _assemble_stored:
                return float(step)
            import torch

            return torch.tensor(float(step), dtype=torch.float32)

        piece, want = req.piece, req.want
        out: dict = {}
        if piece.key in got and "param" in want:
            out["param"] = assemble(got[piece.key], piece)
        if (self._flat_buckets and not self._in_model_space(ref.local_name, ref.shape)) or (
                self._optim_space == "gathered"):
            for name, key in req.flat.items():
                out[name] = assemble(got[key], _Piece(key, 0, (), 0), ref.shape)
            for name, record in req.records.items():
                out[name] = stored_tensor(record) if assemble is _assemble_stored else read_tensor(record)
            step = self._optimizer_groups(self._info_for(ref)).step if not rulebook.is_buffer(ref.local_name) else None
            if step is not None:
                out["step"] = step_value(step)
        elif self._model_space:
            if req.weight_is_main and "fp32" in want:
                out["fp32"] = out["param"] if "param" in out else assemble(got[piece.key], piece)
            out.update({name: assemble(got[key], piece) for name, key in req.states.items()})
            row = self.parameter_row(ref.local_name, ref.shape)
            if row.step and row.states[0] in self._state_keys.get(piece.key, {}) and (
                    self._model_space_step is not None):
                out["step"] = step_value(self._model_space_step)
        return out

    def read(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> dict:
        """The shard's tensors: 'param' (model weight), and with optimizer state 'fp32' (main weight),
        'exp_avg', 'exp_avg_sq', 'step'. `keys` (a subset of READ_KEYS, default all) names the tensors
        wanted; only their bytes are read ('step' comes along whenever Adam state exists). State a release saved
        shifted is repaired (shifted.py)."""
        shifted = self._shifted.params.get(self._shifted.key(ref)) if self._shifted else None
        if shifted is not None:
            try:
                return self._shifted.read(shifted, keys, self._read_saved, self.reset_lost_optimizer_state)
            except ValueError as e:
                raise CheckpointFormatError(str(e)) from None
        return self._read_saved(ref, keys)

    def _read_saved(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> dict:
        """read() of the tensors as saved."""
        req = self._requests(ref, keys)
        got = {fqn: [self._read_box(fqn, box) for box in boxes] for fqn, boxes in req.tensors.items()}
        out = self._outputs(ref, req, got, self._assemble)
        if "fp32" in out and "param" in out and out["fp32"] is out["param"]:
            out["fp32"] = out["param"].clone()
        return out

    def locate(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> Optional[dict]:
        """Like read(), but each tensor is a StoredTensor (where its bytes are in the .distcp files)
        and nothing but the items' pickles is read; None when some tensor is not one contiguous run of
        bytes per saved chunk (read() it then)."""
        shifted = self._shifted.params.get(self._shifted.key(ref)) if self._shifted else None
        if shifted is not None:
            return self._shifted.locate(shifted, keys, self._locate_saved, self.reset_lost_optimizer_state)
        return self._locate_saved(ref, keys)

    def zeroed(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> dict:
        shifted = self._shifted.params.get(self._shifted.key(ref)) if self._shifted else None
        return self._shifted.zeroed(shifted, keys, self.reset_lost_optimizer_state) if shifted is not None else {}

    def _locate_saved(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> Optional[dict]:
        """locate() of the tensors as saved."""
        req = self._requests(ref, keys)
        got = {}
        for fqn, boxes in req.tensors.items():
            parts = [self._locate_box(fqn, box) for box in boxes]
            if any(p is None for p in parts):
                return None
            got[fqn] = parts
        try:
            return self._outputs(ref, req, got, _assemble_stored)
        except _NotContiguous:
            return None

    # -- saved chunks ---------------------------------------------------------------------------

    def _saved_chunks(self, fqn: str) -> dict:
        """{offsets: sizes} of the key's saved chunks, built once per key."""
        found = self._chunks_by_offset.get(fqn)
        if found is None:
            found = self._chunks_by_offset[fqn] = {c.offsets: c.sizes for c in self._keys[fqn].chunks}
        return found

    def _overlaps(self, fqn: str, box: Box) -> list[_Overlap]:
        """The saved chunks holding the box, each with the part it holds; they must tile the box exactly
        (no gap: nothing of the result is left unread; no overlap)."""
        offsets, sizes = box
        chunks = self._saved_chunks(fqn)
        # most boxes are exactly one saved chunk (a TP shard of one layer, a slice of a flat bucket in one DP
        # shard): a dict lookup, not a scan over every saved chunk of the key
        if chunks.get(offsets) == sizes:
            zeros = (0,) * len(sizes)
            return [_Overlap(offsets, zeros, zeros, sizes)]
        found = []
        for chunk_offsets, chunk_sizes in chunks.items():
            common = _intersect(box, (chunk_offsets, chunk_sizes))
            if common is not None:
                lo, lengths = common
                found.append(_Overlap(chunk_offsets, tuple(a - b for a, b in zip(lo, chunk_offsets)),
                                      tuple(a - b for a, b in zip(lo, offsets)), lengths))
        covered = sum(math.prod(o.lengths) for o in found)
        disjoint = all(_intersect((a.dst, a.lengths), (b.dst, b.lengths)) is None
                       for i, a in enumerate(found) for b in found[i + 1:])
        if covered != math.prod(sizes) or not disjoint:
            raise CheckpointFormatError(
                f"{self._dcp_index}: the saved chunks of {fqn} do not cover the box at {offsets} of size "
                f"{sizes} exactly once ({'gaps' if disjoint else 'overlapping chunks'}); the metadata is corrupt, "
                f"re-copy the iteration folder.")
        return found

    def _record(self, fqn: str, chunk_offsets: tuple[int, ...]) -> TensorRecord:
        """The saved chunk's tensor record, verified against the metadata before any of its bytes is used:
        a plain C-contiguous tensor of the declared dtype and chunk shape whose storage is exactly its bytes."""
        index = DcpIndex(fqn, chunk_offsets)
        found = self._records.get(index)
        if found is not None:
            return found
        md = self._keys[fqn]
        sizes = self._saved_chunks(fqn)[chunk_offsets]
        item = self._metadata.storage_data.get(index)
        if item is None:
            raise CheckpointFormatError(f"{self._dcp_index}: lists a chunk of {fqn} at {chunk_offsets} but not "
                                        f"where it is saved; the metadata is corrupt, re-copy the iteration folder.")
        where = f"{item.path}: item {fqn} at {chunk_offsets} (bytes {item.offset}..{item.offset + item.length})"
        if item.transform_descriptors:
            raise CheckpointFormatError(f"{where} was saved with transforms {list(item.transform_descriptors)} (e.g. "
                                        f"compression), which megatron-ucp does not read; re-save without them.")
        try:
            record = load_dcp_item(self._metadata, index)
        except SafeLoadError as e:
            raise CheckpointFormatError(str(e)) from e
        plain = (isinstance(record, TensorRecord) and record.storage_offset == 0 and record.is_c_contiguous()
                 and record.storage_nbytes == record.nbytes)
        if not (plain and record.dtype == md.dtype and record.shape == sizes):
            if isinstance(record, TensorRecord):
                held = f"{record.dtype} data of shape {record.shape}" + (
                    "" if plain else " (not a plain contiguous tensor over its own storage)")
            else:
                held = f"a {type(record).__name__}"
            raise CheckpointFormatError(
                f"{where} holds {held} but {self._dcp_index} declares {md.dtype} data of shape {sizes}; "
                f"the .distcp file is corrupt or belongs to another checkpoint (files swapped?); re-copy the "
                f"iteration folder.")
        self._records[index] = record
        return record

    def _read_box(self, fqn: str, box: Box):
        """The box of a saved key as a new contiguous tensor: only the bytes of the chunks it overlaps are
        read, each chunk verified first; the result is allocated after that (its size is then bounded by
        the files)."""
        import torch

        if fqn in self._fragments:
            return self._read_flat_box(fqn, box)
        overlaps = self._overlaps(fqn, box)
        parts = [(o, box_record(self._record(fqn, o.chunk), o.src, o.lengths)) for o in overlaps]
        if len(parts) == 1 and parts[0][0].lengths == box[1]:
            return read_tensor(parts[0][1]).contiguous()
        out = torch.empty(box[1], dtype=torch_dtype(self._keys[fqn].dtype))
        for o, record in parts:
            view = out
            for dim, (start, length) in enumerate(zip(o.dst, o.lengths)):
                view = view.narrow(dim, start, length)
            view.copy_(read_tensor(record))
        return out

    def _locate_box(self, fqn: str, box: Box):
        """Where the box's bytes are (a StoredTensor), or None when they are not one run per saved chunk."""
        from megatron_ucp.core.dtypes import itemsize as itemsize_of
        from megatron_ucp.io.byteio import StoredTensor, box_bytes, concat_stored

        if fqn in self._fragments:
            return self._locate_flat_box(fqn, box)
        overlaps = self._overlaps(fqn, box)
        if len(overlaps) == 1 and overlaps[0].lengths == box[1]:
            return stored_tensor(self._record(fqn, overlaps[0].chunk))
        dtype = str(self._keys[fqn].dtype)  # a name: locating bytes needs no torch
        itemsize = itemsize_of(dtype)
        placed = []
        for o in overlaps:
            saved = stored_tensor(self._record(fqn, o.chunk))
            src = box_bytes(saved.shape, o.src, o.lengths, itemsize) if saved is not None else None
            dst = box_bytes(box[1], o.dst, o.lengths, itemsize)
            if src is None or dst is None:
                return None
            placed.append((dst[0], saved.byte_slice(src[0], src[0] + src[1]), src[1]))
        placed.sort(key=lambda p: p[0])
        pos = 0
        for dst_start, _, nbytes in placed:
            if dst_start != pos:
                return None
            pos += nbytes
        parts = [StoredTensor((nbytes // itemsize,), dtype, tuple(regions)) for _, regions, nbytes in placed]
        return concat_stored(parts, box[1]) if parts else None

    @staticmethod
    def _assemble(parts: list, piece: _Piece, shape: Optional[tuple] = None):
        import torch

        tensor = torch.cat(parts, dim=piece.axis) if len(parts) > 1 else parts[0]
        if shape is not None:
            return tensor.view(shape)
        return tensor.reshape(tensor.shape[piece.lead:]) if piece.lead else tensor

    def _flat_request(self, info: _RankInfo, ref: ShardRef) -> dict:
        for i, buf in enumerate(info.buffers[ref.vpp_chunk]):
            try:
                span = buf.span(ref.local_name)
            except KeyError:
                continue
            gbuf = info.gbuf_base[ref.vpp_chunk] + i
            keys = self._buckets[(self._chain_of_buckets(info), info.group_idx, gbuf, (str(buf.param_dtype), str(buf.grad_dtype)),
                                  span.bucket)]
            start = buf.offset_in_bucket(span)
            return {what: (keys[what], start, math.prod(span.shape)) for what in ("param", "exp_avg", "exp_avg_sq")}
        raise CheckpointFormatError(f"{self._dcp_index}: {ref.local_name} is in no DDP buffer of "
                                    f"{self._describe_rank(info, ref.tp_rank, ref.pp_rank)}; the checkpoint does not "
                                    f"match its args.")

    def common_state(self) -> dict:
        if self._layer_wise:  # [the emerging optimizer's groups, its scalar optimizer's]: the chain's order
            groups = list(self._model_space_groups) + list(
                self._optimizer_groups(self._ranks[("dense", 0, 0)]).param_groups)
        elif self._flat_buckets or self._optim_space == "gathered":
            # the ChainedOptimizer's groups: the dense optimizer's, then the expert optimizer's
            groups = list(self._optimizer_groups(self._ranks[("dense", 0, 0)]).param_groups)
            if self._chained:
                groups += self._optimizer_groups(self._ranks[("expert", 0, 0, 0)]).param_groups
        else:
            groups = self._model_space_groups
        return build_common_state(iteration=self.iteration, args=self.args,
                                  checkpoint_version=self._common.get("checkpoint_version"),
                                  opt_param_scheduler=self._common.get("opt_param_scheduler"),
                                  param_groups=groups,
                                  num_flops=self._common.get("num_floating_point_operations_so_far"))

    # -- run state besides tensors ------------------------------------------------------------------

    @property
    def _dcp_index(self) -> Path:
        """The folder's DCP index (.metadata), as error messages name it."""
        return self.path / names.DCP_METADATA_FILENAME

    def _bytes_item(self, key: str):
        """A pickled object saved as a DCP bytes item (a ShardedObject), parsed through the allow-list."""
        index = DcpIndex(key)
        if index not in self._metadata.storage_data:
            raise CheckpointFormatError(f"{self._dcp_index}: lists {key} but not where it is saved; the "
                                        f"metadata is corrupt, re-copy the iteration folder.")
        try:
            saved = load_dcp_item(self._metadata, index)
        except SafeLoadError as e:
            raise CheckpointFormatError(str(e)) from e
        return saved[0] if isinstance(saved, list) and len(saved) == 1 else saved  # DCP saves [object]

    def loss_scaler(self):
        """dp_reshardable: the ShardedObject optimizer.distributed.dp_group_idx_<m>.grad_scaler of every
        model-parallel rank m (all equal: checked); otherwise common.pt['optimizer']['grad_scaler']."""
        from megatron_ucp.core.run_state import LossScalerState, RunStateError

        if self.weights_only:
            return None  # part of the optimizer's state
        found = {}
        try:
            for key, md in self._keys.items():
                if isinstance(md, DcpBytesMeta) and names.is_grad_scaler_key(key):
                    found[key] = LossScalerState.from_saved(self._bytes_item(key), f"{self.path} item {key}")
            for i, part in enumerate(self._optimizer_common_parts()):
                if "grad_scaler" in part:
                    found[f"common {i}"] = LossScalerState.from_saved(
                        part["grad_scaler"], f"{self._common_file} optimizer grad_scaler")
        except RunStateError as e:
            raise CheckpointFormatError(f"{e}; the checkpoint is corrupt, re-copy it") from None
        states = set(found.values())
        if len(states) > 1:
            raise CheckpointFormatError(f"{self.path}: the saved loss-scaler states differ ({sorted(found)}); the "
                                        f"checkpoint mixes saves, re-copy the iteration folder")
        return states.pop() if states else None

    def rng_states(self) -> list:
        """The ShardedObject 'rng_state': one item per (pp, tp) rank (rng_state/shard_<pp>.<tp>_<PP>.<TP>), or
        per (pp, tp, dp) rank with expert parallelism; each holds a one-element list."""
        from megatron_ucp.core.run_state import RankRngState, RunStateError

        out = []
        for key, md in self._keys.items():
            parsed = names.parse_sharded_object_key(key)
            if not parsed or parsed[0] != names.RNG_STATE_KEY or not isinstance(md, DcpBytesMeta):
                continue
            offsets = parsed[1]
            if len(offsets) not in (2, 3):
                raise CheckpointFormatError(f"{self._dcp_index}: {key} is not sharded by (pp, tp) or "
                                            f"(pp, tp, dp); the checkpoint was not written by Megatron-LM.")
            state = self._bytes_item(key)
            state = state[0] if isinstance(state, list) and len(state) == 1 else state  # the harness's [state]
            try:
                out.append(RankRngState.from_saved(state, pp=offsets[0], tp=offsets[1],
                                                   dp=offsets[2] if len(offsets) == 3 else None,
                                                   where=f"{self.path} item {key}"))
            except RunStateError as e:
                raise CheckpointFormatError(f"{e}; the checkpoint is corrupt, re-copy it") from None
        return sorted(out, key=lambda s: (s.pp, s.tp, -1 if s.dp is None else s.dp))
