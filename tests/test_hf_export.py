"""export-hf: Hugging Face transformers computes the same logits as megatron-core on the same checkpoint.

Fixtures A (llama-like: GQA 2 groups of 2 heads, SwiGLU, RMSNorm, RoPE, untied, no biases) and C (gpt2-like:
LayerNorm, GELU, learned positions, tied, biases), both at iteration 8, converted to universal checkpoints
and exported with `megatron-ucp export-hf`; plus an "amplified" copy of each (QKV weights x6, fc1 x10) whose
attention is sharp and whose activations reach GELU's curved range, so conventions that barely matter at
init scale (exact vs tanh GELU: 5e-6 on the fixture, 1e-4 amplified) cannot pass unnoticed.
The megatron-core side is a megatron-core 0.19 TP1 PP1 GPTModel (local spec, cpu_shims) built from the
checkpoint's own flags as Megatron-LM 0.19 builds it (tests/mcore_gpt.py) and filled with the universal tensors
(which are the TP1 tensors); it runs in a child process so the CPU patches and process group stay out of the
test process.
Tolerance: max |logit difference| <= 1e-5 (fp32, CPU; observed <= 6e-7) over the true vocabulary.

Run as a script (`python tests/test_hf_export.py UCP OUT.pt`) it is that child process.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "megatron-lm"
SOURCES = {"llama": FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt",
           "gpt2": FIXTURES / "C_gpt2_tp2pp2dp1_adam_torch" / "ckpt"}
SEQ, BATCH = 32, 2
AMPLIFY = {"self_attention.linear_qkv.weight": 6.0, "mlp.linear_fc1.": 10.0}
VARIANTS = [(m, v) for m in SOURCES for v in ("fixture", "amplified")]


def tokens_for(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def amplified_copy(src: Path, dst: Path) -> Path:
    """A universal checkpoint with AMPLIFY's weights scaled (weights only)."""
    from megatron_ucp.adapters.gpt import expected_parameters
    from megatron_ucp.universal import UniversalCheckpoint, UniversalWriter

    ucp = UniversalCheckpoint.open(src)
    with UniversalWriter(dst) as writer:
        for name, info in ucp.parameters.items():
            scale = next((s for key, s in AMPLIFY.items() if key in name), 1.0)
            writer.write_parameter(name, {"fp32": ucp.read(name) * scale},
                                   {"pattern": info.pattern, "step": None, "model_dtype": info.model_dtype})
        return writer.finish({k: v for k, v in ucp.metadata.items() if k not in ("parameters", "format", "version")},
                             expected_parameters(ucp.config))


def megatron_flags(ucp) -> list[str]:
    """Megatron-LM 0.19 flags that rebuild the checkpoint's model at TP1 PP1 (from its metadata)."""
    c, a = ucp.config, ucp.args
    flags = ["--num-layers", c.num_layers, "--hidden-size", c.hidden_size, "--ffn-hidden-size", c.ffn_hidden_size,
             "--num-attention-heads", c.num_attention_heads, "--kv-channels", c.kv_channels,
             "--seq-length", a["seq_length"], "--max-position-embeddings", c.max_position_embeddings,
             "--micro-batch-size", 1, "--train-iters", 1, "--lr", 1e-3, "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", c.vocab_size,  # Megatron-LM 0.19: EOD included
             "--attention-dropout", 0, "--hidden-dropout", 0,
             "--normalization", c.normalization, "--position-embedding-type", c.position_embedding_type,
             "--norm-epsilon", a.get("norm_epsilon", 1e-5), "--rotary-base", a.get("rotary_base", 10000)]
    if c.num_query_groups != c.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", c.num_query_groups]
    flags += ["--swiglu"] * c.swiglu + ["--untie-embeddings-and-output-weights"] * (not c.tied)
    flags += ["--disable-bias-linear"] * (not c.add_bias_linear) + ["--add-qkv-bias"] * c.add_qkv_bias
    return [str(f) for f in flags]


def megatron_logits(ucp_paths: list[str]) -> list[torch.Tensor]:
    """Child process: megatron-core forwards of universal checkpoints at TP1 PP1, logits [b, s, padded]."""
    from mcore_gpt import build_gpt, causal_logits, fill_from_universal, gpt_args, single_process

    from megatron_ucp.universal import UniversalCheckpoint

    results = []
    with single_process():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        for path in ucp_paths:
            ucp = UniversalCheckpoint.open(path)
            model_parallel_cuda_manual_seed(1)
            model = build_gpt(gpt_args(megatron_flags(ucp), ucp.config.padded_vocab_size))
            fill_from_universal(model, ucp)
            results.append(causal_logits(model, tokens_for(ucp.config.vocab_size)))
    return results


def _user_cli(*argv):
    """`megatron-ucp ARGV` in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "megatron_ucp.cli", *map(str, argv)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{(model_type, variant): (universal dir, HF dir, megatron-core logits)}."""
    from megatron_ucp.convert import to_universal

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for model_type, src in SOURCES.items():
        ucp = to_universal(src, root / f"ucp_{model_type}_fixture", iteration=8, progress=False)
        for variant in ("fixture", "amplified"):
            if variant == "amplified":
                ucp = amplified_copy(ucp, root / f"ucp_{model_type}_amplified")
            hf = root / f"hf_{model_type}_{variant}"
            assert _user_cli("export-hf", ucp, hf, "--model-type", model_type, "--quiet").returncode == 0
            out[(model_type, variant)] = [ucp, hf]
    # one child process computes the megatron-core logits of all checkpoints
    proc = subprocess.run([sys.executable, __file__, str(root), *(str(out[k][0]) for k in VARIANTS)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for key in VARIANTS:
        out[key].append(torch.load(root / f"{Path(out[key][0]).name}.logits.pt"))
    return out


@pytest.mark.parametrize("model_type,variant", VARIANTS)
def test_hf_logits_match_megatron_core(exported, model_type, variant):
    from transformers import AutoModelForCausalLM

    ucp, hf_dir, reference = exported[(model_type, variant)]
    config = json.loads((hf_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    assert vocab == 1001 and reference.shape == (BATCH, SEQ, 1024)  # padding rows dropped
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[model_type]
    with torch.no_grad():
        logits = model(tokens_for(vocab)).logits
    assert logits.shape == (BATCH, SEQ, vocab)
    assert reference.std() > 0.1  # a trained model's logits, not zeros
    torch.testing.assert_close(logits, reference[..., :vocab], atol=1e-5, rtol=0)


def test_export_refuses_wrong_family_and_existing_output(exported):
    ucp_gpt2, hf_gpt2, _ = exported[("gpt2", "fixture")]
    proc = _user_cli("export-hf", ucp_gpt2, hf_gpt2.parent / "x", "--model-type", "llama")
    assert proc.returncode == 1 and "the MLP is GELU, Llama's is SwiGLU; use --model-type gpt2" in proc.stderr
    proc = _user_cli("export-hf", ucp_gpt2, hf_gpt2, "--model-type", "gpt2")
    assert proc.returncode == 1 and "already exists; choose another destination, or pass --overwrite" in proc.stderr
    proc = _user_cli("export-hf", SOURCES["gpt2"], hf_gpt2.parent / "y", "--model-type", "gpt2")
    assert proc.returncode == 1 and "convert it first" in proc.stderr
    assert not (hf_gpt2.parent / "x").exists() and not (hf_gpt2.parent / "y").exists()
    config = json.loads((hf_gpt2 / "config.json").read_text())
    assert config["activation_function"] == "gelu" and config["tie_word_embeddings"] is True


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/: mcore_gpt
    out_dir, paths = Path(sys.argv[1]), sys.argv[2:]
    for path, logits in zip(paths, megatron_logits(paths)):
        torch.save(logits, out_dir / f"{Path(path).name}.logits.pt")
