#!/usr/bin/env python
"""Time to the first training step of a resume from the run's own Megatron-LM checkpoint (see benchmarks/README.md).

Trains the GPT of bench_checkpointing.py (--preset) at TP2 PP2 DP2 for one iteration and saves it (torch_dist,
megatron-core's default dp_reshardable optimizer format), then measures, each as its own process tree, in rounds
that alternate the steps (`--repeat` rounds; the table shows medians), with the page cache dropped before each
step when allowed:

  mcore@SRC       Megatron-LM's own --load of that checkpoint at the layout it was saved at (TP2 PP2 DP2)
  direct@SRC      --load CKPT --universal-checkpoint at the same layout (rank 0 indexes it, every rank reads its
                  slices from its files: issue 35)
  direct@L        the same at another layout L (--layouts)
  offline@L       the two-step path: megatron-ucp to-universal CKPT UCP (CLI), then --load UCP
                  --universal-checkpoint at L; its time to the first step is the sum of the two

and the index itself: `source_index` of the checkpoint in one process (what rank 0 does), and in N processes at
once (N = the first layout's world size: what every rank building its own index would cost on one node).

For each: time from process start to the first training step's log line, the load phase (Megatron-LM's own
`load-checkpoint` timer around its load_checkpoint call, the slowest rank), peak PSS of the process tree, storage
bytes read (megatron_ucp.io.stats). Prints a table and writes JSON (--output).

    python benchmarks/bench_direct_load.py --preset 100m --repeat 3 --output bench_direct_100m.json
    python benchmarks/bench_direct_load.py --print bench_direct_100m.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_checkpointing import (LAYOUTS, MARKS, PRESETS, SOURCE, add_run_options, estimated_peak_bytes,  # noqa: E402
                                 model_flags, torchrun)

from megatron_ucp.io.stats import RunStats, dir_bytes, drop_page_cache, run_measured  # noqa: E402

MIB = 2 ** 20
INDEXED = re.compile(r"rank 0 indexed \d+ parameters in ([\d.]+) s")
WAITED = re.compile(r"the load waited ([\d.]+) s for it")
# Megatron-LM's own timer around its load_checkpoint call (min, max over ranks, ms): the load phase of every path
LOAD_TIMER = re.compile(r"load-checkpoint \.+: \(([\d.]+), ([\d.]+)\)")


def _median(values: List[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


class Bench:
    def __init__(self, args):
        self.args = args
        self.shape = PRESETS[args.preset]
        self.work = Path(args.workdir).absolute()
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
        self.runs: Dict[str, List[RunStats]] = {}
        self.index_log: Dict[str, List[float]] = {}
        self.index_wait: Dict[str, List[float]] = {}
        self.load_s: Dict[str, List[float]] = {}
        self.cold: Optional[bool] = None

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def measure(self, name: str, cmd: List[str], log_name: str) -> RunStats:
        if self.args.drop_caches == "auto":
            ok = drop_page_cache()
            self.cold = ok if self.cold is None else self.cold and ok
        else:
            self.cold = False
        log = self.work / "logs" / f"{log_name}.log"
        stats = run_measured(name, cmd, log_path=log, cwd=REPO, env=self.env, marks=MARKS,
                             timeout_s=self.args.timeout)
        self.runs.setdefault(name, []).append(stats)
        text = log.read_text()
        found = INDEXED.search(text)
        if found:
            self.index_log.setdefault(name, []).append(float(found.group(1)))
        waited = WAITED.search(text)
        if waited:
            self.index_wait.setdefault(name, []).append(float(waited.group(1)))
        timer = LOAD_TIMER.search(text)
        if timer:
            self.load_s.setdefault(name, []).append(float(timer.group(2)) / 1000)
        self.log(f"{name}: {stats.wall_s:.1f} s, first step at {stats.marks.get('first_step')} s, peak PSS "
                 f"{stats.peak_pss_bytes / MIB:.0f} MiB, read {stats.read_bytes / MIB:.1f} MiB")
        return stats

    def index_costs(self, src: Path, processes: int) -> dict:
        """source_index in one process, and in `processes` processes started together (seconds each)."""
        cmd = [sys.executable, str(Path(__file__).resolve()), "--index-only", str(src)]
        one = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=self.env).stdout)
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=self.env) for _ in range(processes)]
        many = [json.loads(p.communicate()[0]) for p in procs]
        return {"one_process_s": one["seconds"], "concurrent_processes": processes,
                "concurrent_max_s": max(m["seconds"] for m in many), "index_json_bytes": one["json_bytes"]}

    def run(self) -> dict:
        a = self.args
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        flags = model_flags(self.shape)
        src = self.work / "ckpt"
        self.log(f"preset {a.preset}: {self.shape.num_parameters / 1e6:.1f} M parameters; estimated peak "
                 f"{estimated_peak_bytes(self.shape, SOURCE) / 2 ** 30:.1f} GiB")
        # one step saved at iteration 1 of a 2-iteration schedule: each load below runs its second step (Megatron-LM's
        # own load asserts the schedule's length equal)
        train = [*flags, "--train-iters", "2"]
        subprocess.run(torchrun(SOURCE, [*train, "--save", str(src), "--save-interval", "1", "--exit-interval", "1"]),
                       check=True, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        load = [*train, "--load", str(src)]
        index = []
        for r in range(a.repeat):
            self.measure(f"mcore@{SOURCE}", torchrun(SOURCE, load), f"mcore_{SOURCE}_{r}")
            self.measure(f"direct@{SOURCE}", torchrun(SOURCE, [*load, "--universal-checkpoint"]),
                         f"direct_{SOURCE}_{r}")
            for layout in a.layouts:
                self.measure(f"direct@{layout}", torchrun(layout, [*load, "--universal-checkpoint"]),
                             f"direct_{layout}_{r}")
                ucp = self.work / "ucp"
                if ucp.exists():
                    shutil.rmtree(ucp)
                self.measure("to-universal", [sys.executable, "-m", "megatron_ucp.cli", "to-universal", str(src),
                                              str(ucp), "--quiet", "--json"], f"to_universal_{layout}_{r}")
                self.measure(f"ucp@{layout}", torchrun(layout, [*train, "--load", str(ucp), "--universal-checkpoint"]),
                             f"ucp_{layout}_{r}")
            world = LAYOUTS[a.layouts[0]][0] * LAYOUTS[a.layouts[0]][1] * LAYOUTS[a.layouts[0]][2]
            index.append(self.index_costs(src, world))
        report = self.report(index, dir_bytes(src))
        if not a.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        return report

    def report(self, index: List[dict], src_bytes: int) -> dict:
        a, rows = self.args, []

        def first(name: str) -> Optional[float]:
            return _median([s.marks.get("first_step") for s in self.runs[name]])

        def load_phase(name: str) -> Optional[float]:
            return _median(self.load_s.get(name, []))

        def row(label: str, name: str, seconds: Optional[float], ref: Optional[float], note: str = "") -> None:
            runs = self.runs[name]
            read = _median([s.read_bytes for s in runs])
            phase = load_phase(name)
            rows.append({"step": label, "seconds": seconds, "runs_s": [s.marks.get("first_step") for s in runs],
                         "ratio": None if not (seconds and ref) else round(seconds / ref, 2),
                         "load_phase_s": phase, "peak_pss_mib": round(_median([s.peak_pss_bytes for s in runs]) / MIB),
                         "read_mib": round(read / MIB, 1),
                         "load_s_per_gib_read": None if not (phase and read) else round(phase / (read / 2 ** 30), 2),
                         "index_s": _median(self.index_log.get(name, [])),
                         "index_wait_s": _median(self.index_wait.get(name, [])), "note": note})

        mcore = first(f"mcore@{SOURCE}")
        row(f"Megatron-LM's own --load @{SOURCE} (saved layout)", f"mcore@{SOURCE}", mcore, None)
        row(f"--universal-checkpoint, direct @{SOURCE}", f"direct@{SOURCE}", first(f"direct@{SOURCE}"), mcore)
        convert = _median([s.wall_s for s in self.runs["to-universal"]])
        for layout in a.layouts:
            row(f"--universal-checkpoint, direct @{layout}", f"direct@{layout}", first(f"direct@{layout}"), mcore)
            ucp_first = first(f"ucp@{layout}")
            row(f"to-universal + --universal-checkpoint @{layout}", f"ucp@{layout}",
                None if ucp_first is None else round(convert + ucp_first, 3), mcore,
                f"to-universal {convert} s (CLI) + load to first step {ucp_first} s")
        return {"preset": a.preset, "num_parameters": self.shape.num_parameters, "source_layout": SOURCE,
                "checkpoint_bytes": src_bytes, "page_cache_dropped": bool(self.cold), "repeat": a.repeat,
                "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
                "index": {"one_process_s": _median([i["one_process_s"] for i in index]),
                          "concurrent_processes": index[0]["concurrent_processes"],
                          "concurrent_max_s": _median([i["concurrent_max_s"] for i in index]),
                          "index_json_bytes": index[0]["index_json_bytes"]},
                "rows": rows, "runs": {k: [s.to_dict() for s in v] for k, v in self.runs.items()}}


def print_table(report: dict) -> None:
    print(f"\npreset {report['preset']}: {report['num_parameters'] / 1e6:.1f} M params, saved at "
          f"{report['source_layout']} ({report['checkpoint_bytes'] / MIB:.0f} MiB), medians of {report['repeat']}, "
          f"page cache {'dropped before each step' if report['page_cache_dropped'] else 'WARM'}")
    head = f"{'step':52s} {'1st step s':>10s} {'ratio':>7s} {'load s':>7s} {'s/GiB':>6s} {'PSS':>8s} {'read':>9s}"
    print(head + "\n" + "-" * len(head))
    for r in report["rows"]:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(f"{r['step']:52s} {r['seconds'] or 0:>10.2f} {ratio:>7s} {r['load_phase_s'] or 0:>7.2f} "
              f"{r['load_s_per_gib_read'] or 0:>6.2f} {r['peak_pss_mib']:>7d}M {r['read_mib']:>8.1f}M")
    for r in report["rows"]:
        print(f"  {r['step']}: runs {r['runs_s']}" + (f"; rank 0's index {r['index_s']} s" if r["index_s"] else "")
              + (f", the load waited {r['index_wait_s']} s for it" if r.get("index_wait_s") is not None else "")
              + (f"; {r['note']}" if r["note"] else ""))
    i = report["index"]
    print(f"index (source_index): {i['one_process_s']} s in one process, {i['concurrent_max_s']} s each in "
          f"{i['concurrent_processes']} processes at once; shared as {i['index_json_bytes'] / 1024:.0f} KiB of JSON")


def index_only(src: str) -> None:
    """One source_index of `src`, timed, as JSON on stdout (the concurrency measurement's worker)."""
    from megatron_ucp.convert import source_index

    start = time.perf_counter()
    index = source_index(src)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": round(seconds, 3), "json_bytes": len(json.dumps(index.document))}))


def main(argv=None) -> Optional[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    p.add_argument("--layouts", nargs="+", default=["TP1PP4DP2"], choices=sorted(LAYOUTS),
                   help="layouts other than the saved one to resume at")
    p.add_argument("--repeat", type=int, default=3, help="rounds of alternating steps (medians)")
    add_run_options(p, "/tmp/megatron_ucp_bench_direct")
    p.add_argument("--index-only", metavar="CKPT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.index_only:
        index_only(args.index_only)
        return None
    if args.print:
        report = json.loads(Path(args.print).read_text())
    else:
        report = Bench(args).run()
        if args.output:
            Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    return report


if __name__ == "__main__":
    main()
