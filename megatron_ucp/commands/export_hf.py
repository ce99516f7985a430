"""`megatron-ucp export-hf`: a Hugging Face transformers model directory from a universal checkpoint.

Writes `config.json` and `model.safetensors` (HF parameter names, from `hf_names`' table, which `import-hf`
reads the other way) for four families:
- llama: SwiGLU, RMSNorm, RoPE; Megatron's per-query-group fused QKV is split into q/k/v_proj
  (GroupedQKV.split_qkv gives HF's head order), fc1 `[gate; up]` into gate_proj / up_proj;
- gpt2: LayerNorm, learned positions, GELU, tied embeddings, biases; HF's Conv1D stores weights
  transposed ([in, out]) and c_attn is [q; k; v] concatenated on the output axis;
- mixtral (MoE): Llama's attention, every layer MoE, routed experts only: router -> block_sparse_moe.gate,
  expert j's fc1 `[gate; up]` -> w1 / w3, fc2 -> w2 (the Hub's layout; transformers 5 fuses it on load);
- qwen2_moe (MoE with a gated shared expert): routed experts -> mlp.experts.j.{gate,up,down}_proj, the
  shared expert -> mlp.shared_expert, its gate -> mlp.shared_expert_gate, dense layers (moe_layer_freq)
  -> mlp_only_layers.
Megatron's router (softmax score, top-k of the logits, then softmax over the k: the same as Mixtral's /
Qwen2-MoE's normalized top-k of the full softmax) is checked to be the default one; with
--moe-router-pre-softmax (top-k of the full softmax, not renormalized) it is Qwen2-MoE's norm_topk_prob=false.
Vocabulary padding rows are dropped (HF vocab_size = the true vocabulary). Only weights are exported
(the fp32 master weights, cast to --dtype, every block read checked against its checksums); the
universal checkpoint itself is never modified. The output goes through `staging.Staging` (kind "hf":
locked, staged, fsynced, marked with `megatron-ucp.json`, renamed into place; an existing DST is
replaced only with --overwrite and only when this tool wrote it).
Needs only torch and safetensors; transformers is needed to load the result, not to write it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from megatron_ucp.adapters.hf import MODEL_TYPES, MOE_MODEL_TYPES, hf_rows, to_hf
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


def check_exportable(config: GPTModelConfig, args: dict, model_type: str) -> None:
    """Raise ExportError unless the HF architecture computes exactly what the Megatron model computes."""
    if model_type not in MODEL_TYPES:
        raise ExportError(f"--model-type {model_type!r} is not supported; choose one of {', '.join(MODEL_TYPES)}")
    if model_type in MOE_MODEL_TYPES:
        _check_moe(config, args, model_type)
    else:
        _need(not config.num_experts, model_type, f"num_experts={config.num_experts} (MoE)",
              "use --model-type mixtral (routed experts only) or qwen2_moe (with a gated shared expert)")
    other = "gpt2" if model_type == "llama" else "llama"
    if model_type != "gpt2":  # Llama's attention, norms and MLP activation
        _need(config.swiglu, model_type, "the MLP is GELU, Llama's is SwiGLU", f"use --model-type {other}")
        _need(config.normalization == "RMSNorm", model_type, f"normalization is {config.normalization}, Llama's is "
              f"RMSNorm", f"use --model-type {other}")
        _need(config.position_embedding_type == "rope", model_type, f"position embeddings are "
              f"{config.position_embedding_type}, Llama uses RoPE", f"use --model-type {other}")
        _need(float(args.get("rotary_percent", 1.0) or 1.0) == 1.0, model_type,
              f"rotary_percent={args.get('rotary_percent')} (partial rotary)", "HF Llama rotates the whole head")
        _need(not args.get("rotary_interleaved"), model_type, "rotary_interleaved=True",
              "HF Llama uses the rotate-half convention")
    else:
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


def _check_moe(config: GPTModelConfig, args: dict, model_type: str) -> None:
    """The MoE families: Megatron's default router and the expert structure each HF class has."""
    _need(bool(config.num_experts), model_type, "the model has no experts (num_experts is not set)",
          "use --model-type llama or gpt2")
    _need(not config.add_bias_linear, model_type, "the linear layers have biases", "train with --disable-bias-linear")
    _need(not config.moe_router_enable_expert_bias, model_type, "the router has an expert bias "
          "(--moe-router-enable-expert-bias)", "the HF class routes without one")
    score = args.get("moe_router_score_function") or "softmax"
    _need(score == "softmax", model_type, f"moe_router_score_function={score}", "the HF class routes by softmax")
    _need(not args.get("moe_router_pre_softmax") or model_type == "qwen2_moe", model_type, "moe_router_pre_softmax"
          "=True (top-k weights not renormalized)", "Mixtral renormalizes the top-k weights; use --model-type "
          "qwen2_moe (norm_topk_prob=false) if the model fits it")
    for name in ("moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_input_jitter_eps"):
        _need(not args.get(name), model_type, f"{name}={args.get(name)}", "the HF class has no such routing option")
    _need(bool(args.get("moe_router_topk")), model_type, "the checkpoint's args lack moe_router_topk",
          "convert a checkpoint saved with its Megatron args")
    shared = config.moe_shared_expert_intermediate_size
    if model_type == "mixtral":
        _need(all(config.moe_layers), model_type, f"dense and MoE layers are mixed (moe_layer_freq="
              f"{config.moe_layer_freq})", "use --model-type qwen2_moe (mlp_only_layers)")
        _need(not shared, model_type, "the model has shared experts", "use --model-type qwen2_moe")
        _need(not config.add_qkv_bias, model_type, "QKV has a bias, Mixtral's attention has none",
              "use --model-type qwen2_moe")
    else:
        _need(bool(shared) and config.moe_shared_expert_gate, model_type, "Qwen2-MoE has a shared expert with a "
              "sigmoid gate in every MoE layer; this model has " + ("an ungated shared expert" if shared else
                                                                      "no shared expert"),
              "use --model-type mixtral" if not shared else "train with --moe-shared-expert-gate")


def _hf_config(config: GPTModelConfig, args: dict, model_type: str, dtype: str) -> dict:
    eps = float(args.get("norm_epsilon", 1e-5) or 1e-5)
    # NullTokenizer and the byte-level tokenizer append EOD as the last token of the true vocabulary.
    eod = config.vocab_size - 1 if args.get("tokenizer_type") in ("NullTokenizer", "ByteLevelTokenizer") else None
    common = {"vocab_size": config.vocab_size, "torch_dtype": dtype, "dtype": dtype,
              "bos_token_id": eod, "eos_token_id": eod, "tie_word_embeddings": config.tied}
    if model_type != "gpt2":
        theta = float(args.get("rotary_base", 10000) or 10000)
        llama = {
            "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
            "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings or
            int(args.get("seq_length") or 2048),
            "rms_norm_eps": eps,
            "rope_theta": theta,  # transformers 4.x
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},  # transformers 5.x
            "rope_scaling": None, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        }
        if model_type == "llama":
            return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, **llama,
                    "attention_bias": bool(config.add_qkv_bias or config.add_bias_linear),
                    "mlp_bias": bool(config.add_bias_linear), "pretraining_tp": 1}
        moe = {"num_experts_per_tok": int(args["moe_router_topk"]), "output_router_logits": False,
               "router_aux_loss_coef": float(args.get("moe_aux_loss_coeff") or 0.0)}
        if model_type == "mixtral":
            return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common, **llama, **moe,
                    "intermediate_size": config.moe_ffn_hidden_size, "num_local_experts": config.num_experts,
                    "router_jitter_noise": 0.0, "sliding_window": None}
        return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **common, **llama, **moe,
                "num_experts": config.num_experts, "moe_intermediate_size": config.moe_ffn_hidden_size,
                "shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
                "norm_topk_prob": not args.get("moe_router_pre_softmax"), "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, moe_layer in enumerate(config.moe_layers) if not moe_layer],
                "qkv_bias": bool(config.add_qkv_bias), "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": config.num_layers}
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
        "n_positions": config.max_position_embeddings, "n_embd": config.hidden_size, "n_layer": config.num_layers,
        "n_head": config.num_attention_heads, "n_inner": config.ffn_hidden_size,
        "activation_function": "gelu",  # Megatron uses exact GELU (F.gelu); HF's default gelu_new is the tanh form
        "layer_norm_epsilon": eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "initializer_range": 0.02, "use_cache": True,
    }


def hf_state_dict(read: Callable[[str], torch.Tensor], config: GPTModelConfig, model_type: str
                  ) -> dict[str, torch.Tensor]:
    """HF tensors from canonical fp32 tensors (`read(name)`), vocabulary padding dropped (hf_names' table)."""
    out: dict[str, torch.Tensor] = {}
    for row in hf_rows(config, model_type):
        tensor = read(row.megatron) if row.megatron is not None else None
        out.update(zip(row.hf, to_hf(row, tensor, config)))
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
              overwrite: bool = False, progress: bool = True, clean_stale: bool = False) -> dict:
    """Write the HF model directory `dst` from the universal checkpoint `src`; returns a summary. DST's lock
    is held from before `src` is opened until the export is published."""
    import sys

    from safetensors.torch import save_file
    from tqdm import tqdm

    from megatron_ucp.commands.common import is_universal, open_any

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
            check_exportable(config, ucp.args, model_type)
            if dtype in (None, "auto"):
                dtypes = {p.model_dtype for p in ucp.parameters.values()}
                dtype = dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes), None) in DTYPES else "float32"
            bar = tqdm(total=sum(math.prod(p.shape) * 4 for p in ucp.parameters.values()), unit="B",
                       unit_scale=True, unit_divisor=1024, desc="export-hf", disable=not progress, file=sys.stderr,
                       dynamic_ncols=True)

            def read(name: str) -> torch.Tensor:
                tensor = ucp.read(name, "fp32")
                bar.update(tensor.numel() * 4)
                return tensor

            try:
                tensors = hf_state_dict(read, config, model_type)
            finally:
                bar.close()
            torch_dtype = DTYPES[dtype]
            tensors = {k: v.to(torch_dtype).contiguous() for k, v in tensors.items()}
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
            "num_tensors": len(tensors), "bytes_written": nbytes}


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "export-hf", parents=[common], help="write a Hugging Face transformers model from a universal checkpoint",
        description="Export the weights of a universal checkpoint as a Hugging Face transformers model directory "
                    "(config.json + model.safetensors): --model-type llama (SwiGLU, RMSNorm, RoPE), gpt2 "
                    "(GELU, LayerNorm, learned positions, tied), mixtral (MoE, routed experts only) or qwen2_moe "
                    "(MoE with a gated shared expert, dense layers allowed). Vocabulary padding rows are dropped.")
    p.add_argument("src", help="universal checkpoint directory (megatron-ucp to-universal's DST)")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--model-type", required=True, choices=MODEL_TYPES)
    p.add_argument("--dtype", default="auto", choices=("auto",) + tuple(DTYPES),
                   help="dtype of the exported weights (default: the model's training dtype)")
    add_publication_flags(p, "export", "megatron-ucp.json")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    result = export_hf(args.src, args.dst, args.model_type, dtype=args.dtype, overwrite=args.overwrite,
                       progress=not args.quiet, clean_stale=args.clean_stale)
    result["message"] = (f"wrote {result['path']}: {args.model_type} ({result['num_tensors']} tensors, "
                         f"{result['bytes_written'] / 2 ** 20:.1f} MiB, {result['dtype']}), iteration "
                         f"{result['iteration']}, vocab {result['vocab_size']} ({result['dropped_padding_rows']} "
                         f"padding rows dropped); no tokenizer files are written")
    return result
