"""Which optimizer keeps which per-parameter state: the one table every reader, writer, the universal format and
the loader take an optimizer's state names from (docs/FORMAT.md "Optimizer state by name").

A row is an optimizer as megatron-core 0.19 builds it for Megatron-LM's `--optimizer`: the torch state names of its
per-parameter tensors (every one elementwise: shaped and sharded exactly as its parameter, so it takes the
parameter's pattern), whether torch keeps a per-parameter scalar `step`, and which of its tensors training never
makes negative (checked on load: a flipped sign bit). The names are data read from checkpoints too: `check_state_name`
is the one test a name passes before it names anything (a safetensors key, a JSON key).

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


OPTIMIZERS: dict[str, OptimizerStates] = {
    "adam": OptimizerStates("adam", ("exp_avg", "exp_avg_sq"), step=True, nonnegative=("exp_avg_sq",),
                            torch_class="torch.optim.Adam / AdamW (TE / Apex FusedAdam on GPUs)"),
    # torch.optim.SGD keeps 'momentum_buffer' only with --sgd-momentum != 0 (megatron-core's default is 0.9)
    "sgd": OptimizerStates("sgd", ("momentum_buffer",), step=False,
                           torch_class="torch.optim.SGD (TE / Apex FusedSGD on GPUs)"),
}

# Megatron-LM 0.19's other --optimizer choices: refused in one line by every path until their state is mapped
NOT_SUPPORTED = {
    # megatron-core 0.19 builds every optimizer but adam and sgd through its emerging-optimizer path, whose default
    # overrides give the embeddings, output layer and every non-2-D parameter Adam (or Muon's scalar optimizer):
    # one checkpoint holds two optimizers' states, per parameter group, which the format does not map yet
    "lion": "Lion (emerging_optimizers' Lion on the 2-D weights, 'exp_avg'; megatron-core 0.19 gives the other "
            "parameters Adam: two optimizers' state in one checkpoint)",
    "muon": "Muon (emerging_optimizers' orthogonalized optimizer: 'momentum_buffer' on matrix parameters, its "
            "non-matrix parameters under --muon-scalar-optimizer's state)",
    "dist_muon": "dist_muon (Muon under the layer-wise distributed optimizer)",
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


LAYER_WISE_REFUSAL = ("the layer-wise distributed optimizer's state (megatron-core 0.19 runs --optimizer lion / muon "
                      "with --use-distributed-optimizer as LayerWiseDistributedOptimizer: whole parameters per DP "
                      "rank) is not supported yet; train without --use-distributed-optimizer, or move the weights "
                      "alone: to-universal --weights-only, or --universal-checkpoint with --no-load-optim")


def optimizer_states(name: str) -> OptimizerStates:
    """The row of a supported optimizer (OptimizerNotSupported otherwise)."""
    why = refusal(name)
    if why is not None or name is None:
        raise OptimizerNotSupported(why or "no optimizer")
    return OPTIMIZERS[name]


def check_state_name(name) -> str:
    """A state name read from a checkpoint, before it names a file key: lower-case letters, digits and '_', one
    of STATE_ORDER (ValueError otherwise)."""
    if not isinstance(name, str) or not _STATE_NAME.fullmatch(name) or name not in STATE_ORDER:
        raise ValueError(f"optimizer state name {name!r} is not one megatron-ucp knows ({', '.join(STATE_ORDER)})")
    return name
