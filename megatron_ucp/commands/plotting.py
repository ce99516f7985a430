"""Loss-curve plots (as in the Universal Checkpointing paper's figures): curves overlaid, resume marked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional


def read_jsonl_losses(path: str | Path) -> Dict[int, float]:
    """{iteration: lm_loss} from a pretrain_gpt.py --log-jsonl file."""
    losses = {}
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            losses[int(record["iteration"])] = float(record["lm_loss"])
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path}:{line_no}: not a --log-jsonl record ({e})") from None
    return losses


def plot_loss_curves(curves: Mapping[str, Mapping[int, float]], path: str | Path,
                     resume_at: Optional[int] = None, title: str = "lm loss") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    styles = ["-", "--", ":", "-."]
    for i, (label, losses) in enumerate(curves.items()):
        its = sorted(losses)
        ax.plot(its, [losses[k] for k in its], styles[i % len(styles)], marker="o" if len(its) < 40 else None,
                markersize=3, label=label, linewidth=1.6)
    if resume_at is not None:
        ax.axvline(resume_at, color="grey", linewidth=1, linestyle="--")
        ax.annotate("resume", (resume_at, ax.get_ylim()[1]), textcoords="offset points", xytext=(4, -12),
                    color="grey")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
