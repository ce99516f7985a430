"""What block checksums and durable publication cost: the numbers behind megatron_ucp/io/integrity.py's
choices (hash, block size) and io/staging.py's fsync.

    .venv/bin/python benchmarks/bench_integrity.py [--gib 1] [--dir /tmp/bench_integrity] [--output r.json]

Measures, on `--gib` GiB (default 1):
- hash throughput of XXH3-128 (xxhash) and blake3 on in-memory data, 1 and 2 threads, and whether each
  releases the GIL (a pure-Python counter thread's speed while another thread hashes);
- copy_file_range of a file alone vs copy_and_hash (the same copy, each 64 MiB hashed from the source
  through mmap), page cache cold (both files evicted with posix_fadvise DONTNEED) and warm;
- the band path: 8 MiB pwrites alone vs pwrite_hashed (BlockHasher fed each band);
- converter-like writes (header, a copy_file_range tensor, a banded row-parallel tensor per file, 2
  threads): byteio.write_placement without and with a BlockHasher (what the converter does), records
  checked against a second pass over the files;
- verified reads of a 4096x4096 fp32 tensor (64 MiB) in a safetensors file: a row slice (512 rows: TP 8), a
  data-parallel piece (64 rows) and a column slice (512 columns: every row), plain safetensors get_slice
  vs verified_pread of the covering blocks, 1 MiB and 4 MiB blocks;
- fsync: writing 32 files of gib/32 without fsync, with fsync of each file as it closes (2 threads), and
  with staging.fsync_tree at the end;
- check_files over the copy, 1 and 2 workers, cold and warm;
- metadata.json bytes of block records for 7B and 70B-parameter models with Adam state.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from megatron_ucp.io import integrity  # noqa: E402
from megatron_ucp.io.byteio import FileHandles, FileRegion, copy_and_hash, copy_region  # noqa: E402
from megatron_ucp.io.staging import fsync_tree  # noqa: E402

MiB = 1 << 20


def evict(*paths) -> None:
    """Drop the files' pages from the page cache (written back first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def timed(fn, prepare=None, repeat: int = 5) -> tuple[float, float]:
    """(min wall seconds, min CPU seconds of this process, user + system, all threads) of `repeat` runs.
    CPU time is what the work costs; wall time also shows other processes' load on a shared machine."""
    walls, cpus = [], []
    for _ in range(repeat):
        if prepare is not None:
            prepare()
        w, c = time.perf_counter(), time.process_time()
        fn()
        cpus.append(time.process_time() - c)
        walls.append(time.perf_counter() - w)
    return min(walls), min(cpus)


def bench_hashes(nbytes: int) -> dict:
    import xxhash

    data = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    blocks = [data[i:i + integrity.BLOCK_SIZE] for i in range(0, nbytes, integrity.BLOCK_SIZE)]
    fns = {"xxh3-128": xxhash.xxh3_128_digest}
    try:  # the alternative considered; not a dependency (pip install blake3 to compare)
        import blake3
        fns["blake3"] = lambda b: blake3.blake3(b).digest()
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        for threads in (1, 2):
            def run():
                if threads == 1:
                    for b in blocks:
                        fn(b)
                    return
                with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda part: [fn(b) for b in part], [blocks[k::threads] for k in range(threads)]))
            out[f"{name} GiB/s, {threads} thread(s)"] = round(nbytes / best(run) / 2**30, 2)
        # GIL: count in a Python thread while the main thread hashes 256 MiB pieces
        piece = data[:min(nbytes, 256 * MiB)]
        stop, count = False, [0]

        def spin():
            while not stop:
                count[0] += 1
        th = threading.Thread(target=spin)
        th.start()
        time.sleep(0.3)  # reference: the counter alone
        alone = count[0] / 0.3
        count[0] = 0
        t0 = time.perf_counter()
        for _ in range(4):
            fn(piece)
        busy = count[0] / (time.perf_counter() - t0)
        stop = True
        th.join()
        out[f"{name}: python thread speed while hashing, vs alone"] = round(busy / alone, 2)
    return out


def bench_copy(src: Path, dst: Path, nbytes: int) -> dict:
    out = {}
    region = FileRegion(str(src), 0, nbytes)

    def copy(hashed: bool):
        fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, nbytes)
            with FileHandles() as files:
                if hashed:
                    hasher = integrity.BlockHasher(nbytes, name=str(dst))
                    copy_and_hash(files, region, fd, 0, hasher)
                    hasher.record()
                else:
                    copy_region(files, region, fd, 0)
        finally:
            os.close(fd)

    for cache in ("cold", "warm"):
        def prepare():
            if dst.exists():
                evict(dst)
                dst.unlink()
            if cache == "cold":
                evict(src)
            else:
                integrity.hash_file(src)  # source in the page cache
        for hashed in (False, True):
            wall, cpu = timed(lambda: copy(hashed), prepare)
            tag = "copy_file_range" + (" + hash" if hashed else "")
            out[f"{tag}, {cache} cache: wall s"] = round(wall, 3)
            out[f"{tag}, {cache} cache: CPU s"] = round(cpu, 3)
        for what in ("wall", "CPU"):
            out[f"copy+hash / copy, {cache} cache, {what}"] = round(
                out[f"copy_file_range + hash, {cache} cache: {what} s"] / out[f"copy_file_range, {cache} cache: {what} s"], 3)
    return out


def bench_bands(dst: Path, nbytes: int) -> dict:
    """Bands of distinct memory (as the converter's assembled bands), unaligned to blocks by a header."""
    bands = [np.random.default_rng(k).integers(0, 256, 8 * MiB, dtype=np.uint8) for k in range(16)]
    out = {}
    for hashed in (False, True):
        def run():
            fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                hasher = integrity.BlockHasher(nbytes + 24, name="bands") if hashed else None
                integrity.pwrite_hashed(fd, b"h" * 24, 0, hasher)  # an unaligned header first
                for i, pos in enumerate(range(0, nbytes, 8 * MiB)):
                    integrity.pwrite_hashed(fd, bands[i % 16][:min(8 * MiB, nbytes - pos)], 24 + pos, hasher)
                if hasher:
                    hasher.record()
            finally:
                os.close(fd)
        wall, cpu = timed(run)
        tag = "8 MiB band pwrites" + (" + hash" if hashed else "")
        out[f"{tag}: wall s"], out[f"{tag}: CPU s"] = round(wall, 3), round(cpu, 3)
    for what in ("wall", "CPU"):
        out[f"bands hashed / plain, {what}"] = round(
            out[f"8 MiB band pwrites + hash: {what} s"] / out[f"8 MiB band pwrites: {what} s"], 3)
    return out


def bench_converter_like(workdir: Path, nbytes: int) -> dict:
    """One tensor file per "parameter" written as the converter writes it: header pwrite, then a dim-0
    (column-parallel) tensor copied from 2 TP shards with copy_file_range, and a dim-1 (row-parallel)
    tensor assembled from 2 shards in 8 MiB bands; 2 threads over 8 files. Without checksums
    (byteio.write_placement without a hasher) vs with (a BlockHasher)."""
    import torch
    from megatron_ucp.io.byteio import Placement, StoredTensor, write_placement
    from megatron_ucp.core.patterns import Block

    per_tensor = nbytes // 16  # 8 files x 2 tensors
    rows, cols = per_tensor // (4096 * 4), 4096
    shard_bytes = per_tensor // 2
    source = workdir / "shards.bin"
    with open(source, "wb") as f:
        for _ in range(4):
            f.write(np.random.default_rng(5).integers(0, 256, shard_bytes, dtype=np.uint8).tobytes())
    def shard(i, shape):
        return StoredTensor(shape, torch.float32, (FileRegion(str(source), i * shard_bytes, shard_bytes),))
    col = Placement((rows, cols), torch.float32, (shard(0, (rows // 2, cols)), shard(1, (rows // 2, cols))),
                    (Block(0, (slice(0, rows // 2), slice(0, cols)), (slice(0, rows // 2), slice(0, cols))),
                     Block(1, (slice(rows // 2, rows), slice(0, cols)), (slice(0, rows // 2), slice(0, cols)))))
    row = Placement((rows, cols), torch.float32, (shard(2, (rows, cols // 2)), shard(3, (rows, cols // 2))),
                    (Block(0, (slice(0, rows), slice(0, cols // 2)), (slice(0, rows), slice(0, cols // 2))),
                     Block(1, (slice(0, rows), slice(cols // 2, cols)), (slice(0, rows), slice(0, cols // 2)))))
    header = b"{" + b" " * 87 + b"}"
    prefix = len(header).to_bytes(8, "little") + header
    size = len(prefix) + 2 * per_tensor
    out_dir = workdir / "conv"

    def one(i: int, hashed: bool):
        path = out_dir / f"p{i}.safetensors"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            hasher = integrity.BlockHasher(size, name=str(path)) if hashed else None
            with FileHandles() as files:
                integrity.pwrite_hashed(fd, prefix, 0, hasher)
                write_placement(files, fd, len(prefix), col, hasher)  # hasher None: no checksums
                write_placement(files, fd, len(prefix) + per_tensor, row, hasher)
            return hasher.record() if hashed else None
        finally:
            os.close(fd)

    def prepare():
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir()

    out = {}
    records = {}
    for hashed in (False, True):
        def run():
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                records.update(enumerate(pool.map(lambda i: one(i, hashed), range(8))))
        wall, cpu = timed(run, prepare, repeat=3)
        tag = "converter-like writes" + (" + checksums" if hashed else "")
        out[f"{tag}: wall s"], out[f"{tag}: CPU s"] = round(wall, 3), round(cpu, 3)
    assert all(records[i] == integrity.hash_file(out_dir / f"p{i}.safetensors") for i in range(8))
    for what in ("wall", "CPU"):
        out[f"with / without checksums, {what}"] = round(
            out[f"converter-like writes + checksums: {what} s"] / out[f"converter-like writes: {what} s"], 3)
    shutil.rmtree(out_dir)
    source.unlink()
    return out


def bench_slices(workdir: Path) -> dict:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = workdir / "w.safetensors"
    save_file({"fp32": torch.randn(4096, 4096)}, str(path))
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    row = 4096 * 4
    cases = {"row slice (512 rows, TP 8)": (slice(0, 512), slice(0, 4096)),
             "DP piece (64 rows)": (slice(1000, 1064), slice(0, 4096)),
             "column slice (512 columns)": (slice(0, 4096), slice(512, 1024))}
    out = {}
    for block in (1 * MiB, 4 * MiB):
        record = integrity.hash_file(path, block)
        fd = os.open(path, os.O_RDONLY)
        try:
            for name, (rows, cols) in cases.items():
                r0, r1 = rows.start, rows.stop

                def plain():
                    with safe_open(str(path), "pt") as f:
                        return f.get_slice("fp32")[rows, cols].clone()

                def by_pread():
                    view = integrity.verified_pread(fd, header + r0 * row, (r1 - r0) * row, record,
                                                    path=str(path), label="w's tensor file")
                    return torch.frombuffer(view, dtype=torch.float32).view(r1 - r0, 4096)[:, cols].clone()

                def by_view():
                    with integrity.verified_view(fd, header + r0 * row, (r1 - r0) * row, record,
                                                 path=str(path), label="w's tensor file") as view:
                        return torch.frombuffer(view, dtype=torch.float32).view(r1 - r0, 4096)[:, cols].clone()

                assert torch.equal(plain(), by_pread()) and torch.equal(plain(), by_view())
                lo, hi = integrity.covering_span(record, header + r0 * row, header + r1 * row)
                result = {"bytes wanted": (r1 - r0) * (cols.stop - cols.start) * 4, "bytes verified": hi - lo}
                for cache in ("warm", "cold"):
                    for label, fn in (("plain", plain), ("verified_pread", by_pread), ("verified_view", by_view)):
                        times = []
                        for _ in range(5):
                            if cache == "cold":
                                evict(path)
                            t = time.perf_counter()
                            fn()
                            times.append(time.perf_counter() - t)
                        result[f"{label} ms, {cache}"] = round(min(times) * 1e3, 2)
                    result[f"verified_view / plain, {cache}"] = round(
                        result[f"verified_view ms, {cache}"] / result[f"plain ms, {cache}"], 2)
                out[f"{name}, {block // MiB} MiB blocks"] = result
        finally:
            os.close(fd)
    return out


def bench_fsync(workdir: Path, nbytes: int) -> dict:
    """32 files written by 2 threads; the three ways to make them durable, alternated, 3 rounds; min and
    median wall seconds (fsync costs wall time, not CPU: the disk writing the data back)."""
    nfiles = 32
    data = np.random.default_rng(2).integers(0, 256, nbytes // nfiles, dtype=np.uint8)
    modes = ("no fsync", "fsync each file at close", "fsync_tree at the end")

    def write(d: Path, i: int, fsync: bool):
        fd = os.open(d / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            integrity.pwrite_hashed(fd, data, 0, None)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    times: dict[str, list[float]] = {m: [] for m in modes}
    d = workdir / "fsync"
    for _ in range(3):
        for mode in modes:
            shutil.rmtree(d, ignore_errors=True)
            os.sync()
            d.mkdir()
            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda i: write(d, i, mode == "fsync each file at close"), range(nfiles)))
            if mode == "fsync_tree at the end":
                fsync_tree(d)
            times[mode].append(time.perf_counter() - t)
    out = {}
    for mode in modes:
        out[f"write {nfiles} files, {mode}: min s"] = round(min(times[mode]), 3)
        out[f"write {nfiles} files, {mode}: median s"] = round(sorted(times[mode])[1], 3)
    t = time.perf_counter()
    fsync_tree(d)
    out["fsync_tree of already-synced files, s"] = round(time.perf_counter() - t, 4)
    shutil.rmtree(d)
    return out


def bench_check(path: Path, nbytes: int) -> dict:
    record = integrity.hash_file(path)
    entry = integrity.FileCheck(str(path), record, "bench")
    out = {}
    for cache in ("cold", "warm"):
        for workers in (1, 2):
            if cache == "cold":
                evict(path)
            else:
                integrity.check_files([entry], 1)
            t = time.perf_counter()
            report = integrity.check_files([entry], workers)
            assert report.ok
            out[f"check_files GiB/s, {cache}, {workers} worker(s)"] = round(nbytes / (time.perf_counter() - t) / 2**30, 2)
    return out


def metadata_sizes() -> dict:
    out = {}
    per_block = len(json.dumps("0" * 32)) + 2  # quoted hex, comma and space/newline of indent=1
    for params, label in ((7e9, "7B"), (70e9, "70B")):
        tensor_bytes = params * 12  # fp32 + exp_avg + exp_avg_sq
        for block in (1 * MiB, 4 * MiB):
            out[f"{label} model with Adam: metadata bytes, {block // MiB} MiB blocks"] = int(
                math.ceil(tensor_bytes / block) * per_block)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default="/tmp/bench_integrity")
    parser.add_argument("--output")
    parser.add_argument("--steps", default="hash,copy,bands,converter,slices,fsync,check,metadata",
                        help="comma-separated subset to run")
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30)
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    src = workdir / "src.bin"
    with open(src, "wb") as f:
        rng = np.random.default_rng(3)
        for _ in range(0, nbytes, 64 * MiB):
            f.write(rng.integers(0, 256, 64 * MiB, dtype=np.uint8).tobytes())
        f.truncate(nbytes)
    results = {"bytes": nbytes, "cpus": os.cpu_count(), "load average at start": os.getloadavg()[0]}
    for name, fn in (("hash", lambda: bench_hashes(nbytes)),
                     ("copy", lambda: bench_copy(src, workdir / "dst.bin", nbytes)),
                     ("bands", lambda: bench_bands(workdir / "bands.bin", nbytes)),
                     ("converter", lambda: bench_converter_like(workdir, nbytes)),
                     ("slices", lambda: bench_slices(workdir)),
                     ("fsync", lambda: bench_fsync(workdir, nbytes)),
                     ("check", lambda: bench_check(src, nbytes)),
                     ("metadata", metadata_sizes)):
        if name not in args.steps.split(","):
            continue
        results[name] = fn()
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
