"""`megatron-ucp export-hf`: a Hugging Face transformers model directory from a universal checkpoint.

Writes `config.json` and `model.safetensors` (HF parameter names from `adapters/hf.py`'s family table, which
`import-hf` reads the other way) for the families of that table:
- llama, mistral, qwen2, qwen3: SwiGLU, RMSNorm, RoPE (llama3 scaling with --use-rope-scaling and its
  --rope-scaling-factor); Megatron's per-query-group fused QKV is split into q/k/v_proj (GroupedQKV.split_qkv
  gives HF's head order), fc1
  `[gate; up]` into gate_proj / up_proj; QKV biases (qwen2 always, llama and qwen3 with attention_bias, whose
  o_proj bias is exported as zeros), per-head QK norm (qwen3: --qk-layernorm);
- gpt2: LayerNorm, learned positions, GELU, tied embeddings, biases; HF's Conv1D stores weights
  transposed ([in, out]) and c_attn is [q; k; v] concatenated on the output axis;
- mixtral (MoE): Llama's attention, every layer MoE, routed experts only: router -> block_sparse_moe.gate,
  expert j's fc1 `[gate; up]` -> w1 / w3, fc2 -> w2 (the Hub's layout; transformers 5 fuses it on load);
- qwen2_moe (MoE with a gated shared expert) and qwen3_moe (QK norm, routed experts only): routed experts ->
  mlp.experts.j.{gate,up,down}_proj, the shared expert -> mlp.shared_expert, its gate -> mlp.shared_expert_gate,
  dense layers (moe_layer_freq) -> mlp_only_layers;
- deepseek_v3: multi-latent attention (--q-lora-rank, --qk-layernorm: q_a_proj, q_a_layernorm, q_b_proj,
  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; RoPE rows interleaved, rope_interleave=true, as megatron-core reads
  them), megatron-core's MLA RoPE (plain, or YaRN with its factor, mscale and mscale_all_dim and the original
  length and betas megatron-core fixes) as rope_parameters, the leading dense layers -> first_k_dense_replace, the
  ungated shared experts -> n_shared_experts, the sigmoid router (--moe-router-score-function sigmoid, its expert
  bias -> e_score_correction_bias (zeros without --moe-router-enable-expert-bias), --moe-router-topk-scaling-factor
  -> routed_scaling_factor, --moe-router-num-groups / --moe-router-group-topk -> n_group / topk_group, renormalized
  for top-k > 1 -> norm_topk_prob); --norm-epsilon must be 1e-6 (transformers' latent norms use it whatever
  rms_norm_eps says).
Multi-token prediction layers (--mtp-num-layers): for deepseek_v3 and kimi_k2 as DeepSeek's checkpoints store them,
layer num_hidden_layers + k (num_nextn_predict_layers; transformers builds none and ignores them): its transformer
layer's tensors, enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and output layer
(embed_tokens, shared_head.head); other families have no MTP layers: refused, or left out with --drop-mtp.
Megatron's router (softmax score, top-k of the logits, then softmax over the k: the same as the families'
normalized top-k of the full softmax) is checked to be the default one; with --moe-router-pre-softmax (top-k of
the full softmax, not renormalized) it is Qwen-MoE's norm_topk_prob=false. What a family cannot express (biases
it lacks, a QK norm it lacks or needs, other routing) is refused with the reason and the families that fit.
Vocabulary padding rows are dropped (HF vocab_size = the true vocabulary). Only weights are exported
(the fp32 master weights, cast to --dtype, every block read checked against its checksums); the
universal checkpoint itself is never modified. The output goes through `staging.Staging` (kind "hf":
locked, staged, fsynced, marked with `megatron-ucp.json`, renamed into place; an existing DST is
replaced only with --overwrite and only when this tool wrote it).
Needs only torch and safetensors; transformers is needed to load the result, not to write it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from megatron_ucp.adapters.hf import (DEEPSEEK_LATENT_NORM_EPS, FAMILIES, MEGATRON_DEFAULT_LLAMA3_FACTOR,
                                      MEGATRON_LLAMA3_ROPE, MEGATRON_MLA_YARN, MLA_WITHOUT_Q_LORA, MODEL_TYPES,
                                      HFFamily, hf_rows, to_hf, yarn_mscale)
from megatron_ucp.commands.common import add_publication_flags
from megatron_ucp.core.dtypes import PARAM_DTYPES, torch_dtype
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.io.staging import TOOL_MARKER_FILENAME, Staging, StagingError
from megatron_ucp.io.staging import check_destination as check_staging_destination
from megatron_ucp.io.staging import tool_marker

PathLike = Union[str, os.PathLike]
DTYPES = {name: torch_dtype(name) for name in PARAM_DTYPES}


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message names the cause and the fix."""


def _need(condition: bool, model_type: str, what: str, fix: str) -> None:
    if not condition:
        raise ExportError(f"cannot export as --model-type {model_type}: {what}; {fix}")


def _families_with(test: Callable[[HFFamily], bool]) -> str:
    return " or ".join(t for t in MODEL_TYPES if test(FAMILIES[t])) or "none"


def _like(config: GPTModelConfig, test: Callable[[HFFamily], bool] = lambda f: True) -> str:
    """The Llama-like families whose MLP kind (dense or MoE) and QK norm are the model's and that pass `test`."""
    return _families_with(lambda f: f.model_type != "gpt2" and not f.facts.mla
                          and bool(f.facts.moe) == bool(config.num_experts)
                          and f.facts.qk_norm == config.qk_layernorm and test(f))


def check_exportable(config: GPTModelConfig, args: dict, model_type: str, *, drop_mtp: bool = False) -> None:
    """Raise ExportError unless the HF architecture computes exactly what the Megatron model computes (its
    multi-token prediction layers left out only with `drop_mtp`)."""
    if model_type not in MODEL_TYPES:
        raise ExportError(f"--model-type {model_type!r} is not supported; choose one of {', '.join(MODEL_TYPES)}")
    facts = FAMILIES[model_type].facts
    _need(not config.mtp_num_layers or drop_mtp or bool(FAMILIES[model_type].mtp), model_type,
          f"the model has {config.mtp_num_layers} multi-token prediction layer(s) (--mtp-num-layers); "
          f"{FAMILIES[model_type].architecture} checkpoints have none", "pass --drop-mtp to export the model without "
          f"them, or use --model-type {_families_with(lambda f: bool(f.mtp))}")
    mla = "the attention is multi-latent (--multi-latent-attention)"
    if facts.mla:
        _check_deepseek(config, args, model_type)
        return
    _need(not config.multi_latent_attention, model_type, mla,
          f"use --model-type {_families_with(lambda f: f.facts.mla)}")
    if facts.moe:
        _check_moe(config, args, model_type)
    else:
        _need(not config.num_experts, model_type, f"num_experts={config.num_experts} (MoE)",
              f"use --model-type {_families_with(lambda f: bool(f.facts.moe) and not f.facts.mla)}")
    other = "gpt2" if model_type != "gpt2" else "llama"
    if model_type == "gpt2":
        _need(not config.swiglu, model_type, "the MLP is SwiGLU, GPT-2's is GELU", f"use --model-type {other}")
        _need(config.normalization == "LayerNorm", model_type, f"normalization is {config.normalization}, GPT-2's is "
              f"LayerNorm", f"use --model-type {other}")
        _need(config.position_embedding_type == "learned_absolute", model_type, f"position embeddings are "
              f"{config.position_embedding_type}, GPT-2 learns absolute positions", f"use --model-type {other}")
        _need(config.tied, model_type, "input and output embeddings are untied, GPT-2 ties them",
              f"use --model-type {other} or train with tied embeddings")
        _need(config.num_query_groups == config.num_attention_heads, model_type,
              f"grouped-query attention ({config.num_query_groups} groups for {config.num_attention_heads} heads)",
              "GPT-2 has multi-head attention only")
        _need(config.kv_channels * config.num_attention_heads == config.hidden_size, model_type,
              f"kv_channels={config.kv_channels} x {config.num_attention_heads} heads != hidden {config.hidden_size}",
              "GPT-2's head dim is hidden / heads")
        _need(not config.add_qkv_bias or config.add_bias_linear, model_type, "QKV bias without other biases",
              "GPT-2 has all biases or none")
        _need(not config.qk_layernorm, model_type, "the attention normalizes q and k (--qk-layernorm)",
              "GPT-2 has no QK norm")
        return
    # Llama's attention, norms and MLP activation, and the family's biases and QK norm
    _need(config.swiglu, model_type, "the MLP is GELU, Llama's is SwiGLU", f"use --model-type {other}")
    _need(config.normalization == "RMSNorm", model_type, f"normalization is {config.normalization}, Llama's is "
          f"RMSNorm", f"use --model-type {other}")
    _need(config.position_embedding_type == "rope", model_type, f"position embeddings are "
          f"{config.position_embedding_type}, Llama uses RoPE", f"use --model-type {other}")
    _need(float(args.get("rotary_percent", 1.0) or 1.0) == 1.0, model_type,
          f"rotary_percent={args.get('rotary_percent')} (partial rotary)", "HF Llama rotates the whole head")
    _need(not args.get("rotary_interleaved"), model_type, "rotary_interleaved=True",
          "HF Llama uses the rotate-half convention")
    _need(not args.get("rotary_seq_len_interpolation_factor"), model_type, "the run set "
          "--rotary-seq-len-interpolation-factor", "Megatron-LM's GPT builder does not pass it to the model, so "
          "what the model computed is unclear; export from a run without it")
    _need(config.qk_layernorm == facts.qk_norm, model_type,
          "the attention normalizes q and k per head (--qk-layernorm)" if config.qk_layernorm else
          f"{FAMILIES[model_type].architecture} normalizes q and k per head, this model does not",
          f"use --model-type {_like(config)}")
    _need(not config.add_qkv_bias or facts.qkv_bias != "none", model_type, "QKV has a bias, "
          f"{FAMILIES[model_type].architecture}'s attention has none",
          f"use --model-type {_like(config, lambda f: f.facts.qkv_bias != 'none')}")
    _need(config.add_qkv_bias or facts.qkv_bias != "always", model_type, "QKV has no bias, "
          f"{FAMILIES[model_type].architecture}'s always has one",
          f"use --model-type {_like(config, lambda f: f.facts.qkv_bias != 'always')}")
    _need(not config.add_bias_linear or facts.mlp_bias, model_type, "the linear layers have biases "
          "(--add-bias-linear)", f"use --model-type {_like(config, lambda f: bool(f.facts.mlp_bias))}")


def _check_moe(config: GPTModelConfig, args: dict, model_type: str) -> None:
    """The MoE families: Megatron's default router and the expert structure each HF class has."""
    keys = FAMILIES[model_type].facts.moe
    _need(bool(config.num_experts), model_type, "the model has no experts (num_experts is not set)",
          f"use --model-type {_families_with(lambda f: not f.facts.moe)}")
    _need(not config.add_bias_linear, model_type, "the linear layers have biases", "train with --disable-bias-linear")
    _need(not config.moe_router_enable_expert_bias, model_type, "the router has an expert bias "
          "(--moe-router-enable-expert-bias)", "the HF class routes without one")
    score = args.get("moe_router_score_function") or "softmax"
    _need(score == "softmax", model_type, f"moe_router_score_function={score}", "the HF class routes by softmax")
    _need(not args.get("moe_router_pre_softmax") or keys.norm_topk, model_type, "moe_router_pre_softmax"
          "=True (top-k weights not renormalized)", "Mixtral renormalizes the top-k weights; use --model-type "
          "qwen2_moe or qwen3_moe (norm_topk_prob=false) if the model fits it")
    for name in ("moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_input_jitter_eps"):
        _need(not args.get(name), model_type, f"{name}={args.get(name)}", "the HF class has no such routing option")
    _need(bool(args.get("moe_router_topk")), model_type, "the checkpoint's args lack moe_router_topk",
          "convert a checkpoint saved with its Megatron args")
    shared = config.moe_shared_expert_intermediate_size
    _need(keys.sparse_step or all(config.moe_layers), model_type, f"dense and MoE layers are mixed (moe_layer_freq="
          f"{config.moe_layer_freq})", "use --model-type qwen2_moe or qwen3_moe (mlp_only_layers)")
    if keys.shared_ffn:
        _need(bool(shared) and config.moe_shared_expert_gate, model_type, "Qwen2-MoE has a shared expert with a "
              "sigmoid gate in every MoE layer; this model has " + ("an ungated shared expert" if shared else
                                                                      "no shared expert"),
              "use --model-type mixtral or qwen3_moe" if not shared else "train with --moe-shared-expert-gate")
    else:
        _need(not shared, model_type, "the model has shared experts", "use --model-type qwen2_moe")


def _norm_epsilon(args: dict) -> float:
    """The run's --norm-epsilon: Megatron-LM 0.17+ keeps it as layernorm_epsilon, older releases (and import-hf's
    args) as norm_epsilon; Megatron-LM's default 1e-5."""
    value = args.get("layernorm_epsilon", args.get("norm_epsilon"))
    return 1e-5 if value is None else float(value)


def _mla_rope(args: dict) -> tuple[str, float, float, float]:
    """megatron-core's MLA RoPE of a run: (rope type, YaRN factor, mscale, mscale_all_dim); a run without
    --rope-type computed MLATransformerConfig's default, YaRN."""
    mscale = args.get("mscale")
    return (args.get("rope_type") or "yarn", float(args.get("rotary_scaling_factor") or 1.0),
            float(1.0 if mscale is None else mscale), float(args.get("mscale_all_dim") or 0.0))


def _check_deepseek(config: GPTModelConfig, args: dict, model_type: str) -> None:
    """DeepseekV3ForCausalLM: multi-latent attention with query compression and both latent norms, SwiGLU, RMSNorm,
    leading dense layers then MoE layers with ungated shared experts and DeepSeek's sigmoid router."""
    arch = FAMILIES[model_type].architecture
    _need(config.multi_latent_attention, model_type, f"the attention is not multi-latent; {arch}'s is",
          f"use --model-type {_like(config)}")
    _need(config.q_lora_rank is not None, model_type, "the query has no low-rank compression (no --q-lora-rank)",
          MLA_WITHOUT_Q_LORA)
    _need(config.qk_layernorm, model_type, "the latent query and key/value are not normalized (no --qk-layernorm)",
          f"{arch} always applies q_a_layernorm and kv_a_layernorm")
    _need(config.swiglu and config.normalization == "RMSNorm", model_type, "the MLP is not SwiGLU or the norms "
          f"not RMSNorm", f"{arch} has SwiGLU and RMSNorm only")
    _need(not config.add_bias_linear, model_type, "the linear layers have biases", "train with --disable-bias-linear")
    eps = _norm_epsilon(args)
    _need(eps == DEEPSEEK_LATENT_NORM_EPS, model_type, f"norm_epsilon={eps:g}", f"{arch}'s q_a_layernorm and "
          f"kv_a_layernorm use eps {DEEPSEEK_LATENT_NORM_EPS:g} whatever rms_norm_eps says: train with "
          f"--norm-epsilon {DEEPSEEK_LATENT_NORM_EPS:g}")
    _need(not args.get("rotary_interleaved"), model_type, "rotary_interleaved=True",
          "megatron-core's MLA then rotates pairs of its de-interleaved rows, which no HF convention does")
    rope_type, factor, mscale, all_dim = _mla_rope(args)
    if rope_type == "rope":
        _need(float(args.get("rotary_percent", 1.0) or 1.0) == 1.0, model_type, f"rotary_percent="
              f"{args.get('rotary_percent')}", f"{arch} rotates the whole qk_rope_head_dim")
        _need(yarn_mscale(factor, all_dim) == 1.0, model_type, f"--rope-type rope with --rotary-scaling-factor "
              f"{factor:g} and --mscale-all-dim {all_dim:g}", "megatron-core then scales the softmax, transformers' "
              "default RoPE does not")
    else:
        _need(factor <= 1 or (mscale and all_dim) or (not all_dim and mscale == 1.0), model_type,
              f"YaRN with --mscale {mscale:g} and --mscale-all-dim {all_dim:g}", "transformers scales cos/sin by "
              "mscale(factor, mscale) / mscale(factor, mscale_all_dim) only when both are nonzero, else by "
              "mscale(factor); megatron-core always by the ratio")
    # DeepSeek's MoE: leading dense layers, then every layer MoE with its shared experts and the sigmoid router
    _need(bool(config.num_experts), model_type, "the model has no experts", f"{arch} is a mixture of experts")
    layers, dense = config.moe_layers, config.moe_layers.index(True) if any(config.moe_layers) else 0
    _need(all(layers[dense:]) and not any(layers[:dense]), model_type, f"dense and MoE layers are mixed "
          f"(moe_layer_freq={config.moe_layer_freq})", f"{arch}'s dense layers are the first "
          "first_k_dense_replace ones, the rest MoE")
    score = args.get("moe_router_score_function") or "softmax"
    _need(score == "sigmoid", model_type, f"moe_router_score_function={score}", f"{arch} routes by sigmoid scores")
    topk, groups, chosen = int(args.get("moe_router_topk") or 0), args.get("moe_router_num_groups"), \
        args.get("moe_router_group_topk")
    _need(topk > 0, model_type, "the checkpoint's args lack moe_router_topk", "convert a checkpoint saved with its "
          "Megatron args")
    _need(not chosen or chosen == groups or topk // chosen == 2, model_type, f"group-limited routing with "
          f"moe_router_group_topk={chosen} and moe_router_topk={topk}", f"{arch} scores a group by its top 2 "
          "experts, megatron-core by its top moe_router_topk // moe_router_group_topk")
    _need(config.num_experts >= 2, model_type, f"num_experts={config.num_experts}", f"{arch} scores expert groups "
          "by their top 2 experts")
    _need(not args.get("moe_input_jitter_eps"), model_type, f"moe_input_jitter_eps={args.get('moe_input_jitter_eps')}",
          f"{arch} has no router input jitter")
    shared, ffn = config.moe_shared_expert_intermediate_size, config.moe_ffn_hidden_size
    _need(bool(shared) and shared % ffn == 0 and not config.moe_shared_expert_gate, model_type,
          f"the shared expert is {'gated' if config.moe_shared_expert_gate else f'of {shared}'}",
          f"{arch} has n_shared_experts ungated shared experts of moe_intermediate_size={ffn} each")


def _deepseek_config(config: GPTModelConfig, args: dict) -> dict:
    """DeepseekV3Config's fields of what megatron-core computed (check_exportable's _check_deepseek passed)."""
    rope_type, factor, mscale, all_dim = _mla_rope(args)
    theta = float(args.get("rotary_base", 10000) or 10000)
    scaling = {"rope_type": "yarn", "factor": factor, **{k: v for k, v in MEGATRON_MLA_YARN.items() if k != "truncate"},
               "mscale": mscale, "mscale_all_dim": all_dim} if rope_type == "yarn" else None
    topk, groups, chosen = int(args["moe_router_topk"]), args.get("moe_router_num_groups"), \
        args.get("moe_router_group_topk")
    limited = bool(chosen) and chosen != groups
    return {
        "intermediate_size": config.ffn_hidden_size, "moe_intermediate_size": config.moe_ffn_hidden_size,
        "num_key_value_heads": config.num_attention_heads, "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank, "qk_nope_head_dim": config.qk_head_dim,
        "qk_rope_head_dim": config.qk_pos_emb_head_dim, "v_head_dim": config.v_head_dim,
        "rope_theta": theta, "rope_scaling": scaling,  # transformers 4.x
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": theta},  # transformers 5.x
        "rope_interleave": FAMILIES["deepseek_v3"].conventions["rope_interleave"],
        "n_routed_experts": config.num_experts, "num_experts_per_tok": topk,
        "n_shared_experts": config.moe_shared_expert_intermediate_size // config.moe_ffn_hidden_size,
        "first_k_dense_replace": config.moe_layers.index(True),
        "routed_scaling_factor": float(args.get("moe_router_topk_scaling_factor") or 1.0),
        "n_group": groups if limited else 1, "topk_group": chosen if limited else 1, "norm_topk_prob": topk > 1,
        "attention_bias": False, "num_nextn_predict_layers": config.mtp_num_layers or 0, "pretraining_tp": 1,
    }


def _rope_config(args: dict) -> dict:
    """transformers' RoPE fields of what megatron-core computed: with --use-rope-scaling, llama3 scaling with the
    run's --rope-scaling-factor (what this project's entry point passes to GPTModel, and the plugin checks the built
    model computes at every load) and MEGATRON_LLAMA3_ROPE's fixed keys."""
    theta = float(args.get("rotary_base", 10000) or 10000)
    scaling = None
    if args.get("use_rope_scaling"):
        factor = float(args.get("rope_scaling_factor") or MEGATRON_DEFAULT_LLAMA3_FACTOR)
        scaling = {"rope_type": "llama3", "factor": factor, **MEGATRON_LLAMA3_ROPE}
    return {"rope_theta": theta, "rope_scaling": scaling,  # transformers 4.x
            "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": theta}}  # transformers 5.x


def _hf_config(config: GPTModelConfig, args: dict, model_type: str, dtype: str) -> dict:
    eps = _norm_epsilon(args)
    # NullTokenizer and the byte-level tokenizer append EOD as the last token of the true vocabulary.
    eod = config.vocab_size - 1 if args.get("tokenizer_type") in ("NullTokenizer", "ByteLevelTokenizer") else None
    fam = FAMILIES[model_type]
    common = {"architectures": [fam.architecture], "model_type": model_type, "vocab_size": config.vocab_size,
              "torch_dtype": dtype, "dtype": dtype, "bos_token_id": eod, "eos_token_id": eod,
              "tie_word_embeddings": config.tied}
    if model_type == "gpt2":
        return {
            **common, "n_positions": config.max_position_embeddings, "n_embd": config.hidden_size,
            "n_layer": config.num_layers, "n_head": config.num_attention_heads, "n_inner": config.ffn_hidden_size,
            "activation_function": "gelu",  # Megatron uses exact GELU (F.gelu); HF's default gelu_new is the tanh form
            "layer_norm_epsilon": eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "initializer_range": 0.02, "use_cache": True,
        }
    facts = fam.facts
    if facts.mla:
        return {**common, "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
                "num_attention_heads": config.num_attention_heads, "hidden_act": "silu",
                "max_position_embeddings": config.max_position_embeddings or int(args.get("seq_length") or 4096),
                "rms_norm_eps": eps, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
                **_deepseek_config(config, args)}
    out = {
        **common, "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
        "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings or
        int(args.get("seq_length") or 2048), "rms_norm_eps": eps, **_rope_config(args),
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    }
    if facts.sliding_window:
        out["sliding_window"] = None  # Megatron attends over the whole sequence
    if facts.sliding_switch:
        out[facts.sliding_switch] = False
    if facts.qkv_bias not in ("none", "always"):
        out[facts.qkv_bias] = bool(config.add_qkv_bias or config.add_bias_linear)
    if facts.mlp_bias:
        out.update({facts.mlp_bias: bool(config.add_bias_linear), "pretraining_tp": 1})
    if not facts.moe:
        return out
    keys = facts.moe
    out.update({"num_experts_per_tok": int(args["moe_router_topk"]), "output_router_logits": False,
                "router_aux_loss_coef": float(args.get("moe_aux_loss_coeff") or 0.0),
                keys.num_experts: config.num_experts, keys.expert_ffn: config.moe_ffn_hidden_size})
    if keys.expert_ffn == "intermediate_size":  # Mixtral: every layer MoE
        out["router_jitter_noise"] = 0.0
    if keys.shared_ffn:
        out[keys.shared_ffn] = config.moe_shared_expert_intermediate_size
    if keys.norm_topk:
        out[keys.norm_topk] = not args.get("moe_router_pre_softmax")
    if keys.sparse_step:
        out.update({"decoder_sparse_step": 1, "max_window_layers": config.num_layers,
                    "mlp_only_layers": [i for i, moe_layer in enumerate(config.moe_layers) if not moe_layer]})
    return out


def hf_state_dict(read: Callable[[str], torch.Tensor], config: GPTModelConfig, model_type: str,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF tensors from canonical fp32 tensors (`read(name)`), vocabulary padding dropped (hf_names' table), in
    `dtype` but those transformers keeps in fp32."""
    out: dict[str, torch.Tensor] = {}
    for row in hf_rows(config, model_type):
        tensor = read(row.megatron) if row.megatron is not None else None
        out.update((name, part.to(torch.float32 if row.keep_fp32 else dtype).contiguous())
                   for name, part in zip(row.hf, to_hf(row, tensor, config)))
    return out


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    resolved_src, resolved_dst = src.resolve(), dst.resolve()
    if resolved_dst == resolved_src or resolved_src in resolved_dst.parents or resolved_dst in resolved_src.parents:
        raise ExportError(f"{dst}: overlaps the universal checkpoint {src}; write the export elsewhere "
                          f"(the input is never modified)")
    try:
        check_staging_destination(dst, "hf", overwrite)
    except StagingError as e:
        raise ExportError(str(e)) from None


def export_hf(src: PathLike, dst: PathLike, model_type: str, *, dtype: Optional[str] = None,
              overwrite: bool = False, progress: bool = True, clean_stale: bool = False, drop_mtp: bool = False,
              allow_non_finite: bool = False) -> dict:
    """Write the HF model directory `dst` from the universal checkpoint `src`; returns a summary. DST's lock
    is held from before `src` is opened until the export is published. `drop_mtp`: leave out the multi-token
    prediction layers (refused otherwise). A weight holding NaN/Inf is refused (searched in the values just
    read and checked) unless `allow_non_finite`."""
    import sys

    from safetensors.torch import save_file
    from tqdm import tqdm

    from megatron_ucp.commands.common import is_universal, open_any
    from megatron_ucp.io import integrity

    src, dst = Path(src), Path(dst).absolute()
    _check_destination(src, dst, overwrite)  # fails fast; checked again under the lock
    if dtype not in (None, "auto") and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of auto, {', '.join(DTYPES)}")
    try:
        with Staging(dst, kind="hf", overwrite=overwrite, clean_stale=clean_stale) as stage:
            ucp = open_any(src)
            if not is_universal(ucp):
                raise ExportError(f"{src}: is a Megatron-LM {ucp.format} checkpoint; convert it first "
                                  f"(megatron-ucp to-universal {src} UCP_DIR) and export UCP_DIR")
            config = ucp.config
            check_exportable(config, ucp.args, model_type, drop_mtp=drop_mtp)
            dropped_mtp = (config.mtp_num_layers or 0) if drop_mtp else 0
            if dropped_mtp:
                config = dataclasses.replace(config, mtp_num_layers=None)
            if dtype in (None, "auto"):
                dtypes = {p.model_dtype for p in ucp.parameters.values()}
                dtype = dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes), None) in DTYPES else "float32"
            bar = tqdm(total=sum(math.prod(p.shape) * 4 for p in ucp.parameters.values()), unit="B",
                       unit_scale=True, unit_divisor=1024, desc="export-hf", disable=not progress, file=sys.stderr,
                       dynamic_ncols=True)

            def read(name: str) -> torch.Tensor:
                tensor = ucp.read(name, "fp32")
                count, first = (0, -1) if allow_non_finite else integrity.non_finite(tensor.reshape(-1).numpy())
                if count:
                    raise ExportError(f"{src}: {name} holds {count} non-finite value(s) (NaN/Inf; the first at "
                                      f"element {first}); {integrity.NON_FINITE_REMEDY}, or pass "
                                      f"--allow-non-finite to export them as they are")
                bar.update(tensor.numel() * 4)
                return tensor

            try:
                tensors = hf_state_dict(read, config, model_type, DTYPES[dtype])
            finally:
                bar.close()
            hf_config = _hf_config(config, ucp.args, model_type, dtype)
            save_file(tensors, str(stage.path / "model.safetensors"), metadata={"format": "pt"})
            (stage.path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
            stage.publish(TOOL_MARKER_FILENAME, tool_marker("hf", model_type=model_type, dtype=dtype,
                                                            iteration=ucp.iteration, source=str(src.resolve())))
    except StagingError as e:
        raise ExportError(str(e)) from e
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"path": str(dst), "source": str(src.resolve()), "model_type": model_type, "dtype": dtype,
            "iteration": ucp.iteration, "vocab_size": config.vocab_size,
            "dropped_padding_rows": config.padded_vocab_size - config.vocab_size,
            "num_tensors": len(tensors), "bytes_written": nbytes,
            "dropped_mtp_layers": dropped_mtp, "mtp_layers": config.mtp_num_layers or 0}


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "export-hf", parents=[common], help="write a Hugging Face transformers model from a universal checkpoint",
        description="Export the weights of a universal checkpoint as a Hugging Face transformers model directory "
                    "(config.json + model.safetensors): --model-type llama, mistral (SwiGLU, RMSNorm, RoPE), qwen2 "
                    "(+ QKV bias), qwen3 (+ QK norm), gpt2 (GELU, LayerNorm, learned positions, tied), mixtral (MoE, "
                    "routed experts only), qwen2_moe (MoE with a gated shared expert, dense layers allowed), "
                    "qwen3_moe (MoE, QK norm) or deepseek_v3 (multi-latent attention, leading dense layers, MoE with "
                    "shared experts and the sigmoid router with its expert bias; its MTP layers too; kimi_k2: the "
                    "same in Kimi-K2's config). Vocabulary padding rows are dropped; --drop-mtp leaves out "
                    "multi-token prediction layers.")
    p.add_argument("src", help="universal checkpoint directory (megatron-ucp to-universal's DST)")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--model-type", required=True, choices=MODEL_TYPES)
    p.add_argument("--dtype", default="auto", choices=("auto",) + tuple(DTYPES),
                   help="dtype of the exported weights (default: the model's training dtype)")
    p.add_argument("--drop-mtp", action="store_true",
                   help="leave out the model's multi-token prediction layers (deepseek_v3 and kimi_k2 store them "
                        "after the decoder's layers; other families have none, and a model with them is refused "
                        "without this flag)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="export weights holding NaN/Inf as they are (refused by default, naming them)")
    add_publication_flags(p, "export", "megatron-ucp.json")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    result = export_hf(args.src, args.dst, args.model_type, dtype=args.dtype, overwrite=args.overwrite,
                       progress=not args.quiet, clean_stale=args.clean_stale, drop_mtp=args.drop_mtp,
                       allow_non_finite=args.allow_non_finite)
    result["message"] = (f"wrote {result['path']}: {args.model_type} ({result['num_tensors']} tensors, "
                         f"{result['bytes_written'] / 2 ** 20:.1f} MiB, {result['dtype']}), iteration "
                         f"{result['iteration']}, vocab {result['vocab_size']} ({result['dropped_padding_rows']} "
                         f"padding rows dropped)"
                         + (f", {result['dropped_mtp_layers']} MTP layer(s) left out" if result["dropped_mtp_layers"]
                            else "") + "; no tokenizer files are written")
    return result
