"""Performance properties, stated as bounds (fast: small models, at most 2-process runs).

Loading (distributed optimizer): across all ranks of a target layout, the tensor bytes read from a
universal checkpoint are at most 1.1 x (universal size + replicated parameters' bytes x ranks), and no
rank reads more of a tensor than the rows covering its data-parallel range. Checked in one process by
emulating every rank of TP2 PP2 DP2 with megatron-core's buffer layout (formats/bucket_layout.py) and
the loader's readers, and end to end with a 2-process torchrun load (the loader reports the bytes all
ranks read).

Conversion: peak RSS growth of to-universal (one worker, measured as ru_maxrss of a child process) is at
most 1 GiB + 3 x the largest parameter's bytes (all states), and stays flat (within 20% or 16 MiB) when
the model doubles in depth.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain_runs import Layout, REPO, run_pretrain

from megatron_ucp.adapters.gpt import expected_parameters, parameters_for_rank, pattern_for
from megatron_ucp.convert import to_universal
from megatron_ucp.formats.bucket_layout import (
    BufferParam, DDPBucketConfig, build_chunk_buffers, shared_embedding_names)
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.megatron_lm.loader import read_local_flat_range
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.core.patterns import Replicated
from megatron_ucp.universal import UniversalCheckpoint, UniversalWriter

MIB = 2 ** 20
GIB = 2 ** 30
BYTES_SLACK = 1.1

# GPT-2-like: tied embeddings across PP (a shared_embedding bucket), biases, learned positions.
CONFIG = GPTModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
                        num_query_groups=4, kv_channels=8, vocab_size=250, padded_vocab_size=256,
                        make_vocab_size_divisible_by=128, max_position_embeddings=64, swiglu=False,
                        normalization="LayerNorm", position_embedding_type="learned_absolute",
                        untie_embeddings_and_output_weights=False, add_bias_linear=True)


def _fabricate(dst: Path) -> Path:
    with UniversalWriter(dst) as writer:
        for seed, (name, shape) in enumerate(expected_parameters(CONFIG)):
            g = torch.Generator().manual_seed(seed)
            tensors = {k: torch.randn(shape, generator=g) for k in ("fp32", "exp_avg")}
            tensors["exp_avg_sq"] = torch.rand(shape, generator=g)
            writer.write_parameter(name, tensors, {"model_dtype": torch.float32, "pattern": pattern_for(name, CONFIG),
                                                   "step": 3, "param_group": {"index": 0}})
        return writer.finish({
            "iteration": 3, "consumed_train_samples": 24, "model_config": CONFIG.to_dict(), "args": {},
            "source": {"format": "torch", "path": "/nowhere", "layout": ParallelLayout().to_dict(),
                       "optimizer_kind": "distributed"},
            "optimizer": {"type": "adam", "param_groups": [{"wd_mult": 1.0, "lr": 1e-3, "weight_decay": 0.1}]}, "scheduler": {}},
            expected_parameters(CONFIG))


def _dp_ranges(layout: ParallelLayout, pp_rank: int, dp_rank: int):
    """{local name: (canonical, local shape, [start, end) of the flat TP slice owned by dp_rank)} as
    megatron-core's DistributedOptimizer assigns them (equal DP shards of each padded bucket)."""
    rank_params = parameters_for_rank(CONFIG, layout, pp_rank)
    names = [local for local, _, _ in rank_params]
    shared = shared_embedding_names({}, layout, pp_rank=pp_rank, vpp_chunk=0, names=names)
    params = [BufferParam(local, shape, torch.float32, shared_embedding=local in shared)
              for local, shape, _ in rank_params]
    buffers = build_chunk_buffers(params, DDPBucketConfig(dp_size=layout.dp, use_distributed_optimizer=True))
    canonical = {local: (canon, shape) for local, shape, canon in rank_params}
    out = {}
    for buf in buffers:
        for span in buf.params:
            bucket = buf.buckets[span.bucket]
            shard = bucket.numel // layout.dp
            lo, hi = bucket.start + dp_rank * shard, bucket.start + (dp_rank + 1) * shard
            start, end = max(lo, span.start), min(hi, span.end)
            if start < end:
                out[span.name] = (*canonical[span.name], (start - span.start, end - span.start))
    return out


def test_emulated_dp_sharded_load_reads_each_byte_about_once(tmp_path, capsys):
    ucp_path = _fabricate(tmp_path / "ucp")
    ucp_size = UniversalCheckpoint.open(ucp_path).total_bytes()
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    ranks = layout.tp * layout.pp * layout.dp
    replicated = sum(math.prod(shape) * 4 * 3 for name, shape in expected_parameters(CONFIG)
                     if isinstance(pattern_for(name, CONFIG), Replicated))
    total = old_total = 0
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            for dp_rank in range(layout.dp):
                ucp = UniversalCheckpoint.open(ucp_path)
                for local, (name, shape, (start, end)) in _dp_ranges(layout, pp_rank, dp_rank).items():
                    row = 4 * (math.prod(shape[1:]) if len(shape) > 1 else 1)
                    for key in ("fp32", "exp_avg", "exp_avg_sq"):
                        before = ucp.bytes_read
                        values = read_local_flat_range(ucp, name, key, tp_rank, layout.tp, start, end)
                        got = ucp.bytes_read - before
                        assert values.numel() == end - start
                        # only the rows covering [start, end): at most one partial row at each end
                        assert got <= 4 * (end - start) + 2 * row, (local, key, got, start, end)
                    # what the loader did before: every DP rank read its whole TP slice of fp32
                    old_total += 4 * math.prod(shape) - 4 * (end - start)
                total += ucp.bytes_read
    old_total += total
    bound = BYTES_SLACK * (ucp_size + replicated * ranks)
    with capsys.disabled():
        print(f"\n[load bytes, TP2PP2DP2] universal {ucp_size} B, read {total} B ({total / ucp_size:.3f}x); bound "
              f"{bound:.0f} B; full-fp32-per-DP-rank reading would be {old_total} B ({old_total / ucp_size:.3f}x)")
    assert total <= bound


# --- end to end: checkpoints Megatron-LM 0.19 saves (2 processes) --------------------------------

def _flags(num_layers: int):
    return ("--num-layers {} --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --min-lr 1e-3 "
            "--lr-decay-style constant --seed 1234 --log-interval 1 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 1023 --attention-dropout 0.0 --hidden-dropout 0.0 --use-distributed-optimizer "
            "--eval-iters 0 --eval-interval 1000 --num-workers 0"
            ).format(num_layers).split()


@pytest.fixture(scope="module")
def megatron_checkpoints(tmp_path_factory):
    """torch_dist (dp_reshardable) checkpoints of a 4- and an 8-layer model, trained 1 step at TP2."""
    work = tmp_path_factory.mktemp("perf")
    out = {}
    for layers in (4, 8):
        run_pretrain(Layout(tp=2), [*_flags(layers), "--train-iters", "1", "--save", str(work / f"ckpt{layers}"),
                                    "--save-interval", "1"],
                     work, f"train{layers}")
        out[layers] = work / f"ckpt{layers}"
    return work, out


# Peak RSS is VmHWM, the high-water mark of this process's own memory map, reset to the current RSS
# just before converting. Not ru_maxrss: Linux folds the pre-exec memory map into it, i.e. the
# parent's RSS at (v)fork, so under pytest it reported the test runner's size, not the converter's.
CONVERT_CHILD = r"""
import json, sys
from megatron_ucp.convert import convert
from megatron_ucp.formats import open_checkpoint

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

open_checkpoint(sys.argv[1])  # imports and first-use allocations happen before the baseline
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
baseline = status("VmRSS")
assert status("VmHWM") <= baseline + 4 * 2 ** 20, "VmHWM was not reset"
convert(sys.argv[1], sys.argv[2], workers=1, progress=False)
print(json.dumps({"baseline": baseline, "peak": status("VmHWM")}))
"""


def _conversion_growth(src: Path, dst: Path) -> int:
    proc = subprocess.run([sys.executable, "-c", CONVERT_CHILD, str(src), str(dst)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["peak"] - result["baseline"]


@pytest.mark.torchrun
def test_conversion_memory_is_bounded_by_a_few_parameters(megatron_checkpoints, capsys):
    work, ckpts = megatron_checkpoints
    growth, largest = {}, {}
    for layers, src in ckpts.items():
        ucp = work / f"ucp_mem{layers}"
        growth[layers] = _conversion_growth(src, ucp)
        u = UniversalCheckpoint.open(ucp)
        largest[layers] = max(math.prod(p.shape) * 4 * len(p.tensors) for p in u.parameters.values())
        total = u.total_bytes()
        with capsys.disabled():
            print(f"\n[conversion memory] {layers} layers: universal {total / MIB:.1f} MiB, largest parameter "
                  f"{largest[layers] / MIB:.2f} MiB (all states), peak RSS growth {growth[layers] / MIB:.1f} MiB")
        assert growth[layers] <= GIB + 3 * largest[layers]
    assert largest[4] == largest[8]
    assert abs(growth[8] - growth[4]) <= max(0.2 * growth[4], 16 * MIB), growth


@pytest.mark.torchrun
def test_torchrun_load_reads_each_byte_about_once(megatron_checkpoints):
    """TP2 DP1 -> TP1 DP2 with the distributed optimizer: DP ranks split the reads, the param
    all-gather completes the weights."""
    work, ckpts = megatron_checkpoints
    ucp_path = to_universal(ckpts[4], work / "ucp_load", progress=False)
    ucp = UniversalCheckpoint.open(ucp_path)
    replicated = sum(math.prod(p.shape) * 4 * len(p.tensors) for p in ucp.parameters.values()
                     if isinstance(p.pattern, Replicated))
    target = Layout(dp=2)
    proc = run_pretrain(target, [*_flags(4), "--train-iters", str(ucp.iteration), "--load", str(ucp_path),
                                 "--universal-checkpoint"], work, "load_dp2")
    m = re.search(r"all ranks read (\d+) bytes of tensors", proc.stdout)
    assert m, proc.stdout[-2000:]
    total = int(m.group(1))
    assert total <= BYTES_SLACK * (ucp.total_bytes() + replicated * target.nproc), (total, ucp.total_bytes())
