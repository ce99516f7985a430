"""megatron-core GPTModel: parameter names, shapes, registration order and parallel patterns.

Canonical names are megatron-core's local-spec GPTModel names with the GLOBAL layer index, e.g.
`decoder.layers.7.self_attention.linear_qkv.weight`. Inside a model chunk megatron-core numbers layers
from 0 (stage-local); the chunk (pp_rank, vpp_chunk) holds global layers
[layer_offset, layer_offset + layers_per_chunk), as in megatron-core 0.16.1's
get_transformer_layer_offset for even pipelines. TransformerEngine-spec names (and torch_dist keys,
which use them even for the local spec) put the norms inside the next linear:
`self_attention.linear_qkv.layer_norm_weight` is canonical `input_layernorm.weight`,
`mlp.linear_fc1.layer_norm_weight` is `pre_mlp_layernorm.weight`.

Tied embeddings: a tied model has one canonical tensor, `embedding.word_embeddings.weight`; when the
first and last model chunks differ, the last one holds a copy as `output_layer.weight`.

Pure: no file I/O, no torch.distributed.
"""

from __future__ import annotations

import functools
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron_ucp.layout import LayoutError, ParallelLayout
from megatron_ucp.model_config import GPTModelConfig
from megatron_ucp.patterns import (FusedSubParams, GroupedQKV, Pattern, Replicated, Sharded, VocabSharded,
                                   check_copies_agree)

Shape = Tuple[int, ...]

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
LAYER_PREFIX = "decoder.layers."


class UnknownParameterError(ValueError):
    """A parameter name the GPT adapter has no rule for (never given a default layout)."""


# --------------------------------------------------------------------------------------------------
# Pipeline placement of layers


def layers_per_chunk(num_layers: int, layout: ParallelLayout) -> int:
    """Transformer layers in each model chunk (megatron-core's even split over PP x VPP)."""
    if layout.num_chunks > 1 and layout.pp == 1:
        raise LayoutError(f"{layout.describe()}: an interleaved pipeline (VPP={layout.vpp}) needs PP > 1 "
                          "(Megatron-LM asserts it; megatron-core ignores VPP at PP=1); drop VPP or raise PP")
    chunks = layout.pp * layout.num_chunks
    if num_layers < 1 or num_layers % chunks:
        ok = [f"PP{p}" + (f"xVPP{v}" if v > 1 else "") for p in range(1, num_layers + 1)
              for v in range(1, num_layers // p + 1) if num_layers % (p * v) == 0 and p * v <= 8][:8]
        raise LayoutError(
            f"num_layers={num_layers} is not divisible by PP x VPP = {layout.pp} x {layout.num_chunks}; "
            f"megatron-core splits layers evenly over model chunks: choose e.g. {', '.join(ok)}")
    return num_layers // chunks


def _check_chunk(layout: ParallelLayout, pp_rank: int, vpp_chunk: Optional[int]) -> int:
    chunk = 0 if vpp_chunk is None else vpp_chunk
    if not 0 <= pp_rank < layout.pp:
        raise LayoutError(f"pp_rank={pp_rank} is not a stage of PP={layout.pp}; use 0 <= pp_rank < {layout.pp}")
    if not 0 <= chunk < layout.num_chunks:
        raise LayoutError(f"vpp_chunk={vpp_chunk} is not a chunk of {layout.describe()}; "
                          f"use 0 <= vpp_chunk < {layout.num_chunks}")
    return chunk


def layer_offset(num_layers: int, layout: ParallelLayout, pp_rank: int, vpp_chunk: Optional[int] = None) -> int:
    """Global index of the chunk's local layer 0 (megatron-core's get_transformer_layer_offset)."""
    chunk = _check_chunk(layout, pp_rank, vpp_chunk)
    per_chunk = layers_per_chunk(num_layers, layout)
    # Chunks are ordered chunk-major: VPP chunk v of stage p is block v * PP + p.
    return (chunk * layout.pp + pp_rank) * per_chunk


def layer_location(global_layer: int, num_layers: int, layout: ParallelLayout) -> Tuple[int, int, int]:
    """(pp_rank, vpp_chunk, local_layer) holding `global_layer`."""
    if not 0 <= global_layer < num_layers:
        raise UnknownParameterError(f"layer {global_layer} does not exist: the model has num_layers={num_layers}")
    per_chunk = layers_per_chunk(num_layers, layout)
    block, local = divmod(global_layer, per_chunk)
    vpp_chunk, pp_rank = divmod(block, layout.pp)
    return pp_rank, vpp_chunk, local


def is_first_chunk(layout: ParallelLayout, pp_rank: int, vpp_chunk: Optional[int] = None) -> bool:
    """Holds the embedding (megatron-core's pre_process)."""
    return pp_rank == 0 and _check_chunk(layout, pp_rank, vpp_chunk) == 0


def is_last_chunk(layout: ParallelLayout, pp_rank: int, vpp_chunk: Optional[int] = None) -> bool:
    """Holds the final norm and the output layer (megatron-core's post_process)."""
    return pp_rank == layout.pp - 1 and _check_chunk(layout, pp_rank, vpp_chunk) == layout.num_chunks - 1


def _last_chunk(layout: ParallelLayout) -> Tuple[int, int]:
    return layout.pp - 1, layout.num_chunks - 1


# --------------------------------------------------------------------------------------------------
# Names


def is_ignorable(name: str) -> bool:
    """Non-parameter state entries we deliberately skip: `_extra_state` (TransformerEngine FP8 metadata;
    None placeholders on megatron-core's local linears), also as torch_dist `…/shard_i_n` byte entries."""
    return bool(re.fullmatch(r".+\._extra_state(/shard_[0-9_.]+)?", name))


# TE-spec (and torch_dist) names of the layer norms fused into the following linear.
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_LOCAL_TO_TE = {v: k for k, v in _TE_TO_LOCAL.items()}

# Every canonical name, as anchored regexes (full match), each with its pattern given the config.
_L = r"decoder\.layers\.(?P<layer>\d+)\."
_RULES: List[Tuple["re.Pattern[str]", object]] = [
    (re.compile(r"embedding\.word_embeddings\.weight"), lambda c: VocabSharded()),
    (re.compile(r"embedding\.position_embeddings\.weight"), lambda c: Replicated()),
    (re.compile(_L + r"(input_layernorm|pre_mlp_layernorm)\.(weight|bias)"), lambda c: Replicated()),
    (re.compile(_L + r"self_attention\.linear_qkv\.(weight|bias)"), lambda c: _qkv_pattern(c)),
    (re.compile(_L + r"self_attention\.linear_proj\.weight"), lambda c: Sharded(1)),
    (re.compile(_L + r"self_attention\.linear_proj\.bias"), lambda c: Replicated()),
    (re.compile(_L + r"mlp\.linear_fc1\.(weight|bias)"),
     lambda c: FusedSubParams(0, (1, 1)) if c.swiglu else Sharded(0)),
    (re.compile(_L + r"mlp\.linear_fc2\.weight"), lambda c: Sharded(1)),
    (re.compile(_L + r"mlp\.linear_fc2\.bias"), lambda c: Replicated()),
    (re.compile(r"decoder\.final_layernorm\.(weight|bias)"), lambda c: Replicated()),
    (re.compile(r"output_layer\.weight"), lambda c: VocabSharded()),
]


def _unknown(name: str, why: str = "") -> UnknownParameterError:
    hint = " (unwrap DDP / Float16Module first: names must not start with 'module.')" if name.startswith(
        "module.") else ""
    return UnknownParameterError(
        f"parameter {name!r} has no rule in the megatron-core GPT adapter{hint}{why}; add an explicit rule "
        "in megatron_ucp/adapters/gpt.py rather than guessing its layout")


def _match_rule(name: str):
    for regex, make_pattern in _RULES:
        if regex.fullmatch(name):
            return make_pattern
    raise _unknown(name)


def _te_to_local_suffix(suffix: str) -> str:
    return _TE_TO_LOCAL.get(suffix, suffix)


def _split_layer(name: str) -> Optional[Tuple[int, str]]:
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    return (int(m.group(1)), m.group(2)) if m else None


def canonical_name(local_name: str, layout: ParallelLayout, pp_rank: int, vpp_chunk: Optional[int],
                   num_layers: int, *, tied: bool = False) -> Optional[str]:
    """Canonical name of a model chunk's parameter (local-spec or TE-spec name, stage-local layer index).

    Returns None only for `is_ignorable` entries; unknown names raise UnknownParameterError and names
    that cannot live on this chunk raise LayoutError. With `tied`, the last chunk's
    `output_layer.weight` is the copy of `embedding.word_embeddings.weight`.
    """
    if is_ignorable(local_name):
        return None
    chunk = _check_chunk(layout, pp_rank, vpp_chunk)
    where = f"pp_rank={pp_rank} vpp_chunk={chunk} of {layout.describe()}"
    layer = _split_layer(local_name)
    if layer is not None:
        local_layer, suffix = layer
        name = f"{LAYER_PREFIX}{local_layer}.{_te_to_local_suffix(suffix)}"
        _match_rule(name)
        per_chunk = layers_per_chunk(num_layers, layout)
        if local_layer >= per_chunk:
            raise LayoutError(f"{local_name!r} on {where}: local layer {local_layer} but each chunk holds "
                              f"{per_chunk} of num_layers={num_layers}; the checkpoint has another layout")
        global_layer = layer_offset(num_layers, layout, pp_rank, chunk) + local_layer
        return f"{LAYER_PREFIX}{global_layer}.{_te_to_local_suffix(suffix)}"
    _match_rule(local_name)
    if local_name.startswith("embedding.") and not is_first_chunk(layout, pp_rank, chunk):
        raise LayoutError(f"{local_name!r} found on {where}, but only pp_rank=0 vpp_chunk=0 holds the "
                          "embedding; the checkpoint has another pipeline layout")
    if local_name.startswith(("decoder.final_layernorm.", "output_layer.")) and not is_last_chunk(
            layout, pp_rank, chunk):
        raise LayoutError(f"{local_name!r} found on {where}, but only the last chunk holds it; "
                          "the checkpoint has another pipeline layout")
    if local_name == OUTPUT_LAYER and tied:
        return WORD_EMBEDDINGS
    return local_name


def local_name(canonical: str, layout: ParallelLayout, num_layers: int, *,
               tied: bool = False) -> List[Tuple[int, int, str]]:
    """Where a canonical parameter lives: [(pp_rank, vpp_chunk, local-spec name)] (vpp_chunk is 0
    without VPP). A tied word embedding has two places when the first and last chunks differ."""
    layer = _split_layer(canonical)
    _match_rule(canonical)
    if layer is not None:
        global_layer, suffix = layer
        pp_rank, chunk, local = layer_location(global_layer, num_layers, layout)
        return [(pp_rank, chunk, f"{LAYER_PREFIX}{local}.{suffix}")]
    layers_per_chunk(num_layers, layout)
    if canonical.startswith("embedding."):
        places = [(0, 0, canonical)]
        if canonical == WORD_EMBEDDINGS and tied and _last_chunk(layout) != (0, 0):
            places.append((*_last_chunk(layout), OUTPUT_LAYER))
        return places
    if canonical == OUTPUT_LAYER and tied:
        raise UnknownParameterError(f"{OUTPUT_LAYER!r} is not canonical in a tied model; its canonical "
                                    f"tensor is {WORD_EMBEDDINGS!r}")
    return [(*_last_chunk(layout), canonical)]


def te_name(canonical_or_local: str) -> str:
    """The TransformerEngine-spec / torch_dist spelling of a local-spec name (norms fused into linears)."""
    layer = _split_layer(canonical_or_local)
    if layer is None:
        return canonical_or_local
    index, suffix = layer
    return f"{LAYER_PREFIX}{index}.{_LOCAL_TO_TE.get(suffix, suffix)}"


def torch_dist_key(canonical: str) -> Tuple[str, Optional[int]]:
    """(torch_dist key, index on its leading layer axis or None). torch_dist stacks all layers of one
    parameter into one tensor of shape (num_layers, *shape), indexed by global layer."""
    _match_rule(canonical)
    layer = _split_layer(canonical)
    if layer is None:
        return canonical, None
    index, suffix = layer
    return LAYER_PREFIX + _LOCAL_TO_TE.get(suffix, suffix), index


def canonical_from_torch_dist(key: str, num_layers: int, *, tied: bool = False) -> List[str]:
    """Canonical names held by a torch_dist key: one per global layer (in axis order) for stacked layer
    keys, one for others, none for ignorable `_extra_state` entries."""
    if is_ignorable(key):
        return []
    m = re.fullmatch(r"decoder\.layers\.([a-z_].*)", key)
    if m:
        suffix = _te_to_local_suffix(m.group(1))
        _match_rule(f"{LAYER_PREFIX}0.{suffix}")
        return [f"{LAYER_PREFIX}{i}.{suffix}" for i in range(num_layers)]
    _match_rule(key)
    return [WORD_EMBEDDINGS if key == OUTPUT_LAYER and tied else key]


# --------------------------------------------------------------------------------------------------
# Shapes, order and patterns


def _qkv_pattern(config: GPTModelConfig) -> GroupedQKV:
    heads, groups = config.num_attention_heads, config.num_query_groups
    if heads % groups:
        raise ValueError(f"num_attention_heads={heads} is not divisible by num_query_groups={groups}; "
                         "the model config is invalid")
    return GroupedQKV(groups, heads // groups, config.kv_channels)


def _layer_parameters(config: GPTModelConfig) -> List[Tuple[str, Shape]]:
    """One layer's (suffix, global shape) in megatron-core's registration order (local spec):
    the attention's linear_proj is built (in Attention) before linear_qkv (in SelfAttention)."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    layer_norm_bias = config.normalization == "LayerNorm"
    qkv_rows = config.query_projection_size + 2 * config.kv_projection_size
    fc1_rows = 2 * ffn if config.swiglu else ffn
    rows = [
        ("input_layernorm.weight", (h,), True),
        ("input_layernorm.bias", (h,), layer_norm_bias),
        ("self_attention.linear_proj.weight", (h, config.query_projection_size), True),
        ("self_attention.linear_proj.bias", (h,), config.add_bias_linear),
        ("self_attention.linear_qkv.weight", (qkv_rows, h), True),
        ("self_attention.linear_qkv.bias", (qkv_rows,), config.add_bias_linear or config.add_qkv_bias),
        ("pre_mlp_layernorm.weight", (h,), True),
        ("pre_mlp_layernorm.bias", (h,), layer_norm_bias),
        ("mlp.linear_fc1.weight", (fc1_rows, h), True),
        ("mlp.linear_fc1.bias", (fc1_rows,), config.add_bias_linear),
        ("mlp.linear_fc2.weight", (h, ffn), True),
        ("mlp.linear_fc2.bias", (h,), config.add_bias_linear),
    ]
    return [(suffix, shape) for suffix, shape, present in rows if present]


def _check_supported(config: GPTModelConfig) -> None:
    if config.num_experts:
        raise NotImplementedError(f"num_experts={config.num_experts}: MoE layers are not supported by the "
                                  "GPT adapter yet")
    if config.normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization={config.normalization!r} is not supported; use LayerNorm or RMSNorm")
    if config.position_embedding_type not in ("learned_absolute", "rope", "none"):
        raise ValueError(f"position_embedding_type={config.position_embedding_type!r} is not supported")


@functools.lru_cache(maxsize=32)
def _expected(config: GPTModelConfig) -> Tuple[Tuple[str, Shape], ...]:
    _check_supported(config)
    h = config.hidden_size
    params: List[Tuple[str, Shape]] = [(WORD_EMBEDDINGS, (config.padded_vocab_size, h))]
    if config.position_embedding_type == "learned_absolute":
        params.append((POSITION_EMBEDDINGS, (config.max_position_embeddings, h)))
    layer = _layer_parameters(config)
    for index in range(config.num_layers):
        params += [(f"{LAYER_PREFIX}{index}.{suffix}", shape) for suffix, shape in layer]
    params.append(("decoder.final_layernorm.weight", (h,)))
    if config.normalization == "LayerNorm":
        params.append(("decoder.final_layernorm.bias", (h,)))
    if not config.tied:
        params.append((OUTPUT_LAYER, (config.padded_vocab_size, h)))
    return tuple(params)


@functools.lru_cache(maxsize=32)
def _expected_shapes(config: GPTModelConfig) -> Dict[str, Shape]:
    return dict(_expected(config))


def pattern_for(canonical: str, config: GPTModelConfig) -> Pattern:
    """The parallel pattern of a canonical parameter (also accepts a tied model's `output_layer.weight`).
    Names that match no rule, or that this config does not have, raise UnknownParameterError."""
    make_pattern = _match_rule(canonical)
    if canonical not in _expected_shapes(config) and not (canonical == OUTPUT_LAYER and config.tied):
        raise _unknown(canonical, f": not a parameter of this model (num_layers={config.num_layers}, "
                                  f"normalization={config.normalization}, add_bias_linear={config.add_bias_linear}, "
                                  f"position_embedding_type={config.position_embedding_type})")
    return make_pattern(config)


def expected_parameters(config: GPTModelConfig, layout: Optional[ParallelLayout] = None
                        ) -> List[Tuple[str, Shape]]:
    """Every canonical parameter with its global shape, in a TP1PP1 model's registration order.
    With a layout, also check that the layout can hold the model (LayoutError with cause and fix)."""
    params = list(_expected(config))
    if layout is not None:
        layers_per_chunk(config.num_layers, layout)
        for name, shape in params:
            pattern_for(name, config).validate(shape, layout.tp, name=name)
    return params


def parameters_for_rank(config: GPTModelConfig, layout: ParallelLayout, pp_rank: int,
                        vpp_chunk: Optional[int] = None) -> List[Tuple[str, Shape, str]]:
    """(local name, TP-local shape, canonical name) of one model chunk, in megatron-core's
    module.parameters() order; layer indices in local names are stage-local (0-based per chunk)."""
    chunk = _check_chunk(layout, pp_rank, vpp_chunk)
    shapes = _expected_shapes(config)
    expected_parameters(config, layout)
    first, last = is_first_chunk(layout, pp_rank, chunk), is_last_chunk(layout, pp_rank, chunk)

    def entry(local: str, canonical: str) -> Tuple[str, Shape, str]:
        return local, pattern_for(canonical, config).local_shape(shapes[canonical], layout.tp), canonical

    out = []
    if first:
        out.append(entry(WORD_EMBEDDINGS, WORD_EMBEDDINGS))
        if POSITION_EMBEDDINGS in shapes:
            out.append(entry(POSITION_EMBEDDINGS, POSITION_EMBEDDINGS))
    offset = layer_offset(config.num_layers, layout, pp_rank, chunk)
    layer = _layer_parameters(config)
    for local_layer in range(layers_per_chunk(config.num_layers, layout)):
        for suffix, _ in layer:
            out.append(entry(f"{LAYER_PREFIX}{local_layer}.{suffix}", f"{LAYER_PREFIX}{offset + local_layer}.{suffix}"))
    if last:
        out.append(entry("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"))
        if "decoder.final_layernorm.bias" in shapes:
            out.append(entry("decoder.final_layernorm.bias", "decoder.final_layernorm.bias"))
        # megatron-core allocates no output weight where it can share the embedding on the same chunk.
        if not config.tied:
            out.append(entry(OUTPUT_LAYER, OUTPUT_LAYER))
        elif not first:
            out.append(entry(OUTPUT_LAYER, WORD_EMBEDDINGS))
    return out


def check_tied_copies(word_embeddings: torch.Tensor, output_layer: torch.Tensor) -> None:
    """Raise PatternError unless the last chunk's output_layer copy equals the embedding bitwise."""
    check_copies_agree([word_embeddings, output_layer], name=WORD_EMBEDDINGS,
                       labels=["the first stage (embedding)", "the last stage (output_layer.weight)"])
