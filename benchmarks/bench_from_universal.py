#!/usr/bin/env python
"""`from-universal --ckpt-format torch_dist`: the direct writer vs the harness route vs `cp -r`
(see benchmarks/README.md).

Prepares a universal checkpoint of a GPT-2-like model (bench_checkpointing.py's presets: LayerNorm, GELU,
biases, learned positions, tied embeddings, fp32, distributed optimizer) by training one iteration in
one process and converting it. Then measures, each as its own process tree, with the page cache
dropped before each step when allowed:

  cp -r            copy of the universal checkpoint (what the disk costs)
  start            python importing the CLI and megatron_ucp.commands.from_universal (what `from-universal` pays
                   before it reads anything: the interpreter and its modules; torch is not among them)
  direct           megatron-ucp from-universal UCP OUT at the target layout (default TP2 PP2 DP2),
                   --use-distributed-optimizer --ckpt-format torch_dist (dp_reshardable), --workers W: bytes
                   copied file to file, every universal block read or copied checked against its checksum
  direct full      the same with --optimizer-format fully_reshardable
  harness          the same as `direct` with --via-megatron-lm (T*P*D training processes save it), when its
                   memory estimate fits (--skip-harness to skip)

For each: wall time, peak RSS and PSS summed over the process tree, storage bytes read / written
(megatron_ucp.io.stats). `--repeat N` measures start, cp -r, direct and direct full N times each,
alternating (medians; the fastest runs too: the shared disk varies by 10x between runs). `--sync` times
each step until its output is on disk.

    python benchmarks/bench_from_universal.py --preset 100m --repeat 3 --output bench_fu_100m.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import psutil  # noqa: E402

from bench_checkpointing import GIB, MIB, PRESETS, PRETRAIN, ModelShape, add_run_options, model_flags  # noqa: E402
from megatron_ucp.io.stats import CommandFailed, RunStats, dir_bytes, drop_page_cache, run_measured  # noqa: E402


def harness_bytes(shape: ModelShape, tp: int, pp: int, dp: int) -> int:
    """Peak of the harness route: T*P*D training processes, each with its fp32 weights and grads (8 B per
    parameter of its TP x PP slice), its DP share of the Adam state (12 B / DP), the universal slices it
    reads, and ~0.6 GiB of runtime (bench_checkpointing.estimated_peak_bytes, plus the reads)."""
    per_rank = shape.num_parameters / (tp * pp)
    return int(tp * pp * dp * (per_rank * (8 + 16 / dp) + 0.6 * GIB))


class Bench:
    def __init__(self, args):
        self.args = args
        self.shape = PRESETS[args.preset]
        self.work = Path(args.workdir).absolute()
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
                        WORKDIR=str(self.work))
        self.results: Dict[str, RunStats] = {}
        self.cold: Optional[bool] = None
        self.seconds: Dict[str, float] = {}  # the command's own timer ("seconds" in its JSON)

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def synced(self, cmd: List[str]) -> List[str]:
        """With --sync, the command followed by `sync -f` of the work folder, so its time includes writing
        the dirty pages out (what the disk really costs; cp -r otherwise ends before its data is written)."""
        if not self.args.sync:
            return cmd
        return ["sh", "-c", '"$@" && sync -f "$WORKDIR"', "sh", *cmd]

    def measure(self, name: str, cmd: List[str]) -> RunStats:
        cmd = self.synced(cmd)
        ok = drop_page_cache() if self.args.drop_caches == "auto" else (os.sync() or False)
        if self.cold is None:
            self.cold = ok
        self.log(f"{name}: {' '.join(cmd[:6])} ...")
        log = self.work / "logs" / f"{name.replace(' ', '_').replace('#', '')}.log"
        stats = run_measured(name, cmd, log_path=log, cwd=REPO, env=self.env, timeout_s=self.args.timeout)
        self.results[name] = stats
        for line in log.read_text().splitlines():
            if line.startswith("{"):
                self.seconds[name] = json.loads(line).get("seconds")
        self.log(f"{name}: {stats.wall_s:.2f} s, peak PSS {stats.peak_pss_bytes / MIB:.0f} MiB, RSS "
                 f"{stats.peak_rss_bytes / MIB:.0f} MiB, read {stats.read_bytes / MIB:.0f} MiB, written "
                 f"{stats.write_bytes / MIB:.0f} MiB")
        return stats

    def from_universal(self, ucp: Path, out: Path, *extra: str) -> List[str]:
        a = self.args
        return [sys.executable, "-m", "megatron_ucp.cli", "from-universal", str(ucp), str(out),
                "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
                "--data-parallel-size", str(a.dp), "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
                "--rng-state", "cpu", "--quiet", "--json", *extra]

    def prepare(self) -> Path:
        """One training iteration in one process, saved, converted to universal (not measured)."""
        src, ucp = self.work / "ckpt", self.work / "ucp"
        flags = model_flags(self.shape)
        self.log(f"preparing: {self.shape.num_parameters / 1e6:.1f} M parameters, 1 training iteration")
        run_measured("prepare-train", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc-per-node", "1", str(PRETRAIN), *flags, "--train-iters", "1",
                                       "--save-interval", "1", "--save", str(src)], log_path=self.work / "logs" / "prepare-train.log",
                     cwd=REPO, env=self.env, timeout_s=self.args.timeout)
        run_measured("prepare-convert", [sys.executable, "-m", "megatron_ucp.cli", "to-universal", str(src), str(ucp),
                                         "--quiet"], log_path=self.work / "logs" / "prepare-convert.log", cwd=REPO,
                     env=self.env, timeout_s=self.args.timeout)
        shutil.rmtree(src)
        return ucp

    def run(self) -> dict:
        a, shape = self.args, self.shape
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        ucp = self.prepare()
        workers = ["--workers", str(a.workers)]
        for i in range(a.repeat):
            suffix = "" if i == 0 else f" #{i + 1}"
            # what from-universal pays before writing: interpreter and megatron_ucp imports (cold cache)
            self.measure("start" + suffix, [sys.executable, "-c", "import megatron_ucp.cli as c; "
                                            "c.build_parser(['from-universal', 'u', 'd']); import megatron_ucp.commands.from_universal"])
            self.measure("cp -r" + suffix, ["cp", "-r", str(ucp), str(self.work / "copy")])
            shutil.rmtree(self.work / "copy")
            self.measure("direct" + suffix, self.from_universal(ucp, self.work / "direct", *workers))
            sizes = {"universal": dir_bytes(ucp), "torch_dist_dp_reshardable": dir_bytes(self.work / "direct")}
            shutil.rmtree(self.work / "direct")
            self.measure("direct full" + suffix, self.from_universal(ucp, self.work / "direct_full", *workers,
                                                                     "--optimizer-format", "fully_reshardable"))
            sizes["torch_dist_fully_reshardable"] = dir_bytes(self.work / "direct_full")
            shutil.rmtree(self.work / "direct_full")
        need = harness_bytes(shape, a.tp, a.pp, a.dp)
        avail = psutil.virtual_memory().available
        self.harness_note = f"estimated {need / GIB:.1f} GiB, available {avail / GIB:.1f} GiB"
        if a.skip_harness or (need > avail and not a.force):
            self.log(f"harness route skipped ({self.harness_note})")
        else:
            try:
                self.measure("harness", self.from_universal(ucp, self.work / "harness", "--via-megatron-lm"))
                sizes["torch_dist_harness"] = dir_bytes(self.work / "harness")
            except CommandFailed as e:  # e.g. killed for memory: report it, keep the other rows
                self.harness_note += f"; failed: {str(e).splitlines()[0][:300]}"
                self.log(f"harness route failed: {e}")
            shutil.rmtree(self.work / "harness", ignore_errors=True)
        report = self.report(sizes)
        if not a.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        return report

    def report(self, sizes: Dict[str, int]) -> dict:
        r, a = self.results, self.args

        def median(prefix: str) -> RunStats:
            runs = sorted((v for k, v in r.items() if k == prefix or k.startswith(prefix + " #")),
                          key=lambda v: v.wall_s)
            return runs[(len(runs) - 1) // 2]

        def walls(prefix: str) -> list:
            return [round(v.wall_s, 2) for k, v in r.items() if k == prefix or k.startswith(prefix + " #")]

        cp = median("cp -r")
        rows = []

        def row(label: str, stats: RunStats, note: str = "") -> None:
            own = self.seconds.get(stats.name)
            rows.append({"step": label, "seconds": stats.wall_s, "ratio": round(stats.wall_s / cp.wall_s, 2),
                         "own_seconds": own, "own_ratio": None if own is None else round(own / cp.wall_s, 2),
                         "peak_rss_mib": round(stats.peak_rss_bytes / MIB),
                         "peak_pss_mib": round(stats.peak_pss_bytes / MIB),
                         "read_mib": round(stats.read_bytes / MIB), "written_mib": round(stats.write_bytes / MIB),
                         "note": note})

        row("cp -r (universal checkpoint)", cp, f"runs {walls('cp -r')}")
        start = median("start").wall_s
        row("CLI start (python, megatron_ucp imports)", median("start"), f"runs {walls('start')}")
        direct = median("direct")
        own = [self.seconds.get(k) for k in r if k.startswith("direct") and "full" not in k]
        row(f"direct, dp_reshardable (--workers {a.workers})", direct, f"runs {walls('direct')}, own timer {own}")
        rows.append({"step": "  direct, dp_reshardable, without CLI start", "seconds": round(direct.wall_s - start, 2),
                     "ratio": round((direct.wall_s - start) / cp.wall_s, 2)})
        # the shared machine's disk varies by 10x between runs: the fastest runs show the intrinsic cost
        fastest = {k: min(v.wall_s for n, v in r.items() if n == k or n.startswith(k + " #"))
                   for k in ("cp -r", "start", "direct")}
        rows.append({"step": "  fastest runs: direct - start vs cp -r", "seconds": round(
            fastest["direct"] - fastest["start"], 2), "ratio": round((fastest["direct"] - fastest["start"]) /
                                                                     fastest["cp -r"], 2)})
        full = median("direct full")
        row("direct, fully_reshardable", full, f"runs {walls('direct full')}")
        rows.append({"step": "  direct, fully_reshardable, without CLI start", "seconds": round(full.wall_s - start, 2),
                     "ratio": round((full.wall_s - start) / cp.wall_s, 2)})
        if "harness" in r:
            row("harness route (--via-megatron-lm)", r["harness"], self.harness_note)
        else:
            rows.append({"step": "harness route (--via-megatron-lm)", "note": f"skipped: {self.harness_note}"})
        return {"preset": a.preset, "shape": self.shape.__dict__, "num_parameters": self.shape.num_parameters,
                "target": f"TP{a.tp}PP{a.pp}DP{a.dp}", "workers": a.workers, "page_cache_dropped": bool(self.cold),
                "sync": a.sync,
                "repeat": a.repeat, "sizes_bytes": sizes, "machine": {
                    "cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / GIB, 1)},
                "rows": rows, "runs": {k: v.to_dict() for k, v in r.items()}}


def print_table(report: dict) -> None:
    print(f"\npreset {report['preset']}: {report['num_parameters'] / 1e6:.1f} M params, target {report['target']}, "
          f"page cache {'dropped before each step' if report['page_cache_dropped'] else 'WARM'}"
          f"{'; every step timed until synced' if report.get('sync') else ''}; sizes: "
          + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in report["sizes_bytes"].items()))
    head = (f"{'step':44s} {'s':>7s} {'x cp':>6s} {'own s':>7s} {'x cp':>6s} {'peakPSS':>8s} {'peakRSS':>8s} "
            f"{'read':>7s} {'written':>8s}")
    print(head + "\n" + "-" * len(head))
    for row in report["rows"]:
        if "seconds" not in row:
            print(f"{row['step']:44s} {row['note']}")
            continue
        if "peak_pss_mib" not in row:
            print(f"{row['step']:44s} {row['seconds']:7.2f} {row['ratio']:6.2f}")
            continue
        own = "" if row["own_seconds"] is None else f"{row['own_seconds']:.2f}"
        own_ratio = "" if row["own_ratio"] is None else f"{row['own_ratio']:.2f}"
        print(f"{row['step']:44s} {row['seconds']:7.2f} {row['ratio']:6.2f} {own:>7s} {own_ratio:>6s} "
              f"{row['peak_pss_mib']:>7d}M {row['peak_rss_mib']:>7d}M {row['read_mib']:>6d}M {row['written_mib']:>7d}M")
    for row in report["rows"]:
        if row.get("note") and "seconds" in row:
            print(f"  note, {row['step']}: {row['note']}")
    print("s: wall time of the whole command (interpreter start included; with --sync until its output is on "
          "disk); own s: the command's own timer (after imports, before the sync); peak PSS/RSS: summed over the "
          "process tree.")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="from-universal --workers")
    p.add_argument("--repeat", type=int, default=1, help="measure cp -r and the direct writer this many times")
    p.add_argument("--skip-harness", action="store_true", help="do not run the harness route")
    p.add_argument("--sync", action="store_true", help="time every step until its output is on disk (sync -f)")
    p.add_argument("--force", action="store_true", help="run the harness route even if its estimate exceeds memory")
    add_run_options(p, "/tmp/megatron_ucp_bench_fu")
    args = p.parse_args(argv)
    if args.print:
        report = json.loads(Path(args.print).read_text())
        print_table(report)
        return report
    report = Bench(args).run()
    print_table(report)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.output}")
    return report


if __name__ == "__main__":
    main()
