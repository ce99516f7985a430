"""Reader for Megatron-LM's `torch_dist` checkpoint format (megatron-core dist_checkpointing on
torch.distributed.checkpoint).

Layout of iter_XXXXXXX/: metadata.json ({"sharded_backend": "torch_dist", ...}), common.pt (args,
iteration, opt_param_scheduler, checkpoint_version, content_metadata with
'distrib_optim_sharding_type'), .metadata + __<rank>_<n>.distcp (DCP). Bytes are read through
torch's own FileSystemReader with a small LoadPlanner that asks only for the chunks one shard needs.

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
- No distributed optimizer (FP32Optimizer / Float16OptimizerWithFloat16Params.sharded_state_dict via
  dist_checkpointing.optimizer.optim_state_to_sharding_state): 'optimizer.state.{exp_avg,exp_avg_sq}.
  <model key>' and, with --bf16/--fp16, the fp32 main weights 'optimizer.state.fp32_param.<model key>'.
  The per-parameter Adam step is saved once as common.pt['optimizer']['state']['common_step']
  (FP32Optimizer) or common.pt['optimizer']['optimizer']['state']['common_step'] (Float16), next to
  'param_groups' (without 'params'). FP32Optimizer steps the model weight itself, so 'fp32' is the weight.
With tied embeddings and PP > 1 the last stage's output-layer state is saved once, under the word
embedding's key (its gradient is all-reduced over the embedding group, so both copies are equal).
A ChainedOptimizer of several optimizers saves common.pt['optimizer'] = {0: ..., 1: ...} and may
prefix tensor keys with 'chained_<i>.'; both are accepted.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio, create_read_items_for_chunk_list

from megatron_ucp.adapters import gpt as rulebook
from megatron_ucp.byteio import FileRegion, StoredTensor, box_bytes, concat_stored
from megatron_ucp.formats.archive import archive_data_record, meta_load
from megatron_ucp.formats.base import READ_KEYS, CheckpointReader, ShardRef
from megatron_ucp.formats.bucket_layout import (
    BufferLayout, BufferParam, DDPBucketConfig, build_chunk_buffers, shared_embedding_names)
from megatron_ucp.formats.common import (
    CheckpointFormatError, args_to_dict, build_common_state, layout_from_args, load_pickled, load_pickled_bytes)
from megatron_ucp.layout import LayoutError
from megatron_ucp.model_config import GPTModelConfig

# optimizer state in model space: fully_reshardable distributed optimizer, FP32 / Float16 optimizers
_MODEL_SPACE_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(param|fp32_param|exp_avg|exp_avg_sq)\.(.+)$")

_BUCKET_KEY = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((.+), (.+)\)\.bucket_idx_(\d+)\."
    r"(param|exp_avg|exp_avg_sq)$")


@dataclass(frozen=True)
class _Piece:
    """Where a local tensor comes from: saved key, how many leading axes of the saved tensor index it
    (stacked layer, expert: each region has size 1 there), and the global (offsets, sizes) regions to
    concatenate along `axis` (axis counts the leading axes)."""

    key: str
    lead: int
    regions: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    axis: int


@dataclass
class _RankInfo:
    params: list[list[BufferParam]]  # per chunk, registration order, local shapes
    sources: dict = field(default_factory=dict)  # (chunk, local name) -> _Piece
    buffers: list[list[BufferLayout]] = field(default_factory=list)
    gbuf_base: list[int] = field(default_factory=list)
    step: Optional[float] = None
    param_groups: Optional[list] = None


class _SliceLoadPlanner(LoadPlanner):
    """Reads requested regions of saved tensors into fresh tensors, and pickled byte items."""

    def __init__(self, metadata, tensor_requests: dict[str, list[ChunkStorageMetadata]], byte_keys: list[str]):
        self.metadata = metadata
        self.tensor_requests = tensor_requests
        self.byte_keys = byte_keys
        self.tensors: dict[str, list[torch.Tensor]] = {}
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for fqn, chunks in self.tensor_requests.items():
            md = self.metadata.state_dict_metadata[fqn]
            self.tensors[fqn] = [torch.empty(tuple(c.sizes), dtype=md.properties.dtype) for c in chunks]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        for fqn in self.byte_keys:
            items.append(_create_read_item_for_byteio(MetadataIndex(fqn), 0, MetadataIndex(fqn), 0, 0))
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        self.objects[read_item.dest_index.fqn] = load_pickled_bytes(value, what=read_item.dest_index.fqn)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        dest = self.tensors[read_item.dest_index.fqn][read_item.dest_index.index]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, offset, length)
        return dest

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination


@dataclass
class _Requests:
    """What one read()/locate() asks of the checkpoint: chunks per saved key, and how to name them."""

    piece: _Piece
    want: set
    tensors: dict = field(default_factory=dict)  # saved key -> [ChunkStorageMetadata]
    flat: dict = field(default_factory=dict)  # out name -> saved key (flat buckets)
    states: dict = field(default_factory=dict)  # out name -> saved key (model-space state)
    weight_is_main: bool = False


class _NotContiguous(Exception):
    pass


_UNSET = object()


def _assemble_stored(parts: list[StoredTensor], piece: _Piece, shape: Optional[tuple] = None) -> StoredTensor:
    """_assemble for StoredTensors: chunks concatenated along the piece's axis are one run of bytes only
    when every dim before that axis has size 1."""
    if len(parts) > 1 and math.prod(parts[0].shape[:piece.axis]) != 1:
        raise _NotContiguous(piece.key)
    full = list(parts[0].shape)
    full[piece.axis] = sum(p.shape[piece.axis] for p in parts)
    if shape is None:
        shape = tuple(full[piece.lead:])
    return concat_stored(parts, shape)


class TorchDistCheckpoint(CheckpointReader):
    """A `torch_dist` format checkpoint; see the module docstring."""

    format = "torch_dist"
    # read() keeps no per-call state (each call plans and opens its own streams): threads may share one
    thread_safe_reads = True

    def __init__(self, iter_dir: Path, iteration: int):
        self.path = Path(iter_dir)
        self.iteration = iteration
        self._check_backend()
        common_file = self.path / "common.pt"
        common = load_pickled(common_file, what="the common state (args, iteration, scheduler)",
                              fix="Every torch_dist checkpoint has one; re-copy the iteration folder.")
        if not isinstance(common, dict) or "args" not in common:
            raise CheckpointFormatError(f"{common_file}: has no 'args'; not written by Megatron-LM's save_checkpoint.")
        if common.get("iteration") != iteration:
            raise CheckpointFormatError(
                f"{common_file}: holds iteration {common.get('iteration')} but lives in {self.path.name}; files of "
                f"different iterations were mixed. Re-copy the iteration folder from one save.")
        self.args = args_to_dict(common["args"], source=common_file)
        self.layout = layout_from_args(self.args)
        self.config = GPTModelConfig.from_megatron_args(self.args)
        self._common = {k: v for k, v in common.items() if k not in ("args", "rng_state")}
        del common
        self._reader, self._metadata = self._open_dcp()
        self._keys = self._metadata.state_dict_metadata
        # 'dp_reshardable' | 'fully_reshardable' with the distributed optimizer, else None
        self.distrib_optim_sharding: Optional[str] = None
        self.optimizer_kind = self._detect_optimizer()
        self._flat_buckets = self.distrib_optim_sharding == "dp_reshardable"
        self._buckets = self._index_buckets() if self._flat_buckets else {}
        self._state_keys = self._index_model_space_state() if self._model_space else {}
        self._model_space_groups, self._model_space_step = (
            self._model_space_common() if self._model_space else (None, None))
        self._item_cache: dict = {}  # MetadataIndex -> Optional[StoredTensor]
        self._plain_keys: dict[str, bool] = {}  # saved key -> its chunks are plain contiguous tensors
        self._chunks_by_offset: dict[str, dict] = {}  # saved key -> {chunk offsets: chunk sizes}
        self._chunks_by_layer: dict[str, dict] = {}  # stacked saved key -> {layer: [chunks]}
        self._ranks: dict[tuple[int, int], _RankInfo] = {}
        try:
            self._expected_shapes = dict(rulebook.expected_parameters(self.config))
        except (ValueError, NotImplementedError) as e:
            raise CheckpointFormatError(f"{common_file}: {e}") from e
        self._used_keys: set = set()
        for pp_rank in range(self.layout.pp):
            for tp_rank in range(self.layout.tp):
                self._ranks[(tp_rank, pp_rank)] = self._rank_info(tp_rank, pp_rank)
        self._check_all_keys_used()

    # -- opening ------------------------------------------------------------------------------

    def _check_backend(self) -> None:
        meta_json = self.path / "metadata.json"
        if not meta_json.is_file():
            raise CheckpointFormatError(f"{meta_json}: missing; re-copy the torch_dist iteration folder.")
        try:
            backend = json.loads(meta_json.read_text()).get("sharded_backend")
        except ValueError as e:
            raise CheckpointFormatError(f"{meta_json}: not valid JSON ({e}); re-copy it.") from e
        if backend != "torch_dist":
            raise CheckpointFormatError(f"{meta_json}: sharded_backend={backend!r}; only 'torch_dist' is supported "
                                        f"(convert zarr checkpoints with Megatron-LM first).")

    def _open_dcp(self):
        meta_file = self.path / ".metadata"
        if not meta_file.is_file():
            raise CheckpointFormatError(f"{meta_file}: missing DCP metadata; re-copy the iteration folder.")
        reader = FileSystemReader(str(self.path))
        try:
            metadata = reader.read_metadata()
        except Exception as e:
            raise CheckpointFormatError(f"{meta_file}: cannot read DCP metadata ({type(e).__name__}: {e}); the "
                                        f"file is truncated or corrupt, re-copy it.") from e
        reader.set_up_storage_reader(metadata, is_coordinator=True)
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for rel, size in sorted(needed.items()):
            f = self.path / rel
            if not f.is_file():
                raise CheckpointFormatError(f"{f}: missing data file listed in {meta_file}; re-copy the iteration folder.")
            if f.stat().st_size < size:
                raise CheckpointFormatError(f"{f}: truncated ({f.stat().st_size} bytes, the metadata needs {size}); "
                                            f"re-copy it.")
        return reader, metadata

    @property
    def _model_space(self) -> bool:
        """Optimizer state saved per parameter, with the model key's shape and chunks."""
        return self.optimizer_kind in ("adam", "mixed_precision") or self.distrib_optim_sharding == "fully_reshardable"

    def _detect_optimizer(self) -> str:
        opt_keys = [k for k in self._keys if k.startswith(("optimizer.", "chained_"))]
        opt_common = self._common.get("optimizer")
        if not opt_keys and opt_common is None:
            return "none"
        content = self._common.get("content_metadata") or {}
        sharding = content.get("distrib_optim_sharding_type")
        common_file = self.path / "common.pt"
        if self.args.get("num_experts"):
            raise CheckpointFormatError(f"{self.path}: MoE optimizer state is not supported yet.")
        if self.args.get("optimizer", "adam") != "adam":
            raise CheckpointFormatError(f"{common_file}: args.optimizer={self.args.get('optimizer')!r}; only Adam "
                                        f"state (exp_avg, exp_avg_sq) can be read.")
        if any(k.startswith("optimizer.distributed.") for k in opt_keys) or sharding == "dp_reshardable":
            if sharding != "dp_reshardable":
                raise CheckpointFormatError(
                    f"{common_file}: distrib_optim_sharding_type={sharding!r} with flat-bucket optimizer keys; "
                    f"only 'dp_reshardable' (Megatron-LM's default) and 'fully_reshardable' "
                    f"(--dist-ckpt-optim-fully-reshardable) are supported.")
            self.distrib_optim_sharding = sharding
            return "distributed"
        if sharding == "fully_reshardable":
            self.distrib_optim_sharding = sharding
            return "distributed"
        if sharding is not None or self.args.get("use_distributed_optimizer"):
            raise CheckpointFormatError(
                f"{common_file}: distributed-optimizer state with distrib_optim_sharding_type={sharding!r}; only "
                f"'dp_reshardable' (Megatron-LM's default) and 'fully_reshardable' (--dist-ckpt-optim-fully-"
                f"reshardable) are supported. Re-save it with a recent Megatron-LM, or use the legacy 'torch' format.")
        subs = self._optimizer_common_parts()
        # Float16OptimizerWithFloat16Params nests the torch state under 'optimizer'; FP32Optimizer does not
        if any("optimizer" in sub or "fp32_from_fp16_params" in sub for sub in subs) or any(
                _MODEL_SPACE_KEY.match(k) and _MODEL_SPACE_KEY.match(k).group(1) == "fp32_param" for k in opt_keys):
            return "mixed_precision"
        return "adam"

    def _optimizer_common_parts(self) -> list[dict]:
        """common.pt['optimizer'] as a list of single-optimizer states (a ChainedOptimizer saves {i: state})."""
        opt = self._common.get("optimizer")
        if opt is None:
            return []
        if not isinstance(opt, dict):
            raise CheckpointFormatError(f"{self.path / 'common.pt'}: 'optimizer' is a {type(opt).__name__}, "
                                        f"expected the dict megatron-core's optimizer.sharded_state_dict leaves.")
        return [opt[k] for k in sorted(opt)] if opt and all(isinstance(k, int) for k in opt) else [opt]

    def _index_model_space_state(self) -> dict[str, dict[str, str]]:
        """model key -> {'param' | 'fp32_param' | 'exp_avg' | 'exp_avg_sq': saved key}."""
        out: dict[str, dict[str, str]] = {}
        for key, md in self._keys.items():
            m = _MODEL_SPACE_KEY.match(key)
            if not m or not isinstance(md, TensorStorageMetadata):
                continue
            what, model_key = m.groups()
            if model_key not in self._keys:
                raise CheckpointFormatError(f"{self.path / '.metadata'}: optimizer state {key} belongs to no saved "
                                            f"model tensor {model_key!r}.")
            if tuple(md.size) != tuple(self._keys[model_key].size):
                raise CheckpointFormatError(
                    f"{self.path / '.metadata'}: {key} has global shape {tuple(md.size)} but the model tensor "
                    f"{model_key} has {tuple(self._keys[model_key].size)}; the checkpoint is inconsistent.")
            if what in out.setdefault(model_key, {}):
                raise CheckpointFormatError(f"{self.path / '.metadata'}: {what} state of {model_key} is saved "
                                            f"twice ({out[model_key][what]}, {key}).")
            out[model_key][what] = key
        expected = {"param", "exp_avg", "exp_avg_sq"} if self.distrib_optim_sharding else {"exp_avg", "exp_avg_sq"}
        for model_key, found in out.items():
            if not expected <= set(found):
                raise CheckpointFormatError(
                    f"{self.path / '.metadata'}: optimizer state of {model_key} has {sorted(found)}, expected "
                    f"{sorted(expected)}; the checkpoint is incomplete or not an Adam checkpoint.")
        if not out and self.distrib_optim_sharding:
            raise CheckpointFormatError(f"{self.path / '.metadata'}: distrib_optim_sharding_type='fully_reshardable' "
                                        f"but no optimizer.state.param.* tensors are saved.")
        return out

    def _model_space_common(self) -> tuple[list, Optional[float]]:
        """(param groups, Adam step) from common.pt for model-space optimizer state."""
        groups: list = []
        steps: set = set()
        for sub in self._optimizer_common_parts():
            inner = sub.get("optimizer", sub)  # Float16 optimizer and distributed optimizer nest it
            groups += list(inner.get("param_groups") or [])
            steps |= {float(g["step"]) for g in inner.get("param_groups") or [] if g.get("step") is not None}
            common_step = (inner.get("state") or {}).get("common_step")
            if common_step is not None:
                steps.add(float(common_step))
        if len(steps) > 1:
            raise CheckpointFormatError(f"{self.path / 'common.pt'}: the optimizer state disagrees on the Adam step "
                                        f"{sorted(steps)}.")
        return groups, (steps.pop() if steps else None)

    def _index_buckets(self) -> dict:
        """(mp rank, gbuf, (param dtype str, grad dtype str), bucket) -> {state key: saved key}."""
        out: dict = {}
        for key in self._keys:
            m = _BUCKET_KEY.match(key)
            if m:
                mp, g, pd, gd, b, what = m.groups()
                out.setdefault((int(mp), int(g), (pd, gd), int(b)), {})[what] = key
        if not out:
            raise CheckpointFormatError(f"{self.path / '.metadata'}: no optimizer.distributed.*bucket_idx_* tensors.")
        return out

    def _piece(self, canonical: str, local: str, tp_rank: int) -> _Piece:
        """Where a rank's local tensor is in the saved global tensor: its pattern's blocks, as boxes of
        the saved key (with the stacked layer / expert indices in front)."""
        candidates = rulebook.torch_dist_keys(canonical, self.config)
        key, lead = next(((k, lead) for k, lead in candidates if k in self._keys), candidates[0])
        md = self._keys.get(key)
        where = f"{self.path / '.metadata'}: {key}"
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointFormatError(f"{where} is missing (needed for {local}); the checkpoint is incomplete or "
                                        f"does not match its args")
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
            blocks = pattern.rank_blocks(shape, tp_rank, self.layout.tp, name=canonical)
        except (LayoutError, ValueError) as e:
            raise CheckpointFormatError(f"{where}: {e}") from e
        ones = (1,) * len(lead)
        regions = tuple((tuple(lead) + tuple(r.start for r in b.dst), ones + tuple(r.stop - r.start for r in b.dst))
                        for b in blocks)
        return _Piece(key, len(lead), regions, (pattern.dim or 0) + len(lead))

    def _rank_info(self, tp_rank: int, pp_rank: int) -> _RankInfo:
        """The rank's parameters (the rulebook's, in registration order) and where each one is saved."""
        info = _RankInfo(params=[])
        for chunk in range(self.layout.num_chunks):
            try:
                entries = rulebook.parameters_for_rank(self.config, self.layout, pp_rank,
                                                       chunk if self.layout.vpp else None)
            except (LayoutError, ValueError, NotImplementedError) as e:
                raise CheckpointFormatError(f"{self.path}: {e}") from e
            params = []
            for local, _, canonical in entries:
                piece = self._piece(canonical, local, tp_rank)
                shape = list(piece.regions[0][1])
                shape[piece.axis] = sum(r[1][piece.axis] for r in piece.regions)
                shape = shape[piece.lead:]
                params.append(BufferParam(local, tuple(shape), self._keys[piece.key].properties.dtype))
                info.sources[(chunk, local)] = piece
                self._used_keys.add(piece.key)
            info.params.append(params)
        if self._flat_buckets:
            self._attach_buffers(info, tp_rank, pp_rank)
        elif self._model_space:
            self._check_model_space_state(info, tp_rank, pp_rank)
        return info

    def _check_all_keys_used(self) -> None:
        """Every saved model tensor belongs to a parameter the rulebook knows (nothing silently dropped)."""
        unused = sorted(k for k, v in self._keys.items() if isinstance(v, TensorStorageMetadata)
                        and not k.startswith(("optimizer.", "chained_", "rng_state")) and not rulebook.is_ignorable(k)
                        and k not in self._used_keys)
        if unused:
            raise CheckpointFormatError(
                f"{self.path / '.metadata'}: saved tensors {unused[:5]} belong to no parameter of the model its args "
                f"describe (transformer_impl={self.args.get('transformer_impl')!r}); add them to the GPT rulebook "
                f"(megatron_ucp/adapters/gpt.py) if the model really has them")

    def _attach_buffers(self, info: _RankInfo, tp_rank: int, pp_rank: int) -> None:
        mp = tp_rank + self.layout.tp * pp_rank
        num_params = sum(p.numel for chunk in info.params for p in chunk)
        gbuf = 0
        for chunk, params in enumerate(info.params):
            config = DDPBucketConfig.from_megatron_args(self.args, pp_rank=pp_rank, vpp_chunk=chunk,
                                                        rank_num_parameters=num_params)
            shared = shared_embedding_names(self.args, pp_rank=pp_rank, vpp_chunk=chunk, names=[p.name for p in params])
            params = [BufferParam(p.name, p.shape, p.dtype, shared_embedding=p.name in shared) for p in params]
            buffers = build_chunk_buffers(params, config)
            info.gbuf_base.append(gbuf)
            info.buffers.append(buffers)
            for buf in buffers:
                dtypes = (str(buf.param_dtype), str(buf.grad_dtype))
                for b, bucket in enumerate(buf.buckets):
                    keys = self._buckets.get((mp, gbuf, dtypes, b))
                    if keys is None or set(keys) != {"param", "exp_avg", "exp_avg_sq"}:
                        raise CheckpointFormatError(
                            f"{self.path / '.metadata'}: no complete optimizer bucket dp_group_idx_{mp}.gbuf_idx_{gbuf}"
                            f".dtype_{dtypes}.bucket_idx_{b} for tp={tp_rank} pp={pp_rank}; the DDP settings in args "
                            f"do not match the saved buffers.")
                    md = self._keys[keys["param"]]
                    starts = {c.offsets[0] for c in md.chunks}
                    spans = [s for s in buf.params if s.bucket == b]
                    if tuple(md.size) != (bucket.numel_unpadded,) or any(
                            buf.offset_in_bucket(s) not in starts for s in spans):
                        raise CheckpointFormatError(
                            f"{self.path / '.metadata'}: {keys['param']} has shape {tuple(md.size)} and chunk starts "
                            f"that do not match the 64-aligned layout of rank tp={tp_rank} pp={pp_rank} "
                            f"(expected {bucket.numel_unpadded} elements); unsupported model or DDP layout.")
                gbuf += 1
        n_saved = len({k[1] for k in self._buckets if k[0] == mp})
        if n_saved != gbuf:
            raise CheckpointFormatError(f"{self.path / '.metadata'}: dp_group_idx_{mp} has {n_saved} buffers, the model "
                                        f"needs {gbuf}.")

    def _check_model_space_state(self, info: _RankInfo, tp_rank: int, pp_rank: int) -> None:
        """Every parameter has Adam state (or none has: saved before the first step), and 16-bit ones
        their fp32 main weight."""
        for (chunk, name), piece in info.sources.items():
            found = self._state_keys.get(piece.key, {})
            if not found and not self._state_keys:
                continue
            need = {"exp_avg", "exp_avg_sq"}
            if self.distrib_optim_sharding == "fully_reshardable":
                need.add("param")
            elif self._keys[piece.key].properties.dtype in (torch.float16, torch.bfloat16):
                need.add("fp32_param")
            if not need <= set(found):
                raise CheckpointFormatError(
                    f"{self.path / '.metadata'}: {name} (tp={tp_rank} pp={pp_rank} chunk={chunk}, saved as "
                    f"{piece.key}) has optimizer state {sorted(found)}, expected {sorted(need)}; the checkpoint is "
                    f"incomplete.")

    def _optimizer_groups(self, tp_rank: int, pp_rank: int) -> dict:
        info = self._ranks[(tp_rank, pp_rank)]
        if info.param_groups is None:
            mp = tp_rank + self.layout.tp * pp_rank
            prefix = f"optimizer.distributed.dp_group_idx_{mp}.optimizer/"
            keys = [k for k, v in self._keys.items() if k.startswith(prefix) and isinstance(v, BytesStorageMetadata)]
            if not keys:
                raise CheckpointFormatError(f"{self.path / '.metadata'}: missing {prefix}* (optimizer param groups).")
            obj = self._read({}, keys[:1]).objects[keys[0]]
            obj = obj[0] if isinstance(obj, list) else obj
            groups = obj.get("optimizer", obj).get("param_groups", [])
            steps = {g.get("step") for g in groups if g.get("step") is not None}
            if len(steps) > 1:
                raise CheckpointFormatError(f"{keys[0]}: param groups disagree on the Adam step {sorted(steps)}.")
            info.step = steps.pop() if steps else None
            info.param_groups = groups  # set last: other threads take a set param_groups as done
        return info

    # -- reading ------------------------------------------------------------------------------

    def _read(self, tensor_requests: dict, byte_keys: list) -> _SliceLoadPlanner:
        planner = _SliceLoadPlanner(self._metadata, tensor_requests, byte_keys)
        plan = self._reader.prepare_local_plan(planner.create_local_plan())
        plan = planner.finish_plan(self._reader.prepare_global_plan([plan])[0])
        try:
            self._reader.read_data(plan, planner).wait()
        except CheckpointFormatError:
            raise
        except Exception as e:
            raise CheckpointFormatError(f"{self.path}: reading {sorted(tensor_requests) + byte_keys} failed "
                                        f"({type(e).__name__}: {e}); a .distcp file is corrupt, re-copy it.") from e
        return planner

    def shards(self) -> list[ShardRef]:
        refs = []
        for (t, p), info in sorted(self._ranks.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            for chunk, params in enumerate(info.params):
                refs += [ShardRef(t, p, chunk, q.name, q.shape, q.dtype) for q in params]
        return refs

    def _requests(self, ref: ShardRef, keys: Optional[Collection[str]]) -> "_Requests":
        want = set(READ_KEYS if keys is None else keys)
        if not want <= set(READ_KEYS):
            raise ValueError(f"keys={sorted(keys)}: choose from {READ_KEYS}")
        info = self._ranks.get((ref.tp_rank, ref.pp_rank))
        piece = info.sources.get((ref.vpp_chunk, ref.local_name)) if info else None
        if piece is None:
            raise KeyError(f"{ref}: not in {self.path}")
        regions = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in piece.regions]
        req = _Requests(piece=piece, want=want)
        if self._flat_buckets:
            for what, (key, start, numel) in self._flat_request(info, ref).items():
                name = "fp32" if what == "param" else what
                if name in want:
                    req.flat[name] = key
                    req.tensors[key] = [ChunkStorageMetadata(torch.Size([start]), torch.Size([numel]))]
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

    def _outputs(self, ref: ShardRef, req: "_Requests", got: dict, assemble) -> dict:
        """read()/locate() results from the requested chunks `got` (fqn -> list of parts)."""
        piece, want = req.piece, req.want
        out: dict = {}
        if piece.key in got and "param" in want:
            out["param"] = assemble(got[piece.key], piece)
        if self._flat_buckets:
            for name, key in req.flat.items():
                out[name] = assemble(got[key], _Piece(key, 0, (), 0), ref.shape)
            step = self._optimizer_groups(ref.tp_rank, ref.pp_rank).step
            if step is not None:
                out["step"] = torch.tensor(float(step), dtype=torch.float32)
        elif self._model_space:
            if req.weight_is_main and "fp32" in want:
                out["fp32"] = out["param"] if "param" in out else assemble(got[piece.key], piece)
            out.update({name: assemble(got[key], piece) for name, key in req.states.items()})
            if "exp_avg" in self._state_keys.get(piece.key, {}) and self._model_space_step is not None:
                out["step"] = torch.tensor(self._model_space_step, dtype=torch.float32)
        return out

    def read(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> dict[str, torch.Tensor]:
        """The shard's tensors: 'param' (model weight), and with optimizer state 'fp32' (main weight),
        'exp_avg', 'exp_avg_sq', 'step'. `keys` (a subset of READ_KEYS, default all) names the tensors
        wanted; only their bytes are read ('step' comes along whenever Adam state exists)."""
        req = self._requests(ref, keys)
        got = self._read(req.tensors, []).tensors if req.tensors else {}
        out = self._outputs(ref, req, got, self._assemble)
        if "fp32" in out and "param" in out and out["fp32"] is out["param"]:
            out["fp32"] = out["param"].clone()
        return out

    def locate(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> Optional[dict]:
        """Like read(), but each tensor is a StoredTensor (where its bytes are in the .distcp files)
        and nothing but pickles is read; None when some tensor is not one contiguous run of bytes
        per saved chunk (read() it then)."""
        req = self._requests(ref, keys)
        got = {}
        for fqn, chunks in req.tensors.items():
            parts = [self._locate_chunk(fqn, c) for c in chunks]
            if any(p is None for p in parts):
                return None
            got[fqn] = parts
        try:
            out = self._outputs(ref, req, got, _assemble_stored)
        except _NotContiguous:
            return None
        return out

    def _saved_chunks(self, fqn: str) -> dict:
        """{offsets: sizes} of the key's saved chunks, built once per key."""
        found = self._chunks_by_offset.get(fqn)
        if found is None:
            found = self._chunks_by_offset[fqn] = {tuple(c.offsets): tuple(c.sizes) for c in self._keys[fqn].chunks}
        return found

    def _saved_item(self, index: MetadataIndex) -> Optional[StoredTensor]:
        """Where one saved chunk's bytes are (cached). Each saved key's first chunk is meta-loaded with
        torch (pickle only) to check it is a plain C-contiguous tensor whose storage is exactly its bytes;
        every chunk's record offset then comes from its zip directory (archive_data_record)."""
        found = self._item_cache.get(index, _UNSET)
        if found is not _UNSET:
            return found
        info = self._metadata.storage_data.get(index)
        md = self._keys[index.fqn]
        sizes = self._saved_chunks(index.fqn).get(tuple(index.offset))
        stored = None
        if info is not None and sizes is not None and not getattr(info, "transform_descriptors", None):
            path = str(self.path / info.relative_path)
            nbytes = math.prod(sizes) * md.properties.dtype.itemsize
            try:
                if self._plain_keys.get(index.fqn) is None:
                    meta = meta_load(path, info.offset, info.length, allow_megatron=False)
                    self._plain_keys[index.fqn] = bool(
                        torch.is_tensor(meta) and meta.is_contiguous() and meta.storage_offset() == 0
                        and meta.untyped_storage().nbytes() == nbytes and meta.dtype == md.properties.dtype
                        and tuple(meta.shape) == sizes)
                record = archive_data_record(path, info.offset, info.length) if self._plain_keys[index.fqn] else None
            except Exception as e:
                raise CheckpointFormatError(f"{path}: item {index.fqn} at byte {info.offset} cannot be read "
                                            f"({type(e).__name__}: {e}); the file is corrupt, re-copy it.") from e
            if record is not None and record[1] == nbytes:
                regions = (FileRegion(path, record[0], nbytes),) if nbytes else ()
                stored = StoredTensor(sizes, md.properties.dtype, regions)
        self._item_cache[index] = stored
        return stored

    def _locate_chunk(self, fqn: str, chunk: ChunkStorageMetadata) -> Optional[StoredTensor]:
        md = self._keys[fqn]
        itemsize = md.properties.dtype.itemsize
        # Most requests are exactly one saved chunk (a TP shard of one layer, a parameter's slice of a
        # flat bucket): a dict lookup, not DCP's scan over every saved chunk of the key (which is
        # quadratic for stacked layers: layers x TP chunks, each requested once).
        if self._saved_chunks(fqn).get(tuple(chunk.offsets)) == tuple(chunk.sizes):
            return self._saved_item(MetadataIndex(fqn, torch.Size(chunk.offsets)))
        placed = []
        for item in create_read_items_for_chunk_list(fqn, md, [chunk]):
            saved = self._saved_item(item.storage_index)
            if saved is None:
                return None
            src = box_bytes(saved.shape, item.storage_offsets, item.lengths, itemsize)
            dst = box_bytes(tuple(chunk.sizes), item.dest_offsets, item.lengths, itemsize)
            if src is None or dst is None:
                return None
            placed.append((dst[0], saved.byte_slice(src[0], src[0] + src[1]), src[1]))
        placed.sort(key=lambda p: p[0])
        pos = 0
        for dst_start, _, nbytes in placed:
            if dst_start != pos:
                return None
            pos += nbytes
        if pos != math.prod(chunk.sizes) * itemsize:
            return None
        parts = [StoredTensor((nbytes // itemsize,), md.properties.dtype, tuple(regions))
                 for _, regions, nbytes in placed]
        return concat_stored(parts, tuple(chunk.sizes)) if parts else None

    @staticmethod
    def _assemble(parts: list[torch.Tensor], piece: _Piece, shape: Optional[tuple] = None) -> torch.Tensor:
        tensor = torch.cat(parts, dim=piece.axis) if len(parts) > 1 else parts[0]
        if shape is not None:
            return tensor.view(shape)
        return tensor.reshape(tensor.shape[piece.lead:]) if piece.lead else tensor

    def _flat_request(self, info: _RankInfo, ref: ShardRef) -> dict:
        mp = ref.tp_rank + self.layout.tp * ref.pp_rank
        for i, buf in enumerate(info.buffers[ref.vpp_chunk]):
            try:
                span = buf.span(ref.local_name)
            except KeyError:
                continue
            gbuf = info.gbuf_base[ref.vpp_chunk] + i
            keys = self._buckets[(mp, gbuf, (str(buf.param_dtype), str(buf.grad_dtype)), span.bucket)]
            start = buf.offset_in_bucket(span)
            return {what: (keys[what], start, math.prod(span.shape)) for what in ("param", "exp_avg", "exp_avg_sq")}
        raise KeyError(f"{ref.local_name} is in no DDP buffer of rank tp={ref.tp_rank} pp={ref.pp_rank}")

    def common_state(self) -> dict:
        if self._flat_buckets:
            groups = self._optimizer_groups(0, 0).param_groups
        else:
            groups = self._model_space_groups
        return build_common_state(iteration=self.iteration, args=self.args,
                                  checkpoint_version=self._common.get("checkpoint_version"),
                                  opt_param_scheduler=self._common.get("opt_param_scheduler"),
                                  param_groups=groups,
                                  num_flops=self._common.get("num_floating_point_operations_so_far"))
