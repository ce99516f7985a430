"""Timings of formats/safe_pickle.py against today's torch paths (not a test; run by hand):

    PYTHONPATH=. OMP_NUM_THREADS=1 python tests/bench_safe_pickle.py ITER_DIR [ITER_DIR ...]

Per legacy/common .pt file: load_archive vs stored.meta_load (torch.load on the meta device). Per torch_dist
folder: load_dcp_metadata vs FileSystemReader.read_metadata (plain pickle.load); per .distcp tensor item:
load_archive vs meta_load and archive_data_record (zip directory only, no unpickling); per bytes item:
load_archive vs load_pickled_bytes. Best of 7 runs each (the machine is shared), then the import times
of safe_pickle (without torch) and of torch / torch.distributed.checkpoint, each in a fresh process.
"""

from __future__ import annotations

import glob
import io
import os
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def best(f, n: int = 7) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def import_seconds(statement: str, lazy_formats: bool) -> float:
    stub = ("import sys, types; pkg = types.ModuleType('megatron_ucp.formats'); "
            f"pkg.__path__ = [{os.path.join(REPO, 'megatron_ucp', 'formats')!r}]; "
            "sys.modules['megatron_ucp.formats'] = pkg\n") if lazy_formats else ""
    code = stub + f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO), check=True)
    return float(out.stdout)


def main(iter_dirs: list[str]) -> None:
    warnings.simplefilter("ignore")
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ucp.formats import safe_pickle as sp
    from megatron_ucp.formats.common import load_pickled_bytes
    from megatron_ucp.formats.stored import archive_data_record, meta_load

    for iter_dir in iter_dirs:
        print(f"== {iter_dir}")
        for path in sorted(glob.glob(f"{iter_dir}/**/*.pt", recursive=True))[:4]:
            ours, torch_meta = best(lambda: sp.load_archive(path, what="x")), best(lambda: meta_load(path))
            print(f"  {os.path.relpath(path, iter_dir)} ({os.path.getsize(path) / 1e6:.1f} MB): load_archive "
                  f"{ours * 1e3:.2f} ms, meta_load {torch_meta * 1e3:.2f} ms")
        if not os.path.exists(f"{iter_dir}/.metadata"):
            continue
        ours = best(lambda: sp.load_dcp_metadata(iter_dir))
        theirs = best(lambda: FileSystemReader(iter_dir).read_metadata())
        print(f"  .metadata: load_dcp_metadata {ours * 1e3:.2f} ms, read_metadata {theirs * 1e3:.2f} ms")
        md = sp.load_dcp_metadata(iter_dir)
        tensors = [(k, v) for k, v in md.storage_data.items()
                   if isinstance(md.state_dict_metadata[k.fqn], sp.DcpTensorMeta)]
        objects = [(k, v) for k, v in md.storage_data.items() if (k, v) not in tensors]

        def each(items, load):
            return lambda: [load(k, v) for k, v in items]

        def torch_bytes(k, v):
            with open(v.path, "rb") as f:
                f.seek(v.offset)
                return load_pickled_bytes(io.BytesIO(f.read(v.length)), what=k.fqn)

        ours = best(each(tensors, lambda k, v: sp.load_archive(v.path, v.offset, v.length, what=k.fqn)))
        torch_meta = best(each(tensors, lambda k, v: meta_load(v.path, v.offset, v.length, allow_megatron=False)))
        record = best(each(tensors, lambda k, v: archive_data_record(v.path, v.offset, v.length)))
        n = len(tensors)
        print(f"  {n} tensor items: load_archive {ours / n * 1e6:.0f} us/item, meta_load {torch_meta / n * 1e6:.0f} "
              f"us/item, archive_data_record {record / n * 1e6:.0f} us/item")
        ours = best(each(objects, lambda k, v: sp.load_archive(v.path, v.offset, v.length, what=k.fqn)))
        theirs = best(each(objects, torch_bytes))
        n = len(objects)
        print(f"  {n} bytes items: load_archive {ours / n * 1e6:.0f} us/item, load_pickled_bytes "
              f"{theirs / n * 1e6:.0f} us/item")
    print(f"import megatron_ucp.formats.safe_pickle (no torch): "
          f"{import_seconds('import megatron_ucp.formats.safe_pickle', True) * 1e3:.1f} ms")
    print(f"import torch: {import_seconds('import torch', False):.2f} s; import torch.distributed.checkpoint: "
          f"{import_seconds('import torch.distributed.checkpoint', False):.2f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
