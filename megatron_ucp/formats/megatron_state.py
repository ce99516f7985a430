"""The parts of Megatron-LM's checkpoint state that both Megatron writers build (formats/legacy/writer.py for
`--ckpt-format torch`, formats/torch_dist/writer.py for `torch_dist`), without torch.

- args: the universal checkpoint's JSON args back as Megatron-LM's Namespace values, dtypes and Megatron
  enums made by the caller (torch dtypes and imported enums for torch.save, serialization/torch_save.py's
  stand-ins for the direct writer, which never imports torch);
- the optimizer's param groups at the target layout (Megatron's grouping rule, checked against the group
  identities the universal checkpoint records) and each group's hyper-parameters;
- the RNG states a checkpoint carries: fresh deterministic ones (Megatron's own seeding) or the stored
  ones, their generator states made by the caller's tensor maker (run_state.TensorMaker).

Parameter dtypes here are safe_pickle.TorchDType (compares equal to the torch dtype of the same name);
legacy.py passes torch dtypes where they end up in its pickles.
"""

from __future__ import annotations

import enum
import importlib
import signal
import random
import struct
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional

from megatron_ucp.core import versions
from megatron_ucp.core.dtypes import PARAM_DTYPES
from megatron_ucp.adapters.gpt import (experts_in_own_optimizer, group_identity, group_overrides,
                                      in_expert_optimizer, is_buffer, megatron_param_groups, parameters_for_rank)
from megatron_ucp.formats.bucket_layout import (BufferParam, DDPBucketConfig, build_chunk_buffers,
                                                shared_embedding_names)
from megatron_ucp.core.dtypes import ITEMSIZE
from megatron_ucp.formats.pickles import MEGATRON_ENUMS
from megatron_ucp.serialization.safe_pickle import TorchDType
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.core.run_state import TensorMaker, cpu_generator_state, torch_tensor
from megatron_ucp.formats.writer_base import WriteError, WriteTarget

CHECKPOINT_VERSION = 3.0
RNG_STATE_KINDS = ("cuda", "cpu", "none", "source")
MODEL_DTYPES = {name: TorchDType(name) for name in PARAM_DTYPES}


class MegatronStateError(WriteError):
    """The universal checkpoint's state cannot be laid out as Megatron's at the target layout (cause + fix)."""


# --------------------------------------------------------------------------------------------------
# Args


def import_enum(qualified: str, value: Any) -> Any:
    """The member of an importable Megatron enum (megatron-core imported here), or _DROP where megatron-core is
    not importable (the enum cannot be pickled faithfully then)."""
    module, _, cls = qualified.rpartition(".")
    try:
        if module.startswith("megatron."):
            # megatron-core 0.19 imports triton (a GPU package) and typing.override (Python 3.12) on the way
            from megatron_ucp.megatron_lm.cpu_shims import install_import_patches

            install_import_patches()
        enum_cls = getattr(importlib.import_module(module), cls)
        if isinstance(enum_cls, type) and issubclass(enum_cls, enum.Enum):
            return enum_cls(value)
    except Exception:
        pass
    return _DROP


_DROP = object()
_SIGNAL_PREFIX = "signal.Signals."


def _is_enum(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"enum", "value"}


def args_values(args: Mapping[str, Any], *, release: versions.MegatronRelease,
                source: Optional[versions.MegatronRelease] = None, dtype: Callable[[str], Any],
                enum_member: Callable[[str, Any], Any] = import_enum) -> dict:
    """The values of the args Namespace megatron-core `release` pickles, for a run of `source` with these
    JSON-safe args (convert.json_safe): first as that release's own save holds them (versions.args_for_release:
    arguments it does not know dropped, its defaults for those missing, enums renumbered into its classes and
    none it lacks), then restored where Megatron needs the real type: dtype names ("torch.bfloat16") through
    `dtype(name)`, Megatron enums ({"enum", "value"}; only those a checkpoint may hold, so metadata.json never
    makes us import a module) through `enum_member(class, value)` (in lists too), non-finite floats; values that
    cannot be restored are dropped."""
    plain = {}
    for key, value in versions.args_for_release(args, release, source).items():
        if isinstance(value, str):
            if value.startswith("torch.") and value[len("torch."):] in ITEMSIZE:  # dtype names only
                value = dtype(value[len("torch."):])
            elif value in ("nan", "inf", "-inf"):
                value = float(value)
            elif value.startswith(_SIGNAL_PREFIX) and value[len(_SIGNAL_PREFIX):] in signal.Signals.__members__:
                # --exit-signal: json_safe spells the member "signal.Signals.SIGTERM"; pickled as the enum
                value = enum_member("signal.Signals", signal.Signals[value[len(_SIGNAL_PREFIX):]].value)
        elif _is_enum(value) or (isinstance(value, list) and value and all(_is_enum(v) for v in value)):
            members = [enum_member(v["enum"], v["value"]) if v["enum"] in MEGATRON_ENUMS else _DROP
                       for v in (value if isinstance(value, list) else [value])]
            value = _DROP if any(m is _DROP for m in members) else members if isinstance(value, list) else members[0]
        if value is not _DROP:
            plain[key] = value
    return plain


# --------------------------------------------------------------------------------------------------
# Ranks' parameters and param groups


def rank_chunks(config: GPTModelConfig, layout: ParallelLayout, pp_rank: int, ep_rank: int = 0
                ) -> list[list[tuple[str, tuple, str]]]:
    """One (pp, ep) rank's state entries per chunk (parameters and persistent buffers, registration order)."""
    return [parameters_for_rank(config, layout, pp_rank, chunk if layout.vpp else None, ep_rank=ep_rank, buffers=True)
            for chunk in range(layout.num_chunks)]


def ep_ranks(config: GPTModelConfig, layout: ParallelLayout) -> range:
    """The EP ranks that get folders of their own (Megatron-LM adds `_EEE` with EP > 1)."""
    return range(layout.ep if config.num_experts else 1)


def optimizer_index(canonical: str, config: GPTModelConfig, layout: ParallelLayout) -> int:
    """0: the dense optimizer, 1: the expert optimizer (megatron-core's ChainedOptimizer order)."""
    return 1 if in_expert_optimizer(canonical, config, layout) else 0


def rank_buffer_params(ucp, config, layout, pp_rank, ep_rank: int = 0, dtypes: Mapping[str, Any] = MODEL_DTYPES
                       ) -> list[list[BufferParam]]:
    """Parameters of one (pp, ep) rank per chunk (no persistent buffers), each marked with its optimizer, its
    dtype `dtypes[model dtype name]`."""
    return [[BufferParam(local, tuple(shape), dtypes[ucp.parameters[canonical].model_dtype],
                         expert=optimizer_index(canonical, config, layout) == 1)
             for local, shape, canonical in chunk if not is_buffer(canonical)]
            for chunk in rank_chunks(config, layout, pp_rank, ep_rank)]


def chunk_buffers(target: WriteTarget, pp_rank: int, chunks: list[list[BufferParam]], *, experts: bool = False):
    """Per chunk: the DDP buffer layouts megatron-core builds at the target layout for one (pp, ep) rank's
    parameters (rank_buffer_params): the dense ones, or with `experts` the expert-parallel ones."""
    num_params = sum(p.numel for chunk in chunks for p in chunk)
    out = []
    for chunk_index, params in enumerate(chunks):
        config = DDPBucketConfig.from_megatron_args(target.args, target.layout, pp_rank=pp_rank, vpp_chunk=chunk_index,
                                                    rank_num_parameters=num_params, experts=experts)
        shared = shared_embedding_names(target.args, target.layout, pp_rank=pp_rank, vpp_chunk=chunk_index,
                                        names=[p.name for p in params])
        selected = [replace(p, shared_embedding=p.name in shared) for p in params if p.expert == experts]
        out.append(build_chunk_buffers(selected, config, experts=experts) if selected else [])
    return out


def group_key(group: Mapping[str, Any]) -> tuple:
    """What makes two param groups the same group across layouts (megatron-core's ParamKey overrides; under an
    emerging optimizer the scalar optimizer's groups name it: 'optimizer')."""
    return (float(group.get("wd_mult", 1.0)), float(group.get("lr_mult", 1.0)), bool(group.get("is_decoupled_lr")),
            group.get("optimizer"))


def _stored_key(ucp, entry: Mapping[str, Any]) -> Optional[tuple]:
    """A parameter's recorded group identity: its own fields, or (checkpoints written before the fields were
    recorded: only `index`) those of the group it points at; None when it records none."""
    if not entry:
        return None
    if "wd_mult" in entry:
        return group_key(entry)
    index = entry.get("index")
    if index is not None and 0 <= int(index) < len(ucp.param_groups):
        return group_key(ucp.param_groups[int(index)])
    return None


@dataclass(frozen=True)
class TargetGroups:
    """Megatron's optimizer param groups at the target layout, per optimizer (0 dense, 1 expert) and rank
    ((tp, ep, pp); dense ranks have ep 0), as [(vpp chunk, local name)] lists, and each group's identity."""

    members: dict  # optimizer index -> {(tp, ep, pp): [[(chunk, local name)], ...]}
    identities: dict  # optimizer index -> [group identity dict, ...]


def param_groups_by_rank(ucp, config: GPTModelConfig, target: WriteTarget) -> TargetGroups:
    """Megatron's grouping at the target layout (the dense optimizer over every (tp, pp) rank, the expert optimizer
    over every (tp, ep, pp) rank when experts have their own), each parameter's group checked against the group
    identity the universal checkpoint records for it (layouts may chain differently, identities do not change)."""
    layout = target.layout
    chained = experts_in_own_optimizer(config, layout)
    by_rank = {(t, e, p): rank_buffer_params(ucp, config, layout, p, e)
               for p in range(layout.pp) for t in range(layout.tp) for e in ep_ranks(config, layout)}
    members, identities = {}, {}
    for index in ((0, 1) if chained else (0,)):
        experts = index == 1
        chunks = by_rank if experts else {k: v for k, v in by_rank.items() if k[1] == 0}
        members[index] = megatron_param_groups(chunks, target.args, experts=experts)
        identities[index] = [group_identity(o, expert=experts)
                             for o in group_overrides(chunks, target.args, experts=experts)]
    saved = {group_key(g) for g in ucp.param_groups}
    for index, ranks in members.items():
        for (t, e, p), groups in ranks.items():
            names = {(c, local): canonical for c, chunk in enumerate(rank_chunks(config, layout, p, e))
                     for local, _, canonical in chunk}
            for identity, group in zip(identities[index], groups):
                for ref in group:
                    stored = _stored_key(ucp, ucp.parameters[names[ref]].param_group)
                    if stored is not None and stored != group_key(identity):
                        raise MegatronStateError(
                            f"{ucp.path}: {names[ref]} is in a param group with {stored} but Megatron's grouping rule "
                            f"puts it in one with {group_key(identity)} (wd_mult, lr_mult, decoupled LR, optimizer); custom "
                            f"param-group overrides are not supported")
        missing = [i for i in identities[index] if group_key(i) not in saved]
        if ucp.param_groups and missing:
            raise MegatronStateError(f"{ucp.path}: the universal checkpoint has no optimizer param group like "
                                     f"{missing} that Megatron's grouping rule needs at {layout.describe()}; custom "
                                     f"param-group overrides are not supported")
    return TargetGroups(members, identities)


def group_hyper(ucp, identity: Mapping[str, Any]) -> dict:
    """A target group's hyper-parameters: the universal checkpoint's group of the same identity (lr, weight decay,
    betas, ... as the source optimizer kept them), with the target's is_expert_parallel."""
    found = [g for g in ucp.param_groups if group_key(g) == group_key(identity)]
    same_kind = [g for g in found if bool(g.get("is_expert_parallel")) == identity["is_expert_parallel"]]
    group = dict((same_kind or found or [{}])[0])
    if group:
        group["is_expert_parallel"] = identity["is_expert_parallel"]
    if isinstance(group.get("betas"), list):
        group["betas"] = tuple(group["betas"])  # torch keeps a tuple
    return group


# --------------------------------------------------------------------------------------------------
# RNG states


def fresh_rng_state(args: Mapping[str, Any], iteration: int, tp_rank: int, pp_rank: int, dp: int, kind: str,
                    ep_rank: int = 0, tensor: Optional[TensorMaker] = None) -> list:
    """Megatron's get_rng_state() as freshly seeded by _set_random_seed/model_parallel_cuda_manual_seed, generator
    states made by `tensor` (default torch tensors)."""
    import numpy as np

    tensor = tensor or torch_tensor
    per_dp = dp if args.get("data_parallel_random_init") else 1

    def generator_state(s: int, of: str = kind):
        if of == "cuda":  # CUDAGeneratorImpl::get_state: uint64 seed, int64 Philox offset
            data = struct.pack("<Qq", s, 0)
        else:
            data = cpu_generator_state(s)
        return tensor(data, "uint8", (len(data),))

    states = []
    for dp_rank in range(per_dp):
        seed = int(args.get("seed") or 1234) + 7919 * int(iteration) + 100 * pp_rank + 10 * dp_rank * (per_dp > 1)
        states.append({
            "random_rng_state": random.Random(seed).getstate(),
            "np_rng_state": np.random.RandomState(seed % 2 ** 32).get_state(),
            "torch_rng_state": generator_state(seed, "cpu"),
            "cuda_rng_state": generator_state(seed),
            "rng_tracker_states": {
                "data-parallel-rng": generator_state(seed),
                "model-parallel-rng": generator_state(seed + 2718 + tp_rank),
                "expert-parallel-rng": generator_state(seed + 1024 + 100 * ep_rank + tp_rank),
            },
        })
    return states


def source_rng_state(ucp, tp_rank: int, pp_rank: int, tensor: Optional[TensorMaker] = None,
                     dp_rank: Optional[int] = None) -> list:
    """The universal checkpoint's stored RNG states of rank (pp, tp), as Megatron-LM's `rng_state` list (one
    element, or one per DP rank where they were saved per DP rank); with `dp_rank` (torch_dist's per-DP RNG
    objects with expert parallelism) that DP rank's own state, or the shared one. from_universal checked the
    layout."""
    states = [s for s in ucp.rng_states() if (s.pp, s.tp) == (pp_rank, tp_rank)]
    if dp_rank is not None:
        own = [s for s in states if s.dp == dp_rank]
        states = own or [s for s in states if s.dp is None]
    if not states:
        raise MegatronStateError(f"{ucp.path}: no stored RNG state for rank tp={tp_rank} pp={pp_rank}; use "
                                 f"--rng-state cuda or cpu")
    return [s.to_megatron(tensor) for s in sorted(states, key=lambda s: -1 if s.dp is None else s.dp)]
