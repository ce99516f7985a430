"""Where tensors' bytes are inside torch.save archives (legacy `*.pt` files; each tensor item of a
`torch_dist` `.distcp` file is one such archive), found without reading tensor data.

Offsets come from torch and the standard library: `torch.load(..., map_location="meta")` reads only
the pickle and tags each storage with `_checkpoint_offset`, the byte offset of its record in the
archive (legacy files); for the many small `.distcp` items, each saved key's first item is checked
that way and every item's record offset is read from its zip directory (`zipfile`).
"""

from __future__ import annotations

import io
import os
import re
import struct
import zipfile
from typing import Optional

import torch

from megatron_ucp.byteio import FileRegion, StoredTensor
from megatron_ucp.formats.common import safe_unpickling




class _FileWindow(io.RawIOBase):
    """Read-only file object over bytes [offset, offset + length) of a file (one DCP item)."""

    def __init__(self, path: str, offset: int, length: int):
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY)
        self._start, self._length, self._pos = offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        data = os.pread(self._fd, n, self._start + self._pos)
        memoryview(buffer)[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def meta_load(path: str, offset: int = 0, length: Optional[int] = None, *, allow_megatron: bool = True):
    """torch.load of the archive at [offset, offset + length) of `path` (default: the whole file) with
    every tensor on the meta device: only the zip directory and the pickle are read. Use `stored_tensor`
    on the result's tensors. allow_megatron=False loads with torch's own allow-list only (a DCP tensor
    item pickles nothing else), which needs no lock, so threads load items in parallel."""
    if length is None:
        source = path
    else:  # unbuffered: torch's zip reader seeks to a few small records; a buffer would read ahead
        source = _FileWindow(path, offset, length)
    try:
        if allow_megatron:
            with safe_unpickling():
                return torch.load(source, map_location="meta", weights_only=True)
        return torch.load(source, map_location="meta", weights_only=True)
    finally:
        if length is not None:
            source.close()


_DATA_RECORD = re.compile(r"[^/]+/data/\d+")


def archive_data_record(path: str, offset: int, length: int) -> Optional[tuple[int, int]]:
    """(file offset, size) of the single data record of the torch.save archive at [offset, offset + length)
    of `path`, read from its zip directory with the standard library (no unpickling: ~40 us); None
    unless there is exactly one stored (uncompressed) record. Which tensor the record holds (dtype,
    shape, strides) is what the caller knows from elsewhere and has checked with meta_load."""
    with _FileWindow(path, offset, length) as window:
        try:
            with zipfile.ZipFile(window) as archive:
                records = [i for i in archive.infolist() if _DATA_RECORD.fullmatch(i.filename)]
        except zipfile.BadZipFile:
            return None
        if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
            return None
        record = records[0]
        header = os.pread(window.fileno(), 30, offset + record.header_offset)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return offset + record.header_offset + 30 + name_len + extra_len, record.file_size


def stored_tensor(path: str, archive_offset: int, meta: torch.Tensor) -> Optional[StoredTensor]:
    """Where the (meta) tensor `meta`, loaded by meta_load from the archive at `archive_offset` of
    `path`, keeps its bytes; None when they are not one C-contiguous run (then read it normally)."""
    record = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if record is None or not meta.is_contiguous():
        return None
    start = archive_offset + int(record) + meta.storage_offset() * meta.element_size()
    nbytes = meta.numel() * meta.element_size()
    return StoredTensor(tuple(meta.shape), meta.dtype, (FileRegion(str(path), start, nbytes),) if nbytes else ())
