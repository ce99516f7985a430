"""benchmarks/bench_scale.py in small: a synthetic universal checkpoint (GQA, SwiGLU, untied, vocabulary
1000 padded to 1024; and an 8-expert MoE) written by its streaming generator, converted by the CLI to
torch_dist at TP2 PP2 DP2 (dp_reshardable and fully_reshardable) and back with to-universal. The round
trip is exact: every tensor of every parameter (weights, exp_avg, exp_avg_sq) equal at atol 0, and the
tensor files byte for byte the generated ones (equal block checksums). Negative control: one byte changed
in the written torch_dist checkpoint is caught by `verify`. No timing is asserted."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from writer_cli import REPO, assert_ok, cli

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_scale  # noqa: E402

LAYOUT = ["-t", "2", "-p", "2", "-d", "2", "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict:
    """{"dense": ucp, "moe": ucp}: the tiny config, and it with 8 routed experts per layer."""
    out = {}
    for kind in ("dense", "moe"):
        config = bench_scale.model_config(bench_scale.CONFIGS["tiny"], moe=kind == "moe")
        assert config.num_query_groups < config.num_attention_heads and config.swiglu
        assert config.padded_vocab_size > config.vocab_size and config.untie_embeddings_and_output_weights
        out[kind] = bench_scale.generate(config, tmp_path_factory.mktemp("scale") / kind, workers=2)
    return out


def _tensors(ucp: Path) -> dict:
    meta = json.loads((ucp / "metadata.json").read_text())["parameters"]
    out = {}
    for name, info in meta.items():
        with safe_open(ucp / info["file"], "pt") as f:
            out[name] = {key: f.get_tensor(key) for key in f.keys()}
    return out


@pytest.mark.parametrize("kind, optimizer_format", [("dense", "dp_reshardable"), ("dense", "fully_reshardable"),
                                                     ("moe", "dp_reshardable")])
def test_round_trip_at_tp2_pp2_dp2_is_exact(generated, kind, optimizer_format, tmp_path):
    generated = generated[kind]
    assert_ok(cli("check", generated, "--quiet"))
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    assert_ok(cli("from-universal", generated, megatron, *LAYOUT, "--ckpt-format", "torch_dist",
                  "--optimizer-format", optimizer_format, "--rng-state", "cpu", "--quiet"))
    assert len(list(megatron.rglob("*.distcp"))) >= 8  # one file per rank of the 8
    assert_ok(cli("to-universal", megatron, back, "--quiet"))
    a, b = _tensors(generated), _tensors(back)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys() == {"fp32", "exp_avg", "exp_avg_sq"}, name
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)  # atol 0
    # the same bytes: every tensor file's block checksums (and shape, pattern, step, group) equal
    assert bench_scale.parameter_entries(back) == bench_scale.parameter_entries(generated)


def test_a_changed_byte_in_the_written_checkpoint_is_caught(generated, tmp_path):
    generated, megatron = generated["dense"], tmp_path / "megatron"
    assert_ok(cli("from-universal", generated, megatron, *LAYOUT, "--ckpt-format", "torch_dist",
                  "--rng-state", "cpu", "--quiet"))
    assert_ok(cli("verify", megatron, generated, "--quiet"))
    victim = max(megatron.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40  # the middle of the largest file: tensor bytes
    victim.write_bytes(bytes(data))
    proc = cli("verify", megatron, generated, "--quiet", "--json")
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and not result["equal"], result  # a value that differs, not a file that fails to parse


def test_open_files_stay_bounded_by_threads_not_tensor_files(generated, tmp_path):
    """from-universal of the tiny MoE (87 tensor files) with 2 writer threads under a 120-descriptor limit:
    each thread keeps at most byteio.FileHandles.max_open source files open (unbounded, it held every tensor
    file it had read and failed (EMFILE) under 150)."""
    import resource
    import subprocess

    from writer_cli import command, env

    ucp = generated["moe"]
    assert len(list((ucp / "tensors").iterdir())) > 80

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (120, 120))

    proc = subprocess.run(command("from-universal", ucp, tmp_path / "megatron", *LAYOUT, "--ckpt-format",
                                  "torch_dist", "--rng-state", "cpu", "--quiet", "--workers", "2"),
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert_ok(proc)


def test_conversions_in_one_process_leave_no_descriptor_open(generated, tmp_path):
    """Three from-universal calls in one process (what a test suite or a notebook does; 2 writer threads, the
    tiny MoE's 87 tensor files) leave as many descriptors open as before them. Each writer thread's source
    files are a thread-local FileHandles of the universal checkpoint; without closing them when the thread
    (or the checkpoint) goes, each call left 2 x 16 open (measured: 38, 70, 102 after calls 1-3)."""
    import gc
    import os

    from megatron_ucp.commands import from_universal as fu

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    fu.from_universal(generated["moe"], tmp_path / "warm", ckpt_format="torch_dist", progress=False,
                      tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2,
                      use_distributed_optimizer=True, workers=2)  # imports, caches
    gc.collect()
    before = open_fds()
    for i in range(3):
        fu.from_universal(generated["moe"], tmp_path / f"out{i}", ckpt_format="torch_dist", progress=False,
                          tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2,
                          use_distributed_optimizer=True, workers=2)
    gc.collect()
    assert open_fds() == before


def test_repeated_runs_report_the_ratio_of_medians(tmp_path):
    """--repeat N: the runs of one command (each with its adjacent cp -r) summarised as their medians, the
    ratio that of the medians (not the median of the ratios: 12/9 here, where the ratios' median is 1.25),
    the peak memory the largest of the runs."""
    import argparse

    bench = bench_scale.Bench(argparse.Namespace(workdir=str(tmp_path)))
    runs = [{"step": "x", "seconds": s, "cp_seconds": c, "peak_rss_mib": m, "peak_pss_mib": m, "processes": 1,
             "read_mib": 10, "written_mib": 20, "cpu_seconds": 3.0, "returncode": 0}
            for s, c, m in ((10, 8, 100), (12, 9, 150), (15, 12, 120))]
    bench.median_row("x, median of 3", runs)
    row = bench.rows[-1]
    assert (row["seconds"], row["cp_seconds"], row["ratio"]) == (12, 9, round(12 / 9, 2))
    assert row["runs"] == [10, 12, 15] and row["cp_runs"] == [8, 9, 12] and row["peak_rss_mib"] == 150
