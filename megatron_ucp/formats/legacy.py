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

Opening parses every rank's files once through the allow-list (formats/safe_pickle.py: the pickles only,
without torch; nothing in them runs) and checks iterations, structure, dtypes, shapes and buffer sizes;
the parsed trees (where each tensor's bytes are) are kept, so read() reads exactly the bytes of the
tensors asked for and locate() reads nothing. Every file opened resolves inside the iteration folder.
Do not rewrite those files while a reader is open.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping, Optional

from megatron_ucp.adapters.gpt import UnknownParameterError, canonical_name, is_ignorable, megatron_param_groups
from megatron_ucp.formats.archive import read_tensor, stored_tensor, sub_record
from megatron_ucp.formats.base import READ_KEYS, CheckpointReader, ShardRef, unknown_shard
from megatron_ucp.formats.bucket_layout import (
    BufferLayout, BufferParam, DDPBucketConfig, build_chunk_buffers, shared_embedding_names)
from megatron_ucp.formats.common import (
    PARAM_DTYPES, STATE_DTYPE, CheckpointFormatError, args_to_dict, build_common_state, check_dtype, entry,
    inside, layout_from_args, load_archive_file, model_config_from_args, scalar, structure_error)
from megatron_ucp.formats.safe_pickle import TensorRecord, TorchDType
from megatron_ucp.layout import LayoutError

MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
_TENSOR_KEYS = ("param", "fp32", "exp_avg", "exp_avg_sq")


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


def chunk_parameters(model_state: Mapping[str, Any], *, path: Any = "model") -> list[BufferParam]:
    """Parameters of one model chunk in registration order: the state dict's tensors minus
    `_extra_state` entries (state_dict and named_parameters visit modules in the same order), each checked
    to be a floating-point tensor Megatron trains (dtypes as torch-free TorchDTypes)."""
    params = []
    for name, value in model_state.items():
        if not isinstance(name, str):
            raise structure_error(path, f"a model entry named {name!r}", value)
        if is_ignorable(name) or not isinstance(value, TensorRecord):
            continue
        check_dtype(value, PARAM_DTYPES, path=path, what=f"parameter {name}")
        params.append(BufferParam(name, tuple(value.shape), TorchDType(value.dtype)))
    return params


# ---------------------------------------------------------------------------------------------

@dataclass
class _RankMeta:
    """What open() learned about one (tp, pp) rank: its parsed files (tensor records, no tensor data)."""

    tp_rank: int
    pp_rank: int
    model_file: Path
    state: dict  # model_optim_rng.pt
    model_keys: list[str]
    chunks: list[list[BufferParam]]
    optim_file: Optional[Path] = None
    distopt: Optional[dict] = None  # distrib_optim.pt
    buffers: list[list[BufferLayout]] = field(default_factory=list)  # per chunk (distributed optimizer)
    gbuf_base: list[int] = field(default_factory=list)  # first gbuf index of each chunk
    state_index: dict = field(default_factory=dict)  # (chunk, name) -> (group, state idx, fp16 position)
    step: Optional[float] = None


class LegacyCheckpoint(CheckpointReader):
    """A legacy `torch` format checkpoint; see the module docstring."""

    format = "torch"
    # everything is parsed at open and only read afterwards; read() returns new tensors
    thread_safe_reads = True

    def __init__(self, iter_dir: Path, iteration: int):
        self.path = Path(iter_dir)
        self.iteration = iteration
        self._parsed: dict[Path, dict] = {}
        first = self._expected_dir(0, 0, pp=None) / MODEL_FILENAME
        state = self._parse(first, what="the first rank's model/optimizer file",
                            fix="Every legacy checkpoint has one per (tp, pp) rank; re-copy the iteration folder.")
        if "args" not in state:
            raise CheckpointFormatError(f"{first}: has no 'args'; it was not written by Megatron-LM's save_checkpoint.")
        self.args = args_to_dict(state["args"], source=first)
        self.layout = layout_from_args(self.args, first)
        self.config = model_config_from_args(self.args, first)
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
        self._ranks: dict[tuple[int, int], _RankMeta] = {}
        self._param_groups: Optional[list] = None
        self._scan()
        self._parsed.clear()

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

    def _parse(self, path: Path, *, what: str, fix: str = "") -> dict:
        """A rank file parsed through the allow-list (once per open), checked to be inside the folder."""
        found = self._parsed.get(path)
        if found is None:
            found = load_archive_file(inside(self.path, path), what=what, fix=fix)
            if not isinstance(found, dict):
                raise structure_error(path, f"{what} (a dict)", found)
            self._parsed[path] = found
        return found

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
                self._ranks[(t, p)] = self._scan_rank(t, p)
        if self.optimizer_kind in ("adam", "mixed_precision"):
            self._map_optimizer_indices()

    def _scan_rank(self, t: int, p: int) -> _RankMeta:
        tp, pp = self.layout.tp, self.layout.pp
        file = self._rank_file(t, p, MODEL_FILENAME)
        state = self._parse(file, what=f"model/optimizer state of rank tp={t} pp={p}",
                            fix="Megatron-LM writes one per (tp, pp) rank; re-copy the rank folder.")
        if state.get("iteration") != self.iteration:
            raise CheckpointFormatError(
                f"{file}: holds iteration {state.get('iteration')} but lives in {self.path.name} "
                f"(iteration {self.iteration}); rank folders of different iterations were mixed. "
                f"Re-copy this rank folder from the same save.")
        args = vars(state["args"]) if isinstance(state.get("args"), argparse.Namespace) else {}
        if (args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size")) != (tp, pp):
            raise CheckpointFormatError(
                f"{file}: written with TP={args.get('tensor_model_parallel_size')} PP="
                f"{args.get('pipeline_model_parallel_size')}, but {self._rank_file(0, 0, MODEL_FILENAME)} says "
                f"TP={tp} PP={pp}; rank folders of different runs were mixed. Re-copy the iteration folder.")
        keys = model_chunk_keys(state)
        if not keys or len(keys) != self.layout.num_chunks:
            raise CheckpointFormatError(
                f"{file}: has model entries {keys} but args ask for {self.layout.num_chunks} model chunk(s); the file "
                f"is incomplete or belongs to another run. Re-copy the rank folder.")
        chunks = []
        for chunk, k in enumerate(keys):
            params = chunk_parameters(entry(state, k, dict, path=file, what=f"'{k}'"), path=file)
            if not params:
                raise CheckpointFormatError(f"{file}: '{k}' holds no parameter tensors; the file is corrupt or not a "
                                            f"model checkpoint. Re-copy the rank folder.")
            self._check_names(file, params, p, chunk)
            chunks.append(params)
        meta = _RankMeta(t, p, file, state, keys, chunks)
        if self._param_groups is None and self.optimizer_kind != "none":
            opt = entry(state, "optimizer", dict, path=file, what="'optimizer'")
            inner = opt.get("optimizer", opt)
            groups = entry(inner, "param_groups", list, path=file, what="the optimizer's 'param_groups'")
            if not all(isinstance(g, dict) for g in groups):
                raise structure_error(file, "the optimizer's 'param_groups' (a list of dicts)", groups)
            self._param_groups = groups
        if self.optimizer_kind == "distributed":
            meta.optim_file = self._rank_file(t, p, DISTRIB_OPTIM_FILENAME)
            meta.distopt = self._parse(meta.optim_file, what=f"distributed optimizer state of rank tp={t} pp={p}",
                                       fix="Megatron-LM writes it next to model_optim_rng.pt with "
                                           "--use-distributed-optimizer; re-copy the rank folder.")
            self._check_distributed(meta)
        return meta

    def _check_names(self, file: Path, params: list[BufferParam], pp_rank: int, chunk: int) -> None:
        """Every parameter is one the rulebook knows, on the pipeline stage that holds it."""
        for param in params:
            try:
                canonical_name(param.name, self.layout, pp_rank, chunk if self.layout.vpp else None,
                               self.config.num_layers, tied=self.config.tied, config=self.config)
            except UnknownParameterError as e:
                raise CheckpointFormatError(f"{file}: {e}") from e
            except LayoutError as e:
                raise CheckpointFormatError(f"{file}: {e} (were rank folders renamed, or copied from another run? "
                                            f"re-copy the iteration folder)") from e

    def _check_distributed(self, meta: _RankMeta) -> None:
        file, distopt = meta.optim_file, meta.distopt
        if not distopt.get("buckets_coalesced"):
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
                dtypes = (buf.param_dtype, buf.grad_dtype)
                saved = distopt.get(gbuf)
                found = saved.get(dtypes) if isinstance(saved, dict) else None
                if not isinstance(found, dict):
                    held = [(k, [tuple(map(str, d)) if isinstance(d, tuple) else str(d) for d in v])
                            for k, v in distopt.items() if k != "buckets_coalesced" and isinstance(v, dict)]
                    raise CheckpointFormatError(
                        f"{file}: no buffer {gbuf} with dtypes {tuple(map(str, dtypes))} (found {held}); "
                        f"the DDP settings in args do not match the saved buffers.")
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    t = check_dtype(found.get(key), (STATE_DTYPE,), path=file, what=f"buffer {gbuf} '{key}'")
                    if (len(t.shape) != 1 or not t.is_c_contiguous() or t.numel != buf.numel_unpadded
                            or found.get("numel_unpadded") != buf.numel_unpadded):
                        raise CheckpointFormatError(
                            f"{file}: buffer {gbuf} '{key}' has shape {t.shape} (numel_unpadded="
                            f"{found.get('numel_unpadded')}) but the model's parameters with 64-element alignment "
                            f"need {buf.numel_unpadded} elements in one flat tensor; the file does not belong to this "
                            f"model or uses an unsupported buffer layout.")
                gbuf += 1
        held = [k for k in distopt if k != "buckets_coalesced"]
        if gbuf != len(held):
            raise CheckpointFormatError(f"{file}: holds {len(held)} buffers, the model needs {gbuf} "
                                        f"(expert-parallel buffers are not supported).")
        opt = entry(meta.state, "optimizer", dict, path=meta.model_file, what="'optimizer'")
        inner = entry(opt, "optimizer", dict, path=meta.model_file, what="the distributed optimizer's 'optimizer'")
        groups = entry(inner, "param_groups", list, path=meta.model_file, what="the optimizer's 'param_groups'")
        steps = {scalar(g["step"], path=meta.model_file, what="a param group's Adam 'step'")
                 for g in groups if isinstance(g, dict) and g.get("step") is not None}
        if len(steps) > 1:
            raise CheckpointFormatError(f"{meta.model_file}: param groups disagree on the Adam step: {sorted(steps)}; "
                                        f"the file is corrupt, re-copy it.")
        meta.step = steps.pop() if steps else None

    def _map_optimizer_indices(self) -> None:
        groups_by_rank = megatron_param_groups({k: m.chunks for k, m in self._ranks.items()}, self.args)
        for key, meta in self._ranks.items():
            file = meta.model_file
            opt = entry(meta.state, "optimizer", dict, path=file, what="'optimizer'")
            if self.optimizer_kind == "mixed_precision":
                inner = entry(opt, "optimizer", dict, path=file, what="the Float16 optimizer's 'optimizer'")
                masters = entry(opt, "fp32_from_fp16_params", list, path=file, what="'fp32_from_fp16_params'")
            else:
                inner, masters = opt, []
            saved = entry(inner, "param_groups", list, path=file, what="the optimizer's 'param_groups'")
            states = entry(inner, "state", dict, path=file, what="the optimizer's 'state'")
            for g in saved:
                params = g.get("params") if isinstance(g, dict) else None
                if not isinstance(params, list) or not all(isinstance(i, int) for i in params):
                    raise structure_error(file, "a param group's 'params' (a list of state indices)", params)
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
                    spec = specs[ref]
                    st = states.get(idx)
                    if st is not None:  # no state before the first optimizer step
                        what = f"optimizer state {idx} ({ref[1]})"
                        if not isinstance(st, dict) or "step" not in st:
                            raise structure_error(file, f"{what}: exp_avg, exp_avg_sq and step", st)
                        for name in ("exp_avg", "exp_avg_sq"):
                            rec = check_dtype(st.get(name), (STATE_DTYPE,), path=file, what=f"{what} {name}")
                            if tuple(rec.shape) != spec.shape:
                                raise CheckpointFormatError(
                                    f"{file}: {what} has {name} of shape {tuple(rec.shape)} but maps to {ref[1]} of "
                                    f"shape {spec.shape}; the param-group order does not match.")
                        scalar(st["step"], path=file, what=f"{what} step")
                    half = None
                    if self.optimizer_kind == "mixed_precision" and spec.dtype.name in ("float16", "bfloat16"):
                        half, halves = halves, halves + 1
                        group_masters = masters[g] if g < len(masters) else None
                        master = group_masters[half] if isinstance(group_masters, list) and half < len(
                            group_masters) else None
                        check_dtype(master, (STATE_DTYPE,), path=file, what=f"the fp32 main weight of {ref[1]}")
                        if tuple(master.shape) != spec.shape:
                            raise CheckpointFormatError(
                                f"{file}: the fp32 main weight of {ref[1]} has shape {tuple(master.shape)}, expected "
                                f"{spec.shape}; the param-group order does not match.")
                    meta.state_index[ref] = (g, idx, half)

    # -- API ----------------------------------------------------------------------------------

    def shards(self) -> list[ShardRef]:
        refs = []
        for (t, p), meta in sorted(self._ranks.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            for chunk, params in enumerate(meta.chunks):
                refs += [ShardRef(t, p, chunk, q.name, q.shape, q.dtype) for q in params]
        return refs

    def _records(self, ref: ShardRef) -> dict:
        """The shard's saved tensors as records ('param', and 'fp32', 'exp_avg', 'exp_avg_sq' with optimizer
        state) and its Adam 'step' (a number or a record)."""
        meta = self._ranks.get((ref.tp_rank, ref.pp_rank))
        model = (meta.state.get(meta.model_keys[ref.vpp_chunk])
                 if meta is not None and 0 <= ref.vpp_chunk < len(meta.chunks) else None)
        param = model.get(ref.local_name) if model is not None else None
        if not isinstance(param, TensorRecord):
            raise unknown_shard(ref, self.path)
        out: dict = {"param": param}
        if self.optimizer_kind == "distributed":
            out.update(self._distributed_records(meta, ref))
        elif self.optimizer_kind in ("adam", "mixed_precision"):
            out.update(self._adam_records(meta, ref, param))
        return out

    def _distributed_records(self, meta: _RankMeta, ref: ShardRef) -> dict:
        for i, buf in enumerate(meta.buffers[ref.vpp_chunk]):
            try:
                span = buf.span(ref.local_name)
            except KeyError:
                continue
            saved = meta.distopt[meta.gbuf_base[ref.vpp_chunk] + i][(buf.param_dtype, buf.grad_dtype)]
            start = buf.coalesced_offset(span)
            out = {("fp32" if key == "param" else key): sub_record(saved[key], start, span.shape)
                   for key in ("param", "exp_avg", "exp_avg_sq")}
            if meta.step is not None:
                out["step"] = meta.step
            return out
        raise CheckpointFormatError(f"{meta.optim_file}: {ref.local_name} is in no DDP buffer of rank "
                                    f"tp={ref.tp_rank} pp={ref.pp_rank}; the file does not match the model.")

    def _adam_records(self, meta: _RankMeta, ref: ShardRef, param: TensorRecord) -> dict:
        group, idx, half = meta.state_index[(ref.vpp_chunk, ref.local_name)]
        opt = meta.state["optimizer"]
        inner = opt["optimizer"] if self.optimizer_kind == "mixed_precision" else opt
        # FP32Optimizer and fp32 params of Float16Optimizer step the model weight itself
        out = {"fp32": opt["fp32_from_fp16_params"][group][half] if half is not None else param}
        st = inner["state"].get(idx)
        if st is not None:  # no state before the first optimizer step
            out.update(exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"], step=st["step"])
        return out

    def _step(self, meta_step: Any, ref: ShardRef):
        import torch

        where = self._rank_file(ref.tp_rank, ref.pp_rank, MODEL_FILENAME)
        return torch.tensor(scalar(meta_step, path=where, what=f"the Adam step of {ref.local_name}"),
                            dtype=torch.float32)

    @staticmethod
    def _wanted(keys: Optional[Collection[str]]) -> set:
        want = set(READ_KEYS if keys is None else keys)
        if not want <= set(READ_KEYS):
            raise ValueError(f"keys={sorted(keys)}: choose from {READ_KEYS}")
        return want

    def read(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> dict:
        """See CheckpointReader.read; only the bytes of the tensors asked for are read (each checked to be in
        the file before anything is allocated)."""
        want = self._wanted(keys)
        records = self._records(ref)
        out: dict = {}
        by_record: dict = {}  # id(record) -> tensor: the weight is its own fp32 main copy in fp32 training
        for key in _TENSOR_KEYS:
            record = records.get(key)
            if record is None or key not in want:
                continue
            done = by_record.get(id(record))
            out[key] = done.clone() if done is not None else read_tensor(record)
            by_record[id(record)] = out[key]
        if "step" in records:
            out["step"] = self._step(records["step"], ref)
        return out

    # -- byte locations (conversion without materialising tensors) ------------------------------

    def locate(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> Optional[dict]:
        """Like read(), but each tensor is a StoredTensor (where its bytes are in the rank's files);
        None when one is not a contiguous run of bytes (read() it then)."""
        want = self._wanted(keys)
        records = self._records(ref)
        out: dict = {key: stored_tensor(records[key]) for key in _TENSOR_KEYS if key in records and key in want}
        if any(v is None for v in out.values()):
            return None
        if "step" in records:
            out["step"] = self._step(records["step"], ref)
        return out

    def common_state(self) -> dict:
        return build_common_state(iteration=self.iteration, args=self.args,
                                  checkpoint_version=self._checkpoint_version,
                                  opt_param_scheduler=self._scheduler, param_groups=self._param_groups,
                                  num_flops=self._num_flops)

    # -- run state besides tensors ------------------------------------------------------------------

    def loss_scaler(self):
        """model_optim_rng.pt['optimizer']['grad_scaler'] (the same in every rank's file: checked)."""
        from megatron_ucp.run_state import LossScalerState, RunStateError

        found = {}
        for (t, p), meta in sorted(self._ranks.items()):
            opt = meta.state.get("optimizer")
            if not isinstance(opt, dict):
                continue
            try:
                found[(t, p)] = LossScalerState.from_saved(opt.get("grad_scaler"), f"{meta.model_file} grad_scaler")
            except RunStateError as e:
                raise CheckpointFormatError(f"{e}; the file is corrupt, re-copy it") from None
        states = set(found.values())
        if len(states) > 1:
            raise CheckpointFormatError(f"{self.path}: the ranks saved different loss-scaler states "
                                        f"({sorted(map(str, states))}); rank folders of different saves were mixed, "
                                        f"re-copy the iteration folder")
        return states.pop() if states else None

    def rng_states(self) -> list:
        """model_optim_rng.pt['rng_state'] of every (tp, pp) rank: a list of one state, or of one per DP rank
        (--data-parallel-random-init)."""
        from megatron_ucp.run_state import RankRngState, RunStateError

        out = []
        for (t, p), meta in sorted(self._ranks.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            saved = meta.state.get("rng_state")
            if saved is None:
                return []  # --no-save-rng: none at all
            if not isinstance(saved, list) or not saved:
                raise structure_error(meta.model_file, "'rng_state' (a list of rank states)", saved)
            try:
                out += [RankRngState.from_saved(s, pp=p, tp=t, dp=d if len(saved) > 1 else None,
                                                where=f"{meta.model_file} rng_state[{d}]") for d, s in enumerate(saved)]
            except RunStateError as e:
                raise CheckpointFormatError(f"{e}; the file is corrupt, re-copy it") from None
        return out
