#!/usr/bin/env python
"""Two checkouts of megatron-ucp, one command, alternating: did a change make it slower or bigger?

Runs `python -m megatron_ucp.cli ARGS...` with checkout A first on PYTHONPATH, then checkout B, N times each,
alternating (A B A B ...) so that a disk or a neighbour slowing down mid-run hits both alike; `--clean DIR` (the
command's output) is removed before each run and at the end. Reports per checkout the
median and the fastest wall time and peak RSS of the process tree (megatron_ucp.io.stats), and B / A.

    python benchmarks/bench_ab.py --a /tmp/before --b . --repeat 9 --clean OUT -- to-universal --quiet CKPT OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_ucp.io.stats import drop_page_cache, run_measured  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="checkout A (e.g. a git worktree of the commit before)")
    p.add_argument("--b", required=True, help="checkout B")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--drop-caches", choices=["auto", "off"], default="auto")
    p.add_argument("--output", help="write the JSON report here")
    p.add_argument("--clean", help="the command's output directory, removed before each run")
    p.add_argument("--log-dir", default="/tmp/megatron_ucp_bench_ab", help="each run's output")
    p.add_argument("cli", nargs=argparse.REMAINDER, help="-- then the megatron-ucp arguments")
    args = p.parse_args(argv)
    cli = args.cli[1:] if args.cli[:1] == ["--"] else args.cli
    if not cli:
        p.error("give the megatron-ucp arguments after --")
    out = Path(args.clean) if args.clean else None
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    runs: dict = {"A": [], "B": []}
    for i in range(args.repeat):
        for label, checkout in (("A", args.a), ("B", args.b)):
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=False)
            if args.drop_caches == "auto":
                drop_page_cache()
            env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
            stats = run_measured(f"{label}{i}", [sys.executable, "-m", "megatron_ucp.cli", *cli], env=env,
                                 log_path=Path(args.log_dir) / f"{label}{i}.log")
            runs[label].append(stats)
            print(f"{label} run {i}: {stats.wall_s:.2f} s, peak RSS {stats.peak_rss_bytes / 2**20:.0f} MiB", flush=True)
    if out is not None:
        shutil.rmtree(out, ignore_errors=True)
    report = {"command": cli, "a": str(args.a), "b": str(args.b), "repeat": args.repeat}
    for label in ("A", "B"):
        walls = [s.wall_s for s in runs[label]]
        rss = [s.peak_rss_bytes for s in runs[label]]
        report[label] = {"median_s": statistics.median(walls), "min_s": min(walls), "walls_s": walls,
                         "median_peak_rss_mib": statistics.median(rss) / 2**20}
    report["ratio_median"] = report["B"]["median_s"] / report["A"]["median_s"]
    report["ratio_min"] = report["B"]["min_s"] / report["A"]["min_s"]
    print(f"A median {report['A']['median_s']:.2f} s (min {report['A']['min_s']:.2f}), "
          f"B median {report['B']['median_s']:.2f} s (min {report['B']['min_s']:.2f}); B/A {report['ratio_median']:.3f} "
          f"(min {report['ratio_min']:.3f}); peak RSS A {report['A']['median_peak_rss_mib']:.0f} MiB, "
          f"B {report['B']['median_peak_rss_mib']:.0f} MiB")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
