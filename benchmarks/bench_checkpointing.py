#!/usr/bin/env python
"""Checkpoint conversion and resharding cost, side by side, on one machine (see benchmarks/README.md).

Trains a GPT with pretrain_scripts/pretrain_gpt.py at TP2 PP2 DP2 (8 processes, distributed optimizer,
1 iteration so real Adam state exists) and saves it twice: megatron-core's default `dp_reshardable`
optimizer format and `--dist-ckpt-optim-fully-reshardable`. Then measures, each as its own process tree,
with the page cache dropped before each step when allowed:

  cp            cp -r of the dp_reshardable checkpoint (what the disk costs)
  to-universal  megatron-ucp to-universal --workers W of the same checkpoint
  lazy          megatron-ucp to-universal --lazy (an index into the source, no copy)
  ucp@L         --load UCP --universal-checkpoint at layout L, until the first training step is done
                (and once from the lazy index, at the first layout)
  mcore@L       megatron-core's own resharding: --load of the fully_reshardable checkpoint at layout L
  save          the save phase of the two training runs (dp_reshardable vs fully_reshardable)

For each: wall time, peak RSS and PSS summed over the process tree, storage bytes read / written and
read()/write() bytes (megatron_ucp.io.stats). Prints a table with ratios and writes JSON (--output).
`--steps conversion` runs only the dp_reshardable save, cp and to-universal (the sizes whose
megatron-core loads do not fit in memory); `--repeat N` measures cp and to-universal N times each,
alternating, and reports the medians.

    python benchmarks/bench_checkpointing.py --preset tiny --output bench_tiny.json
    python benchmarks/bench_checkpointing.py --preset 100m --workdir /tmp/bench --output bench_100m.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from megatron_ucp.io.stats import RunStats, dir_bytes, drop_page_cache, run_measured  # noqa: E402

PRETRAIN = REPO / "pretrain_scripts" / "pretrain_gpt.py"
GIB = 2 ** 30
MIB = 2 ** 20


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int  # NullTokenizer --vocab-size; the model's vocabulary is one more (EOD)
    seq_length: int
    global_batch_size: int

    @property
    def num_parameters(self) -> int:
        """GPT-2-like (LayerNorm, GELU, biases, learned positions, tied embeddings)."""
        h, f, layers = self.hidden_size, self.ffn_hidden_size, self.num_layers
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv+proj (+bias), fc1/fc2 (+bias), 2 norms
        return layers * per_layer + (self.vocab_size + 1 + self.seq_length) * h + 2 * h


# NullTokenizer's vocabulary is --vocab-size + 1; keeping it a multiple of 256 gives the same padded
# vocabulary at TP 1 and 2, which megatron-core's own load requires (it cannot re-pad).
PRESETS = {
    "tiny": ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                       vocab_size=1023, seq_length=64, global_batch_size=4),
    "100m": ModelShape(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
                       vocab_size=32767, seq_length=128, global_batch_size=4),
    "300m": ModelShape(num_layers=20, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                       vocab_size=32767, seq_length=128, global_batch_size=4),
    "1b": ModelShape(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                     vocab_size=32767, seq_length=128, global_batch_size=4),
}

SOURCE = "TP2PP2DP2"
LAYOUTS = {"TP2PP2DP2": (2, 2, 2), "TP1PP4DP2": (1, 4, 2), "TP1PP1DP4": (1, 1, 4), "TP1PP4DP1": (1, 4, 1),
           "TP2PP1DP2": (2, 1, 2)}

# Output lines the timings are taken from (rank 0 / last rank of pretrain_gpt.py).
MARKS = {
    "started": r"> megatron-ucp pretrain_gpt:",        # processes up, parallel state built
    "resumed": r"> resuming at iteration",             # load finished on every rank (after a barrier)
    "first_step": r"\] iteration\s+\d+/",              # first training step's log line
    "saved": r"> saved checkpoint at iteration",       # the save finished on every rank
}


def model_flags(shape: ModelShape) -> List[str]:
    return ("--num-layers {l} --hidden-size {h} --num-attention-heads {a} --ffn-hidden-size {f} --seq-length {s} "
            "--max-position-embeddings {s} --micro-batch-size 1 --global-batch-size {g} --lr 1e-4 --min-lr 1e-4 "
            "--lr-decay-style constant --seed 1234 --log-interval 1 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size {v} --attention-dropout 0.0 --hidden-dropout 0.0 --normalization LayerNorm "
            "--position-embedding-type learned_absolute --use-distributed-optimizer --eval-iters 0"  # no evaluation
            ).format(l=shape.num_layers, h=shape.hidden_size, a=shape.num_attention_heads, f=shape.ffn_hidden_size,
                     s=shape.seq_length, g=shape.global_batch_size, v=shape.vocab_size).split()


def torchrun(layout: str, args: List[str]) -> List[str]:
    tp, pp, dp = LAYOUTS[layout]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp * pp * dp),
            str(PRETRAIN), "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *args]


def estimated_peak_bytes(shape: ModelShape, layout: str) -> int:
    """Rough peak of a training process tree at `layout`: per rank, fp32 weights + grads (8 B/param), Adam
    moments of its DP shard (8 B/param / DP), ~0.6 GiB of runtime, and activations (small here)."""
    tp, pp, dp = LAYOUTS[layout]
    per_rank = shape.num_parameters / (tp * pp)
    return int(tp * pp * dp * (per_rank * (8 + 8 / dp) + 0.6 * GIB))


def estimated_fully_reshardable_save_bytes(shape: ModelShape, layout: str) -> int:
    """megatron-core's fully_reshardable save (non mem-efficient) all-gathers each rank's fp32 main
    param and moments over DP into model-space tensors: ~ +12 B per parameter of the rank, and observed
    ~2.2x the dp_reshardable run's peak at 300M parameters."""
    tp, pp, dp = LAYOUTS[layout]
    per_rank = shape.num_parameters / (tp * pp)
    return estimated_peak_bytes(shape, layout) + int(tp * pp * dp * per_rank * 12)


def estimated_mcore_load_bytes(shape: ModelShape, layout: str) -> int:
    """megatron-core's fully_reshardable load holds the model-space optimizer state of the whole TP slice
    next to the model and optimizer: measured ~36 B per parameter of the rank (100m preset, TP1PP1DP4)."""
    tp, pp, dp = LAYOUTS[layout]
    return int(tp * pp * dp * (shape.num_parameters / (tp * pp) * 36 + 0.6 * GIB))


class Bench:
    def __init__(self, args):
        self.args = args
        self.shape = PRESETS[args.preset]
        if args.num_layers:
            self.shape = ModelShape(**{**self.shape.__dict__, "num_layers": args.num_layers})
        if args.hidden_size:
            self.shape = ModelShape(**{**self.shape.__dict__, "hidden_size": args.hidden_size,
                                       "ffn_hidden_size": 4 * args.hidden_size})
        self.work = Path(args.workdir).absolute()
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
                        WORKDIR=str(self.work))
        self.results: Dict[str, RunStats] = {}
        self.cold = None  # whether the page cache could be dropped
        self.conversion_seconds: List[Optional[float]] = []  # to-universal's own timing, per repeat

    def synced(self, cmd: List[str]) -> List[str]:
        """With --sync, the command followed by `sync -f` of the work folder's filesystem, so its time
        includes writing the dirty pages out (cp -r of a checkpoint larger than the dirty-page limit is
        otherwise throttled by earlier writes in ways that vary from run to run)."""
        if not self.args.sync:
            return cmd
        return ["sh", "-c", '"$@" && sync -f "$WORKDIR"', "sh", *cmd]

    def _conversion_seconds(self, log_name: str) -> Optional[float]:
        for line in (self.work / "logs" / f"{log_name}.log").read_text().splitlines():
            if line.startswith("{"):
                return json.loads(line).get("seconds")
        return None

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def prepare_cache(self) -> None:
        if self.args.drop_caches == "off":
            self.cold = False
            os.sync()
            return
        ok = drop_page_cache()
        if self.cold is None:
            self.cold = ok
            if not ok:
                self.log("cannot drop the page cache (not root?): measuring with a warm cache")

    def measure(self, name: str, cmd: List[str], drop: bool = True, log_name: Optional[str] = None) -> RunStats:
        if drop:
            self.prepare_cache()
        self.log(f"{name}: {' '.join(cmd[:8])} ...")
        log = self.work / "logs" / f"{(log_name or name).replace('@', '_')}.log"
        stats = run_measured(name, cmd, log_path=log, cwd=REPO,
                             env=self.env, marks=MARKS, timeout_s=self.args.timeout)
        self.results[name] = stats
        self.log(f"{name}: {stats.wall_s:.1f} s, peak PSS {stats.peak_pss_bytes / MIB:.0f} MiB, read "
                 f"{stats.read_bytes / MIB:.1f} MiB, written {stats.write_bytes / MIB:.1f} MiB")
        return stats

    def run(self) -> dict:
        a, shape = self.args, self.shape
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        flags = model_flags(shape)
        full = a.steps == "all"
        need = (max([estimated_mcore_load_bytes(shape, lay) for lay in a.layouts]
                    + [estimated_fully_reshardable_save_bytes(shape, SOURCE)]) if full
                else estimated_peak_bytes(shape, SOURCE))
        avail = psutil.virtual_memory().available
        self.log(f"preset {a.preset}: {shape.num_parameters / 1e6:.1f} M parameters; estimated peak "
                 f"{need / GIB:.1f} GiB, available {avail / GIB:.1f} GiB")
        if need > avail and not a.force:
            raise SystemExit(f"estimated peak {need / GIB:.1f} GiB exceeds the available {avail / GIB:.1f} GiB; "
                             f"choose a smaller preset or --layouts, or pass --force")

        iters = 1
        src, src_fr, ucp = self.work / "ckpt_dp", self.work / "ckpt_fr", self.work / "ucp"
        # The two saves (one training iteration each, then the save).
        save = ["--train-iters", str(iters), "--save-interval", str(iters)]  # Megatron-LM 0.19 asserts an interval
        self.measure("train+save dp_reshardable", torchrun(SOURCE, [*flags, *save, "--save", str(src)]), drop=False)
        if full:
            self.measure("train+save fully_reshardable", torchrun(SOURCE, [
                *flags, *save, "--save", str(src_fr), "--dist-ckpt-optim-fully-reshardable"]),
                drop=False)

        for i in range(a.repeat):
            suffix = "" if i == 0 else f" #{i + 1}"
            if ucp.exists():
                shutil.rmtree(ucp)
            self.measure("cp -r" + suffix, self.synced(["cp", "-r", str(src), str(self.work / "ckpt_copy")]))
            shutil.rmtree(self.work / "ckpt_copy")
            self.measure("to-universal" + suffix, self.synced(
                [sys.executable, "-m", "megatron_ucp.cli", "to-universal", str(src), str(ucp), "--workers",
                 str(a.workers), "--quiet", "--json"]), log_name=f"to-universal{i}")
            self.conversion_seconds.append(self._conversion_seconds(f"to-universal{i}"))
        lazy = self.work / "ucp_lazy"
        self.measure("to-universal --lazy", [sys.executable, "-m", "megatron_ucp.cli", "to-universal", str(src),
                                             str(lazy), "--lazy", "--quiet", "--json"], log_name="to-universal-lazy")
        for layout in (a.layouts if full else []):
            load = [*flags, "--train-iters", str(iters + 1)]
            self.measure(f"ucp@{layout}", torchrun(layout, [*load, "--load", str(ucp), "--universal-checkpoint"]))
            self.measure(f"mcore@{layout}", torchrun(layout, [*load, "--load", str(src_fr)]))
            if layout == a.layouts[0]:
                self.measure(f"ucp-lazy@{layout}", torchrun(layout, [*load, "--load", str(lazy),
                                                                     "--universal-checkpoint"]))

        sizes = {"ckpt_dp_reshardable": dir_bytes(src), "universal": dir_bytes(ucp), "universal_lazy": dir_bytes(lazy)}
        if full:
            sizes["ckpt_fully_reshardable"] = dir_bytes(src_fr)
        report = self.report(sizes)
        if not a.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        return report

    def report(self, sizes: Dict[str, int]) -> dict:
        r, a = self.results, self.args

        def phase(name: str, begin: str, end: str) -> Optional[float]:
            m = r[name].marks
            return None if m.get(begin) is None or m.get(end) is None else round(m[end] - m[begin], 3)

        rows = []

        def row(label: str, stats: RunStats, seconds: float, ref: Optional[float], ref_name: str, note: str = ""):
            rows.append({"step": label, "seconds": seconds, "wall_s": stats.wall_s,
                         "peak_rss_mib": round(stats.peak_rss_bytes / MIB), "peak_pss_mib": round(stats.peak_pss_bytes / MIB),
                         "read_mib": round(stats.read_bytes / MIB, 1), "written_mib": round(stats.write_bytes / MIB, 1),
                         "rchar_mib": round(stats.rchar / MIB, 1), "wchar_mib": round(stats.wchar / MIB, 1),
                         "ratio": None if not ref else round(seconds / ref, 2), "ratio_to": ref_name, "note": note})

        def median_run(prefix: str) -> RunStats:
            runs = sorted((v for k, v in r.items() if k == prefix or k.startswith(prefix + " #")),
                          key=lambda v: v.wall_s)
            return runs[(len(runs) - 1) // 2]

        cp_run, tu_run = median_run("cp -r"), median_run("to-universal")
        cp = cp_run.wall_s
        walls = lambda prefix: [round(v.wall_s, 2) for k, v in r.items() if k == prefix or k.startswith(prefix + " #")]
        conv = sorted(c for c in self.conversion_seconds if c is not None)
        conv_median = conv[(len(conv) - 1) // 2] if conv else None
        row("cp -r (dp_reshardable ckpt)", cp_run, cp, None, "", f"runs {walls('cp -r')}" if a.repeat > 1 else "")
        row("to-universal", tu_run, tu_run.wall_s, cp, "cp -r",
            f"--workers {a.workers}; conversion itself {conv_median} s (rest: interpreter start)"
            + (f"; runs {walls('to-universal')}, conversion {self.conversion_seconds}" if a.repeat > 1 else ""))
        rows.append({"step": "  conversion itself (no interpreter start)", "seconds": conv_median,
                     "ratio": None if not conv_median else round(conv_median / cp, 2), "ratio_to": "cp -r"})
        lz = r["to-universal --lazy"]
        row("to-universal --lazy (index only)", lz, lz.wall_s, cp, "cp -r",
            f"conversion itself {self._conversion_seconds('to-universal-lazy')} s")
        if a.steps != "all":
            return self._report(sizes, rows)
        for layout in a.layouts:
            u, m = r[f"ucp@{layout}"], r[f"mcore@{layout}"]
            u_first, m_first = u.marks["first_step"] or u.wall_s, m.marks["first_step"] or m.wall_s
            row(f"ucp load @{layout} (start -> 1st step)", u, u_first, m_first, "mcore load")
            row(f"mcore fully_reshardable load @{layout} (start -> 1st step)", m, m_first, None, "")
            if f"ucp-lazy@{layout}" in r:
                z = r[f"ucp-lazy@{layout}"]
                row(f"lazy ucp load @{layout} (start -> 1st step)", z, z.marks["first_step"] or z.wall_s, m_first,
                    "mcore load")
            u_load, m_load = phase(f"ucp@{layout}", "started", "resumed"), phase(f"mcore@{layout}", "started", "resumed")
            rows.append({"step": f"  load phase only @{layout} (banner -> resumed)", "seconds": u_load,
                         "ratio": None if not (u_load and m_load) else round(u_load / m_load, 2),
                         "ratio_to": f"mcore {m_load} s"})
        dp_save = phase("train+save dp_reshardable", "first_step", "saved")
        fr_save = phase("train+save fully_reshardable", "first_step", "saved")
        row("save dp_reshardable (1st step -> saved)", r["train+save dp_reshardable"], dp_save, None, "",
            "bytes/memory: whole train+save run")
        row("save fully_reshardable (1st step -> saved)", r["train+save fully_reshardable"], fr_save, dp_save,
            "dp_reshardable save")
        return self._report(sizes, rows)

    def _report(self, sizes: Dict[str, int], rows: list) -> dict:
        r, a = self.results, self.args
        return {"preset": a.preset, "shape": self.shape.__dict__, "num_parameters": self.shape.num_parameters,
                "source_layout": SOURCE, "workers": a.workers, "page_cache_dropped": bool(self.cold),
                "steps": a.steps, "repeat": a.repeat, "sync": a.sync,
                "sizes_bytes": sizes, "machine": {"cpus": os.cpu_count(), "memory_gib": round(
                    psutil.virtual_memory().total / GIB, 1)},
                "rows": rows, "runs": {k: v.to_dict() for k, v in r.items()}}


def print_table(report: dict) -> None:
    s = report["sizes_bytes"]
    print(f"\npreset {report['preset']}: {report['num_parameters'] / 1e6:.1f} M params, source {report['source_layout']}, "
          f"page cache {'dropped before each step' if report['page_cache_dropped'] else 'WARM'}"
          f"{'; cp -r and to-universal timed until synced' if report.get('sync') else ''}; sizes: "
          + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in s.items()))
    head = f"{'step':58s} {'s':>8s} {'ratio':>12s} {'peakPSS':>8s} {'peakRSS':>8s} {'read':>8s} {'written':>8s} {'rchar':>8s}"
    print(head + "\n" + "-" * len(head))
    for row in report["rows"]:
        ratio = "" if row.get("ratio") is None else f"{row['ratio']:.2f}x"
        sec = "-" if row.get("seconds") is None else f"{row['seconds']:.2f}"
        if "peak_pss_mib" not in row:
            print(f"{row['step']:58s} {sec:>8s} {ratio:>12s}   (vs {row['ratio_to']})")
            continue
        print(f"{row['step']:58s} {sec:>8s} {ratio:>12s} {row['peak_pss_mib']:>7d}M {row['peak_rss_mib']:>7d}M "
              f"{row['read_mib']:>7.1f}M {row['written_mib']:>7.1f}M {row['rchar_mib']:>7.1f}M"
              + (f"   vs {row['ratio_to']}" if row["ratio_to"] else ""))
    for row in report["rows"]:
        if row.get("note"):
            print(f"  note, {row['step']}: {row['note']}")
    print("read/written: storage bytes (/proc/<pid>/io read_bytes/write_bytes of the reaped tree); rchar: read() "
          "bytes incl. page-cache hits and pipes, excl. mmap.")


def add_run_options(p: argparse.ArgumentParser, workdir: str) -> None:
    """The options every measured benchmark takes: where it works and reports, page cache, limits, re-printing."""
    p.add_argument("--workdir", default=workdir)
    p.add_argument("--output", help="write the JSON report here")
    p.add_argument("--drop-caches", choices=["auto", "off"], default="auto",
                   help="auto: sync; echo 3 > /proc/sys/vm/drop_caches before each measured step when allowed")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per step")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints in --workdir")
    p.add_argument("--print", metavar="JSON", help="only print the table of an earlier --output file")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m",
                   help="100m fits a 24 GiB machine; 300m needs ~41 GiB, 1b ~175 GiB with the default layouts")
    p.add_argument("--num-layers", type=int, help="override the preset's layer count (multiple of 4)")
    p.add_argument("--hidden-size", type=int, help="override the preset's hidden size (ffn = 4x)")
    p.add_argument("--layouts", nargs="+", default=["TP1PP4DP2", "TP1PP1DP4"], choices=sorted(LAYOUTS),
                   help="layouts to load at")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="to-universal --workers")
    p.add_argument("--steps", choices=["all", "conversion"], default="all",
                   help="conversion: only the dp_reshardable save, cp -r and to-universal (fits larger presets)")
    p.add_argument("--repeat", type=int, default=1, help="measure cp -r and to-universal this many times (median)")
    p.add_argument("--sync", action="store_true",
                   help="time cp -r and to-universal until their output is on disk (each followed by sync -f)")
    add_run_options(p, "/tmp/megatron_ucp_bench")
    p.add_argument("--force", action="store_true", help="run even if the memory estimate exceeds what is free")
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
