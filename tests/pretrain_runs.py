"""Launching real multi-process runs of Megatron-LM's own training loop from tests (torchrun, gloo, CPU).

Every run is pretrain_scripts/pretrain_gpt.py: Megatron-LM 0.19's `megatron.training.pretrain` with the
project's providers and plugin (megatron_ucp/megatron_lm), megatron-core 0.19.2, and the losses of every
iteration at full precision from the plugin's --log-jsonl.

Tiny model families, each in the shape of Megatron-LM's fixtures (4 layers, hidden 48, 4 heads,
seq 32, global batch 8, lr 1e-3 constant, dropout 0, --mock-data seed 1234, vocab 1000 (EOD 999)):
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

import zygote

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "megatron-lm"  # copied unchanged from Megatron-LM runs (README there)
# Megatron-LM's own checkpoints (see the fixtures' README), by label
FIXTURE_CKPTS = {
    "A": FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt",  # legacy torch + distrib_optim.pt
    "B": FIXTURES / "B_llama_tp2pp2dp2_distopt_sp_torch_dist" / "ckpt",  # torch_dist, dp_reshardable
    "C": FIXTURES / "C_gpt2_tp2pp2dp1_adam_torch" / "ckpt",  # legacy torch, plain Adam, tied embeddings
}
# Megatron-LM runs of other releases (each folder's README): fixture folder names, used by several modules
F14 = REPO / "tests" / "fixtures" / "megatron-core-0.14"
A14 = "A14_llama_tp2pp1dp2_distopt_sp_torch_dist"  # torch_dist fully_sharded_model_space
B14 = "B14_llama_tp2pp1dp2_distopt_sp_torch"  # the same run, legacy torch + distrib_optim.pt
C14 = "C14_llama_tp2pp1dp2_distopt_sp_torch_dist_dpzero"  # the same run, torch_dist dp_zero_gather_scatter
M14 = "M14_moe4top2_tp2pp1dp2ep2etp1_distopt_sp_torch_dist"  # GPT-MoE, EP2 ETP1
F19 = REPO / "tests" / "fixtures" / "megatron-core-0.19"
A19 = "A19_llama_tp2pp2dp1_distopt_sp_torch_dist"  # dp_reshardable
B19 = "B19_llama_tp2pp2dp1_distopt_sp_torch_dist_fullyresh"  # the same run, fully_reshardable
C19 = "C19_llama_tp2pp2dp1_distopt_sp_torch"  # the same run, legacy torch
D19 = "D19_llama_tp2pp1dp2_distopt_sp_torch_dist"
E19 = "E19_moe4top2_tp1pp2dp2ep2_distopt_torch_dist"  # GPT-MoE, EP2 DP2 PP2
# Context-parallel runs of the entry point (tools/make_cp_fixtures.sh; folder README): tests/test_context_parallel.py
CPA19 = "CPA19_llama_tp1cp2dp2_distopt_torch_dist"  # dp_reshardable
CPB19 = "CPB19_llama_tp2cp2dp1_distopt_sp_torch"  # legacy torch + distrib_optim.pt
CPC19 = "CPC19_moe_tp1cp2dp2ep2_distopt_torch_dist"  # GPT-MoE, EP2 over CP x DP
CPD19 = "CPD19_moe_tp1cp2dp1ep2_distopt_torch_dist_fullyresh"  # GPT-MoE, EP2 over the CP ranks, fully_reshardable
# Multi-bucket runs of the entry point (tools/make_bucket_fixtures.sh; folder README): tests/test_bucket_shift*.py
J19 = "J19_llama_tp1dp2_buckets_distopt_torch_dist"  # 6 DDP buckets, dp_reshardable: the truth
K19 = "K19_llama_tp1dp2_buckets_distopt_torch_dist_fullyresh"  # the same run, fully_reshardable: saved shifted
# Optimizers other than Adam (tools/make_optim_fixtures.sh; folder README): SGD momentum 0.9, fp32, no distributed optimizer
SGA19 = "SGA19_llama_tp2pp2dp1_sgd_torch_dist"  # torch_dist: optimizer.state.momentum_buffer.<param>
SGB19 = "SGB19_llama_tp2pp2dp1_sgd_torch"  # the same run, legacy torch
PRETRAIN = REPO / "pretrain_scripts" / "pretrain_gpt.py"  # CPU flags: added by cpu_shims.with_cpu_flags
TORCHRUN_TIMEOUT_S = int(os.environ.get("MEGATRON_UCP_TEST_TIMEOUT", "600"))

COMMON = ("--num-layers 4 --hidden-size 48 --num-attention-heads 4 --seq-length 32 "
          "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-3 "
          "--lr-decay-style constant --seed 1234 --log-interval 1 --mock-data --tokenizer-type NullTokenizer "
          "--vocab-size 1000 --attention-dropout 0.0 --hidden-dropout 0.0 --eval-iters 0 --eval-interval 1000 --num-workers 0").split()
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
    ep: int = 1  # expert parallelism: carved out of the TP x CP x DP ranks, adds no processes
    etp: Optional[int] = None  # expert tensor parallelism (None: = TP)
    cp: int = 1  # context parallelism: each CP rank holds 2 of the sequence's 2*CP chunks

    @property
    def nproc(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def flags(self) -> List[str]:
        f = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        if self.vpp_layers:
            f += ["--num-layers-per-virtual-pipeline-stage", str(self.vpp_layers)]
        if self.sp:
            f.append("--sequence-parallel")
        if self.cp > 1:
            f += ["--context-parallel-size", str(self.cp)]
        if self.ep > 1:
            f += ["--expert-model-parallel-size", str(self.ep)]
        if self.etp is not None:
            f += ["--expert-tensor-parallel-size", str(self.etp)]
        return f

    def __str__(self) -> str:
        s = f"TP{self.tp}PP{self.pp}" + (f"CP{self.cp}" if self.cp > 1 else "") + f"DP{self.dp}"
        if self.vpp_layers:
            s += f"VPP(l={self.vpp_layers})"
        s += "+SP" if self.sp else ""
        if self.ep > 1 or self.etp is not None:
            s += f"EP{self.ep}ETP{self.etp or self.tp}"
        return s


# The layout flags of a fixture's cmd.txt (flag -> values it takes), dropped by entry_point_model_flags
LAYOUT_FLAGS = {"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--context-parallel-size": 1,
                "--expert-model-parallel-size": 1, "--expert-tensor-parallel-size": 1, "--sequence-parallel": 0}


def entry_point_model_flags(folder: Path) -> List[str]:
    """The flags of a fixture the entry point trained (its cmd.txt's last line) less its layout, --save and
    --log-jsonl: what every resume of it repeats (Layout gives the layout)."""
    import shlex

    argv = shlex.split((folder / "cmd.txt").read_text().splitlines()[-1])
    flags = argv[argv.index("pretrain_scripts/pretrain_gpt.py") + 1:]
    drop = {**LAYOUT_FLAGS, "--save": 1, "--log-jsonl": 1}
    out, i = [], 0
    while i < len(flags):
        if flags[i] in drop:
            i += 1 + drop[flags[i]]
            continue
        out.append(flags[i])
        i += 1
    return out


class RunFailed(AssertionError):
    pass


def run_pretrain(layout: Layout, args: Sequence[str], workdir: Path, name: str,
                 expect_failure: bool = False, env: Optional[Dict[str, str]] = None,
                 script: Path = PRETRAIN) -> subprocess.CompletedProcess:
    """torchrun pretrain_gpt.py (or another entry point `script`) at `layout`; the log goes to workdir/name.log.
    `env`: extra environment variables for the run (e.g. ATEN_CPU_CAPABILITY to choose another kernel path)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(layout.nproc),
           str(script), *layout.flags(), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           **(env or {})}
    log = workdir / f"{name}.log"
    rc = zygote.launch(script, layout.nproc, [*layout.flags(), *args], log, env, TORCHRUN_TIMEOUT_S)
    if rc is None:
        proc = _torchrun(cmd, env, log, name, layout)
    else:  # forked from the session's fork server (tests/zygote.py)
        proc = subprocess.CompletedProcess(cmd, rc, log.read_text())
        if rc == zygote.TIMEOUT_RC:
            raise RunFailed(f"{name} at {layout}: timed out after {TORCHRUN_TIMEOUT_S}s; log: {log}")
    if expect_failure:
        if proc.returncode == 0:
            raise RunFailed(f"{name} at {layout} was expected to fail but succeeded; log: {log}")
    elif proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise RunFailed(f"{name} at {layout} failed (exit {proc.returncode}); log: {log}\n{tail}")
    return proc


def _torchrun(cmd, env, log: Path, name: str, layout: Layout) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        log.write_text((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
        raise RunFailed(f"{name} at {layout}: torchrun timed out after {TORCHRUN_TIMEOUT_S}s; log: {log}")
    log.write_text(proc.stdout)
    return proc


def train(family: str, layout: Layout, workdir: Path, name: str, iters: int, extra: Sequence[str] = (),
          env: Optional[Dict[str, str]] = None) -> Dict[int, float]:
    """Run and return {iteration: lm loss} from the run's --log-jsonl."""
    jsonl = workdir / f"{name}.jsonl"
    if jsonl.exists():
        jsonl.unlink()
    run_pretrain(layout, [*FAMILIES[family], "--train-iters", str(iters), "--log-jsonl", str(jsonl), *extra],
                 workdir, name, env=env)
    return read_losses(jsonl)


def read_losses(jsonl: Path) -> Dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, jsonl.read_text().splitlines())}


def read_records(jsonl: Path) -> Dict[int, dict]:
    """Every --log-jsonl field by iteration (lm_loss, grad_norm, load_balancing_loss, ...)."""
    return {r["iteration"]: r for r in map(json.loads, jsonl.read_text().splitlines())}


# Relative lm-loss tolerance against Megatron-LM's logged runs (LOSSES.txt). Its log prints 7 significant
# digits: <= 7e-8 relative rounding, <= 1.1e-7 for the 'true' iteration-2 value derived from two printed ones.
# The fixtures were written on another machine, and another CPU's kernels round differently: re-running A
# and C with other kernel paths (ATEN_CPU_CAPABILITY=default / avx2, MKL_CBWR=COMPATIBLE, OMP_NUM_THREADS=2,
# and all three at once; measured with the retired 0.16.1 harness) moved the losses of iterations 1..8 by
# <= 5.2e-8 relative. Resuming at another layout adds layout noise (measured <= 4e-7). 1e-6 covers their sum twice.
FIXTURE_LOSS_TOL = 1e-6
# The tests/fixtures/megatron-lm runs (megatron-core 0.16.1) used vocabulary 1001 (EOD 1000) for
# `--vocab-size 1000`; 0.19 takes --vocab-size as the whole vocabulary. These flags (after FAMILIES) give
# 0.19 the fixtures' mock data: fixture C re-run at its layout reproduces LOSSES.txt within 7.2e-8.
MOCK_DATA_016 = ["--vocab-size", "1001", "--null-tokenizer-eod-id", "1000"]


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


# --------------------------------------------------------------------------------------------------
# Real training configurations, trained once per test session (conftest.py's `runs` fixture)

# Every loss-continuation source: warmup (2 iterations) + cosine decay to 1e-4, weight decay 0.1 on
# Megatron's decay group only (biases and norms are in its no-decay group), 12 iterations, saved at 4:
# a resume then runs 8 optimizer steps, and a wrong scheduler position or param-group mapping moves
# the loss (the LR differs at every step, the decay differs per group).
SCHEDULE = ["--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--lr", "1e-3", "--min-lr", "1e-4",
            "--weight-decay", "0.1"]
SOURCE_ITERS, SAVED_AT = 12, 4
RESUMED = range(SAVED_AT + 1, SOURCE_ITERS + 1)  # 8 optimizer steps after every resume
DISTOPT = ["--use-distributed-optimizer"]
OVERLAP = [*DISTOPT, "--overlap-grad-reduce", "--overlap-param-gather"]

# GPT-MoE continuation sources (tests/test_moe_universal.py; tests/test_moe_harness.py reuses them through
# `runs`): name -> (family, layout, model flags repeated on every resume, source-only flags). The router's
# expert_bias needs a sigmoid score function; the gate is the shared expert's.
MOE_EXPERT_BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                   "--moe-shared-expert-gate"]
MOE_SOURCES = {
    "ep2dp4": ("llama_moe", Layout(dp=4, ep=2), [], DISTOPT),  # expert-DP 2, torch_dist dp_reshardable
    "ep1": ("llama_moe", Layout(), [], DISTOPT),  # the experts in the dense optimizer
    "tp2etp1ep2": ("llama_moe", Layout(tp=2, sp=True, ep=2, etp=1), [], DISTOPT),  # EP over the TP ranks
    "adam_allmoe": ("gpt2_moe", Layout(dp=2, ep=2), ["--moe-layer-freq", "1"], []),  # plain Adam, every layer MoE
    "legacy_bias": ("llama_moe", Layout(dp=2, ep=2), MOE_EXPERT_BIAS, [*DISTOPT, "--ckpt-format", "torch"]),
    "ep2_fp16": ("llama_moe", Layout(dp=2, ep=2), ["--fp16"], DISTOPT),
}

# Tolerances on the relative lm-loss difference of a resume at another layout against the uninterrupted
# run (warmup + cosine, weight decay 0.1, 8 steps after the resume, llama and gpt2 families; see each test
# for its own figure). Measured through Megatron-LM 0.19's loop: fp32 <= 1.4e-7 (one or two float32 ulps),
# bf16 <= 1.9e-5 (before the move, fresh runs at other layouts: <= 2.9e-5); fp16 see FP16_TOL.
FP32_TOL = 1e-6
BF16_TOL = 1e-4


@dataclass(frozen=True)
class Trained:
    """One finished run: its folder, log, {iteration: lm loss}, every --log-jsonl field, its --save."""

    name: str
    work: Path
    losses: Dict[int, float]
    records: Dict[int, dict]
    save: Optional[Path]

    @property
    def log(self) -> Path:
        return self.work / f"{self.name}.log"


class RunCache:
    """Runs each distinct command once per test session: the key is the exact command line (family,
    layout, iterations, extra flags, whether it saves), so a source checkpoint trained for one test is
    resumed by every test that asks for the same command, and a resume two tests share runs once. The
    universal conversions of those checkpoints are cached the same way."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._runs: Dict[tuple, Trained] = {}
        self._ucp: Dict[tuple, Path] = {}

    def run(self, family: str, layout: Layout, iters: int, extra: Sequence[str] = (), *,
            save: bool = False) -> Trained:
        key = (family, tuple(layout.flags()), iters, tuple(map(str, extra)), save)
        if key not in self._runs:
            work = self.root / f"run{len(self._runs):03d}"
            name = "run"
            flags = [*extra, "--save", str(work / "ckpt")] if save else list(extra)
            train(family, layout, work, name, iters, flags)
            records = read_records(work / f"{name}.jsonl")
            self._runs[key] = Trained(name, work, {i: r["lm_loss"] for i, r in records.items()}, records,
                                      work / "ckpt" if save else None)
        return self._runs[key]

    def source(self, family: str, layout: Layout, extra: Sequence[str] = (), *, iters: int = SOURCE_ITERS
               ) -> Trained:
        """A continuation source: SCHEDULE, `iters` iterations, saved at SAVED_AT (and at the end)."""
        return self.run(family, layout, iters, [*SCHEDULE, *extra, "--save-interval", str(SAVED_AT)], save=True)

    def resume(self, family: str, layout: Layout, load: Path, extra: Sequence[str] = (), *,
               universal: bool = True, iters: int = SOURCE_ITERS) -> Trained:
        """Iterations SAVED_AT+1..`iters` from `load` (a universal checkpoint, or a Megatron one)."""
        return self.run(family, layout, iters,
                        [*SCHEDULE, *extra, "--load", str(load), *(["--universal-checkpoint"] if universal else [])])

    def universal(self, ckpt: Path, iteration: int = SAVED_AT, *, lazy: bool = False) -> Path:
        from megatron_ucp.convert import to_universal

        key = (str(ckpt), iteration, lazy)
        if key not in self._ucp:
            dst = self.root / f"ucp{len(self._ucp):03d}"
            self._ucp[key] = Path(to_universal(ckpt, dst, iteration=iteration, lazy=lazy, progress=False))
        return self._ucp[key]


def rel_diff(a: Dict[int, float], b: Dict[int, float], iterations=RESUMED) -> float:
    """max relative lm-loss difference over `iterations`, after checking both runs logged them all."""
    missing = [i for i in iterations if i not in a or i not in b]
    assert not missing, f"iterations {missing} missing from a run's log"
    return max_rel_diff(a, b, iterations)
