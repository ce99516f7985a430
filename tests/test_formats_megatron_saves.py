"""The readers on checkpoints Megatron-LM 0.19 saves itself (its own training loop through
pretrain_scripts/pretrain_gpt.py, megatron-core 0.19.2 dist_checkpointing and legacy `torch` save), each
training command once per session (conftest's `runs`).

- FORMATS: one deterministic GPT-2-like run (TP2 PP2 DP1, tied embeddings, biases, 2 iterations) saved
  with the distributed optimizer as 'dp_reshardable' (flat buckets) and 'fully_reshardable' (model
  space), with plain fp32 Adam (FP32Optimizer, 'optimizer.state.exp_avg.<key>'), and with plain Adam as
  legacy `--ckpt-format torch` (model_optim_rng.pt per rank): identical losses, every torch_dist shard's
  param / fp32 / exp_avg / exp_avg_sq / step equal bitwise, and the legacy save's universal checkpoint equal
  at atol 0 to the torch_dist one's.
- VPP: TP1 PP2 with one layer per virtual stage (2 chunks per stage), distributed optimizer
  ('dp_reshardable'): every local name of every (stage, chunk) present, step == iteration, and each
  fp32 weight (read by global layer index from the model keys) equal bitwise to its fp32 main copy
  (read by registration order from that chunk's flat buckets), so a chunk or layer mix-up shows.
- Uneven pipelines (GPT-2-like, 6 layers, distributed optimizer): Megatron-LM's --decoder-first/last-
  pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split, with and without VPP, at PP2 and
  PP3: the reader takes the split from the args (the layers each (stage, chunk) holds are Megatron-LM's,
  as its log prints them), the same per-chunk check as VPP, and from-universal at the same layout writes
  Megatron-LM's own files back byte for byte (every object too: rng_state="source"), so the split is read and
  written the same way Megatron-LM makes it.
- locate(): for every format above, each shard's StoredTensors (where the bytes are in the .distcp
  files, for the converter's byte copies) read back bitwise equal to read().
- BF16: llama-like TP2 run with --bf16 (Float16OptimizerWithFloat16Params): 'param' is the bf16 model
  weight, 'fp32' the fp32 main weight ('optimizer.state.fp32_param.<key>') that rounds to it.
- fp16 loss scaler (GPT-2-like DP2, distributed optimizer, initial scale 2**20, window 3, hysteresis 2,
  torch_dist saved every iteration; the same run saved as legacy at the iteration chosen, then stopped): the
  logged loss scale follows megatron-core's DynamicGradScaler rules replayed from the logged skipped steps; at
  an iteration whose hysteresis tracker (1) no fresh scaler has, to-universal takes the scaler from the torch_dist dp_reshardable ShardedObject
  `optimizer.distributed.dp_group_idx_0.grad_scaler` and from legacy model_optim_rng.pt
  ['optimizer']['grad_scaler'] into metadata.json's loss_scaler, equal to the replay's. (Resuming it:
  tests/test_e2e_precision.py.)
"""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron_ucp.adapters.gpt import chunk_layers
from megatron_ucp.commands import from_universal as fu
from megatron_ucp.commands.verify import verify
from megatron_ucp.formats import CheckpointFormatError, open_checkpoint
from megatron_ucp.formats.torch_dist.reader import TorchDistCheckpoint
from locate_checks import assert_locate_equals_read
from pretrain_runs import Layout
from test_megatron_versions import differences_from_megatron
from torch_dist_checks import gap_chunks

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


@pytest.fixture(scope="session")
def megatron_save(runs):
    """(family, layout, extra) -> (checkpoint root, {iteration: lm loss}): Megatron-LM 0.19 trains ITERS
    iterations and saves at the end; each command once per session."""

    def run(family: str, layout: Layout, extra=()):
        trained = runs.run(family, layout, ITERS, [*extra, "--save-interval", str(ITERS)], save=True)
        return trained.save, trained.losses

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
def gpt2_formats(megatron_save):
    return {fmt: megatron_save("gpt2", TP2PP2, flags) for fmt, flags in OPTIMIZER_FORMATS.items()}


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

GPT2_LAYER_SUFFIXES = ["input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_proj.weight",
                       "self_attention.linear_proj.bias", "self_attention.linear_qkv.weight",
                       "self_attention.linear_qkv.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                       "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]


def assert_chunks_hold_their_layers(ckpt) -> None:
    """Each (stage, chunk) holds the local names of its layers (chunk_layers), the first chunk the embeddings,
    the last the final norm and output layer; every shard's fp32 weight (by global layer, from the model keys)
    equals its main copy (by registration order, from that chunk's flat buckets); step == iteration."""
    layout, vpp = ckpt.layout, ckpt.layout.vpp or 1
    by_place: dict = {}
    for ref in ckpt.shards():
        by_place.setdefault((ref.pp_rank, ref.vpp_chunk if layout.vpp else 0), set()).add(ref.local_name)
    for pp in range(layout.pp):
        for chunk in range(vpp):
            layers = chunk_layers(ckpt.config.num_layers, layout, pp, chunk if layout.vpp else None)
            want = {f"decoder.layers.{i}.{s}" for i, _ in enumerate(layers) for s in GPT2_LAYER_SUFFIXES}
            if (pp, chunk) == (0, 0):
                want |= {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}
            if (pp, chunk) == (layout.pp - 1, vpp - 1):
                want |= {"decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"}
            assert by_place.get((pp, chunk), set()) == want, (pp, chunk)
    seen = set()
    for ref in ckpt.shards():
        d = ckpt.read(ref)
        assert d["param"].shape == ref.shape and d["step"].item() == ckpt.iteration, ref
        assert torch.equal(d["fp32"], d["param"]), ref  # weight by global layer == main copy by bucket
        seen.add(d["param"].sum().item())
    assert len(seen) > len(ckpt.shards()) // 2  # the layers differ, so a swap could not pass unnoticed


def test_vpp_shards_map(megatron_save):
    root, _ = megatron_save("gpt2", VPP, OPTIMIZER_FORMATS["dp_reshardable"])
    ckpt = open_checkpoint(root)
    assert ckpt.layout.vpp == 2 and ckpt.layout.pp == 2 and ckpt.layout.tp == 1
    assert ckpt.iteration == ITERS
    assert_chunks_hold_their_layers(ckpt)


# ---------------------------------------------------------------------------------------------
# mixed precision

def test_bf16_param_and_fp32_main(megatron_save):
    root, _ = megatron_save("llama", TP2, ("--bf16",))
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
    "dp_reshardable": ("gpt2", TP2PP2, OPTIMIZER_FORMATS["dp_reshardable"]),
    "fully_reshardable": ("gpt2", TP2PP2, OPTIMIZER_FORMATS["fully_reshardable"]),
    "adam": ("gpt2", TP2PP2, OPTIMIZER_FORMATS["adam"]),
    "vpp": ("gpt2", VPP, OPTIMIZER_FORMATS["dp_reshardable"]),
    "bf16": ("llama", TP2, ("--bf16",)),
}


@pytest.mark.parametrize("label", sorted(LOCATE_RUNS))
def test_locate_equals_read(megatron_save, label):
    root, _ = megatron_save(*LOCATE_RUNS[label])
    ckpt = open_checkpoint(root)
    assert assert_locate_equals_read(ckpt, label) >= 5 * len(ckpt.shards())


# ---------------------------------------------------------------------------------------------
# legacy --ckpt-format torch


def test_legacy_save_reads_as_the_torch_dist_save(megatron_save, tmp_path):
    """The plain-Adam run saved as legacy files (model_optim_rng.pt per (TP, PP) rank, Adam state per parameter)
    converts to the universal checkpoint of its torch_dist save, at atol 0."""
    legacy, losses = megatron_save("gpt2", TP2PP2, (*OPTIMIZER_FORMATS["adam"], "--ckpt-format", "torch"))
    dist, dist_losses = megatron_save("gpt2", TP2PP2, OPTIMIZER_FORMATS["adam"])
    assert losses == dist_losses
    assert sorted(p.name for p in (legacy / f"iter_{ITERS:07d}").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    ckpt = open_checkpoint(legacy)
    assert (ckpt.optimizer_kind, ckpt.iteration) == ("adam", ITERS)
    from megatron_ucp.convert import to_universal

    a = to_universal(legacy, tmp_path / "legacy_ucp", progress=False)
    b = to_universal(dist, tmp_path / "dist_ucp", progress=False)
    result = verify(a, b, progress=False)
    assert result.equal and result.compared_keys == ("fp32", "exp_avg", "exp_avg_sq", "step"), \
        [d for d in result.diffs if not d.equal][:3]


# ---------------------------------------------------------------------------------------------
# uneven pipelines

SIX_LAYERS = ("--num-layers", "6", *DISTOPT)
UNEVEN = {
    # name: (layout, flags, the split Megatron-LM places: {(pp, chunk): global layers})
    "pp2-vpp2-first2": (Layout(pp=2), ("--num-virtual-stages-per-pipeline-rank", "2",
                                       "--decoder-first-pipeline-num-layers", "2"),
                        {(0, 0): [0], (1, 0): [1, 2], (0, 1): [3], (1, 1): [4, 5]}),
    "pp2-vpp2-counted": (Layout(pp=2, vpp_layers=2), ("--account-for-embedding-in-pipeline-split",
                                                      "--account-for-loss-in-pipeline-split"),
                         {(0, 0): [0], (1, 0): [1, 2], (0, 1): [3, 4], (1, 1): [5]}),
    "pp3-first1-last1": (Layout(pp=3), ("--decoder-first-pipeline-num-layers", "1",
                                        "--decoder-last-pipeline-num-layers", "1"),
                         {(0, 0): [0], (1, 0): [1, 2, 3, 4], (2, 0): [5]}),
}


def global_layers(ckpt) -> dict:
    """{(pp, chunk): sorted global layer indices} of a checkpoint, from the reader's shard references."""
    found: dict = {}
    for ref in ckpt.shards():
        if ref.local_name.startswith("decoder.layers."):
            local = int(ref.local_name.split(".")[2])
            chunk = ref.vpp_chunk if ckpt.layout.vpp else 0
            layers = chunk_layers(ckpt.config.num_layers, ckpt.layout, ref.pp_rank, chunk if ckpt.layout.vpp else None)
            found.setdefault((ref.pp_rank, chunk), set()).add(layers[local])
    return {k: sorted(v) for k, v in found.items()}


@pytest.mark.parametrize("name", list(UNEVEN))
def test_uneven_pipeline_read_and_written_back(megatron_save, tmp_path, name):
    layout, flags, split = UNEVEN[name]
    root, losses = megatron_save("gpt2", layout, (*SIX_LAYERS, *flags))
    assert sorted(losses) == list(range(1, ITERS + 1))
    ckpt = open_checkpoint(root)
    assert global_layers(ckpt) == split
    assert_chunks_hold_their_layers(ckpt)
    from megatron_ucp.convert import to_universal

    ucp = to_universal(root, tmp_path / "ucp", progress=False)
    assert json.loads((ucp / "metadata.json").read_text())["source"]["layout"] == ckpt.layout.to_dict()
    split_kwargs = {k: v for k, v in dict(first_stage_layers=ckpt.layout.first_stage_layers,
                                          last_stage_layers=ckpt.layout.last_stage_layers,
                                          embedding_in_split=ckpt.layout.embedding_in_split,
                                          loss_in_split=ckpt.layout.loss_in_split).items() if v}
    if ckpt.layout.vpp and not layout.vpp_layers:
        split_kwargs["virtual_stages"] = ckpt.layout.vpp
    out = tmp_path / "back"
    summary = fu.from_universal(ucp, out, ckpt_format="torch_dist", use_distributed_optimizer=True,
                                rng_state="source", progress=False, pipeline_model_parallel_size=layout.pp,
                                num_layers_per_virtual_pipeline_stage=layout.vpp_layers,
                                pipeline_split=split_kwargs or None)
    iter_dir = f"iter_{ITERS:07d}"
    assert differences_from_megatron(out / iter_dir, root / iter_dir, gap_chunks(summary, ucp)) == []


# ---------------------------------------------------------------------------------------------
# fp16 loss scaler

INITIAL_SCALE, WINDOW, HYSTERESIS = 2.0 ** 20, 3, 2
FP16 = ("--fp16", *DISTOPT, "--initial-loss-scale", str(int(INITIAL_SCALE)), "--loss-scale-window", str(WINDOW),
        "--hysteresis", str(HYSTERESIS))
FP16_ITERS = 8


def replay_scaler(skipped, scale=INITIAL_SCALE, growth=0, hysteresis=HYSTERESIS):
    """megatron-core's DynamicGradScaler.update over the steps' overflow flags: [(scale, growth, hysteresis)]."""
    states = []
    for overflow in skipped:
        if overflow:
            growth, hysteresis = 0, hysteresis - 1
            if hysteresis <= 0:
                scale = max(scale * 0.5, 1.0)
        else:
            growth += 1
            if growth == WINDOW:
                growth, hysteresis, scale = 0, HYSTERESIS, scale * 2.0
        states.append((scale, growth, hysteresis))
    return states


def test_fp16_loss_scaler_is_read_from_both_formats(runs, tmp_path):
    from megatron_ucp.convert import to_universal
    from megatron_ucp.formats.common import load_pickled

    dist = runs.run("gpt2", Layout(dp=2), FP16_ITERS, [*FP16, "--save-interval", "1"], save=True)
    records = dist.records
    skipped = [records[i]["skipped"] for i in range(1, FP16_ITERS + 1)]
    replay = replay_scaler(skipped)
    assert [records[i]["loss_scale"] for i in range(1, FP16_ITERS + 1)] == [s for s, _, _ in replay]
    assert sum(skipped) >= 2 and len({s for s, _, _ in replay}) >= 2  # overflows, back-offs
    # an iteration whose hysteresis tracker no fresh scaler has, after a step was taken (Megatron-LM's legacy
    # distributed-optimizer save fails before Adam has any state)
    iteration = next(i + 1 for i, (_, _, h) in enumerate(replay) if h not in (0, HYSTERESIS) and not all(skipped[:i + 1]))
    expected = dict(zip(("scale", "growth_tracker", "hysteresis_tracker"), replay[iteration - 1]))
    legacy = runs.run("gpt2", Layout(dp=2), FP16_ITERS, [*FP16, "--ckpt-format", "torch", "--save-interval",
                                                          str(iteration), "--exit-interval", str(iteration)], save=True)
    assert legacy.records == {i: records[i] for i in range(1, iteration + 1)}  # the same run, in two formats
    for fmt, trained in (("torch_dist", dist), ("torch", legacy)):
        ucp = to_universal(trained.save, tmp_path / fmt, iteration=iteration, progress=False)
        assert json.loads((ucp / "metadata.json").read_text())["loss_scaler"] == expected, fmt
    # the torch_dist scaler is dp_reshardable's ShardedObject, the legacy one in the optimizer state
    md = FileSystemReader(str(dist.save / f"iter_{iteration:07d}")).read_metadata()
    assert "optimizer.distributed.dp_group_idx_0.grad_scaler/shard_0_1" in md.state_dict_metadata
    state = load_pickled(legacy.save / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt", what="test")
    assert set(state["optimizer"]["grad_scaler"]) == {"scale", "growth_tracker", "hysteresis_tracker"}
