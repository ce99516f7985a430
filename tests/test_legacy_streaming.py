"""The legacy writer (`from-universal --ckpt-format torch`) streams: its files are torch.save's bytes, written
record by record, and its memory does not grow with a rank's state.

Model: benchmarks/bench_scale.py's synthetic universal checkpoint (GQA, SwiGLU, untied, bf16 model dtype,
fp32 master weights and Adam moments) of 3.5 M parameters, so that one TP1 PP1 rank's model_optim_rng.pt is
~47 MiB and distrib_optim.pt ~40 MiB.

1. Bytes: every .pt file written at TP2 PP2 DP2 (distributed optimizer: model_optim_rng.pt and distrib_optim.pt)
   and TP2 PP1 (torch Adam, fp32 masters in fp32_from_fp16_params) equals torch.save of what torch.load reads
   from it, byte for byte but for the 40 digits of `.data/serialization_id` (and that record's CRC-32): torch
   hashes record names with C++'s std::hash, which torch_save does not reproduce; torch's reader only logs it.
2. Memory: in a fresh process, with tensor bands of 256 KiB, the peak of Python's traced allocations while
   writing TP1 PP1 stays under 3 MiB (a band, the 1 MiB checksum blocks it is read through, the pickle) while the
   largest file written is more than 10 times that. It cannot pass
   by accident: the same process first shows tracemalloc sees a 4 MiB numpy array (numpy reports its buffers
   to tracemalloc), and neither torch nor megatron-core is imported by the write (torch's allocator would hide
   from tracemalloc), so every buffer the writer could hold is counted. No timing is asserted.
Runtime: ~30-60 s (generation of the checkpoint dominates).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_torch_save import assert_same_bytes
from writer_cli import REPO, assert_ok, cli, env

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_scale  # noqa: E402

SHAPE = bench_scale.Shape(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=704, vocab_size=1000, padded_vocab_size=1024)
BAND = 256 * 2 ** 10
BOUND = 3 * 2 ** 20


@pytest.fixture(scope="module")
def universal(tmp_path_factory) -> Path:
    config = bench_scale.model_config(SHAPE)
    assert bench_scale.num_parameters(config) > 3_400_000
    return bench_scale.generate(config, tmp_path_factory.mktemp("stream") / "ucp", workers=2)


@pytest.mark.parametrize("layout", [["-t", "2", "-p", "2", "-d", "2", "--use-distributed-optimizer"],
                                    ["-t", "2", "-p", "1", "-d", "1"]], ids=["tp2pp2dp2-distopt", "tp2pp1-adam"])
def test_files_are_torch_saves_bytes(universal, tmp_path, layout):
    out = tmp_path / "megatron"
    assert_ok(cli("from-universal", universal, out, *layout, "--ckpt-format", "torch", "--rng-state", "cpu", "--quiet"))
    files = sorted(out.rglob("*.pt"))
    names = {f.name for f in files}
    assert names == ({"model_optim_rng.pt", "distrib_optim.pt"} if "--use-distributed-optimizer" in layout
                     else {"model_optim_rng.pt"})
    for path in files:
        state = torch.load(path, weights_only=False)
        again = tmp_path / "again" / path.relative_to(out)
        again.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, again)  # to a path of the same name: the same archive folder name
        assert_same_bytes(path.read_bytes(), again.read_bytes())
    if "--use-distributed-optimizer" not in layout:  # the tensors are there: a bf16 TP shard, an fp32 moment
        model = torch.load(out / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
        weight = model["model"]["decoder.layers.0.mlp.linear_fc2.weight"]
        assert weight.dtype == torch.bfloat16 and tuple(weight.shape) == (256, 352) and weight.abs().sum() > 0
        moments = model["optimizer"]["optimizer"]["state"][0]["exp_avg_sq"]
        assert moments.dtype == torch.float32 and (moments > 0).all()


_MEASURE = """
import json, sys, tracemalloc
from pathlib import Path
import numpy as np
from megatron_ucp.commands import from_universal as fu
from megatron_ucp.formats import universal_pieces
from megatron_ucp.formats.legacy import writer as legacy
universal_pieces.BAND_BYTES = legacy.BAND_BYTES = int(sys.argv[3])
tracemalloc.start()
seen = np.ones(4 << 20, dtype=np.uint8)
del seen
calibration = tracemalloc.get_traced_memory()[1]
tracemalloc.reset_peak()
fu.from_universal(Path(sys.argv[1]), Path(sys.argv[2]), use_distributed_optimizer=sys.argv[4] == "1",
                  ckpt_format="torch", rng_state="cpu", progress=False)
print(json.dumps({"calibration": calibration, "peak": tracemalloc.get_traced_memory()[1],
                  "torch": "torch" in sys.modules, "megatron": "megatron" in sys.modules}))
"""


@pytest.mark.parametrize("distopt", [True, False], ids=["distopt", "adam"])
def test_memory_is_a_band_not_a_rank(universal, tmp_path, distopt):
    out = tmp_path / "megatron"
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(universal), str(out), str(BAND), str(int(distopt))],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    assert measured["calibration"] >= 4 << 20, measured  # tracemalloc counts numpy's buffers
    assert not measured["torch"] and not measured["megatron"], measured
    largest = max(p.stat().st_size for p in out.rglob("*.pt"))
    assert largest > 10 * BOUND, (largest, BOUND)  # one rank's state is many times the bound
    assert measured["peak"] < BOUND, (measured, largest)
    # and it is the checkpoint: the bytes torch.save writes for what torch.load reads from it
    path = max(out.rglob("*.pt"), key=lambda p: p.stat().st_size)
    again = tmp_path / path.name
    torch.save(torch.load(path, weights_only=False), again)
    assert_same_bytes(path.read_bytes(), again.read_bytes())
