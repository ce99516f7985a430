"""The Hugging Face models issue 41 names: DeepSeek-V2-Lite (refused, with megatron-core's own reason), Llama 3.2's
llama3 RoPE (factor 32) and DeepSeek-V3 / Kimi-K2 multi-token prediction layers, both ways.

DeepSeek-V2-Lite (q_lora_rank null): its kv_a_layernorm is megatron-core's kv_layernorm, which 0.19 builds only with
--qk-layernorm, and 0.19's MLA norm resolver then demands a norm fused into linear_q_proj (a norm V2-Lite's q_proj
does not have). The test asks megatron-core 0.19.2's resolver itself (both spellings of the local spec refused), so
the refusal is lifted the day a release builds the model; import-hf refuses a V2-Lite-shaped deepseek_v3 folder and a
deepseek_v2 one in one line each, nothing at DST.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]

# DeepSeek-V2-Lite's shape, tiny: MLA without query compression, a dense first layer, 4 routed experts
V2_LITE = dict(vocab_size=1024, max_position_embeddings=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, initializer_range=0.1)


def _one_line_refusal(hf: Path, dst: Path, expected: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", "import-hf", str(hf), str(dst), "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert not dst.exists()


def test_deepseek_v2_lite_is_refused_with_megatron_cores_reason(tmp_path):
    """megatron-core 0.19.2 cannot build MLA with the kv norm and no query compression: its resolver refuses the
    local spec (a q_layernorm with no compressed query) and, with the q norm taken out, asks for a norm fused into
    linear_q_proj (TransformerEngine's, which normalizes q_proj's input). import-hf refuses both V2-Lite spellings."""
    import dataclasses

    import transformers as tf

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(num_layers=1, hidden_size=48, num_attention_heads=4, q_lora_rank=None,
                                  kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
                                  qk_layernorm=True, normalization="RMSNorm", transformer_impl="local")
    attention = get_gpt_layer_local_spec(None, False, True, True, normalization="RMSNorm").submodules.self_attention
    with pytest.raises(ValueError, match="q_lora_rank is None`, meaning it will not be used"):
        QKNormConfigResolver(config, attention.submodules).resolve()
    with pytest.raises(RuntimeError, match="qk_layernorm requires TransformerEngine .* to build `linear_q_proj`"):
        QKNormConfigResolver(config, dataclasses.replace(attention.submodules, q_layernorm=IdentityOp)).resolve()
    # without --qk-layernorm it builds, but with no kv norm: not V2-Lite's function
    no_norm = get_gpt_layer_local_spec(None, False, False, True, normalization="RMSNorm").submodules.self_attention
    plain = QKNormConfigResolver(dataclasses.replace(config, qk_layernorm=False), no_norm.submodules).resolve()
    assert plain["kv_layernorm"] is IdentityOp

    torch.manual_seed(0)
    hf = tmp_path / "v2_lite_as_v3"
    tf.AutoModelForCausalLM.from_config(tf.DeepseekV3Config(**V2_LITE)).save_pretrained(hf)
    _one_line_refusal(hf, tmp_path / "out", "q_lora_rank=null (a query projection without compression: "
                      "DeepSeek-V2-Lite): Megatron's GPT cannot express it as deepseek_v3 (megatron-core 0.19 builds "
                      "DeepSeek's kv_a_layernorm only with --qk-layernorm")
    v2 = tmp_path / "v2_lite"
    tf.AutoModelForCausalLM.from_config(tf.DeepseekV2Config(**V2_LITE)).save_pretrained(v2)
    assert json.loads((v2 / "config.json").read_text())["model_type"] == "deepseek_v2"
    _one_line_refusal(v2, tmp_path / "out", "model type 'deepseek_v2' cannot be a Megatron GPT: ")
