"""Real training configurations in the harness: fp16 with dynamic loss scaling, dropout, uneven pipelines.

- fp16 (GPT-2-like, TP1 DP2, distributed optimizer, --initial-loss-scale 2**20 --loss-scale-window 3,
  --hysteresis 2): the logged loss scale follows megatron-core's DynamicGradScaler rules replayed from the
  logged skipped steps; the scaler state saved at iteration 7 (torch_dist: the dp_reshardable
  ShardedObject `optimizer.distributed.dp_group_idx_<g>.grad_scaler`; legacy: model_optim_rng.pt
  ['optimizer']['grad_scaler']) equals the replay's, with a hysteresis tracker (1) that differs from
  the configured 2; to-universal takes it from both formats into metadata.json's loss_scaler; the resume
  reproduces iterations 8..12 (losses 1e-6 relative, scales and skips equal).
  Negative control: a scaler restarted from the flags would log other scales from iteration 8 on.
- dropout 0.1 (attention and hidden, GPT-2-like TP2 PP2, distributed optimizer): the torch_dist resume
  at iteration 3 restores every rank's RNG state and reproduces iterations 4..6 within 1e-6; negative
  control: --no-load-rng leaves the curve by more than 1e-6.
- uneven pipelines (GPT-2-like, 6 layers, --layout-invariant-init, 5 iterations): first-stage layer
  counts, counted embedding/loss, with and without VPP, PP2 and PP3, give the PP1 run's losses within
  1e-6 relative (same model, same data; reduction order only), and resume exactly (1e-6) from their own
  torch_dist checkpoint. Negative control: without --layout-invariant-init the split changes the
  initial model and the curve moves by more than 1e-3.
"""

import io
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pretrain_runs import Layout, max_rel_diff, train

pytestmark = pytest.mark.torchrun

INITIAL_SCALE, WINDOW, HYSTERESIS = 2.0 ** 20, 3, 2
FP16 = ["--fp16", "--use-distributed-optimizer", "--initial-loss-scale", str(int(INITIAL_SCALE)),
        "--loss-scale-window", str(WINDOW), "--hysteresis", str(HYSTERESIS)]


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


def jsonl_column(path, name):
    return {r["iteration"]: r[name] for r in map(json.loads, path.read_text().splitlines())}


def test_fp16_loss_scaler_is_saved_and_resumed(tmp_path):
    layout = Layout(dp=2)
    full = train("gpt2", layout, tmp_path, "full", 12, [*FP16, "--save", str(tmp_path / "dist"), "--save-interval", "7"])
    skipped = jsonl_column(tmp_path / "full.jsonl", "skipped")
    scales = jsonl_column(tmp_path / "full.jsonl", "loss_scale")
    replay = replay_scaler([skipped[i] for i in range(1, 13)])
    assert [scales[i] for i in range(1, 13)] == [s for s, _, _ in replay]
    assert sum(skipped.values()) >= 3 and len(set(scales.values())) >= 3  # overflows, back-offs and growth
    at_7 = {"scale": replay[6][0], "growth_tracker": replay[6][1], "hysteresis_tracker": replay[6][2]}
    assert at_7["hysteresis_tracker"] not in (0, HYSTERESIS)  # a state a fresh scaler cannot have

    # torch_dist (dp_reshardable): one ShardedObject per model-parallel group, in the .distcp files.
    key = "optimizer.distributed.dp_group_idx_0.grad_scaler/shard_0_1"
    saved = {key: io.BytesIO()}
    dcp.load(saved, storage_reader=dcp.FileSystemReader(str(tmp_path / "dist" / "iter_0000007")), no_dist=True)
    scaler = saved[key][0] if isinstance(saved[key], list) else saved[key]
    assert {k: (v.item() if torch.is_tensor(v) else v) for k, v in scaler.items()} == at_7

    # legacy: model_optim_rng.pt['optimizer']['grad_scaler'].
    train("gpt2", layout, tmp_path, "legacy", 12,
          [*FP16, "--save", str(tmp_path / "legacy"), "--save-interval", "7", "--exit-interval", "7",
           "--ckpt-format", "torch"])
    legacy = torch.load(tmp_path / "legacy" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt",
                        weights_only=False)["optimizer"]["grad_scaler"]
    assert legacy["scale"].dtype == torch.float32 and legacy["scale"].shape == (1,)
    assert {k: (v.item() if torch.is_tensor(v) else v) for k, v in legacy.items()} == at_7
    # Both readers take it into the universal checkpoint's metadata (docs/FORMAT.md "Loss scaler").
    from megatron_ucp.convert import to_universal
    for name in ("dist", "legacy"):
        ucp = to_universal(tmp_path / name, tmp_path / f"{name}_ucp", iteration=7, progress=False)
        assert json.loads((ucp / "metadata.json").read_text())["loss_scaler"] == at_7, name

    resumed = train("gpt2", layout, tmp_path, "resumed", 12,
                    [*FP16, "--load", str(tmp_path / "dist"), "--ckpt-step", "7"])
    assert sorted(resumed) == list(range(8, 13))
    assert max_rel_diff(resumed, full, range(8, 13)) < 1e-6, (resumed, full)
    resumed_scales = jsonl_column(tmp_path / "resumed.jsonl", "loss_scale")
    assert all(resumed_scales[i] == scales[i] for i in range(8, 13)), (resumed_scales, scales)
    # Negative control: a scaler rebuilt from the flags would have scaled differently after iteration 7.
    fresh = replay_scaler([skipped[i] for i in range(8, 13)])
    assert [s for s, _, _ in fresh] != [scales[i] for i in range(8, 13)]


def test_dropout_resume_restores_every_rng_stream(tmp_path):
    layout = Layout(tp=2, pp=2)
    flags = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--use-distributed-optimizer"]
    full = train("gpt2", layout, tmp_path, "full", 6, [*flags, "--save", str(tmp_path / "ckpt"), "--save-interval", "3"])
    resumed = train("gpt2", layout, tmp_path, "resumed", 6, [*flags, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "3"])
    assert sorted(resumed) == [4, 5, 6]
    assert max_rel_diff(resumed, full, range(4, 7)) < 1e-6, (resumed, full)
    fresh_rng = train("gpt2", layout, tmp_path, "no_rng", 6,
                      [*flags, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "3", "--no-load-rng"])
    assert max_rel_diff(fresh_rng, full, range(4, 7)) > 1e-6, (fresh_rng, full)


SIX_LAYERS = ["--num-layers", "6", "--layout-invariant-init"]
UNEVEN = {
    # name: (layout, flags, the split pretrain_gpt.py prints)
    "pp2-first2": (Layout(pp=2), ["--decoder-first-pipeline-num-layers", "2"],
                   "pp0/v0: embedding + layers 0-1 | pp1/v0: layers 2-5 + loss"),
    "pp2-vpp2-first2": (Layout(pp=2), ["--num-virtual-stages-per-pipeline-rank", "2",
                                       "--decoder-first-pipeline-num-layers", "2"],
                        "pp0/v0: embedding + layer 0 | pp1/v0: layers 1-2 | pp0/v1: layer 3 | pp1/v1: layers 4-5 + loss"),
    "pp2-vpp2-counted": (Layout(pp=2), ["--num-layers-per-virtual-pipeline-stage", "2",
                                        "--account-for-embedding-in-pipeline-split",
                                        "--account-for-loss-in-pipeline-split"],
                         "pp0/v0: embedding + layer 0 | pp1/v0: layers 1-2 | pp0/v1: layers 3-4 | pp1/v1: layer 5 + loss"),
    "pp3-first1-last1": (Layout(pp=3), ["--decoder-first-pipeline-num-layers", "1",
                                        "--decoder-last-pipeline-num-layers", "1"],
                         "pp0/v0: embedding + layer 0 | pp1/v0: layers 1-4 | pp2/v0: layer 5 + loss"),
}


@pytest.fixture(scope="module")
def even_reference(tmp_path_factory):
    work = tmp_path_factory.mktemp("even")
    return train("gpt2", Layout(), work, "pp1", 5, SIX_LAYERS)


@pytest.mark.parametrize("name", list(UNEVEN))
def test_uneven_pipeline_matches_one_stage(name, even_reference, tmp_path):
    layout, flags, split = UNEVEN[name]
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"] if name == "pp2-vpp2-first2" else []
    losses = train("gpt2", layout, tmp_path, name, 5, [*SIX_LAYERS, *flags, *save])
    assert f" > pipeline split: {split}" in (tmp_path / f"{name}.log").read_text()
    assert max_rel_diff(losses, even_reference, range(1, 6)) <= 1e-6, (name, losses, even_reference)
    if save:
        resumed = train("gpt2", layout, tmp_path, "resumed", 5,
                        [*SIX_LAYERS, *flags, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "3"])
        assert max_rel_diff(resumed, losses, range(4, 6)) < 1e-6, (resumed, losses)


def test_uneven_pipeline_negative_control(even_reference, tmp_path):
    layout, flags, _ = UNEVEN["pp2-first2"]
    losses = train("gpt2", layout, tmp_path, "megatron_init", 5, ["--num-layers", "6", *flags])
    assert max_rel_diff(losses, even_reference, range(1, 6)) > 1e-3


@pytest.mark.parametrize("flags,message", [
    (["--num-virtual-stages-per-pipeline-rank", "2", "--decoder-first-pipeline-num-layers", "2",
      "--decoder-last-pipeline-num-layers", "2"], "divides by the number of middle stages"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--decoder-first-pipeline-num-layers", "2"],
     "--num-virtual-stages-per-pipeline-rank"),
    (["--decoder-first-pipeline-num-layers", "1", "--account-for-loss-in-pipeline-split"], "cannot be combined"),
    (["--account-for-embedding-in-pipeline-split"], "--num-layers 4 \\+ 1 \\(embedding/loss\\) is not divisible by PP=2"),
])
def test_uneven_pipeline_refusals_name_the_cause(flags, message):
    from pretrain_runs import FAMILIES

    from megatron_ucp.training.arguments import ArgumentError, build_parser, validate_args

    args = build_parser().parse_args([*FAMILIES["gpt2"], "--train-iters", "1",
                                      "--pipeline-model-parallel-size", "2", *flags])
    with pytest.raises(ArgumentError, match=message):
        validate_args(args, world_size=2)
