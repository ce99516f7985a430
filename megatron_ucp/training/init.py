"""Layout-invariant initialisation: the same initial model at every TP/PP/DP layout.

Megatron seeds each pipeline stage and tensor-parallel rank differently, so two layouts start from
different weights. With --layout-invariant-init every parameter is drawn from a generator seeded by
(seed, its canonical global name), as one global tensor, then sliced for this rank with its UCP
pattern. Runs at different layouts then start from bitwise-identical models, which is what makes
loss curves comparable across layouts. Each rank materialises the global tensor of the parameters it
holds, so this is meant for experiments and tests, not 100B models.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re

import torch

from megatron.core import parallel_state

from megatron_ucp.adapters import gpt as gpt_adapter
from megatron_ucp.formats.common import layout_from_args
from megatron_ucp.layer_placement import chunk_placement, split_from_args
from megatron_ucp.layout import ParallelLayout
from megatron_ucp.model_config import GPTModelConfig


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2 ** 63 - 1)


def initial_value(name: str, shape, config: GPTModelConfig, std: float, seed: int) -> torch.Tensor:
    """The global initial tensor of canonical parameter `name` (Megatron's init rules)."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "layernorm" in name or name.endswith("final_layernorm.weight"):
        return torch.ones(shape)
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        std = std / math.sqrt(2.0 * config.num_layers)  # Megatron's scaled init for output layers
    generator = torch.Generator().manual_seed(_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def global_name(local: str, first_layer: int, one_stage: ParallelLayout, config: GPTModelConfig):
    """Canonical name of a chunk's parameter whose local layer 0 is global layer `first_layer` (any
    pipeline split, uneven included; see megatron_ucp.layer_placement)."""
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", local)
    if match:
        local = f"decoder.layers.{first_layer + int(match.group(1))}.{match.group(2)}"
    # Global layer indices, so the name is read as on a one-stage layout (this TP, no pipeline).
    return gpt_adapter.canonical_name(local, one_stage, 0, None, config.num_layers, tied=config.tied)


@torch.no_grad()
def layout_invariant_init(chunks, args) -> None:
    config = GPTModelConfig.from_megatron_args(args)
    layout = layout_from_args(vars(args))
    one_stage = dataclasses.replace(layout, pp=1, vpp=None)
    split = split_from_args(args)
    shapes = dict(gpt_adapter.expected_parameters(config))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for vpp_chunk, chunk in enumerate(chunks):
        first_layer = chunk_placement(split, pp_rank, vpp_chunk).layers.start
        for local, param in chunk.named_parameters():
            name = global_name(local, first_layer, one_stage, config)
            if name is None:
                continue
            pattern = gpt_adapter.pattern_for(name, config)
            full = initial_value(name, shapes[name], config, args.init_method_std, args.seed)
            param.copy_(pattern.slice_for_rank(full, tp_rank, layout.tp).to(param.dtype))
