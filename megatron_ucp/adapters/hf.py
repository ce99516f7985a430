"""The one table between Hugging Face and Megatron parameter names, used both ways (`export-hf`, `import-hf`).

`FAMILIES` holds one `HFFamily` per transformers model type (llama, mistral, qwen2, qwen3, gpt2, mixtral,
qwen2_moe, qwen3_moe; olmoe as a refusal with its reason): its tensors as rows of templates (`Row`: a Megatron
canonical parameter, `{i}` the global layer and `{j}` the routed expert, the HF tensors it is made of, how
(`Join`), and when the row exists for a model config), and the facts of its config.json that decide the
Megatron model (`HFConfigFacts`: which biases, QK norm, MoE keys, sliding-window keys, transformers' defaults).
A new family is a new entry of rows and facts; `hf_rows(config, model_type)` expands a family for a model.

Joins: the same tensor, transposed (GPT-2's Conv1D stores [in, out]), QKV grouped per query group from
q/k/v_proj (GroupedQKV.merge_qkv, the inverse of split_qkv) or from GPT-2's c_attn, SwiGLU `[gate; up]`
concatenated, routed experts by their global index, the vocabulary padded (rows beyond the true vocabulary exist
only on Megatron's side), and HF tensors Megatron does not have, which must be zero (HF's o_proj bias when only
QKV has a bias). `to_hf` and `from_hf` apply a row in each direction and are exact inverses on the true vocabulary
(`from_hf_bands` is `from_hf` a band of rows at a time, for bounded memory); nothing else in the project spells
an HF name.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

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

Predicate = Callable[[GPTModelConfig], bool]

# transformers' llama3 RoPE (rope_type "llama3") that megatron-core 0.19's RotaryEmbedding computes with
# --use-rope-scaling: _apply_scaling's constants, and GPTModel's default factor (Megatron-LM's GPT builder passes
# --use-rope-scaling to the model, not --rope-scaling-factor)
MEGATRON_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class HFRow:
    """One Megatron parameter (None for ZERO) and the HF tensors it is made of, in order (ZERO rows: the HF
    tensor's shape)."""

    megatron: Optional[str]
    hf: tuple[str, ...]
    join: str
    zero_shape: Optional[tuple[int, ...]] = None


def _always(config: GPTModelConfig) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    """A family's row: templates of the Megatron parameter and its HF tensors (`{i}`: global layer, `{j}`: routed
    expert), the join, when the row exists, and for a ZERO row the shape of its HF tensor."""

    megatron: Optional[str]
    hf: tuple[str, ...]
    join: str = SAME
    when: Predicate = _always
    zero_shape: Optional[Callable[[GPTModelConfig], tuple[int, ...]]] = None

    def expand(self, config: GPTModelConfig, **index: int) -> HFRow:
        return HFRow(self.megatron.format(**index) if self.megatron else None,
                     tuple(n.format(**index) for n in self.hf), self.join,
                     self.zero_shape(config) if self.zero_shape else None)


@dataclass(frozen=True)
class MoEKeys:
    """Where a MoE family's config.json keeps its experts."""

    num_experts: str  # key of the routed experts' count
    expert_ffn: str  # key of a routed expert's FFN size
    shared_ffn: Optional[str] = None  # key of the (gated) shared expert's FFN size; None: the family has none
    sparse_step: bool = False  # decoder_sparse_step / mlp_only_layers choose the MoE layers (else every layer)
    norm_topk: Optional[str] = None  # key of "renormalize the top-k weights" (None: always renormalized)


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
    unsupported: Optional[str] = None  # why Megatron's GPT cannot compute the family


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


def _llama_like(model_type: str, architecture: str, facts: HFConfigFacts, *, moe: tuple[Row, ...] = (),
                expert: tuple[Row, ...] = (), expert_prefix: str = "") -> HFFamily:
    attention = LLAMA_ATTENTION + (ATTENTION_BIAS_O_PROJ if facts.qkv_bias_with_o_proj else ())
    return HFFamily(model_type, architecture, H, attention, LLAMA_MLP, LLAMA_MODEL, moe, expert, expert_prefix, facts)


# transformers' config-class defaults (transformers 5: configuration_<type>.py) of the keys import-hf reads
_LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "num_key_value_heads": None, "max_position_embeddings": 2048}
_QWEN_SLIDING = {"use_sliding_window": False, "sliding_window": 4096}
_QWEN = {"sliding_window": True, "sliding_switch": "use_sliding_window"}

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


def hf_rows(config: GPTModelConfig, model_type: str) -> list[HFRow]:
    """Every row of the model, layer by layer (routed experts by global index), then the embeddings, final norm
    and output layer."""
    fam = family(model_type)
    moe_layers = config.moe_layers  # one tuple for all layers
    per_layer = [[r for r in rows if r.when(config)] for rows in (fam.attention, fam.dense_mlp, fam.moe, fam.expert)]
    attention, dense, moe, expert = per_layer
    rows: list[HFRow] = []
    for i in range(config.num_layers):
        rows += [r.expand(config, i=i) for r in attention]
        if moe_layers[i]:
            rows += [r.expand(config, i=i) for r in moe]
            rows += [r.expand(config, i=i, j=j) for j in range(config.num_experts) for r in expert]
        else:
            rows += [r.expand(config, i=i) for r in dense]
    rows += [r.expand(config) for r in fam.model if r.when(config)]
    return rows


@functools.lru_cache(maxsize=None)
def _index_pattern(template: str) -> "re.Pattern[str]":
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(\d+)").replace(re.escape("{j}"), r"(\d+)"))


def stored_layers_and_experts(model_type: str, names: Sequence[str]) -> tuple[set[int], set[int]]:
    """The layer indices and routed-expert indices that HF tensor names hold (by the family's prefixes)."""
    fam = family(model_type)
    layers, experts = set(), set()
    layer_re = _index_pattern(fam.layer)
    expert_re = _index_pattern(fam.expert_prefix) if fam.expert_prefix else None
    for name in names:
        m = layer_re.match(name)
        if m:
            layers.add(int(m.group(1)))
        m = expert_re.match(name) if expert_re else None
        if m:
            experts.add(int(m.group(2)))
    return layers, experts


def hf_shapes(row: HFRow, config: GPTModelConfig, megatron_shape: Optional[Sequence[int]]) -> list[tuple[int, ...]]:
    """The HF shapes of a row's parts, from the Megatron parameter's global shape (ZERO rows: their own)."""
    if row.join == ZERO:
        return [row.zero_shape]
    shape = tuple(megatron_shape)
    if row.join == SAME:
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
    pads). GPT-2's Conv1D rows (transposed) are read whole. ZERO rows yield nothing."""
    import torch

    if row.join == ZERO:
        return
    if row.join in (SAME, VOCAB, CONCAT):  # dim 0 of the parts, one after the other
        for part, shape in enumerate(shapes):
            step = band_rows(math.prod(shape[1:]))
            for r0 in range(0, shape[0], step):
                yield read_rows(part, r0, min(shape[0], r0 + step))
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
