"""Pieces of universal tensors as a Megatron writer lays them out: what both Megatron writers stream.

A rank's tensor (a TP shard, a flat DDP buffer, a chunk of one) is a sequence of `Piece`s (elements of a box
of a stored universal tensor, C order) and `Gap`s (zeros). `Sources` is one writer thread's view of the
universal checkpoint: byte regions to copy file to file, and rows read through `UniversalCheckpoint.read`
(every block checked), with rows past the stored vocabulary filled as patterns.resize_vocab re-pads.
`write_piece` puts a piece at a position of an open file (the direct torch_dist writer: copies where it
can); `piece_bands` yields it as bytes band by band (the legacy writer, which frames each storage record
itself and needs its CRC-32). Memory: one band (io/byteio.BAND_BYTES) at a time, whatever the tensor size.
No torch.

Non-finite values: every float32 value a writer takes from the universal checkpoint is searched for NaN/Inf
where it already passes (the checked mapping a cast reads, each step of a stored run right after its
checksums are checked); one is refused (`NonFiniteError`, naming the parameter and the state) unless
`allow_non_finite`. No extra read of the data.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from megatron_ucp.adapters.gpt import pattern_for, tp_size_of
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.serialization.safe_pickle import TorchDType
from megatron_ucp.serialization.torch_save import cast_float32
from megatron_ucp.formats.writer_base import WriteError
from megatron_ucp.io import integrity
from megatron_ucp.io.byteio import BAND_BYTES, FileHandles, FileRegion, copy_region

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim of a universal tensor, target coordinates
_F32 = TorchDType("float32")


class PieceLayoutError(WriteError):
    """A tensor cannot be laid out as pieces of the universal tensors (cause + fix)."""


class NonFiniteError(WriteError):
    """A universal tensor holds NaN or Inf and the write does not allow them (cause + fix)."""


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) (C order) of the box `box` of the universal tensor `state` ('fp32',
    'exp_avg', 'exp_avg_sq') of parameter `name`; rows past the stored vocabulary are re-padding."""

    name: str
    state: str
    box: Box
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Gap:
    """`numel` elements of alignment padding, left as zeros."""

    numel: int


def box_of(block) -> Box:
    return tuple((r.start, r.stop) for r in block.dst)


def box_numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def local_flat_pieces(config: GPTModelConfig, layout: ParallelLayout, name: str, shape: tuple, tp_rank: int,
                      state: str, start: int, stop: int) -> list[Piece]:
    """Elements [start, stop) of the TP rank's shard flattened (C order) as pieces of global boxes. The shard
    is its blocks concatenated along the pattern's dim, i.e. their flattenings concatenated when that dim
    is 0 (or there is one block)."""
    pattern, tp = pattern_for(name, config), tp_size_of(name, layout)
    blocks = pattern.rank_blocks(shape, tp_rank, tp, name=name)
    if len(blocks) > 1 and pattern.dim != 0:
        raise PieceLayoutError(f"{name}: pattern {pattern.to_json()} concatenates {len(blocks)} blocks along dim "
                               f"{pattern.dim}; flat buckets need dim-0 concatenation")
    pieces, pos = [], 0
    for block in blocks:
        box = box_of(block)
        n = box_numel(box)
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            pieces.append(Piece(name, state, box, lo - pos, hi - pos))
        pos += n
    return pieces


class Sources:
    """One writer thread's view of the universal tensors, seen as 2-D (a 1-D tensor is one row): byte regions
    to copy (`UniversalCheckpoint.locate`, cached) and rows read through `UniversalCheckpoint.read`
    (checked). Rows past the stored vocabulary (a target with more padding rows) are filled as
    patterns.resize_vocab re-pads: the mean padding row for weights, zeros for moments."""

    def __init__(self, ucp, config: GPTModelConfig, *, allow_non_finite: bool = False):
        self.ucp, self.config = ucp, config
        self.allow_non_finite = allow_non_finite
        self.files = FileHandles()
        self._located: dict = {}
        self._fill: dict = {}

    def close(self) -> None:
        self.files.close()

    def finite(self, values, name: str, state: str) -> None:
        """Refuse NaN/Inf among float32 `values` of the tensor (an array or bytes-like, in cache) unless allowed."""
        if self.allow_non_finite:
            return
        count, _ = integrity.non_finite(values)
        if count:
            path = self.ucp.path
            raise NonFiniteError(
                f"{path}: {name} {integrity.state_word(state)} holds non-finite values (NaN/Inf), refused; "
                f"`megatron-ucp check {path}` lists every one; {integrity.NON_FINITE_REMEDY}, or pass "
                f"--allow-non-finite to write them as they are")

    def shape2d(self, name: str) -> tuple[int, int]:
        shape = self.ucp.parameters[name].shape
        if len(shape) > 2:
            raise PieceLayoutError(f"{name}: {len(shape)}-D tensors are not laid out by this writer")
        return (1, shape[0]) if len(shape) == 1 else shape

    def region(self, name: str, state: str, start: int, stop: int) -> Optional[FileRegion]:
        """File region of stored elements [start, stop) (flat) of the tensor, or None (read it instead)."""
        if (name, state) not in self._located:
            self._located[(name, state)] = self.ucp.locate(name, state)
        located = self._located[(name, state)]
        if located is None:
            return None
        return FileRegion(located.path, located.offset + 4 * start, 4 * (stop - start))

    def rows(self, name: str, state: str, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """Rows [r0, r1), columns [c0, c1) of the tensor as float32 (r1 - r0, c1 - c0)."""
        rows, _ = self.shape2d(name)
        parts = []
        if r0 < rows:
            top = min(r1, rows)
            if len(self.ucp.parameters[name].shape) == 1:
                parts.append(self.ucp.read(name, state, (slice(c0, c1),), array=True).reshape(1, c1 - c0))
            else:
                parts.append(self.ucp.read(name, state, (slice(r0, top), slice(c0, c1)), array=True))
            self.finite(parts[-1], name, state)
        if r1 > rows:
            parts.append(np.broadcast_to(self.fill_row(name, state)[:, c0:c1], (r1 - max(r0, rows), c1 - c0)))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def cast_rows(self, name: str, state: str, r0: int, r1: int, c0: int, c1: int, lo: int, hi: int,
                  dtype: TorchDType) -> np.ndarray:
        """Elements [lo, hi) (C order) of rows [r0, r1) x columns [c0, c1) of the tensor, cast to `dtype`, as a
        new contiguous array. Stored rows are cast straight from the checked mapping (no copy first)."""
        rows, _ = self.shape2d(name)
        if r1 > rows:  # re-padded vocabulary rows: assembled by rows()
            return cast_float32(self.rows(name, state, r0, r1, c0, c1).reshape(-1)[lo:hi], dtype.name)
        one_d = len(self.ucp.parameters[name].shape) == 1
        index = (slice(c0, c1),) if one_d else (slice(r0, r1), slice(c0, c1))
        with self.ucp.read_view(name, state, index) as block:
            self.finite(block.reshape(-1)[lo:hi] if block.flags.c_contiguous else block, name, state)
            out = cast_out_of(block, lo, hi, dtype)
            del block  # nothing may keep the mapping past the with-block
        return out

    def fill_row(self, name: str, state: str) -> np.ndarray:
        found = self._fill.get((name, state))
        if found is None:
            rows, cols = self.shape2d(name)
            if state != "fp32":
                found = np.zeros((1, cols), dtype=np.float32)
            else:  # the mean of the stored padding rows (all rows if none), in float64
                lo = self.config.vocab_size if rows > self.config.vocab_size else 0
                total = np.zeros(cols, dtype=np.float64)
                step = max(1, BAND_BYTES // (4 * cols))
                for a in range(lo, rows, step):
                    total += self.rows(name, state, a, min(rows, a + step), 0, cols).astype(np.float64).sum(0)
                found = (total / (rows - lo)).astype(np.float32).reshape(1, cols)
            self._fill[(name, state)] = found
        return found


def cast_out_of(block: np.ndarray, lo: int, hi: int, dtype: TorchDType) -> np.ndarray:
    """Elements [lo, hi) (C order) of a 2-D float32 block (a view of a checked mapping) cast to `dtype`, as a
    new array that does not keep the mapping (float32 out of a contiguous block would still be a view)."""
    out = cast_float32(block.reshape(-1)[lo:hi], dtype.name)  # reshape copies a strided block
    return out.copy() if np.may_share_memory(out, block) else out


def row_bands(sources: Sources, piece: Piece) -> Iterator[tuple[int, int, int, int, int]]:
    """The piece's elements band by band (at most BAND_BYTES of whole stored rows each), in order:
    (first row, end row) of the stored tensor, (lo, hi) the band's elements of the piece within the box
    columns of those rows (C order), and the piece element the band starts at."""
    _, cols = sources.shape2d(piece.name)
    r0 = piece.box[0][0] if len(piece.box) == 2 else 0
    c0, c1 = piece.box[-1]
    width = c1 - c0
    band_rows = max(1, BAND_BYTES // (4 * cols))
    e = piece.start
    while e < piece.stop:
        row = e // width
        end_row = min(row + band_rows, -(-piece.stop // width))
        lo, hi = e - row * width, min(piece.stop, end_row * width) - row * width
        yield r0 + row, r0 + end_row, lo, hi, e
        e = row * width + hi


def piece_bands(sources: Sources, piece: Piece, dtype: TorchDType) -> Iterator[np.ndarray]:
    """The piece's elements cast to `dtype` (torch's rounding for bf16/fp16) as contiguous arrays of at most a
    band of rows each, in order."""
    c0, c1 = piece.box[-1]
    for first, end, lo, hi, _ in row_bands(sources, piece):
        yield sources.cast_rows(piece.name, piece.state, first, end, c0, c1, lo, hi, dtype)


@dataclass(frozen=True)
class StoredRun:
    """A piece whose elements are one run of its universal tensor file as stored (float32, no cast): written
    file to file (copy_file_range: the bytes never enter this process), then checked against the universal
    checksums where they lie, in the page cache. torch_save's archive writer takes it as a chunk (`copy_into`)."""

    sources: Sources
    name: str
    region: FileRegion
    state: str = "fp32"

    @property
    def nbytes(self) -> int:
        return self.region.nbytes

    def copy_into(self, fd: int, pos: int, crc: Optional[int] = None) -> Optional[int]:
        """Copy the run to byte `pos` of `fd`, check it; with `crc`, return the CRC-32 continued over it
        (computed on the checked mapping: no copy)."""
        copy_region(self.sources.files, self.region, fd, pos)
        running = crc

        def on_view(view) -> None:  # each checked step of the run, in the page cache
            nonlocal running
            self.sources.finite(view, self.name, self.state)
            if crc is not None:
                running = zlib.crc32(view, running)

        self.sources.ucp.verify_copied(self.name, self.region, on_view=on_view)
        return running


def is_one_run(rows: int, cols: int, piece: Piece, dtype: TorchDType) -> bool:
    """Whether the piece's elements are one run of its stored (rows, cols) tensor, copyable as they lie:
    float32 out, whole rows or part of one row, inside the stored rows."""
    r0 = piece.box[0][0] if len(piece.box) == 2 else 0
    c0, c1 = piece.box[-1]
    width = c1 - c0
    first_row, last_row = piece.start // width, (piece.stop - 1) // width
    return dtype == _F32 and (width == cols or first_row == last_row) and r0 + last_row < rows


def stored_run(sources: Sources, piece: Piece, dtype: TorchDType) -> Optional[StoredRun]:
    """The piece as one stored run, when it is one: float32 out, whole rows or part of one row, inside the
    stored rows, and a universal checkpoint that stores its bytes (not a lazy one)."""
    rows, cols = sources.shape2d(piece.name)
    if is_one_run(rows, cols, piece, dtype):
        r0 = piece.box[0][0] if len(piece.box) == 2 else 0
        c0, c1 = piece.box[-1]
        width = c1 - c0
        start = (r0 + piece.start // width) * cols + c0 + piece.start % width
        region = sources.region(piece.name, piece.state, start, start + piece.numel)
        if region is not None:
            return StoredRun(sources, piece.name, region, piece.state)
    return None


def piece_chunks(sources: Sources, piece: Piece, dtype: TorchDType) -> Iterator:
    """The piece's bytes in order: one StoredRun where it is one, else piece_bands' cast bands."""
    run = stored_run(sources, piece, dtype)
    if run is not None:
        yield run
    else:
        yield from piece_bands(sources, piece, dtype)


def shared_rows_key(shape: tuple, piece: Piece, dtype: TorchDType) -> Optional[tuple]:
    """A key equal for pieces that read the same stored rows band by band in step: TP slices (other columns,
    same rows, same element range, same output dtype) of a 2-D tensor, e.g. a row-parallel weight's shards in
    the TP ranks' files. `write_sharing_rows` writes such pieces together, mapping each band of rows once for
    all of them instead of once per TP rank. None: a piece written on its own (full rows, or one stored run)."""
    if len(shape) != 2 or len(piece.box) != 2:
        return None
    (r0, r1), (c0, c1) = piece.box
    if c1 - c0 >= shape[1] or r1 > shape[0] or is_one_run(shape[0], shape[1], piece, dtype):
        return None  # whole rows, re-padded rows, or a run copied file to file
    return piece.name, piece.state, dtype.name, r0, r1, c1 - c0, piece.start, piece.stop


def write_sharing_rows(sources: Sources, writes: list) -> None:
    """Write pieces of equal shared_rows_key, each `(fd, pos, piece, dtype)` (its elements, cast to dtype, at
    byte pos of the open file fd): every band of their common rows is mapped and checked once, then each
    piece's columns are cast from it and written."""
    _, _, first, _ = writes[0]
    for r0, r1, lo, hi, e in row_bands(sources, first):
        with sources.ucp.read_view(first.name, first.state, (slice(r0, r1),)) as band:
            sources.finite(band, first.name, first.state)
            for fd, pos, piece, dtype in writes:
                a, b = piece.box[1]
                out = cast_out_of(band[:, a:b], lo, hi, dtype)
                integrity.pwrite_hashed(fd, memoryview(out.view(np.uint8)),
                                        pos + (e - piece.start) * dtype.itemsize, None)
                del out
            del band  # nothing may keep the mapping past the with-block


def write_piece(sources: Sources, fd: int, pos: int, piece: Piece, dtype: TorchDType) -> None:
    """Write the piece's elements, cast to `dtype`, at byte `pos` of the open file `fd`."""
    for chunk in piece_chunks(sources, piece, dtype):
        if isinstance(chunk, StoredRun):
            chunk.copy_into(fd, pos)
        else:
            integrity.pwrite_hashed(fd, memoryview(chunk.view(np.uint8)), pos, None)
        pos += chunk.nbytes
