"""import-hf: a Hugging Face model becomes a universal checkpoint that megatron-core computes exactly as transformers
does, and that trains at any layout from the same loss.

Models (no hub access): transformers' own classes built from their config classes (fp32), seeded, every parameter
then perturbed (N(0, 0.02) added, so norms are not 1 and biases not 0 and a wrong norm or bias mapping shows), all
2 layers, hidden 48, 4 heads in 2 query groups, initializer_range 0.1 (sharp enough attention that a swapped head
shows), vocabulary 1024 (NullTokenizer --vocab-size 1024 with Megatron-LM 0.19: no padding rows):
- llama: SwiGLU 64, untied, Llama 3.1's RoPE scaling (rope_type llama3, factor 8), saved SHARDED (index + files);
- mistral: vocabulary 1000 (padded to 1024: 24 padding rows, which only add logits columns);
- qwen2: QKV biases, and a tokenizer in the folder (tokenizer.json: the printed flags use HuggingFaceTokenizer);
- qwen3: per-head QK RMSNorm (head_dim 16 != hidden / heads);
- gpt2: exact GELU (`activation_function="gelu"`), tied, biases;
- mixtral: 4 experts top-2 of 32, every layer MoE;
- qwen2_moe: layer 0 dense (mlp_only_layers=[0]), 4 experts top-2 of 32, a gated shared expert of 32, QKV biases,
  norm_topk_prob=false (Megatron's --moe-router-pre-softmax);
- qwen3_moe: QK norm, layer 0 dense, 4 experts top-2 of 32, norm_topk_prob=true (Megatron's default router);
- deepseek_v3: multi-latent attention (q_lora 24, kv_lora 16, qk_nope 16, qk_rope 8, v 12), YaRN (factor 40,
  mscale 1, mscale_all_dim 0.8), layer 0 dense, 4 routed experts top-2 in 2 groups (one chosen) of 32 and a shared
  expert, the sigmoid router with its correction bias N(0, 0.5) and routed_scaling_factor 2.5;
- deepseek_v3_halves (a variant): rope_interleave=false (RoPE rows imported through a row permutation), plain
  RoPE, 2 shared experts, no group limit.

Logits (every family): megatron-core 0.19's GPTModel built from the flags import-hf prints (Megatron-LM's parser,
validate_args and model provider, the universal loader's check_compatible; tests/mcore_gpt.py, all families in one
child process), filled from the import, on the same token ids as transformers: max |difference| / max |logit|
<= 1e-5 over the true vocabulary (measured 4.4e-7 - 7.2e-7). Negative controls: the HF model with K heads 0 and 1
swapped in every layer (MLA: kv_b_proj heads 0 and 1) misses by > 1e-5 (measured 0.33 - 1.4), llama's HF model
with unscaled RoPE misses Megatron's llama3 scaling (measured 4.6e-3), and DeepSeek's with RoPE rows not permuted,
plain RoPE for YaRN or the correction bias zeroed miss by 0.36, 0.84, 0.95; printed with -s. Export back:
`export-hf` (fp32) of each import writes the original tensors bit for bit (deepseek_v3: the config transformers
reads back too, but token ids and initializer_range; the halves variant in DeepSeek's interleaved layout, its
RoPE rows permuted, logits equal), and transformers loads it as the same class computing the same logits bitwise.
MTP layers (DeepSeek's, stored after the decoder's; a universal checkpoint's --mtp-num-layers) are left out with
--drop-mtp both ways (tests/test_hf_v2lite_llama32_mtp.py maps them).

End to end (tests/pretrain_runs, torchrun, gloo, CPU): the llama, gpt2, qwen2_moe and deepseek_v3 imports are loaded
with `--universal-checkpoint` at TP2 PP2 (qwen2_moe: EP2 ETP1, sequence parallel; deepseek_v3: TP2 PP1 EP2 ETP1
SP) and trained 8 iterations with
--mock-data; the first iteration's lm loss (before any update) is compared with transformers' loss on exactly
that global batch (megatron-core's MockGPTDataset samples 0..7, built here with the run's own flags).
Tolerance: 1e-5 relative (fp32; measured 3.1e-8 llama (llama3 RoPE), 4.0e-9 gpt2, 3.8e-9 qwen2_moe, 7.4e-8 deepseek_v3).
Negative control: the HF model with query groups 0 and 1 swapped in every layer's q/k/v_proj (what a QKV fusion that
mixes up groups would load; deepseek_v3: kv_b_proj heads 0 and 1) must miss by > 1e-5 (measured 2.2e-2, 9.6e-4,
1.3e-3, 1.5e-2: margins 96x or more; printed with -s).
`from-universal` writes the llama and qwen2_moe imports as Megatron-LM checkpoints (legacy torch at EP1,
torch_dist at EP2 ETP1) at TP2 PP2: `verify` finds every tensor equal (atol 0).

Round trip: `export-hf` (fp32) of Megatron-LM's trained fixtures A (llama) and C (gpt2) and `import-hf` of the
export give back every true-vocabulary row of every fp32 master bit for bit.

Checked inputs (each a small crafted folder): one error line naming the cause and the fix, the input unchanged,
nothing at the destination.
"""

import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain_runs import FIXTURE_CKPTS, Layout, read_losses, run_pretrain  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5
SEQ, BATCH = 32, 2
# --eval-*: Megatron-LM 0.19 sizes its splits from them (no default interval); no evaluation runs
TRAIN = ("--seq-length 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 --train-iters 8 --mock-data "
         "--attention-dropout 0 --hidden-dropout 0 --log-interval 1 --seed 1234 --eval-iters 0 --eval-interval 1000").split()
LAYOUTS = {"llama": Layout(tp=2, pp=2), "gpt2": Layout(tp=2, pp=2),
           "qwen2_moe": Layout(tp=2, pp=2, ep=2, etp=1, sp=True),  # MoE layers with TP need SP
           "deepseek_v3": Layout(tp=2, ep=2, etp=1, sp=True)}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# models of another shape within a family: {name: model type}
VARIANTS = {"deepseek_v3_halves": "deepseek_v3"}
MODELS = FAMILIES + tuple(VARIANTS)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# DeepSeek-V3's YaRN (factor 40 over 4096 positions, beta 32/1) with mscale_all_dim 0.8 (DeepSeek-V3: 1.0): the
# factor on cos/sin (1.369 / 1.295) and the softmax's (1.295^2) both differ from 1
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}


def hf_model(model_type: str, **overrides):
    """A seeded transformers model of the family (or of a VARIANTS name), every parameter perturbed (and
    DeepSeek's correction bias, a buffer, set to N(0, 0.5): large enough to change which experts are chosen)."""
    import transformers as tf

    torch.manual_seed(0)
    llama_like = dict(vocab_size=1024, max_position_embeddings=32, hidden_size=48, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0])
    deepseek = dict(vocab_size=1024, max_position_embeddings=64, hidden_size=48, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, initializer_range=0.1,
                    q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                    num_nextn_predict_layers=0)
    config = {
        "llama": lambda: tf.LlamaConfig(**llama_like, rope_parameters=dict(LLAMA3)),
        "mistral": lambda: tf.MistralConfig(**{**llama_like, "vocab_size": 1000}),
        "qwen2": lambda: tf.Qwen2Config(**llama_like),
        "qwen3": lambda: tf.Qwen3Config(**llama_like, head_dim=16),
        "gpt2": lambda: tf.GPT2Config(vocab_size=1024, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                                      activation_function="gelu", initializer_range=0.1),
        "mixtral": lambda: tf.MixtralConfig(**{**llama_like, "intermediate_size": 32}, num_local_experts=4,
                                            num_experts_per_tok=2),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**llama_like, **moe, shared_expert_intermediate_size=32,
                                               norm_topk_prob=False),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**llama_like, **moe, head_dim=16, norm_topk_prob=True),
        # multi-latent attention with query compression, the first layer dense, 4 routed experts top-2 in 2 groups
        # (one chosen per token) and a shared expert, YaRN, RoPE rows interleaved (DeepSeek's layout)
        "deepseek_v3": lambda: tf.DeepseekV3Config(**deepseek, rope_parameters=dict(DEEPSEEK_YARN)),
        # RoPE rows as [first half; second half] (imported through a row permutation), plain RoPE, 2 shared experts,
        # no group limit
        "deepseek_v3_halves": lambda: tf.DeepseekV3Config(**{**deepseek, "n_shared_experts": 2, "n_group": 1},
                                                          rope_interleave=False),
    }[model_type]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.5)
    return model.eval()


def save_word_tokenizer(folder: Path, size: int) -> None:
    """A word-level tokenizer of `size` tokens as transformers saves one (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size - 1)} | {"<unk>": size - 1}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(folder)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{model_type: (HF dir, universal dir, import summary)}."""
    from megatron_ucp.commands.import_hf import import_hf

    root = tmp_path_factory.mktemp("hf_import")
    out = {}
    for model_type in MODELS:
        hf = root / f"hf_{model_type}"
        # llama sharded: the index path (shards named by model.safetensors.index.json)
        hf_model(model_type).save_pretrained(hf, max_shard_size="100KB" if model_type == "llama" else "1GB")
        if model_type == "qwen2":
            save_word_tokenizer(hf, 1000)
        out[model_type] = (hf, root / f"ucp_{model_type}", import_hf(hf, root / f"ucp_{model_type}", progress=False))
    assert len(list(out["llama"][0].glob("model-*.safetensors"))) > 1
    return out


def tokens_for(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def megatron_logits(imported, tmp_path_factory):
    """{model_type: megatron-core's logits [b, s, padded vocabulary]} from one child process (tests/mcore_gpt.py)."""
    work = tmp_path_factory.mktemp("mcore_logits")
    jobs = [{"ucp": str(imported[t][1]), "flags": imported[t][2]["megatron_flags"],
             "tokens": tokens_for(imported[t][2]["vocab_size"])} for t in MODELS]
    torch.save(jobs, work / "jobs.pt")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "mcore_gpt.py"), str(work / "jobs.pt"),
                           str(work / "logits.pt")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(MODELS, torch.load(work / "logits.pt")))


def hf_logits(model, vocab: int) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens_for(vocab)).logits


def rel_diff(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """max |difference| / max |reference| over the true vocabulary (reference's own columns)."""
    vocab = logits.shape[-1]
    return ((logits - reference[..., :vocab]).abs().max() / reference[..., :vocab].abs().max()).item()


def swap_k_heads(model) -> None:
    """K heads 0 and 1 (query groups 0 and 1's keys) exchanged in every layer (weights and biases); under
    multi-latent attention heads 0 and 1 of kv_b_proj (each head's k_nope and v rows)."""
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    with torch.no_grad():
        for layer in layers:
            if hasattr(getattr(layer, "self_attn", None), "kv_b_proj"):
                w, d = layer.self_attn.kv_b_proj.weight, layer.self_attn.qk_nope_head_dim + layer.self_attn.v_head_dim
                w[: 2 * d] = torch.cat([w[d: 2 * d], w[:d]]).clone()
                continue
            if hasattr(layer, "attn"):  # GPT-2: c_attn is [in, 3h] (Conv1D), keys in columns [h, 2h)
                hidden, d = layer.attn.embed_dim, layer.attn.head_dim
                for p in (layer.attn.c_attn.weight, layer.attn.c_attn.bias):
                    p[..., hidden: hidden + 2 * d] = torch.cat([p[..., hidden + d: hidden + 2 * d],
                                                                p[..., hidden: hidden + d]], dim=-1).clone()
                continue
            k, d = layer.self_attn.k_proj, layer.self_attn.head_dim
            for p in (k.weight, k.bias):
                if p is not None:
                    p[: 2 * d] = torch.cat([p[d: 2 * d], p[:d]]).clone()


@pytest.mark.parametrize("model_type", MODELS)
def test_imported_logits_equal_transformers(imported, megatron_logits, model_type):
    """megatron-core's GPTModel from the printed flags computes transformers' logits; swapped K heads do not."""
    from transformers import AutoModelForCausalLM

    hf_dir, _, summary = imported[model_type]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference = megatron_logits[model_type]
    vocab = summary["vocab_size"]
    assert reference.shape == (BATCH, SEQ, summary["padded_vocab_size"]) and reference.std() > 0.1
    diff = rel_diff(hf_logits(model, vocab), reference)
    assert diff <= TOL, f"{model_type}: logits differ by {diff:.2e} relative"
    swap_k_heads(model)
    broken = rel_diff(hf_logits(model, vocab), reference)
    assert broken > TOL, f"{model_type}: swapped K heads only move the logits by {broken:.2e}"
    print(f"{model_type}: logits {diff:.2e} relative, swapped K heads {broken:.2e}")


def test_llama3_rope_scaling_is_what_megatron_computes(imported, megatron_logits):
    """The llama import prints --use-rope-scaling; the same weights with unscaled RoPE in transformers miss
    megatron-core's logits (so the comparison above sees the scaling)."""
    import transformers as tf

    hf_dir, _, summary = imported["llama"]
    flags = summary["megatron_flags"]
    assert "--use-rope-scaling" in flags and flags[flags.index("--rope-scaling-factor") + 1] == "8.0"
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    unscaled = hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    unscaled.load_state_dict(model.state_dict())
    broken = rel_diff(hf_logits(unscaled, summary["vocab_size"]), megatron_logits["llama"])
    assert broken > TOL, f"unscaled RoPE only moves the logits by {broken:.2e}"
    print(f"llama: unscaled RoPE {broken:.2e}")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_export_gives_back_the_hf_model(imported, model_type, tmp_path):
    """export-hf (fp32) of the import: the original tensors bit for bit, loaded by transformers as the same class
    computing the same logits bitwise."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_ucp.commands.export_hf import export_hf

    hf_dir, ucp, summary = imported[model_type]
    export_hf(ucp, tmp_path / "hf", model_type, dtype="float32", progress=False)
    original = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        original.update(load_file(f))
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    if model_type == "gpt2":  # the tied lm_head is not saved by transformers
        exported.pop("lm_head.weight", None)
    assert exported.keys() == original.keys(), set(exported) ^ set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name].view(torch.int32), tensor.view(torch.int32)), name
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(back) is type(model)
    assert torch.equal(hf_logits(back, summary["vocab_size"]), hf_logits(model, summary["vocab_size"]))


# transformers config fields an export does not carry over: token ids (the export names the Megatron tokenizer's
# EOD), the initializer's std (training from scratch only) and where the config was read from
NOT_EXPORTED = ("bos_token_id", "eos_token_id", "initializer_range", "_name_or_path")


def test_deepseek_rope_yarn_and_router_bias_are_what_megatron_computes(imported, megatron_logits):
    """The DeepSeek imports' printed flags carry YaRN (factor, mscale, mscale_all_dim), the sigmoid router with its
    expert bias, scaling and groups; the same weights in transformers with one thing changed miss megatron-core's
    logits, so the comparison above sees each: the halves import read as interleaved (its RoPE rows not permuted),
    plain RoPE instead of YaRN, the correction bias zeroed (other experts chosen)."""
    import transformers as tf

    for name, want in (("deepseek_v3", "--rope-type yarn --rotary-scaling-factor 40.0 --mscale 1.0 --mscale-all-dim "
                                       "0.8"), ("deepseek_v3_halves", "--rope-type rope --swiglu")):
        flags = " ".join(imported[name][2]["megatron_flags"])
        assert want in flags and "--qk-layernorm" in flags and "--moe-layer-freq [0,1]" in flags, flags
        assert ("--moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 "
                "--moe-router-enable-expert-bias") in flags, flags
        assert ("--moe-router-num-groups 2 --moe-router-group-topk 1" in flags) == (name == "deepseek_v3"), flags

    def miss(name: str, **config) -> float:
        model = tf.AutoModelForCausalLM.from_pretrained(imported[name][0], dtype=torch.float32, **config).eval()
        if not config:
            with torch.no_grad():
                for layer in model.model.layers[1:]:
                    layer.mlp.gate.e_score_correction_bias.zero_()
        broken = rel_diff(hf_logits(model, 1024), megatron_logits[name])
        assert broken > TOL, f"{name} {config or 'without its correction bias'}: only {broken:.2e}"
        return broken

    margins = {"RoPE rows not permuted": miss("deepseek_v3_halves", rope_interleave=True),
               "plain RoPE for YaRN": miss("deepseek_v3", rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 10000.0}),
               "correction bias zeroed": miss("deepseek_v3")}
    print("deepseek_v3 negative controls: " + ", ".join(f"{k} {v:.2e}" for k, v in margins.items()))


def test_mla_constants_are_what_the_libraries_fix():
    """adapters/hf's constants: MEGATRON_MLA_YARN are megatron-core 0.19.2's MLATransformerConfig defaults (and
    YarnRotaryEmbedding's integer correction range, which MLA does not pass), none of them a destination of
    Megatron-LM 0.19's parser; DEEPSEEK_LATENT_NORM_EPS is the eps transformers' DeepseekV3RMSNorm takes when
    q_a_layernorm and kv_a_layernorm are built without one."""
    import dataclasses
    import inspect

    from megatron_lm_args import megatron_lm_parser
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    from megatron.core.models.common.embeddings import YarnRotaryEmbedding
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron_ucp.adapters.hf import DEEPSEEK_LATENT_NORM_EPS, MEGATRON_MLA_YARN

    fields = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)}
    truncate = inspect.signature(YarnRotaryEmbedding).parameters["correction_range_round_to_int"].default
    assert {**{k: fields[k] for k in MEGATRON_MLA_YARN if k != "truncate"}, "truncate": truncate} == MEGATRON_MLA_YARN
    dests = {a.dest for a in megatron_lm_parser()._actions}
    assert not dests & set(MEGATRON_MLA_YARN) and {"rotary_scaling_factor", "mscale", "mscale_all_dim"} <= dests
    assert inspect.signature(ds.DeepseekV3RMSNorm).parameters["eps"].default == DEEPSEEK_LATENT_NORM_EPS
    source = inspect.getsource(ds.DeepseekV3Attention)
    assert "DeepseekV3RMSNorm(self.q_lora_rank)" in source and "DeepseekV3RMSNorm(config.kv_lora_rank)" in source


def test_deepseek_export_config_and_rope_convention(imported, tmp_path):
    """export-hf of the DeepSeek imports: the config transformers reads back is the original's (but NOT_EXPORTED),
    the correction bias stays fp32 in a bf16 export; the halves import comes out in DeepSeek's interleaved layout (rope_interleave=true): q_b_proj and
    kv_a_proj_with_mqa with their RoPE rows permuted, every other tensor bit for bit, transformers' logits those of
    the original within TOL."""
    import transformers as tf
    from safetensors.torch import load_file

    from megatron_ucp.commands.export_hf import export_hf

    def config(folder):
        return {k: v for k, v in tf.AutoConfig.from_pretrained(folder).to_dict().items() if k not in NOT_EXPORTED}

    hf_dir, ucp, _ = imported["deepseek_v3"]
    export_hf(ucp, tmp_path / "yarn", "deepseek_v3", dtype="float32", progress=False)
    assert config(tmp_path / "yarn") == config(hf_dir)
    export_hf(ucp, tmp_path / "bf16", "deepseek_v3", dtype="bfloat16", progress=False)
    dtypes = {n: t.dtype for n, t in load_file(tmp_path / "bf16" / "model.safetensors").items()}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"  # fp32 in megatron-core and transformers alike
    assert dtypes.pop(bias) == torch.float32 and set(dtypes.values()) == {torch.bfloat16}

    hf_dir, ucp, _ = imported["deepseek_v3_halves"]
    export_hf(ucp, tmp_path / "halves", "deepseek_v3", dtype="float32", progress=False)
    assert config(tmp_path / "halves") == {**config(hf_dir), "rope_interleave": True}
    original, exported = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "halves" / "model.safetensors")
    assert exported.keys() == original.keys()
    pairs = [r // 2 + 4 * (r % 2) for r in range(8)]  # RoPE dim 8: interleaved row r is half-layout row pairs[r]
    for name, tensor in original.items():
        if name.endswith("q_b_proj.weight"):  # 4 heads of 16 qk_nope rows, then 8 RoPE rows
            tensor = tensor.view(4, 24, -1)
            tensor = torch.cat([tensor[:, :16], tensor[:, 16:][:, pairs]], dim=1).reshape(96, -1)
        elif name.endswith("kv_a_proj_with_mqa.weight"):  # 16 kv_lora rows, then 8 RoPE rows
            tensor = torch.cat([tensor[:16], tensor[16:][pairs]])
        assert torch.equal(exported[name], tensor), name
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "halves", dtype=torch.float32).eval()
    diff = rel_diff(hf_logits(back, 1024), hf_logits(model, 1024))
    assert diff <= TOL, f"the interleaved export computes other logits: {diff:.2e}"
    print(f"deepseek_v3_halves exported interleaved: logits {diff:.2e} relative")


def with_mtp_layer(ucp_dir: Path, dst: Path) -> Path:
    """The universal checkpoint with one multi-token prediction layer added (random weights, --mtp-num-layers 1)."""
    import dataclasses

    from megatron_ucp.adapters.gpt import expected_parameters, pattern_for
    from megatron_ucp.universal import UniversalCheckpoint, UniversalWriter

    ucp = UniversalCheckpoint.open(ucp_dir)
    config = dataclasses.replace(ucp.config, mtp_num_layers=1)
    g = torch.Generator().manual_seed(0)
    with UniversalWriter(dst) as writer:
        for name, shape in expected_parameters(config):
            tensor = ucp.read(name) if name in ucp.parameters else torch.randn(shape, generator=g)
            writer.write_parameter(name, {"fp32": tensor}, {"pattern": pattern_for(name, config), "step": None,
                                                            "model_dtype": "float32"})
        metadata = {k: v for k, v in ucp.metadata.items() if k not in ("parameters", "format", "version")}
        return writer.finish({**metadata, "model_config": config.to_dict(), "args": {**ucp.args, "mtp_num_layers": 1}},
                             expected_parameters(config))


def test_deepseek_mtp_layers_are_dropped_or_incomplete_refused(imported, tmp_path):
    """import-hf: a DeepSeek folder with an incomplete MTP layer stored after the decoder's (layer 2 of 2,
    num_nextn_predict_layers=1; tests/test_hf_v2lite_llama32_mtp.py imports and checks complete ones) is refused
    naming a missing tensor, and with --drop-mtp imported as the folder without that layer (every tensor equal).
    export-hf of a model with an MTP layer as a family without MTP layers: exit 1 in one line naming --drop-mtp,
    nothing written; with --drop-mtp the export of the model without MTP, bit for bit."""
    from safetensors.torch import load_file, save_file

    from megatron_ucp.commands.import_hf import HFImportError, import_hf
    from megatron_ucp.universal import UniversalCheckpoint

    hf_dir, ucp_dir, _ = imported["deepseek_v3"]
    hf = tmp_path / "hf_mtp"
    shutil.copytree(hf_dir, hf)
    _set_config(hf, num_nextn_predict_layers=1)
    tensors = load_file(hf / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for suffix, shape in (("enorm.weight", (48,)), ("hnorm.weight", (48,)), ("eh_proj.weight", (48, 96)),
                          ("shared_head.norm.weight", (48,)), ("self_attn.kv_b_proj.weight", (112, 16)),
                          ("mlp.experts.0.up_proj.weight", (32, 48))):
        tensors[f"model.layers.2.{suffix}"] = torch.randn(shape, generator=g)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFImportError, match=r"tensor\(s\) missing, e.g. model.layers.2.input_layernorm.weight"):
        import_hf(hf, tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused").exists()
    summary = import_hf(hf, tmp_path / "dropped", progress=False, drop_mtp=True)
    assert summary["dropped_mtp_tensors"] == 6
    plain, dropped = UniversalCheckpoint.open(ucp_dir), UniversalCheckpoint.open(tmp_path / "dropped")
    assert dropped.parameters.keys() == plain.parameters.keys()
    assert all(torch.equal(plain.read(n), dropped.read(n)) for n in plain.parameters)

    mtp = with_mtp_layer(ucp_dir, tmp_path / "ucp_mtp")
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", "export-hf", mtp, tmp_path / "x", "--model-type",
                           "qwen3_moe"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "1 multi-token prediction layer(s)" in proc.stderr and "pass --drop-mtp" in proc.stderr
    assert not (tmp_path / "x").exists()
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", "export-hf", mtp, tmp_path / "x", "--model-type",
                           "deepseek_v3", "--drop-mtp", "--dtype", "float32", "--quiet"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    exported, original = load_file(tmp_path / "x" / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[n], original[n]) for n in original)


def test_deepseek_export_refuses_what_transformers_does_not_compute(imported):
    """check_exportable on Megatron-LM 0.19's own args (its parser and validate_args) of the deepseek import's
    printed flags, one change each: without --rope-type (MLA's default, YaRN) it exports; each other change is
    refused naming the reason."""
    from megatron_lm_args import megatron_lm_args

    from megatron_ucp.commands.export_hf import ExportError, check_exportable
    from megatron_ucp.core.model_config import GPTModelConfig

    flags = imported["deepseek_v3"][2]["megatron_flags"]

    def without(*names: str, values: int = 0) -> list:
        out = list(flags)
        for name in names:
            i = out.index(name)
            del out[i: i + 1 + values]
        return out

    def check(changed: list, **kwargs) -> None:
        args = megatron_lm_args([*changed, *TRAIN])
        check_exportable(GPTModelConfig.from_megatron_args(args), vars(args), "deepseek_v3", **kwargs)

    check(flags)
    check(without("--rope-type", values=1))
    check([*flags, "--mtp-num-layers", "1"], drop_mtp=True)
    no_sigmoid = without("--moe-router-score-function", "--moe-router-enable-expert-bias", values=0)
    no_sigmoid.remove("sigmoid")
    cases = {
        "norm_epsilon=1e-05; DeepseekV3ForCausalLM's q_a_layernorm": [*flags, "--norm-epsilon", "1e-5"],
        "no low-rank compression (no --q-lora-rank)": without("--q-lora-rank", values=1),
        "not normalized (no --qk-layernorm)": without("--qk-layernorm"),
        "moe_router_score_function=softmax": no_sigmoid,
        "moe_router_group_topk=1 and moe_router_topk=4": [*flags, "--moe-router-topk", "4"],
        "the shared expert is gated": [*flags, "--moe-shared-expert-gate"],
        "YaRN with --mscale 0.5 and --mscale-all-dim 0": [*flags, "--mscale", "0.5", "--mscale-all-dim", "0"],
        "dense and MoE layers are mixed": [*flags, "--moe-layer-freq", "[1,0]"],
    }
    for expected, changed in cases.items():
        with pytest.raises(ExportError, match=re.escape(expected)):
            check(changed)


def first_batch(flags):
    """The run's first global batch (tokens, labels, mask) as Megatron-LM 0.19 draws it: the entry point's mock-data
    provider (megatron-core's MockGPTDataset, GPTDatasetConfig from the run's flags, the tokenizer Megatron-LM builds
    from them) over the splits Megatron-LM sizes (get_train_valid_test_num_samples); samples 0..GBS-1."""
    from unittest import mock

    from megatron_lm_args import megatron_lm_args

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import training

    args = megatron_lm_args(flags)
    with mock.patch.object(training, "get_args", lambda: args):
        num_samples = training.get_train_valid_test_num_samples()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader)
    dataset, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()
    samples = [dataset[i] for i in range(args.global_batch_size)]
    return [torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in ("tokens", "labels", "loss_mask")]


def hf_loss(model, batch) -> float:
    tokens, labels, mask = batch
    with torch.no_grad():
        logits = model(tokens).logits.double()
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               reduction="none")
    return ((losses * mask.reshape(-1).double()).sum() / mask.sum()).item()


def swap_query_groups(model) -> None:
    """Query groups 0 and 1 exchanged in q_proj, k_proj, v_proj (weights and biases) of every layer."""
    for layer in model.model.layers:
        attn = layer.self_attn
        head_dim = attn.head_dim
        per_group = attn.config.num_attention_heads // attn.config.num_key_value_heads
        with torch.no_grad():
            for proj, rows in ((attn.q_proj, per_group * head_dim), (attn.k_proj, head_dim),
                               (attn.v_proj, head_dim)):
                for p in (proj.weight, proj.bias):
                    if p is not None:
                        p[: 2 * rows] = torch.cat([p[rows: 2 * rows], p[:rows]]).clone()


def swap_query_heads_gpt2(model) -> None:
    """GPT-2 (MHA: one head per group): heads 0 and 1 exchanged in q, k and v of every layer's c_attn."""
    for block in model.transformer.h:
        hidden, head_dim = block.attn.embed_dim, block.attn.head_dim
        with torch.no_grad():
            for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):  # Conv1D: [in, 3h]; bias [3h]
                for base in (0, hidden, 2 * hidden):
                    a = p[..., base: base + head_dim].clone()
                    p[..., base: base + head_dim] = p[..., base + head_dim: base + 2 * head_dim]
                    p[..., base + head_dim: base + 2 * head_dim] = a


@pytest.mark.parametrize("model_type", list(LAYOUTS))
def test_imported_model_trains_from_transformers_loss(imported, model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir, ucp, summary = imported[model_type]
    flags = [*summary["megatron_flags"], *TRAIN]
    layout = LAYOUTS[model_type]
    jsonl = tmp_path / "run.jsonl"
    run_pretrain(layout, [*flags, "--load", str(ucp), "--universal-checkpoint", "--log-jsonl", str(jsonl)],
                 tmp_path, "universal")
    losses = read_losses(jsonl)
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())

    batch = first_batch(flags)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference = hf_loss(model, batch)
    diff = abs(losses[1] - reference) / reference
    assert diff <= TOL, f"{model_type} at {layout}: lm loss {losses[1]!r} vs transformers {reference!r} ({diff:.2e})"

    # multi-latent attention has no query groups: two heads' keys and values swapped in kv_b_proj
    {"gpt2": swap_query_heads_gpt2, "deepseek_v3": swap_k_heads}.get(model_type, swap_query_groups)(model)
    broken = abs(losses[1] - hf_loss(model, batch)) / reference
    assert broken > TOL, f"{model_type}: swapped QKV groups only move the loss by {broken:.2e}"
    print(f"{model_type} at {layout}: loss diff {diff:.2e}, swapped QKV groups {broken:.2e}")



@pytest.mark.parametrize("model_type", list(LAYOUTS))
def test_printed_flags_build_the_imported_model_in_megatron_lm(imported, model_type):
    """import-hf's flags, read by Megatron-LM 0.19's own parser and validate_args, describe the imported model:
    the universal loader's compatibility check accepts the run, vocabulary included (1024 = --vocab-size 1024 with
    0.19's NullTokenizer; 0.16's spelling, --vocab-size 1023, is refused as a 1023-token model)."""
    from megatron_lm_args import megatron_lm_args

    from megatron_ucp.megatron_lm.loader import UniversalLoadError, check_compatible
    from megatron_ucp.universal import UniversalCheckpoint

    _, ucp_dir, summary = imported[model_type]
    ucp = UniversalCheckpoint.open(ucp_dir)
    layout = LAYOUTS[model_type]
    flags = [*summary["megatron_flags"], *TRAIN, "--tensor-model-parallel-size", str(layout.tp)]
    args = megatron_lm_args(flags, world_size=layout.tp)
    args.padded_vocab_size = ucp.config.padded_vocab_size
    check_compatible(ucp, args)
    i = flags.index("--vocab-size")
    old_spelling = megatron_lm_args([*flags[:i + 1], "1023", *flags[i + 2:]], world_size=layout.tp)
    old_spelling.padded_vocab_size = ucp.config.padded_vocab_size
    with pytest.raises(UniversalLoadError, match="vocab_size: checkpoint 1024, this run 1023"):
        check_compatible(ucp, old_spelling)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_imported_checkpoint_written_as_megatron_at_tp2_pp2(imported, ckpt_format, tmp_path):
    """from-universal of an import (weights only): every tensor equal to the universal one (verify, atol 0)."""
    from megatron_ucp.commands.from_universal import from_universal
    from megatron_ucp.commands.verify import verify

    # legacy torch cannot hold ETP != TP (Megatron-LM's folder naming): the MoE goes there at EP1 ETP2
    moe = {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1} if ckpt_format == "torch_dist" else {}
    for model_type in ("llama", "qwen2_moe"):
        ucp = imported[model_type][1]
        dst = tmp_path / model_type
        from_universal(ucp, dst, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                       **(moe if model_type == "qwen2_moe" else {}),
                       ckpt_format=ckpt_format, progress=False, warn=lambda message: None)
        result = verify(ucp, dst, progress=False)
        assert result.equal and result.diffs and result.compared_keys == ("fp32",), model_type


def model_fields(config) -> dict:
    """A model config without the layer implementation a run chose (transformer_impl, where it is recorded)."""
    return {k: v for k, v in config.to_dict().items() if k != "transformer_impl"}


@pytest.mark.parametrize("fixture,model_type", [("A", "llama"), ("C", "gpt2")])
def test_export_then_import_gives_back_the_fp32_masters(fixture, model_type, tmp_path):
    from megatron_ucp.convert import to_universal
    from megatron_ucp.commands.export_hf import export_hf
    from megatron_ucp.commands.import_hf import import_hf
    from megatron_ucp.universal import UniversalCheckpoint

    original = UniversalCheckpoint.open(to_universal(FIXTURE_CKPTS[fixture], tmp_path / "ucp", iteration=8,
                                                     progress=False))
    export_hf(original.path, tmp_path / "hf", model_type, dtype="float32", progress=False)
    back = UniversalCheckpoint.open(import_hf(tmp_path / "hf", tmp_path / "back", progress=False)["path"])
    assert model_fields(back.config) == model_fields(original.config) and back.iteration == 0
    vocab = original.config.vocab_size
    for name, info in original.parameters.items():
        a, b = original.read(name), back.read(name)
        assert b.dtype == torch.float32 and a.shape == b.shape, name
        rows = slice(0, vocab) if name.startswith(("embedding.word", "output_layer")) else slice(None)
        assert torch.equal(a[rows], b[rows]), f"{name}: not bit-identical after export-hf + import-hf"
        assert not back.parameters[name].tensors[1:], "an import holds no optimizer state"


def test_bf16_weights_are_widened_exactly_and_vocabulary_padded(tmp_path):
    from safetensors.torch import load_file

    from megatron_ucp.commands.import_hf import import_hf
    from megatron_ucp.universal import UniversalCheckpoint

    model = hf_model("llama")
    model.config.vocab_size = 1000
    model.resize_token_embeddings(1000)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    ucp = UniversalCheckpoint.open(import_hf(tmp_path / "hf", tmp_path / "ucp", progress=False)["path"])
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    embed = ucp.read("embedding.word_embeddings.weight")
    assert embed.shape == (1024, 48) and ucp.config.padded_vocab_size == 1024
    assert torch.equal(embed[:1000], hf["model.embed_tokens.weight"].float())
    mean = hf["model.embed_tokens.weight"].double().mean(0).float()  # padding rows: the mean row
    assert torch.equal(embed[1000:], mean.expand(24, -1))
    assert ucp.parameters["decoder.final_layernorm.weight"].model_dtype == "bfloat16"
    assert torch.equal(ucp.read("decoder.final_layernorm.weight"), hf["model.norm.weight"].float())


# --------------------------------------------------------------------------------------------------
# Checked inputs: one line naming the cause and the fix, exit 1, input unchanged, nothing left behind


def _set_config(hf: Path, **changes) -> None:
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    (hf / "config.json").write_text(json.dumps(config))


def _corrupt(hf: Path, case: str) -> tuple[str, dict]:
    """Damage a copy of an HF directory as `case` says; returns the text the error line must contain and the
    import's keyword arguments."""
    from safetensors.torch import load_file, save_file

    weights = hf / "model.safetensors"
    if case == "missing tensor":
        tensors = load_file(weights)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, weights)
        return "tensor(s) missing, e.g. model.layers.1.mlp.up_proj.weight", {}
    if case == "shape mismatch":
        _set_config(hf, intermediate_size=80)
        return "model.layers.0.mlp.gate_proj.weight has shape [64, 48], config.json implies [80, 48]", {}
    if case == "untied without lm_head":
        tensors = load_file(weights)
        del tensors["lm_head.weight"]
        save_file(tensors, weights)
        return "set tie_word_embeddings to true", {}
    if case == "tied but lm_head differs":
        _set_config(hf, tie_word_embeddings=True)
        return "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight", {}
    if case == "integer dtype":
        tensors = load_file(weights)
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
        save_file(tensors, weights)
        return "tensor model.norm.weight is I32; a model's weights must be F32, BF16 or F16", {}
    if case == "index outside the folder":
        outside = hf.parent / "elsewhere.safetensors"
        weights.rename(outside)
        names = list(load_file(outside))
        (hf / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {n: "../elsewhere.safetensors" for n in names}}))
        return "outside", {}
    if case == "symlink outside the folder":
        outside = hf.parent / "elsewhere.safetensors"
        weights.rename(outside)
        weights.symlink_to(outside)
        return "resolves to", {}
    if case == "truncated file":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - 100])
        return "the file is truncated, re-download it", {}
    if case == "pickle only":
        weights.rename(hf / "pytorch_model.bin")
        return "has only pickled weights (pytorch_model.bin); they are never loaded", {}
    if case == "llama3 high_freq_factor 8":  # any factor is megatron-core's (Llama 3.2's 32 too), not this
        _set_config(hf, rope_parameters={**LLAMA3, "high_freq_factor": 8.0})
        return ("RoPE scaling 'llama3' with high_freq_factor=8.0 (from rope_parameters): Megatron's GPT cannot "
                "express it", {})
    if case == "legacy rope_scaling":  # transformers 5 reads rope_scaling before rope_parameters: linear
        _set_config(hf, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    rope_scaling={"type": "linear", "factor": 2.0})
        return "RoPE scaling 'linear' (from rope_scaling)", {}
    if case == "layers beyond the weights":
        _set_config(hf, num_hidden_layers=1000000)
        return "says 1000000 layers but the weights hold layers 0-1 (2 layers)", {}
    if case == "fractional hidden size":
        _set_config(hf, hidden_size=32.5)
        return "hidden_size 32.5 is not a positive integer", {}
    if case == "hidden size as text":
        _set_config(hf, hidden_size="32")
        return "hidden_size '32' is not a positive integer", {}
    if case == "nested config":
        (hf / "config.json").write_text("[" * 100000 + "]" * 100000)
        return "config.json: config.json is nested too deeply", {}
    if case == "nested header":
        header = b"[" * 100000 + b"]" * 100000
        weights.write_bytes(len(header).to_bytes(8, "little") + header)
        return "model.safetensors: safetensors header is nested too deeply", {}
    if case == "huge header length":
        data = weights.read_bytes()
        weights.write_bytes(b"\xff" * 8 + data[8:])
        return "declares a 18446744073709551615-byte header", {}
    if case == "vocabulary multiple":
        return "--make-vocab-size-divisible-by 100000000: must be 1-65536", {"make_vocab_size_divisible_by": 10 ** 8}
    if case == "unsupported family":
        _set_config(hf, model_type="olmoe")
        return "cannot be a Megatron GPT: OLMoE's q_norm and k_norm normalize", {}
    if case == "non-finite weight":  # a damaged (or diverged) model: refused, found while the bytes are hashed
        tensors = load_file(weights)
        tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
        save_file(tensors, weights)
        return "model.layers.1.mlp.down_proj.weight hold(s) NaN or Inf (Megatron's decoder.layers.1.mlp.linear_fc2", {}
    if case == "tokenizer beyond the vocabulary":
        save_word_tokenizer(hf, 2000)
        return "tokenizer.json: has token id 1999, config.json's vocab_size is 1024", {}
    raise AssertionError(case)


CASES = ["missing tensor", "shape mismatch", "untied without lm_head", "tied but lm_head differs", "integer dtype",
         "index outside the folder", "symlink outside the folder", "truncated file", "pickle only",
         "llama3 high_freq_factor 8", "legacy rope_scaling", "layers beyond the weights", "fractional hidden size", "hidden size as text",
         "nested config", "nested header", "huge header length", "vocabulary multiple", "unsupported family",
         "tokenizer beyond the vocabulary", "non-finite weight"]


def _tree_digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else
                                         str(p.readlink()))
            for p in sorted(folder.rglob("*")) if p.is_file() or p.is_symlink()}


def test_bad_inputs_fail_in_one_line_leaving_nothing(tmp_path):
    from megatron_ucp.commands.import_hf import HFImportError, import_hf

    good = tmp_path / "good"
    hf_model("llama").save_pretrained(good)
    for i, case in enumerate(CASES):
        hf = tmp_path / f"case{i}" / "hf"
        shutil.copytree(good, hf)
        expected, kwargs = _corrupt(hf, case)
        before = _tree_digest(hf.parent)
        dst = tmp_path / f"case{i}" / "ucp"
        start = time.perf_counter()
        with pytest.raises(HFImportError) as error:
            import_hf(hf, dst, progress=False, **kwargs)
        assert time.perf_counter() - start < 10, f"{case}: the refusal took {time.perf_counter() - start:.1f} s"
        assert expected in str(error.value) and "\n" not in str(error.value), (case, str(error.value))
        assert "not valid JSON" not in str(error.value), (case, str(error.value))
        assert _tree_digest(hf.parent) == before, f"{case}: the input changed"
        left = sorted(p.name for p in dst.parent.iterdir() if p.name != "elsewhere.safetensors")
        assert left == ["hf"], f"{case}: something was left behind: {left}"
    # the non-finite weight imported as it is when allowed: `check` then names it (exit 1)
    nan_case = tmp_path / f"case{CASES.index('non-finite weight')}"
    import_hf(nan_case / "hf", nan_case / "ucp", progress=False, allow_non_finite=True)
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", "check", nan_case / "ucp"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "decoder.layers.1.mlp.linear_fc2.weight" in proc.stdout + proc.stderr
    # as a user runs it: exit 1, one line, no traceback
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", "import-hf", tmp_path / "case0" / "hf",
                           tmp_path / "case0" / "ucp"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and "tensor(s) missing" in proc.stderr


def test_experts_beyond_the_weights_and_no_space_are_refused_before_writing(imported, tmp_path, monkeypatch):
    from megatron_ucp.commands import import_hf as module

    hf = tmp_path / "hf"
    shutil.copytree(imported["qwen3_moe"][0], hf)
    _set_config(hf, num_local_experts=1000000)  # transformers 5 spells num_experts so
    with pytest.raises(module.HFImportError, match="says num_experts=1000000 but the weights hold experts 0-3"):
        module.import_hf(hf, tmp_path / "ucp", progress=False)
    shutil.copytree(imported["qwen3_moe"][0], hf, dirs_exist_ok=True)
    monkeypatch.setattr(module.shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 30, free=1 << 16))
    with pytest.raises(module.HFImportError, match=r"needs [\d.]+ MiB \(fp32 masters.*\), 0\.1 MiB are free there"):
        module.import_hf(hf, tmp_path / "ucp", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_hub_cache_snapshot_is_read_through_its_links(imported, tmp_path):
    """A hub cache snapshot (files linked to ../../blobs) imports as the folder it mirrors; a link leaving the
    repository's cache is refused, naming `cp -rL`."""
    from megatron_ucp.commands.import_hf import HFImportError, import_hf

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    source = imported["qwen2"][0]
    for i, f in enumerate(sorted(source.iterdir())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    with pytest.raises(HFImportError, match="hub cache repository, not a model folder; pass one of its snapshots"):
        import_hf(repo, tmp_path / "ucp", progress=False)
    summary = import_hf(snapshot, tmp_path / "ucp", progress=False)
    assert summary["megatron_flags"] == [f.replace(str(source), str(snapshot))
                                         for f in imported["qwen2"][2]["megatron_flags"]]
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(source / "config.json")
    with pytest.raises(HFImportError, match="outside .*cp -rL"):
        import_hf(snapshot, tmp_path / "ucp2", progress=False)
    assert not (tmp_path / "ucp2").exists()


def test_printed_tokenizer_flags_give_the_checkpoint_vocabulary(imported):
    """qwen2's folder holds a tokenizer: the printed flags load it with Megatron-LM's HuggingFaceTokenizer, the
    vocabulary Megatron-LM builds from them is the checkpoint's, and the universal loader accepts the run."""
    from megatron_lm_args import megatron_lm_args

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron_ucp.megatron_lm.loader import check_compatible
    from megatron_ucp.universal import UniversalCheckpoint

    hf_dir, ucp_dir, summary = imported["qwen2"]
    flags = summary["megatron_flags"]
    assert flags[flags.index("--tokenizer-type") + 1] == "HuggingFaceTokenizer"
    assert flags[flags.index("--tokenizer-model") + 1] == str(hf_dir)
    args = megatron_lm_args([*flags, *TRAIN])
    tokenizer = build_tokenizer(args)  # sets args.padded_vocab_size as a run does
    ucp = UniversalCheckpoint.open(ucp_dir)
    assert 1000 <= tokenizer.vocab_size <= 1024 and args.padded_vocab_size == ucp.config.padded_vocab_size == 1024
    check_compatible(ucp, args)
    assert "--tokenizer-type NullTokenizer" in " ".join(imported["llama"][2]["megatron_flags"])


def test_refuses_configs_megatron_cannot_express(tmp_path):
    import transformers as tf

    from megatron_ucp.commands.import_hf import HFImportError, megatron_model

    gpt2 = hf_model("gpt2").config.to_dict()
    with pytest.raises(HFImportError, match="activation_function='gelu_new'.*tanh approximation"):
        megatron_model({**gpt2, "activation_function": "gelu_new"}, "gpt2")
    llama = hf_model("llama").config.to_dict()
    with pytest.raises(HFImportError, match="mlp_bias without attention_bias"):
        megatron_model({**llama, "mlp_bias": True}, "llama")
    with pytest.raises(HFImportError, match="hidden_act='gelu'"):
        megatron_model({**llama, "hidden_act": "gelu"}, "llama")
    mistral = hf_model("mistral").config.to_dict()
    with pytest.raises(HFImportError, match="sliding_window=16 < max_position_embeddings=32"):
        megatron_model({**mistral, "sliding_window": 16}, "mistral")
    qwen2 = hf_model("qwen2").config.to_dict()
    with pytest.raises(HFImportError, match="sliding_window=16 < max_position_embeddings=32"):
        megatron_model({**qwen2, "use_sliding_window": True, "sliding_window": 16}, "qwen2")
    megatron_model({**qwen2, "use_sliding_window": False, "sliding_window": 16}, "qwen2")  # transformers drops it
    # RoPE read as transformers 5 reads it: rope_scaling wins over rope_parameters
    legacy = {**llama, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert tf.LlamaConfig.from_dict(legacy).rope_parameters["rope_type"] == "linear"
    with pytest.raises(HFImportError, match="RoPE scaling 'linear' .*rotary-seq-len-interpolation-factor"):
        megatron_model(legacy, "llama")
    for field, value in (("low_freq_factor", 2.0), ("original_max_position_embeddings", 4096)):
        with pytest.raises(HFImportError, match=f"{field}={value!r}"):
            megatron_model({**llama, "rope_parameters": {**LLAMA3, field: value}}, "llama")
    _, args = megatron_model({**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192},
                              "rope_theta": 500000.0, "rope_parameters": None}, "llama")
    assert args["use_rope_scaling"] and args["rotary_base"] == 500000  # Llama 3.1's config.json (transformers 4)


def test_refuses_deepseek_configs_megatron_cannot_express():
    """DeepSeek-V3 configs whose function megatron-core 0.19's multi-latent attention and router cannot compute are
    refused naming the field and why; DeepSeek-V3's own config.json spelling (transformers 4's rope_scaling with
    "type": "yarn", mscale 1.0, mscale_all_dim 1.0) and DeepSeek-V2's (mscale 0.707 = mscale_all_dim) import."""
    from megatron_ucp.commands.import_hf import HFImportError, megatron_model

    base = hf_model("deepseek_v3").config.to_dict()
    yarn = base["rope_parameters"]
    cases = {
        r"q_lora_rank=null \(a query projection without compression: DeepSeek-V2-Lite\)": {"q_lora_rank": None},
        "rms_norm_eps=1e-05: .*q_a_layernorm and kv_a_layernorm use eps 1e-06": {"rms_norm_eps": 1e-5},
        "norm_topk_prob=false with num_experts_per_tok=2": {"norm_topk_prob": False},
        "n_group=2, topk_group=1 with num_experts_per_tok=4.*top 2": {"num_experts_per_tok": 4},
        "attention_bias=true": {"attention_bias": True},
        "n_shared_experts=0": {"n_shared_experts": 0},
        r"first_k_dense_replace=2 with num_hidden_layers=2 \(no MoE layer\)": {"first_k_dense_replace": 2},
        "YaRN original_max_position_embeddings=8192": {"rope_parameters": {**yarn,
                                                                          "original_max_position_embeddings": 8192}},
        "YaRN beta_fast=16": {"rope_parameters": {**yarn, "beta_fast": 16}},
        "YaRN truncate=False": {"rope_parameters": {**yarn, "truncate": False}},
        "YaRN attention_factor=1.2": {"rope_parameters": {**yarn, "attention_factor": 1.2}},
        "YaRN mscale_all_dim=0.8 without mscale": {"rope_parameters": {**yarn, "mscale": 0}},
        "RoPE scaling 'llama3'.*plain RoPE or YaRN only": {"rope_parameters": {**LLAMA3}},
    }
    for expected, change in cases.items():
        with pytest.raises(HFImportError, match=expected):
            megatron_model({**base, **change}, "deepseek_v3")
    v3 = {**base, "rope_parameters": None, "rope_theta": 10000, "max_position_embeddings": 163840,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"}}
    _, args = megatron_model(v3, "deepseek_v3")
    assert (args["rope_type"], args["rotary_scaling_factor"], args["mscale"], args["mscale_all_dim"]) == \
        ("yarn", 40.0, 1.0, 1.0)
    v2 = {**v3, "rope_scaling": {**v3["rope_scaling"], "mscale": 0.707, "mscale_all_dim": 0.707}}
    assert megatron_model(v2, "deepseek_v3")[1]["mscale_all_dim"] == 0.707
    # mscale without mscale_all_dim: transformers scales cos/sin by mscale(factor) alone, megatron-core's default
    no_all_dim = {**v3, "rope_scaling": {**v3["rope_scaling"], "mscale": 0.707, "mscale_all_dim": None}}
    assert [megatron_model(no_all_dim, "deepseek_v3")[1][k] for k in ("mscale", "mscale_all_dim")] == [1.0, 0.0]


@pytest.mark.parametrize("model_type", ["llama", "llama_biases", "gpt2", "mistral", "qwen2", "qwen3", "mixtral",
                                        "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v3_halves",
                                        "kimi_k2_halves"])
def test_name_table_directions_are_inverses(model_type):
    """adapters/hf: to_hf then from_hf (and from_hf_bands in small bands) gives every Megatron tensor back bit for
    bit (true vocabulary rows), for every row of every family and convention; ZERO rows export zeros; PERMUTED
    rows (DeepSeek's RoPE rows as halves) move rows within a head only."""
    from megatron_ucp.adapters.gpt import expected_parameters
    from megatron_ucp.adapters.hf import PERMUTED, VOCAB, ZERO, from_hf, from_hf_bands, hf_rows, hf_shapes, to_hf
    from megatron_ucp.core.model_config import GPTModelConfig

    base = dict(num_layers=2, hidden_size=48, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                kv_channels=12, vocab_size=1001, padded_vocab_size=1024)
    rope = dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                untie_embeddings_and_output_weights=True, add_bias_linear=False)
    moe = dict(num_experts=4, moe_ffn_hidden_size=32)
    mla = dict(**{**base, "num_query_groups": 4}, qk_layernorm=True, multi_latent_attention=True, q_lora_rank=24,
               kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, moe_layer_freq=(0, 1),
               moe_shared_expert_intermediate_size=64)
    config = {
        "llama": GPTModelConfig(**base, **rope),
        "llama_biases": GPTModelConfig(**base, **{**rope, "add_bias_linear": True}),
        "gpt2": GPTModelConfig(**{**base, "num_query_groups": 4}, max_position_embeddings=32),
        "mistral": GPTModelConfig(**base, **rope),
        "qwen2": GPTModelConfig(**base, **rope, add_qkv_bias=True),
        "qwen3": GPTModelConfig(**{**base, "kv_channels": 16}, **rope, add_qkv_bias=True, qk_layernorm=True),
        "mixtral": GPTModelConfig(**base, **rope, **moe),
        "qwen2_moe": GPTModelConfig(**base, **rope, **moe, add_qkv_bias=True, moe_layer_freq=(0, 1),
                                    moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True),
        "qwen3_moe": GPTModelConfig(**base, **rope, **moe, qk_layernorm=True, moe_layer_freq=(0, 1)),
        "deepseek_v3": GPTModelConfig(**mla, **rope, **moe, moe_router_enable_expert_bias=True),
        "deepseek_v3_halves": GPTModelConfig(**mla, **rope, **moe),  # no expert bias: HF's correction bias is zero
        # with an MTP layer (HF layer 2: its transformer layer's rows, the MTP rows, the embedding / head copies)
        "kimi_k2_halves": GPTModelConfig(**mla, **rope, **moe, mtp_num_layers=1),
    }[model_type]
    family = model_type.split("_biases")[0].split("_halves")[0]
    conventions = {"rope_interleave": False} if model_type.endswith("_halves") else None
    shapes = dict(expected_parameters(config))
    g = torch.Generator().manual_seed(0)
    covered, zeros, permuted = set(), 0, 0
    rows = hf_rows(config, family, conventions)
    names = [n for row in rows for n in row.hf]
    assert len(names) == len(set(names))  # every HF tensor in one row
    for row in rows:
        original = torch.randn(shapes[row.megatron], generator=g) if row.megatron else None
        if row.join == PERMUTED:  # a permutation of the rows that keeps each head's (q_b_proj: 24 rows) in place
            order = torch.tensor(row.permutation)
            assert sorted(row.permutation) == list(range(len(order))) and not torch.equal(order, order.sort().values)
            assert torch.equal(order // 24, torch.arange(len(order)) // 24)
            permuted += 1
        parts = to_hf(row, original, config)
        assert [tuple(p.shape) for p in parts] == hf_shapes(row, config, original.shape if row.megatron else None)
        if row.join == ZERO:
            assert all(not p.any() for p in parts)
            zeros += 1
            continue
        covered.add(row.megatron)
        want = original[: config.vocab_size] if row.join == VOCAB else original
        assert torch.equal(from_hf(row, parts, config), want), row
        banded = from_hf_bands(row, config, [tuple(p.shape) for p in parts], lambda i, r0, r1: parts[i][r0:r1],
                               lambda n: 5)
        assert torch.equal(torch.cat(list(banded)), want), row
    assert covered == set(shapes), set(shapes) ^ covered  # the table names every Megatron parameter once
    # qwen3's attention_bias: o_proj's, one per layer; DeepSeek's correction bias of a router without expert bias
    assert zeros == {"qwen3": 2, "deepseek_v3_halves": 1, "kimi_k2_halves": 2}.get(model_type, 0)
    # q_b_proj, kv_a_proj_with_mqa per layer (the MTP layer's too)
    assert permuted == {"deepseek_v3_halves": 4, "kimi_k2_halves": 6}.get(model_type, 0)
