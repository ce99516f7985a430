"""Layout-invariant initialisation: the same initial model at every TP/PP/DP layout.

Megatron seeds each pipeline stage and tensor-parallel rank differently, so two layouts start from
different weights. With --layout-invariant-init every parameter is drawn from a generator seeded by
(seed, its canonical global name), as one global tensor, then sliced for this rank with its UCP
pattern. Runs at different layouts then start from bitwise-identical models, which is what makes
loss curves comparable across layouts. Each rank materialises the global tensor of the parameters it
holds, so this is meant for experiments and tests, not 100B models.

MoE layers: each routed expert is drawn from its canonical name with the GLOBAL expert index
(`decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight`) and sliced over the
expert-tensor-parallel group, so the experts are the same at any EP/ETP; the router (replicated) and
the shared expert (sliced over TP like a dense MLP) are drawn from their global names too. Names,
patterns and groups all come from the GPT rulebook.
"""

from __future__ import annotations

import hashlib
import math

import torch

from megatron.core import parallel_state

from megatron_ucp.adapters import gpt as rulebook
from megatron_ucp.formats.common import layout_from_args
from megatron_ucp.core.model_config import GPTModelConfig


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


@torch.no_grad()
def layout_invariant_init(chunks, args) -> None:
    config = GPTModelConfig.from_megatron_args(args)
    layout = layout_from_args(vars(args))
    shapes = dict(rulebook.expected_parameters(config))
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank() if config.num_experts else 0
    ranks = {False: parallel_state.get_tensor_model_parallel_rank(),
             True: parallel_state.get_expert_tensor_parallel_rank() if config.num_experts else 0}
    for vpp_chunk, chunk in enumerate(chunks):
        vpp = vpp_chunk if layout.vpp else None
        for local, param in chunk.named_parameters():
            # any pipeline split, uneven included: the rulebook places layers (layer_placement)
            name = rulebook.canonical_name(local, layout, pp_rank, vpp, config.num_layers, tied=config.tied,
                                           config=config, ep_rank=ep_rank)
            if name is None:
                continue
            pattern = rulebook.pattern_for(name, config)
            full = initial_value(name, shapes[name], config, args.init_method_std, args.seed)
            rank = ranks[rulebook.rule_for(name).expert_tp]
            param.copy_(pattern.slice_for_rank(full, rank, rulebook.tp_size_of(name, layout)).to(param.dtype))
