"""torch_dist reader on checkpoints written by our own pretrain_gpt.py (megatron-core dist_checkpointing,
as Megatron-LM saves them), one per optimizer format, made in a temporary folder once per session.

- FORMATS: the same deterministic GPT-2-like run (TP2 PP2 DP1, tied embeddings, biases, 2 iterations)
  saved with the distributed optimizer as 'dp_reshardable' (flat buckets) and 'fully_reshardable'
  (model space), and with plain fp32 Adam (FP32Optimizer, 'optimizer.state.exp_avg.<key>'): identical
  losses, and every shard's param / fp32 / exp_avg / exp_avg_sq / step equal bitwise (torch.equal).
- VPP: TP1 PP2 with one layer per virtual stage (2 chunks per stage), distributed optimizer
  ('dp_reshardable'): every local name of every (stage, chunk) present, step == iteration, and each
  fp32 weight (read by global layer index from the model keys) equal bitwise to its fp32 main copy
  (read by registration order from that chunk's flat buckets), so a chunk or layer mix-up shows.
- locate(): for every format above, each shard's StoredTensors (where the bytes are in the .distcp
  files, for the converter's byte copies) read back bitwise equal to read().
- BF16: llama-like TP2 run with --bf16 (Float16OptimizerWithFloat16Params): 'param' is the bf16 model
  weight, 'fp32' the fp32 main weight ('optimizer.state.fp32_param.<key>') that rounds to it.
"""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron_ucp.formats import CheckpointFormatError, open_checkpoint
from megatron_ucp.adapters.gpt import chunk_layers
from megatron_ucp.formats.torch_dist.reader import TorchDistCheckpoint
from locate_checks import assert_locate_equals_read
from pretrain_runs import Layout, RunFailed, train

pytestmark = pytest.mark.torchrun

ITERS = 2
DISTOPT = ("--use-distributed-optimizer",)
# Gradient clipping off: its coefficient comes from the grad norm, which each optimizer sums over
# differently sharded tensors (last-digit differences: GPT-2's norm is > 1, so clipping would scale the
# update by it); without clipping the update never reads the norm and the formats stay bitwise equal.
NO_CLIP = ("--clip-grad", "0")
OPTIMIZER_FORMATS = {
    "dp_reshardable": DISTOPT + NO_CLIP,
    "fully_reshardable": DISTOPT + ("--dist-ckpt-optim-fully-reshardable",) + NO_CLIP,
    "adam": NO_CLIP,
}
TP2PP2 = Layout(tp=2, pp=2)
VPP = Layout(tp=1, pp=2, vpp_layers=1)
TP2 = Layout(tp=2)

# Harness limitations (megatron_ucp/training, not the reader) that make a run fail before it saves.


@pytest.fixture(scope="session")
def harness_run(tmp_path_factory):
    """name -> (checkpoint root, {iteration: lm loss}); each run happens at most once per session."""
    workdir = tmp_path_factory.mktemp("torch_dist_harness")
    done: dict = {}

    def run(name: str, family: str, layout: Layout, extra=()):
        if name not in done:
            save = workdir / name
            try:
                losses = train(family, layout, workdir, name, ITERS, ["--save", str(save), *extra])
                done[name] = (save, losses)
            except RunFailed as e:
                done[name] = e
        result = done[name]
        if isinstance(result, RunFailed):
            raise result
        return result

    return run


def _assert_same_shards(a: TorchDistCheckpoint, b: TorchDistCheckpoint) -> int:
    assert b.shards() == a.shards()
    for ref in a.shards():
        da, db = a.read(ref), b.read(ref)
        assert set(da) == set(db) == {"param", "fp32", "exp_avg", "exp_avg_sq", "step"}, ref
        for key in da:
            assert da[key].dtype == db[key].dtype and torch.equal(da[key], db[key]), (ref, key)
    return len(a.shards())


# ---------------------------------------------------------------------------------------------
# one run, three optimizer formats

@pytest.fixture(scope="session")
def gpt2_formats(harness_run):
    return {fmt: harness_run(f"gpt2_tp2pp2_{fmt}", "gpt2", TP2PP2, flags) for fmt, flags in OPTIMIZER_FORMATS.items()}


def test_formats_detected(gpt2_formats):
    kinds = {fmt: (c.optimizer_kind, c.distrib_optim_sharding) for fmt, c in
             ((fmt, open_checkpoint(root)) for fmt, (root, _) in gpt2_formats.items())}
    assert kinds == {"dp_reshardable": ("distributed", "dp_reshardable"),
                     "fully_reshardable": ("distributed", "fully_reshardable"),
                     "adam": ("adam", None)}


@pytest.mark.parametrize("fmt", ["fully_reshardable", "adam"])
def test_optimizer_formats_identical(gpt2_formats, fmt):
    """Deterministic training: the same losses, so every saved tensor must match bitwise."""
    (ref_root, ref_losses), (root, losses) = gpt2_formats["dp_reshardable"], gpt2_formats[fmt]
    assert losses == ref_losses and sorted(losses) == list(range(1, ITERS + 1))
    a, b = open_checkpoint(ref_root), open_checkpoint(root)
    assert b.layout == a.layout and b.config == a.config and b.iteration == ITERS
    assert _assert_same_shards(a, b) == len(a.shards()) > 0
    for ref in b.shards():
        d = b.read(ref)
        assert d["step"].item() == ITERS and torch.equal(d["fp32"], d["param"]) and (d["exp_avg_sq"] >= 0).all()
    ca, cb = a.common_state(), b.common_state()
    # FP32Optimizer keeps the step per parameter, not in its param groups
    strip = (lambda groups: [{k: v for k, v in g.items() if k != "step"} for g in groups])
    assert strip(cb.pop("param_groups")) == strip(ca.pop("param_groups")) and cb == ca


def test_tied_output_layer_state_equals_embedding_state(gpt2_formats):
    """Model-space formats save the last stage's tied output-layer state once, under the word
    embedding's key; that is exact because the two copies are equal, as the flat buckets (one per
    stage) show."""
    ckpt = open_checkpoint(gpt2_formats["dp_reshardable"][0])
    refs = {(r.tp_rank, r.pp_rank, r.local_name): r for r in ckpt.shards()}
    for tp in range(2):
        emb = ckpt.read(refs[(tp, 0, "embedding.word_embeddings.weight")])
        out = ckpt.read(refs[(tp, 1, "output_layer.weight")])
        for key in emb:
            assert torch.equal(emb[key], out[key]), (tp, key)


def test_model_space_state_missing_is_an_error(gpt2_formats, tmp_path):
    """Dropping one exp_avg_sq tensor from the DCP metadata names the parameter."""
    root = tmp_path / "ckpt"
    src = gpt2_formats["adam"][0]
    shutil.copytree(src, root)
    iter_dir = root / f"iter_{ITERS:07d}"
    metadata = FileSystemReader(str(iter_dir)).read_metadata()
    key = "optimizer.state.exp_avg_sq.decoder.final_layernorm.weight"
    del metadata.state_dict_metadata[key]
    with open(iter_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointFormatError, match="decoder.final_layernorm.weight"):
        open_checkpoint(root)


# ---------------------------------------------------------------------------------------------
# virtual pipeline parallelism

def test_vpp_shards_map(harness_run):
    root, _ = harness_run("gpt2_vpp_dp_reshardable", "gpt2", VPP, OPTIMIZER_FORMATS["dp_reshardable"])
    ckpt = open_checkpoint(root)
    assert ckpt.layout.vpp == 2 and ckpt.layout.pp == 2 and ckpt.layout.tp == 1
    layer_suffixes = ["input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_proj.weight",
                      "self_attention.linear_proj.bias", "self_attention.linear_qkv.weight",
                      "self_attention.linear_qkv.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                      "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]
    by_place: dict = {}
    for ref in ckpt.shards():
        by_place.setdefault((ref.pp_rank, ref.vpp_chunk), set()).add(ref.local_name)
    for pp in range(2):
        for chunk in range(2):
            want = {f"decoder.layers.{i}.{s}" for i, _ in enumerate(chunk_layers(ckpt.config.num_layers, ckpt.layout, pp, chunk))
                    for s in layer_suffixes}
            if (pp, chunk) == (0, 0):
                want |= {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}
            if (pp, chunk) == (1, 1):
                want |= {"decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"}
            assert by_place[(pp, chunk)] == want, (pp, chunk)
    assert sorted(by_place) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    seen = set()
    for ref in ckpt.shards():
        d = ckpt.read(ref)
        assert d["param"].shape == ref.shape and d["step"].item() == ITERS == ckpt.iteration
        assert torch.equal(d["fp32"], d["param"]), ref  # weight by global layer == main copy by bucket
        seen.add(d["param"].sum().item())
    assert len(seen) > len(ckpt.shards()) // 2  # the layers differ, so a swap could not pass unnoticed


# ---------------------------------------------------------------------------------------------
# mixed precision

def test_bf16_param_and_fp32_main(harness_run):
    root, _ = harness_run("llama_tp2_bf16", "llama", TP2, ("--bf16",))
    ckpt = open_checkpoint(root)
    assert ckpt.optimizer_kind == "mixed_precision"
    refs = ckpt.shards()
    assert {r.tp_rank for r in refs} == {0, 1} and all(r.dtype == torch.bfloat16 for r in refs)
    rounded = 0
    for ref in refs:
        d = ckpt.read(ref)
        assert set(d) == {"param", "fp32", "exp_avg", "exp_avg_sq", "step"}
        assert d["param"].dtype == torch.bfloat16 and d["param"].shape == ref.shape
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert d[key].dtype == torch.float32 and d[key].shape == ref.shape, (ref, key)
        # the Float16 optimizer copies the stepped fp32 main weight into the bf16 model weight
        assert torch.equal(d["fp32"].to(torch.bfloat16), d["param"]), ref
        rounded += not torch.equal(d["fp32"], d["param"].float())
        assert d["step"].item() == ITERS
    assert rounded > len(refs) // 2  # the main weights carry more than bf16 precision


# ---------------------------------------------------------------------------------------------
# byte locations (the converter's copy path)

LOCATE_RUNS = {
    "dp_reshardable": ("gpt2_tp2pp2_dp_reshardable", "gpt2", TP2PP2, OPTIMIZER_FORMATS["dp_reshardable"]),
    "fully_reshardable": ("gpt2_tp2pp2_fully_reshardable", "gpt2", TP2PP2, OPTIMIZER_FORMATS["fully_reshardable"]),
    "adam": ("gpt2_tp2pp2_adam", "gpt2", TP2PP2, OPTIMIZER_FORMATS["adam"]),
    "vpp": ("gpt2_vpp_dp_reshardable", "gpt2", VPP, OPTIMIZER_FORMATS["dp_reshardable"]),
    "bf16": ("llama_tp2_bf16", "llama", TP2, ("--bf16",)),
}


@pytest.mark.parametrize("label", sorted(LOCATE_RUNS))
def test_locate_equals_read(harness_run, label):
    root, _ = harness_run(*LOCATE_RUNS[label])
    ckpt = open_checkpoint(root)
    assert assert_locate_equals_read(ckpt, label) >= 5 * len(ckpt.shards())
