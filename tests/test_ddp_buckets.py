"""Many DDP buckets (--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size N) on CPU/gloo.

1. megatron_ucp/formats/bucket_layout.py, which converters use to find parameters in the distributed
   optimizer's flat buffers, predicts from args alone the exact layout megatron-core's DDP builds
   (every parameter's [start, end, bucket], every bucket's [start, end, numel_unpadded], buffer dtypes),
   read from the live buffers by tests/ddp_bucket_probe.py: several bucket sizes, PP stage 1 (one
   bucket, the tied embedding in its own), VPP chunk 1 (one bucket), bf16 params with fp32 grads,
   --ddp-num-buckets, DP=3 with --ddp-pad-buckets-for-high-nccl-busbw (lcm(3, 128, 2**16) bucket
   ends), no distributed optimizer (no padding). Negative control: a one-bucket prediction differs from the live
   multi-bucket layout.
2. Llama-like TP2 DP2 + SP with 9 buckets per rank saves torch_dist (dp_reshardable: one flat tensor
   per bucket) and legacy (distrib_optim.pt, buckets coalesced); both convert to universal checkpoints
   bitwise equal to the one-bucket run's (same losses to the last bit: per-element sums do not depend
   on bucketing); the torch_dist one resumes reproducing the uninterrupted losses (1e-6 relative).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pretrain_runs import FAMILIES, REPO, TORCHRUN_TIMEOUT_S, Layout, max_rel_diff, train

from megatron_ucp.convert import to_universal
from megatron_ucp.formats.bucket_layout import BufferParam, DDPBucketConfig, build_buffer_layout

pytestmark = pytest.mark.torchrun

OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]

# name -> (family, nproc, flags, minimum buckets in the first chunk of PP rank 0)
PROBES = {
    "tp2dp2-sp-4000": ("llama", 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", *OVERLAP,
                                     "--ddp-bucket-size", "4000"], 5),
    "pp2-vpp-tied-bf16-fp32grads-numbuckets": (
        "gpt2", 4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                    "--bf16", "--accumulate-allreduce-grads-in-fp32", *OVERLAP, "--ddp-num-buckets", "6"], 3),
    "dp3-bf16-fp32grads-pad-busbw-2500": (
        "gpt2", 3, ["--bf16", "--accumulate-allreduce-grads-in-fp32", *OVERLAP, "--ddp-bucket-size", "2500",
                    "--ddp-pad-buckets-for-high-nccl-busbw", "--global-batch-size", "12"], 5),
    "dp2-no-distopt-3000": ("llama", 2, ["--overlap-grad-reduce", "--ddp-bucket-size", "3000"], 5),
}


def probe(name, tmp_path) -> list:
    import os
    import subprocess
    import sys

    family, nproc, flags, _ = PROBES[name]
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(REPO / "tests" / "ddp_bucket_probe.py"), str(out), *FAMILIES[family], "--train-iters", "4", *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TORCHRUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("name", list(PROBES))
def test_bucket_layout_predicts_megatron_core_buffers(name, tmp_path):
    reports = probe(name, tmp_path)
    min_buckets = PROBES[name][3]
    for rank, report in enumerate(reports):
        for chunk, layouts in enumerate(report["chunks"]):
            where = f"{name} rank {rank} (pp {report['pp_rank']}, chunk {chunk})"
            assert layouts["live"] == layouts["predicted"], where
            if report["pp_rank"] == 0 and chunk == 0:
                assert len(layouts["live"][0]["buckets"]) >= min_buckets, where
            else:  # megatron-core buckets only the first chunk of the first stage
                buckets = len(layouts["live"][0]["buckets"])
                assert buckets <= 2, where  # 2: the tied embedding's own bucket

    # Negative control: ignoring the bucket size (one bucket) mispredicts the live layout.
    live = reports[0]["chunks"][0]["live"][0]
    shapes = {n: e - s for n, s, e, _ in live["params"]}
    order = [n for n, *_ in sorted(live["params"], key=lambda r: -r[1])]  # registration order
    one_bucket = build_buffer_layout([BufferParam(n, (shapes[n],), torch.float32) for n in order],
                                     DDPBucketConfig(dp_size=2, use_distributed_optimizer=True))
    assert [[s.name, s.start, s.end, s.bucket] for s in one_bucket.params] != live["params"]


@pytest.fixture(scope="module")
def bucketed_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("buckets")
    layout = Layout(tp=2, dp=2, sp=True)
    bucketed = [*OVERLAP, "--ddp-bucket-size", "4000"]
    runs = {
        "torch_dist": train("llama", layout, work, "torch_dist", 6,
                            [*bucketed, "--save", str(work / "torch_dist"), "--save-interval", "4"]),
        "legacy": train("llama", layout, work, "legacy", 6,
                        [*bucketed, "--save", str(work / "legacy"), "--save-interval", "4", "--exit-interval", "4",
                         "--ckpt-format", "torch"]),
        "one_bucket": train("llama", layout, work, "one_bucket", 6,
                            ["--use-distributed-optimizer", "--save", str(work / "one_bucket"), "--save-interval", "4",
                             "--exit-interval", "4"]),
    }
    return work, layout, bucketed, runs


def test_multi_bucket_checkpoints_convert_like_one_bucket(bucketed_runs):
    work, _, _, runs = bucketed_runs
    assert runs["torch_dist"][4] == runs["legacy"][4] == runs["one_bucket"][4]
    ucp = {name: Path(to_universal(work / name, work / f"{name}_ucp", iteration=4, progress=False))
           for name in ("one_bucket", "torch_dist", "legacy")}
    reference = json.loads((ucp["one_bucket"] / "metadata.json").read_text())["parameters"]
    for name in ("torch_dist", "legacy"):
        params = json.loads((ucp[name] / "metadata.json").read_text())["parameters"]
        assert params.keys() == reference.keys()
        for param, info in reference.items():
            with safe_open(ucp["one_bucket"] / info["file"], "pt") as a, \
                    safe_open(ucp[name] / params[param]["file"], "pt") as b:
                assert set(a.keys()) == set(b.keys()) == {"fp32", "exp_avg", "exp_avg_sq"}, param
                for key in a.keys():
                    assert torch.equal(a.get_tensor(key), b.get_tensor(key)), f"{name}: {param}/{key}"


def test_multi_bucket_resume_is_exact(bucketed_runs):
    """From the 9-bucket dp_reshardable checkpoint (one flat tensor per bucket in the .distcp files)."""
    work, layout, bucketed, runs = bucketed_runs
    source = "torch_dist"
    resumed = train("llama", layout, work, f"resume_{source}", 6,
                    [*bucketed, "--load", str(work / source), "--ckpt-step", "4"])
    assert sorted(resumed) == [5, 6]
    assert max_rel_diff(resumed, runs["torch_dist"], range(5, 7)) < 1e-6, (resumed, runs["torch_dist"])
