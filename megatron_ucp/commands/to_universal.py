"""`megatron-ucp to-universal`: the command line of the conversion."""

from __future__ import annotations

import argparse

from megatron_ucp.commands.common import add_publication_flags
from megatron_ucp.convert.runner import convert, convert_distributed, default_workers
from megatron_ucp.convert.tasks import ConversionError
from megatron_ucp.io.sharded_job import in_torchrun, reports


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "to-universal", parents=[common],
        help="convert a Megatron-LM checkpoint into a universal checkpoint",
        description="Convert a Megatron-LM checkpoint (legacy torch or torch_dist, any TP/PP/DP) into a "
                    "parallelism-independent universal checkpoint (docs/FORMAT.md).")
    p.add_argument("src", help="Megatron-LM checkpoint root (with latest_checkpointed_iteration.txt) or an "
                               "iter_XXXXXXX folder")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to convert (default: the tracker's)")
    p.add_argument("--workers", type=int, default=None,
                   help=f"parallel conversion threads (default: min(4, CPUs) = {default_workers()}); across "
                        f"nodes, run under torchrun")
    p.add_argument("--average-replicas", action="store_true",
                   help="store the mean of replicated copies (TP replicas, tied output layer) instead of "
                        "requiring them to agree bitwise")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="convert tensors holding NaN/Inf as they are (refused by default, naming them; a lazy "
                        "index does not search: `check` does)")
    p.add_argument("--reset-lost-optimizer-state", action="store_true",
                   help="where the source's release saved some optimizer state nowhere (megatron-core 0.15-0.19's "
                        "fully_reshardable with several DDP buckets: docs/VERSIONS.md), reset just those elements "
                        "(Adam moments to zero, named in the notice) instead of refusing the conversion")
    p.add_argument("--weights-only", action="store_true",
                   help="leave the source's optimizer state out (weights, schedule and RNG state only; the resume "
                        "starts the optimizer from zero): the way to another layout for Lion or Muon, whose state "
                        "megatron-ucp does not convert yet")
    add_publication_flags(p, "universal checkpoint", "COMPLETE")
    p.add_argument("--lazy", action="store_true",
                   help="write only an index (metadata.json) of where each consolidated tensor's bytes are in SRC: "
                        "no copy; SRC must stay in place, unchanged, while the result is used")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    if in_torchrun() and args.lazy:
        raise ConversionError("--lazy copies no bytes and takes seconds: run it in one process, not under torchrun")
    if in_torchrun():  # one process per node (or per core) of a torchrun job, sharing the filesystem
        summary = convert_distributed(args.src, args.dst, iteration=args.iteration,
                                      average_replicas=args.average_replicas, progress=not args.quiet,
                                      overwrite=args.overwrite, clean_stale=args.clean_stale,
                                      allow_non_finite=args.allow_non_finite,
                                      reset_lost_optimizer_state=args.reset_lost_optimizer_state,
                          weights_only=args.weights_only)
    else:
        summary = convert(args.src, args.dst, iteration=args.iteration, workers=args.workers,
                          average_replicas=args.average_replicas, progress=not args.quiet,
                          overwrite=args.overwrite, lazy=args.lazy, clean_stale=args.clean_stale,
                          allow_non_finite=args.allow_non_finite,
                          reset_lost_optimizer_state=args.reset_lost_optimizer_state,
                          weights_only=args.weights_only)
    result = summary.to_dict()
    if not reports():
        return result  # rank 0 reports
    result["message"] = (f"wrote {summary.path}: {summary.num_parameters} parameters, "
                         f"{summary.bytes_written / 2 ** 20:.1f} MiB, iteration {summary.iteration} "
                         f"({summary.source_format}), {summary.seconds:.1f} s")
    if summary.lazy:
        result["message"] = (f"wrote lazy {summary.path}: an index of {summary.num_parameters} parameters into "
                             f"{summary.source} (iteration {summary.iteration}, {summary.source_format}), "
                             f"{summary.seconds:.1f} s; keep the source in place and unchanged while you use it")
    result["message"] += "".join(f"\nnotice: {n}" for n in summary.notices)
    return result
