"""Which optimizer keeps which per-parameter state: the one table every reader, writer, the universal format and
the loader take an optimizer's state names from (docs/FORMAT.md "Optimizer state by name").

A row is a torch optimizer as megatron-core 0.19 builds it for a parameter: the torch state names of its
per-parameter tensors (every one elementwise: shaped and sharded exactly as its parameter, so it takes the
parameter's pattern), whether torch keeps a per-parameter scalar `step`, and which of its tensors training never
makes negative (checked on load: a flipped sign bit). The names are data read from checkpoints too: `check_state_name`
is the one test a name passes before it names anything (a safetensors key, a JSON key).

A run's `--optimizer` is one row (adam, sgd) or an *emerging* one (lion, muon): megatron-core 0.19 gives that
optimizer the matrix parameters and a scalar optimizer the rest (the embedding, the output layer, every parameter
that is not 2-D: Adam for Lion, --muon-scalar-optimizer for Muon), a ChainedOptimizer of two rows; each parameter
group records which (`group_optimizer`), and `run_optimizers` lists a run's rows in megatron-core's chain order.
Which parameter is a matrix is the rulebook's (adapters/gpt.py `emerging_matrix`).

Pure: no I/O, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class OptimizerStates:
    """One optimizer's per-parameter state (see the module docstring)."""

    name: str  # Megatron-LM's --optimizer value and the universal checkpoint's optimizer "type"
    states: tuple[str, ...]  # torch's state names of its per-parameter tensors, elementwise; file order
    step: bool  # torch keeps a per-parameter scalar 'step'
    nonnegative: tuple[str, ...] = ()  # states training never makes negative
    torch_class: str = ""  # the torch optimizer megatron-core 0.19 builds (for messages and docs)
    # an emerging optimizer (megatron-core's emerging-optimizer path): the args key naming the optimizer of its
    # non-matrix parameters, or that optimizer itself (Lion: "adam"); None for adam and sgd
    scalar: Optional[str] = None


OPTIMIZERS: dict[str, OptimizerStates] = {
    "adam": OptimizerStates("adam", ("exp_avg", "exp_avg_sq"), step=True, nonnegative=("exp_avg_sq",),
                            torch_class="torch.optim.Adam / AdamW (TE / Apex FusedAdam on GPUs)"),
    # torch.optim.SGD keeps 'momentum_buffer' only with --sgd-momentum != 0 (megatron-core's default is 0.9)
    "sgd": OptimizerStates("sgd", ("momentum_buffer",), step=False,
                           torch_class="torch.optim.SGD (TE / Apex FusedSGD on GPUs)"),
    # emerging_optimizers 0.3.0's Lion keeps one moment and no step; megatron-core gives the rest Adam
    "lion": OptimizerStates("lion", ("exp_avg",), step=False, scalar="adam",
                            torch_class="emerging_optimizers' Lion"),
    # emerging_optimizers 0.3.0's orthogonalized optimizer keeps the momentum only (no step); the rest take
    # --muon-scalar-optimizer (adam or lion)
    "muon": OptimizerStates("muon", ("momentum_buffer",), step=False, scalar="muon_scalar_optimizer",
                            torch_class="megatron-core's TensorParallelMuon (emerging_optimizers' Muon)"),
}

# the optimizers an emerging optimizer's non-matrix parameters may take (megatron-core 0.19: --muon-scalar-optimizer)
SCALAR_OPTIMIZERS = ("adam", "lion")

# Megatron-LM 0.19's other --optimizer choices: refused in one line by every path until their state is mapped
NOT_SUPPORTED = {
    "dist_muon": "dist_muon (Muon under the layer-wise distributed optimizer: whole parameters per DP rank)",
    "soap": "SOAP (emerging_optimizers' Kronecker-factored preconditioner state, not elementwise)",
    "adaptive_muon": "adaptive Muon (emerging_optimizers' AdaptiveMuon: momentum_buffer and a moment2_buffer of its "
                     "own shape)",
}

# every state name any row knows, in the order tensor files store them (after 'fp32')
STATE_ORDER: tuple[str, ...] = tuple(dict.fromkeys(s for row in OPTIMIZERS.values() for s in row.states))

_STATE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


class OptimizerNotSupported(ValueError):
    """An optimizer whose state this project does not map (yet): the message names it and the way out."""


def refusal(name: Optional[str]) -> Optional[str]:
    """Why an optimizer's state cannot be converted or loaded, one line; None for the rows of OPTIMIZERS (and for
    None: a checkpoint without optimizer state)."""
    if name is None or name in OPTIMIZERS:
        return None
    what = NOT_SUPPORTED.get(name) if isinstance(name, str) else None
    if what is None:
        return (f"optimizer {name!r} is not one megatron-ucp knows ({', '.join(OPTIMIZERS)} are supported, "
                f"{', '.join(NOT_SUPPORTED)} not yet)")
    return (f"--optimizer {name}: {what} is not supported yet; megatron-ucp converts and loads the state of "
            f"{', '.join(OPTIMIZERS)} only (move its weights alone: to-universal --weights-only, or "
            f"--universal-checkpoint with --no-load-optim)")


_WEIGHTS_ALONE = ("move the weights alone: to-universal --weights-only, or --universal-checkpoint with "
                  "--no-load-optim")

# megatron-core 0.19 runs --optimizer lion / muon with --use-distributed-optimizer as LayerWiseDistributedOptimizer:
# whole matrices per DP rank (model-space state) chained with a DistributedOptimizer of the scalar parameters' own
# DDP buffer. megatron-ucp reads and loads it from torch_dist's default dp_reshardable saves (the measured ones).
LAYER_WISE_LEGACY_REFUSAL = (
    "the layer-wise distributed optimizer's state in a --ckpt-format torch checkpoint (distrib_optim.pt of a "
    "LayerWiseDistributedOptimizer) is not supported; megatron-ucp reads it from --ckpt-format torch_dist saves "
    "(Megatron-LM's default), or " + _WEIGHTS_ALONE)


def runs_layer_wise(name: Optional[str]) -> bool:
    """Whether megatron-core 0.19 runs --optimizer `name` with --use-distributed-optimizer as its layer-wise
    distributed optimizer (Megatron-LM 0.19's validate_args: every optimizer but adam and sgd)."""
    return (name or "adam") not in ("adam", "sgd")


def layer_wise_refusal(name: Optional[str], args) -> Optional[str]:
    """Why a run of --optimizer `name` under the layer-wise distributed optimizer has state megatron-ucp does not map,
    one line; None where it does (Muon or Lion with Adam for the scalar parameters). Lion scalars: megatron-core
    0.19.2 cannot save them (its DistributedOptimizer's save reads Adam's per-parameter 'step': KeyError at the first
    save), so no such checkpoint exists to measure."""
    scalar = scalar_optimizer(name, args) if name in OPTIMIZERS else None
    if scalar in (None, name):
        return (f"--optimizer {name} under the layer-wise distributed optimizer: megatron-core 0.19 builds it for the "
                f"emerging optimizers (lion, muon) only")
    if scalar != "adam":
        return (f"--optimizer {name} with {scalar} for the scalar parameters under the layer-wise distributed optimizer "
                f"is not supported (megatron-core 0.19.2 cannot save it: its DistributedOptimizer reads Adam's 'step'); "
                f"use --muon-scalar-optimizer adam, or " + _WEIGHTS_ALONE)
    return None


def layer_wise_sharding_refusal(sharding) -> str:
    """Why the layer-wise distributed optimizer's state saved with this distrib_optim_sharding_type is not read."""
    return (f"the layer-wise distributed optimizer's state saved with distrib_optim_sharding_type={sharding!r} is not "
            f"supported (megatron-ucp reads its 'dp_reshardable' saves, Megatron-LM's default: drop "
            f"--dist-ckpt-optim-fully-reshardable), or " + _WEIGHTS_ALONE)


EMERGING_WITH_EXPERTS_REFUSAL = (
    "with experts in their own optimizer (EP > 1 or ETP != TP) megatron-core chains four optimizers, which "
    "megatron-ucp does not map yet; " + _WEIGHTS_ALONE)
# the write side: --universal-checkpoint loads that chain (measured: MUE19's universal at EP2), nothing writes it yet
EMERGING_WITH_EXPERTS_WRITE_REFUSAL = (
    "with experts in their own optimizer at the target layout (EP > 1 or ETP != TP) megatron-core chains four "
    "optimizers, which megatron-ucp does not write yet; resume at that layout with --universal-checkpoint (it loads "
    "them), or write at EP1 with ETP = TP")


def optimizer_states(name: str) -> OptimizerStates:
    """The row of a supported optimizer (OptimizerNotSupported otherwise)."""
    why = refusal(name)
    if why is not None or name is None:
        raise OptimizerNotSupported(why or "no optimizer")
    return OPTIMIZERS[name]


def scalar_optimizer(name: str, args) -> Optional[str]:
    """The optimizer megatron-core 0.19 gives an emerging optimizer's non-matrix parameters (None for adam, sgd):
    Lion's Adam, Muon's --muon-scalar-optimizer (`args`: a dict of Megatron-LM's args). OptimizerNotSupported
    for a scalar optimizer megatron-core does not build."""
    row = optimizer_states(name)
    if row.scalar is None:
        return None
    scalar = row.scalar if row.scalar in OPTIMIZERS else (args.get(row.scalar) or "adam")
    if scalar not in SCALAR_OPTIMIZERS:
        raise OptimizerNotSupported(f"--{row.scalar.replace('_', '-')} {scalar!r}: megatron-core 0.19 builds "
                                    f"{', '.join(SCALAR_OPTIMIZERS)} only")
    return scalar


def run_optimizers(name: Optional[str], args) -> tuple[str, ...]:
    """The rows a run's --optimizer gives its parameters, in megatron-core 0.19's chain order: (name,) for adam and
    sgd; (the emerging optimizer, its scalar optimizer) for lion and muon. () for None (no optimizer state)."""
    if name is None:
        return ()
    scalar = scalar_optimizer(name, args)
    return (name,) if scalar is None or scalar == name else (name, scalar)


def parameter_optimizer(name: str, args, *, matrix: bool) -> str:
    """The row of one parameter under --optimizer `name`: the emerging optimizer for a matrix parameter, its scalar
    optimizer for the rest (megatron-core 0.19's `_is_nonlinear_or_embedding` override); `name` itself otherwise."""
    scalar = scalar_optimizer(name, args)
    return name if scalar is None or matrix else scalar


def group_optimizer(group: dict, run: str) -> str:
    """Which row a saved param group's parameters take: megatron-core 0.19's own rule (its emerging-optimizer
    path buckets groups by `group.get('optimizer', config.optimizer)`); a name no row has is refused."""
    kind = group.get("optimizer", run) if isinstance(group, dict) else run
    if kind not in OPTIMIZERS:
        raise OptimizerNotSupported(f"a param group's optimizer {kind!r} is not one megatron-ucp knows "
                                    f"({', '.join(OPTIMIZERS)})")
    return kind


def run_states(name: Optional[str], args) -> tuple[str, ...]:
    """Every state a run's parameters hold (the union over run_optimizers, in STATE_ORDER)."""
    found = {s for row in run_optimizers(name, args) for s in OPTIMIZERS[row].states}
    return tuple(s for s in STATE_ORDER if s in found)


def check_state_name(name) -> str:
    """A state name read from a checkpoint, before it names a file key: lower-case letters, digits and '_', one
    of STATE_ORDER (ValueError otherwise)."""
    if not isinstance(name, str) or not _STATE_NAME.fullmatch(name) or name not in STATE_ORDER:
        raise ValueError(f"optimizer state name {name!r} is not one megatron-ucp knows ({', '.join(STATE_ORDER)})")
    return name
