"""Reader for Megatron-LM's legacy `torch` checkpoint format.

Layout: iter_XXXXXXX/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt, written by DP rank 0 of each
(tp, pp) rank (with experts: by expert-data-parallel rank 0 of each (tp, pp, ep) rank), holding `args`, `iteration`, `model` (`model0`, `model1`, ... with VPP), `optimizer`,
`opt_param_scheduler`, `rng_state`, `checkpoint_version`. With the distributed optimizer the same
folder holds distrib_optim.pt: {'buckets_coalesced': True, gbuf_idx: {(param dtype, grad dtype):
{'param', 'exp_avg', 'exp_avg_sq': flat fp32 [numel_unpadded], 'numel_unpadded'}}}, i.e. each DDP
buffer gathered over DP with only the bucket-end padding removed (see bucket_layout.py), and the
Adam step in `optimizer['optimizer']['param_groups'][*]['step']`.
Without it `optimizer` is the torch optimizer state dict (FP32Optimizer), or
{'optimizer': ..., 'fp32_from_fp16_params': ...} (Float16OptimizerWithFloat16Params), whose per-parameter
state holds the torch optimizer's own names (core/optimizers.py: Adam's exp_avg, exp_avg_sq, step; SGD's
momentum_buffer); state indices run group by group over Megatron's param groups (adapters.gpt.megatron_param_groups).

Opening parses every rank's files once through the allow-list (serialization/safe_pickle.py: the pickles only,
without torch; nothing in them runs) and checks iterations, structure, dtypes, shapes and buffer sizes;
the parsed trees (where each tensor's bytes are) are kept, so read() reads exactly the bytes of the
tensors asked for and locate() reads nothing. Every file opened resolves inside the iteration folder.
Do not rewrite those files while a reader is open.

Mixture of experts (docs/MOE_CHECKPOINTS.md, Megatron-LM core_v0.16.1's get_checkpoint_name): the folder
name gets `_{ep:03d}` with EP > 1, so at PP1 `mp_rank_00_001` is EP rank 1 (at PP2 EP1 it is PP rank 1: the
args decide). Each EP folder holds the dense parameters (a DP replica) and that EP rank's LOCAL experts
(global index ep*E/EP + j). Dense shards are read from EP folder 0 only: the other folders' dense tensors
are bitwise DP replicas (all-reduced gradients, one update), which Megatron-LM itself only writes because
it names the writer by the expert-DP rank. With experts in their own optimizer the `optimizer` entry is a
list [dense, expert] of the two optimizers' states (torch Adam indices run within each optimizer's groups)
and distrib_optim.pt a list with each optimizer's coalesced buffers or None where the writer is not DP rank 0
of that optimizer's group: [dense, expert] in EP folder 0, [None, expert] in the others (the expert buffers
hold the local experts, over the expert-DP group). With ETP != TP Megatron-LM 0.16.1 names folders by the
dense TP rank but chooses writers by expert-DP rank, so some folders are never written: refused.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Collection, Mapping, Optional

from megatron_ucp.adapters.gpt import (
    UnknownParameterError, canonical_name, experts_in_own_optimizer, is_buffer, is_expert, is_ignorable,
    group_overrides, local_spelling, megatron_param_groups, parameters_for_rank)
from megatron_ucp.core import optimizers, versions
from megatron_ucp.core.dtypes import PARAM_DTYPES
from megatron_ucp.core.layout import LayoutError
from megatron_ucp.formats.base import READ_KEYS, CheckpointReader, ShardRef, unknown_shard
from megatron_ucp.formats.bucket_layout import BufferLayout, BufferParam
from megatron_ucp.formats.coalesced import coalesced_buffers, coalesced_records
from megatron_ucp.formats.common import (
    STATE_DTYPE, CheckpointFormatError, args_to_dict, build_common_state, check_dtype, entry, inside, layout_from_args,
    load_archive_file, model_config_from_args, optimizer_row, read_tensor, scalar, structure_error)
from megatron_ucp.formats.legacy.names import (
    DISTRIB_OPTIM_FILENAME, FIRST_RANK_DIRS, MODEL_FILENAME, RANK_DIR_PREFIX, rank_dir_name)
from megatron_ucp.serialization.records import stored_tensor
from megatron_ucp.serialization.safe_pickle import TensorRecord, TorchDType

_TENSOR_KEYS = READ_KEYS


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
class _OptimView:
    """One optimizer (0 dense, 1 expert: megatron-core's ChainedOptimizer order) as one rank folder holds it."""

    state: Optional[dict] = None  # its entry of model_optim_rng.pt's 'optimizer'
    distopt: Optional[dict] = None  # its entry of distrib_optim.pt (distributed optimizer)
    buffers: list[list[BufferLayout]] = field(default_factory=list)  # per chunk (distributed optimizer)
    gbuf_base: list[int] = field(default_factory=list)  # first gbuf index of each chunk
    step: Optional[float] = None


@dataclass
class _RankMeta:
    """What open() learned about one (tp, pp, ep) rank folder: its parsed files (tensor records, no tensor data)."""

    tp_rank: int
    pp_rank: int
    model_file: Path
    state: dict  # model_optim_rng.pt
    model_keys: list[str]
    chunks: list[list[BufferParam]]  # every tensor entry (parameters and persistent buffers), file order
    ep_rank: int = 0
    optim_file: Optional[Path] = None
    optims: dict[int, _OptimView] = field(default_factory=dict)
    state_index: dict = field(default_factory=dict)  # (chunk, name) -> (group, state idx, fp16 position)

    def listed(self, chained: bool) -> list[list[BufferParam]]:
        """The entries this folder contributes to the shard list: everything in EP folder 0, only the routed
        experts in the others (their dense entries are replicas of EP folder 0's)."""
        return [[p for p in chunk if self.ep_rank == 0 or is_expert(p.name)] for chunk in self.chunks]


def _optimizer_index(name: str, chained: bool) -> int:
    """0 for the dense optimizer, 1 for the expert optimizer (routed experts when they have their own)."""
    return 1 if chained and is_expert(name) else 0


class LegacyCheckpoint(CheckpointReader):
    """A legacy `torch` format checkpoint; see the module docstring."""

    format = "torch"
    # everything is parsed at open and only read afterwards; read() returns new tensors
    thread_safe_reads = True

    def __init__(self, iter_dir: Path, iteration: int, *, weights_only: bool = False):
        self.path = Path(iter_dir)
        self.iteration = iteration
        self.weights_only = bool(weights_only)
        self._parsed: dict[Path, dict] = {}
        first = self._first_dir() / MODEL_FILENAME
        state = self._parse(first, what="the first rank's model/optimizer file",
                            fix="Every legacy checkpoint has one per (tp, pp) rank; re-copy the iteration folder.")
        if "args" not in state:
            raise CheckpointFormatError(f"{first}: has no 'args'; it was not written by Megatron-LM's save_checkpoint.")
        self.args = args_to_dict(state["args"], source=first)
        self.release = versions.detect(self.args)
        self.layout = layout_from_args(self.args, first)
        self.config = model_config_from_args(self.args, first)
        if self.config.num_experts and self.layout.expert_tp != self.layout.tp:
            raise CheckpointFormatError(
                f"{first}: a legacy checkpoint at --expert-tensor-parallel-size {self.layout.expert_tp} != "
                f"--tensor-model-parallel-size {self.layout.tp}: Megatron-LM 0.16.1 names its folders by the dense TP "
                f"rank but lets expert-DP rank 0 write them, so some ranks' experts were never written; resave with "
                f"--ckpt-format torch_dist (or ETP = TP) and convert that.")
        self._chained = experts_in_own_optimizer(self.config, self.layout)
        # an emerging optimizer's chain [its own, its scalar optimizer] (core/optimizers.py), () otherwise
        self._kinds: tuple[str, ...] = ()
        self._checkpoint_version = state.get("checkpoint_version")
        self._scheduler = state.get("opt_param_scheduler")
        self._num_flops = state.get("num_floating_point_operations_so_far")
        opt = state.get("optimizer")
        if self.weights_only and opt is not None:
            self.skipped_optimizer, opt = str(self.args.get("optimizer", "adam")), None
        if opt is not None:  # an optimizer whose state is not mapped is refused by name before its structure is read
            optimizer_row(self.args, first, distributed=bool(self.args.get("use_distributed_optimizer")),
                          layer_wise=optimizers.LAYER_WISE_LEGACY_REFUSAL)
            kinds = optimizers.run_optimizers(self.args.get("optimizer", "adam"), self.args)
            self._kinds = kinds if len(kinds) > 1 else ()
        if self._kinds and opt is not None:
            if self._chained:
                raise CheckpointFormatError(
                    f"{first}: --optimizer {self.args.get('optimizer')}: {optimizers.EMERGING_WITH_EXPERTS_REFUSAL}")
            if not (isinstance(opt, list) and len(opt) == len(self._kinds)):
                raise structure_error(first, f"'optimizer' (a list of the {len(self._kinds)} chained optimizers "
                                             f"{', '.join(self._kinds)})", opt)
            opt = opt[0]
        elif self._chained and opt is not None:
            if not (isinstance(opt, list) and len(opt) == 2):
                raise CheckpointFormatError(
                    f"{first}: 'optimizer' is {type(opt).__name__ if not isinstance(opt, list) else f'a list of {len(opt)}'}"
                    f", but at {self.layout.describe()} megatron-core chains a dense and an expert optimizer (a list of "
                    f"2); the file does not match its args, re-copy the iteration folder.")
            opt = opt[0]
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
                f"only the distributed optimizer, FP32Optimizer and Float16Optimizer (chained [dense, expert] with "
                f"experts) are supported.")
        # the optimizer's per-parameter state by name (core/optimizers.py; refused in one line if not mapped)
        self._row = (None if self.optimizer_kind == "none" else
                     optimizer_row(self.args, first, distributed=self.optimizer_kind == "distributed",
                                  layer_wise=optimizers.LAYER_WISE_LEGACY_REFUSAL))
        self._ranks: dict[tuple[int, int, int], _RankMeta] = {}
        self._param_groups: dict[int, list] = {}  # optimizer index -> its param groups (hyper-parameters)
        self._scan()
        self._parsed.clear()

    # -- files ------------------------------------------------------------------------------

    def _first_dir(self) -> Path:
        """Rank (0, 0, 0)'s folder, before the args are known: whichever naming the folder uses."""
        for name in FIRST_RANK_DIRS:
            if (self.path / name).is_dir():
                return self.path / name
        raise CheckpointFormatError(
            f"{self.path / 'mp_rank_00_000'}: missing rank folder (nor mp_rank_00); the checkpoint is incomplete, "
            f"re-copy {self.path}.")

    def _rank_dir(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> Path:
        return self.path / rank_dir_name(tp_rank, pp_rank, self.layout.pp, ep_rank, self.layout.ep)

    def _parse(self, path: Path, *, what: str, fix: str = "") -> Any:
        """A rank file parsed through the allow-list (once per open), checked to be inside the folder."""
        found = self._parsed.get(path)
        if found is None:
            found = load_archive_file(inside(self.path, path), what=what, fix=fix)
            if not isinstance(found, (dict, list)):
                raise structure_error(path, f"{what} (a dict)", found)
            self._parsed[path] = found
        return found

    @staticmethod
    def _where(t: int, p: int, e: int) -> str:
        return f"tp={t} pp={p}" + (f" ep={e}" if e else "")

    # -- open-time validation -----------------------------------------------------------------

    def _scan(self) -> None:
        tp, pp, ep = self.layout.tp, self.layout.pp, self.layout.ep if self.config.num_experts else 1
        folders = [(t, p, e) for p in range(pp) for t in range(tp) for e in range(ep)]
        expected = {self._rank_dir(t, p, e).name for t, p, e in folders}
        for t, p, e in folders:
            d = self._rank_dir(t, p, e)
            if not d.is_dir():
                raise CheckpointFormatError(
                    f"{d}: missing rank folder for {self._where(t, p, e)} (args say TP={tp} PP={pp}"
                    f"{f' EP={ep}' if ep > 1 else ''}); the checkpoint is incomplete, re-copy {self.path}.")
        extra = sorted(p.name for p in self.path.glob(RANK_DIR_PREFIX + "*") if p.name not in expected)
        if extra:
            raise CheckpointFormatError(
                f"{self.path}: unexpected rank folders {extra} for TP={tp} PP={pp} EP={ep} (folders of another run "
                f"were copied in, or the args are not this checkpoint's).")
        for t, p, e in folders:
            self._ranks[(t, p, e)] = self._scan_rank(t, p, e)
        if self.optimizer_kind in ("adam", "mixed_precision"):
            self._map_optimizer_indices()

    def _sub_optimizer(self, value: Any, index: int, file: Path, what: str) -> Any:
        """Optimizer `index`'s entry of a (possibly chained) 'optimizer' / distrib_optim.pt value."""
        if self._kinds:
            if not isinstance(value, list) or len(value) != len(self._kinds):
                raise structure_error(file, f"{what} (a list of the chained optimizers {', '.join(self._kinds)})",
                                      value)
            return value[index]
        if not self._chained:
            return value
        if not isinstance(value, list) or len(value) != 2:
            raise structure_error(file, f"{what} (a list [dense, expert] of the chained optimizers)", value)
        return value[index]

    def _scan_rank(self, t: int, p: int, e: int) -> _RankMeta:
        tp, pp = self.layout.tp, self.layout.pp
        where = self._where(t, p, e)
        file = self._rank_dir(t, p, e) / MODEL_FILENAME
        state = self._parse(file, what=f"model/optimizer state of rank {where}",
                            fix="Megatron-LM writes one per (tp, pp) rank; re-copy the rank folder.")
        if not isinstance(state, dict):
            raise structure_error(file, "the model/optimizer state (a dict)", state)
        if state.get("iteration") != self.iteration:
            raise CheckpointFormatError(
                f"{file}: holds iteration {state.get('iteration')} but lives in {self.path.name} "
                f"(iteration {self.iteration}); rank folders of different iterations were mixed. "
                f"Re-copy this rank folder from the same save.")
        args = vars(state["args"]) if isinstance(state.get("args"), argparse.Namespace) else {}
        ep = self.layout.ep
        if (args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size"),
                args.get("expert_model_parallel_size") or 1) != (tp, pp, ep):
            raise CheckpointFormatError(
                f"{file}: written with TP={args.get('tensor_model_parallel_size')} PP="
                f"{args.get('pipeline_model_parallel_size')} EP={args.get('expert_model_parallel_size') or 1}, but "
                f"{self._rank_dir(0, 0) / MODEL_FILENAME} says TP={tp} PP={pp} EP={ep}; rank folders of different "
                f"runs were mixed. Re-copy the iteration folder.")
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
            self._check_names(file, params, p, chunk, e)
            chunks.append([replace(q, expert=_optimizer_index(q.name, self._chained) == 1) for q in params])
        meta = _RankMeta(t, p, file, state, keys, chunks, ep_rank=e)
        if self.optimizer_kind != "none":
            opt = state.get("optimizer")
            for index in self._optimizer_indices(e):
                view = meta.optims[index] = _OptimView(self._sub_optimizer(opt, index, file, "'optimizer'"))
                if not isinstance(view.state, dict):
                    raise structure_error(file, "'optimizer'", view.state)
                if index not in self._param_groups:
                    inner = view.state.get("optimizer", view.state)
                    groups = entry(inner, "param_groups", list, path=file, what="the optimizer's 'param_groups'")
                    if not all(isinstance(g, dict) for g in groups):
                        raise structure_error(file, "the optimizer's 'param_groups' (a list of dicts)", groups)
                    self._param_groups[index] = groups
        if self.optimizer_kind == "distributed":
            meta.optim_file = self._rank_dir(t, p, e) / DISTRIB_OPTIM_FILENAME
            distopt = self._parse(meta.optim_file, what=f"distributed optimizer state of rank {where}",
                                  fix="Megatron-LM writes it next to model_optim_rng.pt with "
                                      "--use-distributed-optimizer; re-copy the rank folder.")
            if self._chained and isinstance(distopt, list) and len(distopt) == 2 and (distopt[0] is None) == (e == 0):
                raise CheckpointFormatError(  # the dense state is saved in EP folder 0 only
                    f"{meta.optim_file}: {'lacks' if e == 0 else 'holds'} the dense optimizer's state, which "
                    f"Megatron-LM saves only in the folder of EP rank 0{' (this one)' if e == 0 else f', not {e}'}; "
                    f"rank folders were swapped or renamed. Re-copy the iteration folder with the folder names "
                    f"Megatron-LM wrote.")
            for index, view in meta.optims.items():
                view.distopt = self._sub_optimizer(distopt, index, meta.optim_file, "distrib_optim.pt")
                self._check_distributed(meta, index)
        rank = args.get("rank")  # the process that saved it (when args record it): its EP / PP rank is the folder's
        if ep > 1 and type(rank) is int and 0 <= rank < self.layout.world_size:
            _, saved_ep, _, saved_pp = self.layout.expert_coordinates(rank)
            if (saved_ep, saved_pp) != (e, p):
                raise CheckpointFormatError(
                    f"{file}: was saved by rank {rank} (EP rank {saved_ep}, PP rank {saved_pp}) but lies in the "
                    f"folder of EP rank {e}, PP rank {p}; rank folders were swapped or renamed. Re-copy the "
                    f"iteration folder with the folder names Megatron-LM wrote.")
        return meta

    def _optimizer_indices(self, ep_rank: int) -> tuple[int, ...]:
        """The optimizers whose state this EP folder provides: the dense one only in EP folder 0 (DP rank 0 of
        the dense group wrote it), the expert one in every EP folder when chained; an emerging optimizer's
        chain (its own, its scalar optimizer: dense models only) in every folder."""
        if self._kinds:
            return tuple(range(len(self._kinds)))
        if not self._chained:
            return (0,)
        return (0, 1) if ep_rank == 0 else (1,)

    def _check_names(self, file: Path, params: list[BufferParam], pp_rank: int, chunk: int, ep_rank: int) -> None:
        """Every tensor is one the rulebook knows, on the pipeline stage (and EP rank) that holds it, and the
        file holds exactly the rulebook's parameters of that rank (names and shapes)."""
        vpp = chunk if self.layout.vpp else None
        for param in params:
            try:
                canonical_name(param.name, self.layout, pp_rank, vpp, self.config.num_layers,
                               tied=self.config.tied, config=self.config, ep_rank=ep_rank)
            except UnknownParameterError as e:
                raise CheckpointFormatError(f"{file}: {e}") from e
            except LayoutError as e:
                raise CheckpointFormatError(f"{file}: {e} (were rank folders renamed, or copied from another run? "
                                            f"re-copy the iteration folder)") from e
        if not self.config.num_experts:
            return  # dense: the rows' presence is checked by the converter (its messages name the parameter)
        want = {local for local, _, _ in parameters_for_rank(self.config, self.layout, pp_rank, vpp, ep_rank=ep_rank,
                                                             buffers=True)}
        have = {local_spelling(p.name) for p in params}  # older releases spell MTP layers otherwise
        if want != have:
            raise CheckpointFormatError(
                f"{file}: holds {sorted(have - want)[:3]} and lacks {sorted(want - have)[:3]} of the model its args "
                f"describe at pp={pp_rank} ep={ep_rank}; the folder does not belong to this checkpoint, re-copy it.")

    def _check_distributed(self, meta: _RankMeta, index: int) -> None:
        file, view = meta.optim_file, meta.optims[index]
        distopt = view.distopt
        view.gbuf_base, view.buffers = coalesced_buffers(
            distopt, meta.chunks, self.args, self.layout, pp_rank=meta.pp_rank, experts=index == 1, where=file,
            what=f"the {'expert' if index else 'dense'} optimizer's state")
        inner = entry(view.state, "optimizer", dict, path=meta.model_file,
                      what="the distributed optimizer's 'optimizer'")
        groups = entry(inner, "param_groups", list, path=meta.model_file, what="the optimizer's 'param_groups'")
        steps = {scalar(g["step"], path=meta.model_file, what="a param group's Adam 'step'")
                 for g in groups if isinstance(g, dict) and g.get("step") is not None}
        if len(steps) > 1:
            raise CheckpointFormatError(f"{meta.model_file}: param groups disagree on the Adam step: {sorted(steps)}; "
                                        f"the file is corrupt, re-copy it.")
        view.step = steps.pop() if steps else None

    def _view_index(self, ref_name: str, shape) -> int:
        """Which optimizer of the chain holds a parameter: the expert one for a routed expert when chained, the
        row of its kind under an emerging optimizer, else 0."""
        if self._kinds:
            return self._kinds.index(self.parameter_row(ref_name, shape).name)
        return _optimizer_index(ref_name, self._chained)

    def _map_optimizer_indices(self) -> None:
        if self._kinds:  # megatron's groups of all parameters, each chained optimizer holding those of its kind
            chunks = {(t, e, p): meta.chunks for (t, p, e), meta in self._ranks.items()}
            groups_by_rank = megatron_param_groups(chunks, self.args)
            run = self.args.get("optimizer")
            kinds = [optimizers.group_optimizer(dict(o or ()), run) for o in group_overrides(chunks, self.args)]
            for (t, p, e), meta in self._ranks.items():
                for index, kind in enumerate(self._kinds):
                    mine = [g for g, k in zip(groups_by_rank[(t, e, p)], kinds) if k == kind]
                    self._map_rank_indices(meta, meta.optims[index], mine, optimizers.OPTIMIZERS[kind])
            return
        for index in ((0, 1) if self._chained else (0,)):
            metas = {k: m for k, m in self._ranks.items() if index in m.optims}
            # the optimizer rank: (tp, pp) for the dense one, (etp = tp, ep, pp) for the expert one
            groups_by_rank = megatron_param_groups(
                {(t, e, p): meta.chunks for (t, p, e), meta in metas.items()}, self.args, experts=index == 1)
            for (t, p, e), meta in metas.items():
                self._map_rank_indices(meta, meta.optims[index], groups_by_rank[(t, e, p)])

    def _map_rank_indices(self, meta: _RankMeta, view: _OptimView, mine: list, row=None) -> None:
        file = meta.model_file
        opt = view.state
        row = row or self._row  # the row of this view's optimizer (an emerging chain's), else the run's
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
                    if not isinstance(st, dict) or row.step and "step" not in st or not set(row.states) <= set(st):
                        raise structure_error(
                            file, f"{what}: {row.name}'s {', '.join(row.states + (('step',) if row.step else ()))}", st)
                    for name in row.states:
                        rec = check_dtype(st.get(name), (STATE_DTYPE,), path=file, what=f"{what} {name}")
                        if tuple(rec.shape) != spec.shape:
                            raise CheckpointFormatError(
                                f"{file}: {what} has {name} of shape {tuple(rec.shape)} but maps to {ref[1]} of "
                                f"shape {spec.shape}; the param-group order does not match.")
                    if row.step:
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
        for (t, p, e), meta in sorted(self._ranks.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
            for chunk, params in enumerate(meta.listed(self._chained)):
                refs += [ShardRef(t, p, chunk, q.name, q.shape, q.dtype, e) for q in params]
        return refs

    def _records(self, ref: ShardRef) -> dict:
        """The shard's saved tensors as records ('param', and 'fp32', 'exp_avg', 'exp_avg_sq' with optimizer
        state) and its Adam 'step' (a number or a record)."""
        meta = self._ranks.get((ref.tp_rank, ref.pp_rank, ref.ep_rank))
        model = (meta.state.get(meta.model_keys[ref.vpp_chunk])
                 if meta is not None and 0 <= ref.vpp_chunk < len(meta.chunks) else None)
        param = model.get(ref.local_name) if model is not None else None
        if not isinstance(param, TensorRecord) or ref.ep_rank and not is_expert(ref.local_name):
            raise unknown_shard(ref, self.path)
        out: dict = {"param": param}
        if is_buffer(ref.local_name):
            pass  # a persistent buffer: its value, no optimizer state
        elif self.optimizer_kind == "distributed":
            out.update(self._distributed_records(meta, ref))
        elif self.optimizer_kind in ("adam", "mixed_precision"):
            out.update(self._torch_records(meta, ref, param))
        return out

    def _distributed_records(self, meta: _RankMeta, ref: ShardRef) -> dict:
        view = meta.optims[self._view_index(ref.local_name, ref.shape)]
        out = coalesced_records(view.distopt, view.gbuf_base, view.buffers, ref.vpp_chunk, ref.local_name)
        if out is not None:
            if view.step is not None:
                out["step"] = view.step
            return out
        raise CheckpointFormatError(f"{meta.optim_file}: {ref.local_name} is in no DDP buffer of rank "
                                    f"{self._where(ref.tp_rank, ref.pp_rank, ref.ep_rank)}; the file does not match "
                                    f"the model.")

    def _torch_records(self, meta: _RankMeta, ref: ShardRef, param: TensorRecord) -> dict:
        group, idx, half = meta.state_index[(ref.vpp_chunk, ref.local_name)]
        index = self._view_index(ref.local_name, ref.shape)
        opt = meta.optims[index].state
        inner = opt["optimizer"] if self.optimizer_kind == "mixed_precision" else opt
        # FP32Optimizer and fp32 params of Float16Optimizer step the model weight itself
        out = {"fp32": opt["fp32_from_fp16_params"][group][half] if half is not None else param}
        st = inner["state"].get(idx)
        if st is not None:  # no state before the first optimizer step
            row = optimizers.OPTIMIZERS[self._kinds[index]] if self._kinds else self._row
            out.update({name: st[name] for name in row.states})
            if row.step:
                out["step"] = st["step"]
        return out

    def _step(self, meta_step: Any, ref: ShardRef, *, tensor: bool = True):
        """The Adam step: a 0-d float32 tensor for read(), a float for locate() (which needs no torch)."""
        where = self._rank_dir(ref.tp_rank, ref.pp_rank, ref.ep_rank) / MODEL_FILENAME
        step = float(scalar(meta_step, path=where, what=f"the Adam step of {ref.local_name}"))
        if not tensor:
            return step
        import torch

        return torch.tensor(step, dtype=torch.float32)

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
            out["step"] = self._step(records["step"], ref, tensor=False)
        return out

    def common_state(self) -> dict:
        return build_common_state(iteration=self.iteration, args=self.args,
                                  checkpoint_version=self._checkpoint_version,
                                  opt_param_scheduler=self._scheduler,
                                  # the ChainedOptimizer's groups: the dense optimizer's, then the expert one's
                                  param_groups=[g for i in sorted(self._param_groups) for g in self._param_groups[i]]
                                  if self._param_groups else None,
                                  num_flops=self._num_flops)

    # -- run state besides tensors ------------------------------------------------------------------

    def loss_scaler(self):
        """model_optim_rng.pt['optimizer']['grad_scaler'] (the same in every rank's file: checked)."""
        from megatron_ucp.core.run_state import LossScalerState, RunStateError

        if self.weights_only:
            return None  # part of the optimizer's state
        found = {}
        for (t, p, e), meta in sorted(self._ranks.items()):
            opt = meta.state.get("optimizer")
            # a ChainedOptimizer (experts in their own optimizer) saves a list: one scaler state in each
            for i, one in enumerate(opt if isinstance(opt, list) else [opt]):
                if not isinstance(one, dict):
                    continue
                try:
                    found[(t, p, e, i)] = LossScalerState.from_saved(one.get("grad_scaler"),
                                                                     f"{meta.model_file} grad_scaler")
                except RunStateError as err:
                    raise CheckpointFormatError(f"{err}; the file is corrupt, re-copy it") from None
        states = set(found.values())
        if len(states) > 1:
            raise CheckpointFormatError(f"{self.path}: the ranks saved different loss-scaler states "
                                        f"({sorted(map(str, states))}); rank folders of different saves were mixed, "
                                        f"re-copy the iteration folder")
        return states.pop() if states else None

    def rng_states(self) -> list:
        """model_optim_rng.pt['rng_state'] of every (tp, pp) rank: a list of one state, or of one per DP rank
        (--data-parallel-random-init)."""
        from megatron_ucp.core.run_state import RankRngState, RunStateError

        if any(e for _, _, e in self._ranks):
            # expert-parallel folders hold each EP rank's expert RNG stream, which RankRngState does not key;
            # the loader then re-seeds deterministically (as at a new layout)
            return []
        out = []
        for (t, p, _), meta in sorted(self._ranks.items(), key=lambda kv: (kv[0][1], kv[0][0])):
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
