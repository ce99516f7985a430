"""Layout-invariant initialisation: the same initial model at every TP/PP/DP layout.

Megatron seeds each pipeline stage and tensor-parallel rank differently, so two layouts start from
different weights. With --layout-invariant-init every parameter is drawn from a generator seeded by
(seed, its canonical global name), as one global tensor, then sliced for this rank with its UCP
pattern. Runs at different layouts then start from bitwise-identical models, which is what makes
loss curves comparable across layouts. Each rank materialises the global tensor of the parameters it
holds, so this is meant for experiments and tests, not 100B models.

MoE layers: each routed expert is drawn from its name with the GLOBAL expert index
(`decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight`, E = ep_rank x local experts + j)
and sliced over the expert-tensor-parallel group, so the experts are the same at any EP/ETP; the router
(replicated) and the shared expert (sliced over TP like a dense MLP) are drawn from their global names too.
The GPT adapter has no MoE rows yet, so those names and patterns are spelled here (`_moe_parameter`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import Optional, Tuple

import torch

from megatron.core import parallel_state

from megatron_ucp.adapters import gpt as gpt_adapter
from megatron_ucp.formats.common import layout_from_args
from megatron_ucp.model_config import GPTModelConfig
from megatron_ucp.patterns import FusedSubParams, Pattern, Replicated, Sharded


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2 ** 63 - 1)


def initial_value(name: str, shape, config: GPTModelConfig, std: float, seed: int) -> torch.Tensor:
    """The global initial tensor of canonical parameter `name` (Megatron's init rules)."""
    if name.endswith(".bias") and not name.endswith(".router.bias"):  # megatron-core draws the router's bias
        return torch.zeros(shape)
    if "layernorm" in name or name.endswith("final_layernorm.weight"):
        return torch.ones(shape)
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        std = std / math.sqrt(2.0 * config.num_layers)  # Megatron's scaled init for output layers
    generator = torch.Generator().manual_seed(_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


# An MoE layer's parameters (local-spec names, stage-local layer, local expert index).
_MOE_PARAMETER = re.compile(
    r"decoder\.layers\.(?P<layer>\d+)\.mlp\.(?:"
    r"(?P<router>router\.(?:weight|bias))"
    r"|experts\.local_experts\.(?P<expert>\d+)\.(?P<expert_linear>linear_fc[12]\.(?:weight|bias))"
    r"|(?P<shared>shared_experts\.(?:linear_fc[12]\.(?:weight|bias)|gate_weight)))")


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where one rank's MoE parameter comes from: its global name, pattern and slicing group."""
    name: str
    pattern: Pattern
    rank: int  # in the group the pattern slices over (ETP for routed experts, TP otherwise)
    size: int


def _linear_pattern(suffix: str, swiglu: bool) -> Pattern:
    """A (routed or shared) expert MLP's linears shard like the dense MLP's: fc1 on rows (SwiGLU: gate and
    up halves each sharded), fc2 on columns, fc2's bias replicated."""
    if suffix.startswith("linear_fc1."):
        return FusedSubParams(0, (1, 1)) if swiglu else Sharded(0)
    return Sharded(1) if suffix == "linear_fc2.weight" else Replicated()


def _moe_parameter(local_name: str, layer_offset: int, expert_offset: int, swiglu: bool) -> Optional[_Placement]:
    """The placement of an MoE-layer parameter of this rank's chunk (None for any other parameter).
    `layer_offset`: global index of the chunk's layer 0; `expert_offset`: global index of local expert 0."""
    m = _MOE_PARAMETER.fullmatch(local_name)
    if m is None:
        return None
    prefix = f"decoder.layers.{layer_offset + int(m['layer'])}.mlp."
    if m["router"]:
        return _Placement(prefix + m["router"], Replicated(), 0, 1)
    if m["shared"]:
        suffix = m["shared"][len("shared_experts."):]
        pattern = Replicated() if suffix == "gate_weight" else _linear_pattern(suffix, swiglu)
        return _Placement(prefix + m["shared"], pattern, parallel_state.get_tensor_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_world_size())
    expert = expert_offset + int(m["expert"])
    return _Placement(f"{prefix}experts.local_experts.{expert}.{m['expert_linear']}",
                      _linear_pattern(m["expert_linear"], swiglu),
                      parallel_state.get_expert_tensor_parallel_rank(),
                      parallel_state.get_expert_tensor_parallel_world_size())


def _global_shape(pattern: Pattern, local_shape: Tuple[int, ...], size: int) -> Tuple[int, ...]:
    dim = getattr(pattern, "dim", None)
    if dim is None:
        return tuple(local_shape)
    return tuple(n * size if d == dim else n for d, n in enumerate(local_shape))


@torch.no_grad()
def layout_invariant_init(chunks, args) -> None:
    config = GPTModelConfig.from_megatron_args(args)
    # The adapter knows the dense parameters (attention, norms, embeddings, dense MLPs); MoE parameters
    # are placed by _moe_parameter.
    dense_config = dataclasses.replace(config, num_experts=None)
    layout = layout_from_args(vars(args))
    shapes = dict(gpt_adapter.expected_parameters(dense_config))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    expert_offset = 0
    if args.num_experts:
        expert_offset = parallel_state.get_expert_model_parallel_rank() * (
            args.num_experts // args.expert_model_parallel_size)
    for vpp_chunk, chunk in enumerate(chunks):
        vpp = vpp_chunk if layout.vpp else None
        offset = gpt_adapter.layer_offset(config.num_layers, layout, pp_rank, vpp)
        for local, param in chunk.named_parameters():
            moe = _moe_parameter(local, offset, expert_offset, config.swiglu) if args.num_experts else None
            if moe is not None:
                shape = _global_shape(moe.pattern, tuple(param.shape), moe.size)
                full = initial_value(moe.name, shape, config, args.init_method_std, args.seed)
                param.copy_(moe.pattern.slice_for_rank(full, moe.rank, moe.size).to(param.dtype))
                continue
            name = gpt_adapter.canonical_name(local, layout, pp_rank, vpp, config.num_layers, tied=config.tied)
            if name is None:
                continue
            pattern = gpt_adapter.pattern_for(name, dense_config)
            full = initial_value(name, shapes[name], dense_config, args.init_method_std, args.seed)
            param.copy_(pattern.slice_for_rank(full, tp_rank, layout.tp).to(param.dtype))
