"""What reading checkpoints through serialization/safe_pickle.py costs, against torch's own readers, and how fast
the CLI starts now that its metadata-only commands need no torch (not a test; run by hand):

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_safe_pickle.py [ITER_DIR ...] [--startup-runs 5]

Default ITER_DIRs: iteration 8 of the three Megatron-LM fixtures (tests/fixtures/megatron-lm). Per legacy /
common .pt file: load_archive vs torch.load on the meta device (the pickle only). Per torch_dist folder:
load_dcp_metadata vs torch.distributed.checkpoint's FileSystemReader.read_metadata (a plain pickle.load);
per .distcp tensor item and bytes item: load_archive vs torch.load of the item. Best of 7 runs each (the
machine is shared). Then, each in a fresh process: the import times of safe_pickle, torch and
torch.distributed.checkpoint, opening each fixture with formats.open_checkpoint (shards + common state),
and `megatron-ucp --help` / `inspect` / `plan` start to finish (min and median of --startup-runs, wall and
CPU seconds, and whether torch got imported).
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "megatron-lm")


def best(f, n: int = 7) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def in_fresh_process(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO), check=True)
    return out.stdout.strip()


def import_seconds(statement: str) -> float:
    return float(in_fresh_process(f"import time; t = time.perf_counter(); {statement}; "
                                  f"print(time.perf_counter() - t)"))


def parse_timings(iter_dirs: list[str]) -> None:
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ucp.serialization import safe_pickle as sp

    def torch_meta(source):
        return torch.load(source, map_location="meta", weights_only=False)  # trusted fixtures: torch's speed

    for iter_dir in iter_dirs:
        print(f"== {os.path.relpath(iter_dir, REPO)}")
        for path in sorted(glob.glob(f"{iter_dir}/**/*.pt", recursive=True))[:4]:
            ours, theirs = best(lambda: sp.load_archive(path, what="x", family=MEGATRON)), best(lambda: torch_meta(path))
            print(f"  {os.path.relpath(path, iter_dir)} ({os.path.getsize(path) / 1e6:.1f} MB): load_archive "
                  f"{ours * 1e3:.2f} ms, torch.load(meta) {theirs * 1e3:.2f} ms")
        if not os.path.exists(f"{iter_dir}/.metadata"):
            continue
        ours = best(lambda: sp.load_dcp_metadata(iter_dir, MEGATRON))
        theirs = best(lambda: FileSystemReader(iter_dir).read_metadata())
        print(f"  .metadata: load_dcp_metadata {ours * 1e3:.2f} ms, read_metadata {theirs * 1e3:.2f} ms")
        md = sp.load_dcp_metadata(iter_dir, MEGATRON)
        tensors = [(k, v) for k, v in md.storage_data.items()
                   if isinstance(md.state_dict_metadata[k.fqn], sp.DcpTensorMeta)]
        objects = [(k, v) for k, v in md.storage_data.items() if (k, v) not in tensors]

        def each(items, load):
            return lambda: [load(k, v) for k, v in items]

        def torch_item(k, v):
            with open(v.path, "rb") as f:
                f.seek(v.offset)
                return torch_meta(io.BytesIO(f.read(v.length)))

        for label, items in (("tensor", tensors), ("bytes", objects)):
            ours = best(each(items, lambda k, v: sp.load_archive(v.path, v.offset, v.length, what=k.fqn, family=MEGATRON)))
            theirs = best(each(items, torch_item))
            n = len(items)
            print(f"  {n} {label} items: load_archive {ours / n * 1e6:.0f} us/item, torch.load "
                  f"{theirs / n * 1e6:.0f} us/item")


OPEN = r"""
import sys, time
t = time.perf_counter()
from megatron_ucp.formats.pickles import MEGATRON
from megatron_ucp.formats import open_checkpoint
ckpt = open_checkpoint(sys.argv[1])
shards, common = ckpt.shards(), ckpt.common_state()
print(f"{(time.perf_counter() - t) * 1e3:.1f} {len(shards)} {'torch' in sys.modules}")
"""


def startup(runs: int) -> None:
    ours = import_seconds("import megatron_ucp.serialization.safe_pickle")
    print(f"import megatron_ucp.serialization.safe_pickle: {ours * 1e3:.1f} ms; import torch: {import_seconds('import torch'):.2f} s; import torch.distributed.checkpoint: "
          f"{import_seconds('import torch.distributed.checkpoint'):.2f} s")
    for name in sorted(os.listdir(FIXTURES)):
        root = os.path.join(FIXTURES, name, "ckpt")
        if os.path.isdir(root):
            ms, shards, torch_loaded = subprocess.run(
                [sys.executable, "-c", OPEN, root], capture_output=True, text=True, cwd=REPO, check=True,
                env=dict(os.environ, PYTHONPATH=REPO)).stdout.split()
            print(f"open_checkpoint + shards + common_state {name}: {float(ms):.0f} ms ({shards} shards, torch "
                  f"imported: {torch_loaded})")
    a = os.path.join(FIXTURES, "A_llama_tp2pp2dp2_distopt_sp_torch", "ckpt")
    b = os.path.join(FIXTURES, "B_llama_tp2pp2dp2_distopt_sp_torch_dist", "ckpt")
    commands = [["--help"], ["inspect", a], ["inspect", b], ["plan", b, "--tensor-model-parallel-size", "1"]]
    probe = "import runpy, sys; sys.argv = ['megatron-ucp', *sys.argv[1:]]\n" \
            "try:\n    runpy.run_module('megatron_ucp.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n" \
            "sys.stderr.write(f\"\\ntorch imported: {'torch' in sys.modules}\\n\")"
    for args in commands:
        walls, cpus, torch_loaded = [], [], ""
        for _ in range(runs):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            run = subprocess.run([sys.executable, "-c", probe, *args, "--quiet"] if args[0] != "--help" else
                                 [sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=REPO,
                                 env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))
            walls.append(time.perf_counter() - t)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
            torch_loaded = run.stderr.strip().splitlines()[-1]
        label = " ".join(os.path.relpath(a, REPO) if os.path.isabs(a) else a for a in args)
        print(f"megatron-ucp {label}: wall min {min(walls):.2f} s median {statistics.median(walls):.2f} s; CPU min "
              f"{min(cpus):.2f} s median {statistics.median(cpus):.2f} s; {torch_loaded}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("iter_dirs", nargs="*")
    parser.add_argument("--startup-runs", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    sys.path.insert(0, REPO)
    iter_dirs = args.iter_dirs or sorted(glob.glob(os.path.join(FIXTURES, "*", "ckpt", "iter_0000008")))
    parse_timings(iter_dirs)
    startup(args.startup_runs)


if __name__ == "__main__":
    main()
