"""to-universal on Megatron-LM's own checkpoints (all checks bitwise, torch.equal on fp32).

A: legacy `torch`, distributed optimizer, TP2 PP2 DP2 + SP, llama-like (GQA 2 groups, SwiGLU), untied.
B: the same training run saved as `torch_dist` (dp_reshardable) -> must give a bitwise identical
   universal checkpoint.
C: legacy `torch`, plain fp32 Adam, TP2 PP2 DP1, gpt2-like, tied embeddings (output_layer copy on
   the last stage is checked against the embedding and dropped).
All at iteration 4 (consumed 32 samples, Adam step 4).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ucp.adapters.gpt import OUTPUT_LAYER, WORD_EMBEDDINGS, expected_parameters
from megatron_ucp.convert import ConversionError, convert, default_workers, conversion_tasks, to_universal
from megatron_ucp.formats import CheckpointFormatError, open_checkpoint
from megatron_ucp.formats.common import load_pickled
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.core.patterns import bitwise_equal
from megatron_ucp.universal import UniversalCheckpoint, UniversalFormatError
from pretrain_runs import FIXTURE_CKPTS

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCES = FIXTURE_CKPTS
KEYS = ("fp32", "exp_avg", "exp_avg_sq")



@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    """A and C converted by one thread, B by two."""
    root = tmp_path_factory.mktemp("universal")
    out = {}
    for label, workers in (("A", 1), ("B", 2), ("C", 1)):
        path = to_universal(SOURCES[label], root / label, iteration=4, workers=workers, progress=False)
        out[label] = UniversalCheckpoint.open(path)
    return out


@pytest.fixture(scope="module")
def sources():
    return {label: open_checkpoint(path, iteration=4) for label, path in SOURCES.items()}


def test_a_and_b_are_bitwise_identical(universal):
    a, b = universal["A"], universal["B"]
    assert list(a.parameters) == list(b.parameters)
    for name, info in a.parameters.items():
        other = b.parameters[name]
        assert (info.shape, info.pattern, info.tensors, info.step, info.param_group) == (
            other.shape, other.pattern, other.tensors, other.step, other.param_group), name
        for key in info.tensors:
            assert bitwise_equal(a.read(name, key), b.read(name, key)), f"{name} [{key}]"
    assert a.param_groups == b.param_groups
    assert a.scheduler_state == b.scheduler_state
    assert a.metadata["model_config"] == b.metadata["model_config"]


@pytest.mark.parametrize("label", ["A", "B", "C"])
def test_universal_slices_back_to_every_source_shard(universal, sources, label):
    """For every parameter, place and TP rank: pattern.slice_for_rank(universal) == the stored shard, and
    reading only that rank's regions (read_for_rank) gives the same bytes."""
    uc, ckpt = universal[label], sources[label]
    tp = ckpt.layout.tp
    tasks = conversion_tasks(ckpt)
    assert sorted(t.name for t in tasks) == sorted(uc.parameters)
    for task in tasks:
        info = uc.parameters[task.name]
        assert info.pattern == task.pattern
        full = {key: uc.read(task.name, key) for key in KEYS}
        for place in task.places:
            for ref in place:
                stored = ckpt.read(ref)
                for key in KEYS:
                    mine = info.pattern.slice_for_rank(full[key], ref.tp_rank, tp)
                    assert bitwise_equal(mine, stored[key]), f"{task.name} [{key}] tp={ref.tp_rank} {ref.local_name}"
                    assert bitwise_equal(uc.read_for_rank(task.name, ref.tp_rank, tp, key), stored[key])
                # fp32 model: the model weight is the master weight
                assert bitwise_equal(info.pattern.slice_for_rank(full["fp32"], ref.tp_rank, tp), stored["param"])


def test_tied_embedding_stored_once_and_equal_to_both_copies(universal, sources):
    uc, ckpt = universal["C"], sources["C"]
    assert OUTPUT_LAYER not in uc.parameters
    emb = {key: uc.read(WORD_EMBEDDINGS, key) for key in KEYS}
    refs = [r for r in ckpt.shards() if r.local_name in (WORD_EMBEDDINGS, OUTPUT_LAYER)]
    assert {(r.pp_rank, r.local_name) for r in refs} == {(0, WORD_EMBEDDINGS), (1, OUTPUT_LAYER)}
    for local, pp_rank in ((WORD_EMBEDDINGS, 0), (OUTPUT_LAYER, 1)):
        shards = sorted((r for r in refs if r.local_name == local), key=lambda r: r.tp_rank)
        for key in KEYS:
            stored = torch.cat([ckpt.read(r)[key] for r in shards], dim=0)
            assert bitwise_equal(emb[key], stored), f"{local} pp={pp_rank} [{key}]"
    assert uc.parameters[WORD_EMBEDDINGS].shape == (1024, 48)


@pytest.mark.parametrize("label", ["A", "B", "C"])
def test_metadata(universal, sources, label):
    uc, ckpt = universal[label], sources[label]
    args = ckpt.args
    assert uc.iteration == 4 and uc.consumed_train_samples == 32
    assert uc.config.vocab_size == 1001 and uc.config.padded_vocab_size == 1024
    assert uc.config == GPTModelConfig.from_megatron_args(args)
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "max_position_embeddings"):
        assert getattr(uc.config, field) == args[field], field
    assert uc.config.swiglu == (label != "C") and uc.config.tied == (label == "C")
    assert uc.source_layout == ckpt.layout
    assert uc.metadata["source"]["format"] == ckpt.format
    assert uc.metadata["source"]["optimizer_kind"] == ("adam" if label == "C" else "distributed")
    assert uc.scheduler_state["num_steps"] == 32 and uc.scheduler_state["max_lr"] == 1e-3
    assert [g["wd_mult"] for g in uc.param_groups] == [1.0, 0.0]
    assert uc.param_groups[0]["betas"] == [0.9, 0.999] and uc.param_groups[0]["weight_decay"] == 0.01
    assert uc.args["hidden_size"] == 48 and uc.args["num_layers"] == 4
    assert [n for n, _ in expected_parameters(uc.config)] == list(uc.parameters)
    for name, info in uc.parameters.items():
        assert info.step == 4, name
        assert info.tensors == KEYS and info.dtype == "float32" and info.model_dtype == "float32"
        # Megatron's rule: no weight decay for biases and 1-D parameters
        assert info.param_group["wd_mult"] == (0.0 if len(info.shape) == 1 else 1.0), name
        assert info.param_group["index"] == (1 if len(info.shape) == 1 else 0), name
    # nothing pickled: JSON and safetensors only
    files = [p for p in uc.path.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} == {".json", ".safetensors", ""}
    assert all(p.read_bytes()[:2] != b"\x80\x04" for p in files)


def test_reading_a_slice_counts_only_its_bytes(universal):
    uc = UniversalCheckpoint.open(universal["A"].path)
    name = "decoder.layers.2.mlp.linear_fc1.weight"  # [gate; up] = (256, 48)
    assert uc.parameters[name].shape == (256, 48)
    part = uc.read(name, "exp_avg", (slice(0, 64), slice(8, 16)))
    assert part.shape == (64, 8) and uc.bytes_read == 64 * 8 * 4
    assert bitwise_equal(part, uc.read(name, "exp_avg")[0:64, 8:16])
    assert uc.bytes_read == 64 * 8 * 4 + 256 * 48 * 4
    uc.bytes_read = 0
    shard = uc.read_for_rank(name, 1, 4)  # FusedSubParams: gate rows 32..63 and up rows 160..191
    assert shard.shape == (64, 48) and uc.bytes_read == 64 * 48 * 4


# --------------------------------------------------------------------------------------------------
# Failures leave nothing behind


def _leftovers(dst: Path) -> list:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(dst.name))


def _copy_source(tmp_path, label) -> Path:
    src = tmp_path / f"src_{label}"
    shutil.copytree(SOURCES[label], src)
    return src


def test_destination_exists_is_refused(universal, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    with pytest.raises(UniversalFormatError, match="already exists"):
        to_universal(SOURCES["C"], dst, iteration=4, progress=False)
    assert list(dst.iterdir()) == []


def test_truncated_source_leaves_no_output(tmp_path):
    src = _copy_source(tmp_path, "C")
    target = src / "iter_0000004" / "mp_rank_01_001" / "model_optim_rng.pt"
    before = {p: p.stat().st_size for p in src.rglob("*") if p.is_file()}
    with open(target, "r+b") as f:
        f.truncate(target.stat().st_size // 2)
    dst = tmp_path / "out"
    with pytest.raises(CheckpointFormatError, match="mp_rank_01_001"):
        to_universal(src, dst, iteration=4, progress=False)
    assert _leftovers(dst) == []
    assert {p: p.stat().st_size for p in src.rglob("*") if p.is_file()} == {**before, target: target.stat().st_size}


def _perturb_replica(src: Path) -> Path:
    """Make TP rank 1's copy of a replicated parameter (final layernorm, last stage) differ."""
    file = src / "iter_0000004" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = load_pickled(file, what="test")
    state = {k: v for k, v in state.items()}
    model = dict(state["model"])
    model["decoder.final_layernorm.weight"] = model["decoder.final_layernorm.weight"] + 0.5
    state["model"] = model
    torch.save(state, file.with_suffix(".new"))
    os.replace(file.with_suffix(".new"), file)  # the loaded state still maps the old file's bytes
    return file


@pytest.mark.parametrize("workers", [1, 2])
def test_disagreeing_replicas_fail_mid_conversion_and_clean_up(tmp_path, workers):
    src = _copy_source(tmp_path, "C")
    _perturb_replica(src)
    dst = tmp_path / "out"
    with pytest.raises(ConversionError, match="decoder.final_layernorm.weight.*average-replicas"):
        to_universal(src, dst, iteration=4, workers=workers, progress=False)
    assert _leftovers(dst) == []


def test_average_replicas_stores_the_mean(tmp_path):
    src = _copy_source(tmp_path, "C")
    _perturb_replica(src)
    uc = UniversalCheckpoint.open(to_universal(src, tmp_path / "out", iteration=4, average_replicas=True,
                                               progress=False))
    ckpt = open_checkpoint(src, iteration=4)
    refs = [r for r in ckpt.shards() if r.local_name == "decoder.final_layernorm.weight"]
    copies = [ckpt.read(r)["fp32"] for r in refs]
    mean = torch.stack([c.double() for c in copies]).mean(0).float()
    assert bitwise_equal(uc.read("decoder.final_layernorm.weight"), mean)
    assert uc.metadata["conversion"]["average_replicas"] is True


def test_destination_inside_source_is_refused(tmp_path):
    src = _copy_source(tmp_path, "C")
    with pytest.raises(ConversionError, match="overlaps the source"):
        to_universal(src, src / "universal", iteration=4, progress=False)
    assert not (src / "universal").exists()


def test_summary_and_overwrite(universal, tmp_path):
    dst = tmp_path / "out"
    shutil.copytree(universal["C"].path, dst)
    summary = convert(SOURCES["C"], dst, iteration=4, progress=False, overwrite=True)
    assert summary.num_parameters == 52 and summary.iteration == 4 and summary.workers == default_workers()
    assert summary.bytes_written == UniversalCheckpoint.open(dst).total_bytes()
    assert _leftovers(dst) == ["out"]


# --------------------------------------------------------------------------------------------------
# CLI (subprocess): exit status and one error line


def _cli(*argv):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "megatron_ucp.cli", *map(str, argv)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_success_json(tmp_path):
    dst = tmp_path / "out"
    run = _cli("to-universal", SOURCES["C"], dst, "--iteration", "4", "--quiet", "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["ok"] and result["num_parameters"] == 52 and result["iteration"] == 4
    assert run.stderr == ""
    UniversalCheckpoint.open(dst)


def test_cli_errors_are_one_line(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    run = _cli("to-universal", SOURCES["C"], dst, "--quiet")
    assert run.returncode != 0
    assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1 and "already exists" in run.stderr
    assert "Traceback" not in run.stderr

    run = _cli("to-universal", tmp_path / "missing", tmp_path / "out3", "--debug")
    assert run.returncode != 0 and "Traceback" in run.stderr
    assert run.stderr.rstrip().splitlines()[-1].startswith("error: ")
