"""`make demo`: the whole story on CPU, in a few minutes.

1. Train a tiny Llama-like GPT at TP2 x PP2 with Megatron-LM's own training loop (pretrain_scripts/pretrain_gpt.py,
   megatron-core 0.19.2) on the embedded corpus, saving a Megatron torch_dist checkpoint half way.
2. Convert that checkpoint to a universal checkpoint.
3. Resume from it at TP1 x PP1 (one process) and at DP4 (four processes), with the full optimizer state.
4. Print the three loss curves side by side and plot them to demo_output/loss.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

_ITERATION_LINE = re.compile(r"iteration\s+\d+/\s*\d+ \|")
REPO = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("MEGATRON_UCP_DEMO_DIR", REPO / "demo_output"))
ITERS, SAVE_AT = 30, 15
MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
         "--max-position-embeddings 64 "
         "--disable-bias-linear --seq-length 64 --micro-batch-size 2 --global-batch-size 16 "
         "--lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 --lr-decay-style cosine --attention-dropout 0.0 "
         "--hidden-dropout 0.0 --seed 1234 --log-interval 1 --use-distributed-optimizer --eval-iters 0 "
         "--eval-interval 1000 --num-workers 0 "
         # the embedded corpus: bytes as tokens, EOD 256; padded to 512 rows at TP1 and TP2 alike
         "--tokenizer-type NullTokenizer --vocab-size 257 --make-vocab-size-divisible-by 256").split()


def torchrun(nproc: int, layout: list, extra: list, log_name: str) -> dict:
    jsonl = OUT / f"{log_name}.jsonl"
    jsonl.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(REPO / "pretrain_scripts" / "pretrain_gpt.py"), *MODEL, *layout, "--train-iters", str(ITERS),
           "--log-jsonl", str(jsonl), "--data-cache-path", str(OUT / "data-cache"), *extra]
    print(f"\n$ torchrun --nproc-per-node {nproc} pretrain_gpt.py {' '.join(layout + extra)}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        log = []
        for line in p.stdout:
            log.append(line)
            if _ITERATION_LINE.search(line) or "Error" in line or line.startswith(" > "):
                print(line.rstrip(), flush=True)
        if p.wait(timeout=900) != 0:
            (OUT / f"{log_name}.log").write_text("".join(log))
            raise SystemExit(f"demo: training failed; full log in {OUT / (log_name + '.log')}")
    (OUT / f"{log_name}.log").write_text("".join(log))
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, jsonl.read_text().splitlines())}


def main() -> None:
    started = time.time()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    ckpt, ucp = OUT / "ckpt_tp2pp2", OUT / f"universal_iter{SAVE_AT}"

    print(f"== 1. train at TP2 PP2 (4 processes, CPU/gloo) on the embedded corpus, saving at iteration {SAVE_AT}")
    base = torchrun(4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                        "--sequence-parallel"], ["--save", str(ckpt), "--save-interval", str(SAVE_AT)], "tp2pp2")

    print(f"\n== 2. convert iteration {SAVE_AT} to a universal checkpoint")
    from megatron_ucp.convert import to_universal
    t = time.time()
    to_universal(ckpt, ucp, iteration=SAVE_AT)
    print(f" > {ucp} ({time.time() - t:.1f} s)")

    print("\n== 3. resume the universal checkpoint at other layouts")
    tp1 = torchrun(1, [], ["--load", str(ucp), "--universal-checkpoint"], "tp1pp1")
    dp4 = torchrun(4, [], ["--load", str(ucp), "--universal-checkpoint"], "tp1pp1dp4")

    print(f"\n== 4. loss curves (resumed at iteration {SAVE_AT})")
    print(f"{'iter':>5} {'TP2PP2 (orig)':>14} {'TP1PP1':>12} {'TP1PP1DP4':>12} {'max rel diff':>13}")
    worst = 0.0
    for i in range(1, ITERS + 1):
        row = f"{i:5d} {base[i]:14.6f}"
        if i > SAVE_AT:
            rel = max(abs(tp1[i] - base[i]), abs(dp4[i] - base[i])) / base[i]
            worst = max(worst, rel)
            row += f" {tp1[i]:12.6f} {dp4[i]:12.6f} {rel:13.2e}"
        print(row)
    print(f"\nworst relative difference after the resume: {worst:.2e}")
    plot(base, {"resumed at TP1PP1": tp1, "resumed at TP1PP1DP4": dp4}, OUT / "loss.png")
    print(f"plot: {OUT / 'loss.png'}   total {time.time() - started:.0f} s")


def plot(base: dict, resumed: dict, path: Path) -> None:
    try:
        from megatron_ucp.commands.plotting import plot_loss_curves
    except ImportError:
        print("(matplotlib not installed: skipping the plot)")
        return
    plot_loss_curves({"TP2PP2 (original)": base, **resumed}, path, resume_at=SAVE_AT)


if __name__ == "__main__":
    main()
