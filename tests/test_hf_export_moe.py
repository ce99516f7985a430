"""export-hf for mixture-of-experts models: transformers' Mixtral and Qwen2-MoE compute the logits megatron-core
computes on the same universal checkpoint.

Two GPT-MoE models in the shape of tests/pretrain_runs' families (4 layers, hidden 48, GQA 2 groups of 4 heads,
SwiGLU, RMSNorm, RoPE, untied, no biases; 4 experts, top-2, expert ffn 32):
- mixtral: every layer MoE (--moe-layer-freq 1), routed experts only;
- qwen2_moe: dense and MoE layers mixed (--moe-layer-freq [0,1,0,1]: HF's mlp_only_layers [0, 2]) and a shared
  expert of 32 with its sigmoid gate (--moe-shared-expert-gate).
A child process builds each model with megatron-core 0.19 as Megatron-LM 0.19 builds it (TP1 PP1 EP1, local spec,
cpu_shims; tests/mcore_gpt.py), vocabulary 1001 (NullTokenizer --vocab-size 1001: Megatron-LM 0.19 counts EOD in it),
initialised with --init-method-std 0.1 so that the router's choices and every expert matter (logits' std 0.69), writes its weights as a universal
checkpoint (UniversalWriter: the same files to-universal writes) and computes the reference logits; the test
exports that checkpoint with the CLI and runs the HF class.
Tolerance: max |logit difference| <= 1e-5 (fp32, CPU; measured 1.3e-6 Mixtral, 1.6e-6 Qwen2-MoE; at std 0.2 the
fp32 rounding alone reaches 8e-6). Negative control: the same HF model with two experts of one layer swapped
must miss it by far (> 1e-3; measured 1.2 and 1.0), so the comparison sees a wrong
expert mapping. A Mixtral export of the mixed model is refused, naming qwen2_moe.

Run as a script (`python tests/test_hf_export_moe.py OUT_DIR`) it is that child process.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain_runs import COMMON, FAMILIES  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 32, 2
TOL, BROKEN = 1e-5, 1e-3
VOCAB = 1001  # with EOD; padded to 1024
MOE_BASE = [f for f in FAMILIES["llama"]] + ["--num-experts", "4", "--moe-router-topk", "2",
                                              "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2",
                                              "--vocab-size", str(VOCAB)]  # the last --vocab-size counts
MODELS = {
    "mixtral": MOE_BASE + ["--moe-layer-freq", "1"],
    "qwen2_moe": MOE_BASE + ["--moe-layer-freq", "[0,1,0,1]", "--moe-shared-expert-intermediate-size", "32",
                             "--moe-shared-expert-gate"],
}
HF_CLASS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
assert "--num-layers" in COMMON


def tokens_for(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def build_checkpoints(out_dir: Path) -> None:
    """Child process: per model, a universal checkpoint of a megatron-core GPT-MoE and its logits."""
    from mcore_gpt import build_gpt, causal_logits, gpt_args, single_process

    from megatron_ucp.adapters.gpt import canonical_name, expected_parameters, pad_vocab_size, pattern_for
    from megatron_ucp.core.layout import ParallelLayout
    from megatron_ucp.core.model_config import GPTModelConfig
    from megatron_ucp.universal import UniversalWriter

    with single_process():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        for model_type, flags in MODELS.items():
            model_parallel_cuda_manual_seed(1234)
            torch.manual_seed(1234)
            args = gpt_args([*flags, "--train-iters", "1", "--init-method-std", "0.1"],
                            pad_vocab_size(VOCAB, 128, 1))
            config = GPTModelConfig.from_megatron_args(args)
            assert config.vocab_size == VOCAB, config.vocab_size  # Megatron-LM 0.19's reading of --vocab-size
            model = build_gpt(args)
            model.eval()
            with UniversalWriter(out_dir / f"ucp_{model_type}") as writer:
                for local, param in model.named_parameters():
                    name = canonical_name(local, ParallelLayout(), 0, None, config.num_layers, tied=config.tied,
                                          config=config)
                    writer.write_parameter(name, {"fp32": param.detach().clone()},
                                           {"pattern": pattern_for(name, config), "step": None,
                                            "model_dtype": "float32"})
                keep = ("seq_length", "micro_batch_size", "global_batch_size", "tokenizer_type", "norm_epsilon",
                        "rotary_base", "rotary_percent", "moe_router_topk", "moe_aux_loss_coeff",
                        "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                        "moe_router_num_groups", "moe_input_jitter_eps", "num_experts", "moe_layer_freq")
                writer.finish({"iteration": 0, "consumed_train_samples": 0, "model_config": config.to_dict(),
                               "args": {k: getattr(args, k, None) for k in keep},
                               "source": {"format": "torch_dist", "path": "megatron-core (test)",
                                          "layout": ParallelLayout().to_dict(), "optimizer_kind": "none"},
                               "optimizer": {"type": None, "param_groups": []}, "scheduler": {}},
                              expected_parameters(config))
            torch.save(causal_logits(model, tokens_for(config.vocab_size)), out_dir / f"{model_type}.logits.pt")


def _user_cli(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_ucp.cli", *map(str, argv)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    proc = subprocess.run([sys.executable, __file__, str(root)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.parametrize("model_type", list(MODELS))
def test_moe_hf_logits_match_megatron_core(built, model_type):
    from transformers import AutoModelForCausalLM

    hf_dir = built / f"hf_{model_type}"
    run = _user_cli("export-hf", built / f"ucp_{model_type}", hf_dir, "--model-type", model_type, "--quiet")
    assert run.returncode == 0, run.stderr
    reference = torch.load(built / f"{model_type}.logits.pt")
    config = json.loads((hf_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    assert vocab == 1001 and reference.shape == (BATCH, SEQ, 1024)
    if model_type == "qwen2_moe":
        assert config["mlp_only_layers"] == [0, 2] and config["shared_expert_intermediate_size"] == 32
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == HF_CLASS[model_type]
    with torch.no_grad():
        logits = model(tokens_for(vocab)).logits
    assert reference.std() > 0.5  # sharp enough that routing and experts matter
    diff = (logits - reference[..., :vocab]).abs().max().item()
    assert diff <= TOL, f"{model_type}: max |logit diff| {diff:.2e}"

    # negative control: experts 0 and 1 of layer 1 (an MoE layer in both models) swapped
    experts = model.model.layers[1].mlp.experts
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.down_proj):
            p[[0, 1]] = p[[1, 0]].clone()
        broken = (model(tokens_for(vocab)).logits - reference[..., :vocab]).abs().max().item()
    assert broken > BROKEN, f"{model_type}: swapped experts only differ by {broken:.2e}"


def test_moe_export_refusals(built, tmp_path):
    run = _user_cli("export-hf", built / "ucp_qwen2_moe", tmp_path / "x", "--model-type", "mixtral")
    assert run.returncode == 1 and "dense and MoE layers are mixed" in run.stderr and "qwen2_moe" in run.stderr
    run = _user_cli("export-hf", built / "ucp_mixtral", tmp_path / "y", "--model-type", "qwen2_moe")
    assert run.returncode == 1 and "no shared expert" in run.stderr and "mixtral" in run.stderr
    run = _user_cli("export-hf", built / "ucp_mixtral", tmp_path / "z", "--model-type", "llama")
    assert run.returncode == 1 and "use --model-type mixtral" in run.stderr
    assert not any((tmp_path / n).exists() for n in "xyz")


if __name__ == "__main__":
    build_checkpoints(Path(sys.argv[1]))
