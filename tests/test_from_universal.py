"""`from-universal`: a universal checkpoint written back as a Megatron checkpoint at any layout.

Layouts and tolerances:
1. Megatron-LM legacy fixtures A (TP2PP2DP2 SP, distributed optimizer) and C (TP2PP2, plain Adam, tied)
   -> universal -> legacy at the SAME layout: every tensor of model_optim_rng.pt (model + optimizer) and
   distrib_optim.pt bitwise equal to Megatron-LM's files; iteration, scheduler, param groups and the
   model/layout args equal.
2. Resharding: C -> TP1PP1, A -> TP1PP2DP1 and A -> TP1PP2DP2 x VPP2 (distributed optimizer); the output,
   converted back to universal, equals the first universal checkpoint bitwise.
   Megatron-LM 0.19's own --load (no plugin; the 0.16.1 fixtures' mock data: pretrain_runs.MOCK_DATA_016)
   resumes the legacy outputs of C at TP1PP1, A at TP1PP2 (distributed optimizer), A at TP1PP2DP2 x VPP2, A at
   PP2 x 3 virtual stages with the embedding and loss counted, and C re-padded, and continues Megatron-LM's
   uninterrupted run (iterations 5..8 within FIXTURE_TOL; the re-padded vocabulary within its measured shift).
   The direct torch_dist writer's outputs are resumed in tests/test_torch_dist_direct.py.
3. The --via-megatron-lm flags (Megatron-LM's own save of a universal checkpoint) are taken by Megatron-LM 0.19's
   parser with the values meant.
4. Errors: a TP that cannot hold the model, an existing DST, --dry-run: nothing is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pretrain_runs import (FIXTURE_LOSS_TOL, FIXTURES, MOCK_DATA_016, Layout, max_rel_diff,  # noqa: E402
                           megatron_lm_losses, train)

from megatron_ucp.commands import from_universal as fu  # noqa: E402
from megatron_ucp.convert import to_universal  # noqa: E402
from megatron_ucp.formats.common import load_pickled  # noqa: E402
from megatron_ucp.universal import UniversalCheckpoint  # noqa: E402

A = "A_llama_tp2pp2dp2_distopt_sp_torch"
C = "C_gpt2_tp2pp2dp1_adam_torch"
# Args a resumed Megatron-LM run checks or derives its model and layout from.
MODEL_LAYOUT_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "group_query_attention",
    "kv_channels", "seq_length", "max_position_embeddings", "vocab_size", "padded_vocab_size",
    "make_vocab_size_divisible_by", "normalization", "swiglu", "position_embedding_type",
    "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "data_parallel_size", "world_size",
    "context_parallel_size",
    "use_distributed_optimizer", "sequence_parallel", "ckpt_format", "params_dtype", "bf16", "fp16",
    "consumed_train_samples", "micro_batch_size", "global_batch_size", "train_iters", "seed", "tokenizer_type",
    "rank", "attention_backend", "model_type")


def fixture_ckpt(name: str) -> Path:
    return FIXTURES / name / "ckpt"


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    """Universal checkpoints of the fixtures, (fixture, iteration) -> path, made once per module."""
    root = tmp_path_factory.mktemp("ucp")
    cache = {}

    def get(name: str, iteration: int = 8) -> Path:
        if (name, iteration) not in cache:
            cache[(name, iteration)] = to_universal(fixture_ckpt(name), root / f"{name}_{iteration}",
                                                    iteration=iteration, progress=False)
        return cache[(name, iteration)]

    return get


def load(path: Path):
    return load_pickled(path, what="test file")


def assert_bitwise_equal(ours, theirs, where: str) -> None:
    """Same structure, key order, tensors bitwise equal (dtype and shape included), other values equal."""
    if torch.is_tensor(theirs):
        assert torch.is_tensor(ours), where
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (where, ours.dtype, theirs.dtype,
                                                                          ours.shape, theirs.shape)
        assert torch.equal(ours.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8)), where
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict), where
        assert list(ours) == list(theirs), (where, list(ours), list(theirs))
        for key in theirs:
            assert_bitwise_equal(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), (where, ours, theirs)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_bitwise_equal(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs and type(ours) is type(theirs), (where, ours, theirs)


def _plain(value):
    """Enums compare by value: the reader may give a megatron enum or its PickledEnum stand-in."""
    return ("enum", value.value) if hasattr(value, "value") and not torch.is_tensor(value) else value


def compare_with_fixture(out_iter: Path, fixture_iter: Path, skip_args=()) -> int:
    """Every rank file of the fixture against ours (the args of MODEL_LAYOUT_ARGS but `skip_args`); returns the
    number of files compared."""
    rank_dirs = sorted(p.name for p in fixture_iter.iterdir())
    assert sorted(p.name for p in out_iter.iterdir()) == rank_dirs
    compared = 0
    for rank in rank_dirs:
        ours, theirs = load(out_iter / rank / "model_optim_rng.pt"), load(fixture_iter / rank / "model_optim_rng.pt")
        assert set(ours) == set(theirs), (rank, sorted(ours), sorted(theirs))
        for key in theirs:
            if key in ("args", "rng_state"):
                continue
            assert_bitwise_equal(ours[key], theirs[key], f"{rank}/model_optim_rng.pt[{key!r}]")
        ours_args, theirs_args = vars(ours["args"]), vars(theirs["args"])
        for name in (n for n in MODEL_LAYOUT_ARGS if n not in skip_args):
            assert _plain(ours_args.get(name)) == _plain(theirs_args.get(name)), (rank, name, ours_args.get(name),
                                                                                  theirs_args.get(name))
        # Megatron-LM's loader reads rng_state[0] (the fixture's CPU-generator format here)
        assert [sorted(s) for s in ours["rng_state"]] == [sorted(s) for s in theirs["rng_state"]]
        assert set(ours["rng_state"][0]["rng_tracker_states"]) == set(theirs["rng_state"][0]["rng_tracker_states"])
        compared += 1
        distrib = fixture_iter / rank / "distrib_optim.pt"
        if distrib.exists():
            assert_bitwise_equal(load(out_iter / rank / "distrib_optim.pt"), load(distrib), f"{rank}/distrib_optim.pt")
            compared += 1
        else:
            assert not (out_iter / rank / "distrib_optim.pt").exists()
    return compared


# ------------------------------------------------------------------------------------------------
# 1. Same-layout round trip is bitwise


@pytest.mark.parametrize("name,layout,distopt", [
    (A, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2,
             sequence_parallel=True), True),
    (C, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=1), False),
], ids=["A-distopt", "C-adam"])
def test_same_layout_round_trip_is_bitwise(universal, tmp_path, name, layout, distopt):
    ucp = universal(name, 8)
    out = tmp_path / "megatron"
    summary = fu.from_universal(ucp, out, **layout, use_distributed_optimizer=distopt, ckpt_format="torch",
                                rng_state="cpu", progress=False)
    assert summary.path == out and not summary.plan.warnings
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "8"
    assert compare_with_fixture(out / "iter_0000008", fixture_ckpt(name) / "iter_0000008") == (8 if distopt else 4)
    assert not list(tmp_path.glob("*.partial-*"))


def test_rng_state_formats(universal, tmp_path):
    """Default: CUDA generator states (16 bytes: seed, Philox offset) Megatron-LM's loader accepts on GPUs;
    `none` omits it (Megatron-LM then needs --no-load-rng)."""
    ucp = universal(C, 8)
    fu.from_universal(ucp, tmp_path / "cuda", tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                      ckpt_format="torch", progress=False)
    state = load(tmp_path / "cuda" / "iter_0000008" / "mp_rank_01_001" / "model_optim_rng.pt")
    rng = state["rng_state"][0]
    assert rng["cuda_rng_state"].dtype == torch.uint8 and rng["cuda_rng_state"].numel() == 16
    seed = int.from_bytes(bytes(rng["rng_tracker_states"]["model-parallel-rng"][:8].tolist()), "little")
    assert seed == 1234 + 7919 * 8 + 100 * 1 + 2718 + 1  # seed + iteration term + pp_rank, tp offset + tp_rank
    if torch.cuda.is_available():  # the state torch.cuda.set_rng_state must accept
        torch.cuda.set_rng_state(rng["cuda_rng_state"])
    fu.from_universal(ucp, tmp_path / "none", tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                      ckpt_format="torch", rng_state="none", progress=False)
    assert "rng_state" not in load(tmp_path / "none" / "iter_0000008" / "mp_rank_00_000" / "model_optim_rng.pt")


# ------------------------------------------------------------------------------------------------
# 2. Resharding, verified through the reader


def assert_universal_equal(ours: Path, theirs: Path) -> None:
    a, b = UniversalCheckpoint.open(ours), UniversalCheckpoint.open(theirs)
    assert list(a.parameters) == list(b.parameters)
    assert a.iteration == b.iteration and a.consumed_train_samples == b.consumed_train_samples
    assert a.scheduler_state == b.scheduler_state and a.param_groups == b.param_groups
    assert a.config == b.config
    for name, info in b.parameters.items():
        mine = a.parameters[name]
        assert (mine.shape, mine.tensors, mine.step, mine.param_group) == (info.shape, info.tensors, info.step,
                                                                          info.param_group), name
        for key in info.tensors:
            assert torch.equal(a.read(name, key).view(torch.int32), b.read(name, key).view(torch.int32)), (name, key)


# Continuing Megatron-LM's uninterrupted runs (iterations 5..8 of LOSSES.txt, printed with 7 significant
# digits) from a from-universal output loaded with a plain --load: measured <= 4e-7 relative; the tolerance
# also covers cross-CPU noise (pretrain_runs.py).
FIXTURE_TOL = FIXTURE_LOSS_TOL
FAMILY = {A: "llama", C: "gpt2"}


def continue_with_megatron_lm(name: str, out: Path, layout: Layout, extra, tmp_path) -> float:
    """Resume a from-universal output at iteration 4 with Megatron-LM 0.19's plain --load (its own load, no
    --universal-checkpoint; the 0.16.1 fixtures' mock data: MOCK_DATA_016) and return the largest relative
    difference from Megatron-LM 0.16.1's uninterrupted run."""
    resumed = train(FAMILY[name], layout, tmp_path, "continue", 8, [*MOCK_DATA_016, *extra, "--load", str(out)])
    assert sorted(resumed) == [5, 6, 7, 8], resumed
    return max_rel_diff(resumed, megatron_lm_losses(name), range(5, 9))


@pytest.mark.torchrun
@pytest.mark.parametrize("name,layout,distopt,rank_dirs", [
    (C, dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1), False, ["mp_rank_00"]),
    (A, dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, data_parallel_size=1), True,
     ["mp_rank_00_000", "mp_rank_00_001"]),
], ids=["C-to-TP1PP1", "A-to-TP1PP2DP1-distopt"])
def test_reshard_legacy_read_back_and_continue(universal, tmp_path, name, layout, distopt, rank_dirs):
    ucp = universal(name, 4)
    out = tmp_path / "megatron"
    fu.from_universal(ucp, out, **layout, use_distributed_optimizer=distopt, ckpt_format="torch", rng_state="cpu",
                      progress=False)
    assert sorted(p.name for p in (out / "iter_0000004").iterdir()) == rank_dirs
    first = load(out / "iter_0000004" / rank_dirs[0] / "model_optim_rng.pt")
    args = vars(first["args"])
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"], args["data_parallel_size"],
            args["world_size"], args["use_distributed_optimizer"]) == (
        layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"],
        layout.get("data_parallel_size", 1), layout["pipeline_model_parallel_size"], distopt)
    assert args["sequence_parallel"] is False  # TP1
    if name == C:  # tied at PP1: one embedding, the output layer module has only its _extra_state
        assert "output_layer.weight" not in first["model"] and first["model"]["output_layer._extra_state"] is None
    back = to_universal(out, tmp_path / "back", progress=False)
    assert_universal_equal(back, ucp)
    target = Layout(tp=1, pp=layout["pipeline_model_parallel_size"])
    diff = continue_with_megatron_lm(name, out, target, ["--use-distributed-optimizer"] if distopt else [], tmp_path)
    assert diff <= FIXTURE_TOL, diff


@pytest.mark.torchrun
def test_vpp_and_dp_layouts_read_back_and_continue(universal, tmp_path):
    """A at TP1 PP2 DP2 x VPP2 (1 layer per virtual stage): model0/model1, one DDP buffer per chunk."""
    ucp = universal(A, 4)
    out = tmp_path / "megatron"
    fu.from_universal(ucp, out, tensor_model_parallel_size=1, pipeline_model_parallel_size=2, data_parallel_size=2,
                      num_layers_per_virtual_pipeline_stage=1, use_distributed_optimizer=True, ckpt_format="torch",
                      rng_state="cpu", progress=False)
    state = load(out / "iter_0000004" / "mp_rank_00_000" / "model_optim_rng.pt")
    assert "model0" in state and "model1" in state and "model" not in state
    assert vars(state["args"])["virtual_pipeline_model_parallel_size"] == 2
    assert sorted(k for k in load(out / "iter_0000004" / "mp_rank_00_000" / "distrib_optim.pt")
                  if k != "buckets_coalesced") == [0, 1]
    assert_universal_equal(to_universal(out, tmp_path / "back", progress=False), ucp)
    diff = continue_with_megatron_lm(A, out, Layout(pp=2, dp=2, vpp_layers=1), ["--use-distributed-optimizer"], tmp_path)
    assert diff <= FIXTURE_TOL, diff


def _with_divisible_by(src: Path, dst: Path, divisible_by: int) -> Path:
    """A copy of a universal checkpoint whose run used another --make-vocab-size-divisible-by."""
    import hashlib
    import shutil

    shutil.copytree(src, dst)
    meta = json.loads((dst / "metadata.json").read_text())
    meta["model_config"]["make_vocab_size_divisible_by"] = divisible_by
    meta["args"]["make_vocab_size_divisible_by"] = divisible_by
    (dst / "metadata.json").write_text(json.dumps(meta))
    complete = json.loads((dst / "COMPLETE").read_text())
    complete["metadata_sha256"] = hashlib.sha256((dst / "metadata.json").read_bytes()).hexdigest()
    (dst / "COMPLETE").write_text(json.dumps(complete))
    return dst


@pytest.mark.torchrun
def test_vocab_is_repadded_when_megatron_would_compute_another_size(universal, tmp_path):
    """Stored 1024 rows; with divisible_by 100 Megatron-LM computes ceil(1001/200)*200 = 1200 rows at TP2
    (it never reads the padded size from a checkpoint): padding rows are appended (weights: their mean,
    moments: zero), the true vocabulary is untouched, and a warning says the loss shifts. Megatron-LM loads
    it with --make-vocab-size-divisible-by 100 and continues. The loss shifts from Megatron-LM's run by what
    176 more padding rows add to the softmax (each carries about the trained padding rows' average mass: 23
    rows become 199): measured 2.3e-2 relative, asserted below 5e-2. That the re-padding itself is exact (the
    same loss as a model re-padded offline, 1e-6) is test_e2e_vocab_repad.py's proof."""
    ucp = _with_divisible_by(universal(C, 4), tmp_path / "ucp100", 100)
    warnings = []
    summary = fu.from_universal(ucp, tmp_path / "megatron", tensor_model_parallel_size=2,
                                pipeline_model_parallel_size=2, ckpt_format="torch", rng_state="cpu", progress=False,
                                warn=warnings.append)
    assert summary.plan.padded_vocab_size == 1200 and len(warnings) == 1 and "1024 to 1200" in warnings[0]
    state = load(tmp_path / "megatron" / "iter_0000004" / "mp_rank_01_001" / "model_optim_rng.pt")
    assert tuple(state["model"]["output_layer.weight"].shape) == (600, 48)
    assert vars(state["args"])["padded_vocab_size"] == 1200
    back = UniversalCheckpoint.open(to_universal(tmp_path / "megatron", tmp_path / "back", progress=False))
    orig = UniversalCheckpoint.open(ucp)
    name = "embedding.word_embeddings.weight"
    assert back.parameters[name].shape == (1200, 48)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert torch.equal(back.read(name, key)[:1024], orig.read(name, key)), key
    assert torch.equal(back.read(name, "exp_avg")[1024:], torch.zeros(176, 48))
    assert torch.allclose(back.read(name, "fp32")[1024:], orig.read(name, "fp32")[1001:].mean(0).expand(176, 48))
    shift = continue_with_megatron_lm(C, tmp_path / "megatron", Layout(tp=2, pp=2),
                                  ["--make-vocab-size-divisible-by", "100"], tmp_path)
    assert shift <= 5e-2, shift


# ------------------------------------------------------------------------------------------------
# 4. Errors and dry run


def test_tp_not_dividing_query_groups_is_refused_before_writing(universal, tmp_path):
    ucp = universal(A, 8)
    out = tmp_path / "megatron"
    with pytest.raises(fu.FromUniversalError) as e:
        fu.from_universal(ucp, out, tensor_model_parallel_size=4, pipeline_model_parallel_size=1,
                          ckpt_format="torch", progress=False)
    message = str(e.value)
    assert "num_query_groups=2" in message and "TP=4" in message and "choose TP in [1, 2]" in message, message
    assert list(tmp_path.iterdir()) == []


def test_layers_not_dividing_pp_is_refused(universal, tmp_path):
    with pytest.raises(fu.FromUniversalError, match="num_layers=4 is not divisible by PP x VPP = 3"):
        fu.from_universal(universal(C, 8), tmp_path / "x", pipeline_model_parallel_size=3, ckpt_format="torch",
                          progress=False)
    with pytest.raises(fu.FromUniversalError, match="global batch 8 is not divisible"):
        fu.from_universal(universal(C, 8), tmp_path / "x", data_parallel_size=3, ckpt_format="torch", progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.torchrun
def test_uneven_targets_are_planned_refused_and_continued(universal, tmp_path):
    """Megatron-LM's split flags on from-universal (--decoder-first/last-pipeline-num-layers,
    --account-for-embedding/loss-in-pipeline-split, --num-virtual-stages-per-pipeline-rank): the target layout,
    its args and each rank folder's layers follow megatron-core's placement; impossible splits are refused
    before anything is written. The embedding/loss-counted VPP3 output continues Megatron-LM's run within
    FIXTURE_TOL (with the distributed optimizer and many buckets: test_e2e_buckets_targets.py)."""
    ucp = universal(A, 4)
    rc, out = _cli([str(ucp), str(tmp_path / "x"), "-p", "2", "--decoder-last-pipeline-num-layers", "1",
                    "--ckpt-format", "torch", "--dry-run"])
    assert rc == 0 and out["layout"]["last_stage_layers"] == 1 and not (tmp_path / "x").exists(), out
    summary = fu.from_universal(ucp, tmp_path / "counted", pipeline_model_parallel_size=2, ckpt_format="torch",
                                rng_state="cpu", progress=False, pipeline_split={"embedding_in_split": True, "loss_in_split": True,
                                                                "virtual_stages": 3})
    assert (summary.plan.layout.vpp, summary.plan.layout.embedding_in_split) == (3, True)
    layers = {}
    for rank_dir in sorted((tmp_path / "counted" / "iter_0000004").iterdir()):
        state = load(rank_dir / "model_optim_rng.pt")
        assert vars(state["args"])["num_virtual_stages_per_pipeline_rank"] == 3
        layers[rank_dir.name] = [sorted({int(k.split(".")[2]) for k in state[f"model{v}"]
                                         if k.startswith("decoder.layers.")}) for v in range(3)]
    # 4 layers + embedding + loss = 6 over 2 stages x 3 virtual stages: one each, the first and last chunk
    # hold the embedding and the loss instead of a layer (local indices)
    assert layers == {"mp_rank_00_000": [[], [0], [0]], "mp_rank_00_001": [[0], [0], []]}, layers
    for split, message in (({"first_stage_layers": 4}, "0 layers left for 1 middle stages"),
                           ({"first_stage_layers": 1, "loss_in_split": True}, "cannot be combined")):
        with pytest.raises(fu.FromUniversalError, match=message):
            fu.from_universal(ucp, tmp_path / "bad", pipeline_model_parallel_size=2, ckpt_format="torch",
                              progress=False, pipeline_split=split)
    with pytest.raises(fu.FromUniversalError, match="give the virtual pipeline size as"):
        fu.from_universal(ucp, tmp_path / "bad", pipeline_model_parallel_size=2, ckpt_format="torch", progress=False,
                          num_layers_per_virtual_pipeline_stage=1, pipeline_split={"first_stage_layers": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counted"]
    counted = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
               "--num-virtual-stages-per-pipeline-rank", "3"]
    diff = continue_with_megatron_lm(A, tmp_path / "counted", Layout(pp=2), counted, tmp_path)
    assert diff <= FIXTURE_TOL, diff


def _cli(argv) -> tuple[int, dict]:
    """`megatron-ucp from-universal ... --json` in a subprocess, as a user runs it: (exit code, result)."""
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", "from-universal", *argv, "--quiet", "--json"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": proc.stderr}
    return proc.returncode, result


def test_existing_destination_and_dry_run_write_nothing(universal, tmp_path, capsys):
    ucp = universal(C, 8)
    dst = tmp_path / "existing"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    rc, out = _cli([str(ucp), str(dst), "--tensor-model-parallel-size", "1", "--ckpt-format", "torch"])
    assert rc == 1 and "already exists" in out["error"] and "--overwrite" in out["error"]
    rc, out = _cli([str(ucp), str(dst), "--ckpt-format", "torch", "--overwrite"])
    assert rc == 1 and "was not written by megatron-ucp" in out["error"] and "refusing to overwrite" in out["error"]
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]

    fresh = tmp_path / "fresh"
    rc, out = _cli([str(ucp), str(fresh), "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                    "--ckpt-format", "torch", "--dry-run"])
    assert rc == 0 and out["dry_run"] and not fresh.exists()
    assert [f["path"] for f in out["files"]] == [
        "iter_0000008/mp_rank_00_000/model_optim_rng.pt", "iter_0000008/mp_rank_01_000/model_optim_rng.pt",
        "iter_0000008/mp_rank_00_001/model_optim_rng.pt", "iter_0000008/mp_rank_01_001/model_optim_rng.pt",
        "latest_checkpointed_iteration.txt"]
    assert all(f["bytes"] > 0 for f in out["files"][:-1]) and "would write" in out["message"]
    rc, out = _cli([str(ucp), str(fresh), "--ckpt-format", "torch_dist", "--dry-run",
                    "--pipeline-model-parallel-size", "2"])
    # the direct writer lists every file: PP2 x 2 files per rank, then the metadata files and the tracker
    assert rc == 0 and not fresh.exists() and out["details"][0] == "optimizer state: adam"
    assert [f["path"] for f in out["files"]] == [
        "iter_0000008/__0_0.distcp", "iter_0000008/__0_1.distcp", "iter_0000008/__1_0.distcp",
        "iter_0000008/__1_1.distcp", "iter_0000008/.metadata", "iter_0000008/common.pt",
        "iter_0000008/metadata.json", "latest_checkpointed_iteration.txt"]
    rc, out = _cli([str(ucp), str(fresh), "--ckpt-format", "torch_dist", "--dry-run", "--via-megatron-lm",
                    "--pipeline-model-parallel-size", "2"])
    assert rc == 0 and not fresh.exists() and "--pipeline-model-parallel-size 2" in out["message"]
    # the flag's former name (the writer ran the retired home-made loop) still means the same
    rc, old = _cli([str(ucp), str(fresh), "--ckpt-format", "torch_dist", "--dry-run", "--via-harness",
                    "--pipeline-model-parallel-size", "2"])
    assert rc == 0 and old["message"] == out["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]

    # --overwrite replaces an existing Megatron checkpoint atomically (here with iteration 4 of the run; the
    # TP1 PP1 layout is continued by test_reshard_legacy_read_back_and_continue)
    fu.from_universal(ucp, fresh, ckpt_format="torch", progress=False)
    fu.from_universal(universal(C, 4), fresh, ckpt_format="torch", overwrite=True, progress=False)
    assert sorted(p.name for p in fresh.iterdir() if p.is_dir()) == ["iter_0000004"]
    assert (fresh / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "fresh"]


# Megatron-LM 0.19's own parser (the entry point's, with the plugin flags), printing the parsed scalar args.
PARSE_CHILD = r"""
import json, sys
from megatron_ucp.megatron_lm import cpu_shims
cpu_shims.install_import_patches()
from megatron.training.arguments import parse_args
from megatron_ucp.megatron_lm.pretrain_gpt import extra_args_provider
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
print(json.dumps({k: v for k, v in vars(parse_args(extra_args_provider)).items()
                  if isinstance(v, (int, float, str, bool, type(None)))}))
"""


def test_via_megatron_lm_flags_are_megatron_lms(universal):
    """The flags of `--via-megatron-lm` rebuild fixture A's command line (model, batch, schedule, data) at the target
    layout, and Megatron-LM 0.19's own parser takes them with the values meant (vocabulary: 0.16.1's 1001 tokens,
    EOD included, which 0.19 takes as --vocab-size); an unknown flag would stop it."""
    from megatron_ucp.formats.torch_dist.megatron_lm_writer import (PRETRAIN_SCRIPT, megatron_lm_command,
                                                                 megatron_lm_flags_from_universal)

    ucp = UniversalCheckpoint.open(universal(A, 4))
    flags = megatron_lm_flags_from_universal(ucp.metadata, fu.target_layout(ucp, 1, 2, 1, None, False),
                                         use_distributed_optimizer=True)
    text = " ".join(flags)
    for expected in ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2", "--use-distributed-optimizer",
                     "--num-layers 4", "--hidden-size 48", "--ffn-hidden-size 128", "--num-attention-heads 4",
                     "--group-query-attention --num-query-groups 2", "--swiglu", "--normalization RMSNorm",
                     "--position-embedding-type rope", "--untie-embeddings-and-output-weights",
                     "--disable-bias-linear", "--seq-length 32", "--max-position-embeddings 32",
                     "--micro-batch-size 2", "--global-batch-size 8", "--lr 0.001", "--min-lr 0.001",
                     "--lr-decay-style constant", "--lr-decay-iters 8", "--seed 1234", "--weight-decay 0.01",
                     "--attention-dropout 0.0", "--hidden-dropout 0.0",
                     "--tokenizer-type NullTokenizer --vocab-size 1001 --mock-data"):
        assert expected in text, (expected, text)
    assert "--sequence-parallel" not in text and "--bf16" not in text
    command = megatron_lm_command(Path("/ucp"), Path("/dst"), 4, 2, flags)
    argv = command[command.index(str(PRETRAIN_SCRIPT)) + 1:]
    proc = subprocess.run([sys.executable, "-c", PARSE_CHILD, *argv], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (args["lr_decay_iters"], args["num_query_groups"], args["vocab_size"], args["train_iters"],
            args["save_interval"], args["universal_checkpoint"], args["ckpt_format"]) == (
        8, 2, 1001, 4, 5, True, "torch_dist")
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"], args["normalization"],
            args["untie_embeddings_and_output_weights"], args["add_bias_linear"]) == (1, 2, "RMSNorm", True, False)
    bad = subprocess.run([sys.executable, "-c", PARSE_CHILD, *argv, "--layout-invariant-init"],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "unrecognized arguments: --layout-invariant-init" in bad.stderr  # the check sees
