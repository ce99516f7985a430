#!/usr/bin/env python
"""What the write-side safety costs a real conversion: `to-universal` with checksums (computed while
writing), lock, staging and fsync vs the same conversion without checksums, and the whole CLI vs `cp -r`.

    .venv/bin/python benchmarks/bench_trust.py --preset 100m --repeat 5 --output bench_trust_100m.json
    .venv/bin/python benchmarks/bench_trust.py --src /path/to/megatron/ckpt --repeat 5   # an existing checkpoint

Trains the preset's GPT for one iteration at TP2 PP2 DP2 (benchmarks/bench_checkpointing.py's model and
flags, torch_dist, distributed optimizer) unless --src is given, then measures `--repeat` rounds, the
order of the steps rotating from round to round, each step a fresh process tree with the page cache
dropped before it (`sync; echo 3 > /proc/sys/vm/drop_caches` when allowed; the report says whether):

  cp -r                        the source checkpoint copied (what the disk costs)
  cp -r + sync                 the same, until the copy is on disk (`sync -f`): to-universal fsyncs its
                               output before the completion marker, so this is the like-for-like copy
  to-universal                 the CLI as shipped: checksums, lock, staging, fsync before the marker
  to-universal, no checksums   the same CLI with the digests switched off (this script's --no-checksums
                               mode: BlockHasher replaced by a no-op, copies without hashing), so the
                               difference is exactly the checksums
  to-universal --lazy          the index only (its source regions are read once for their checksums)
  check                        every block of the result read and checked

Reports medians (all runs in the JSON): wall time of each command, the converter's own seconds (its
--json "seconds": without interpreter start), the CLI / cp -r ratio and the checksums / no-checksums
ratio. Load average before each step is recorded (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

MIB = 2 ** 20


def _without_checksums() -> None:
    """Switch the digests off in this process (the --no-checksums mode): tensor files are written exactly
    as before checksums existed (copy_region, plain pwrite), records are placeholders."""
    from megatron_ucp.io import byteio
    from megatron_ucp.io import integrity
    from megatron_ucp import universal
    from megatron_ucp.convert import runner
    from megatron_ucp.universal import tensorfile

    class NoDigests(integrity.BlockHasher):
        def update(self, pos, data) -> None:
            pass

        def missing(self) -> list:  # nothing is fed to it, so it cannot tell (the checksummed run checks)
            return []

        def record(self) -> integrity.DigestRecord:
            return integrity.DigestRecord(integrity.ALGORITHM, self.block_size, self.size,
                                          ("0" * 32,) * len(self._digests), self.offset)

    class NoFiniteDigests(NoDigests):  # the finiteness scan rides on the digests' pass: off with them
        def __init__(self, size, regions, block_size=integrity.BLOCK_SIZE, *, offset=0, name="file"):
            super().__init__(size, block_size, offset=offset, name=name)
            self.non_finite = {}

    integrity.BlockHasher = NoDigests
    integrity.FiniteBlockHasher = NoFiniteDigests
    tensorfile.write_placement = lambda files, fd, offset, placement, hasher=None: byteio.write_placement(
        files, fd, offset, placement)

    def lazy_section(root, entries, workers=4):
        root = Path(root).resolve()
        return {"source": str(root), "files": universal.source_file_stats(root, entries)}

    runner.lazy_section = lazy_section


def _cli_main(argv) -> int:
    from megatron_ucp import cli

    return cli.main(argv)


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


class Bench:
    def __init__(self, args):
        from megatron_ucp.io.stats import drop_page_cache

        self.args = args
        self.work = Path(args.workdir).absolute()
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
        self.drop = drop_page_cache
        self.cold = None
        self.runs: dict[str, list[dict]] = {}

    def log(self, msg: str) -> None:
        print(f"[bench_trust {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def measure(self, name: str, cmd: list[str]) -> dict:
        from megatron_ucp.io.stats import run_measured

        ok = self.drop()
        self.cold = ok if self.cold is None else self.cold and ok
        load = os.getloadavg()[0]
        log = self.work / "logs" / f"{name.replace(' ', '_').replace(',', '')}-{len(self.runs.get(name, []))}.log"
        stats = run_measured(name, cmd, log_path=log, cwd=REPO, env=self.env, timeout_s=self.args.timeout)
        run = {"wall_s": round(stats.wall_s, 3), "load_before": round(load, 2),
               "peak_pss_mib": round(stats.peak_pss_bytes / MIB), "read_mib": round(stats.read_bytes / MIB, 1),
               "written_mib": round(stats.write_bytes / MIB, 1)}
        for line in log.read_text().splitlines():
            if line.startswith("{"):
                doc = json.loads(line)
                run["seconds"] = doc.get("seconds")
        self.runs.setdefault(name, []).append(run)
        self.log(f"{name}: {run['wall_s']:.2f} s (own {run.get('seconds')}), load {load:.1f}")
        return run

    def source(self) -> Path:
        if self.args.src:
            return Path(self.args.src).absolute()
        from bench_checkpointing import PRESETS, model_flags, torchrun
        from megatron_ucp.io.stats import run_measured

        src = self.work / "ckpt"
        flags = model_flags(PRESETS[self.args.preset])
        self.log(f"training {self.args.preset} for one iteration at TP2PP2DP2 ...")
        run_measured("train", torchrun("TP2PP2DP2", [*flags, "--train-iters", "1", "--save-interval", "1", "--save", str(src)]),
                     log_path=self.work / "logs" / "train.log", cwd=REPO, env=self.env, timeout_s=self.args.timeout)
        return src

    def run(self) -> dict:
        from megatron_ucp.io.stats import dir_bytes

        if self.work.exists() and not self.args.src:
            shutil.rmtree(self.work)
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        src = self.source()
        me = [sys.executable, str(Path(__file__).resolve())]
        ucp, lazy, copy = self.work / "ucp", self.work / "ucp_lazy", self.work / "copy"
        workers = str(self.args.workers)
        steps = {
            "cp -r": (["cp", "-r", str(src), str(copy)], copy),
            "cp -r + sync": (["sh", "-c", 'cp -r "$0" "$1" && sync -f "$1"', str(src), str(copy)], copy),
            "to-universal": (me + ["--cli", "to-universal", str(src), str(ucp), "--workers", workers, "--quiet",
                                   "--json"], ucp),
            "to-universal, no checksums": (me + ["--cli-no-checksums", "to-universal", str(src), str(ucp), "--workers",
                                                 workers, "--quiet", "--json"], ucp),
            "to-universal --lazy": (me + ["--cli", "to-universal", str(src), str(lazy), "--lazy", "--quiet", "--json"],
                                    lazy),
            "to-universal --lazy, no checksums": (me + ["--cli-no-checksums", "to-universal", str(src), str(lazy),
                                                        "--lazy", "--quiet", "--json"], lazy),
        }
        names = list(steps)
        sizes = {}
        for i in range(self.args.repeat):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                cmd, out = steps[name]
                shutil.rmtree(out, ignore_errors=True)
                self.measure(name, cmd)
                if name == "to-universal" and "universal" not in sizes:
                    sizes["universal"] = dir_bytes(ucp)
                    self.measure("check", me + ["--cli", "check", str(ucp), "--quiet", "--json"])
                    shutil.rmtree(ucp)
                    continue
                shutil.rmtree(out, ignore_errors=True)
        sizes["source"] = dir_bytes(src)
        report = self.report(sizes)
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        return report

    def report(self, sizes: dict) -> dict:
        m = {name: {"wall_s": median(r["wall_s"] for r in runs), "seconds": median(r.get("seconds") for r in runs)}
             for name, runs in self.runs.items()}
        cp = m["cp -r"]["wall_s"]

        def ratio(a, b):
            return round(a / b, 3) if a and b else None

        summary = {
            "cli / cp -r": ratio(m["to-universal"]["wall_s"], cp),
            "cli without checksums / cp -r": ratio(m["to-universal, no checksums"]["wall_s"], cp),
            "cli / (cp -r + sync)": ratio(m["to-universal"]["wall_s"], m["cp -r + sync"]["wall_s"]),
            "conversion itself / cp -r": ratio(m["to-universal"]["seconds"], cp),
            "checksums / none, CLI wall": ratio(m["to-universal"]["wall_s"], m["to-universal, no checksums"]["wall_s"]),
            "checksums / none, conversion itself": ratio(m["to-universal"]["seconds"],
                                                         m["to-universal, no checksums"]["seconds"]),
            "lazy: checksums / none, CLI wall": ratio(m["to-universal --lazy"]["wall_s"],
                                                      m["to-universal --lazy, no checksums"]["wall_s"]),
            "check GiB/s (its own seconds)": round(sizes["universal"] / 2 ** 30 / m["check"]["seconds"], 2)
            if m.get("check", {}).get("seconds") else None,
        }
        return {"preset": self.args.preset if not self.args.src else None, "source": self.args.src,
                "workers": self.args.workers, "repeat": self.args.repeat, "page_cache_dropped": bool(self.cold),
                "machine": {"cpus": os.cpu_count()}, "sizes_bytes": sizes, "medians": m, "summary": summary,
                "runs": self.runs}


def print_report(report: dict) -> None:
    s = report["sizes_bytes"]
    print(f"\nsource {s['source'] / MIB:.0f} MiB, universal {s.get('universal', 0) / MIB:.0f} MiB; page cache "
          f"{'dropped before each step' if report['page_cache_dropped'] else 'WARM'}; medians of {report['repeat']}")
    print(f"{'step':38s} {'wall s':>8s} {'own s':>8s}  runs (wall s, load before)")
    for name, med in report["medians"].items():
        runs = ", ".join(f"{r['wall_s']:.2f}@{r['load_before']:.1f}" for r in report["runs"][name])
        own = "-" if med["seconds"] is None else f"{med['seconds']:.2f}"
        print(f"{name:38s} {med['wall_s']:8.2f} {own:>8s}  {runs}")
    for key, value in report["summary"].items():
        print(f"  {key}: {value}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("--cli", "--cli-no-checksums"):  # a measured command (this script re-run)
        if argv[0] == "--cli-no-checksums":
            _without_checksums()
        sys.exit(_cli_main(argv[1:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="100m", help="bench_checkpointing.py preset (tiny, 100m, 300m, 1b)")
    p.add_argument("--src", help="an existing Megatron checkpoint instead of training one")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="to-universal --workers")
    p.add_argument("--workdir", default="/tmp/megatron_ucp_bench_trust")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--output", help="write the JSON report here")
    p.add_argument("--print", metavar="JSON", help="only print an earlier report")
    args = p.parse_args(argv)
    if args.print:
        print_report(json.loads(Path(args.print).read_text()))
        return
    report = Bench(args).run()
    print_report(report)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
