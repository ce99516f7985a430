"""Tensors as byte regions of files, and byte-level I/O on them (format-neutral).

A `StoredTensor` is a tensor whose C-order bytes are the concatenation of file regions; a
`Placement` assembles a consolidated tensor from stored shards block by block (blocks come from the
parameter's pattern, `patterns.Pattern.rank_blocks`). With them the converter never materialises a
tensor: it copies byte ranges file to file with `copy_file_range` (in the kernel, like `cp`; a reflink
where the filesystem has them), assembles row-interleaved outputs (row-parallel weights) in bands from
mmaps of the shards, and compares replicas through bounded mmaps. A lazy universal checkpoint keeps the
same descriptions (`Placement`, as JSON) and reads slices through them (`read_box`).

Readers say where a format's tensors are (`locate`); this module only moves bytes. It imports torch only
inside the functions that make tensors (dtypes are torch dtypes or their names, e.g. "float32"), so
describing, checking and copying bytes needs no torch. Copies into a universal tensor file take a
`integrity.BlockHasher`, which digests the bytes as they are written (docs/FORMAT.md, checksums).
"""

from __future__ import annotations

from collections import OrderedDict
import contextlib
import errno
import mmap
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from megatron_ucp.core.dtypes import bits as bits_dtype
from megatron_ucp.core.dtypes import dtype_name, itemsize, to_torch
from megatron_ucp.io import integrity

if TYPE_CHECKING:  # only for annotations: patterns and torch are imported where tensors are made
    import torch

    from megatron_ucp.core.patterns import Block

CHUNK_BYTES = 4 * 2 ** 20  # bounded buffers for reads and fallback copies
COMPARE_BYTES = 64 * 2 ** 20  # mapped at once per side when comparing
_PAGE = mmap.ALLOCATIONGRANULARITY


class StorageError(ValueError):
    """A file too short for the bytes it should hold (truncated or replaced); the message says which."""


@dataclass(frozen=True)
class FileRegion:
    """`nbytes` bytes of `path` starting at `offset`."""

    path: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class StoredTensor:
    """A tensor whose C-order bytes are the concatenation of `regions`."""

    shape: tuple[int, ...]
    dtype: Any  # a torch.dtype or its name ("float32")
    regions: tuple[FileRegion, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    def byte_slice(self, start: int, stop: int) -> list[FileRegion]:
        """The regions holding bytes [start, stop) of the tensor's C-order data."""
        out, pos = [], 0
        for r in self.regions:
            lo, hi = max(start, pos), min(stop, pos + r.nbytes)
            if lo < hi:
                out.append(FileRegion(r.path, r.offset + lo - pos, hi - lo))
            pos += r.nbytes
            if pos >= stop:
                break
        return out


def concat_stored(parts: Sequence[StoredTensor], shape: Sequence[int]) -> StoredTensor:
    """Flat concatenation of `parts` (same dtype) seen as `shape`; adjacent regions are merged."""
    dtype = parts[0].dtype
    regions: list[FileRegion] = []
    for part in parts:
        if dtype_name(part.dtype) != dtype_name(dtype):
            raise ValueError(f"cannot concatenate {part.dtype} with {dtype}")
        for r in part.regions:
            if regions and regions[-1].path == r.path and regions[-1].offset + regions[-1].nbytes == r.offset:
                regions[-1] = FileRegion(r.path, regions[-1].offset, regions[-1].nbytes + r.nbytes)
            else:
                regions.append(r)
    stored = StoredTensor(tuple(int(s) for s in shape), dtype, tuple(regions))
    if stored.nbytes != _numel(stored.shape) * itemsize(dtype):
        raise ValueError(f"{stored.nbytes} bytes cannot be a {dtype} tensor of shape {tuple(shape)}")
    return stored


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def box_bytes(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
              itemsize: int) -> Optional[tuple[int, int]]:
    """(start, nbytes) of the box `offsets`/`lengths` inside a C-contiguous tensor of `shape`, or None when
    the box is not one contiguous run of bytes (that needs: length-1 dims, then one partial dim, then
    full dims)."""
    shape, offsets, lengths = tuple(shape), tuple(offsets), tuple(lengths)
    k = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
    if any(lengths[i] != shape[i] for i in range(k + 1, len(shape))):
        return None
    start, stride = 0, 1
    for i in reversed(range(len(shape))):
        start += offsets[i] * stride
        stride *= shape[i]
    return start * itemsize, _numel(lengths) * itemsize


# --------------------------------------------------------------------------------------------------
# Moving bytes


class FileHandles:
    """Read-only descriptors of source files, opened once per conversion thread and kept open, at most
    `max_open` of them: the least recently used is closed first. (Unbounded, a writer thread held one per
    tensor file of the universal checkpoint: threads x files, past a 1024-descriptor limit for a 1.3B MoE.)
    An fd is used before the next fd() call of its thread, or mapped (mmap holds its own), so evicting one
    never closes a descriptor in use."""

    def __init__(self, max_open: int = 16):
        self._fds: "OrderedDict[str, int]" = OrderedDict()
        self.max_open = max(2, max_open)

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        while len(self._fds) >= self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise StorageError(f"{path}: cannot open ({e.strerror}); re-copy the checkpoint") from e
        self._fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:  # a thread-local set (UniversalCheckpoint's) goes with its thread, unclosed
        try:
            self.close()
        except OSError:
            pass

    def __enter__(self) -> "FileHandles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_NO_COPY_FILE_RANGE = threading.Event()  # set once the kernel/filesystem refuses copy_file_range
if not hasattr(os, "copy_file_range"):  # not Linux
    _NO_COPY_FILE_RANGE.set()


def copy_region(files: FileHandles, src: FileRegion, dst_fd: int, dst_offset: int) -> None:
    """Copy `src` into the open file `dst_fd` at `dst_offset`: copy_file_range when the kernel allows
    it (no user-space copy), else pread/pwrite in bounded chunks."""
    src_fd, offset, left = files.fd(src.path), src.offset, src.nbytes
    while left and not _NO_COPY_FILE_RANGE.is_set():
        try:
            n = os.copy_file_range(src_fd, dst_fd, left, offset, dst_offset)
        except OSError as e:  # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP: another filesystem or an old kernel
            if e.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
                _NO_COPY_FILE_RANGE.set()
                break
            raise
        if n == 0:
            raise StorageError(f"{src.path}: ends before byte {offset + left}; the file is truncated, "
                                        f"re-copy it")
        offset, dst_offset, left = offset + n, dst_offset + n, left - n
    while left:
        data = os.pread(src_fd, min(left, CHUNK_BYTES), offset)
        if not data:
            raise StorageError(f"{src.path}: ends before byte {offset + left}; the file is truncated, "
                                        f"re-copy it")
        written = os.pwrite(dst_fd, data, dst_offset)
        offset, dst_offset, left = offset + written, dst_offset + written, left - written


def copy_and_hash(files, region, dst_fd: int, dst_pos: int, hasher: Optional[integrity.BlockHasher], *,
                  step: int = integrity.COPY_STEP) -> None:
    """copy_region (copy_file_range: the bytes never enter user space) in `step` pieces, each
    hashed from the source right after it is copied (still in the page cache). `files` is a
    FileHandles, `region` a FileRegion."""
    done = 0
    while done < region.nbytes:
        n = min(step, region.nbytes - done)
        piece = FileRegion(region.path, region.offset + done, n)
        copy_region(files, piece, dst_fd, dst_pos + done)
        if hasher is not None:
            integrity.hash_source(hasher, dst_pos + done, files.fd(region.path), piece.offset, n, path=region.path)
        done += n


def _chunks(files: FileHandles, regions: Sequence[FileRegion], size: int) -> Iterator[bytes]:
    """The regions' bytes, concatenated, in pieces of exactly `size` bytes (the last may be shorter)."""
    pending: list[bytes] = []
    have = 0
    for r in regions:
        fd, offset, left = files.fd(r.path), r.offset, r.nbytes
        while left:
            data = os.pread(fd, min(left, size - have), offset)
            if not data:
                raise StorageError(f"{r.path}: ends before byte {offset + left}; the file is truncated, "
                                            f"re-copy it")
            offset, left = offset + len(data), left - len(data)
            pending.append(data)
            have += len(data)
            if have == size:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending, have = [], 0
    if pending:
        yield b"".join(pending)


def _aligned_segments(a: Sequence[FileRegion], b: Sequence[FileRegion], size: int):
    """Walk two equally long byte sequences in step: (region of a, offset in it, region of b, offset in
    it, length) pieces that each lie inside one region on both sides, at most `size` bytes."""
    ia, ib = iter(a), iter(b)
    ra, rb = next(ia, None), next(ib, None)
    oa = ob = 0
    while ra is not None and rb is not None:
        n = min(ra.nbytes - oa, rb.nbytes - ob, size)
        if n > 0:
            yield ra, oa, rb, ob, n
        oa, ob = oa + n, ob + n
        if oa >= ra.nbytes:
            ra, oa = next(ia, None), 0
        if ob >= rb.nbytes:
            rb, ob = next(ib, None), 0


def regions_equal(files: FileHandles, a: Sequence[FileRegion], b: Sequence[FileRegion]) -> bool:
    """Whether two byte sequences (each a list of regions) are identical: compared through mmaps of at
    most COMPARE_BYTES at a time (no copies; memory bounded)."""
    import numpy

    if sum(r.nbytes for r in a) != sum(r.nbytes for r in b):
        return False
    for ra, oa, rb, ob, n in _aligned_segments(a, b, COMPARE_BYTES):
        with MappedArray(files.fd(ra.path), ra.offset + oa, (n,), "uint8", writable=False, name=ra.path) as x, \
                MappedArray(files.fd(rb.path), rb.offset + ob, (n,), "uint8", writable=False, name=rb.path) as y:
            if not numpy.array_equal(x.array, y.array):
                return False
    return True


def read_stored(files: FileHandles, stored: StoredTensor) -> "torch.Tensor":
    """The tensor as a new CPU tensor (bounded by its own size)."""
    return to_torch(_read_stored_array(files, stored), stored.dtype)


def _read_stored_array(files: FileHandles, stored: StoredTensor):
    """The tensor's bytes as a new numpy array of its shape (elements as unsigned ints of its width)."""
    import numpy

    out = numpy.empty(stored.shape, dtype=bits_dtype(stored.dtype))
    view = memoryview(out.reshape(-1).view(numpy.uint8)) if out.size else memoryview(b"")
    pos = 0
    for piece in _chunks(files, stored.regions, CHUNK_BYTES):
        view[pos:pos + len(piece)] = piece
        pos += len(piece)
    return out


class MappedArray:
    """A numpy array (raw bits, see core.dtypes.bits) over a file region through mmap; `close()` (or the with-block)
    unmaps it."""

    def __init__(self, fd: int, offset: int, shape: Sequence[int], dtype: Any, *, writable: bool,
                 readahead: bool = True, name: str = "a checkpoint file"):
        import numpy

        bits = numpy.dtype(bits_dtype(dtype))
        nbytes = _numel(shape) * bits.itemsize
        start = offset - offset % _PAGE
        self._mm = None
        if nbytes == 0:
            self.array = numpy.empty(tuple(shape), dtype=bits)
            return
        if os.fstat(fd).st_size < offset + nbytes:  # a mapping past the end faults (SIGBUS), check first
            raise StorageError(f"{name}: ends before byte {offset + nbytes}; the file is truncated, re-copy it")
        # Sources are mapped read-only and private; the destination mapping is shared, writes reach the file.
        flags = mmap.MAP_SHARED if writable else mmap.MAP_PRIVATE
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mm = mmap.mmap(fd, offset - start + nbytes, flags=flags, prot=prot, offset=start)
        if not writable and readahead:  # read ahead the whole range now (one request), not fault by fault
            self._mm.madvise(mmap.MADV_WILLNEED)
        self.array = numpy.frombuffer(self._mm, dtype=numpy.uint8, count=nbytes,
                                      offset=offset - start).view(bits).reshape(tuple(shape))

    def close(self) -> None:
        self.array = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still lives (e.g. in a traceback): unmapped when it dies
                pass
            self._mm = None

    def __enter__(self) -> "MappedArray":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# Consolidating bytes


@dataclass(frozen=True)
class Placement:
    """A consolidated tensor of `shape` assembled from stored shards, block by block."""

    shape: tuple[int, ...]
    dtype: Any  # a torch.dtype or its name ("float32")
    shards: tuple[StoredTensor, ...]
    blocks: tuple["Block", ...]

    def regions(self) -> Optional[list[FileRegion]]:
        """The output's bytes as file regions in order, or None when some block is strided."""
        runs = []
        for b in self.blocks:
            span = self._runs(b)
            if span is None:
                return None
            (src_start, nbytes), (dst_start, _) = span
            runs.append((dst_start, self.shards[b.shard].byte_slice(src_start, src_start + nbytes)))
        runs.sort(key=lambda r: r[0])
        return [region for _, regions in runs for region in regions]

    def _runs(self, block: "Block"):
        size = itemsize(self.dtype)
        shard = self.shards[block.shard]
        lengths = [s.stop - s.start for s in block.src]
        src = box_bytes(shard.shape, [s.start for s in block.src], lengths, size)
        dst = box_bytes(self.shape, [s.start for s in block.dst], lengths, size)
        return None if src is None or dst is None else (src, dst)


BAND_BYTES = 8 * 2 ** 20  # rows of a strided output assembled per write
_STAGING = threading.local()  # per-thread reusable band buffer (first-touch page faults paid once)


def _staging(nbytes: int):
    import numpy

    buf = getattr(_STAGING, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _STAGING.buf = numpy.empty(max(nbytes, BAND_BYTES), dtype=numpy.uint8)
    return buf[:nbytes]


def write_placement(files: FileHandles, dst_fd: int, data_offset: int, placement: Placement,
                    hasher: Optional[integrity.BlockHasher] = None) -> None:
    """Write the consolidated tensor at `data_offset` of the open file `dst_fd` (already long enough).

    When every block is one run of bytes in both the shard and the output (dim-0 layouts: column-parallel,
    vocabulary, QKV, SwiGLU, replicated), the runs are copied file to file (copy_region). Otherwise (a
    row-parallel weight: each output row interleaves the TP shards) bands of output rows are assembled in
    a reused buffer from mmaps of the shards and written with one pwrite each.

    With a `hasher` (the output file's BlockHasher) every byte written is digested on the way: a copied
    run from the source right after its copy (copy_and_hash: still in the page cache), a band
    from the buffer before it is reused. Nothing is read back from the output."""
    runs = [placement._runs(b) for b in placement.blocks]
    if all(r is not None for r in runs):
        for block, ((src_start, nbytes), (dst_start, _)) in zip(placement.blocks, runs):
            pos = data_offset + dst_start
            for region in placement.shards[block.shard].byte_slice(src_start, src_start + nbytes):
                if hasher is None:
                    copy_region(files, region, dst_fd, pos)
                else:
                    copy_and_hash(files, region, dst_fd, pos, hasher)
                pos += region.nbytes
        return
    shape = placement.shape
    row_bytes = _numel(shape[1:]) * itemsize(placement.dtype)
    if not shape or row_bytes == 0 or shape[0] == 0:
        return
    band_rows = max(1, BAND_BYTES // row_bytes)
    whole = tuple(slice(0, n) for n in shape[1:])
    with _mapped_shards(files, placement, range(len(placement.shards)), readahead=True) as sources:
        for r0 in range(0, shape[0], band_rows):
            r1 = min(shape[0], r0 + band_rows)
            raw = _staging((r1 - r0) * row_bytes)
            band = raw.view(bits_dtype(placement.dtype)).reshape((r1 - r0,) + tuple(shape[1:]))
            _fill_box(band, (slice(r0, r1),) + whole, placement, sources)
            integrity.pwrite_hashed(dst_fd, memoryview(raw), data_offset + r0 * row_bytes, hasher)


@contextlib.contextmanager
def _mapped_shards(files: FileHandles, placement: Placement, indices, *, readahead: bool):
    """{shard index: tensor} for the given shards: an mmap view of a one-region shard (readahead: ask for
    all of it at once; else only the pages touched are read), a bounded copy of a shard split over saved
    chunks. Unmapped on exit."""
    mapped: list[MappedArray] = []
    sources: dict = {}
    try:
        for i in indices:
            shard = placement.shards[i]
            if len(shard.regions) == 1:
                region = shard.regions[0]
                m = MappedArray(files.fd(region.path), region.offset, shard.shape, shard.dtype, writable=False,
                                readahead=readahead, name=region.path)
                mapped.append(m)
                sources[i] = m.array
            else:
                sources[i] = _read_stored_array(files, shard)
        yield sources
    finally:
        sources.clear()
        for m in mapped:
            m.close()


def _fill_box(out, box: Sequence[slice], placement: Placement, sources: dict,
              first_rows: Optional[dict] = None) -> None:
    """out := the region `box` (one slice per dim) of the consolidated tensor, from the blocks it overlaps.
    `first_rows[i]`: source i holds only the shard's rows from that one on (a band read for this box)."""
    for b in _overlapping(box, placement):
        lo = [max(x.start, d.start) for x, d in zip(box, b.dst)]
        hi = [min(x.stop, d.stop) for x, d in zip(box, b.dst)]
        dst = tuple(slice(l - x.start, h - x.start) for l, h, x in zip(lo, hi, box))
        src = [slice(s.start + l - d.start, s.start + h - d.start) for l, h, d, s in zip(lo, hi, b.dst, b.src)]
        shift = (first_rows or {}).get(b.shard, 0)
        if src and shift:
            src[0] = slice(src[0].start - shift, src[0].stop - shift)
        out[dst] = sources[b.shard][tuple(src)]


def _overlapping(box: Sequence[slice], placement: Placement):
    return [b for b in placement.blocks
            if all(max(x.start, d.start) < min(x.stop, d.stop) for x, d in zip(box, b.dst))]


def _shard_rows(box: Sequence[slice], placement: Placement, shard: int) -> tuple[int, int]:
    """The rows [first, stop) of shard `shard` that the box's blocks read (dim 0 of the shard)."""
    first, stop = None, None
    for b in _overlapping(box, placement):
        if b.shard != shard:
            continue
        lo, hi = max(box[0].start, b.dst[0].start), min(box[0].stop, b.dst[0].stop)
        a, z = b.src[0].start + lo - b.dst[0].start, b.src[0].start + hi - b.dst[0].start
        first, stop = (a, z) if first is None else (min(first, a), max(stop, z))
    return first, stop


def _read_shard_rows(files: FileHandles, shard: StoredTensor, first: int, stop: int):
    """Rows [first, stop) of a shard stored as several regions, read into a new array (those bytes only)."""
    row = _numel(shard.shape[1:]) * itemsize(shard.dtype)
    regions = tuple(shard.byte_slice(first * row, stop * row))
    return _read_stored_array(files, StoredTensor((stop - first, *shard.shape[1:]), shard.dtype, regions))


# --------------------------------------------------------------------------------------------------
# In-place references (lazy universal checkpoints)


def placement_to_json(placement: Placement, root: str) -> dict:
    """The placement as JSON, file paths relative to `root` (the source checkpoint's iteration folder)."""
    def rel(path: str) -> str:
        r = os.path.relpath(path, root)
        if r.startswith(".."):
            raise ValueError(f"{path} is outside {root}")
        return r

    return {
        "shape": list(placement.shape),
        "shards": [{"shape": list(s.shape), "regions": [[rel(r.path), r.offset, r.nbytes] for r in s.regions]}
                   for s in placement.shards],
        "blocks": [[b.shard, [[x.start, x.stop] for x in b.dst], [[x.start, x.stop] for x in b.src]]
                   for b in placement.blocks],
    }


def relative_inside(path: Any) -> str:
    """`path` if it is a plain relative path that stays inside its root (no absolute path, no '..', no
    empty part); ValueError otherwise. Lazy indexes name source files this way, so an edited index
    cannot make a reader follow it out of the source checkpoint."""
    text = str(path)
    parts = text.split("/")
    if not text or text.startswith("/") or "\0" in text or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"file {text!r} is not a plain relative path inside the source checkpoint")
    return text


def placement_from_json(d: dict, root: str) -> Placement:
    """Inverse of placement_to_json (float32 tensors); raises ValueError on malformed input, including a
    file path that would leave `root` (relative_inside)."""
    from megatron_ucp.core.patterns import Block

    shape = tuple(int(n) for n in d["shape"])
    shards = tuple(StoredTensor(tuple(int(n) for n in s["shape"]), "float32",
                                tuple(FileRegion(os.path.join(root, relative_inside(p)), int(o), int(n))
                                      for p, o, n in s["regions"]))
                   for s in d["shards"])
    blocks = tuple(Block(int(i), tuple(slice(int(a), int(b)) for a, b in dst), tuple(slice(int(a), int(b)) for a, b in src))
                   for i, dst, src in d["blocks"])
    if any(n < 0 for n in shape) or any(n < 0 for s in shards for n in s.shape):
        raise ValueError(f"negative dimension in shape {shape}")
    for s in shards:
        if any(r.offset < 0 or r.nbytes < 0 for r in s.regions):
            raise ValueError("negative region offset or size")
        if s.nbytes != _numel(s.shape) * 4:
            raise ValueError(f"shard of shape {s.shape} has {s.nbytes} bytes")
    covered = 0
    for b in blocks:
        if not 0 <= b.shard < len(shards) or len(b.dst) != len(shape) or len(b.src) != len(shards[b.shard].shape):
            raise ValueError(f"block {b} does not fit shape {shape}")
        lengths = [x.stop - x.start for x in b.dst]
        if lengths != [x.stop - x.start for x in b.src] or any(n < 0 for n in lengths) or any(
                x.start < 0 or x.stop > n for x, n in zip(b.dst, shape)) or any(
                x.start < 0 or x.stop > n for x, n in zip(b.src, shards[b.shard].shape)):
            raise ValueError(f"block {b} is out of bounds")
        covered += _numel(lengths)
    if covered != _numel(shape):
        raise ValueError(f"blocks cover {covered} of {_numel(shape)} elements")
    return Placement(shape, "float32", shards, blocks)


def read_box(files: FileHandles, placement: Placement, index: Optional[Sequence[slice]] = None) -> "torch.Tensor":
    """The region `index` (step-1 slices over leading dims; None = all) of the consolidated tensor, read
    from the shards' files: only the shards it overlaps, through mmaps (only the touched pages are read)."""
    return to_torch(read_box_bits(files, placement, index), placement.dtype)


def read_box_bits(files: FileHandles, placement: Placement, index: Optional[Sequence[slice]] = None):
    """read_box as a numpy array of the elements' raw bits (see _bits); no torch."""
    import numpy

    shape = placement.shape
    box = [slice(*s.indices(n)[:2]) for s, n in zip(index or (), shape)]
    box += [slice(0, n) for n in shape[len(box):]]
    out = numpy.empty([max(0, s.stop - s.start) for s in box], dtype=bits_dtype(placement.dtype))
    if not out.size:
        return out
    needed = sorted({b.shard for b in _overlapping(box, placement)})
    # a shard split over saved chunks (several regions) is read for the rows the box needs only: memory and
    # reads are the box's band, not the whole shard (a one-region shard is mapped: only touched pages are read)
    banded = [i for i in needed if len(placement.shards[i].regions) > 1 and placement.shards[i].shape]
    first_rows, bands = {}, {}
    for i in banded:
        first, stop = _shard_rows(box, placement, i)
        first_rows[i], bands[i] = first, _read_shard_rows(files, placement.shards[i], first, stop)
    with _mapped_shards(files, placement, [i for i in needed if i not in bands], readahead=False) as sources:
        sources.update(bands)
        _fill_box(out, box, placement, sources, first_rows)
    return out
