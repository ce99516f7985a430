"""Reader for Megatron-LM's legacy `torch` checkpoint format.

Layout: iter_XXXXXXX/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt, written by DP rank 0 of each
(tp, pp) rank, holding `args`, `iteration`, `model` (`model0`, `model1`, ... with VPP), `optimizer`,
`opt_param_scheduler`, `rng_state`, `checkpoint_version`. With the distributed optimizer the same
folder holds distrib_optim.pt: {'buckets_coalesced': True, gbuf_idx: {(param dtype, grad dtype):
{'param', 'exp_avg', 'exp_avg_sq': flat fp32 [numel_unpadded], 'numel_unpadded'}}}, i.e. each DDP
buffer gathered over DP with only the bucket-end padding removed (see bucket_layout.py), and the
Adam step in `optimizer['optimizer']['param_groups'][*]['step']`.
Without it `optimizer` is the torch optimizer state dict (FP32Optimizer), or
{'optimizer': ..., 'fp32_from_fp16_params': ...} (Float16OptimizerWithFloat16Params); state
indices run group by group over Megatron's param groups (adapters.gpt.megatron_param_groups).

Opening scans every rank's files once (torch.load with mmap=True: pickles only, tensor bytes stay
on disk) to validate iterations, shapes and buffer sizes; reads keep at most two ranks' files
mapped and return copies. Do not rewrite those files in place while a reader is open.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping, Optional

import torch

from megatron_ucp.adapters.gpt import is_ignorable, megatron_param_groups
from megatron_ucp.formats.archive import meta_load, stored_tensor
from megatron_ucp.formats.base import READ_KEYS, CheckpointReader, ShardRef
from megatron_ucp.formats.bucket_layout import (
    BufferLayout, BufferParam, DDPBucketConfig, build_chunk_buffers, shared_embedding_names)
from megatron_ucp.formats.common import (
    CheckpointFormatError, args_to_dict, build_common_state, layout_from_args, load_pickled)
from megatron_ucp.model_config import GPTModelConfig

MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
_CACHED_RANKS = 2  # (tp, pp) ranks whose files stay open (mmap'd) at once


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron-LM's get_checkpoint_name: no pipeline suffix without PP."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def model_chunk_keys(state: Mapping[str, Any]) -> list[str]:
    """'model' or, with VPP, 'model0', 'model1', ... in chunk order."""
    if "model" in state:
        return ["model"]
    keys, i = [], 0
    while f"model{i}" in state:
        keys.append(f"model{i}")
        i += 1
    return keys


def chunk_parameters(model_state: Mapping[str, Any], *, dtype_hint: Optional[torch.dtype] = None) -> list[BufferParam]:
    """Parameters of one model chunk in registration order: the state dict's tensors minus
    `_extra_state` entries (state_dict and named_parameters visit modules in the same order)."""
    params = []
    for name, value in model_state.items():
        if is_ignorable(name) or not torch.is_tensor(value):
            continue
        params.append(BufferParam(name, tuple(value.shape), value.dtype))
    return params


# ---------------------------------------------------------------------------------------------

@dataclass
class _RankMeta:
    """What open() learned about one (tp, pp) rank; no tensors."""

    tp_rank: int
    pp_rank: int
    model_keys: list[str]
    chunks: list[list[BufferParam]]
    buffers: list[list[BufferLayout]] = field(default_factory=list)  # per chunk (distributed optimizer)
    gbuf_base: list[int] = field(default_factory=list)  # first gbuf index of each chunk
    state_index: dict = field(default_factory=dict)  # (chunk, name) -> (group, state idx, fp16 position)
    step: Optional[float] = None


class LegacyCheckpoint(CheckpointReader):
    """A legacy `torch` format checkpoint; see the module docstring."""

    format = "torch"
    # read()/locate() may be called from several threads: file loads are serialised by a lock, tensors
    # returned by read() are copies
    thread_safe_reads = True

    def __init__(self, iter_dir: Path, iteration: int):
        self.path = Path(iter_dir)
        self.iteration = iteration
        first = self._expected_dir(0, 0, pp=None) / MODEL_FILENAME
        state = load_pickled(first, what="the first rank's model/optimizer file",
                             fix="Every legacy checkpoint has one per (tp, pp) rank; re-copy the iteration folder.")
        if "args" not in state:
            raise CheckpointFormatError(f"{first}: has no 'args'; it was not written by Megatron-LM's save_checkpoint.")
        self.args = args_to_dict(state["args"], source=first)
        self.layout = layout_from_args(self.args)
        self.config = GPTModelConfig.from_megatron_args(self.args)
        self._checkpoint_version = state.get("checkpoint_version")
        self._scheduler = state.get("opt_param_scheduler")
        self._num_flops = state.get("num_floating_point_operations_so_far")
        opt = state.get("optimizer")
        if opt is None:
            self.optimizer_kind = "none"
        elif self.args.get("use_distributed_optimizer"):
            self.optimizer_kind = "distributed"
        elif isinstance(opt, dict) and "fp32_from_fp16_params" in opt:
            self.optimizer_kind = "mixed_precision"
        elif isinstance(opt, dict) and "state" in opt and "param_groups" in opt:
            self.optimizer_kind = "adam"
        else:
            raise CheckpointFormatError(
                f"{first}: 'optimizer' has keys {sorted(map(str, opt)) if isinstance(opt, dict) else type(opt).__name__}; "
                f"only the distributed optimizer, FP32Optimizer and Float16Optimizer (one optimizer, no chained "
                f"MoE optimizers) are supported.")
        if self.optimizer_kind in ("adam", "mixed_precision", "distributed") and self.args.get("optimizer", "adam") != "adam":
            raise CheckpointFormatError(f"{first}: args.optimizer={self.args.get('optimizer')!r}; only Adam state is supported.")
        del state
        self._ranks: dict[tuple[int, int], _RankMeta] = {}
        self._param_groups: Optional[list] = None
        self._cache: "OrderedDict[tuple[int, int], tuple[dict, Optional[dict]]]" = OrderedDict()
        self._meta_cache: dict[tuple[int, int], tuple[dict, Optional[dict]]] = {}
        self._lock = threading.RLock()  # reads may come from several conversion threads
        self._scan()

    # -- files ------------------------------------------------------------------------------

    def _expected_dir(self, tp_rank: int, pp_rank: int, pp: Optional[int]) -> Path:
        if pp is None:  # before args are known: whichever naming the folder uses
            for name in (f"mp_rank_{tp_rank:02d}_{pp_rank:03d}", f"mp_rank_{tp_rank:02d}"):
                if (self.path / name).is_dir():
                    return self.path / name
            raise CheckpointFormatError(
                f"{self.path / f'mp_rank_{tp_rank:02d}_{pp_rank:03d}'}: missing rank folder (nor "
                f"mp_rank_{tp_rank:02d}); the checkpoint is incomplete, re-copy {self.path}.")
        return self.path / rank_dir_name(tp_rank, pp_rank, pp)

    def _rank_file(self, tp_rank: int, pp_rank: int, filename: str) -> Path:
        return self._expected_dir(tp_rank, pp_rank, self.layout.pp) / filename

    def _load_rank(self, tp_rank: int, pp_rank: int) -> tuple[dict, Optional[dict]]:
        with self._lock:
            return self._load_rank_locked(tp_rank, pp_rank)

    def _load_rank_locked(self, tp_rank: int, pp_rank: int) -> tuple[dict, Optional[dict]]:
        key = (tp_rank, pp_rank)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        model_file = self._rank_file(tp_rank, pp_rank, MODEL_FILENAME)
        state = load_pickled(model_file, what=f"model/optimizer state of rank tp={tp_rank} pp={pp_rank}")
        distopt = None
        if self.optimizer_kind == "distributed":
            distopt = load_pickled(self._rank_file(tp_rank, pp_rank, DISTRIB_OPTIM_FILENAME),
                                   what=f"distributed optimizer state of rank tp={tp_rank} pp={pp_rank}",
                                   fix="Megatron-LM writes it next to model_optim_rng.pt with "
                                       "--use-distributed-optimizer; re-copy the rank folder.")
        self._cache[key] = (state, distopt)
        while len(self._cache) > _CACHED_RANKS:
            self._cache.popitem(last=False)
        return state, distopt

    # -- open-time validation -----------------------------------------------------------------

    def _scan(self) -> None:
        tp, pp = self.layout.tp, self.layout.pp
        expected = {rank_dir_name(t, p, pp) for t in range(tp) for p in range(pp)}
        for t in range(tp):
            for p in range(pp):
                d = self._rank_file(t, p, "")
                if not d.is_dir():
                    raise CheckpointFormatError(
                        f"{d}: missing rank folder for tp={t} pp={p} (args say TP={tp} PP={pp}); "
                        f"the checkpoint is incomplete, re-copy {self.path}.")
        extra = sorted(p.name for p in self.path.glob("mp_rank_*") if p.name not in expected)
        if extra:
            raise CheckpointFormatError(
                f"{self.path}: unexpected rank folders {extra} for TP={tp} PP={pp} (expert-parallel "
                f"checkpoints are not supported, or folders of another run were copied in).")
        for t in range(tp):
            for p in range(pp):
                state, distopt = self._load_rank(t, p)
                file = self._rank_file(t, p, MODEL_FILENAME)
                if state.get("iteration") != self.iteration:
                    raise CheckpointFormatError(
                        f"{file}: holds iteration {state.get('iteration')} but lives in {self.path.name} "
                        f"(iteration {self.iteration}); rank folders of different iterations were mixed. "
                        f"Re-copy this rank folder from the same save.")
                args = vars(state["args"]) if hasattr(state.get("args"), "__dict__") else {}
                if (args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size")) != (tp, pp):
                    raise CheckpointFormatError(f"{file}: written with a different TP/PP than {self._rank_file(0, 0, MODEL_FILENAME)}.")
                keys = model_chunk_keys(state)
                if not keys or len(keys) != self.layout.num_chunks:
                    raise CheckpointFormatError(
                        f"{file}: has model entries {keys} but args ask for {self.layout.num_chunks} model chunk(s).")
                chunks = [chunk_parameters(state[k]) for k in keys]
                self._ranks[(t, p)] = _RankMeta(t, p, keys, chunks)
                if self._param_groups is None and isinstance(state.get("optimizer"), dict):
                    inner = state["optimizer"].get("optimizer", state["optimizer"])
                    self._param_groups = inner.get("param_groups")
                if self.optimizer_kind == "distributed":
                    self._check_distributed(self._ranks[(t, p)], state, distopt)
        if self.optimizer_kind in ("adam", "mixed_precision"):
            self._map_optimizer_indices()

    def _check_distributed(self, meta: _RankMeta, state: dict, distopt: dict) -> None:
        file = self._rank_file(meta.tp_rank, meta.pp_rank, DISTRIB_OPTIM_FILENAME)
        if not isinstance(distopt, dict) or not distopt.get("buckets_coalesced"):
            raise CheckpointFormatError(
                f"{file}: distributed optimizer state without 'buckets_coalesced' (written by an older "
                f"Megatron-LM with per-bucket lists, or not a distrib_optim.pt); resave it with "
                f"megatron-core >= 0.7 (load it there and save again) before converting.")
        num_params = sum(p.numel for chunk in meta.chunks for p in chunk)
        gbuf = 0
        for chunk, params in enumerate(meta.chunks):
            config = DDPBucketConfig.from_megatron_args(self.args, pp_rank=meta.pp_rank, vpp_chunk=chunk,
                                                        rank_num_parameters=num_params)
            shared = shared_embedding_names(self.args, pp_rank=meta.pp_rank, vpp_chunk=chunk,
                                            names=[p.name for p in params])
            params = [BufferParam(p.name, p.shape, p.dtype, shared_embedding=p.name in shared) for p in params]
            buffers = build_chunk_buffers(params, config)
            meta.gbuf_base.append(gbuf)
            meta.buffers.append(buffers)
            for buf in buffers:
                entry = distopt.get(gbuf, {}).get((buf.param_dtype, buf.grad_dtype))
                if entry is None:
                    raise CheckpointFormatError(
                        f"{file}: no buffer {gbuf} with dtypes {(buf.param_dtype, buf.grad_dtype)} "
                        f"(found {[(k, list(v)) for k, v in distopt.items() if k != 'buckets_coalesced']}); "
                        f"the DDP settings in args do not match the saved buffers.")
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    t = entry.get(key)
                    if not torch.is_tensor(t) or t.numel() != buf.numel_unpadded or entry.get("numel_unpadded") != buf.numel_unpadded:
                        raise CheckpointFormatError(
                            f"{file}: buffer {gbuf} '{key}' has {t.numel() if torch.is_tensor(t) else t} elements "
                            f"(numel_unpadded={entry.get('numel_unpadded')}) but the model's parameters with "
                            f"64-element alignment need {buf.numel_unpadded}; the file does not belong to this "
                            f"model or uses an unsupported buffer layout.")
                gbuf += 1
        if gbuf != len([k for k in distopt if k != "buckets_coalesced"]):
            raise CheckpointFormatError(f"{file}: holds {len(distopt) - 1} buffers, the model needs {gbuf} "
                                        f"(expert-parallel buffers are not supported).")
        groups = state["optimizer"].get("optimizer", {}).get("param_groups", [])
        steps = {g.get("step") for g in groups if g.get("step") is not None}
        if len(steps) > 1:
            raise CheckpointFormatError(f"{self._rank_file(meta.tp_rank, meta.pp_rank, MODEL_FILENAME)}: param groups "
                                        f"disagree on the Adam step: {sorted(steps)}.")
        meta.step = steps.pop() if steps else None

    def _map_optimizer_indices(self) -> None:
        groups_by_rank = megatron_param_groups({k: m.chunks for k, m in self._ranks.items()}, self.args)
        for key, meta in self._ranks.items():
            state, _ = self._load_rank(*key)
            file = self._rank_file(*key, MODEL_FILENAME)
            opt = state["optimizer"]
            inner = opt["optimizer"] if self.optimizer_kind == "mixed_precision" else opt
            saved = inner["param_groups"]
            mine = groups_by_rank[key]
            if [len(g["params"]) for g in saved] != [len(g) for g in mine]:
                raise CheckpointFormatError(
                    f"{file}: optimizer param groups hold {[len(g['params']) for g in saved]} parameters but "
                    f"Megatron's grouping of this rank's model gives {[len(g) for g in mine]}; custom "
                    f"param-group overrides are not supported.")
            specs = {(c, p.name): p for c, chunk in enumerate(meta.chunks) for p in chunk}
            for g, (saved_group, my_group) in enumerate(zip(saved, mine)):
                halves = 0  # fp32_from_fp16_params[g] lists only the group's 16-bit params, in order
                for idx, ref in zip(saved_group["params"], my_group):
                    st = inner["state"].get(idx)
                    if st is not None and tuple(st["exp_avg"].shape) != specs[ref].shape:
                        raise CheckpointFormatError(
                            f"{file}: optimizer state {idx} has shape {tuple(st['exp_avg'].shape)} but maps to "
                            f"{ref[1]} of shape {specs[ref].shape}; the param-group order does not match.")
                    half = None
                    if self.optimizer_kind == "mixed_precision" and specs[ref].dtype in (torch.float16, torch.bfloat16):
                        half, halves = halves, halves + 1
                    meta.state_index[ref] = (g, idx, half)

    # -- API ----------------------------------------------------------------------------------

    def shards(self) -> list[ShardRef]:
        refs = []
        for (t, p), meta in sorted(self._ranks.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            for chunk, params in enumerate(meta.chunks):
                refs += [ShardRef(t, p, chunk, q.name, q.shape, q.dtype) for q in params]
        return refs

    def read(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> dict[str, torch.Tensor]:
        """See CheckpointReader.read; the rank's files are mmapped, so tensors not asked for cost nothing."""
        out = self._read_all(ref)
        if keys is None:
            return out
        want = set(keys)
        if not want <= set(READ_KEYS):
            raise ValueError(f"keys={sorted(keys)}: choose from {READ_KEYS}")
        return {k: v for k, v in out.items() if k in want or k == "step"}

    def _read_all(self, ref: ShardRef) -> dict[str, torch.Tensor]:
        meta = self._ranks.get((ref.tp_rank, ref.pp_rank))
        if meta is None or ref.vpp_chunk >= len(meta.chunks):
            raise KeyError(f"{ref}: no such rank/chunk in {self.path}")
        state, distopt = self._load_rank(ref.tp_rank, ref.pp_rank)
        model = state[meta.model_keys[ref.vpp_chunk]]
        if ref.local_name not in model:
            raise KeyError(f"{ref.local_name} not in {self._rank_file(ref.tp_rank, ref.pp_rank, MODEL_FILENAME)}")
        param = model[ref.local_name]
        out = {"param": param.clone()}
        if self.optimizer_kind == "distributed":
            out.update(self._read_distributed(meta, distopt, ref))
        elif self.optimizer_kind in ("adam", "mixed_precision"):
            out.update(self._read_adam(meta, state["optimizer"], ref, param))
        return out

    def _distributed_views(self, meta: _RankMeta, distopt: dict, ref: ShardRef) -> dict:
        for i, buf in enumerate(meta.buffers[ref.vpp_chunk]):
            try:
                span = buf.span(ref.local_name)
            except KeyError:
                continue
            entry = distopt[meta.gbuf_base[ref.vpp_chunk] + i][(buf.param_dtype, buf.grad_dtype)]
            start = buf.coalesced_offset(span)
            numel = span.end - span.start
            out = {("fp32" if key == "param" else key): entry[key][start:start + numel].view(span.shape)
                   for key in ("param", "exp_avg", "exp_avg_sq")}
            if meta.step is not None:
                out["step"] = torch.tensor(float(meta.step), dtype=torch.float32)
            return out
        raise KeyError(f"{ref.local_name} is in no DDP buffer of rank tp={ref.tp_rank} pp={ref.pp_rank}")

    def _read_distributed(self, meta: _RankMeta, distopt: dict, ref: ShardRef) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._distributed_views(meta, distopt, ref).items()}

    def _adam_views(self, meta: _RankMeta, opt: dict, ref: ShardRef, param: Optional[torch.Tensor]) -> dict:
        group, idx, half = meta.state_index[(ref.vpp_chunk, ref.local_name)]
        inner = opt["optimizer"] if self.optimizer_kind == "mixed_precision" else opt
        # FP32Optimizer and fp32 params of Float16Optimizer step the model weight itself
        out = {"fp32": opt["fp32_from_fp16_params"][group][half] if half is not None else param}
        st = inner["state"].get(idx)
        if st is not None:  # no state before the first optimizer step
            out["exp_avg"] = st["exp_avg"]
            out["exp_avg_sq"] = st["exp_avg_sq"]
            out["step"] = st["step"]
        return out

    def _read_adam(self, meta: _RankMeta, opt: dict, ref: ShardRef, param: torch.Tensor) -> dict[str, torch.Tensor]:
        views = self._adam_views(meta, opt, ref, param)
        out = {k: v.clone() for k, v in views.items() if k != "step"}
        if "step" in views:
            out["step"] = torch.as_tensor(views["step"], dtype=torch.float32).clone().reshape(())
        return out

    # -- byte locations (conversion without materialising tensors) ------------------------------

    def _meta_rank(self, tp_rank: int, pp_rank: int) -> tuple[dict, Optional[dict]]:
        """The rank's files loaded with every tensor on the meta device (pickles only), cached."""
        key = (tp_rank, pp_rank)
        with self._lock:
            found = self._meta_cache.get(key)
        if found is not None:
            return found
        model_file = self._rank_file(tp_rank, pp_rank, MODEL_FILENAME)
        files = [model_file] + ([self._rank_file(tp_rank, pp_rank, DISTRIB_OPTIM_FILENAME)]
                                if self.optimizer_kind == "distributed" else [])
        loaded = []
        for f in files:
            try:
                loaded.append(meta_load(str(f)))
            except Exception as e:  # noqa: BLE001 - the mmap load at open worked; report, do not guess
                raise CheckpointFormatError(f"{f}: cannot read its pickle ({type(e).__name__}: {e}); re-copy it") from e
        found = (loaded[0], loaded[1] if len(loaded) > 1 else None)
        with self._lock:
            self._meta_cache[key] = found
        return found

    def locate(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> Optional[dict]:
        """Like read(), but each tensor is a StoredTensor (where its bytes are in the rank's files);
        None when one is not a contiguous run of bytes (read() it then). Locations of all tensors cost
        nothing to compute, so `keys` only filters."""
        meta = self._ranks.get((ref.tp_rank, ref.pp_rank))
        if meta is None or ref.vpp_chunk >= len(meta.chunks):
            raise KeyError(f"{ref}: no such rank/chunk in {self.path}")
        state, distopt = self._meta_rank(ref.tp_rank, ref.pp_rank)
        model_file = str(self._rank_file(ref.tp_rank, ref.pp_rank, MODEL_FILENAME))
        param = state[meta.model_keys[ref.vpp_chunk]][ref.local_name]
        out = {"param": stored_tensor(model_file, 0, param)}
        if self.optimizer_kind == "distributed":
            optim_file = str(self._rank_file(ref.tp_rank, ref.pp_rank, DISTRIB_OPTIM_FILENAME))
            views = self._distributed_views(meta, distopt, ref)
            out.update({k: v if k == "step" else stored_tensor(optim_file, 0, v) for k, v in views.items()})
        elif self.optimizer_kind in ("adam", "mixed_precision"):
            views = self._adam_views(meta, state["optimizer"], ref, param)
            if "step" in views:  # the value itself, from the mapped (not meta) state
                real, _ = self._load_rank(ref.tp_rank, ref.pp_rank)
                real_views = self._adam_views(meta, real["optimizer"], ref, None)
                views["step"] = torch.as_tensor(real_views["step"], dtype=torch.float32).clone().reshape(())
            out.update({k: v if k == "step" else stored_tensor(model_file, 0, v) for k, v in views.items()})
        if keys is not None:
            out = {k: v for k, v in out.items() if k in set(keys) or k == "step"}
        if any(v is None for v in out.values()):
            return None
        return out

    def common_state(self) -> dict:
        return build_common_state(iteration=self.iteration, args=self.args,
                                  checkpoint_version=self._checkpoint_version,
                                  opt_param_scheduler=self._scheduler, param_groups=self._param_groups,
                                  num_flops=self._num_flops)
