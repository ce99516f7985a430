"""Launching real multi-process pretrain_gpt.py runs from tests (torchrun, gloo, CPU), with timeouts.

Tiny model families, each in the shape of Megatron-LM's fixtures (4 layers, hidden 48, 4 heads,
seq 32, global batch 8, lr 1e-3 constant, dropout 0, --mock-data seed 1234, vocab 1000 (+EOD)):
- LLAMA: GQA with 2 query groups, SwiGLU, RMSNorm, RoPE, untied embeddings, no biases;
- GPT2: LayerNorm, learned absolute positions, GELU, tied embeddings, biases;
- LLAMA_MOE: LLAMA with MoE layers 1 and 3 (--moe-layer-freq [0,1,0,1]): 4 experts, top-2, expert
  ffn 32, one shared expert of 32, aux-loss coefficient 1e-2;
- GPT2_MOE: GPT2 with the same MoE layers, biased experts and router, no shared expert (megatron-core
  has no shared-expert bias).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "megatron-lm"  # copied unchanged from Megatron-LM runs (README there)
# Megatron-LM's own checkpoints (see the fixtures' README), by label
FIXTURE_CKPTS = {
    "A": FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt",  # legacy torch + distrib_optim.pt
    "B": FIXTURES / "B_llama_tp2pp2dp2_distopt_sp_torch_dist" / "ckpt",  # torch_dist, dp_reshardable
    "C": FIXTURES / "C_gpt2_tp2pp2dp1_adam_torch" / "ckpt",  # legacy torch, plain Adam, tied embeddings
}
PRETRAIN = REPO / "pretrain_scripts" / "pretrain_gpt.py"
TORCHRUN_TIMEOUT_S = int(os.environ.get("MEGATRON_UCP_TEST_TIMEOUT", "600"))

COMMON = ("--num-layers 4 --hidden-size 48 --num-attention-heads 4 --seq-length 32 "
          "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-3 "
          "--lr-decay-style constant --seed 1234 --log-interval 1 --mock-data --tokenizer-type NullTokenizer "
          "--vocab-size 1000 --attention-dropout 0.0 --hidden-dropout 0.0").split()
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq [0,1,0,1] "
       "--moe-aux-loss-coeff 1e-2").split()
FAMILIES: Dict[str, List[str]] = {
    "llama": COMMON + ("--group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm "
                       "--position-embedding-type rope --untie-embeddings-and-output-weights "
                       "--disable-bias-linear").split(),
    "gpt2": COMMON + "--normalization LayerNorm --position-embedding-type learned_absolute".split(),
}
FAMILIES["llama_moe"] = FAMILIES["llama"] + MOE + ["--moe-shared-expert-intermediate-size", "32"]
FAMILIES["gpt2_moe"] = FAMILIES["gpt2"] + MOE


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp_layers: Optional[int] = None  # --num-layers-per-virtual-pipeline-stage
    sp: bool = False
    ep: int = 1  # expert parallelism: carved out of the DP x TP ranks, adds no processes
    etp: Optional[int] = None  # expert tensor parallelism (None: = TP)

    @property
    def nproc(self) -> int:
        return self.tp * self.pp * self.dp

    def flags(self) -> List[str]:
        f = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        if self.vpp_layers:
            f += ["--num-layers-per-virtual-pipeline-stage", str(self.vpp_layers)]
        if self.sp:
            f.append("--sequence-parallel")
        if self.ep > 1:
            f += ["--expert-model-parallel-size", str(self.ep)]
        if self.etp is not None:
            f += ["--expert-tensor-parallel-size", str(self.etp)]
        return f

    def __str__(self) -> str:
        s = f"TP{self.tp}PP{self.pp}DP{self.dp}"
        if self.vpp_layers:
            s += f"VPP(l={self.vpp_layers})"
        s += "+SP" if self.sp else ""
        if self.ep > 1 or self.etp is not None:
            s += f"EP{self.ep}ETP{self.etp or self.tp}"
        return s


class RunFailed(AssertionError):
    pass


def run_pretrain(layout: Layout, args: Sequence[str], workdir: Path, name: str,
                 expect_failure: bool = False) -> subprocess.CompletedProcess:
    """torchrun pretrain_gpt.py at `layout`; the log goes to workdir/name.log."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(layout.nproc),
           str(PRETRAIN), *layout.flags(), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    log = workdir / f"{name}.log"
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        log.write_text((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
        raise RunFailed(f"{name} at {layout}: torchrun timed out after {TORCHRUN_TIMEOUT_S}s; log: {log}")
    log.write_text(proc.stdout)
    if expect_failure:
        if proc.returncode == 0:
            raise RunFailed(f"{name} at {layout} was expected to fail but succeeded; log: {log}")
    elif proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise RunFailed(f"{name} at {layout} failed (exit {proc.returncode}); log: {log}\n{tail}")
    return proc


def train(family: str, layout: Layout, workdir: Path, name: str, iters: int, extra: Sequence[str] = ()
          ) -> Dict[int, float]:
    """Run and return {iteration: lm loss} from the run's --log-jsonl."""
    jsonl = workdir / f"{name}.jsonl"
    if jsonl.exists():
        jsonl.unlink()
    run_pretrain(layout, [*FAMILIES[family], "--train-iters", str(iters), "--log-jsonl", str(jsonl), *extra],
                 workdir, name)
    return read_losses(jsonl)


def read_losses(jsonl: Path) -> Dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, jsonl.read_text().splitlines())}


def read_records(jsonl: Path) -> Dict[int, dict]:
    """Every --log-jsonl field by iteration (lm_loss, grad_norm, load_balancing_loss, ...)."""
    return {r["iteration"]: r for r in map(json.loads, jsonl.read_text().splitlines())}


def megatron_lm_losses(fixture: str) -> Dict[int, float]:
    """The 'true' lm loss column of the fixture's uninterrupted run, from LOSSES.txt."""
    text = (FIXTURES / "LOSSES.txt").read_text().splitlines()
    start = text.index(f"{fixture} / train.log")
    losses = {}
    for line in text[start + 2:]:
        parts = line.split()
        if len(parts) != 4 or not parts[0].isdigit():
            break
        losses[int(parts[0])] = float(parts[2])
    return losses


def max_rel_diff(a: Dict[int, float], b: Dict[int, float], iterations) -> float:
    return max(abs(a[i] - b[i]) / abs(b[i]) for i in iterations)
