"""The inspection and planning subcommands, run as a user runs them: `python -m megatron_ucp.cli ...` in a
subprocess, for every case including the errors (CLI below runs the command and keeps its output).

Inputs are Megatron-LM's own fixture checkpoints (read-only) and their universal conversions in tmp dirs:
A (legacy torch, TP2 PP2 DP2 SP, distributed optimizer, llama-like with 2 query groups), B (the same run
as torch_dist), C (legacy torch, TP2 PP2 DP1, gpt2-like, tied). `verify` compares with atol = rtol = 0
(bitwise-equal values) unless a test says otherwise.
"""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ucp.adapters.gpt import expected_parameters
from megatron_ucp.convert import to_universal
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.commands.plan import format_report as format_plan

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "megatron-lm"
A = FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt"
B = FIXTURES / "B_llama_tp2pp2dp2_distopt_sp_torch_dist" / "ckpt"
C = FIXTURES / "C_gpt2_tp2pp2dp1_adam_torch" / "ckpt"



def run_cli(*args, expect=0):
    """The command as a user runs it; returns (stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.stdout, proc.stderr


def run_json(*args, expect=0) -> dict:
    out, _ = run_cli(*args, "--json", "--quiet", expect=expect)
    return json.loads(out)


class _UserCLI:
    """`megatron-ucp ARGS` in a subprocess, as a user runs it: main() returns the exit code and
    readouterr() the (stdout, stderr) of the last run."""

    def __init__(self):
        self._last = ("", "")

    def main(self, argv) -> int:
        proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", *map(str, argv)], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300)
        self._last = (proc.stdout, proc.stderr)
        return proc.returncode

    def readouterr(self):
        out, self._last = self._last, ("", "")
        return type("Captured", (), {"out": out[0], "err": out[1]})()


CLI = _UserCLI()


def main_json(capsys, *args, expect=0) -> dict:
    """The command in a subprocess, --json output parsed."""
    assert CLI.main([*map(str, args), "--json", "--quiet"]) == expect
    return json.loads(CLI.readouterr().out)


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def ucp(tmp_path_factory):
    root = tmp_path_factory.mktemp("ucp")
    out = {label: to_universal(src, root / label, iteration=it, progress=False)
           for label, src, it in (("A8", A, 8), ("B8", B, 8), ("A4", A, 4), ("C8", C, 8))}
    return out


# --------------------------------------------------------------------------------------------------
# inspect


def test_inspect_json_for_all_three_formats(ucp, capsys):
    universal = run_json("inspect", ucp["A8"])
    legacy = main_json(capsys, "inspect", A)  # root: the tracker's iteration (8)
    dist = main_json(capsys, "inspect", B, "--iteration", 4)
    assert (universal["format"], legacy["format"], dist["format"]) == ("universal", "torch", "torch_dist")
    assert universal["format_version"] == 2 and universal["checksums"] and universal["problems"] == []
    assert (universal["iteration"], legacy["iteration"], dist["iteration"]) == (8, 8, 4)
    assert (universal["consumed_train_samples"], legacy["consumed_train_samples"],
            dist["consumed_train_samples"]) == (64, 64, 32)
    for info in (universal, legacy, dist):
        assert info["ok"] is True
        assert info["layout"] == {"tp": 2, "pp": 2, "dp": 2, "vpp": None, "sp": True, "ep": 1, "etp": None}
        assert info["optimizer_kind"] == "distributed" and info["has_optimizer_state"]
        c = info["model_config"]
        assert (c["num_query_groups"], c["vocab_size"], c["padded_vocab_size"], c["swiglu"]) == (2, 1001, 1024, True)
        assert info["total_bytes"] > 0 and info["consolidated_bytes"] == 3 * 4 * info["num_elements"]
    # Megatron shapes come from the adapter, universal ones from metadata: the same table.
    assert universal["parameters"] == legacy["parameters"] == dist["parameters"]
    qkv = {p["name"]: p for p in legacy["parameters"]}["decoder.layers.3.self_attention.linear_qkv.weight"]
    assert qkv["shape"] == [(4 + 2 * 2) * 12, 48] and qkv["dtype"] == "float32"
    assert qkv["pattern"] == {"kind": "grouped_qkv", "num_query_groups": 2, "heads_per_group": 2, "head_dim": 12}


def test_inspect_table_and_errors(ucp, tmp_path, capsys):
    assert CLI.main(["inspect", str(C / "iter_0000004")]) == 0
    out = CLI.readouterr().out
    assert "format        torch" in out and "embedding.position_embeddings.weight" in out
    assert "output_layer.weight" not in out  # tied: one canonical tensor
    # errors: one line on stderr naming the cause and the fix, exit 1, no traceback
    _, err = run_cli("inspect", tmp_path / "nope", expect=1)
    assert err.startswith("error: ") and err.count("\n") == 1 and "no such file or directory" in err
    (tmp_path / "empty").mkdir()
    assert CLI.main(["inspect", str(tmp_path / "empty")]) == 1
    assert "not a checkpoint" in CLI.readouterr().err
    assert CLI.main(["inspect", str(A), "--iteration", "5"]) == 1
    assert "iter_0000005: missing" in CLI.readouterr().err
    # a universal checkpoint from a newer megatron-ucp (version 5, consistent marker; 3 is a lazy one with 'zeroed',
    # 4 one with another optimizer's state than Adam's)
    newer = tmp_path / "newer"
    shutil.copytree(ucp["C8"], newer)
    meta = json.loads((newer / "metadata.json").read_text())
    meta["version"] = 5
    (newer / "metadata.json").write_text(json.dumps(meta))
    import hashlib
    marker = json.loads((newer / "COMPLETE").read_text())
    marker["metadata_sha256"] = hashlib.sha256((newer / "metadata.json").read_bytes()).hexdigest()
    (newer / "COMPLETE").write_text(json.dumps(marker))
    assert CLI.main(["inspect", str(newer), "--json"]) == 1
    captured = CLI.readouterr()
    assert "format version 5" in captured.err and "upgrade megatron-ucp" in captured.err
    assert json.loads(captured.out)["ok"] is False


# --------------------------------------------------------------------------------------------------
# verify


def test_verify_same_run_in_two_formats_is_equal(ucp):
    """A and B (legacy torch vs torch_dist of one run) converted: weights, moments and steps bitwise equal."""
    before = snapshot(ucp["A8"])
    out, _ = run_cli("verify", ucp["A8"], ucp["B8"])
    assert out.strip().splitlines()[-1].startswith("equal: 108 tensors of 27 parameters")
    assert snapshot(ucp["A8"]) == before  # input never modified


def test_verify_iterations_4_and_8_differ(ucp, capsys):
    """Megatron checkpoints directly (legacy torch, consolidated on the fly), iteration 4 vs 8: exit 1."""
    out, _ = run_cli("verify", A / "iter_0000004", A, "--top", "3", expect=1)
    last = out.strip().splitlines()[-1]
    assert last.startswith("differ: 108 of 108 tensors differ beyond atol=0 rtol=0; worst decoder.layers.")
    assert "worst tensors:" in out and "Adam steps differ: step 4 vs 8" in out
    table = [line for line in out.split("worst tensors:")[1].strip().splitlines() if line]
    assert len(table) == 1 + 3 + 1  # header, --top 3 rows, the summary line
    # four steps move no value by 0.01 (lr 1e-3), but a tolerance never hides the Adam steps: still differ
    result = main_json(capsys, "verify", ucp["A4"], ucp["A8"], "--atol", "0.01", expect=1)
    assert result["equal"] is False and result["exit_code"] == 1 and result["num_differing"] == 27
    assert result["worst"][0]["key"] == "step" and result["worst"][0]["note"] == "step 4 vs 8"


def test_verify_legacy_against_its_own_conversion(ucp, capsys):
    assert CLI.main(["verify", str(A), str(ucp["A8"]), "--quiet"]) == 0
    assert CLI.readouterr().out == ""
    result = main_json(capsys, "verify", A, ucp["A8"])
    assert result["equal"] and result["num_differing"] == 0 and result["compared"] == [
        "fp32", "exp_avg", "exp_avg_sq", "step"]
    assert (result["a"]["format"], result["b"]["format"]) == ("torch", "universal")


def test_verify_reports_vocab_padding_and_missing_state(ucp, tmp_path, capsys):
    """A copy of C8 re-padded to 1152 rows (as a TP3 load would) and without Adam state: the first 1024 rows and
    the weights are compared; the padding difference is reported."""
    import torch

    from megatron_ucp.universal import UniversalCheckpoint, UniversalWriter

    src = UniversalCheckpoint.open(ucp["C8"])
    dst = tmp_path / "C8_repadded"
    with UniversalWriter(dst) as writer:
        for name, info in src.parameters.items():
            weight = src.read(name)
            if name == "embedding.word_embeddings.weight":
                weight = torch.cat([weight, torch.zeros(128, weight.shape[1])])
            writer.write_parameter(name, {"fp32": weight}, {"pattern": info.pattern, "step": None,
                                                            "model_dtype": info.model_dtype})
        meta = {k: v for k, v in src.metadata.items() if k not in ("parameters", "format", "version")}
        meta["model_config"] = {**meta["model_config"], "padded_vocab_size": 1152}
        writer.finish(meta, expected_parameters(GPTModelConfig.from_dict(meta["model_config"])))
    assert CLI.main(["verify", str(ucp["C8"]), str(dst), "--quiet", "--json"]) == 0
    result = json.loads(CLI.readouterr().out)
    assert result["vocab_padding"] == {"a_rows": 1024, "b_rows": 1152, "compared_rows": 1024, "true_vocab_size": 1001}
    assert result["compared"] == ["fp32"]
    assert CLI.main(["verify", str(ucp["C8"]), str(dst)]) == 0
    out = CLI.readouterr().out
    assert "vocabulary padding differs: A has 1024 rows, B has 1152" in out
    assert "optimizer state not compared: B has none" in out
    # different models: parameters only on one side are reported, exit 1
    assert CLI.main(["verify", str(ucp["C8"]), str(ucp["A8"]), "--quiet"]) == 1


# --------------------------------------------------------------------------------------------------
# plan


def test_plan_incompatible_tp_exits_non_zero(ucp):
    out, _ = run_cli("plan", ucp["A8"], "--tensor-model-parallel-size", 4, expect=1)
    assert "incompatible: num_query_groups=2 is not divisible by TP=4" in out and "choose TP in [1, 2]" in out


def test_plan_reads_per_rank(ucp, capsys):
    """TP2 PP2 DP2 with the distributed optimizer: the DP ranks of a stage together read each fp32 weight's TP
    slice and each Adam moment about once (bucket shards plus at most a boundary row each; the param
    all-gather completes the weights). test_e2e_buckets_targets.py checks the total against the bytes the
    loader reports reading."""
    argv = ["plan", str(ucp["A8"]), "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--data-parallel-size", "2", "--use-distributed-optimizer", "--json"]
    assert CLI.main(argv) == 0
    plan = json.loads(CLI.readouterr().out)
    assert plan["compatible"] and plan["problems"] == [] and plan["warnings"] == []
    assert len(plan["ranks"]) == 8 and [r["rank"] for r in plan["ranks"]] == list(range(8))
    params = json.loads((ucp["A8"] / "metadata.json").read_text())["parameters"]
    # each weight's TP slices once over the stages; replicated ones (norms) on both TP ranks
    weights = sum(s["weight_bytes"] for s in plan["stages"])
    assert weights == sum(4 * math.prod(p["shape"]) * (2 if p["pattern"]["kind"] == "replicated" else 1)
                          for p in params.values())
    moments = sum(r["optimizer_bytes"] for r in plan["ranks"])
    assert 2 * weights <= moments <= 2 * weights * 1.05
    fp32 = sum(r["weight_bytes"] for r in plan["ranks"])
    assert 2 * fp32 == moments  # the same rows of the weight and of each moment
    names = [n for s in plan["stages"] if s["tp_rank"] == 0 for n in s["parameters"]]
    assert sorted(names) == sorted(params)
    # without the distributed optimizer each DP rank reads its stage's full moments; a Megatron source adds
    # the conversion step; TP 3 changes the vocabulary padding (a warning) and is refused for the heads
    assert CLI.main(["plan", str(C), "--tensor-model-parallel-size", "1", "--data-parallel-size", "4", "--json"]) == 0
    plan = json.loads(CLI.readouterr().out)
    assert plan["conversion"]["parameters"] == 52 and plan["source"]["format"] == "torch"
    assert {r["optimizer_bytes"] for r in plan["ranks"]} == {2 * plan["source"]["universal_bytes"] // 3}
    assert CLI.main(["plan", str(ucp["C8"]), "--tensor-model-parallel-size", "3",
                     "--pipeline-model-parallel-size", "3", "--num-layers-per-virtual-pipeline-stage", "1"]) == 1
    out = CLI.readouterr().out
    assert "warning: vocabulary padding changes: the stored 1024 rows are not divisible by TP=3" in out
    assert "num_attention_heads=4 is not divisible by TP=3" in out and "not divisible by PP=3" in out


def test_plan_uneven_split(ucp, capsys):
    """Megatron-LM's split flags: the stages hold megatron-core's layers; a split it refuses is incompatible."""
    argv = ["plan", str(ucp["A8"]), "-t", "1", "-p", "2", "--decoder-first-pipeline-num-layers", "1", "--json"]
    assert CLI.main(argv) == 0
    plan = json.loads(CLI.readouterr().out)
    layers = [sorted({n.split(".")[2] for n in s["parameters"] if n.startswith("decoder.layers.")})
              for s in plan["stages"]]
    assert layers == [["0"], ["1", "2", "3"]] and plan["target"]["layout"]["first_stage_layers"] == 1
    assert "[first stage 1 layers]" in format_plan(plan)
    assert CLI.main(["plan", str(ucp["A8"]), "-t", "1", "-p", "2", "--decoder-first-pipeline-num-layers", "1",
                     "--account-for-loss-in-pipeline-split"]) == 1
    assert "cannot be combined" in CLI.readouterr().out


# --------------------------------------------------------------------------------------------------
# plot-loss


def test_plot_loss(tmp_path, capsys):
    logs = []
    for label, start in (("tp2pp2", 1), ("resumed_tp1", 5)):
        path = tmp_path / f"{label}.jsonl"
        path.write_text("".join(json.dumps({"iteration": i, "lm_loss": 7.0 - 0.1 * i}) + "\n"
                                for i in range(start, 9)))
        logs.append(str(path))
    png = tmp_path / "loss.png"
    assert CLI.main(["plot-loss", *logs, "-o", str(png), "--resume-at", "4", "--labels", "before", "after",
                     "--json"]) == 0
    result = json.loads(CLI.readouterr().out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["curves"]["after"] == {"first_iteration": 5, "last_iteration": 8, "final_loss": pytest.approx(6.2)}
    # output exists / wrong label count / not a log: one line each, exit 1
    assert CLI.main(["plot-loss", *logs, "-o", str(png)]) == 1
    assert "already exists" in CLI.readouterr().err
    assert CLI.main(["plot-loss", *logs, "-o", str(tmp_path / "x.png"), "--labels", "one"]) == 1
    assert "give one label per file" in CLI.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\n')
    assert CLI.main(["plot-loss", str(bad), "-o", str(tmp_path / "y.png")]) == 1
    assert "bad.jsonl:1: not a --log-jsonl record" in CLI.readouterr().err
