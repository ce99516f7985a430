"""The one table between Hugging Face and Megatron parameter names, used both ways (`export-hf`, `import-hf`).

`FAMILIES` holds one `HFFamily` per transformers model type (llama, mistral, qwen2, qwen3, gpt2, mixtral,
qwen2_moe, qwen3_moe, deepseek_v3, kimi_k2 (DeepSeek-V3's layout); deepseek_v2, glm4_moe and olmoe as refusals with
their reasons): its tensors as rows of templates (`Row`: a Megatron canonical parameter, `{i}` the global layer, `{j}` the
routed expert and `{k}` the multi-token prediction layer, the HF tensors it is made of, how (`Join`), when the row
exists for a model config, and for which value of an HF tensor convention), and the facts of its config.json that
decide the Megatron model (`HFConfigFacts`: which biases, QK norm, MoE keys, sliding-window keys, multi-latent
attention, MTP layers, transformers' defaults). DeepSeek's MTP layer k is HF layer num_hidden_layers + k (as
Megatron-Bridge maps it): a decoder layer's rows for its transformer layer (Megatron's
mtp.layers.<k>.mtp_model_layer), enorm, hnorm, eh_proj, shared_head.norm (its final_layernorm) and the copies of the
embedding and output layer DeepSeek stores there (`duplicate` rows). A new family is a new entry of rows and facts;
`hf_rows(config, model_type, conventions)` expands a family for a model.

Conventions are HF config keys that choose how the same function is stored, not what it computes (DeepSeek-V3's
rope_interleave: its RoPE rows in interleaved pairs, as megatron-core's multi-latent attention reads them, or as
[first half; second half], which megatron-core reads after a row permutation): import-hf takes config.json's value,
export-hf writes the family's default.

Joins: the same tensor, transposed (GPT-2's Conv1D stores [in, out]), QKV grouped per query group from
q/k/v_proj (GroupedQKV.merge_qkv, the inverse of split_qkv) or from GPT-2's c_attn, SwiGLU `[gate; up]`
concatenated, routed experts by their global index, the vocabulary padded (rows beyond the true vocabulary exist
only on Megatron's side), rows reordered by a permutation (RoPE rows of the other convention), and HF tensors
Megatron does not have, which must be zero (HF's o_proj bias when only QKV has a bias, DeepSeek's correction bias
of a router without an expert bias). `to_hf` and `from_hf` apply a row in each direction and are exact inverses on
the true vocabulary (`from_hf_bands` is `from_hf` a band of rows at a time, for bounded memory); nothing else in
the project spells an HF name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

from megatron_ucp.adapters.gpt import MTP_INNER
from megatron_ucp.adapters.gpt import MTP_PREFIX as MTP
from megatron_ucp.core.model_config import GPTModelConfig

if TYPE_CHECKING:
    import torch

# How a row's HF parts make the Megatron tensor.
SAME = "same"  # one HF tensor, equal
TRANSPOSED = "transposed"  # one HF tensor, Megatron's is its transpose (GPT-2 Conv1D)
QKV = "qkv"  # q, k, v -> Megatron's per-query-group fused QKV
QKV_CONV1D = "qkv_conv1d"  # GPT-2 c_attn ([in, 3h] weight or [3h] bias, [q; k; v]) -> grouped QKV
CONCAT = "concat"  # parts concatenated on dim 0 (SwiGLU [gate; up])
VOCAB = "vocab"  # one HF tensor of the true vocabulary's rows; Megatron's has padding rows after them
ZERO = "zero"  # an HF tensor Megatron does not have: zero (no Megatron parameter)
PERMUTED = "permuted"  # one HF tensor, its rows reordered: Megatron's row r is the HF tensor's row permutation[r]

Predicate = Callable[[GPTModelConfig], bool]

# transformers' llama3 RoPE (rope_type "llama3") as megatron-core 0.19 computes it with --use-rope-scaling: any
# factor (--rope-scaling-factor, which this project's entry point passes to GPTModel; Megatron-LM 0.19's own GPT
# builder does not, so its models get GPTModel's default, MEGATRON_DEFAULT_LLAMA3_FACTOR), and the other three keys
# fixed at RotaryEmbedding._apply_scaling's defaults (RotaryEmbedding passes it the factor only)
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MEGATRON_DEFAULT_LLAMA3_FACTOR = 8.0
# transformers' YaRN keys that megatron-core 0.19's multi-latent attention fixes: MLATransformerConfig's defaults,
# which Megatron-LM's arguments never set for MLA (its --yarn-* flags only reach GPTModel's non-MLA YaRN), and the
# correction range rounded to integers (transformers' truncate=true)
MEGATRON_MLA_YARN = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": True}
# the epsilon of transformers' DeepseekV3 q_a_layernorm and kv_a_layernorm (DeepseekV3RMSNorm's default: they are
# built without rms_norm_eps); megatron-core's q/kv layernorms use --norm-epsilon like every other norm
DEEPSEEK_LATENT_NORM_EPS = 1e-6
# Why DeepSeek's multi-latent attention without query compression (q_lora_rank null: DeepSeek-V2-Lite) is not a
# megatron-core 0.19 model: its kv_a_layernorm is megatron-core's kv_layernorm, built only with --qk-layernorm, and
# 0.19's MLA norm resolver (mla_qk_norm_config.QKNormConfigResolver, also on Megatron-LM main) then demands a norm
# fused into linear_q_proj (the local spec refuses; TransformerEngine's normalizes q_proj's input, a norm DeepSeek's
# q_proj does not have). megatron-core <= 0.18 built the kv norm alone.
MLA_WITHOUT_Q_LORA = (
    "megatron-core 0.19 builds DeepSeek's kv_a_layernorm only with --qk-layernorm, and its MLA norm resolver then "
    "requires a norm fused into linear_q_proj (the local spec refuses to build; TransformerEngine's normalizes "
    "q_proj's input, a norm this model does not have); megatron-core 0.18 and earlier built the kv norm alone")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1), as transformers (yarn_get_mscale) and megatron-core
    (_yarn_get_mscale) compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class HFRow:
    """One Megatron parameter (None for ZERO) and the HF tensors it is made of, in order (ZERO rows: the HF
    tensor's shape)."""

    megatron: Optional[str]
    hf: tuple[str, ...]
    join: str
    zero_shape: Optional[tuple[int, ...]] = None
    permutation: Optional[tuple[int, ...]] = None  # PERMUTED rows: Megatron's row r is HF's row permutation[r]
    keep_fp32: bool = False  # transformers keeps the tensor in fp32 whatever the model's dtype
    # an HF copy of a parameter another row maps (DeepSeek's MTP layers store the embedding and output layer again):
    # export writes it, import checks it equals that row's HF tensor bit for bit (it may be absent)
    duplicate: bool = False


def _always(config: GPTModelConfig) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    """A family's row: templates of the Megatron parameter and its HF tensors (`{i}`: global layer, `{j}`: routed
    expert), the join, when the row exists (for a model config, and for a value of one of the family's HF
    conventions), for a ZERO row the shape of its HF tensor, for a PERMUTED row its permutation."""

    megatron: Optional[str]
    hf: tuple[str, ...]
    join: str = SAME
    when: Predicate = _always
    zero_shape: Optional[Callable[[GPTModelConfig], tuple[int, ...]]] = None
    convention: Optional[tuple[str, Any]] = None  # (HF config key, value): the row exists only for that value
    permutation: Optional[Callable[[GPTModelConfig], tuple[int, ...]]] = None
    keep_fp32: bool = False
    duplicate: bool = False

    def expand(self, config: GPTModelConfig, megatron_layer: Optional[str] = None, **index: int) -> HFRow:
        """The row of layer `i`, expert `j`, MTP layer `k`; `megatron_layer`: the Megatron prefix that replaces
        the decoder layer's (an MTP layer's transformer layer)."""
        megatron = self.megatron
        if megatron and megatron_layer is not None and megatron.startswith(L):
            megatron = megatron_layer + megatron[len(L):]
        return HFRow(megatron.format(**index) if megatron else None,
                     tuple(n.format(**index) for n in self.hf), self.join,
                     self.zero_shape(config) if self.zero_shape else None,
                     self.permutation(config) if self.permutation else None, self.keep_fp32, self.duplicate)


@dataclass(frozen=True)
class MoEKeys:
    """Where a MoE family's config.json keeps its experts."""

    num_experts: str  # key of the routed experts' count
    expert_ffn: str  # key of a routed expert's FFN size
    shared_ffn: Optional[str] = None  # key of the (gated) shared expert's FFN size; None: the family has none
    sparse_step: bool = False  # decoder_sparse_step / mlp_only_layers choose the MoE layers (else every layer)
    norm_topk: Optional[str] = None  # key of "renormalize the top-k weights" (None: always renormalized)
    shared_count: Optional[str] = None  # key of the count of ungated shared experts, each of expert_ffn (DeepSeek)
    first_dense: Optional[str] = None  # key of the count of leading dense layers, the rest MoE (DeepSeek)
    # DeepSeek-V3's router: sigmoid scores, top-k chosen with the correction bias (--moe-router-enable-expert-bias),
    # group-limited (n_group / topk_group), weights scaled by routed_scaling_factor; else softmax top-k
    sigmoid_router: bool = False


@dataclass(frozen=True)
class HFConfigFacts:
    """What a family's config.json says about the model beyond shapes, and transformers' defaults for the keys
    read (the config class's field defaults, used when config.json omits a key)."""

    num_layers: str = "num_hidden_layers"  # key of the layer count
    qkv_bias: str = "none"  # "none", "always", or the config key that adds q/k/v biases
    qkv_bias_with_o_proj: bool = False  # that key biases o_proj too (Llama's and Qwen3's attention_bias)
    mlp_bias: Optional[str] = None  # config key of MLP biases (Llama's mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k (q_norm / k_norm of head_dim): Megatron's --qk-layernorm
    sliding_window: bool = False  # attention reads sliding_window (Llama's ignores it)
    sliding_switch: Optional[str] = None  # key that turns sliding_window on (Qwen's use_sliding_window)
    moe: Optional[MoEKeys] = None
    # DeepSeek's multi-latent attention (q_lora_rank, kv_lora_rank, qk_nope/rope_head_dim, v_head_dim) and its key
    # of the MTP layers its checkpoints carry after the decoder's (transformers builds none and ignores them; they
    # map to Megatron's mtp.layers.<k>: the family's `mtp` rows and a decoder layer's rows)
    mla: bool = False
    mtp_layers: Optional[str] = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # other spellings (attribute_map)


@dataclass(frozen=True)
class HFFamily:
    """One transformers model type: its rows and config facts, or the reason it cannot be a Megatron GPT."""

    model_type: str
    architecture: str  # the CausalLM class export-hf names in config.json
    layer: str  # HF prefix of layer {i}
    attention: tuple[Row, ...] = ()
    dense_mlp: tuple[Row, ...] = ()
    model: tuple[Row, ...] = ()
    moe: tuple[Row, ...] = ()  # an MoE layer's rows besides its routed experts (router, shared expert)
    expert: tuple[Row, ...] = ()  # routed expert {j}'s rows
    expert_prefix: str = ""  # HF prefix of expert {j} of layer {i}
    facts: HFConfigFacts = HFConfigFacts()
    # a multi-token prediction layer's rows besides its transformer layer's (`{k}`: the MTP layer, `{i}` its HF
    # layer, the decoder's layer count + k); its transformer layer has a decoder layer's rows at HF layer {i}
    mtp: tuple[Row, ...] = ()
    unsupported: Optional[str] = None  # why Megatron's GPT cannot compute the family
    # HF config keys that choose how tensors are stored (not what the model computes), with the value export writes
    conventions: Mapping[str, Any] = field(default_factory=dict)


def _qkv_bias(c: GPTModelConfig) -> bool:
    return c.add_qkv_bias


def _no_qkv_bias(c: GPTModelConfig) -> bool:
    return not c.add_qkv_bias


def _bias(c: GPTModelConfig) -> bool:
    return c.add_bias_linear


def _no_bias(c: GPTModelConfig) -> bool:
    return not c.add_bias_linear


def _qkv_bias_only(c: GPTModelConfig) -> bool:
    return c.add_qkv_bias and not c.add_bias_linear


def _qk_norm(c: GPTModelConfig) -> bool:
    return c.qk_layernorm


def _untied(c: GPTModelConfig) -> bool:
    return not c.tied


def _hidden(c: GPTModelConfig) -> tuple[int, ...]:
    return (c.hidden_size,)


L = "decoder.layers.{i}."  # Megatron's layer
H = "model.layers.{i}."  # HF's layer (Llama-like)
A = H + "self_attn."
G = "transformer.h.{i}."  # GPT-2's layer
E = L + "mlp.experts.local_experts.{j}."  # Megatron's routed expert

LLAMA_ATTENTION = (
    Row(L + "input_layernorm.weight", (H + "input_layernorm.weight",)),
    Row(L + "self_attention.linear_qkv.weight", (A + "q_proj.weight", A + "k_proj.weight", A + "v_proj.weight"), QKV),
    Row(L + "self_attention.linear_proj.weight", (A + "o_proj.weight",)),
    Row(L + "self_attention.linear_qkv.bias", (A + "q_proj.bias", A + "k_proj.bias", A + "v_proj.bias"), QKV,
        _qkv_bias),
    Row(L + "self_attention.linear_proj.bias", (A + "o_proj.bias",), when=_bias),
    Row(L + "self_attention.q_layernorm.weight", (A + "q_norm.weight",), when=_qk_norm),
    Row(L + "self_attention.k_layernorm.weight", (A + "k_norm.weight",), when=_qk_norm),
    Row(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),
)
# HF's attention_bias (Llama, Qwen3) biases o_proj with q/k/v; Megatron's --add-qkv-bias does not: it must be zero
ATTENTION_BIAS_O_PROJ = (Row(None, (A + "o_proj.bias",), ZERO, _qkv_bias_only, _hidden),)
LLAMA_MLP = (
    Row(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), CONCAT),
    Row(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",)),
    Row(L + "mlp.linear_fc1.bias", (H + "mlp.gate_proj.bias", H + "mlp.up_proj.bias"), CONCAT, _bias),
    Row(L + "mlp.linear_fc2.bias", (H + "mlp.down_proj.bias",), when=_bias),
)
LLAMA_MODEL = (
    Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
    Row("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Row("output_layer.weight", ("lm_head.weight",), VOCAB, _untied),
)
QWEN_ROUTER = (Row(L + "mlp.router.weight", (H + "mlp.gate.weight",)),)
QWEN_EXPERT = (
    Row(E + "linear_fc1.weight", (H + "mlp.experts.{j}.gate_proj.weight", H + "mlp.experts.{j}.up_proj.weight"),
        CONCAT),
    Row(E + "linear_fc2.weight", (H + "mlp.experts.{j}.down_proj.weight",)),
)
QWEN2_SHARED_EXPERT = (
    Row(L + "mlp.shared_experts.linear_fc1.weight",
        (H + "mlp.shared_expert.gate_proj.weight", H + "mlp.shared_expert.up_proj.weight"), CONCAT),
    Row(L + "mlp.shared_experts.linear_fc2.weight", (H + "mlp.shared_expert.down_proj.weight",)),
    Row(L + "mlp.shared_experts.gate_weight", (H + "mlp.shared_expert_gate.weight",)),
)
MIXTRAL_ROUTER = (Row(L + "mlp.router.weight", (H + "block_sparse_moe.gate.weight",)),)
MIXTRAL_EXPERT = (
    Row(E + "linear_fc1.weight", (H + "block_sparse_moe.experts.{j}.w1.weight",
                                  H + "block_sparse_moe.experts.{j}.w3.weight"), CONCAT),
    Row(E + "linear_fc2.weight", (H + "block_sparse_moe.experts.{j}.w2.weight",)),
)
# GPT-2 has every bias; a Megatron model without them exports zeros
GPT2_ATTENTION = (
    Row(L + "input_layernorm.weight", (G + "ln_1.weight",)),
    Row(L + "input_layernorm.bias", (G + "ln_1.bias",)),
    Row(L + "self_attention.linear_qkv.weight", (G + "attn.c_attn.weight",), QKV_CONV1D),
    Row(L + "self_attention.linear_proj.weight", (G + "attn.c_proj.weight",), TRANSPOSED),
    Row(L + "self_attention.linear_qkv.bias", (G + "attn.c_attn.bias",), QKV_CONV1D, _qkv_bias),
    Row(None, (G + "attn.c_attn.bias",), ZERO, _no_qkv_bias, lambda c: (3 * c.hidden_size,)),
    Row(L + "self_attention.linear_proj.bias", (G + "attn.c_proj.bias",), when=_bias),
    Row(None, (G + "attn.c_proj.bias",), ZERO, _no_bias, _hidden),
    Row(L + "pre_mlp_layernorm.weight", (G + "ln_2.weight",)),
    Row(L + "pre_mlp_layernorm.bias", (G + "ln_2.bias",)),
)
GPT2_MLP = (
    Row(L + "mlp.linear_fc1.weight", (G + "mlp.c_fc.weight",), TRANSPOSED),
    Row(L + "mlp.linear_fc1.bias", (G + "mlp.c_fc.bias",), when=_bias),
    Row(None, (G + "mlp.c_fc.bias",), ZERO, _no_bias, lambda c: (c.ffn_hidden_size,)),
    Row(L + "mlp.linear_fc2.weight", (G + "mlp.c_proj.weight",), TRANSPOSED),
    Row(L + "mlp.linear_fc2.bias", (G + "mlp.c_proj.bias",), when=_bias),
    Row(None, (G + "mlp.c_proj.bias",), ZERO, _no_bias, _hidden),
)
GPT2_MODEL = (
    Row("embedding.word_embeddings.weight", ("transformer.wte.weight",), VOCAB),
    Row("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
    Row("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
    Row("decoder.final_layernorm.bias", ("transformer.ln_f.bias",)),
)


def _expert_bias(c: GPTModelConfig) -> bool:
    return c.moe_router_enable_expert_bias


def _no_expert_bias(c: GPTModelConfig) -> bool:
    return not c.moe_router_enable_expert_bias


def _halves_to_pairs(rope_dim: int) -> list[int]:
    """RoPE rows stored as [first half; second half] read as megatron-core's MLA reads them (pairs (x0, x1), (x2,
    x3), ... it splits into evens and odds before rotating halves): its row 2k is the first half's k, 2k + 1 the
    second half's k."""
    half = rope_dim // 2
    return [k // 2 + half * (k % 2) for k in range(rope_dim)]


def _q_rope_pairs(c: GPTModelConfig) -> tuple[int, ...]:
    """q_b_proj (per head: qk_nope rows, then RoPE rows) with each head's RoPE rows as pairs."""
    head, pairs = c.mla_q_head_dim, _halves_to_pairs(c.qk_pos_emb_head_dim)
    return tuple(h * head + r for h in range(c.num_attention_heads)
                 for r in [*range(c.qk_head_dim), *(c.qk_head_dim + p for p in pairs)])


def _kv_rope_pairs(c: GPTModelConfig) -> tuple[int, ...]:
    """kv_a_proj_with_mqa ([kv_lora rows; the shared key's RoPE rows]) with the RoPE rows as pairs."""
    return (*range(c.kv_lora_rank), *(c.kv_lora_rank + p for p in _halves_to_pairs(c.qk_pos_emb_head_dim)))


# DeepSeek-V3 (multi-latent attention): rope_interleave=true stores RoPE rows as megatron-core reads them
INTERLEAVED, HALVES = ("rope_interleave", True), ("rope_interleave", False)
MLA_ATTENTION = (
    Row(L + "input_layernorm.weight", (H + "input_layernorm.weight",)),
    Row(L + "self_attention.linear_proj.weight", (A + "o_proj.weight",)),
    Row(L + "self_attention.linear_q_down_proj.weight", (A + "q_a_proj.weight",)),
    Row(L + "self_attention.linear_q_up_proj.weight", (A + "q_b_proj.weight",), convention=INTERLEAVED),
    Row(L + "self_attention.linear_q_up_proj.weight", (A + "q_b_proj.weight",), PERMUTED, convention=HALVES,
        permutation=_q_rope_pairs),
    Row(L + "self_attention.linear_kv_down_proj.weight", (A + "kv_a_proj_with_mqa.weight",), convention=INTERLEAVED),
    Row(L + "self_attention.linear_kv_down_proj.weight", (A + "kv_a_proj_with_mqa.weight",), PERMUTED,
        convention=HALVES, permutation=_kv_rope_pairs),
    Row(L + "self_attention.linear_kv_up_proj.weight", (A + "kv_b_proj.weight",)),  # per head [k_nope; v] both
    Row(L + "self_attention.q_layernorm.weight", (A + "q_a_layernorm.weight",)),
    Row(L + "self_attention.kv_layernorm.weight", (A + "kv_a_layernorm.weight",)),
    Row(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),
)
DEEPSEEK_MOE = (
    Row(L + "mlp.router.weight", (H + "mlp.gate.weight",)),
    # the correction bias stays fp32 (megatron-core's expert_bias buffer and transformers' both)
    Row(L + "mlp.router.expert_bias", (H + "mlp.gate.e_score_correction_bias",), when=_expert_bias, keep_fp32=True),
    Row(None, (H + "mlp.gate.e_score_correction_bias",), ZERO, _no_expert_bias, lambda c: (c.num_experts,),
        keep_fp32=True),
    Row(L + "mlp.shared_experts.linear_fc1.weight",
        (H + "mlp.shared_experts.gate_proj.weight", H + "mlp.shared_experts.up_proj.weight"), CONCAT),
    Row(L + "mlp.shared_experts.linear_fc2.weight", (H + "mlp.shared_experts.down_proj.weight",)),
)


# DeepSeek's MTP layer k is HF layer L + k (Megatron-Bridge's mapping): enorm, hnorm and eh_proj as they are, its
# shared_head.norm Megatron's final_layernorm of the MTP layer, and copies of the embedding and the output layer
# (DeepSeek-V3's own checkpoints store them; megatron-core's MTP layers use the model's own)
M = MTP + "{k}."
DEEPSEEK_MTP = (
    Row(M + "enorm.weight", (H + "enorm.weight",)),
    Row(M + "hnorm.weight", (H + "hnorm.weight",)),
    Row(M + "eh_proj.weight", (H + "eh_proj.weight",)),  # [embedding; hidden state] both
    Row(M + "final_layernorm.weight", (H + "shared_head.norm.weight",)),
    Row("embedding.word_embeddings.weight", (H + "embed_tokens.weight",), VOCAB, duplicate=True),
    Row("output_layer.weight", (H + "shared_head.head.weight",), VOCAB, _untied, duplicate=True),
    Row("embedding.word_embeddings.weight", (H + "shared_head.head.weight",), VOCAB, lambda c: c.tied,
        duplicate=True),
)


def _llama_like(model_type: str, architecture: str, facts: HFConfigFacts, *, moe: tuple[Row, ...] = (),
                expert: tuple[Row, ...] = (), expert_prefix: str = "") -> HFFamily:
    attention = LLAMA_ATTENTION + (ATTENTION_BIAS_O_PROJ if facts.qkv_bias_with_o_proj else ())
    return HFFamily(model_type, architecture, H, attention, LLAMA_MLP, LLAMA_MODEL, moe, expert, expert_prefix, facts)


# transformers' config-class defaults (transformers 5: configuration_<type>.py) of the keys import-hf reads
_LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "num_key_value_heads": None, "max_position_embeddings": 2048}
_QWEN_SLIDING = {"use_sliding_window": False, "sliding_window": 4096}
_QWEN = {"sliding_window": True, "sliding_switch": "use_sliding_window"}
# transformers 5's DeepseekV3Config field defaults of the keys import-hf reads
_DEEPSEEK_V3_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": 1}

# DeepSeek-V3: multi-latent attention, the first layers dense, MoE with ungated shared experts and the sigmoid
# router, MTP layers after the decoder's
DEEPSEEK_V3 = HFFamily(
    "deepseek_v3", "DeepseekV3ForCausalLM", H, MLA_ATTENTION, LLAMA_MLP, LLAMA_MODEL, DEEPSEEK_MOE, QWEN_EXPERT,
    H + "mlp.experts.{j}.", mtp=DEEPSEEK_MTP, conventions={"rope_interleave": True}, facts=HFConfigFacts(
        mla=True, mtp_layers="num_nextn_predict_layers",
        moe=MoEKeys("n_routed_experts", "moe_intermediate_size", norm_topk="norm_topk_prob",
                    shared_count="n_shared_experts", first_dense="first_k_dense_replace", sigmoid_router=True),
        defaults=_DEEPSEEK_V3_DEFAULTS,
        aliases={"n_routed_experts": ("num_local_experts",), "num_nextn_predict_layers": ("num_mtp_layers",)}))

FAMILIES: dict[str, HFFamily] = {f.model_type: f for f in (
    _llama_like("llama", "LlamaForCausalLM", HFConfigFacts(
        qkv_bias="attention_bias", qkv_bias_with_o_proj=True, mlp_bias="mlp_bias", defaults=_LLAMA_DEFAULTS)),
    _llama_like("mistral", "MistralForCausalLM", HFConfigFacts(sliding_window=True, defaults={
        "rms_norm_eps": 1e-6, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096})),
    _llama_like("qwen2", "Qwen2ForCausalLM", HFConfigFacts(qkv_bias="always", **_QWEN,
                                                           defaults={"rms_norm_eps": 1e-6, "num_key_value_heads": 32,
                                                                     "max_position_embeddings": 32768,
                                                                     **_QWEN_SLIDING})),
    _llama_like("qwen3", "Qwen3ForCausalLM", HFConfigFacts(
        qkv_bias="attention_bias", qkv_bias_with_o_proj=True, qk_norm=True, **_QWEN,
        defaults={"rms_norm_eps": 1e-6, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
                  **_QWEN_SLIDING})),
    HFFamily("gpt2", "GPT2LMHeadModel", G, GPT2_ATTENTION, GPT2_MLP, GPT2_MODEL,
             facts=HFConfigFacts(num_layers="n_layer", aliases={
                 "n_embd": ("hidden_size",), "n_positions": ("max_position_embeddings",),
                 "n_head": ("num_attention_heads",), "n_layer": ("num_hidden_layers",)})),
    _llama_like("mixtral", "MixtralForCausalLM", HFConfigFacts(
        sliding_window=True, moe=MoEKeys("num_local_experts", "intermediate_size"),
        defaults={"rms_norm_eps": 1e-5, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                  "rope_theta": 1e6, "sliding_window": None}, aliases={"num_local_experts": ("num_experts",)}),
        moe=MIXTRAL_ROUTER, expert=MIXTRAL_EXPERT, expert_prefix=H + "block_sparse_moe.experts.{j}."),
    _llama_like("qwen2_moe", "Qwen2MoeForCausalLM", HFConfigFacts(
        qkv_bias="qkv_bias", **_QWEN,
        moe=MoEKeys("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", True, "norm_topk_prob"),
        defaults={"rms_norm_eps": 1e-6, "num_key_value_heads": 16, "max_position_embeddings": 32768,
                  "qkv_bias": True, "norm_topk_prob": False, **_QWEN_SLIDING}),
        moe=QWEN_ROUTER + QWEN2_SHARED_EXPERT, expert=QWEN_EXPERT, expert_prefix=H + "mlp.experts.{j}."),
    _llama_like("qwen3_moe", "Qwen3MoeForCausalLM", HFConfigFacts(
        qkv_bias="attention_bias", qkv_bias_with_o_proj=True, qk_norm=True, **_QWEN,
        moe=MoEKeys("num_experts", "moe_intermediate_size", None, True, "norm_topk_prob"),
        defaults={"rms_norm_eps": 1e-6, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "norm_topk_prob": False, **_QWEN_SLIDING}, aliases={"num_experts": ("num_local_experts",)}),
        moe=QWEN_ROUTER, expert=QWEN_EXPERT, expert_prefix=H + "mlp.experts.{j}."),
    DEEPSEEK_V3,
    # Kimi-K2: config.json of model_type kimi_k2 in DeepSeek-V3's architecture and tensor names (its remote code's
    # class is DeepseekV3ForCausalLM, which export-hf names)
    dataclasses.replace(DEEPSEEK_V3, model_type="kimi_k2"),
    HFFamily("deepseek_v2", "DeepseekV2ForCausalLM", H, unsupported=(
        "megatron-ucp maps DeepSeek's multi-latent attention as deepseek_v3 (DeepSeek-V2's softmax group-limited "
        "router is not mapped), and DeepSeek-V2-Lite (q_lora_rank null) is not computable: " + MLA_WITHOUT_Q_LORA)),
    HFFamily("glm4_moe", "Glm4MoeForCausalLM", H, unsupported=(
        "megatron-ucp does not map GLM-4.5 yet: megatron-core's GPTModel looks able to compute it (partial RoPE as "
        "--rotary-percent, QKV biases, DeepSeek's sigmoid router, MTP layers like DeepSeek-V3's), but no rows for its "
        "tensors are written or tested against transformers' Glm4MoeForCausalLM")),
    HFFamily("olmoe", "OlmoeForCausalLM", H, unsupported=(
        "OLMoE's q_norm and k_norm normalize each token's whole query and key projections (all heads together), "
        "megatron-core 0.19's --qk-layernorm normalizes each head separately, and its GPT has no whole-projection "
        "QK norm")),
)}
MODEL_TYPES = tuple(t for t, f in FAMILIES.items() if f.unsupported is None)
MOE_MODEL_TYPES = tuple(t for t in MODEL_TYPES if FAMILIES[t].facts.moe)


def family(model_type: str) -> HFFamily:
    """The family of `model_type`; ValueError naming the supported ones (or why it is not supported)."""
    found = FAMILIES.get(model_type)
    if found is None:
        raise ValueError(f"model type {model_type!r} is not supported; choose one of {', '.join(MODEL_TYPES)}")
    if found.unsupported:
        raise ValueError(f"model type {model_type!r} cannot be a Megatron GPT: {found.unsupported}")
    return found


def hf_rows(config: GPTModelConfig, model_type: str, conventions: Optional[Mapping[str, Any]] = None
            ) -> list[HFRow]:
    """Every row of the model, layer by layer (routed experts by global index), then the embeddings, final norm
    and output layer, then each multi-token prediction layer's (its transformer layer's, then the family's MTP
    rows; a family without MTP rows has none: export-hf refuses such a model); rows of a convention for its value
    in `conventions` (config.json's), else the family's."""
    fam = family(model_type)
    chosen = {**fam.conventions, **{k: v for k, v in (conventions or {}).items() if k in fam.conventions}}

    def exists(row: Row) -> bool:
        return row.when(config) and (row.convention is None or chosen[row.convention[0]] == row.convention[1])

    moe_layers = config.moe_layers  # one tuple for all layers
    per_layer = [[r for r in rows if exists(r)] for rows in (fam.attention, fam.dense_mlp, fam.moe, fam.expert)]
    attention, dense, moe, expert = per_layer
    rows: list[HFRow] = []
    for i in range(config.num_layers):
        rows += [r.expand(config, i=i) for r in attention]
        if moe_layers[i]:
            rows += [r.expand(config, i=i) for r in moe]
            rows += [r.expand(config, i=i, j=j) for j in range(config.num_experts) for r in expert]
        else:
            rows += [r.expand(config, i=i) for r in dense]
    rows += [r.expand(config) for r in fam.model if exists(r)]
    for k in range(config.mtp_num_layers or 0):  # MTP layer k: HF layer L + k, built like the decoder's last layer
        i, inner = config.num_layers + k, f"{MTP}{k}.{MTP_INNER}."
        rows += [r.expand(config, inner, i=i) for r in attention]
        if moe_layers[-1]:
            rows += [r.expand(config, inner, i=i) for r in moe]
            rows += [r.expand(config, inner, i=i, j=j) for j in range(config.num_experts) for r in expert]
        else:
            rows += [r.expand(config, inner, i=i) for r in dense]
        rows += [r.expand(config, i=i, k=k) for r in fam.mtp if exists(r)]
    return rows


@functools.lru_cache(maxsize=None)
def _index_pattern(template: str) -> "re.Pattern[str]":
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(\d+)").replace(re.escape("{j}"), r"(\d+)"))


def layer_of(model_type: str, name: str) -> Optional[int]:
    """The layer index of an HF tensor name (by the family's layer prefix), None outside layers."""
    m = _index_pattern(family(model_type).layer).match(name)
    return int(m.group(1)) if m else None


def stored_layers_and_experts(model_type: str, names: Sequence[str]) -> tuple[set[int], set[int]]:
    """The layer indices and routed-expert indices that HF tensor names hold (by the family's prefixes)."""
    fam = family(model_type)
    layers, experts = set(), set()
    expert_re = _index_pattern(fam.expert_prefix) if fam.expert_prefix else None
    for name in names:
        layer = layer_of(model_type, name)
        if layer is not None:
            layers.add(layer)
        m = expert_re.match(name) if expert_re else None
        if m:
            experts.add(int(m.group(2)))
    return layers, experts


def hf_shapes(row: HFRow, config: GPTModelConfig, megatron_shape: Optional[Sequence[int]]) -> list[tuple[int, ...]]:
    """The HF shapes of a row's parts, from the Megatron parameter's global shape (ZERO rows: their own)."""
    if row.join == ZERO:
        return [row.zero_shape]
    shape = tuple(megatron_shape)
    if row.join in (SAME, PERMUTED):
        return [shape]
    if row.join == TRANSPOSED:
        return [shape[::-1]]
    if row.join == VOCAB:
        return [(config.vocab_size, *shape[1:])]
    if row.join == CONCAT:
        return [(shape[0] // len(row.hf), *shape[1:])] * len(row.hf)
    q_rows, kv_rows = config.query_projection_size, config.kv_projection_size
    if row.join == QKV:
        return [(q_rows, *shape[1:]), (kv_rows, *shape[1:]), (kv_rows, *shape[1:])]
    return [tuple(shape[::-1])]  # QKV_CONV1D: [in, 3h] weight or [3h] bias


def _qkv_pattern(row: HFRow, config: GPTModelConfig):
    from megatron_ucp.adapters.gpt import pattern_for

    return pattern_for(row.megatron, config)


def to_hf(row: HFRow, tensor: Optional["torch.Tensor"], config: GPTModelConfig) -> list["torch.Tensor"]:
    """A Megatron parameter's consolidated tensor -> the row's HF tensors (padding rows dropped)."""
    import torch

    if row.join == ZERO:
        return [torch.zeros(row.zero_shape)]
    if row.join == SAME:
        return [tensor]
    if row.join == PERMUTED:  # HF's row permutation[r] is Megatron's row r
        return [tensor[torch.argsort(torch.tensor(row.permutation))]]
    if row.join == TRANSPOSED:
        return [tensor.t()]
    if row.join == VOCAB:
        return [tensor[: config.vocab_size]]
    if row.join == CONCAT:
        return list(torch.chunk(tensor, len(row.hf), dim=0))
    q, k, v = _qkv_pattern(row, config).split_qkv(tensor)
    if row.join == QKV:
        return [q, k, v]
    return [torch.cat([q, k, v], dim=0).t()]  # QKV_CONV1D (a bias's .t() is itself)


def from_hf_bands(row: HFRow, config: GPTModelConfig, shapes: Sequence[Sequence[int]],
                  read_rows: Callable[[int, int, int], "torch.Tensor"], band_rows: Callable[[int], int]
                  ) -> Iterator["torch.Tensor"]:
    """The Megatron tensor of a row as consecutive dim-0 bands in fp32, reading its HF parts a few rows at a
    time: `read_rows(part, r0, r1)` gives rows [r0, r1) of part `part` (shapes[part]) in fp32, `band_rows(n)`
    how many rows of n elements make a band. A VOCAB row yields only the true vocabulary's rows (the caller
    pads). A PERMUTED row reads, per band, the HF rows between the band's lowest and highest source row (its
    permutations only move rows within a head). GPT-2's Conv1D rows (transposed) are read whole. ZERO rows yield
    nothing."""
    import torch

    if row.join == ZERO:
        return
    if row.join in (SAME, VOCAB, CONCAT):  # dim 0 of the parts, one after the other
        for part, shape in enumerate(shapes):
            step = band_rows(math.prod(shape[1:]))
            for r0 in range(0, shape[0], step):
                yield read_rows(part, r0, min(shape[0], r0 + step))
        return
    if row.join == PERMUTED:  # Megatron's rows a band at a time, from the HF rows they are (a local permutation)
        order = torch.tensor(row.permutation)
        step = band_rows(math.prod(shapes[0][1:]))
        for r0 in range(0, shapes[0][0], step):
            wanted = order[r0: r0 + step]
            lo, hi = int(wanted.min()), int(wanted.max()) + 1
            yield read_rows(0, lo, hi)[wanted - lo]
        return
    if row.join == QKV:  # per query group: its q heads, then its k and v
        pattern = _qkv_pattern(row, config)
        q_rows, kv_rows = pattern.heads_per_group * pattern.head_dim, pattern.head_dim
        for g in range(pattern.num_query_groups):
            yield torch.cat([read_rows(0, g * q_rows, (g + 1) * q_rows), read_rows(1, g * kv_rows, (g + 1) * kv_rows),
                             read_rows(2, g * kv_rows, (g + 1) * kv_rows)], dim=0)
        return
    whole = read_rows(0, 0, shapes[0][0])
    if row.join == TRANSPOSED:
        yield whole.t().contiguous()
        return
    q, k, v = torch.split(whole.t(), [config.query_projection_size, config.kv_projection_size,
                                      config.kv_projection_size], dim=0)  # QKV_CONV1D
    yield _qkv_pattern(row, config).merge_qkv(q, k, v).contiguous()


def from_hf(row: HFRow, parts: Sequence["torch.Tensor"], config: GPTModelConfig) -> Optional["torch.Tensor"]:
    """The row's whole HF tensors (any float dtype) -> the Megatron tensor in fp32 (None for ZERO rows; a
    VOCAB row without its padding rows): from_hf_bands over tensors in memory."""
    import torch

    if row.join == ZERO:
        return None
    bands = from_hf_bands(row, config, [tuple(p.shape) for p in parts],
                          lambda i, r0, r1: parts[i][r0:r1].to(torch.float32), lambda n: 1 << 62)
    return torch.cat(list(bands), dim=0)
