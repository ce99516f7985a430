"""import-hf: a Hugging Face model becomes a universal checkpoint that trains at any layout from the same loss.

Models (no hub access): transformers' own classes built from their config classes, seeded, every parameter
then perturbed (N(0, 0.02) added, so norms are not 1 and biases not 0 and a wrong norm or bias mapping shows):
- llama: 2 layers, hidden 48, 4 heads in 2 query groups, SwiGLU 64, untied, saved SHARDED (index + 4 files);
- gpt2: 2 layers, hidden 48, 4 heads, exact GELU (`activation_function="gelu"`), tied, biases;
- qwen2_moe: 2 layers (layer 0 dense: mlp_only_layers=[0]), 4 experts top-2 of 32, a gated shared expert of
  32, QKV biases, norm_topk_prob=false (Megatron's --moe-router-pre-softmax).
Vocabulary 1024 (Megatron-LM 0.19's NullTokenizer --vocab-size 1024, EOD included: no padding rows, so Megatron's
softmax is HF's).

End to end (tests/pretrain_runs, torchrun, gloo, CPU): each imported checkpoint is loaded with
`--universal-checkpoint` at TP2 PP2 (qwen2_moe: EP2 ETP1, sequence parallel) and trained 8 iterations with
--mock-data; the first iteration's lm loss (before any update) is compared with transformers' loss on exactly
that global batch (megatron-core's MockGPTDataset samples 0..7, built here with the run's own flags).
Tolerance: 1e-5 relative (fp32; measured 2.1e-8 llama, 1.3e-8 gpt2, 3.8e-9 qwen2_moe). Negative control: the HF
model with query groups 0 and 1 swapped in every layer's q/k/v_proj (what a QKV fusion that mixes up groups would
load) must miss by > 1e-5 (measured 2.2e-2, 9.6e-4, 1.3e-3: margins 96x or more; printed with -s).
`from-universal` writes the llama and qwen2_moe imports as Megatron-LM checkpoints (legacy torch at EP1,
torch_dist at EP2 ETP1) at TP2 PP2: `verify` finds every tensor equal (atol 0).

Round trip: `export-hf` (fp32) of Megatron-LM's trained fixtures A (llama) and C (gpt2) and `import-hf` of the
export give back every true-vocabulary row of every fp32 master bit for bit.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain_runs import FIXTURE_CKPTS, Layout, read_losses, run_pretrain  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5
# --eval-*: Megatron-LM 0.19 sizes its splits from them (no default interval); no evaluation runs
TRAIN = ("--seq-length 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 --train-iters 8 --mock-data "
         "--attention-dropout 0 --hidden-dropout 0 --log-interval 1 --seed 1234 --eval-iters 0 --eval-interval 1000").split()
LAYOUTS = {"llama": Layout(tp=2, pp=2), "gpt2": Layout(tp=2, pp=2),
           "qwen2_moe": Layout(tp=2, pp=2, ep=2, etp=1, sp=True)}  # MoE layers with TP need SP


def hf_model(model_type: str):
    """A seeded transformers model of the family, every parameter perturbed."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=1024, max_position_embeddings=32)
    if model_type == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2,
                                                   initializer_range=0.1))
    elif model_type == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=1024, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                                                 activation_function="gelu", initializer_range=0.1))
    else:
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **common, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=False, initializer_range=0.1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{model_type: (HF dir, universal dir, import summary)}."""
    from megatron_ucp.commands.import_hf import import_hf

    root = tmp_path_factory.mktemp("hf_import")
    out = {}
    for model_type in LAYOUTS:
        hf = root / f"hf_{model_type}"
        # llama sharded: the index path (shards named by model.safetensors.index.json)
        hf_model(model_type).save_pretrained(hf, max_shard_size="100KB" if model_type == "llama" else "1GB")
        out[model_type] = (hf, root / f"ucp_{model_type}", import_hf(hf, root / f"ucp_{model_type}", progress=False))
    assert len(list(out["llama"][0].glob("model-*.safetensors"))) > 1
    return out


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
    assert back.config == original.config and back.iteration == 0
    vocab = original.config.vocab_size
    for name, info in original.parameters.items():
        a, b = original.read(name), back.read(name)
        assert b.dtype == torch.float32 and a.shape == b.shape, name
        rows = slice(0, vocab) if name.startswith(("embedding.word", "output_layer")) else slice(None)
        assert torch.equal(a[rows], b[rows]), f"{name}: not bit-identical after export-hf + import-hf"
        assert not back.parameters[name].tensors[1:], "an import holds no optimizer state"


def test_moe_import_export_import_is_identity(imported, tmp_path):
    from megatron_ucp.commands.export_hf import export_hf
    from megatron_ucp.commands.import_hf import import_hf
    from megatron_ucp.universal import UniversalCheckpoint

    _, ucp, _ = imported["qwen2_moe"]
    export_hf(ucp, tmp_path / "hf", "qwen2_moe", dtype="float32", progress=False)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["norm_topk_prob"] is False
    a = UniversalCheckpoint.open(ucp)
    b = UniversalCheckpoint.open(import_hf(tmp_path / "hf", tmp_path / "back", progress=False)["path"])
    assert a.config == b.config and a.parameters.keys() == b.parameters.keys()
    assert all(torch.equal(a.read(n), b.read(n)) for n in a.parameters)


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
# Checked inputs: one line naming the cause and the fix, exit 1, nothing left behind


def _corrupt(hf: Path, case: str) -> str:
    """Damage a copy of an HF directory as `case` says; returns the text the error line must contain."""
    from safetensors.torch import load_file, save_file

    config = json.loads((hf / "config.json").read_text())
    weights = hf / "model.safetensors"
    if case == "missing tensor":
        tensors = load_file(weights)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, weights)
        return "tensor(s) missing, e.g. model.layers.1.mlp.up_proj.weight"
    if case == "shape mismatch":
        config["intermediate_size"] = 80
        (hf / "config.json").write_text(json.dumps(config))
        return "model.layers.0.mlp.gate_proj.weight has shape [64, 48], config.json implies [80, 48]"
    if case == "untied without lm_head":
        tensors = load_file(weights)
        del tensors["lm_head.weight"]
        save_file(tensors, weights)
        return "set tie_word_embeddings to true"
    if case == "tied but lm_head differs":
        config["tie_word_embeddings"] = True
        (hf / "config.json").write_text(json.dumps(config))
        return "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight"
    if case == "integer dtype":
        tensors = load_file(weights)
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
        save_file(tensors, weights)
        return "tensor model.norm.weight is I32; a model's weights must be F32, BF16 or F16"
    if case == "index outside the folder":
        outside = hf.parent / "elsewhere.safetensors"
        weights.rename(outside)
        names = list(load_file(outside))
        (hf / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {n: "../elsewhere.safetensors" for n in names}}))
        return "outside"
    if case == "symlink outside the folder":
        outside = hf.parent / "elsewhere.safetensors"
        weights.rename(outside)
        weights.symlink_to(outside)
        return "resolves to"
    if case == "truncated file":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - 100])
        return "the file is truncated, re-download it"
    if case == "pickle only":
        weights.rename(hf / "pytorch_model.bin")
        return "has only pickled weights (pytorch_model.bin); they are never loaded"
    if case == "rope scaling":
        config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
        (hf / "config.json").write_text(json.dumps(config))
        return "RoPE scaling 'llama3': Megatron's GPT cannot express it as llama"
    raise AssertionError(case)


CASES = ["missing tensor", "shape mismatch", "untied without lm_head", "tied but lm_head differs", "integer dtype",
         "index outside the folder", "symlink outside the folder", "truncated file", "pickle only", "rope scaling"]


def test_bad_inputs_fail_in_one_line_leaving_nothing(tmp_path):
    import shutil
    import subprocess

    from megatron_ucp.commands.import_hf import HFImportError, import_hf

    good = tmp_path / "good"
    hf_model("llama").save_pretrained(good)
    for i, case in enumerate(CASES):
        hf = tmp_path / f"case{i}" / "hf"
        shutil.copytree(good, hf)
        expected = _corrupt(hf, case)
        dst = tmp_path / f"case{i}" / "ucp"
        with pytest.raises(HFImportError) as error:
            import_hf(hf, dst, progress=False)
        assert expected in str(error.value) and "\n" not in str(error.value), (case, str(error.value))
        left = sorted(p.name for p in dst.parent.iterdir() if p.name != "elsewhere.safetensors")
        assert left == ["hf"], f"{case}: something was left behind: {left}"
    # as a user runs it: exit 1, one line, no traceback
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", "import-hf", tmp_path / "case0" / "hf",
                           tmp_path / "case0" / "ucp"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and "tensor(s) missing" in proc.stderr


def test_refuses_configs_megatron_cannot_express(tmp_path):
    from megatron_ucp.commands.import_hf import HFImportError, megatron_model

    gpt2 = hf_model("gpt2").config.to_dict()
    with pytest.raises(HFImportError, match="activation_function='gelu_new'.*tanh approximation"):
        megatron_model({**gpt2, "activation_function": "gelu_new"}, "gpt2")
    llama = hf_model("llama").config.to_dict()
    with pytest.raises(HFImportError, match="mlp_bias without attention_bias"):
        megatron_model({**llama, "mlp_bias": True}, "llama")
    with pytest.raises(HFImportError, match="hidden_act='gelu'"):
        megatron_model({**llama, "hidden_act": "gelu"}, "llama")
    with pytest.raises(HFImportError, match="sliding_window"):
        megatron_model({**llama, "use_sliding_window": True, "sliding_window": 16}, "llama")


@pytest.mark.parametrize("model_type", ["llama", "llama_biases", "gpt2", "mixtral", "qwen2_moe"])
def test_name_table_directions_are_inverses(model_type):
    """hf_names: to_hf then from_hf (and from_hf_bands in small bands) gives every Megatron tensor back bit for bit
    (true vocabulary rows), for every row of every family; ZERO rows export zeros."""
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
        "mixtral": GPTModelConfig(**base, **rope, **moe),
        "qwen2_moe": GPTModelConfig(**base, **rope, **moe, add_qkv_bias=True, moe_layer_freq=(0, 1),
                                    moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True),
    }[model_type]
    family = model_type.split("_biases")[0]
    shapes = dict(expected_parameters(config))
    g = torch.Generator().manual_seed(0)
    covered = set()
    for row in hf_rows(config, family):
        original = torch.randn(shapes[row.megatron], generator=g) if row.megatron else None
        parts = to_hf(row, original, config)
        assert [tuple(p.shape) for p in parts] == hf_shapes(row, config, original.shape if row.megatron else None)
        if row.join == ZERO:
            assert all(not p.any() for p in parts)
            continue
        covered.add(row.megatron)
        want = original[: config.vocab_size] if row.join == VOCAB else original
        assert torch.equal(from_hf(row, parts, config), want), row
        banded = from_hf_bands(row, config, [tuple(p.shape) for p in parts], lambda i, r0, r1: parts[i][r0:r1],
                               lambda n: 5)
        assert torch.equal(torch.cat(list(banded)), want), row
    assert covered == set(shapes), set(shapes) ^ covered  # the table names every Megatron parameter once
