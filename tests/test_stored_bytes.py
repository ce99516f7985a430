"""Byte-level conversion (io/byteio.py, universal.write_tensor_file_placed): consolidating TP
shards by copying their bytes file to file must give exactly pattern.consolidate's tensor.

Synthetic shards (random fp32 written to files, some split over two files so a shard spans regions)
for every pattern kind at TP 1, 2 and 4; compared bitwise (torch.equal). The written safetensors
files are read back with safetensors' own reader and have safetensors' own data layout.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save, save_file

from megatron_ucp.convert import placement_for
from megatron_ucp.io import byteio as stored_mod
from megatron_ucp.io.byteio import (
    FileHandles, FileRegion, StoredTensor, box_bytes, concat_stored, read_stored, regions_equal, write_placement)
from megatron_ucp.core.patterns import FusedSubParams, GroupedQKV, Replicated, Sharded, VocabSharded
from megatron_ucp.universal import safetensors_header, write_tensor_file_placed

CASES = [
    ("column", Sharded(0), (16, 6)),
    ("row", Sharded(1), (6, 16)),
    ("bias", Sharded(0), (16,)),
    ("vocab", VocabSharded(), (32, 4)),
    ("swiglu", FusedSubParams(0, (1, 1)), (16, 5)),
    ("qkv_gqa", GroupedQKV(num_query_groups=4, heads_per_group=2, head_dim=2), (32, 3)),
    ("replicated", Replicated(), (7,)),
]


def _store(tmp_path, name: str, tensor: torch.Tensor, split: bool) -> StoredTensor:
    """Write `tensor`'s bytes after a 37-byte prefix (unaligned on purpose); with split, its second half
    goes to another file, so the shard spans two regions."""
    data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    cut = len(data) // 2 if split else len(data)
    regions = []
    for i, part in enumerate((data[:cut], data[cut:])):
        if not part:
            continue
        path = tmp_path / f"{name}.{i}.bin"
        path.write_bytes(b"x" * 37 + part)
        regions.append(FileRegion(str(path), 37, len(part)))
    return StoredTensor(tuple(tensor.shape), tensor.dtype, tuple(regions))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("label,pattern,shape", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("split", [False, True], ids=["one_region", "two_regions"])
def test_placement_equals_consolidate(tmp_path, label, pattern, shape, tp, split):
    gen = torch.Generator().manual_seed(tp)
    full = torch.randn(shape, generator=gen)
    shards = [pattern.slice_for_rank(full, r, tp) for r in range(tp)]
    expected = pattern.consolidate(shards)
    assert torch.equal(expected, full)
    stored = [_store(tmp_path, f"s{r}", s, split) for r, s in enumerate(shards)]
    placement = placement_for(pattern, tuple(shape), stored)
    out = tmp_path / "out.bin"
    offset = 24  # the data of a tensor starts after a header in the real files
    with FileHandles() as files:
        fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            os.ftruncate(fd, offset + full.numel() * 4)
            write_placement(files, fd, offset, placement)
        finally:
            os.close(fd)
        got = read_stored(files, StoredTensor(tuple(shape), torch.float32,
                                              (FileRegion(str(out), offset, full.numel() * 4),)))
        assert torch.equal(got, expected), (label, tp)
        contiguous = placement.regions()
        if pattern.dim in (None, 0):  # dim-0 layouts are plain runs of the shards' bytes
            written = [FileRegion(str(out), offset, full.numel() * 4)]
            assert contiguous is not None and regions_equal(files, contiguous, written)
        else:
            assert contiguous is None or tp == 1


def test_box_bytes():
    assert box_bytes((4, 6), (1, 0), (2, 6), 4) == (24, 48)  # whole rows
    assert box_bytes((4, 6), (2, 3), (1, 2), 4) == (60, 8)  # part of one row
    assert box_bytes((4, 6), (0, 3), (2, 3), 4) is None  # the right half of two rows
    assert box_bytes((1, 4, 6), (0, 2, 0), (1, 2, 6), 2) == (24, 24)  # leading layer axis
    assert box_bytes((10,), (3,), (4,), 4) == (12, 16)


def test_concat_and_byte_slice(tmp_path):
    a = StoredTensor((2,), torch.float32, (FileRegion("f", 0, 8),))
    b = StoredTensor((3,), torch.float32, (FileRegion("f", 8, 12), FileRegion("g", 0, 4)))
    c = concat_stored([a, b], (6,))
    assert c.regions == (FileRegion("f", 0, 20), FileRegion("g", 0, 4))  # adjacent runs merged
    assert c.byte_slice(16, 24) == [FileRegion("f", 16, 4), FileRegion("g", 0, 4)]
    with pytest.raises(ValueError):
        concat_stored([a, b], (5,))


def test_regions_equal_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(stored_mod, "COMPARE_BYTES", 7)  # many pieces, boundaries inside regions
    data = bytes(range(200))
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(b"zz" + data[:90] + b"q" + data[90:])
    a = [FileRegion(str(tmp_path / "a"), 0, 200)]
    b = [FileRegion(str(tmp_path / "b"), 2, 90), FileRegion(str(tmp_path / "b"), 93, 110)]
    with FileHandles() as files:
        assert regions_equal(files, a, b)
        assert not regions_equal(files, a, [FileRegion(str(tmp_path / "b"), 2, 200)])  # the 'q' differs
        assert not regions_equal(files, a, a[:0])


def test_copy_falls_back_without_copy_file_range(tmp_path, monkeypatch):
    """Another filesystem (EXDEV) or an old kernel: the same bytes through pread/pwrite."""
    monkeypatch.setattr(stored_mod, "_NO_COPY_FILE_RANGE", threading.Event())

    def refuse(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    full = torch.randn(8, 3)
    stored = [_store(tmp_path, f"s{r}", s, split=True) for r, s in enumerate(full.chunk(2))]
    placement = placement_for(Sharded(0), (8, 3), stored)
    with FileHandles() as files:
        fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
        try:
            os.ftruncate(fd, full.numel() * 4)
            write_placement(files, fd, 0, placement)
        finally:
            os.close(fd)
        got = read_stored(files, StoredTensor((8, 3), torch.float32, (FileRegion(str(tmp_path / "out"), 0, 96),)))
    assert torch.equal(got, full)
    assert stored_mod._NO_COPY_FILE_RANGE.is_set()


def test_truncated_source_is_an_error(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\0" * 10)
    with FileHandles() as files, pytest.raises(stored_mod.StorageError, match="truncated"):
        read_stored(files, StoredTensor((4,), torch.float32, (FileRegion(str(path), 0, 16),)))


def test_header_matches_safetensors_layout():
    shapes = {"fp32": (3, 5), "exp_avg": (3, 5), "exp_avg_sq": (3, 5)}
    meta = {"format": "megatron-ucp-universal", "name": "a.b", "version": "1"}
    prefix, offsets = safetensors_header(shapes, meta)
    assert len(prefix) % 8 == 0
    ours = json.loads(prefix[8:])
    theirs_bytes = save({k: torch.zeros(s) for k, s in shapes.items()}, metadata=meta)
    n = struct.unpack("<Q", theirs_bytes[:8])[0]
    theirs = json.loads(theirs_bytes[8:8 + n])
    assert ours == theirs  # same tensors, shapes, data offsets and metadata
    assert n == len(prefix) - 8  # same padded header size, so the same data start
    assert offsets == {k: len(prefix) + v["data_offsets"][0] for k, v in ours.items() if k != "__metadata__"}


def test_placed_file_reads_back_with_safetensors(tmp_path):
    full = {k: torch.randn(6, 4) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    placements = {}
    for key, t in full.items():
        shards = [_store(tmp_path, f"{key}{r}", s, split=False) for r, s in enumerate(t.chunk(2, dim=1))]
        placements[key] = placement_for(Sharded(1), (6, 4), shards)
    info = {"pattern": Sharded(1), "step": 3, "model_dtype": torch.bfloat16, "param_group": {"index": 0}}
    with FileHandles() as files:
        entry = write_tensor_file_placed(tmp_path / "stage", "decoder.layers.0.mlp.linear_fc2.weight",
                                         placements, info, files)
    assert entry["tensors"] == ["fp32", "exp_avg", "exp_avg_sq"] and entry["shape"] == [6, 4]
    assert entry["model_dtype"] == "bfloat16" and entry["step"] == 3
    path = tmp_path / "stage" / entry["file"]
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "megatron-ucp-universal", "name": "decoder.layers.0.mlp.linear_fc2.weight",
                                "version": "2"}
        for key, t in full.items():
            assert torch.equal(f.get_tensor(key), t), key
    reference = tmp_path / "reference.safetensors"
    save_file(full, str(reference), metadata={
        "format": "megatron-ucp-universal", "name": "decoder.layers.0.mlp.linear_fc2.weight", "version": "2"})
    assert path.stat().st_size == reference.stat().st_size  # same layout, same size


def test_truncated_shard_is_an_error_not_a_crash(tmp_path):
    """Strided placements and comparisons map the shards: a file cut short must raise (a mapping past
    the end of a file would kill the process with SIGBUS)."""
    full = torch.randn(4, 6)
    stored = [_store(tmp_path, f"s{r}", s, split=False) for r, s in enumerate(full.chunk(2, dim=1))]
    path = stored[1].regions[0].path
    os.truncate(path, os.path.getsize(path) - 4)
    placement = placement_for(Sharded(1), (4, 6), stored)
    with FileHandles() as files:
        fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
        try:
            os.ftruncate(fd, full.numel() * 4)
            with pytest.raises(stored_mod.StorageError, match="truncated"):
                write_placement(files, fd, 0, placement)
        finally:
            os.close(fd)
        with pytest.raises(stored_mod.StorageError, match="truncated"):
            regions_equal(files, stored[0].regions, [FileRegion(path, 37, stored[0].nbytes)])
