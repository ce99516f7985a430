"""The one table between Hugging Face and Megatron parameter names, used both ways (`export-hf`, `import-hf`).

`hf_rows(config, model_type)` lists, for the llama, gpt2, mixtral and qwen2_moe families, every Megatron
canonical parameter with the HF tensors it is made of and how (`Join`): the same tensor, transposed
(GPT-2's Conv1D stores [in, out]), QKV grouped per query group from q/k/v_proj (GroupedQKV.merge_qkv, the
inverse of split_qkv) or from GPT-2's c_attn, SwiGLU `[gate; up]` concatenated, routed experts by their
global index, the vocabulary padded (rows beyond the true vocabulary exist only on Megatron's side), and
HF tensors Megatron does not have, which must be zero (HF Llama's o_proj bias when only QKV has a bias).
`to_hf` and `from_hf` apply a row in each direction and are exact inverses on the true vocabulary
(`from_hf_bands` is `from_hf` a band of rows at a time, for bounded memory); nothing else in the project
spells an HF name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

from megatron_ucp.core.model_config import GPTModelConfig

if TYPE_CHECKING:
    import torch

MODEL_TYPES = ("llama", "gpt2", "mixtral", "qwen2_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe")

# How a row's HF parts make the Megatron tensor.
SAME = "same"  # one HF tensor, equal
TRANSPOSED = "transposed"  # one HF tensor, Megatron's is its transpose (GPT-2 Conv1D)
QKV = "qkv"  # q, k, v -> Megatron's per-query-group fused QKV
QKV_CONV1D = "qkv_conv1d"  # GPT-2 c_attn ([in, 3h] weight or [3h] bias, [q; k; v]) -> grouped QKV
CONCAT = "concat"  # parts concatenated on dim 0 (SwiGLU [gate; up])
VOCAB = "vocab"  # one HF tensor of the true vocabulary's rows; Megatron's has padding rows after them
ZERO = "zero"  # an HF tensor Megatron does not have: zero (no Megatron parameter)


@dataclass(frozen=True)
class HFRow:
    """One Megatron parameter (None for ZERO) and the HF tensors it is made of, in order."""

    megatron: Optional[str]
    hf: tuple[str, ...]
    join: str


def _attention(config: GPTModelConfig, model_type: str, i: int) -> list[HFRow]:
    m = f"decoder.layers.{i}."
    if model_type == "gpt2":
        h = f"transformer.h.{i}."
        rows = [HFRow(m + "input_layernorm.weight", (h + "ln_1.weight",), SAME),
                HFRow(m + "input_layernorm.bias", (h + "ln_1.bias",), SAME),
                HFRow(m + "self_attention.linear_qkv.weight", (h + "attn.c_attn.weight",), QKV_CONV1D),
                HFRow(m + "self_attention.linear_proj.weight", (h + "attn.c_proj.weight",), TRANSPOSED)]
        # GPT-2 has every bias; a Megatron model without them exports zeros
        rows.append(HFRow(m + "self_attention.linear_qkv.bias" if config.add_qkv_bias else None,
                          (h + "attn.c_attn.bias",), QKV_CONV1D if config.add_qkv_bias else ZERO))
        rows.append(HFRow(m + "self_attention.linear_proj.bias" if config.add_bias_linear else None,
                          (h + "attn.c_proj.bias",), SAME if config.add_bias_linear else ZERO))
        rows += [HFRow(m + "pre_mlp_layernorm.weight", (h + "ln_2.weight",), SAME),
                 HFRow(m + "pre_mlp_layernorm.bias", (h + "ln_2.bias",), SAME)]
        return rows
    a = f"model.layers.{i}.self_attn."
    rows = [HFRow(m + "input_layernorm.weight", (f"model.layers.{i}.input_layernorm.weight",), SAME),
            HFRow(m + "self_attention.linear_qkv.weight", (a + "q_proj.weight", a + "k_proj.weight",
                                                           a + "v_proj.weight"), QKV),
            HFRow(m + "self_attention.linear_proj.weight", (a + "o_proj.weight",), SAME)]
    if config.add_qkv_bias:
        rows.append(HFRow(m + "self_attention.linear_qkv.bias", (a + "q_proj.bias", a + "k_proj.bias",
                                                                 a + "v_proj.bias"), QKV))
        if config.add_bias_linear:
            rows.append(HFRow(m + "self_attention.linear_proj.bias", (a + "o_proj.bias",), SAME))
        elif model_type == "llama":  # HF Llama's attention_bias gives o_proj a bias too
            rows.append(HFRow(None, (a + "o_proj.bias",), ZERO))
    rows.append(HFRow(m + "pre_mlp_layernorm.weight", (f"model.layers.{i}.post_attention_layernorm.weight",), SAME))
    return rows


def _dense_mlp(config: GPTModelConfig, model_type: str, i: int) -> list[HFRow]:
    m = f"decoder.layers.{i}.mlp."
    if model_type == "gpt2":
        h = f"transformer.h.{i}.mlp."
        return [HFRow(m + "linear_fc1.weight", (h + "c_fc.weight",), TRANSPOSED),
                HFRow(m + "linear_fc1.bias" if config.add_bias_linear else None, (h + "c_fc.bias",),
                      SAME if config.add_bias_linear else ZERO),
                HFRow(m + "linear_fc2.weight", (h + "c_proj.weight",), TRANSPOSED),
                HFRow(m + "linear_fc2.bias" if config.add_bias_linear else None, (h + "c_proj.bias",),
                      SAME if config.add_bias_linear else ZERO)]
    h = f"model.layers.{i}.mlp."
    rows = [HFRow(m + "linear_fc1.weight", (h + "gate_proj.weight", h + "up_proj.weight"), CONCAT),
            HFRow(m + "linear_fc2.weight", (h + "down_proj.weight",), SAME)]
    if config.add_bias_linear:
        rows += [HFRow(m + "linear_fc1.bias", (h + "gate_proj.bias", h + "up_proj.bias"), CONCAT),
                 HFRow(m + "linear_fc2.bias", (h + "down_proj.bias",), SAME)]
    return rows


def _moe_mlp(config: GPTModelConfig, model_type: str, i: int) -> list[HFRow]:
    """The router, every routed expert by global index j (fc1 `[gate; up]`), and (qwen2_moe) the shared
    expert and its sigmoid gate."""
    m = f"decoder.layers.{i}.mlp."
    block, (gate, up, down) = ((f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")) if model_type == "mixtral"
                               else (f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")))
    rows = [HFRow(m + "router.weight", (block + "gate.weight",), SAME)]
    for j in range(config.num_experts):
        e = f"{block}experts.{j}."
        rows += [HFRow(f"{m}experts.local_experts.{j}.linear_fc1.weight", (e + gate + ".weight", e + up + ".weight"),
                       CONCAT),
                 HFRow(f"{m}experts.local_experts.{j}.linear_fc2.weight", (e + down + ".weight",), SAME)]
    if model_type == "qwen2_moe":
        s = block + "shared_expert."
        rows += [HFRow(m + "shared_experts.linear_fc1.weight", (s + "gate_proj.weight", s + "up_proj.weight"),
                       CONCAT),
                 HFRow(m + "shared_experts.linear_fc2.weight", (s + "down_proj.weight",), SAME),
                 HFRow(m + "shared_experts.gate_weight", (block + "shared_expert_gate.weight",), SAME)]
    return rows


def hf_rows(config: GPTModelConfig, model_type: str) -> list[HFRow]:
    """Every row of the model, layer by layer, then the embeddings, final norm and output layer."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported; choose one of {', '.join(MODEL_TYPES)}")
    rows: list[HFRow] = []
    for i in range(config.num_layers):
        rows += _attention(config, model_type, i)
        moe_layer = bool(config.num_experts) and config.moe_layers[i]
        rows += _moe_mlp(config, model_type, i) if moe_layer else _dense_mlp(config, model_type, i)
    if model_type == "gpt2":
        rows += [HFRow("embedding.word_embeddings.weight", ("transformer.wte.weight",), VOCAB),
                 HFRow("embedding.position_embeddings.weight", ("transformer.wpe.weight",), SAME),
                 HFRow("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), SAME),
                 HFRow("decoder.final_layernorm.bias", ("transformer.ln_f.bias",), SAME)]
        return rows
    rows += [HFRow("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
             HFRow("decoder.final_layernorm.weight", ("model.norm.weight",), SAME)]
    if not config.tied:
        rows.append(HFRow("output_layer.weight", ("lm_head.weight",), VOCAB))
    return rows


def hf_shapes(row: HFRow, config: GPTModelConfig, megatron_shape: Optional[Sequence[int]]) -> list[tuple[int, ...]]:
    """The HF shapes of a row's parts, from the Megatron parameter's global shape (ZERO rows: from the
    config)."""
    if row.join == ZERO:
        name = row.hf[0]
        if "c_fc" in name:
            return [(config.ffn_hidden_size,)]
        if "c_attn" in name:
            return [(3 * config.hidden_size,)]
        return [(config.hidden_size,)]
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
        return [torch.zeros(hf_shapes(row, config, None)[0])]
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
