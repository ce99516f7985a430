"""`megatron-ucp plot-loss`: overlay the loss curves of pretrain_gpt.py --log-jsonl files, resume marked."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_ucp.commands.plotting import plot_loss_curves, read_jsonl_losses


class PlotError(ValueError):
    """Inputs or output that cannot be plotted as asked; the message names the file and the fix."""


def plot_loss(logs: list, output, *, labels=None, resume_at=None, title: str = "lm loss",
              overwrite: bool = False) -> dict:
    logs = [Path(p) for p in logs]
    output = Path(output)
    if labels is not None and len(labels) != len(logs):
        raise PlotError(f"--labels gives {len(labels)} labels for {len(logs)} log files; give one label per file")
    if output.exists() and not overwrite:
        raise PlotError(f"{output}: already exists; choose another -o or pass --overwrite")
    if output.suffix.lower() not in (".png", ".pdf", ".svg", ".jpg", ".jpeg"):
        raise PlotError(f"{output}: unknown image type {output.suffix!r}; use .png, .pdf or .svg")
    curves = {}
    for i, path in enumerate(logs):
        if not path.is_file():
            raise PlotError(f"{path}: no such file; pass the files written by pretrain_gpt.py --log-jsonl")
        losses = read_jsonl_losses(path)  # ValueError names the file and line
        if not losses:
            raise PlotError(f"{path}: holds no iterations; was the run logged with --log-jsonl?")
        label = labels[i] if labels else path.stem
        if label in curves:
            label = f"{label} ({i + 1})"
        curves[label] = losses
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("plot-loss needs matplotlib: pip install 'megatron-ucp[plot]'") from None
    plot_loss_curves(curves, output, resume_at=resume_at, title=title)
    summary = {label: {"first_iteration": min(c), "last_iteration": max(c), "final_loss": c[max(c)]}
               for label, c in curves.items()}
    return {"path": str(output), "curves": summary, "resume_at": resume_at}


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "plot-loss", parents=[common], help="plot loss curves of --log-jsonl files, resume point marked",
        description="Overlay the lm-loss curves of pretrain_gpt.py --log-jsonl files in one image.")
    p.add_argument("logs", nargs="+", help="JSON-lines logs (pretrain_gpt.py --log-jsonl)")
    p.add_argument("-o", "--output", required=True, help="image to write (.png, .pdf or .svg)")
    p.add_argument("--resume-at", type=int, default=None, help="iteration to mark as the resume point")
    p.add_argument("--labels", nargs="+", default=None, help="one legend label per log (default: file names)")
    p.add_argument("--title", default="lm loss")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output image")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    result = plot_loss(args.logs, args.output, labels=args.labels, resume_at=args.resume_at, title=args.title,
                       overwrite=args.overwrite)
    result["message"] = f"wrote {result['path']} ({len(result['curves'])} curves" + (
        f", resume at iteration {args.resume_at})" if args.resume_at is not None else ")")
    return result
