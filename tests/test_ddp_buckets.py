"""Many DDP buckets (--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size N) on CPU/gloo.

1. megatron_ucp/formats/bucket_layout.py, which converters use to find parameters in the distributed
   optimizer's flat buffers, predicts from args alone the exact layout megatron-core's DDP builds
   (every parameter's [start, end, bucket], every bucket's [start, end, numel_unpadded], buffer dtypes),
   read from the live buffers of the model Megatron-LM 0.19's get_model builds (tests/ddp_bucket_probe.py): several bucket sizes, PP stage 1 (one
   bucket, the tied embedding in its own), VPP chunk 1 (one bucket), bf16 params with fp32 grads,
   --ddp-num-buckets, DP=3 with --ddp-pad-buckets-for-high-nccl-busbw (lcm(3, 128, 2**16) bucket
   ends), no distributed optimizer (no padding). Negative control: a one-bucket prediction differs from the live
   multi-bucket layout.
2. End to end with many buckets (torch_dist dp_reshardable and legacy distrib_optim.pt written by megatron-core,
   converted, resumed at layouts with other bucket counts): tests/test_e2e_buckets_targets.py.
"""

import json

import pytest
import torch

from pretrain_runs import FAMILIES, REPO, TORCHRUN_TIMEOUT_S

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
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1"), stdout=subprocess.PIPE,
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
