"""The megatron-core GPTModel rulebook: every rule about its parameters, in one table.

One row (`ParamRule`) per parameter of the model, in megatron-core's registration order (what
`module.parameters()` visits, which the distributed optimizer's flat buffers depend on):
its local-spec name, its TransformerEngine-spec spelling (also the `torch_dist` key), where it lives
(first chunk, every layer, last chunk), its global shape and parallel pattern as functions of the
model config, whether it is in the model for that config, whether it belongs to a linear module
(the local spec saves a `_extra_state` entry after it), and whether Megatron's decoupled learning rate
applies (embedding / output weights). Every spelling, order, pattern and group rule the readers,
writers, converter and loader use is derived from `RULES`; change a layout rule here and nowhere else.

Canonical names are local-spec names with the GLOBAL layer index, e.g.
`decoder.layers.7.self_attention.linear_qkv.weight`. Inside a model chunk megatron-core numbers layers
from 0; the chunk (pp_rank, vpp_chunk) holds global layers `chunk_layers(...)` (megatron-core 0.16.1's
get_transformer_layer_offset / get_num_layers_to_build for even pipelines).
TransformerEngine-spec names (and torch_dist keys, which use them even for the local spec) put the
norms inside the next linear: `self_attention.linear_qkv.layer_norm_weight` is canonical
`input_layernorm.weight`; torch_dist stacks a layer parameter over all layers under
`decoder.layers.<TE suffix>`, with the global layer index on the leading axis.

Tied embeddings: a tied model has one canonical tensor, `embedding.word_embeddings.weight`; when the
first and last model chunks differ, the last one holds a copy as `output_layer.weight`.

Mixture of experts (docs/MOE_CHECKPOINTS.md): a layer is dense or MoE (`GPTModelConfig.moe_layers`);
rows say which kind has them. Routed-expert rows are templates over the expert index: the model
names local experts (`mlp.experts.local_experts.{j}...`, `mlp.experts.linear_fc1.weight{j}` with
TransformerEngine's grouped GEMM), canonical names use the GLOBAL expert index
(`decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight`; expert e lives on EP rank
e // (E/EP) as local expert e % (E/EP)), torch_dist keys put it on an expert axis
(`mlp.experts.experts.linear_fc1.weight`). Routed experts are split over the expert-TP group (ETP),
everything else over TP. With `--moe-layer-freq` as a list (or an int > 1) torch_dist saves every
layer under its own key `decoder.layers.<L>.<suffix>` instead of stacking.

Pure: no file I/O, no torch.distributed.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_ucp.core import optimizers
from megatron_ucp.core.placement import PipelineSplit, PlacementError, chunk_placement
from megatron_ucp.core.placement import layer_location as split_layer_location
from megatron_ucp.core.placement import validate as validate_split
from megatron_ucp.core.layout import LayoutError, ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig, pad_vocab_size
from megatron_ucp.core.patterns import (FusedSubParams, GroupedQKV, Pattern, PatternError, Replicated, Sharded,
                                   VocabSharded, check_copies_agree)

Shape = Tuple[int, ...]

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
LAYER_PREFIX = "decoder.layers."

PRE, LAYER, POST = "pre", "layer", "post"  # where a row lives: first chunk, every layer, last chunk
# A multi-token prediction layer's own rows (before and after its inner transformer layer, whose rows are the
# LAYER rows): on the last chunk, between the decoder's final norm and the output layer
MTP_PRE, MTP_POST = "mtp_pre", "mtp_post"
MTP_PREFIX = "mtp.layers."
# The MTP layer's inner transformer layer: the module megatron-core >= 0.17 names it (the canonical spelling),
# and what torch_dist (every release) and legacy files of releases <= 0.16 call it
MTP_INNER, MTP_INNER_SAVED = "mtp_model_layer", "transformer_layer"


class UnknownParameterError(ValueError):
    """A parameter name the GPT rulebook has no row for (never given a default layout)."""


# --------------------------------------------------------------------------------------------------
# The table


ANY, DENSE, MOE = "any", "dense", "moe"  # which layers have a LAYER row: all, dense ones, MoE ones
EXPERT = "{e}"  # the expert index in a routed expert row's names


@dataclass(frozen=True)
class ParamRule:
    """One parameter (or persistent buffer) of megatron-core's GPTModel (see the module docstring)."""

    name: str  # local-spec name; for LAYER rows the suffix after `decoder.layers.<i>.`; EXPERT for experts
    scope: str  # PRE | LAYER | POST
    shape: Callable[[GPTModelConfig], Shape]
    pattern: Callable[[GPTModelConfig], Pattern]
    present: Callable[[GPTModelConfig], bool] = lambda c: True
    te_name: Optional[str] = None  # TransformerEngine spelling when it differs
    dist_name: Optional[str] = None  # torch_dist key spelling when it differs from the TE one
    linear: bool = False  # part of a linear module (saves `<module>._extra_state` in the local spec)
    decoupled_lr: bool = False  # embedding / output weight: Megatron's --decoupled-lr applies
    kind: str = ANY  # ANY | DENSE | MOE (LAYER rows)
    expert_tp: bool = False  # split over the expert-TP group (routed experts) instead of TP
    buffer: bool = False  # a persistent buffer (in state dicts, no gradient, no optimizer state)
    # Other spellings megatron-core uses for this parameter (readers accept them), e.g. MLA's query norm fused
    # into TransformerEngine's up projection
    aliases: Tuple[str, ...] = ()
    # The torch_dist spelling when it depends on the model's spec (transformer_impl, MLA) or on whether the
    # layer is MoE: a function of (config, moe layer); default `dist`
    dist_by: Optional[Callable[[GPTModelConfig, bool], str]] = None

    @property
    def te(self) -> str:
        return self.te_name or self.name

    @property
    def dist(self) -> str:
        return self.dist_name or self.te

    def dist_for(self, config: Optional[GPTModelConfig], moe_layer: bool) -> str:
        """The torch_dist spelling megatron-core writes for this row in a model of `config`."""
        return self.dist_by(config, moe_layer) if self.dist_by is not None and config is not None else self.dist

    @property
    def expert(self) -> bool:
        """A routed expert's row: one parameter per expert."""
        return EXPERT in self.name

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


def _qkv_rows(c: GPTModelConfig) -> int:
    return c.query_projection_size + 2 * c.kv_projection_size


def _qkv_pattern(c: GPTModelConfig) -> GroupedQKV:
    if c.num_attention_heads % c.num_query_groups:
        raise ValueError(f"num_attention_heads={c.num_attention_heads} is not divisible by num_query_groups="
                         f"{c.num_query_groups}; the model config is invalid")
    return GroupedQKV(c.num_query_groups, c.num_attention_heads // c.num_query_groups, c.kv_channels)


def _gpt_attention(c: GPTModelConfig) -> bool:
    return not c.multi_latent_attention


def _mla_with(*needs: Callable[[GPTModelConfig], bool]) -> Callable[[GPTModelConfig], bool]:
    return lambda c: c.multi_latent_attention and all(need(c) for need in needs)


def _q_lora(c: GPTModelConfig) -> bool:
    return c.q_lora_rank is not None


def _mla_down_proj_pattern(c: GPTModelConfig) -> Pattern:
    """MLA's q/kv down projections: megatron-core's local spec builds them column-parallel (each TP rank computes
    a slice of the compressed vector, then gathers it), TransformerEngine's spec as duplicated linears."""
    return Sharded(0) if c.transformer_impl == "local" else Replicated()


def _te_spec(c: GPTModelConfig) -> bool:
    return c.transformer_impl != "local"


def _norm_spelling(fused: str, separate: str, *, fused_when: Callable[[GPTModelConfig, bool], bool]
                   ) -> Callable[[GPTModelConfig, bool], str]:
    """A norm's torch_dist spelling: inside the next linear (TE's LayerNormLinear, or the local spec's key map
    onto it) or as its own module."""
    return lambda c, moe: fused if fused_when(c, moe) else separate


def _pre_mlp_norm_fused(c: GPTModelConfig, moe: bool) -> bool:
    # TE spec: fused into a dense layer's linear_fc1, its own module before MoE. Local spec: the key map spells it
    # fused for GPT attention layers; MLA's local layer spec has no key map.
    return not moe if _te_spec(c) else not c.multi_latent_attention


def _mla_norm_fused(c: GPTModelConfig, moe: bool) -> bool:
    return _te_spec(c)  # TE spec: MLA's q / kv norms are fused into the up projections


def _mla_q_norm_fused(c: GPTModelConfig, moe: bool) -> bool:
    return c.multi_latent_attention and _mla_norm_fused(c, moe)  # GPT attention's q_layernorm is its own module


def _fc1_rows(c: GPTModelConfig) -> int:
    return 2 * c.ffn_hidden_size if c.swiglu else c.ffn_hidden_size


def _fc1_pattern(c: GPTModelConfig) -> Pattern:
    return FusedSubParams(0, (1, 1)) if c.swiglu else Sharded(0)  # SwiGLU: [gate; up], each split over TP


def _layer_norm_bias(c: GPTModelConfig) -> bool:
    return c.normalization == "LayerNorm"


def _qkv_bias(c: GPTModelConfig) -> bool:
    return c.add_bias_linear or c.add_qkv_bias


def _h(c: GPTModelConfig) -> Shape:
    return (c.hidden_size,)


def _head(c: GPTModelConfig) -> Shape:
    return (c.kv_channels,)


def _q_norm_shape(c: GPTModelConfig) -> Shape:
    return (c.q_lora_rank,) if c.multi_latent_attention else (c.kv_channels,)


def _mtp(c: GPTModelConfig) -> bool:
    return bool(c.mtp_num_layers)


def _replicated(c: GPTModelConfig) -> Pattern:
    return Replicated()


def _bias(c: GPTModelConfig) -> bool:
    return c.add_bias_linear


def _moe_fc1_rows(c: GPTModelConfig) -> int:
    return 2 * c.moe_ffn_hidden_size if c.swiglu else c.moe_ffn_hidden_size


def _shared_fc1_rows(c: GPTModelConfig) -> int:
    size = c.moe_shared_expert_intermediate_size
    return 2 * size if c.swiglu else size


def _shared(c: GPTModelConfig) -> bool:
    return bool(c.moe_shared_expert_intermediate_size)


_EXPERTS = "mlp.experts.local_experts." + EXPERT


# Registration order: TransformerLayer.__init__ builds input_layernorm, self_attention (Attention.__init__
# builds linear_proj, then SelfAttention adds linear_qkv, q_layernorm, k_layernorm; MLASelfAttention adds
# linear_q_proj or linear_q_down_proj + linear_q_up_proj, then linear_kv_down_proj, linear_kv_up_proj, q_layernorm,
# kv_layernorm), pre_mlp_layernorm, mlp (linear_fc1, linear_fc2); a multi-token prediction layer builds enorm,
# hnorm, eh_proj, its transformer layer, final_layernorm; checked against megatron-core and real checkpoints
# (tests/test_adapter_gpt.py, tests/test_mla_mtp.py).
RULES: Tuple[ParamRule, ...] = (
    ParamRule(WORD_EMBEDDINGS, PRE, lambda c: (c.padded_vocab_size, c.hidden_size), lambda c: VocabSharded(),
              decoupled_lr=True),
    ParamRule(POSITION_EMBEDDINGS, PRE, lambda c: (c.max_position_embeddings, c.hidden_size), _replicated,
              present=lambda c: c.position_embedding_type == "learned_absolute"),
    # MLA layers keep the input norm as a module of its own in both specs
    ParamRule("input_layernorm.weight", LAYER, _h, _replicated,
              te_name="self_attention.linear_qkv.layer_norm_weight",
              dist_by=_norm_spelling("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight",
                                     fused_when=lambda c, moe: _gpt_attention(c))),
    ParamRule("input_layernorm.bias", LAYER, _h, _replicated, present=_layer_norm_bias,
              te_name="self_attention.linear_qkv.layer_norm_bias",
              dist_by=_norm_spelling("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias",
                                     fused_when=lambda c, moe: _gpt_attention(c))),
    ParamRule("self_attention.linear_proj.weight", LAYER, lambda c: (c.hidden_size, c.attention_output_size),
              lambda c: Sharded(1), linear=True),
    ParamRule("self_attention.linear_proj.bias", LAYER, _h, _replicated, present=_bias, linear=True),
    ParamRule("self_attention.linear_qkv.weight", LAYER, lambda c: (_qkv_rows(c), c.hidden_size), _qkv_pattern,
              present=_gpt_attention, linear=True),
    ParamRule("self_attention.linear_qkv.bias", LAYER, lambda c: (_qkv_rows(c),), _qkv_pattern,
              present=lambda c: _gpt_attention(c) and _qkv_bias(c), linear=True),
    # Multi-latent attention: column-parallel up projections whose rows are whole heads ([q_nope; q_rope] per
    # query head, [k_nope; v] per key/value head), so an even split over TP is a split of heads
    # TransformerEngine's spec only (the local spec refuses --qk-layernorm without --q-lora-rank): a norm over the
    # hidden state fused into the query projection
    ParamRule("self_attention.linear_q_proj.layer_norm_weight", LAYER, _h, _replicated,
              present=_mla_with(lambda c: not _q_lora(c), lambda c: c.qk_layernorm, _te_spec)),
    ParamRule("self_attention.linear_q_proj.layer_norm_bias", LAYER, _h, _replicated,
              present=_mla_with(lambda c: not _q_lora(c), lambda c: c.qk_layernorm, _te_spec, _layer_norm_bias)),
    ParamRule("self_attention.linear_q_proj.weight", LAYER,
              lambda c: (c.num_attention_heads * c.mla_q_head_dim, c.hidden_size), lambda c: Sharded(0),
              present=_mla_with(lambda c: not _q_lora(c)), linear=True),
    ParamRule("self_attention.linear_q_down_proj.weight", LAYER, lambda c: (c.q_lora_rank, c.hidden_size),
              _mla_down_proj_pattern, present=_mla_with(_q_lora), linear=True),
    ParamRule("self_attention.linear_q_up_proj.weight", LAYER,
              lambda c: (c.num_attention_heads * c.mla_q_head_dim, c.q_lora_rank), lambda c: Sharded(0),
              present=_mla_with(_q_lora), linear=True),
    ParamRule("self_attention.linear_kv_down_proj.weight", LAYER,
              lambda c: (c.kv_lora_rank + c.qk_pos_emb_head_dim, c.hidden_size), _mla_down_proj_pattern,
              present=_mla_with(), linear=True),
    ParamRule("self_attention.linear_kv_up_proj.weight", LAYER,
              lambda c: (c.num_attention_heads * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank),
              lambda c: Sharded(0), present=_mla_with(), linear=True),
    # q_layernorm: per head (GPT attention) or over the compressed query (MLA, with --q-lora-rank)
    ParamRule("self_attention.q_layernorm.weight", LAYER, _q_norm_shape, _replicated,
              present=lambda c: c.qk_layernorm and (_gpt_attention(c) or _q_lora(c)),
              aliases=("self_attention.linear_q_up_proj.layer_norm_weight",),
              dist_by=_norm_spelling("self_attention.linear_q_up_proj.layer_norm_weight",
                                     "self_attention.q_layernorm.weight", fused_when=_mla_q_norm_fused)),
    ParamRule("self_attention.q_layernorm.bias", LAYER, _q_norm_shape, _replicated,
              present=lambda c: c.qk_layernorm and (_gpt_attention(c) or _q_lora(c)) and _layer_norm_bias(c),
              aliases=("self_attention.linear_q_up_proj.layer_norm_bias",),
              dist_by=_norm_spelling("self_attention.linear_q_up_proj.layer_norm_bias",
                                     "self_attention.q_layernorm.bias", fused_when=_mla_q_norm_fused)),
    ParamRule("self_attention.k_layernorm.weight", LAYER, _head, _replicated,
              present=lambda c: c.qk_layernorm and _gpt_attention(c)),
    ParamRule("self_attention.k_layernorm.bias", LAYER, _head, _replicated,
              present=lambda c: c.qk_layernorm and _gpt_attention(c) and _layer_norm_bias(c)),
    ParamRule("self_attention.kv_layernorm.weight", LAYER, lambda c: (c.kv_lora_rank,), _replicated,
              present=_mla_with(lambda c: c.qk_layernorm), aliases=("self_attention.linear_kv_up_proj.layer_norm_weight",),
              dist_by=_norm_spelling("self_attention.linear_kv_up_proj.layer_norm_weight",
                                     "self_attention.kv_layernorm.weight", fused_when=_mla_norm_fused)),
    ParamRule("self_attention.kv_layernorm.bias", LAYER, lambda c: (c.kv_lora_rank,), _replicated,
              present=_mla_with(lambda c: c.qk_layernorm, _layer_norm_bias),
              aliases=("self_attention.linear_kv_up_proj.layer_norm_bias",),
              dist_by=_norm_spelling("self_attention.linear_kv_up_proj.layer_norm_bias",
                                     "self_attention.kv_layernorm.bias", fused_when=_mla_norm_fused)),
    ParamRule("pre_mlp_layernorm.weight", LAYER, _h, _replicated, te_name="mlp.linear_fc1.layer_norm_weight",
              dist_by=_norm_spelling("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight",
                                     fused_when=_pre_mlp_norm_fused)),
    ParamRule("pre_mlp_layernorm.bias", LAYER, _h, _replicated, present=_layer_norm_bias,
              te_name="mlp.linear_fc1.layer_norm_bias",
              dist_by=_norm_spelling("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias",
                                     fused_when=_pre_mlp_norm_fused)),
    ParamRule("mlp.linear_fc1.weight", LAYER, lambda c: (_fc1_rows(c), c.hidden_size), _fc1_pattern, linear=True,
              kind=DENSE),
    ParamRule("mlp.linear_fc1.bias", LAYER, lambda c: (_fc1_rows(c),), _fc1_pattern, present=_bias, linear=True,
              kind=DENSE),
    ParamRule("mlp.linear_fc2.weight", LAYER, lambda c: (c.hidden_size, c.ffn_hidden_size), lambda c: Sharded(1),
              linear=True, kind=DENSE),
    ParamRule("mlp.linear_fc2.bias", LAYER, _h, _replicated, present=_bias, linear=True, kind=DENSE),
    # MoE layer (MoELayer.__init__: router, experts, shared_experts; SharedExpertMLP registers its gate
    # before its linears). The router is fp32 and replicated; its expert_bias is a persistent buffer.
    ParamRule("mlp.router.weight", LAYER, lambda c: (c.num_experts, c.hidden_size), _replicated, kind=MOE),
    ParamRule("mlp.router.bias", LAYER, lambda c: (c.num_experts,), _replicated, present=_bias, kind=MOE),
    ParamRule("mlp.router.expert_bias", LAYER, lambda c: (c.num_experts,), _replicated,
              present=lambda c: c.moe_router_enable_expert_bias, kind=MOE, buffer=True),
    ParamRule(_EXPERTS + ".linear_fc1.weight", LAYER, lambda c: (_moe_fc1_rows(c), c.hidden_size), _fc1_pattern,
              te_name="mlp.experts.linear_fc1.weight" + EXPERT, dist_name="mlp.experts.experts.linear_fc1.weight",
              linear=True, kind=MOE, expert_tp=True),
    ParamRule(_EXPERTS + ".linear_fc1.bias", LAYER, lambda c: (_moe_fc1_rows(c),), _fc1_pattern, present=_bias,
              te_name="mlp.experts.linear_fc1.bias" + EXPERT, dist_name="mlp.experts.experts.linear_fc1.bias",
              linear=True, kind=MOE, expert_tp=True),
    ParamRule(_EXPERTS + ".linear_fc2.weight", LAYER, lambda c: (c.hidden_size, c.moe_ffn_hidden_size),
              lambda c: Sharded(1), te_name="mlp.experts.linear_fc2.weight" + EXPERT,
              dist_name="mlp.experts.experts.linear_fc2.weight", linear=True, kind=MOE, expert_tp=True),
    ParamRule(_EXPERTS + ".linear_fc2.bias", LAYER, _h, _replicated, present=_bias,
              te_name="mlp.experts.linear_fc2.bias" + EXPERT, dist_name="mlp.experts.experts.linear_fc2.bias",
              linear=True, kind=MOE, expert_tp=True),
    ParamRule("mlp.shared_experts.gate_weight", LAYER, lambda c: (1, c.hidden_size), _replicated,
              present=lambda c: _shared(c) and c.moe_shared_expert_gate, kind=MOE),
    ParamRule("mlp.shared_experts.linear_fc1.weight", LAYER, lambda c: (_shared_fc1_rows(c), c.hidden_size),
              _fc1_pattern, present=_shared, linear=True, kind=MOE),
    ParamRule("mlp.shared_experts.linear_fc1.bias", LAYER, lambda c: (_shared_fc1_rows(c),), _fc1_pattern,
              present=lambda c: _shared(c) and c.add_bias_linear, linear=True, kind=MOE),
    ParamRule("mlp.shared_experts.linear_fc2.weight", LAYER,
              lambda c: (c.hidden_size, c.moe_shared_expert_intermediate_size), lambda c: Sharded(1),
              present=_shared, linear=True, kind=MOE),
    ParamRule("mlp.shared_experts.linear_fc2.bias", LAYER, _h, _replicated,
              present=lambda c: _shared(c) and c.add_bias_linear, linear=True, kind=MOE),
    # Multi-token prediction layer k: mtp.layers.<k>.<name> (MTP_PRE rows, then its transformer layer's LAYER
    # rows under mtp.layers.<k>.mtp_model_layer., then MTP_POST rows)
    ParamRule("enorm.weight", MTP_PRE, _h, _replicated, present=_mtp),
    ParamRule("enorm.bias", MTP_PRE, _h, _replicated, present=lambda c: _mtp(c) and _layer_norm_bias(c)),
    ParamRule("hnorm.weight", MTP_PRE, _h, _replicated, present=_mtp),
    ParamRule("hnorm.bias", MTP_PRE, _h, _replicated, present=lambda c: _mtp(c) and _layer_norm_bias(c)),
    ParamRule("eh_proj.weight", MTP_PRE, lambda c: (c.hidden_size, 2 * c.hidden_size), lambda c: Sharded(0),
              present=_mtp, linear=True),  # column-parallel: [embedding; hidden state] -> hidden
    ParamRule("final_layernorm.weight", MTP_POST, _h, _replicated, present=_mtp),
    ParamRule("final_layernorm.bias", MTP_POST, _h, _replicated, present=lambda c: _mtp(c) and _layer_norm_bias(c)),
    ParamRule("decoder.final_layernorm.weight", POST, _h, _replicated),
    ParamRule("decoder.final_layernorm.bias", POST, _h, _replicated, present=_layer_norm_bias),
    ParamRule(OUTPUT_LAYER, POST, lambda c: (c.padded_vocab_size, c.hidden_size), lambda c: VocabSharded(),
              present=lambda c: not c.tied, linear=True, decoupled_lr=True),
)

_MTP_SCOPES = (MTP_PRE, MTP_POST)


def _site_of(rule: ParamRule) -> str:
    return LAYER if rule.scope == LAYER else "mtp" if rule.scope in _MTP_SCOPES else "top"


_BY_NAME: Dict[Tuple[str, str], ParamRule] = {}  # (LAYER | "mtp" | "top", spelling) -> row, rows without an index
_EXPERT_SPELLINGS: List[Tuple["re.Pattern[str]", ParamRule]] = []  # routed expert rows, by regex
for _rule in RULES:
    for _spelling in {_rule.name, _rule.te, *_rule.aliases}:
        if _rule.expert:
            _EXPERT_SPELLINGS.append((re.compile(re.escape(_spelling).replace(re.escape(EXPERT), r"(\d+)")), _rule))
        else:
            assert _BY_NAME.setdefault((_site_of(_rule), _spelling), _rule) is _rule, f"two rows spell {_spelling}"


# --------------------------------------------------------------------------------------------------
# Names


def is_ignorable(name: str) -> bool:
    """Non-parameter state entries we deliberately skip: `_extra_state` (TransformerEngine FP8 metadata;
    None placeholders on megatron-core's local linears), also as torch_dist `…/shard_i_n` byte entries."""
    return bool(re.fullmatch(r".+\._extra_state(/shard_[0-9_.]+)?", name))


def _unknown(name: str, why: str = "") -> UnknownParameterError:
    hint = " (unwrap DDP / Float16Module first: names must not start with 'module.')" if name.startswith(
        "module.") else ""
    return UnknownParameterError(
        f"parameter {name!r} has no rule in the megatron-core GPT rulebook{hint}{why}; add a row to RULES "
        "in megatron_ucp/adapters/gpt.py rather than guessing its layout")


@dataclass(frozen=True)
class _Name:
    """A parameter name taken apart: its row, its decoder layer or MTP layer index, its expert index."""

    rule: ParamRule
    layer: Optional[int] = None  # decoder layer (LAYER rows)
    mtp: Optional[int] = None  # multi-token prediction layer (MTP rows, and LAYER rows of its transformer layer)
    expert: Optional[int] = None


_DECODER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(?:(" + MTP_INNER + "|" + MTP_INNER_SAVED + r")\.)?(.+)")


def _match_suffix(suffix: str) -> Optional[Tuple[ParamRule, Optional[int]]]:
    """(row, expert index or None) of a layer suffix in any spelling."""
    rule = _BY_NAME.get((LAYER, suffix))
    if rule is not None:
        return rule, None
    for regex, rule in _EXPERT_SPELLINGS:
        m = regex.fullmatch(suffix)
        if m:
            return rule, int(m.group(1))
    return None


def _resolve(name: str) -> _Name:
    """A name in any spelling (local, TE, torch_dist; decoder or MTP layer), taken apart."""
    m = _DECODER_LAYER.fullmatch(name)
    if m:
        found = _match_suffix(m.group(2))
        if found is None:
            raise _unknown(name)
        return _Name(found[0], layer=int(m.group(1)), expert=found[1])
    m = _MTP_LAYER.fullmatch(name)
    if m:
        if m.group(2):  # the MTP layer's transformer layer
            found = _match_suffix(m.group(3))
        else:
            rule = _BY_NAME.get(("mtp", m.group(3)))
            found = (rule, None) if rule is not None else None
        if found is None:
            raise _unknown(name)
        return _Name(found[0], mtp=int(m.group(1)), expert=found[1])
    rule = _BY_NAME.get(("top", name))
    if rule is None:
        raise _unknown(name)
    return _Name(rule)


def rule_for(name: str) -> ParamRule:
    """The row of a parameter name in any spelling (local or TE, any layer or expert index)."""
    return _resolve(name).rule


def _spell(rule: ParamRule, spelling: str, layer: Optional[int] = None, expert: Optional[int] = None, *,
           mtp: Optional[int] = None, inner: str = MTP_INNER) -> str:
    """A row's name with its indices: decoder layer `layer`, or MTP layer `mtp` (its transformer layer's rows under
    `inner`), expert `expert`."""
    if expert is not None:
        spelling = spelling.replace(EXPERT, str(expert))
    if mtp is not None:
        return f"{MTP_PREFIX}{mtp}.{inner + '.' if rule.scope == LAYER else ''}{spelling}"
    return spelling if layer is None else f"{LAYER_PREFIX}{layer}.{spelling}"


def local_spelling(name: str) -> str:
    """A name in the local-spec spelling of megatron-core 0.19 (same indices): TE-spec norms, older releases' MTP
    module names, aliases."""
    n = _resolve(name)
    return _spell(n.rule, n.rule.name, n.layer, n.expert, mtp=n.mtp)


def mtp_inner_spelling(name: str, inner: str) -> str:
    """A local-spec name with an MTP layer's transformer layer spelled `inner` (MTP_INNER or MTP_INNER_SAVED:
    what a release's legacy files call it); other names unchanged."""
    n = _resolve(name)
    return _spell(n.rule, n.rule.name, n.layer, n.expert, mtp=n.mtp, inner=inner)


def te_name(canonical_or_local: str) -> str:
    """The TransformerEngine-spec spelling of a local-spec name (norms fused into linears, grouped experts)."""
    n = _resolve(canonical_or_local)
    return _spell(n.rule, n.rule.te, n.layer, n.expert, mtp=n.mtp)


def is_expert(name: str) -> bool:
    """A routed expert's parameter (split over ETP, placed by EP, its own optimizer groups)."""
    return rule_for(name).expert


def is_buffer(name: str) -> bool:
    """A persistent buffer (state, but no gradient and no optimizer state)."""
    return rule_for(name).buffer


def tp_size_of(name: str, layout: ParallelLayout) -> int:
    """The tensor-parallel size a parameter is split over at `layout` (ETP for routed experts)."""
    return layout.expert_tp if rule_for(name).expert_tp else layout.tp


# --------------------------------------------------------------------------------------------------
# Pipeline placement of layers


def _split(num_layers: int, layout: ParallelLayout) -> PipelineSplit:
    return PipelineSplit(num_layers, layout.pp, layout.vpp, layout.first_stage_layers, layout.last_stage_layers,
                         layout.embedding_in_split, layout.loss_in_split)


def check_pipeline(num_layers: int, layout: ParallelLayout) -> None:
    """LayoutError (cause + fix) unless megatron-core places num_layers on this pipeline correctly."""
    if layout.num_chunks > 1 and layout.pp == 1:
        raise LayoutError(f"{layout.describe()}: an interleaved pipeline (VPP={layout.vpp}) needs PP > 1 "
                          "(Megatron-LM asserts it; megatron-core ignores VPP at PP=1); drop VPP or raise PP")
    if not layout.even_pipeline:
        try:
            validate_split(_split(num_layers, layout))
        except PlacementError as e:
            raise LayoutError(str(e)) from None
        return
    chunks = layout.pp * layout.num_chunks
    if num_layers < 1 or num_layers % chunks:
        ok = [f"PP{p}" + (f"xVPP{v}" if v > 1 else "") for p in range(1, num_layers + 1)
              for v in range(1, num_layers // p + 1) if num_layers % (p * v) == 0 and p * v <= 8][:8]
        raise LayoutError(
            f"num_layers={num_layers} is not divisible by PP x VPP = {layout.pp} x {layout.num_chunks}; "
            f"megatron-core splits layers evenly over model chunks (or use --decoder-first/last-pipeline-num-layers): "
            f"choose e.g. {', '.join(ok)}")


def layers_per_chunk(num_layers: int, layout: ParallelLayout) -> int:
    """Transformer layers in each model chunk of an even pipeline (megatron-core's split over PP x VPP)."""
    check_pipeline(num_layers, layout)
    if not layout.even_pipeline:
        raise LayoutError(f"{layout.describe()}: chunks hold different numbers of layers; use chunk_layers")
    return num_layers // (layout.pp * layout.num_chunks)


def virtual_chunks(num_layers: int, pp: int, layers_per_virtual_stage: Optional[int]) -> Optional[int]:
    """Model chunks per pipeline stage for Megatron-LM's --num-layers-per-virtual-pipeline-stage (None: not
    interleaved, also when each stage would have one chunk); LayoutError with the fix otherwise."""
    if layers_per_virtual_stage is None:
        return None
    if pp == 1:
        raise LayoutError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 "
                          "(Megatron-LM's interleaved schedule); drop it or raise PP")
    if num_layers % pp:
        raise LayoutError(f"num_layers={num_layers} is not divisible by PP={pp}; choose PP in "
                          f"{[d for d in range(1, num_layers + 1) if num_layers % d == 0]}")
    per_stage = num_layers // pp
    if layers_per_virtual_stage < 1 or per_stage % layers_per_virtual_stage:
        raise LayoutError(f"num_layers={num_layers} over PP={pp} gives {per_stage} layers per stage, which cannot be "
                          f"split into virtual stages of {layers_per_virtual_stage} layers; choose "
                          f"--num-layers-per-virtual-pipeline-stage in "
                          f"{[d for d in range(1, per_stage + 1) if per_stage % d == 0]}")
    chunks = per_stage // layers_per_virtual_stage
    return chunks if chunks > 1 else None


def chunk_layers(num_layers: int, layout: ParallelLayout, pp_rank: int, vpp_chunk: Optional[int] = None) -> range:
    """Global layers held by one model chunk, in local order (megatron-core's get_transformer_layer_offset
    and get_num_layers_to_build, even or uneven: layer_placement)."""
    chunk = layout.check_chunk(pp_rank, vpp_chunk)
    if layout.even_pipeline:
        per_chunk = layers_per_chunk(num_layers, layout)
        # Chunks are ordered chunk-major: VPP chunk v of stage p is block v * PP + p.
        offset = (chunk * layout.pp + pp_rank) * per_chunk
        return range(offset, offset + per_chunk)
    check_pipeline(num_layers, layout)
    return chunk_placement(_split(num_layers, layout), pp_rank, chunk).layers


def layer_offset(num_layers: int, layout: ParallelLayout, pp_rank: int, vpp_chunk: Optional[int] = None) -> int:
    """Global index of the chunk's local layer 0 (megatron-core's get_transformer_layer_offset)."""
    return chunk_layers(num_layers, layout, pp_rank, vpp_chunk).start


def layer_location(global_layer: int, num_layers: int, layout: ParallelLayout) -> Tuple[int, int, int]:
    """(pp_rank, vpp_chunk, local_layer) holding `global_layer`."""
    if not 0 <= global_layer < num_layers:
        raise UnknownParameterError(f"layer {global_layer} does not exist: the model has num_layers={num_layers}")
    if layout.even_pipeline:
        per_chunk = layers_per_chunk(num_layers, layout)
        block, local = divmod(global_layer, per_chunk)
        vpp_chunk, pp_rank = divmod(block, layout.pp)
        return pp_rank, vpp_chunk, local
    check_pipeline(num_layers, layout)
    return split_layer_location(_split(num_layers, layout), global_layer)


def experts_per_ep_rank(config: GPTModelConfig, ep: int) -> int:
    """Routed experts each of `ep` EP ranks holds (0 for a dense model); LayoutError unless EP divides them."""
    if not config.num_experts:
        return 0
    if config.num_experts % ep:
        ok = [d for d in range(1, config.num_experts + 1) if config.num_experts % d == 0]
        raise LayoutError(f"num_experts={config.num_experts} is not divisible by EP={ep} (Megatron-LM refuses "
                          f"it too); choose --expert-model-parallel-size in {ok}")
    return config.num_experts // ep


def experts_per_rank(config: GPTModelConfig, layout: ParallelLayout) -> int:
    """Routed experts each EP rank of `layout` holds (0 for a dense model); LayoutError unless EP divides them."""
    return experts_per_ep_rank(config, layout.ep)


def expert_location(expert: int, config: GPTModelConfig, layout: ParallelLayout) -> Tuple[int, int]:
    """(EP rank, local expert index) holding global expert `expert`."""
    per = experts_per_rank(config, layout)
    if not 0 <= expert < (config.num_experts or 0):
        raise UnknownParameterError(f"expert {expert} does not exist: the model has num_experts={config.num_experts}")
    return divmod(expert, per)


# --------------------------------------------------------------------------------------------------
# Canonical names <-> where the model keeps them


def _layer_is_moe(config: GPTModelConfig, n: _Name) -> bool:
    """Whether the layer a name lives in is an MoE layer: its decoder layer, or for an MTP layer the decoder's
    last layer, whose spec megatron-core's MTP block reuses (get_gpt_mtp_block_spec)."""
    return config.moe_layers[-1 if n.mtp is not None else n.layer]


def _check_layer_kind(n: _Name, config: Optional[GPTModelConfig], name: str) -> None:
    if config is None or n.rule.kind == ANY:
        return
    moe = _layer_is_moe(config, n)
    if moe != (n.rule.kind == MOE):
        which = f"MTP layer {n.mtp} (built like the last decoder layer)" if n.mtp is not None else \
            f"global layer {n.layer}"
        raise LayoutError(f"{name!r} belongs to {'a dense' if n.rule.kind == DENSE else 'an MoE'} layer but {which} is "
                          f"{'MoE' if moe else 'dense'} (moe_layer_freq={config.moe_layer_freq}); the checkpoint and "
                          f"its args disagree")


def _global_expert(n: _Name, name: str, config: Optional[GPTModelConfig], layout: ParallelLayout,
                   ep_rank: int) -> Optional[int]:
    if n.expert is None:
        return None
    if config is None:
        raise ValueError(f"{name!r} is a routed expert: pass the model config to name it")
    per = experts_per_rank(config, layout)
    if n.expert >= per:
        raise LayoutError(f"{name!r} on EP rank {ep_rank}: local expert {n.expert} but each EP rank holds "
                          f"{per} of num_experts={config.num_experts}; the checkpoint has another EP")
    return n.expert + ep_rank * per


def _mtp_copy_of_embedding(config: Optional[GPTModelConfig], layout: ParallelLayout) -> bool:
    """Whether the last chunk keeps its own copy of the word embeddings for multi-token prediction (MTP layers
    embed the shifted tokens; megatron-core all-reduces the copy's gradients with the first stage's)."""
    return config is not None and _mtp(config) and layout.last_chunk != (0, 0)


def canonical_name(local_name: str, layout: ParallelLayout, pp_rank: int, vpp_chunk: Optional[int],
                   num_layers: int, *, tied: bool = False, config: Optional[GPTModelConfig] = None,
                   ep_rank: int = 0) -> Optional[str]:
    """Canonical name of a model chunk's parameter (local-spec or TE-spec name, stage-local layer index,
    local expert index on EP rank `ep_rank`).

    Returns None only for `is_ignorable` entries; unknown names raise UnknownParameterError and names
    that cannot live on this chunk raise LayoutError. With `tied`, the last chunk's
    `output_layer.weight` is the copy of `embedding.word_embeddings.weight`; with multi-token prediction so is
    the last chunk's own `embedding.word_embeddings.weight`. Routed experts and MTP layers need `config`."""
    if is_ignorable(local_name):
        return None
    chunk = layout.check_chunk(pp_rank, vpp_chunk)
    where = f"pp_rank={pp_rank} vpp_chunk={chunk} of {layout.describe()}"
    n = _resolve(local_name)
    if n.layer is not None:
        layers = chunk_layers(num_layers, layout, pp_rank, chunk)
        if n.layer >= len(layers):
            raise LayoutError(f"{local_name!r} on {where}: local layer {n.layer} but this chunk holds "
                              f"{len(layers)} of num_layers={num_layers}; the checkpoint has another layout")
        global_layer = layers[n.layer]
        n = _Name(n.rule, layer=global_layer, expert=n.expert)
        _check_layer_kind(n, config, local_name)
        return _spell(n.rule, n.rule.name, global_layer, _global_expert(n, local_name, config, layout, ep_rank))
    if n.mtp is not None:
        if config is None or not n.mtp < (config.mtp_num_layers or 0):
            raise LayoutError(f"{local_name!r}: MTP layer {n.mtp} but the model has mtp_num_layers="
                              f"{config and config.mtp_num_layers}; the checkpoint and its args disagree")
        if not layout.is_last_chunk(pp_rank, chunk):
            raise LayoutError(f"{local_name!r} found on {where}, but megatron-core builds the MTP layers on the last "
                              "chunk only; the checkpoint has another pipeline layout")
        _check_layer_kind(n, config, local_name)
        return _spell(n.rule, n.rule.name, expert=_global_expert(n, local_name, config, layout, ep_rank), mtp=n.mtp)
    if (n.rule.name == WORD_EMBEDDINGS and _mtp_copy_of_embedding(config, layout)
            and layout.is_last_chunk(pp_rank, chunk)):
        return WORD_EMBEDDINGS
    if n.rule.scope == PRE and not layout.is_first_chunk(pp_rank, chunk):
        raise LayoutError(f"{local_name!r} found on {where}, but only pp_rank=0 vpp_chunk=0 holds the "
                          "embedding; the checkpoint has another pipeline layout")
    if n.rule.scope == POST and not layout.is_last_chunk(pp_rank, chunk):
        raise LayoutError(f"{local_name!r} found on {where}, but only the last chunk holds it; "
                          "the checkpoint has another pipeline layout")
    if n.rule.name == OUTPUT_LAYER and tied:
        return WORD_EMBEDDINGS
    return n.rule.name


def local_name(canonical: str, layout: ParallelLayout, num_layers: int, *, tied: bool = False,
               config: Optional[GPTModelConfig] = None) -> List[Tuple[int, int, str]]:
    """Where a canonical parameter lives: [(pp_rank, vpp_chunk, local-spec name)] (vpp_chunk is 0
    without VPP). A tied word embedding has two places when the first and last chunks differ, and so has the
    word embedding of a model with multi-token prediction. A routed expert's local name has its local index (its
    EP rank: `expert_location`; needs `config`)."""
    n = _resolve(canonical)
    expert = n.expert
    if expert is not None:
        if config is None:
            raise ValueError(f"{canonical!r} is a routed expert: pass the model config to place it")
        expert = expert_location(expert, config, layout)[1]
    if n.layer is not None:
        pp_rank, chunk, local = layer_location(n.layer, num_layers, layout)
        return [(pp_rank, chunk, _spell(n.rule, n.rule.name, local, expert))]
    check_pipeline(num_layers, layout)
    if n.mtp is not None:
        return [(*layout.last_chunk, _spell(n.rule, n.rule.name, expert=expert, mtp=n.mtp))]
    if n.rule.scope == PRE:
        places = [(0, 0, n.rule.name)]
        if n.rule.name == WORD_EMBEDDINGS and _mtp_copy_of_embedding(config, layout):
            places.append((*layout.last_chunk, WORD_EMBEDDINGS))
        elif n.rule.name == WORD_EMBEDDINGS and tied and layout.last_chunk != (0, 0):
            places.append((*layout.last_chunk, OUTPUT_LAYER))
        return places
    if n.rule.name == OUTPUT_LAYER and tied:
        raise UnknownParameterError(f"{OUTPUT_LAYER!r} is not canonical in a tied model; its canonical "
                                    f"tensor is {WORD_EMBEDDINGS!r}")
    return [(*layout.last_chunk, n.rule.name)]


def torch_dist_stacked(config: GPTModelConfig) -> bool:
    """Whether torch_dist stacks each layer parameter over all layers (TransformerBlock's homogeneous
    layers); with --moe-layer-freq as a list or an int > 1 every layer is saved under its own key."""
    freq = config.moe_layer_freq
    return not (config.num_experts and (isinstance(freq, tuple) or freq > 1))


def torch_dist_keys(canonical: str, config: Optional[GPTModelConfig] = None) -> List[Tuple[str, Tuple[int, ...]]]:
    """Where torch_dist saves a canonical parameter: [(key, indices on its leading axes)], the key megatron-core's
    spec of the model (config.transformer_impl, MLA, the layer's kind) writes first, then other spellings a reader
    should accept (the other spec's, the local name). Leading axes: the global layer when decoder layers are
    stacked, then the global expert for routed experts. An MTP layer is never stacked: its transformer layer is
    saved under mtp.layers.<k>.transformer_layer. in every release."""
    n = _resolve(canonical)
    rule = n.rule
    if n.layer is None and n.mtp is None:
        return [(rule.name, ())]
    experts = () if n.expert is None else (n.expert,)
    first = rule.dist_for(config, config is not None and _layer_is_moe(config, n))
    others = [rule.dist] + ([rule.name] if not rule.expert else []) + list(rule.aliases)
    spellings = [first] + [s for i, s in enumerate(others) if s != first and s not in others[:i]]
    if n.mtp is not None:
        return [(_spell(rule, s, mtp=n.mtp, inner=MTP_INNER_SAVED), experts) for s in spellings]
    if config is None or torch_dist_stacked(config):
        return [(LAYER_PREFIX + s, (n.layer,) + experts) for s in spellings]
    return [(f"{LAYER_PREFIX}{n.layer}.{s}", experts) for s in spellings]


def torch_dist_lead_shape(canonical: str, config: GPTModelConfig) -> Tuple[int, ...]:
    """Sizes of the leading axes torch_dist puts before a canonical parameter's own (torch_dist_keys' indices):
    the layer axis of stacked decoder layers, then the expert axis of routed experts."""
    n = _resolve(canonical)
    layers = (config.num_layers,) if n.layer is not None and torch_dist_stacked(config) else ()
    return layers + ((config.num_experts,) if n.expert is not None else ())


def torch_dist_key(canonical: str, config: Optional[GPTModelConfig] = None) -> Tuple[str, Tuple[int, ...]]:
    """The torch_dist key megatron-core writes for a canonical parameter, and its leading-axis indices."""
    return torch_dist_keys(canonical, config)[0]


# --------------------------------------------------------------------------------------------------
# Shapes, order and patterns


def _check_supported(config: GPTModelConfig) -> None:
    if config.normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization={config.normalization!r} is not supported; use LayerNorm or RMSNorm")
    if config.position_embedding_type not in ("learned_absolute", "rope", "none"):
        raise ValueError(f"position_embedding_type={config.position_embedding_type!r} is not supported")
    if config.mla_down_proj_fusion:
        # one parameter (and one Adam state) for two canonical ones; megatron-core splits it only for torch_dist's
        # model keys, not for its optimizer buffers or legacy files
        raise ValueError("--mla-down-proj-fusion (TransformerEngine's fused MLA q/kv down projection) is not "
                         "supported: its one fused parameter and optimizer state per layer have no universal form "
                         "here; train without it (the unfused model's checkpoints convert at any layout)")
    if config.mtp_num_layers and config.position_embedding_type == "learned_absolute":
        # megatron-core builds a second position-embedding table on the MTP stage and never synchronises it with
        # the first stage's: one model at PP1, two at PP > 1; no layout-independent form exists
        raise ValueError("multi-token prediction with learned absolute position embeddings is not supported "
                         "(megatron-core keeps an unsynchronised second table on the MTP stage at PP > 1); "
                         "use --position-embedding-type rope or none")
    config.moe_layers  # a bad moe_layer_freq raises here with its fix


@functools.lru_cache(maxsize=64)
def _rows(config: GPTModelConfig) -> Tuple[ParamRule, ...]:
    _check_supported(config)
    return tuple(r for r in RULES if r.present(config))


def _layer_entries(config: GPTModelConfig, moe: bool, experts: Sequence[int]) -> List[Tuple[ParamRule, Optional[int]]]:
    """(row, expert index) of one transformer layer (an MoE layer if `moe`) in registration order: routed experts
    one after the other, each with all its rows (SequentialMLP's local_experts), for the expert indices given."""
    rows = [r for r in _rows(config) if r.scope == LAYER and (r.kind == ANY or (r.kind == MOE) == moe)]
    out: List[Tuple[ParamRule, Optional[int]]] = []
    i = 0
    while i < len(rows):
        if not rows[i].expert:
            out.append((rows[i], None))
            i += 1
            continue
        run = []
        while i < len(rows) and rows[i].expert:
            run.append(rows[i])
            i += 1
        out += [(r, e) for e in experts for r in run]
    return out


def _mtp_entries(config: GPTModelConfig, experts: Sequence[int]) -> List[Tuple[ParamRule, Optional[int], int]]:
    """(row, expert index, MTP layer) of the multi-token prediction layers in registration order: each layer's
    MTP_PRE rows, its transformer layer (built like the decoder's last layer), its MTP_POST rows."""
    rows = _rows(config)
    inner = _layer_entries(config, config.moe_layers[-1], experts)
    out: List[Tuple[ParamRule, Optional[int], int]] = []
    for k in range(config.mtp_num_layers or 0):
        out += [(r, None, k) for r in rows if r.scope == MTP_PRE]
        out += [(r, e, k) for r, e in inner]
        out += [(r, None, k) for r in rows if r.scope == MTP_POST]
    return out


def _post_rows(rows: Sequence[ParamRule]) -> Tuple[List[ParamRule], List[ParamRule]]:
    """The last chunk's rows around the MTP layers: the decoder's (its final norm), then the output layer."""
    post = [r for r in rows if r.scope == POST]
    return [r for r in post if r.name != OUTPUT_LAYER], [r for r in post if r.name == OUTPUT_LAYER]


@functools.lru_cache(maxsize=32)
def _expected(config: GPTModelConfig) -> Tuple[Tuple[str, Shape], ...]:
    rows = _rows(config)
    params: List[Tuple[str, Shape]] = [(r.name, r.shape(config)) for r in rows if r.scope == PRE]
    experts = range(config.num_experts or 0)
    moe_layers = config.moe_layers
    for index in range(config.num_layers):
        params += [(_spell(r, r.name, index, e), r.shape(config))
                   for r, e in _layer_entries(config, moe_layers[index], experts)]
    decoder_post, head = _post_rows(rows)
    params += [(r.name, r.shape(config)) for r in decoder_post]
    params += [(_spell(r, r.name, expert=e, mtp=k), r.shape(config)) for r, e, k in _mtp_entries(config, experts)]
    params += [(r.name, r.shape(config)) for r in head]
    return tuple(params)


@functools.lru_cache(maxsize=32)
def _expected_shapes(config: GPTModelConfig) -> Dict[str, Shape]:
    return dict(_expected(config))


def pattern_for(canonical: str, config: GPTModelConfig) -> Pattern:
    """The parallel pattern of a canonical parameter (also accepts a tied model's `output_layer.weight`).
    Names that match no row, or that this config does not have, raise UnknownParameterError. Routed
    experts' patterns split over ETP (tp_size_of), the others over TP."""
    rule = rule_for(canonical)
    if local_spelling(canonical) not in _expected_shapes(config) and not (
            rule.name == OUTPUT_LAYER and config.tied):
        raise _unknown(canonical, f": not a parameter of this model (num_layers={config.num_layers}, "
                                  f"normalization={config.normalization}, add_bias_linear={config.add_bias_linear}, "
                                  f"position_embedding_type={config.position_embedding_type}, "
                                  f"num_experts={config.num_experts}, moe_layer_freq={config.moe_layer_freq})")
    return rule.pattern(config)


def expected_parameters(config: GPTModelConfig, layout: Optional[ParallelLayout] = None
                        ) -> List[Tuple[str, Shape]]:
    """Every canonical parameter (and persistent buffer) with its global shape, in a TP1PP1EP1 model's
    registration order. With a layout, also check that the layout can hold the model (LayoutError with
    cause and fix)."""
    params = list(_expected(config))
    if layout is not None:
        check_pipeline(config.num_layers, layout)
        if config.mtp_num_layers and config.tied and layout.last_chunk != (0, 0):
            raise LayoutError(
                f"{layout.describe()}: multi-token prediction with tied embeddings at PP > 1 is not supported: "
                "megatron-core 0.19 gives the MTP stage an output weight of its own that nothing trains, and cannot "
                "save it in torch_dist; train tied MTP models at PP=1, or untie the embeddings")
        experts_per_rank(config, layout)
        for name, shape in params:
            pattern_for(name, config).validate(shape, tp_size_of(name, layout), name=name)
    return params


def parameters_for_rank(config: GPTModelConfig, layout: ParallelLayout, pp_rank: int,
                        vpp_chunk: Optional[int] = None, *, ep_rank: int = 0, buffers: bool = False
                        ) -> List[Tuple[str, Shape, str]]:
    """(local name, TP-local shape, canonical name) of one model chunk on EP rank `ep_rank`, in
    megatron-core's module.parameters() order; layer indices in local names are stage-local (0-based per
    chunk), expert indices local to the EP rank. Persistent buffers only with `buffers`."""
    chunk = layout.check_chunk(pp_rank, vpp_chunk)
    shapes = _expected_shapes(config)
    expected_parameters(config, layout)
    per = experts_per_rank(config, layout)
    if per and not 0 <= ep_rank < layout.ep:
        raise LayoutError(f"ep_rank={ep_rank} is not a rank of EP={layout.ep}")
    first, last = layout.is_first_chunk(pp_rank, chunk), layout.is_last_chunk(pp_rank, chunk)
    rows = [r for r in _rows(config) if buffers or not r.buffer]

    def entry(local: str, canonical: str) -> Tuple[str, Shape, str]:
        tp = tp_size_of(canonical, layout)
        return local, pattern_for(canonical, config).local_shape(shapes[canonical], tp), canonical

    out = []
    if first:
        out += [entry(r.name, r.name) for r in rows if r.scope == PRE]
    elif last and _mtp_copy_of_embedding(config, layout):  # built first, before the decoder
        out.append(entry(WORD_EMBEDDINGS, WORD_EMBEDDINGS))
    moe_layers = config.moe_layers
    for local_layer, global_layer in enumerate(chunk_layers(config.num_layers, layout, pp_rank, chunk)):
        for r, j in _layer_entries(config, moe_layers[global_layer], range(per)):
            if r.buffer and not buffers:
                continue
            e = None if j is None else ep_rank * per + j
            out.append(entry(_spell(r, r.name, local_layer, j), _spell(r, r.name, global_layer, e)))
    if last:
        decoder_post, head = _post_rows(rows)
        out += [entry(r.name, r.name) for r in decoder_post]
        for r, j, k in _mtp_entries(config, range(per)):
            if r.buffer and not buffers:
                continue
            e = None if j is None else ep_rank * per + j
            out.append(entry(_spell(r, r.name, expert=j, mtp=k), _spell(r, r.name, expert=e, mtp=k)))
        out += [entry(r.name, r.name) for r in head]
        # megatron-core allocates no output weight where it can share the embedding on the same chunk.
        if config.tied and not first:
            out.append(entry(OUTPUT_LAYER, WORD_EMBEDDINGS))
    return out


def check_tied_copies(word_embeddings, output_layer) -> None:
    """Raise PatternError unless the last chunk's output_layer copy equals the embedding bitwise."""
    check_copies_agree([word_embeddings, output_layer], name=WORD_EMBEDDINGS,
                       labels=["the first stage (embedding)", "the last stage (output_layer.weight)"])


# --------------------------------------------------------------------------------------------------
# Vocabulary rows


def is_vocab_parameter(canonical: str) -> bool:
    """Rows are the (padded) vocabulary: re-padded when the padded size changes."""
    return rule_for(canonical).name in (WORD_EMBEDDINGS, OUTPUT_LAYER)


def megatron_padded_vocab(config: GPTModelConfig, tp: int) -> int:
    """The padded vocabulary Megatron-LM computes from its args at TP=`tp` (it never reads it from a
    checkpoint): ceil(vocab / (divisible_by * TP)) * divisible_by * TP."""
    return pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp)


def padded_vocab_at(config: GPTModelConfig, tp: int) -> int:
    """Padded vocabulary rows a resume at TP=`tp` uses: the stored size when TP divides it (no rows added
    or dropped, so the loss is unchanged), else Megatron-LM's rule."""
    if config.padded_vocab_size < config.vocab_size:
        raise PatternError(f"stored padded vocabulary {config.padded_vocab_size} is smaller than the true "
                           f"vocabulary {config.vocab_size}; the checkpoint's vocab_size is wrong")
    if config.padded_vocab_size % tp == 0:
        return config.padded_vocab_size
    return megatron_padded_vocab(config, tp)


# --------------------------------------------------------------------------------------------------
# Optimizer param groups (megatron/core/optimizer/__init__.py _get_param_groups with the standard
# overrides of get_standard_config_overrides, as megatron/training/training.py uses them)


def emerging_matrix(local: str, shape: Sequence[int]) -> bool:
    """Whether an emerging optimizer (Lion, Muon) steps this parameter itself: megatron-core 0.19 gives its scalar
    optimizer every parameter that is not 2-D and the embedding and output weights (is_embedding_or_output_parameter:
    language_module.py; `_is_nonlinear_or_embedding` in optimizer/emerging_optimizers.py)."""
    return len(shape) == 2 and not rule_for(local).decoupled_lr


def parameter_optimizer(local: str, shape: Sequence[int], args: Mapping[str, Any]) -> str:
    """The core/optimizers.py row megatron-core 0.19 gives one parameter of a run with these args."""
    return optimizers.parameter_optimizer(args.get("optimizer") or "adam", args, matrix=emerging_matrix(local, shape))


def group_override(local: str, shape: Sequence[int], args: Mapping[str, Any], *, first_chunk: bool,
                   last_chunk: bool) -> Optional[tuple]:
    """The merged override Megatron's grouping keys a parameter by (None: no override): no weight decay
    for biases and 1-D parameters (except q/k layernorms with --apply-wd-to-qk-layernorm), the decoupled
    LR for the embedding (first chunk) and the output weight (last chunk), and under an emerging optimizer the
    scalar optimizer of its non-matrix parameters ('optimizer': megatron-core 0.19's default override)."""
    rule = rule_for(local)
    override: dict = {}
    run = args.get("optimizer") or "adam"
    if optimizers.scalar_optimizer(run, args) is not None and not emerging_matrix(local, shape):
        override["optimizer"] = optimizers.scalar_optimizer(run, args)
    if args.get("apply_wd_to_qk_layernorm"):
        no_wd = (len(shape) == 1 or local.endswith(".bias")) and not (
            "q_layernorm." in local or "k_layernorm." in local)
    else:
        no_wd = fnmatch.fnmatch(local, "*.bias") or len(shape) == 1
    if no_wd:
        override["wd_mult"] = 0.0
    # megatron-core marks the first chunk's embedding, the MTP stage's copy of it and the last chunk's output layer
    embedding_or_output = rule.decoupled_lr and (
        (first_chunk or (last_chunk and bool(args.get("mtp_num_layers")))) if rule.scope == PRE else last_chunk)
    if args.get("decoupled_lr") is not None and embedding_or_output:
        override["max_lr"] = args["decoupled_lr"]
        if args.get("decoupled_min_lr") is not None:
            override["min_lr"] = args["decoupled_min_lr"]
    return tuple(sorted(override.items())) if override else None


def _group_order(keys) -> list:
    """megatron-core's order of param groups: sorted, no override first; under an emerging optimizer its
    ChainedOptimizer lists each optimizer's groups together, optimizers in the order their first group comes."""
    ordered = sorted(keys, key=lambda k: (k is not None, k or ()))
    kinds = [dict(k or ()).get("optimizer") for k in ordered]
    first = {kind: kinds.index(kind) for kind in kinds}
    return sorted(ordered, key=lambda k: first[dict(k or ()).get("optimizer")])


def experts_in_own_optimizer(config: GPTModelConfig, layout: ParallelLayout) -> bool:
    """Whether routed experts live in their own DDP buffers (reduced over the expert-DP group) and their own
    optimizer, megatron-core's ChainedOptimizer [dense, expert]: with experts at EP > 1, or at ETP != TP
    (megatron-core 0.16.1 marked them only at EP > 1, reducing their gradients over the wrong group at
    ETP != TP; 0.19 marks them at either: tensor_parallel/layers.py, `use_expert_pgs`)."""
    return bool(config.num_experts) and (layout.ep > 1 or layout.expert_tp != layout.tp)


def in_expert_optimizer(name: str, config: GPTModelConfig, layout: ParallelLayout) -> bool:
    """Whether a parameter lives in the expert DDP buffers and the expert optimizer at `layout` (a routed
    expert's parameter when `experts_in_own_optimizer`), rather than in the dense ones."""
    return experts_in_own_optimizer(config, layout) and is_expert(name)


def megatron_param_groups(rank_chunks: Mapping[tuple, Sequence[Sequence[Any]]], args: Mapping[str, Any], *,
                          experts: bool = False) -> Dict[tuple, List[List[Tuple[int, str]]]]:
    """Per rank: one optimizer's param groups as lists of (vpp chunk, local name).

    `rank_chunks[rank]` (rank = (tp, pp) or any key whose last item is the pp rank) lists each model chunk's
    parameters (objects with .name, .shape and .expert: whether it is in the expert optimizer) in
    registration order. `experts` selects the expert optimizer's parameters instead of the dense one's.
    Groups are keyed by the merged override; keys are unioned over all ranks so every rank has the same
    groups (some empty), sorted with the no-override group first."""
    pp = args.get("pipeline_model_parallel_size") or 1
    per_rank: Dict[tuple, dict] = {}
    all_keys: list = []
    for rank, chunks in rank_chunks.items():
        pp_rank = rank[-1]
        groups: dict = {}
        for chunk, params in enumerate(chunks):
            first, last = pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == len(chunks) - 1
            for p in params:
                if bool(getattr(p, "expert", False)) != experts:
                    continue
                key = group_override(p.name, p.shape, args, first_chunk=first, last_chunk=last)
                groups.setdefault(key, []).append((chunk, p.name))
                if key not in all_keys:
                    all_keys.append(key)
        per_rank[rank] = groups
    ordered = _group_order(all_keys)
    return {rank: [groups.get(k, []) for k in ordered] for rank, groups in per_rank.items()}


def group_identity(override: Optional[tuple], *, expert: bool = False) -> dict:
    """What identifies a group in the universal metadata (megatron-core's ParamKey fields) for an override."""
    rule = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": expert, "is_decoupled_lr": False}
    rule.update({k: v for k, v in (override or ()) if k in rule or k == "optimizer"})
    if override and any(k in ("max_lr", "min_lr") for k, _ in override):
        rule["is_decoupled_lr"] = True
    return rule


def group_overrides(rank_chunks: Mapping[tuple, Sequence[Sequence[Any]]], args: Mapping[str, Any], *,
                    experts: bool = False) -> list:
    """The sorted override keys megatron_param_groups orders its groups by (one per group)."""
    pp = args.get("pipeline_model_parallel_size") or 1
    found = set()
    for rank, chunks in rank_chunks.items():
        pp_rank = rank[-1]
        for chunk, params in enumerate(chunks):
            first, last = pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == len(chunks) - 1
            for p in params:
                if bool(getattr(p, "expert", False)) == experts:
                    found.add(group_override(p.name, p.shape, args, first_chunk=first, last_chunk=last))
    return _group_order(found)
