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
- qwen3_moe: QK norm, layer 0 dense, 4 experts top-2 of 32, norm_topk_prob=true (Megatron's default router).

Logits (every family): megatron-core 0.19's GPTModel built from the flags import-hf prints (Megatron-LM's parser,
validate_args and model provider, the universal loader's check_compatible; tests/mcore_gpt.py, all families in one
child process), filled from the import, on the same token ids as transformers: max |difference| / max |logit|
<= 1e-5 over the true vocabulary (measured 4.4e-7 - 7.1e-7). Negative controls: the HF model with K heads 0 and 1
swapped in every layer misses by > 1e-5 (measured 0.33 - 1.2), and llama's HF model with unscaled RoPE misses
Megatron's llama3 scaling (measured 4.6e-3); printed with -s. Export back: `export-hf` (fp32) of each import writes the original
tensors bit for bit, and transformers loads it as the same class computing the same logits bitwise.

End to end (tests/pretrain_runs, torchrun, gloo, CPU): the llama, gpt2 and qwen2_moe imports are loaded with
`--universal-checkpoint` at TP2 PP2 (qwen2_moe: EP2 ETP1, sequence parallel) and trained 8 iterations with
--mock-data; the first iteration's lm loss (before any update) is compared with transformers' loss on exactly
that global batch (megatron-core's MockGPTDataset samples 0..7, built here with the run's own flags).
Tolerance: 1e-5 relative (fp32; measured 3.1e-8 llama (llama3 RoPE), 4.0e-9 gpt2, 3.8e-9 qwen2_moe). Negative control: the HF
model with query groups 0 and 1 swapped in every layer's q/k/v_proj (what a QKV fusion that mixes up groups would
load) must miss by > 1e-5 (measured 2.2e-2, 9.6e-4, 1.3e-3: margins 96x or more; printed with -s).
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
           "qwen2_moe": Layout(tp=2, pp=2, ep=2, etp=1, sp=True)}  # MoE layers with TP need SP
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe")
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def hf_model(model_type: str, **overrides):
    """A seeded transformers model of the family, every parameter perturbed."""
    import transformers as tf

    torch.manual_seed(0)
    llama_like = dict(vocab_size=1024, max_position_embeddings=32, hidden_size=48, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0])
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
    }[model_type]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
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
    for model_type in FAMILIES:
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
             "tokens": tokens_for(imported[t][2]["vocab_size"])} for t in FAMILIES]
    torch.save(jobs, work / "jobs.pt")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "mcore_gpt.py"), str(work / "jobs.pt"),
                           str(work / "logits.pt")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(FAMILIES, torch.load(work / "logits.pt")))


def hf_logits(model, vocab: int) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens_for(vocab)).logits


def rel_diff(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """max |difference| / max |reference| over the true vocabulary (reference's own columns)."""
    vocab = logits.shape[-1]
    return ((logits - reference[..., :vocab]).abs().max() / reference[..., :vocab].abs().max()).item()


def swap_k_heads(model) -> None:
    """K heads 0 and 1 (query groups 0 and 1's keys) exchanged in every layer (weights and biases)."""
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    with torch.no_grad():
        for layer in layers:
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


@pytest.mark.parametrize("model_type", FAMILIES)
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

    (swap_query_heads_gpt2 if model_type == "gpt2" else swap_query_groups)(model)
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
    if case == "llama3 factor 32":  # Llama 3.2's: megatron-core's GPT computes factor 8 only
        _set_config(hf, rope_parameters={**LLAMA3, "factor": 32.0})
        return "RoPE scaling 'llama3' with factor=32.0 (from rope_parameters): Megatron's GPT cannot express it", {}
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
    if case == "tokenizer beyond the vocabulary":
        save_word_tokenizer(hf, 2000)
        return "tokenizer.json: has token id 1999, config.json's vocab_size is 1024", {}
    raise AssertionError(case)


CASES = ["missing tensor", "shape mismatch", "untied without lm_head", "tied but lm_head differs", "integer dtype",
         "index outside the folder", "symlink outside the folder", "truncated file", "pickle only", "llama3 factor 32",
         "legacy rope_scaling", "layers beyond the weights", "fractional hidden size", "hidden size as text",
         "nested config", "nested header", "huge header length", "vocabulary multiple", "unsupported family",
         "tokenizer beyond the vocabulary"]


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


@pytest.mark.parametrize("model_type", ["llama", "llama_biases", "gpt2", "mistral", "qwen2", "qwen3", "mixtral",
                                        "qwen2_moe", "qwen3_moe"])
def test_name_table_directions_are_inverses(model_type):
    """adapters/hf: to_hf then from_hf (and from_hf_bands in small bands) gives every Megatron tensor back bit for
    bit (true vocabulary rows), for every row of every family; ZERO rows export zeros."""
    from megatron_ucp.adapters.gpt import expected_parameters
    from megatron_ucp.adapters.hf import VOCAB, ZERO, from_hf, from_hf_bands, hf_rows, hf_shapes, to_hf
    from megatron_ucp.core.model_config import GPTModelConfig

    base = dict(num_layers=2, hidden_size=48, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                kv_channels=12, vocab_size=1001, padded_vocab_size=1024)
    rope = dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                untie_embeddings_and_output_weights=True, add_bias_linear=False)
    moe = dict(num_experts=4, moe_ffn_hidden_size=32)
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
    }[model_type]
    family = model_type.split("_biases")[0]
    shapes = dict(expected_parameters(config))
    g = torch.Generator().manual_seed(0)
    covered, zeros = set(), 0
    for row in hf_rows(config, family):
        original = torch.randn(shapes[row.megatron], generator=g) if row.megatron else None
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
    assert zeros == {"qwen3": 2}.get(model_type, 0)  # qwen3's attention_bias: o_proj's, one per layer
