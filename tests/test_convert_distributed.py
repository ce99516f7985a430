"""to-universal across the processes of a torchrun job: the same universal checkpoint as one process,
and a failure on any rank leaves nothing behind."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pretrain_runs import FIXTURES, REPO, TORCHRUN_TIMEOUT_S

from megatron_ucp.convert import to_universal

pytestmark = pytest.mark.torchrun


def torchrun_convert(src, dst, nproc=2, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "megatron_ucp.cli", "to-universal", str(src), str(dst), "--quiet", *extra]
    return subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=TORCHRUN_TIMEOUT_S)


@pytest.mark.parametrize("fixture", ["A_llama_tp2pp2dp2_distopt_sp_torch", "B_llama_tp2pp2dp2_distopt_sp_torch_dist",
                                     "C_gpt2_tp2pp2dp1_adam_torch"])
def test_two_ranks_write_what_one_process_writes(fixture, tmp_path):
    src = FIXTURES / fixture / "ckpt"
    proc = torchrun_convert(src, tmp_path / "dist", 2, "--iteration", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = to_universal(src, tmp_path / "single", iteration=4, progress=False)
    a = json.loads((tmp_path / "dist" / "metadata.json").read_text())
    b = json.loads((Path(single) / "metadata.json").read_text())
    assert a["parameters"] == b["parameters"]
    for name, info in a["parameters"].items():
        with safe_open(tmp_path / "dist" / info["file"], "pt") as x, safe_open(Path(single) / info["file"], "pt") as y:
            assert set(x.keys()) == set(y.keys())
            for key in x.keys():
                assert torch.equal(x.get_tensor(key), y.get_tensor(key)), (name, key)


def test_failure_on_one_rank_leaves_nothing(tmp_path):
    broken = tmp_path / "src"
    shutil.copytree(FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt", broken)
    victim = broken / "iter_0000004" / "mp_rank_01_001" / "distrib_optim.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    proc = torchrun_convert(broken, tmp_path / "out", 2, "--iteration", "4")
    assert proc.returncode != 0
    assert "distrib_optim.pt" in proc.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.partial-*"))
