"""The Hugging Face models issue 41 names: DeepSeek-V2-Lite (refused, with megatron-core's own reason), Llama 3.2's
llama3 RoPE (factor 32) and DeepSeek-V3 / Kimi-K2 multi-token prediction layers, both ways.

DeepSeek-V2-Lite (q_lora_rank null): its kv_a_layernorm is megatron-core's kv_layernorm, which 0.19 builds only with
--qk-layernorm, and 0.19's MLA norm resolver then demands a norm fused into linear_q_proj (a norm V2-Lite's q_proj
does not have). The test asks megatron-core 0.19.2's resolver itself (both spellings of the local spec refused), so
the refusal is lifted the day a release builds the model; import-hf refuses a V2-Lite-shaped deepseek_v3 folder and a
deepseek_v2 one in one line each, nothing at DST.

Llama 3.2 (rope_type llama3, factor 32, 512 positions): megatron-core's GPTModel built by the entry point's own model
provider from import-hf's printed flags computes transformers' logits within 1e-5 relative (measured 1.1e-6); the
same weights with factor 8 miss by 9.6e-3; Megatron-LM 0.19's own builder (no rope_scaling_factor) computes factor
8's logits (9.1e-7) and the loader's check refuses it in one line naming the line to add. import-hf takes any factor
and refuses other low/high frequency factors or original context lengths (RotaryEmbedding passes only the factor);
export-hf gives the import back bit for bit with the same config.

DeepSeek-V3 MTP (one MTP layer stored as HF layer 2 with enorm, hnorm, eh_proj, shared_head.norm and copies of the
embedding and lm_head): import-hf maps it to mtp.layers.0 and export-hf writes every HF tensor back bit for bit; the
MTP layer's logits of the entry point's GPTModel equal DeepSeek's MTP computed from the HF weights with transformers'
modules (eh_proj over [enorm(embedding of the next token); hnorm(final hidden state)], the stored layer, its
shared_head.norm, lm_head) within 1e-5 (measured 5.7e-7); eh_proj's halves swapped miss by 1.3, the hidden state
before the final norm by 1.8e-2. Kimi-K2 (model_type kimi_k2) imports to the same tensors and exports back bit for
bit; --drop-mtp both ways; a copy that differs, an incomplete MTP layer and an MTP export as llama are refused.
Trained through the entry point at TP2 EP2 ETP1 SP from the import, iteration 1's mtp_1 loss equals DeepSeek's MTP
loss of the HF weights on that batch (4.0e-9 relative).
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


# --- DeepSeek-V3 / Kimi-K2 multi-token prediction layers, both ways -----------------------------------------------
# DeepSeek-V3-shaped, tiny: MLA with q-LoRA, the first layer dense, 4 routed experts top-2 and a shared one, the
# sigmoid router with its correction bias; one MTP layer stored as layer 2 (num_nextn_predict_layers=1)
DEEPSEEK = dict(vocab_size=1024, max_position_embeddings=64, hidden_size=48, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=4, initializer_range=0.1, q_lora_rank=24, kv_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                routed_scaling_factor=2.5)
MTP_SEQ = 32


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    """A DeepSeek-V3 folder with its MTP layer as DeepSeek stores it: a 3-layer transformers model (seeded, every
    parameter perturbed, correction biases N(0, 0.5)) saved as 2 layers + layer 2 with enorm, hnorm, eh_proj,
    shared_head.norm and the copies embed_tokens / shared_head.head; (folder, MTP tensors {name: tensor})."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.DeepseekV3Config(**DEEPSEEK, num_hidden_layers=3))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.5)
    hf = tmp_path_factory.mktemp("deepseek_mtp") / "hf"
    model.save_pretrained(hf)
    tensors = load_file(hf / "model.safetensors")
    g, h = torch.Generator().manual_seed(1), DEEPSEEK["hidden_size"]
    mtp = {"enorm.weight": 1 + 0.1 * torch.randn(h, generator=g), "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
           "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
           "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
           "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
           "shared_head.head.weight": tensors["lm_head.weight"].clone()}
    tensors.update({f"model.layers.2.{k}": v for k, v in mtp.items()})
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}))
    return hf, {k: v for k, v in tensors.items() if k.startswith("model.layers.2.")}


def _mtp_reference(hf: Path, tokens: torch.Tensor, swap_eh_halves: bool = False, pre_norm: bool = False):
    """DeepSeek-V3's MTP layer 1 from the HF weights with transformers' own modules, independently of megatron-core:
    h = the main model's last hidden state (after model.norm), e = embed_tokens of the tokens one ahead;
    eh_proj([enorm(e); hnorm(h)]), then the stored layer 2 as a one-layer DeepseekV3Model (its MoE layer, causal
    attention over positions 0..s-1, its norm = shared_head.norm), then lm_head: logits [b, s - 1, vocabulary]
    predicting the token two ahead. Controls: eh_proj's halves swapped ([h; e]), or h before model.norm."""
    import transformers as tf
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    import tempfile

    from safetensors.torch import save_file

    main = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    weights = load_file(hf / "model.safetensors")
    config = main.config
    # layer 2 as layer 0 of a one-layer model (MoE: first_k_dense_replace 0), its final norm shared_head.norm,
    # loaded by transformers from the Hub layout (it fuses the experts on load)
    own = ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head")
    state = {k.replace("model.layers.2.", "model.layers.0."): v for k, v in weights.items()
             if k.startswith("model.layers.2.") and k.split(".")[3] not in own}
    state |= {"model.norm.weight": weights["model.layers.2.shared_head.norm.weight"],
              "model.embed_tokens.weight": weights["model.embed_tokens.weight"],
              "lm_head.weight": weights["lm_head.weight"]}
    with tempfile.TemporaryDirectory() as folder:
        tf.DeepseekV3Config(**{**config.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0,
                               "num_nextn_predict_layers": 0}).save_pretrained(folder)
        save_file(state, f"{folder}/model.safetensors", metadata={"format": "pt"})
        layer = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def norm(name: str) -> torch.nn.Module:
        module = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        module.weight.data.copy_(weights[f"model.layers.2.{name}.weight"])
        return module

    with torch.no_grad():
        captured = []  # the last layer's output, before model.norm (the control)
        hook = main.model.layers[-1].register_forward_hook(
            lambda module, inputs, output: captured.append(output[0] if isinstance(output, tuple) else output))
        h = main.model(tokens).last_hidden_state
        hook.remove()
        h = captured[0] if pre_norm else h
        h = h[:, :-1]
        e = main.model.embed_tokens(tokens[:, 1:])
        halves = [norm("enorm")(e), norm("hnorm")(h)]
        x = torch.nn.functional.linear(torch.cat(halves[::-1] if swap_eh_halves else halves, dim=-1),
                                       weights["model.layers.2.eh_proj.weight"])
        return layer.lm_head(layer.model(inputs_embeds=x).last_hidden_state)


def test_deepseek_mtp_layer_round_trips_and_computes_deepseeks_mtp(deepseek_mtp, tmp_path):
    """import-hf maps the stored MTP layer to Megatron's mtp.layers.0 (--mtp-num-layers 1 printed; the copies of the
    embedding and output layer checked equal, not stored twice); export-hf writes every HF tensor back bit for bit
    (layer 2 and its copies included) with num_nextn_predict_layers=1. megatron-core's GPTModel built by the entry
    point from the printed flags computes, in its MTP layer, the logits of DeepSeek's MTP from the HF weights with
    transformers' modules (<= 1e-5 relative over positions 0..s-2); eh_proj's halves swapped or the hidden state
    taken before the final norm miss by far. The main logits stay transformers'."""
    import transformers as tf
    from safetensors.torch import load_file

    from megatron_ucp.commands.export_hf import export_hf
    from megatron_ucp.commands.import_hf import import_hf
    from megatron_ucp.universal import UniversalCheckpoint

    hf, stored = deepseek_mtp
    summary = import_hf(hf, tmp_path / "ucp", progress=False)
    assert summary["mtp_layers"] == 1 and "--mtp-num-layers 1" in " ".join(summary["megatron_flags"])
    ucp = UniversalCheckpoint.open(tmp_path / "ucp")
    mtp_params = sorted(n for n in ucp.parameters if n.startswith("mtp.layers.0."))
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight", "mtp.layers.0.mtp_model_layer.mlp.router.expert_bias"} <= \
        set(mtp_params) and len(mtp_params) == 25
    assert torch.equal(ucp.read("mtp.layers.0.final_layernorm.weight"),
                       stored["model.layers.2.shared_head.norm.weight"])

    export_hf(tmp_path / "ucp", tmp_path / "back", "deepseek_v3", dtype="float32", progress=False)
    original, exported = load_file(hf / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert exported.keys() == original.keys(), set(exported) ^ set(original)
    assert all(torch.equal(exported[n].view(torch.int32), original[n].view(torch.int32)) for n in original)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    tokens = _tokens(1024, MTP_SEQ)
    [(logits, [mtp])] = _child([{"ucp": str(tmp_path / "ucp"), "flags": summary["megatron_flags"], "tokens": tokens,
                                 "builder": "entry_point", "mtp": True}], tmp_path)
    with torch.no_grad():
        main = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        main_diff = rel_diff(main(tokens).logits, logits)
    reference = _mtp_reference(hf, tokens)
    diff = rel_diff(reference, mtp[:, :-1])
    swapped = rel_diff(_mtp_reference(hf, tokens, swap_eh_halves=True), mtp[:, :-1])
    pre_norm = rel_diff(_mtp_reference(hf, tokens, pre_norm=True), mtp[:, :-1])
    assert main_diff <= TOL, f"main logits differ by {main_diff:.2e}"
    assert diff <= TOL, f"MTP logits differ from DeepSeek's MTP by {diff:.2e}"
    assert swapped > 100 * TOL and pre_norm > 100 * TOL, (swapped, pre_norm)
    assert rel_diff(logits[:, 1:], mtp[:, :-1]) > 0.1  # the MTP head predicts another token than the main head
    print(f"deepseek_v3 MTP: main logits {main_diff:.3e}, MTP logits {diff:.3e}; eh_proj halves swapped "
          f"{swapped:.2e}, hidden before the final norm {pre_norm:.2e}")


def test_kimi_k2_and_mtp_refusals(deepseek_mtp, tmp_path):
    """A Kimi-K2 config (model_type kimi_k2, DeepSeek-V3's layout) imports to the same universal tensors as the
    deepseek_v3 folder and exports back bit for bit as kimi_k2 (architectures DeepseekV3ForCausalLM); --drop-mtp
    leaves the MTP layer out both ways. Refused in one line, nothing written: an MTP copy of the embedding that
    differs from model.embed_tokens, an incomplete MTP layer, export-hf of an MTP model as a family without MTP
    layers (llama), and GLM-4.5 (glm4_moe: not mapped)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_ucp.commands.export_hf import export_hf
    from megatron_ucp.commands.import_hf import import_hf
    from megatron_ucp.universal import UniversalCheckpoint

    hf, _ = deepseek_mtp
    kimi = tmp_path / "kimi"
    shutil.copytree(hf, kimi)
    config = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    import_hf(hf, tmp_path / "ucp_v3", progress=False)
    summary = import_hf(kimi, tmp_path / "ucp_kimi", progress=False)
    assert summary["model_type"] == "kimi_k2" and summary["mtp_layers"] == 1
    a, b = UniversalCheckpoint.open(tmp_path / "ucp_v3"), UniversalCheckpoint.open(tmp_path / "ucp_kimi")
    assert a.parameters.keys() == b.parameters.keys()
    assert all(torch.equal(a.read(n), b.read(n)) for n in a.parameters)
    export_hf(tmp_path / "ucp_kimi", tmp_path / "kimi_back", "kimi_k2", dtype="float32", progress=False)
    back = json.loads((tmp_path / "kimi_back" / "config.json").read_text())
    assert back["model_type"] == "kimi_k2" and back["architectures"] == ["DeepseekV3ForCausalLM"]
    original, exported = load_file(hf / "model.safetensors"), load_file(tmp_path / "kimi_back" / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[n].view(torch.int32), original[n].view(torch.int32)) for n in original)

    dropped = import_hf(kimi, tmp_path / "ucp_dropped", progress=False, drop_mtp=True)
    assert dropped["mtp_layers"] == 0 and dropped["dropped_mtp_tensors"] == sum(
        n.startswith("model.layers.2.") for n in original)
    assert not any(n.startswith("mtp.") for n in UniversalCheckpoint.open(tmp_path / "ucp_dropped").parameters)
    export_hf(tmp_path / "ucp_kimi", tmp_path / "no_mtp", "kimi_k2", dtype="float32", progress=False, drop_mtp=True)
    without = load_file(tmp_path / "no_mtp" / "model.safetensors")
    assert without.keys() == {n for n in original if not n.startswith("model.layers.2.")}
    assert json.loads((tmp_path / "no_mtp" / "config.json").read_text())["num_nextn_predict_layers"] == 0

    bad = tmp_path / "bad_copy"
    shutil.copytree(hf, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.2.embed_tokens.weight"][7, 3] += 1
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    _one_line_refusal(bad, tmp_path / "out", "model.layers.2.embed_tokens.weight differs from model.embed_tokens."
                      "weight; megatron-core's multi-token prediction layers use the model's own embedding")
    del tensors["model.layers.2.eh_proj.weight"]
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    _one_line_refusal(bad, tmp_path / "out", "1 tensor(s) missing, e.g. model.layers.2.eh_proj.weight")
    glm = tmp_path / "glm"
    glm.mkdir()
    (glm / "config.json").write_text(json.dumps({"model_type": "glm4_moe", "num_nextn_predict_layers": 1}))
    _one_line_refusal(glm, tmp_path / "out", "model type 'glm4_moe' cannot be a Megatron GPT: megatron-ucp does not "
                      "map GLM-4.5 yet")
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", "export-hf", str(tmp_path / "ucp_v3"),
                           str(tmp_path / "x"), "--model-type", "llama"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert ("the model has 1 multi-token prediction layer(s) (--mtp-num-layers); LlamaForCausalLM checkpoints have "
            "none; pass --drop-mtp to export the model without them, or use --model-type deepseek_v3 or kimi_k2"
            in proc.stderr), proc.stderr
    assert not (tmp_path / "x").exists()


def test_imported_mtp_trains_from_deepseeks_mtp_loss(deepseek_mtp, tmp_path):
    """The MTP import trained through the entry point (Megatron-LM 0.19's own loop, --universal-checkpoint) at TP2
    EP2 ETP1 with sequence parallelism: iteration 1's mtp_1 loss (before any update) equals DeepSeek's MTP loss of the
    HF weights on that global batch (_mtp_reference's logits against the token two ahead, megatron-core's average of
    each micro-batch's token mean) within 1e-5 relative (measured 4.0e-9), and the lm loss transformers' (1.0e-8);
    eh_proj's halves swapped miss the MTP loss by 1.0e-4 (a near-uniform tiny model's loss moves little: the MTP
    logits themselves miss by 1.3, test above)."""
    import transformers as tf
    from pretrain_runs import Layout, read_records, run_pretrain
    from test_hf_import import TRAIN, first_batch, hf_loss

    from megatron_ucp.commands.import_hf import import_hf

    hf, _ = deepseek_mtp
    summary = import_hf(hf, tmp_path / "ucp", progress=False)
    flags = [*summary["megatron_flags"], *TRAIN, "--train-iters", "2"]
    jsonl = tmp_path / "run.jsonl"
    run_pretrain(Layout(tp=2, ep=2, etp=1, sp=True), [*flags, "--load", str(tmp_path / "ucp"),
                                                       "--universal-checkpoint", "--log-jsonl", str(jsonl)],
                 tmp_path, "mtp")
    first = read_records(jsonl)[1]
    tokens, labels, mask = first_batch(flags)
    micro = 2  # TRAIN's --micro-batch-size: Megatron-LM's sampler gives each micro-batch consecutive samples

    def mtp_loss(**control) -> float:
        logits = _mtp_reference(hf, tokens, **control).double()  # position i predicts labels[i + 1]
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="none")
        m = mask[:, 1:].double()
        per_micro = [(losses[b: b + micro] * m[b: b + micro]).sum() / m[b: b + micro].sum()
                     for b in range(0, len(tokens), micro)]
        return torch.stack(per_micro).mean().item()

    reference = mtp_loss()
    diff = abs(first["mtp_1_loss"] - reference) / reference
    lm = hf_loss(tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval(), (tokens, labels, mask))
    lm_diff = abs(first["lm_loss"] - lm) / lm
    broken = abs(first["mtp_1_loss"] - mtp_loss(swap_eh_halves=True)) / reference
    assert diff <= TOL and lm_diff <= TOL, (first, reference, lm)
    assert broken > 10 * TOL, f"eh_proj halves swapped only move the MTP loss by {broken:.2e}"
    print(f"deepseek_v3 MTP at TP2 EP2 ETP1 SP: mtp_1 loss {diff:.2e}, lm loss {lm_diff:.2e}; eh_proj halves "
          f"swapped {broken:.2e}")
