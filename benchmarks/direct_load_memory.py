#!/usr/bin/env python
"""Where a resume's memory goes, per rank and per phase (benchmarks/README.md, "The direct resume's memory").

Run by torchrun in place of pretrain_scripts/pretrain_gpt.py, with the same flags: it wraps the phases of a load
(Megatron-LM's own `load_checkpoint`, or the direct resume's index, its broadcast and per-rank validation, the
tensor reads, the scheduler and run state) and the first training steps, and prints for each, per rank, the
process's resident memory before and after it and its peak during it (Linux: /proc/self/status VmRSS and VmHWM;
the peak is reset before each phase through /proc/self/clear_refs, so a phase's peak is its own):

    torchrun --nproc-per-node 8 benchmarks/direct_load_memory.py <the run's flags> --load CKPT [--universal-checkpoint]

or, to train bench_checkpointing.py's model at TP2 PP2 DP2 for one iteration and compare Megatron-LM's own load
with the direct resume at that layout (a table of per-rank medians per phase):

    python benchmarks/direct_load_memory.py --drive --preset 100m [--workdir DIR] [--output FILE.json]

Lines start with "memprobe" and are JSON: {"rank", "phase", "before", "after", "peak"} in MiB. Nested phases
report their own peaks; an enclosing phase's peak is the largest of its own and its children's.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 2 ** 20
_STACK: list = []  # running peaks of the enclosing phases (a child's reset of VmHWM would hide theirs)


def _status() -> tuple:
    """(VmRSS, VmHWM) of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kib, _ = line.split()
                values[key[:-1]] = int(kib) * 1024
    return values["VmRSS"], values["VmHWM"]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _report(phase: str, before: int, after: int, peak: int) -> None:
    print("memprobe " + json.dumps({"rank": _rank(), "phase": phase, "before": round(before / MIB, 1),
                                     "after": round(after / MIB, 1), "peak": round(peak / MIB, 1)}), flush=True)


def measured(phase: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rss, hwm = _status()
        if _STACK:  # what the enclosing phase reached so far
            _STACK[-1] = max(_STACK[-1], hwm)
        _reset_peak()
        _STACK.append(rss)
        try:
            return fn(*args, **kwargs)
        finally:
            after, hwm = _status()
            peak = max(_STACK.pop(), hwm)
            if _STACK:
                _STACK[-1] = max(_STACK[-1], peak)
            _report(phase, rss, after, peak)
            if os.environ.get("MEMPROBE_TRIM") == "1":  # what of `after` is freed memory glibc still holds
                import ctypes
                import gc
                gc.collect()
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                trimmed, _ = _status()
                _report(phase + " [gc + malloc_trim]", after, trimmed, trimmed)
            _reset_peak()
    return wrapper


def install() -> None:
    """Wrap the phases (before pretrain_gpt's main installs the plugin, which wraps Megatron-LM's load_checkpoint
    in turn: the wrapped one is then what it calls for Megatron-LM's own load)."""
    from megatron_ucp.megatron_lm import cpu_shims
    cpu_shims.install_import_patches()  # as pretrain_gpt.py does, before megatron is imported
    from megatron.training import checkpointing, training

    from megatron_ucp import convert, universal
    from megatron_ucp.megatron_lm import loader

    checkpointing.load_checkpoint = measured("megatron load_checkpoint", checkpointing.load_checkpoint)
    training.load_checkpoint = checkpointing.load_checkpoint
    for name, phase in (("open_for_load", "ucp open_for_load (index, broadcast, validation)"),
                        ("load_universal_checkpoint", "ucp load_universal_checkpoint"),
                        ("_load_tensors", "ucp tensors read into model and optimizer"),
                        ("restore_run_state", "ucp run state")):
        setattr(loader, name, measured(phase, getattr(loader, name)))
    convert.source_index = measured("ucp source_index (rank 0)", convert.source_index)
    cls = universal.UniversalCheckpoint
    cls.from_source_index = classmethod(measured("ucp from_source_index", cls.from_source_index.__func__))
    steps = {"n": 0}
    step = training.train_step

    @functools.wraps(step)
    def train_step(*args, **kwargs):
        steps["n"] += 1
        if steps["n"] <= 2:
            return measured(f"train_step {steps['n']}", step)(*args, **kwargs)
        return step(*args, **kwargs)

    training.train_step = train_step
    rss, _ = _status()
    _report("start (imports)", rss, rss, rss)


def drive(argv) -> None:
    """Train the source once, load it both ways under this probe, print per-phase medians over ranks."""
    import argparse
    import shutil
    import statistics
    import subprocess
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_checkpointing import PRESETS, SOURCE, model_flags, torchrun

    p = argparse.ArgumentParser()
    p.add_argument("--drive", action="store_true")
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    p.add_argument("--workdir", default="/tmp/megatron_ucp_direct_memory")
    p.add_argument("--output")
    a = p.parse_args(argv)
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    train = [*model_flags(PRESETS[a.preset]), "--train-iters", "2"]
    src = work / "ckpt"
    subprocess.run(torchrun(SOURCE, [*train, "--save", str(src), "--save-interval", "1", "--exit-interval", "1"]),
                   check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    report = {}
    for name, extra in (("megatron", []), ("direct", ["--universal-checkpoint"])):
        cmd = torchrun(SOURCE, [*train, "--load", str(src), *extra])
        cmd[cmd.index(next(c for c in cmd if c.endswith("pretrain_gpt.py")))] = str(Path(__file__).resolve())
        out = subprocess.run(cmd, check=True, cwd=REPO, env=env, capture_output=True, text=True).stdout
        rows = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("memprobe ")]
        phases = {}
        for row in rows:
            phases.setdefault(row["phase"], []).append(row)
        report[name] = {ph: {k: statistics.median(r[k] for r in rs) for k in ("before", "after", "peak")}
                        | {"ranks": len(rs)} for ph, rs in phases.items()}
        print(f"\n{name} (per-rank medians, MiB)")
        for ph, v in report[name].items():
            print(f"  {ph:55s} before {v['before']:8.1f}  after {v['after']:8.1f}  (+{v['after'] - v['before']:7.1f})"
                  f"  peak {v['peak']:8.1f}  ranks {v['ranks']}")
    if a.output:
        Path(a.output).write_text(json.dumps(report, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__" and "--drive" in sys.argv:
    drive(sys.argv[1:])
elif __name__ == "__main__":
    install()
    sys.argv[0] = str(REPO / "pretrain_scripts" / "pretrain_gpt.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
