"""Block checksums of the bytes megatron-ucp writes and reads: computed while writing, checked on every
read, and checkable for a whole checkpoint at disk speed.

A `DigestRecord` covers `size` bytes of one file starting at `offset` (0 for a whole universal tensor
file; a byte region of a source checkpoint file for lazy checkpoints), cut into fixed `block_size`
blocks (the last one shorter), each with its own XXH3-128 digest as 32 hex digits. Its JSON form
(`to_json`) is what docs/FORMAT.md version 2 stores: per parameter entry under `"checksum"`, and for a
lazy checkpoint per source file under `lazy.files[FILE]["checksums"]` (records of the byte regions the
index references, sorted by offset).

Writing (nothing is read back from the output):
- `BlockHasher(size, block_size, offset=...)` takes (file offset, bytes) pieces in any order, pieces
  crossing block boundaries included; a block is hashed as soon as it is fully covered (straight from
  the caller's buffer when one piece covers it, else from a small reassembly buffer). It fits the header
  pwrite, the 8 MiB bands (hash the band before it is reused) and a safetensors file written by pwrite.
- `byteio.copy_and_hash` copies a source region with copy_file_range (`byteio.copy_region`, bytes
  never in user space) in 64 MiB steps and hashes each step's source bytes through mmap right after
  the copy, while they are in the page cache.
- `hash_regions` hashes copied source regions after the fact; `write_file_hashed` writes a file from
  (offset, bytes) pieces, hashing and fsyncing it (the tensor path, instead of safetensors' save_file);
  `hash_file` is the fallback second pass for files written by code that cannot report its writes.
- `digest_regions` hashes the source regions a lazy index references (parallel, through mmap).

Reading:
- `verified_pread(fd, offset, nbytes, record, ...)` reads the covering blocks, checks them and returns
  exactly the requested bytes; `verified_view` does the same through mmap (no buffer filled: the way
  to read large spans); `verify_buffer` checks blocks of a mapping the caller already holds.
  `VerifiedBlocks` remembers blocks already checked by one reader (e.g. the header block).
- `VerifiedTensorFile(path, record, label).read(key, index)` is `safe_open(...).get_slice(key)[index]`
  with every block it touches checked (the universal reader's tensor path).
- `SourceDigests` holds a lazy checkpoint's source checksums; `verify_box_sources(files, placement,
  index, digests)` checks every source byte `byteio.read_box` will read for that box.
- `check_files(entries, workers)` checks every block of many files in parallel (threads: xxhash and
  pread release the GIL), and sizes, and missing files; `check_universal(path, metadata)` applies it to a
  universal checkpoint and also checks each tensor file's safetensors header against metadata.json.
- A failure is a `ChecksumError`, one line: "FILE: block K (bytes a..b) of PARAM's tensor file fails its
  checksum: the file was damaged after it was written; restore it from a copy or reconvert".

Why XXH3-128 (benchmarks/bench_integrity.py on this project's 2-core machine while it was idle, 1 GiB
in memory, 1 MiB blocks): xxhash 4.1's XXH3-128 hashes 28-31 GiB/s on one thread and 34-42 GiB/s on
two; blake3 1.0 hashes 7.3 GiB/s on one thread and 14.3 on two. Both release the GIL (a pure-Python
thread keeps 91-95% of its speed while another thread hashes). The checksums guard against accidental
damage (bit rot, truncated copies, bad RAM or controllers), not against an adversary, so a
cryptographic hash buys nothing here; at ~25 GiB/s hashing adds ~0.05 CPU-seconds per GiB, small next
to a 1-3 GiB/s copy (a converter-like write of 1 GiB: 1.10x CPU, 1.14x wall with checksums), while
blake3 would cost four times that. 128 bits keep the chance that a damaged block goes unnoticed
(2^-128) negligible over millions of blocks. xxhash is a small, widely used C binding (PyPI `xxhash`,
wheels for every platform), maintained since 2014.

Why 1 MiB blocks: the loader reads row slices (one TP rank's rows, or a data-parallel rank's part of
them) and column slices of row-parallel weights (every row, 1/TP of each). A verified read reads whole
blocks, so a row slice reads at most one extra block at each end, and a column slice reads the tensor's
rows it spans whatever the block size. Smaller blocks cut the row-slice overhead, larger ones the
metadata: with 36 bytes of JSON per block, 1 MiB blocks add 2.9 MB to metadata.json for a 7B-parameter
model with Adam state (84 GB of tensors) and 29 MB at 70B; 4 MiB blocks a quarter of that, but a
data-parallel rank's 1 MiB piece of a 4096x4096 fp32 weight then reads 8 MiB instead of 2 MiB (0.7 vs
0.3 ms from the page cache, 7.1 vs 2.4 ms cold). A TP-8 row slice (8 MiB) reads 9 MiB; a column slice
(512 of 4096 columns) reads and hashes all 64 MiB whatever the block size, through verified_view about
as fast as safetensors' own mmap read when cold (30 vs 28 ms), 2x when cached (7.6 vs 3.8 ms).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import mmap
import os
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import xxhash

PathLike = Union[str, os.PathLike]

ALGORITHM = "xxh3-128"
BLOCK_SIZE = 1 << 20
COPY_STEP = 64 << 20  # copy_and_hash: bytes copied, then hashed while still in the page cache
CHECK_READ = 16 << 20  # check_files: bytes read per pread
MAX_HEADER = 100_000_000  # a safetensors header larger than this is refused (safetensors' own limit)
_PAGE = mmap.ALLOCATIONGRANULARITY
_HEX = frozenset("0123456789abcdef")

FILE_REMEDY = "the file was damaged after it was written; restore it from a copy or reconvert"
SOURCE_REMEDY = ("the source checkpoint was damaged after the lazy conversion; restore it from a copy, or "
                 "convert a good copy again")


NON_FINITE_REMEDY = ("the run diverged before it was saved, or its bytes were damaged before they were "
                     "checksummed; resume from an earlier checkpoint")
_STATE_WORDS = {"fp32": "weight"}  # universal tensor keys as the user says them (exp_avg, exp_avg_sq as they are)


def state_word(key: str) -> str:
    """A universal tensor key as messages name it: 'fp32' is the weight."""
    return _STATE_WORDS.get(key, key)


def non_finite(values) -> tuple[int, int]:
    """(how many, flat index of the first) NaN or +-Inf values among float32 `values` (a float32 array, or
    bytes-like of whole float32 elements); (0, -1) when every value is finite. One vectorised pass, meant for
    bytes a caller has just hashed, copied or mapped (still in cache): no extra read of the data. numpy is
    imported here, on first use: checking bytes and metadata imports neither it nor torch."""
    import numpy as np

    a = values if isinstance(values, np.ndarray) else np.frombuffer(values, dtype=np.float32)
    finite = np.isfinite(a)
    if finite.all():
        return 0, -1
    bad = np.flatnonzero(~finite)
    return int(bad.size), int(bad[0])


def block_digest(data) -> str:
    """XXH3-128 of one block as 32 lowercase hex digits (xxhash's canonical, big-endian form)."""
    return xxhash.xxh3_128_hexdigest(data)


# --------------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class DigestRecord:
    """Digests of bytes [offset, offset + size) of one file in blocks of `block_size` (last one shorter)."""

    algorithm: str
    block_size: int
    size: int
    blocks: tuple[str, ...]
    offset: int = 0

    @property
    def stop(self) -> int:
        return self.offset + self.size

    def block_span(self, k: int) -> tuple[int, int]:
        """File offsets [start, stop) of block k."""
        start = self.offset + k * self.block_size
        return start, min(start + self.block_size, self.stop)

    def blocks_covering(self, start: int, stop: int) -> range:
        """Indices of the blocks holding file bytes [start, stop) (which must lie inside the record)."""
        if not self.offset <= start <= stop <= self.stop:
            raise ValueError(f"bytes {start}..{stop} are outside the checksummed bytes {self.offset}..{self.stop}")
        if start == stop:
            return range(0)
        return range((start - self.offset) // self.block_size, (stop - 1 - self.offset) // self.block_size + 1)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"algorithm": self.algorithm, "block_size": self.block_size, "size": self.size}
        if self.offset:
            d["offset"] = self.offset
        d["blocks"] = list(self.blocks)
        return d

    @staticmethod
    def from_json(d: Any, where: str = "checksum") -> "DigestRecord":
        """Parse and validate; ValueError (one line, naming `where`) when malformed or of an unknown algorithm."""
        try:
            record = DigestRecord(str(d["algorithm"]), int(d["block_size"]), int(d["size"]),
                                  tuple(str(b) for b in d["blocks"]), int(d.get("offset", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: malformed checksum record ({type(e).__name__}: {e})") from None
        if record.algorithm != ALGORITHM:
            raise ValueError(f"{where}: checksum algorithm {record.algorithm!r}, this megatron-ucp knows "
                             f"{ALGORITHM!r}; upgrade megatron-ucp")
        if record.block_size <= 0 or record.size < 0 or record.offset < 0:
            raise ValueError(f"{where}: checksum record has block_size {record.block_size}, size {record.size}, "
                             f"offset {record.offset}")
        if len(record.blocks) != math.ceil(record.size / record.block_size):
            raise ValueError(f"{where}: {len(record.blocks)} block digests for {record.size} bytes in blocks of "
                             f"{record.block_size}")
        if any(len(b) != 32 or not set(b) <= _HEX for b in record.blocks):
            raise ValueError(f"{where}: a block digest is not 32 lowercase hex digits")
        return record


class ChecksumError(Exception):
    """Bytes that do not match their recorded digest (or a file of the wrong size / missing)."""

    def __init__(self, message: str, path: str = "", block: Optional[int] = None, start: int = 0, stop: int = 0):
        super().__init__(message)
        self.path, self.block, self.start, self.stop = path, block, start, stop


def _block_error(path, k: int, start: int, stop: int, label: str, remedy: str) -> ChecksumError:
    return ChecksumError(f"{path}: block {k} (bytes {start}..{stop - 1}) of {label} fails its checksum: {remedy}",
                         str(path), k, start, stop)


def remedy_clause(remedy: str) -> str:
    """The "what to do" half of a remedy (for missing or resized files, whose cause is plain)."""
    return remedy.rsplit("; ", 1)[-1]


def tensor_file_label(param: str) -> str:
    """How errors name a universal tensor file: "PARAM's tensor file"."""
    return f"{param}'s tensor file"


# --------------------------------------------------------------------------------------------------
# Writing: digests of bytes as they are written


def _bytes_view(data) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("BlockHasher.update needs a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class BlockHasher:
    """Block digests of `size` bytes at file offset `offset`, fed as (offset, bytes) pieces in any order.

    A block is hashed once fully covered: straight from the piece when one piece covers it, else from a
    reassembly buffer holding only blocks partly covered so far (at most ~2 blocks per piece boundary).
    Writing a byte twice is an error (a writer bug), as is asking for the record with bytes missing.
    Thread-safe: pieces of one file may come from several threads; full blocks hash without the lock.
    """

    def __init__(self, size: int, block_size: int = BLOCK_SIZE, *, offset: int = 0, name: str = "file"):
        if size < 0 or block_size <= 0:
            raise ValueError(f"{name}: size {size}, block size {block_size}")
        self.size, self.block_size, self.offset, self.name = int(size), int(block_size), int(offset), name
        self._digests: list[Optional[str]] = [None] * math.ceil(self.size / self.block_size)
        self._claimed: set[int] = set()  # whole blocks being hashed outside the lock
        self._partial: dict[int, tuple[bytearray, list[list[int]]]] = {}  # k -> (bytes, covered intervals)
        self._lock = threading.Lock()

    def _block_len(self, k: int) -> int:
        return min(self.block_size, self.size - k * self.block_size)

    def update(self, pos: int, data) -> None:
        """Bytes `data` were (or will be) written at file offset `pos`."""
        view = _bytes_view(data)
        rel, n = pos - self.offset, len(view)
        if rel < 0 or rel + n > self.size:
            raise ValueError(f"{self.name}: bytes {pos}..{pos + n} lie outside {self.offset}..{self.offset + self.size}")
        whole: list[tuple[int, memoryview]] = []
        done: list[tuple[int, bytes]] = []
        with self._lock:
            i = 0
            while i < n:
                k = (rel + i) // self.block_size
                lo = rel + i - k * self.block_size
                length = self._block_len(k)
                take = min(n - i, length - lo)
                if self._digests[k] is not None or k in self._claimed:
                    self._twice(k, lo, lo + take)
                if lo == 0 and take == length and k not in self._partial:
                    self._claimed.add(k)
                    whole.append((k, view[i:i + take]))
                else:
                    buf, covered = self._partial.setdefault(k, (bytearray(length), []))
                    _add_interval(covered, lo, lo + take, lambda: self._twice(k, lo, lo + take))
                    buf[lo:lo + take] = view[i:i + take]
                    if covered == [[0, length]]:
                        del self._partial[k]
                        self._claimed.add(k)
                        done.append((k, buf))
                i += take
        digests = [(k, self._digest(k, b)) for k, b in whole + done]
        with self._lock:
            for k, d in digests:
                self._digests[k] = d
                self._claimed.discard(k)

    def _digest(self, k: int, block) -> str:
        """Block k's digest, from its complete bytes (a subclass may look at them too: FiniteBlockHasher)."""
        return block_digest(block)

    def _twice(self, k: int, lo: int, hi: int):
        start = self.offset + k * self.block_size
        raise ValueError(f"{self.name}: bytes {start + lo}..{start + hi - 1} written twice; each byte of a "
                         f"checksummed file is written once")

    def missing(self) -> list[tuple[int, int]]:
        """File byte ranges [start, stop) not yet given to update()."""
        out = []
        with self._lock:
            for k, d in enumerate(self._digests):
                if d is not None or k in self._claimed:
                    continue
                start, length = self.offset + k * self.block_size, self._block_len(k)
                pos = 0
                for lo, hi in (self._partial[k][1] if k in self._partial else []):
                    if lo > pos:
                        out.append((start + pos, start + lo))
                    pos = hi
                if pos < length:
                    out.append((start + pos, start + length))
        merged: list[tuple[int, int]] = []
        for a, b in out:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        return merged

    def record(self) -> DigestRecord:
        """The finished record; ValueError naming the first byte range never written."""
        gaps = self.missing()
        if gaps:
            raise ValueError(f"{self.name}: bytes {gaps[0][0]}..{gaps[0][1] - 1} were never written "
                             f"({len(gaps)} gap(s)); the file is incomplete")
        return DigestRecord(ALGORITHM, self.block_size, self.size, tuple(self._digests), self.offset)


class FiniteBlockHasher(BlockHasher):
    """A BlockHasher that also counts NaN/Inf among the float32 values of `regions` ({key: (start, stop)} file
    offsets, 4-byte aligned: a tensor file's tensors) in each block as it hashes it: no extra pass over the
    data. `non_finite` holds {key: count} of the keys that have any."""

    def __init__(self, size: int, regions: Mapping[str, tuple[int, int]], block_size: int = BLOCK_SIZE, *,
                 name: str = "file"):
        if block_size % 4 or any(a % 4 or b % 4 for a, b in regions.values()):
            raise ValueError(f"{name}: float32 regions {dict(regions)} or block size {block_size} not 4-byte aligned")
        super().__init__(size, block_size, name=name)
        self.regions = dict(regions)
        self.non_finite: dict[str, int] = {}

    def _digest(self, k: int, block) -> str:
        start = self.offset + k * self.block_size
        view = _bytes_view(block)
        for key, (a, b) in self.regions.items():
            lo, hi = max(a, start), min(b, start + len(view))
            if lo < hi:
                count, _ = non_finite(view[lo - start:hi - start])
                if count:
                    with self._lock:
                        self.non_finite[key] = self.non_finite.get(key, 0) + count
        return block_digest(block)


def _add_interval(covered: list[list[int]], lo: int, hi: int, on_overlap: Callable) -> None:
    """Insert [lo, hi) into sorted disjoint intervals, merging touching ones; on_overlap() if they overlap."""
    for a, b in covered:
        if lo < b and a < hi:
            on_overlap()
    covered.append([lo, hi])
    covered.sort()
    merged = [covered[0]]
    for a, b in covered[1:]:
        if a == merged[-1][1]:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    covered[:] = merged


def pwrite_hashed(fd: int, data, pos: int, hasher: Optional[BlockHasher]) -> None:
    """pwrite all of `data` at `pos` (retrying short writes), then give it to `hasher` (header, bands,
    tensor bytes of a safetensors file written without save_file)."""
    view = _bytes_view(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], pos + done)
    if hasher is not None:
        hasher.update(pos, view)


class _Mapped:
    """Bytes [offset, offset + nbytes) of an open file, mapped (a memoryview in `.view`). The mapping is
    private and writable (copy-on-write; nothing writes), so torch.frombuffer accepts it without warning."""

    def __init__(self, fd: int, offset: int, nbytes: int, *, willneed: bool = True):
        start = offset - offset % _PAGE
        self._mm = mmap.mmap(fd, offset - start + nbytes, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start) if nbytes else None
        if self._mm is not None and willneed:
            self._mm.madvise(mmap.MADV_WILLNEED)
        self.view = memoryview(self._mm)[offset - start:] if self._mm is not None else memoryview(b"")

    def close(self) -> None:
        self.view.release()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still lives (e.g. in a traceback): unmapped when it dies
                pass

    def __enter__(self) -> "_Mapped":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_extent(fd: int, offset: int, nbytes: int, path) -> None:
    size = os.fstat(fd).st_size
    if size < offset + nbytes:  # a mapping past the end faults (SIGBUS): refuse first
        raise ChecksumError(f"{path}: ends at byte {size}, before {offset + nbytes}; the file is truncated, "
                            f"restore it from a copy", str(path))


def hash_source(hasher: BlockHasher, dst_pos: int, src_fd: int, src_offset: int, nbytes: int, *,
                path: PathLike = "source", step: int = COPY_STEP) -> None:
    """Give `hasher` the bytes [src_offset, src_offset + nbytes) of `src_fd` as the output's bytes at
    `dst_pos`, read through mmap `step` bytes at a time (page-cache hits right after a copy)."""
    _check_extent(src_fd, src_offset, nbytes, path)
    done = 0
    while done < nbytes:
        n = min(step, nbytes - done)
        with _Mapped(src_fd, src_offset + done, n) as m:
            hasher.update(dst_pos + done, m.view)
        done += n


def hash_regions(hasher: BlockHasher, files, pieces: Iterable[tuple[Any, int]]) -> None:
    """Give `hasher` source regions copied (or about to be copied) into its file: `pieces` are
    (byteio.FileRegion, destination offset), hashed from the source through mmap. For writers
    that copy first and hash after (copy_and_hash interleaves the two, which keeps the page cache hot
    for regions larger than memory)."""
    for region, dst_pos in pieces:
        hash_source(hasher, dst_pos, files.fd(region.path), region.offset, region.nbytes, path=region.path)


def write_file_hashed(path: PathLike, size: int, pieces: Iterable[tuple[int, Any]], *,
                      block_size: int = BLOCK_SIZE, fsync: bool = True,
                      hasher: Optional[BlockHasher] = None) -> DigestRecord:
    """Create `path` of `size` bytes from (offset, bytes-like) pieces, hashing each as it is written, and
    return its record; fsync before closing (a staging directory is published only once its files are
    durable). The tensor path's replacement for safetensors' save_file: pieces are the header prefix and
    each tensor's bytes (`tensor.contiguous().view(-1).view(torch.uint8).numpy()`) at its offset. `hasher`: the
    BlockHasher of `size` bytes to feed (e.g. a FiniteBlockHasher), instead of a new one of `block_size`."""
    hasher = hasher if hasher is not None else BlockHasher(size, block_size, name=str(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        for offset, data in pieces:
            pwrite_hashed(fd, data, offset, hasher)
        record = hasher.record()
        if fsync:
            os.fsync(fd)
    except OSError as e:
        if e.filename is None:  # name the file (ENOSPC from pwrite names none)
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    finally:
        os.close(fd)
    return record


def hash_file(path: PathLike, block_size: int = BLOCK_SIZE) -> DigestRecord:
    """The record of a whole existing file (for outputs written by code that cannot report its writes,
    e.g. safetensors' save_file: a second pass over the file, from the page cache if just written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        hasher = BlockHasher(size, block_size, name=str(path))
        hash_source(hasher, 0, fd, 0, size, path=path)
        return hasher.record()
    finally:
        os.close(fd)


def merge_regions(regions: Iterable[tuple[str, int, int]]) -> dict[str, list[tuple[int, int]]]:
    """{path: sorted disjoint [start, stop)} of (path, offset, nbytes) regions, overlapping or touching
    ones merged (what a lazy index's checksums cover)."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for path, offset, nbytes in regions:
        if nbytes > 0:
            by_file.setdefault(str(path), []).append((int(offset), int(offset) + int(nbytes)))
    out = {}
    for path, spans in by_file.items():
        spans.sort()
        merged = [list(spans[0])]
        for a, b in spans[1:]:
            if a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out[path] = [(a, b) for a, b in merged]
    return out


def digest_regions(regions: Iterable[tuple[str, int, int]], *, block_size: int = BLOCK_SIZE,
                   workers: int = 4) -> dict[str, list[DigestRecord]]:
    """Records of the source bytes a lazy index references: {path: records sorted by offset}, one per
    merged region, blocks counted from the region's start. Reads each byte once, `workers` threads."""
    spans = merge_regions(regions)

    def one(path: str, start: int, stop: int) -> DigestRecord:
        fd = os.open(path, os.O_RDONLY)
        try:
            hasher = BlockHasher(stop - start, block_size, offset=start, name=path)
            hash_source(hasher, start, fd, start, stop - start, path=path)
            return hasher.record()
        finally:
            os.close(fd)

    jobs = [(p, a, b) for p, s in spans.items() for a, b in s]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs) or 1))) as pool:
        records = list(pool.map(lambda job: one(*job), jobs))
    out: dict[str, list[DigestRecord]] = {}
    for (path, _, _), record in zip(jobs, records):
        out.setdefault(path, []).append(record)
    return out


# --------------------------------------------------------------------------------------------------
# Reading: every block checked before its bytes are used


class VerifiedBlocks:
    """Blocks one reader has already checked, so a block read twice (a header, neighbouring slices) is
    hashed once. Keyed by file identity (device, inode, size, mtime), so a replaced file is checked again."""

    def __init__(self):
        self._done: set = set()
        self._lock = threading.Lock()

    @staticmethod
    def file_key(fd: int) -> tuple:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def has(self, key: tuple, record: DigestRecord, k: int) -> bool:
        with self._lock:
            return (key, record.offset, k) in self._done

    def add(self, key: tuple, record: DigestRecord, k: int) -> None:
        with self._lock:
            self._done.add((key, record.offset, k))


def covering_span(record: DigestRecord, start: int, stop: int) -> tuple[int, int]:
    """File offsets [lo, hi) of the whole blocks holding bytes [start, stop): what to read or map to verify."""
    blocks = record.blocks_covering(start, stop)
    if not blocks:
        return start, start
    return record.block_span(blocks[0])[0], record.block_span(blocks[-1])[1]


def verify_buffer(buf, buf_offset: int, start: int, stop: int, record: DigestRecord, *, path: PathLike,
                  label: str, remedy: str = FILE_REMEDY, cache: Optional[VerifiedBlocks] = None,
                  file_key: Optional[tuple] = None) -> None:
    """Check the blocks holding file bytes [start, stop) against `record`, reading them from `buf`, which
    holds the file's bytes from offset `buf_offset` (e.g. an mmap of the covering_span); ChecksumError on
    the first block that differs."""
    bad = None
    with _bytes_view(buf) as view:  # released before raising: a traceback must not pin a mapping
        for k in record.blocks_covering(start, stop):
            if cache is not None and file_key is not None and cache.has(file_key, record, k):
                continue
            a, b = record.block_span(k)
            if a < buf_offset or b > buf_offset + len(view):
                raise ValueError(f"{path}: block {k} (bytes {a}..{b - 1}) is not inside the buffer given "
                                 f"({buf_offset}..{buf_offset + len(view) - 1}); map covering_span()")
            if block_digest(view[a - buf_offset:b - buf_offset]) != record.blocks[k]:
                bad = (k, a, b)
                break
            if cache is not None and file_key is not None:
                cache.add(file_key, record, k)
    if bad is not None:
        raise _block_error(path, *bad, label, remedy)


def pread_exact(fd: int, nbytes: int, offset: int, path) -> bytearray:
    buf = bytearray(nbytes)
    view, done = memoryview(buf), 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ChecksumError(f"{path}: ends at byte {offset + done}, before {offset + nbytes}; the file is "
                                f"truncated, restore it from a copy", str(path))
        done += n
    return buf


def verified_pread(fd: int, offset: int, nbytes: int, record: DigestRecord, *, path: PathLike, label: str,
                   remedy: str = FILE_REMEDY, cache: Optional[VerifiedBlocks] = None) -> memoryview:
    """Exactly bytes [offset, offset + nbytes) of the open file, after checking every block that holds them
    (one pread of the covering blocks). Returns a writable memoryview (torch.frombuffer takes it)."""
    lo, hi = covering_span(record, offset, offset + nbytes)
    buf = pread_exact(fd, hi - lo, lo, path)
    key = VerifiedBlocks.file_key(fd) if cache is not None else None
    verify_buffer(buf, lo, offset, offset + nbytes, record, path=path, label=label, remedy=remedy,
                  cache=cache, file_key=key)
    return memoryview(buf)[offset - lo:offset - lo + nbytes]


@contextlib.contextmanager
def verified_view(fd: int, offset: int, nbytes: int, record: DigestRecord, *, path: PathLike, label: str,
                  remedy: str = FILE_REMEDY, cache: Optional[VerifiedBlocks] = None) -> Iterator[memoryview]:
    """verified_pread through mmap: maps the covering blocks, checks them in place and yields a view of
    exactly bytes [offset, offset + nbytes), valid inside the with-block (copy out what you keep, e.g.
    `torch.frombuffer(view, dtype=...).view(rows, cols)[:, c0:c1].clone()` for a column slice). No buffer
    is allocated or filled, so large spans cost the hashing only."""
    lo, hi = covering_span(record, offset, offset + nbytes)
    _check_extent(fd, lo, hi - lo, path)
    key = VerifiedBlocks.file_key(fd) if cache is not None else None
    with _Mapped(fd, lo, hi - lo) as m:
        verify_buffer(m.view, lo, offset, offset + nbytes, record, path=path, label=label, remedy=remedy,
                      cache=cache, file_key=key)
        view = m.view[offset - lo:offset - lo + nbytes]
        try:
            yield view
        finally:
            view.release()


class SourceDigests:
    """The checksummed regions of a lazy checkpoint's source files ({path: records}) and the check of a
    byte range of one of them before it is read (byteio.read_box's shards)."""

    def __init__(self, records: Mapping[str, Sequence[DigestRecord]]):
        self._records = {str(p): sorted(r, key=lambda x: x.offset) for p, r in records.items()}
        self._starts = {p: [r.offset for r in rs] for p, rs in self._records.items()}

    def to_json(self, relative_to: Callable[[str], str] = str) -> dict:
        """{relative path: [record JSON, ...]} for metadata.json's lazy.files[...]["checksums"]."""
        return {relative_to(p): [r.to_json() for r in rs] for p, rs in self._records.items()}

    @staticmethod
    def from_json(d: Mapping[str, Any], resolve: Callable[[str], str] = str, where: str = "lazy") -> "SourceDigests":
        return SourceDigests({resolve(p): [DigestRecord.from_json(r, f"{where} {p}") for r in rs]
                              for p, rs in d.items()})

    def pieces(self, path: str, start: int, stop: int) -> list[tuple[DigestRecord, int, int]]:
        """(record, lo, hi): [start, stop) of `path` split over the records holding it; ChecksumError when a
        byte is in no record (the index references bytes it has no checksum for: reconvert)."""
        records, starts = self._records.get(str(path), []), self._starts.get(str(path), [])
        out, pos = [], start
        i = bisect_right(starts, pos) - 1
        while pos < stop:
            if i < 0 or i >= len(records) or not records[i].offset <= pos < records[i].stop:
                raise ChecksumError(f"{path}: bytes {pos}..{stop - 1} are read by the lazy index but have no "
                                    f"checksum; the metadata is inconsistent, convert again", str(path))
            hi = min(stop, records[i].stop)
            out.append((records[i], pos, hi))
            pos, i = hi, i + 1
        return out

    def verify(self, fd: int, path: str, start: int, stop: int, *, label: str, remedy: str = SOURCE_REMEDY,
               cache: Optional[VerifiedBlocks] = None, mapped: Optional[tuple[Any, int]] = None) -> None:
        """Check the blocks holding bytes [start, stop) of the open source file `path`: from `mapped` =
        (buffer, its file offset) when it holds the covering blocks, else by pread."""
        key = VerifiedBlocks.file_key(fd) if cache is not None else None
        for record, lo, hi in self.pieces(path, start, stop):
            a, b = covering_span(record, lo, hi)
            if mapped is not None and mapped[1] <= a and b <= mapped[1] + len(memoryview(mapped[0])):
                verify_buffer(mapped[0], mapped[1], lo, hi, record, path=path, label=label, remedy=remedy,
                              cache=cache, file_key=key)
            else:
                verify_buffer(pread_exact(fd, b - a, a, path), a, lo, hi, record, path=path, label=label,
                              remedy=remedy, cache=cache, file_key=key)


def verify_box_sources(files, placement, index: Optional[Sequence[slice]], digests: SourceDigests, *, label: str,
                       cache: Optional[VerifiedBlocks] = None) -> int:
    """Check, against a lazy checkpoint's source checksums, every source byte that
    byteio.read_box(files, placement, index) will read: for each shard the box overlaps, the
    shard rows it touches (whole rows: a column box reads every row's part of the shard). Call it
    right before read_box (same page-cache pages). Returns the bytes checked."""
    shape = placement.shape
    box = [slice(*s.indices(n)[:2]) for s, n in zip(index or (), shape)]
    box += [slice(0, n) for n in shape[len(box):]]
    rows: dict[int, tuple[int, int]] = {}
    for b in placement.blocks:
        lo = [max(x.start, d.start) for x, d in zip(box, b.dst)]
        hi = [min(x.stop, d.stop) for x, d in zip(box, b.dst)]
        if not all(l < h for l, h in zip(lo, hi)):
            continue
        if not shape:
            rows[b.shard] = (0, 1)
            continue
        s0, s1 = b.src[0].start + lo[0] - b.dst[0].start, b.src[0].start + hi[0] - b.dst[0].start
        old = rows.get(b.shard)
        rows[b.shard] = (s0, s1) if old is None else (min(old[0], s0), max(old[1], s1))
    from megatron_ucp.core.dtypes import itemsize

    checked = 0
    for i, (s0, s1) in sorted(rows.items()):
        shard = placement.shards[i]
        row_bytes = math.prod(shard.shape[1:]) * itemsize(placement.dtype)
        for region in shard.byte_slice(s0 * row_bytes, s1 * row_bytes):
            digests.verify(files.fd(region.path), region.path, region.offset, region.offset + region.nbytes,
                           label=label, cache=cache)
            checked += region.nbytes
    return checked


# --------------------------------------------------------------------------------------------------
# Checking whole files


@dataclass(frozen=True)
class FileCheck:
    """One file (or region of one) to check: every block of `record`; with exact_size the file's size
    must be record.offset + record.size (a whole tensor file), else at least that (a source region)."""

    path: str
    record: DigestRecord
    label: str
    exact_size: bool = True
    remedy: str = FILE_REMEDY
    # float32 data to find NaN/Inf in while its blocks are hashed: (what, start, stop) file byte ranges,
    # `what` naming the tensor ("PARAM exp_avg_sq")
    floats: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class Failure:
    """One problem found: problem is "missing", "size", "checksum", "unreadable", "header", "coverage" or
    "non-finite"."""

    path: str
    problem: str
    message: str
    block: Optional[int] = None
    start: int = 0
    stop: int = 0

    def to_json(self) -> dict:
        d = {"path": self.path, "problem": self.problem, "message": self.message}
        if self.block is not None:
            d.update(block=self.block, start=self.start, stop=self.stop)
        return d


@dataclass(frozen=True)
class CheckReport:
    files: int
    blocks: int
    bytes: int
    seconds: float
    failures: tuple[Failure, ...]
    checks: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        return {"ok": self.ok, "files": self.files, "blocks": self.blocks, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "checks": list(self.checks), "notes": list(self.notes),
                "failures": [f.to_json() for f in self.failures]}

    def raise_for_failures(self) -> None:
        """ChecksumError with the first failure's line (and how many more)."""
        if self.failures:
            more = f" (and {len(self.failures) - 1} more problem(s))" if len(self.failures) > 1 else ""
            first = self.failures[0]
            raise ChecksumError(first.message + more, first.path, first.block, first.start, first.stop)


_READ_BUFFER = threading.local()


def _check_blocks(fd: int, entry: FileCheck, blocks: range, found: list) -> list[Failure]:
    """Check blocks (consecutive) of one file with large preads into a per-thread buffer; each block's part
    of entry.floats is searched for NaN/Inf right after it is hashed (still in cache), findings appended to
    `found` as (what, block, count, first element)."""
    record, failures = entry.record, []
    buf = getattr(_READ_BUFFER, "buf", None)
    step = max(1, CHECK_READ // record.block_size)
    if buf is None or len(buf) < step * record.block_size:
        buf = _READ_BUFFER.buf = bytearray(max(CHECK_READ, step * record.block_size))
    view = memoryview(buf)
    for first in range(blocks.start, blocks.stop, step):
        last = min(blocks.stop, first + step) - 1
        a, b = record.block_span(first)[0], record.block_span(last)[1]
        done = 0
        while done < b - a:
            n = os.preadv(fd, [view[done:b - a]], a + done)
            if n == 0:
                break
            done += n
        for k in range(first, last + 1):
            ka, kb = record.block_span(k)
            if kb - a > done:  # past the end of a short file: reported by the size check
                return failures
            if block_digest(view[ka - a:kb - a]) != record.blocks[k]:
                failures.append(Failure(entry.path, "checksum", str(_block_error(entry.path, k, ka, kb, entry.label,
                                                                                 entry.remedy)), k, ka, kb))
            for what, start, stop in entry.floats:
                _find_non_finite(fd, view, a, ka, kb, what, start, stop, k, found)
    return failures


def _find_non_finite(fd: int, view: memoryview, a: int, ka: int, kb: int, what: str, start: int, stop: int,
                     k: int, found: list) -> None:
    """NaN/Inf among the float32 elements of [start, stop) that end inside block [ka, kb) (`view` holds the
    file from byte `a`); an element a block boundary cuts (data not 4-byte aligned) is read whole by pread."""
    lo, hi = max(ka, start), min(kb, stop)
    if lo >= hi:
        return
    e0, e1 = -(-(lo - start) // 4), (hi - start) // 4  # the elements wholly inside the block
    count, first = non_finite(view[start + 4 * e0 - a:start + 4 * e1 - a]) if e1 > e0 else (0, -1)
    first += e0 if count else 0
    if (lo - start) % 4 and lo > start:  # the element starting before the block and ending in it
        cut = non_finite(os.pread(fd, 4, start + 4 * (e0 - 1)))[0]
        if cut:
            count, first = count + 1, e0 - 1
    if count:
        found.append((what, k, count, first))


def check_files(entries: Iterable[FileCheck], workers: int = 4, *, raise_on_failure: bool = False,
                split_blocks: int = 64) -> CheckReport:
    """Check every block of every entry, `workers` threads (files split in runs of `split_blocks` blocks so
    one large file keeps all threads busy); also missing files and wrong sizes. Returns every failure
    (raise_on_failure: raise the first as ChecksumError instead)."""
    start = time.perf_counter()
    entries = list(entries)
    failures: list[Failure] = []
    jobs: list[tuple[int, FileCheck, range]] = []
    fds: list[int] = []
    found: list = []  # (what, block, count, first element) of non-finite values, from every thread
    try:
        for entry in entries:
            try:
                fd = os.open(entry.path, os.O_RDONLY)
            except FileNotFoundError:
                failures.append(Failure(entry.path, "missing", f"{entry.path}: missing ({entry.label}); "
                                                               f"{remedy_clause(entry.remedy)}"))
                continue
            except OSError as e:
                failures.append(Failure(entry.path, "unreadable", f"{entry.path}: cannot open {entry.label} "
                                                                  f"({e.strerror}); {remedy_clause(entry.remedy)}"))
                continue
            fds.append(fd)
            size, want = os.fstat(fd).st_size, entry.record.stop
            if size < want or (entry.exact_size and size != want):
                failures.append(Failure(entry.path, "size", f"{entry.path}: {size} bytes, {entry.label} was "
                                                            f"written with {want}; {remedy_clause(entry.remedy)}"))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, entry.record.offset, entry.record.size, os.POSIX_FADV_SEQUENTIAL)
            n = len(entry.record.blocks)
            jobs.extend((fd, entry, range(i, min(n, i + split_blocks))) for i in range(0, n, split_blocks))
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for result in pool.map(lambda job: _safe_check(*job, found), jobs):
                failures.extend(result)
    finally:
        for fd in fds:
            os.close(fd)
    failures.extend(_non_finite_failures(entries, found))
    order = {e.path: i for i, e in enumerate(entries)}
    failures.sort(key=lambda f: (order.get(f.path, 0), f.block if f.block is not None else -1))
    report = CheckReport(files=len(entries), blocks=sum(len(e.record.blocks) for e in entries),
                         bytes=sum(e.record.size for e in entries), seconds=time.perf_counter() - start,
                         failures=tuple(failures))
    if raise_on_failure:
        report.raise_for_failures()
    return report


def _non_finite_failures(entries: Sequence[FileCheck], found: list) -> list[Failure]:
    """One failure per tensor holding NaN/Inf: how many, and the first element (C order)."""
    by_what: dict[str, list] = {}
    for what, k, count, first in found:
        by_what.setdefault(what, []).append((k, count, first))
    paths = {what: e.path for e in entries for what, _, _ in e.floats}
    out = []
    for what, hits in by_what.items():
        hits.sort()
        total = sum(count for _, count, _ in hits)
        out.append(Failure(paths[what], "non-finite", f"{paths[what]}: {what} holds {total} non-finite value(s) "
                                                      f"(NaN/Inf), the first at element {hits[0][2]}; "
                                                      f"{NON_FINITE_REMEDY}", hits[0][0]))
    return out


def _safe_check(fd: int, entry: FileCheck, blocks: range, found: list) -> list[Failure]:
    try:
        return _check_blocks(fd, entry, blocks, found)
    except OSError as e:  # an I/O error is damage too (bad sectors)
        return [Failure(entry.path, "unreadable", f"{entry.path}: reading {entry.label} failed ({e.strerror}); "
                                                  f"{entry.remedy}")]

