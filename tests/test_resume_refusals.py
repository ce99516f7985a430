"""Resumes the checkpoint cannot make stop in one line, before any step: `error: <cause and fix>`, exit status 2,
no traceback, the checkpoint unchanged (real runs of the entry point, one process each).

- A universal checkpoint resumed with another learning-rate schedule (here another --train-iters): stopped at
  argument time, before the model is built, naming the difference and Megatron-LM's two flags (the plugin's
  check_schedule); with one of them the same run trains.
- A Megatron-LM checkpoint holding a CUDA generator's RNG state (from-universal's default --rng-state cuda)
  loaded by Megatron-LM's own --load on CPU: stopped in the load, naming --rng-state cpu and --no-load-rng
  (cpu_shims' CPU RNG check); with --no-load-rng the same run trains.

The checkpoint is Megatron-LM 0.16.1's fixture C (gpt2, trained 8 iterations, saved at 4) converted once per
session (RunCache.universal); MOCK_DATA_016 is its vocabulary.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pretrain_runs import FAMILIES, FIXTURE_CKPTS, MOCK_DATA_016, SAVED_AT, Layout, run_pretrain

pytestmark = pytest.mark.torchrun

FIXTURE_C = [*FAMILIES["gpt2"], *MOCK_DATA_016]  # fixture C's model and schedule; trained with --train-iters 8


def contents(folder: Path) -> dict:
    """Every file under `folder` with its size, mtime and digest: what 'unchanged' is checked against."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns,
                                               hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def the_one_error(log: str) -> str:
    """The run's `error:` line, after checking it is the only one and no traceback or step came before it."""
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, log[-3000:]
    assert "Traceback" not in log and "] iteration" not in log, log[-3000:]
    return errors[0]


def test_another_learning_rate_schedule_is_refused_at_argument_time(runs, tmp_path):
    """--train-iters 12 on a checkpoint trained for 8 (decay over 96 samples where it had 64): refused before the
    model is built; Megatron-LM's --use-checkpoint-opt-param-scheduler, as the error says, resumes it."""
    ucp = runs.universal(FIXTURE_CKPTS["C"], SAVED_AT)
    before = contents(ucp)
    flags = [*FIXTURE_C, "--train-iters", "12", "--load", str(ucp), "--universal-checkpoint"]
    proc = run_pretrain(Layout(), flags, tmp_path, "refused", expect_failure=True)
    assert proc.returncode == 2
    assert the_one_error(proc.stdout) == (
        f"error: {ucp}: this run's learning-rate schedule differs from the checkpoint's (total number of iterations: "
        "checkpoint 64, this run 96, in samples: iterations x --global-batch-size): give the schedule flags it was "
        "trained with, or pass --use-checkpoint-opt-param-scheduler (keep the checkpoint's schedule) or "
        "--override-opt-param-scheduler (this run's, from the checkpoint's step)")
    assert "building GPT model" not in proc.stdout  # argument time
    assert contents(ucp) == before
    resumed = run_pretrain(Layout(), [*flags, "--use-checkpoint-opt-param-scheduler", "--train-iters", "6"], tmp_path,
                           "kept")
    assert "] iteration        6/       6 |" in resumed.stdout


def test_a_cuda_rng_state_is_refused_on_cpu_in_the_load(runs, tmp_path):
    """from-universal with its default --rng-state cuda, loaded by Megatron-LM's own --load (no plugin flag) on
    CPU: one line naming both ways on, instead of torch's "Expected a CPUGeneratorImplState of size 5056";
    --no-load-rng, as the error says, resumes it."""
    from megatron_ucp.commands.from_universal import from_universal

    ckpt = tmp_path / "ckpt"
    from_universal(runs.universal(FIXTURE_CKPTS["C"], SAVED_AT), ckpt, ckpt_format="torch", progress=False)
    before = contents(ckpt)
    flags = [*FIXTURE_C, "--train-iters", "8", "--load", str(ckpt)]
    proc = run_pretrain(Layout(), flags, tmp_path, "refused", expect_failure=True)
    assert proc.returncode == 2
    assert the_one_error(proc.stdout) == (
        f"error: --load {ckpt}: its RNG state is a CUDA generator's (16 bytes; this CPU run's generator takes 5056): "
        "write the checkpoint for CPU with `megatron-ucp from-universal --rng-state cpu`, or resume with "
        "--no-load-rng")
    assert contents(ckpt) == before
    resumed = run_pretrain(Layout(), [*flags, "--no-load-rng"], tmp_path, "fresh_rng")
    assert "] iteration        8/       8 |" in resumed.stdout
