"""The torch.save archive of one tensor, framed by torch itself but without its data.

A `torch_dist` `.distcp` file is a sequence of items; a tensor item is exactly what `torch.save(tensor, f)`
writes (a zip archive: `archive/data.pkl` (the pickle: `torch._utils._rebuild_tensor_v2` of storage "0"),
`.format_version`, `.storage_alignment`, `byteorder`, `data/0` (the tensor's C-order bytes, starting at
a multiple of 64 bytes from the archive start), `version`, `.data/serialization_id`, then the central
directory and the zip64 end records). Writers that copy tensor bytes file to file need that framing
without materialising the tensor.

`torch.serialization.skip_data()` is torch's own way to get it: torch.save then writes every record
except the storage bytes, over which it seeks (`seek(nbytes, SEEK_CUR)`), and records the data's
CRC-32 as 0 (torch's reader does not check CRC-32s; `torch.load` and DCP read such archives). Saving
an uninitialised `torch.empty` of the right shape into a stream that only records what torch writes
gives the bytes before the data (`head`) and after it (`tail`); the tensor's pages are never touched,
so no memory is used for them. Framing depends only on (shape, dtype): it is cached.

So an archive is `head + <nbytes of tensor data> + tail`, byte for byte what torch.save writes apart
from the data record's CRC-32 (0) and the 40-digit `.data/serialization_id` (a per-save id, logged
by torch's reader only).
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass

import torch


class ArchiveFramingError(RuntimeError):
    """torch.save under skip_data() did not behave as this module expects (a torch version change)."""


@dataclass(frozen=True)
class TensorArchive:
    """torch.save(tensor) framing: `head`, then `nbytes` of tensor data, then `tail`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    head: bytes
    tail: bytes

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def data_offset(self) -> int:
        """Offset of the tensor's first byte from the start of the archive."""
        return len(self.head)

    @property
    def length(self) -> int:
        return len(self.head) + self.nbytes + len(self.tail)


class _FramingRecorder(io.RawIOBase):
    """A write-only stream that keeps what torch.save writes and notes the one skip over the data."""

    def __init__(self):
        super().__init__()
        self.parts: list[bytes] = []
        self.pos = 0
        self.skips: list[tuple[int, int]] = []  # (position, length)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:
        data = bytes(data)
        self.parts.append(data)
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset}.get(whence)
        if target is None or target < self.pos:
            raise ArchiveFramingError(f"torch.save seeked to {offset} (whence {whence}); only forward skips over "
                                      f"tensor data are expected")
        if target > self.pos:
            self.skips.append((self.pos, target - self.pos))
            self.parts.append(None)  # the data's place
        self.pos = target
        return self.pos


@functools.lru_cache(maxsize=4096)
def tensor_archive(shape: tuple[int, ...], dtype: torch.dtype) -> TensorArchive:
    """The framing of torch.save(tensor) for a C-contiguous `dtype` tensor of `shape` (cached)."""
    shape = tuple(int(n) for n in shape)
    recorder = _FramingRecorder()
    placeholder = torch.empty(shape, dtype=dtype)  # never written nor read: skip_data saves no bytes
    with torch.serialization.skip_data():
        torch.save(placeholder, recorder)
    del placeholder
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # an empty storage has no data to skip
        if recorder.skips:
            raise ArchiveFramingError(f"torch.save skipped {recorder.skips} bytes of an empty tensor")
        return TensorArchive(shape, dtype, b"".join(recorder.parts), b"")
    if len(recorder.skips) != 1 or recorder.skips[0][1] != nbytes:
        raise ArchiveFramingError(f"torch.save of a {dtype} tensor of shape {shape} under skip_data skipped "
                                  f"{recorder.skips}, expected one skip of {nbytes} bytes; this torch version "
                                  f"frames archives differently, use the harness route (--via-harness)")
    split = recorder.parts.index(None)
    head, tail = b"".join(recorder.parts[:split]), b"".join(recorder.parts[split + 1:])
    if len(head) % 64:
        raise ArchiveFramingError(f"tensor data would start at byte {len(head)} of its archive, not a multiple "
                                  f"of 64 as torch.save aligns it")
    return TensorArchive(shape, dtype, head, tail)
