"""`megatron-ucp check PATH`: is every byte of a universal checkpoint what was written?

Reads every block of every tensor file (or, for a lazy checkpoint, every source region its index
reads) and checks it against the XXH3-128 digests recorded while writing (docs/FORMAT.md, version 2),
with `--workers` threads (hashing and pread release the GIL, so this runs at disk speed). Also checks
what metadata alone can tell (file sizes, parameters of the model missing, extra or of another shape)
and each tensor file's safetensors header against metadata.json (tensors, dtypes, shapes, data tiling
the file), and finds every NaN or Inf value (each tensor holding one is reported with its parameter, state
weight/exp_avg/exp_avg_sq, count and first element), searching each block right after it is hashed.
Every problem is one line naming the file, the parameter and, for damaged bytes, the block;
the command exits 1 when there is any.

A version-1 checkpoint (no checksums) gets everything but the block comparison, and says so.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from megatron_ucp.universal import check_universal
from megatron_ucp.universal import UniversalCheckpoint, UniversalFormatError

SHOWN = 20  # problems listed in the text report (--json lists all)


def default_workers() -> int:
    return max(2, min(8, os.cpu_count() or 1))


def check(path, workers: int = 0) -> dict:
    """The check of the universal checkpoint at `path`, as a JSON-safe dict ("ok", "problems", counts)."""
    from megatron_ucp.commands.common import universal_problems

    ucp = UniversalCheckpoint.open(path, validate=False)  # the marker, metadata.json's sha256 and every entry
    report = check_universal(ucp.path, ucp.metadata, workers=workers or default_workers())
    problems = [f.message for f in report.failures]
    known = {f.path for f in report.failures}
    # missing / resized files are already in the report; add what only metadata and the model tell
    problems += [p for p in universal_problems(ucp) if p.split(": ", 1)[0] not in known]
    problems += _rng_problems(ucp)
    seconds = report.seconds
    # what the source's release saved wrongly and what the conversion did about it (recorded by to-universal)
    notes = list(report.notes) + [f"source: {n}" for n in (ucp.metadata.get("source") or {}).get("notices") or []]
    return {"path": str(Path(ucp.path).resolve()), "format_version": ucp.version, "lazy": ucp.lazy_source is not None,
            "ok": not problems, "files": report.files, "blocks": report.blocks, "bytes": report.bytes,
            "seconds": round(seconds, 3), "gib_per_s": round(report.bytes / 2 ** 30 / seconds, 2) if seconds else None,
            "checks": list(report.checks), "notes": notes, "problems": problems,
            "failures": [f.to_json() for f in report.failures]}


def _rng_problems(ucp: UniversalCheckpoint) -> list:
    """The RNG-state file (docs/FORMAT.md "RNG states") against its recorded sha256, and parsed."""
    try:
        ucp.rng_states()
    except UniversalFormatError as e:
        return [str(e)]
    return []


def format_report(result: dict) -> str:
    what = "source regions of the lazy checkpoint" if result["lazy"] else "tensor files"
    speed = f", {result['gib_per_s']} GiB/s" if result.get("gib_per_s") else ""
    head = (f"{result['path']}: {result['files']} {what}, {result['bytes'] / 2 ** 20:.1f} MiB in "
            f"{result['blocks']} blocks checked in {result['seconds']:.2f} s{speed}")
    lines = [head] + [f"note: {n}" for n in result["notes"]]
    problems = result["problems"]
    if not problems:
        return "\n".join(lines + ["ok: every block matches its checksum, every value is finite; sizes, headers and "
                                  "parameters agree with metadata.json"])
    lines += [f"{len(problems)} problem(s):"] + [f"  {p}" for p in problems[:SHOWN]]
    if len(problems) > SHOWN:
        lines.append(f"  ... {len(problems) - SHOWN} more (--json lists all)")
    return "\n".join(lines)


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "check", parents=[common], help="verify every byte of a universal checkpoint against its checksums",
        description="Read every block of a universal checkpoint's tensor files (or of the source regions a lazy "
                    "checkpoint reads) and compare it with the checksums recorded while writing; also file "
                    "sizes, safetensors headers, and the parameters of the model. Exit status 1 names every "
                    "damaged file, parameter and block.")
    p.add_argument("path", help="universal checkpoint directory")
    p.add_argument("--workers", type=int, default=0,
                   help=f"reading threads (default: min(8, CPUs), at least 2 = {default_workers()})")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    if args.workers < 0:
        raise UniversalFormatError(f"--workers {args.workers}: use 1 or more (0: the default)")
    result = check(args.path, args.workers)
    result["message"] = format_report(result)
    if not result["ok"]:
        result["exit_code"] = 1
    return result
