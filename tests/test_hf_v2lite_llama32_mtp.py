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


# --- Llama 3.2: llama3 RoPE with factor 32 ------------------------------------------------------------------------
# Llama 3.2's rope_parameters (factor 32; Llama 3.1: 8) with its rope_theta. At 512 positions the factors' low and
# medium frequencies (wavelengths above 2048 of 8192 original positions) turn far enough apart to move the logits.
LLAMA32_SEQ = 512
LLAMA32_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TOL = 1e-5


def _llama32(rope: dict):
    """A seeded Llama-3.2-shaped tiny model (GQA, tied embeddings as Llama 3.2 1B/3B, head_dim 32), every
    parameter perturbed so norms are not 1."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
        vocab_size=1024, max_position_embeddings=LLAMA32_SEQ, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.1,
        tie_word_embeddings=True, rope_parameters=dict(rope)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def _tokens(vocab: int, seq: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def rel_diff(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """max |difference| / max |reference| over the true vocabulary (logits' own columns)."""
    vocab = logits.shape[-1]
    return ((logits - reference[..., :vocab]).abs().max() / reference[..., :vocab].abs().max()).item()


def _child(jobs: list, work: Path) -> list:
    """tests/mcore_gpt.py's universal_logits in a child process (its patches stay out of pytest's)."""
    torch.save(jobs, work / "jobs.pt")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "mcore_gpt.py"), str(work / "jobs.pt"),
                           str(work / "out.pt")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(work / "out.pt")


def test_llama32_rope_factor_32_is_what_the_entry_point_computes(tmp_path):
    """import-hf of a Llama-3.2-shaped model prints --use-rope-scaling --rope-scaling-factor 32.0; megatron-core's
    GPTModel built by the entry point's model provider from those flags computes transformers' logits (<= 1e-5
    relative at 512 positions); the same weights with factor 8 (Llama 3.1's, what Megatron-LM's own builder gives
    every llama3 model) miss by far. The loader's check refuses Megatron-LM 0.19's own builder (gpt_builders.py: no
    rope_scaling_factor) in one line naming the line to add, and that builder's model is indeed factor 8's."""
    from megatron_ucp.commands.import_hf import import_hf

    hf = tmp_path / "hf"
    model = _llama32(LLAMA32_ROPE)
    model.save_pretrained(hf)
    summary = import_hf(hf, tmp_path / "ucp", progress=False)
    flags = " ".join(summary["megatron_flags"])
    assert "--rotary-base 500000 --use-rope-scaling --rope-scaling-factor 32.0" in flags, flags
    tokens = _tokens(1024, LLAMA32_SEQ)
    job = {"ucp": str(tmp_path / "ucp"), "flags": summary["megatron_flags"], "tokens": tokens, "rope_check": True}
    entry, refused, plain = _child([{**job, "builder": "entry_point"}, {**job, "builder": "megatron_lm"},
                                    {**job, "builder": "megatron_lm", "rope_check": False}], tmp_path)
    with torch.no_grad():
        reference = model(tokens).logits
        factor8 = _llama32({**LLAMA32_ROPE, "factor": 8.0})
        factor8.load_state_dict(model.state_dict())
        reference8 = factor8(tokens).logits
    diff, control, plain8 = rel_diff(reference, entry), rel_diff(reference8, entry), rel_diff(reference8, plain)
    assert diff <= TOL, f"factor 32: megatron-core's logits differ from transformers' by {diff:.2e}"
    assert control > 100 * TOL, f"factor 8 only moves the logits by {control:.2e}"
    assert plain8 <= TOL and rel_diff(reference, plain) > 100 * TOL, "Megatron-LM's builder is not factor 8's"
    assert isinstance(refused, str) and refused.count("\n") == 0, refused
    assert ("llama3 scaling with factor 8, GPTModel's default, for --rope-scaling-factor 32" in refused
            and "add `rope_scaling_factor=args.rope_scaling_factor,` to the GPTModel(...) call" in refused), refused
    print(f"llama 3.2 (factor 32, {LLAMA32_SEQ} positions): logits {diff:.2e} relative; factor 8 {control:.2e}; "
          f"Megatron-LM's builder vs factor 8 {plain8:.2e}")


def test_llama3_rope_accepted_as_megatron_core_computes_it(tmp_path):
    """import-hf takes any llama3 factor (megatron-core's RotaryEmbedding takes it as a parameter) and refuses the
    other three keys at values other than _apply_scaling's defaults (RotaryEmbedding never passes them), in one line
    each; export-hf writes the run's factor back: the Llama 3.2 import exports bit for bit, the config transformers
    reads back is the original's (but token ids and the initializer's std)."""
    import inspect

    import transformers as tf
    from safetensors.torch import load_file

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron_ucp.adapters.hf import MEGATRON_DEFAULT_LLAMA3_FACTOR, MEGATRON_LLAMA3_ROPE
    from megatron_ucp.commands.export_hf import export_hf
    from megatron_ucp.commands.import_hf import HFImportError, import_hf, megatron_model

    defaults = {k: p.default for k, p in inspect.signature(RotaryEmbedding._apply_scaling).parameters.items()}
    assert {k: defaults[k] for k in MEGATRON_LLAMA3_ROPE} == MEGATRON_LLAMA3_ROPE
    init = inspect.signature(RotaryEmbedding.__init__).parameters
    assert init["rope_scaling_factor"].default == MEGATRON_DEFAULT_LLAMA3_FACTOR and not set(init) & set(defaults) - {
        "self", "factor"}
    base = _llama32(LLAMA32_ROPE).config.to_dict()
    for factor in (2.0, 8.0, 16, 32.0, 64.0):
        _, args = megatron_model({**base, "rope_parameters": {**LLAMA32_ROPE, "factor": factor}}, "llama")
        assert args["use_rope_scaling"] and args["rope_scaling_factor"] == float(factor)
    for key, value in (("low_freq_factor", 2.0), ("high_freq_factor", 8.0), ("original_max_position_embeddings", 4096)):
        with pytest.raises(HFImportError, match=f"llama3' with {key}={value!r}.*takes the llama3 factor only"):
            megatron_model({**base, "rope_parameters": {**LLAMA32_ROPE, key: value}}, "llama")
    with pytest.raises(HFImportError, match="llama3' factor -1.0 .* is not a positive number"):
        megatron_model({**base, "rope_parameters": {**LLAMA32_ROPE, "factor": -1.0}}, "llama")

    hf = tmp_path / "hf"
    _llama32(LLAMA32_ROPE).save_pretrained(hf)
    import_hf(hf, tmp_path / "ucp", progress=False)
    export_hf(tmp_path / "ucp", tmp_path / "back", "llama", dtype="float32", progress=False)
    original, exported = load_file(hf / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    exported.pop("lm_head.weight", None)  # tied: transformers does not save it
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[n].view(torch.int32), original[n].view(torch.int32)) for n in original)
    skip = ("bos_token_id", "eos_token_id", "initializer_range", "_name_or_path")
    config = {k: v for k, v in tf.AutoConfig.from_pretrained(tmp_path / "back").to_dict().items() if k not in skip}
    assert config["rope_parameters"] == LLAMA32_ROPE
    assert config == {k: v for k, v in tf.AutoConfig.from_pretrained(hf).to_dict().items() if k not in skip}
