"""megatron_ucp.io.integrity: block digests computed while writing equal a one-pass digest of the result,
and one flipped bit anywhere in a file (header, first block, middle, last partial block) is reported with
its block by check_files and by every verified read covering it, while untouched ranges still read.

Small files with 64 KiB blocks keep it fast; one test uses the default 1 MiB blocks.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading

import numpy as np
import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save, save_file

from megatron_ucp import universal
from megatron_ucp.universal import check_universal
from megatron_ucp.io import integrity
from megatron_ucp.io.byteio import FileHandles, FileRegion, copy_and_hash
from megatron_ucp.io.integrity import (
    BlockHasher, ChecksumError, DigestRecord, FileCheck, SourceDigests, check_files,
    digest_regions, hash_file, pwrite_hashed, verified_pread, verified_view)

BLOCK = 64 << 10
PARAM = "decoder.layers.0.mlp.linear_fc1.weight"
LABEL = f"{PARAM}'s tensor file"


def reference_digests(data: bytes, block: int) -> list[str]:
    """Independent of BlockHasher: xxhash over each block of the whole bytes."""
    return [xxhash.xxh3_128_hexdigest(data[i:i + block]) for i in range(0, len(data), block)]


def flip(path, byte: int, bit: int = 3) -> None:
    with open(path, "r+b") as f:
        f.seek(byte)
        b = f.read(1)[0]
        f.seek(byte)
        f.write(bytes([b ^ (1 << bit)]))


# --------------------------------------------------------------------------------------------------
# Digests while writing


@pytest.mark.parametrize("seed", range(5))
def test_pieces_in_any_order_across_blocks_give_the_one_pass_digest(seed):
    rng = random.Random(seed)
    data = os.urandom(rng.randrange(5 * 1000 + 1, 9 * 1000))
    cuts = sorted(rng.sample(range(1, len(data)), 25))
    pieces = [(a, data[a:b]) for a, b in zip([0] + cuts, cuts + [len(data)])]
    rng.shuffle(pieces)
    hasher = BlockHasher(len(data), 1000, name="f")
    for offset, piece in pieces:
        hasher.update(offset, piece)
    record = hasher.record()
    assert list(record.blocks) == reference_digests(data, 1000)
    assert record.size == len(data) and len(record.blocks) == -(-len(data) // 1000)
    # negative control: a piece placed at the wrong offset gives another digest
    wrong = BlockHasher(len(data), 1000)
    wrong.update(0, data[1:] + data[:1])
    assert list(wrong.record().blocks) != reference_digests(data, 1000)


def test_pieces_from_several_threads_and_a_region_offset():
    data = os.urandom(40 * 1000 + 17)
    hasher = BlockHasher(len(data), 1000, offset=5000, name="region")
    pieces = [(5000 + a, data[a:a + 777]) for a in range(0, len(data), 777)]
    threads = [threading.Thread(target=lambda part=pieces[k::4]: [hasher.update(o, p) for o, p in part])
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    record = hasher.record()
    assert record.offset == 5000 and list(record.blocks) == reference_digests(data, 1000)
    assert record.blocks_covering(5000, 6000) == range(0, 1) and record.blocks_covering(5999, 6001) == range(0, 2)


def test_writing_a_byte_twice_or_missing_one_is_an_error():
    hasher = BlockHasher(3000, 1000, name="f")
    hasher.update(0, b"a" * 1500)
    with pytest.raises(ValueError, match="f: bytes 1499..1508 written twice"):
        hasher.update(1499, b"b" * 10)
    with pytest.raises(ValueError, match="f: bytes 1000..1000 written twice"):
        hasher.update(1000, b"b")
    hasher.update(2000, b"c" * 1000)
    assert hasher.missing() == [(1500, 2000)]
    with pytest.raises(ValueError, match="f: bytes 1500..1999 were never written"):
        hasher.record()
    with pytest.raises(ValueError, match="lie outside 0..3000"):
        hasher.update(2990, b"x" * 20)
    with pytest.raises(ValueError, match="contiguous"):
        hasher.update(1500, np.zeros((10, 10), dtype=np.uint8)[:, ::2])


def test_a_file_written_like_the_converter_gets_the_digest_of_its_bytes(tmp_path):
    """The converter's ways of writing one safetensors file: the header pwritten, one tensor copied from a
    source file with copy_file_range (hashed from the source through mmap), one assembled in bands
    written out of order. The record equals the digest of the finished file, which is byte-identical to
    safetensors' own."""
    torch.manual_seed(0)
    tensors = {"exp_avg": torch.randn(300, 170), "exp_avg_sq": torch.rand(300, 170), "fp32": torch.randn(300, 170)}
    reference = save(tensors, metadata={"name": PARAM})
    n = int.from_bytes(reference[:8], "little")
    header = json.loads(reference[8:8 + n])
    base = 8 + n
    source = tmp_path / "source.bin"  # the "Megatron file": junk around the exp_avg bytes
    a, b = header["exp_avg"]["data_offsets"]
    source.write_bytes(os.urandom(12345) + reference[base + a:base + b] + os.urandom(999))
    out = tmp_path / "out.safetensors"
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    hasher = BlockHasher(len(reference), BLOCK, name=str(out))
    try:
        os.ftruncate(fd, len(reference))
        pwrite_hashed(fd, reference[:base], 0, hasher)
        with FileHandles() as files:
            copy_and_hash(files, FileRegion(str(source), 12345, b - a), fd, base + a, hasher, step=50_000)
        for key in ("fp32", "exp_avg_sq"):  # bands, last first
            a2, b2 = header[key]["data_offsets"]
            bands = [(p, reference[base + p:base + min(p + 30_000, b2)]) for p in range(a2, b2, 30_000)]
            for p, band in reversed(bands):
                pwrite_hashed(fd, band, base + p, hasher)
    finally:
        os.close(fd)
    record = hasher.record()
    assert out.read_bytes() == reference
    assert record == hash_file(out, BLOCK)
    assert list(record.blocks) == reference_digests(reference, BLOCK)
    assert DigestRecord.from_json(json.loads(json.dumps(record.to_json()))) == record


def test_the_tensor_path_writes_safetensors_bytes_by_pwrite_and_hashes_them(tmp_path):
    """write_file_hashed (header prefix + each tensor's bytes at its offset) writes the bytes safetensors'
    save writes, and its record is that of the finished file; hash_regions hashes copied source regions."""
    torch.manual_seed(4)
    tensors = {"exp_avg": torch.randn(70, 33), "fp32": torch.randn(70, 33)}
    reference = save(tensors)
    n = int.from_bytes(reference[:8], "little")
    header = json.loads(reference[8:8 + n])
    pieces = [(0, reference[:8 + n])] + [
        (8 + n + header[k]["data_offsets"][0], tensors[k].contiguous().view(-1).view(torch.uint8).numpy())
        for k in ("fp32", "exp_avg")]
    out = tmp_path / "t.safetensors"
    record = integrity.write_file_hashed(out, len(reference), pieces, block_size=4096)
    assert out.read_bytes() == reference and record == hash_file(out, 4096)
    with pytest.raises(ValueError, match="were never written"):  # a missing tensor is noticed
        integrity.write_file_hashed(tmp_path / "u", len(reference), pieces[:2], block_size=4096)
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 100 + reference)
    hasher = BlockHasher(len(reference), 4096)
    with FileHandles() as files:
        integrity.hash_regions(hasher, files, [(FileRegion(str(src), 100 + 5000, len(reference) - 5000), 5000),
                                               (FileRegion(str(src), 100, 5000), 0)])
    assert hasher.record() == record


def test_record_json_is_validated():
    good = DigestRecord(integrity.ALGORITHM, 1000, 2500, ("0" * 32,) * 3).to_json()
    assert DigestRecord.from_json(good).size == 2500
    for change, message in ((dict(algorithm="md5"), "algorithm 'md5'"), (dict(size=3500), "3 block digests for 3500"),
                            (dict(blocks=["xyz"] * 3), "not 32 lowercase hex"), (dict(block_size=0), "block_size 0")):
        with pytest.raises(ValueError, match=message):
            DigestRecord.from_json({**good, **change}, "p")


# --------------------------------------------------------------------------------------------------
# One flipped bit


@pytest.fixture()
def tensor_file(tmp_path):
    """A safetensors file of ~5.3 blocks of 64 KiB (last one partial) and its record."""
    torch.manual_seed(1)
    tensors = {"exp_avg": torch.randn(200, 142), "exp_avg_sq": torch.rand(200, 142), "fp32": torch.randn(200, 142)}
    path = tmp_path / f"{PARAM}.safetensors"
    save_file(tensors, str(path), metadata={"name": PARAM})
    size = path.stat().st_size
    assert 5 * BLOCK < size < 6 * BLOCK
    return path, hash_file(path, BLOCK), tensors


def _where(path, record):
    header_len = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    return {"header": 20, "first block": header_len + 100, "middle": 2 * BLOCK + BLOCK // 2,
            "last partial block": record.size - 1}


@pytest.mark.parametrize("place", ["header", "first block", "middle", "last partial block"])
def test_one_flipped_bit_is_found_in_its_block_by_every_check(tensor_file, place):
    path, record, tensors = tensor_file
    original = path.read_bytes()
    byte = _where(path, record)[place]
    flip(path, byte)
    k = byte // BLOCK
    start, stop = record.block_span(k)
    expected = (f"{path}: block {k} (bytes {start}..{stop - 1}) of {LABEL} fails its checksum: the file was damaged "
                f"after it was written; restore it from a copy or reconvert")
    # every block of the file
    report = check_files([FileCheck(str(path), record, LABEL)], workers=2)
    assert [(f.problem, f.block, f.start, f.stop, f.message) for f in report.failures] == [
        ("checksum", k, start, stop, expected)]
    with pytest.raises(ChecksumError) as e:
        report.raise_for_failures()
    assert str(e.value) == expected and e.value.block == k
    fd = os.open(path, os.O_RDONLY)
    try:
        # verified reads covering the byte: a 1-byte read, and a read that spans into the next block
        for offset, nbytes in ((byte, 1), (max(0, byte - 10), min(20 + BLOCK, record.size - max(0, byte - 10)))):
            with pytest.raises(ChecksumError) as e:
                verified_pread(fd, offset, nbytes, record, path=str(path), label=LABEL)
            assert str(e.value) == expected
            with pytest.raises(ChecksumError) as e:
                with verified_view(fd, offset, nbytes, record, path=str(path), label=LABEL):
                    pass
            assert str(e.value) == expected
        # untouched blocks still read, exactly the bytes asked for
        other = (k + 2) % len(record.blocks)
        a, b = record.block_span(other)
        lo, hi = a + 7, min(b, a + 5000)
        assert bytes(verified_pread(fd, lo, hi - lo, record, path=str(path), label=LABEL)) == original[lo:hi]
        with verified_view(fd, lo, hi - lo, record, path=str(path), label=LABEL) as view:
            assert bytes(view) == original[lo:hi]
        # negative control: an unverified read returns the damaged byte without a word
        assert os.pread(fd, 1, byte) != original[byte:byte + 1]
    finally:
        os.close(fd)
    if place in ("first block", "middle", "last partial block"):  # and safetensors reads wrong numbers silently
        with safe_open(str(path), "pt") as f:
            damaged = {key: f.get_tensor(key) for key in tensors}
        assert sum(not torch.equal(damaged[key], tensors[key]) for key in tensors) == 1


def test_default_block_size_on_a_multi_block_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"fp32": torch.randn(640, 1024)}, str(path))  # 2.5 MiB: 3 blocks of 1 MiB, the last partial
    record = hash_file(path)
    assert record.block_size == integrity.BLOCK_SIZE == 1 << 20 and len(record.blocks) == 3
    assert check_files([FileCheck(str(path), record, LABEL)]).ok
    flip(path, (1 << 20) + 5)
    assert [f.block for f in check_files([FileCheck(str(path), record, LABEL)]).failures] == [1]


def test_missing_truncated_and_grown_files(tensor_file, tmp_path):
    path, record, _ = tensor_file
    short, long_ = tmp_path / "short", tmp_path / "long"
    data = path.read_bytes()
    short.write_bytes(data[:-BLOCK])
    long_.write_bytes(data + b"\0")
    report = check_files([FileCheck(str(tmp_path / "gone"), record, LABEL), FileCheck(str(short), record, LABEL),
                          FileCheck(str(long_), record, LABEL), FileCheck(str(path), record, LABEL)])
    problems = [(f.path.rsplit("/", 1)[-1], f.problem) for f in report.failures]
    assert problems == [("gone", "missing"), ("short", "size"), ("long", "size")]
    assert report.failures[0].message == f"{tmp_path / 'gone'}: missing ({LABEL}); restore it from a copy or reconvert"
    assert report.failures[1].message == (f"{short}: {len(data) - BLOCK} bytes, {LABEL} was written with {len(data)}; "
                                          f"restore it from a copy or reconvert")
    fd = os.open(short, os.O_RDONLY)
    try:
        with pytest.raises(ChecksumError, match="the file is truncated"):
            verified_pread(fd, record.size - 10, 10, record, path=str(short), label=LABEL)
    finally:
        os.close(fd)


def test_verified_blocks_are_checked_once_per_reader(tensor_file):
    path, record, _ = tensor_file
    cache = integrity.VerifiedBlocks()
    fd = os.open(path, os.O_RDONLY)
    try:
        verified_pread(fd, 0, 8, record, path=str(path), label=LABEL, cache=cache)
        st = path.stat()
        flip(path, 100)  # bit rot after this reader checked block 0: the file's mtime does not change
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        verified_pread(fd, 8, 8, record, path=str(path), label=LABEL, cache=cache)  # cached: not hashed again
        with pytest.raises(ChecksumError):  # a reader without the cache sees it
            verified_pread(fd, 8, 8, record, path=str(path), label=LABEL)
        flip(path, 200)  # a rewrite changes the mtime: the cache no longer vouches for the file
        with pytest.raises(ChecksumError):
            verified_pread(fd, 8, 8, record, path=str(path), label=LABEL, cache=cache)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# Lazy checkpoints: regions of source files


def test_source_regions_are_checksummed_and_checked_before_reading(tmp_path):
    src = tmp_path / "__0_0.distcp"
    data = bytearray(os.urandom(400_000))
    src.write_bytes(data)
    regions = [(str(src), 1000, 150_000), (str(src), 151_000, 50_000), (str(src), 300_000, 70_000)]
    records = digest_regions(regions, block_size=BLOCK, workers=2)
    assert [(r.offset, r.size) for r in records[str(src)]] == [(1000, 200_000), (300_000, 70_000)]  # touching merged
    for r in records[str(src)]:
        assert list(r.blocks) == reference_digests(bytes(data[r.offset:r.stop]), BLOCK)
    digests = SourceDigests.from_json(json.loads(json.dumps(SourceDigests(records).to_json())))
    label = f"a source region read by {PARAM}'s lazy entry"
    fd = os.open(src, os.O_RDONLY)
    try:
        digests.verify(fd, str(src), 150_000, 152_000, label=label)
        with pytest.raises(ChecksumError, match=r"bytes 210000..209999|have no checksum"):
            digests.verify(fd, str(src), 200_500, 210_000, label=label)  # between the regions
        flip(src, 310_000)
        with pytest.raises(ChecksumError) as e:
            digests.verify(fd, str(src), 305_000, 306_000, label=label)
        assert str(e.value) == (f"{src}: block 0 (bytes 300000..365535) of {label} fails its checksum: the source "
                                f"checkpoint was damaged after the lazy conversion; restore it from a copy, or convert "
                                f"a good copy again")
        digests.verify(fd, str(src), 366_000, 369_000, label=label)  # the region's other block is fine
        flip(src, 250_000)  # not referenced by the index: nobody reads it, nobody complains
        digests.verify(fd, str(src), 1000, 200_000, label=label)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# A universal checkpoint as a whole


def _fake_universal(root, *, checksums=True):
    (root / "tensors").mkdir(parents=True)
    params = {}
    for name, shape in ((PARAM, (96, 64)), ("decoder.final_layernorm.weight", (64,))):
        tensors = {"exp_avg": torch.randn(shape), "exp_avg_sq": torch.rand(shape), "fp32": torch.randn(shape)}
        rel = f"tensors/{name}.safetensors"
        save_file(tensors, str(root / rel), metadata={"name": name})
        params[name] = {"shape": list(shape), "dtype": "float32", "file": rel,
                        "tensors": ["fp32", "exp_avg", "exp_avg_sq"]}
        if checksums:
            params[name]["checksum"] = hash_file(root / rel, 4096).to_json()
    return {"format": "megatron-ucp-universal", "version": 2 if checksums else 1, "parameters": params}


def test_check_universal_reports_damage_wrong_headers_and_missing_files(tmp_path):
    root = tmp_path / "ucp"
    metadata = _fake_universal(root)
    report = check_universal(root, metadata, workers=2)
    assert report.ok and report.files == 2 and report.blocks > 6 and report.checks == universal.UNIVERSAL_CHECKS
    big = root / "tensors" / f"{PARAM}.safetensors"
    flip(big, big.stat().st_size - 3)
    report = check_universal(root, metadata)
    assert [(f.problem, f.block) for f in report.failures] == [("checksum", (big.stat().st_size - 3) // 4096)]
    shutil.copy(big, tmp_path / "keep")
    wrong = json.loads(json.dumps(metadata))
    wrong["parameters"][PARAM]["shape"] = [64, 96]
    report = check_universal(root, wrong)
    assert [f.problem for f in report.failures] == ["header", "checksum"]
    assert "'exp_avg' is F32 [96, 64], metadata.json says F32 [64, 96]" in report.failures[0].message
    (root / "tensors" / "decoder.final_layernorm.weight.safetensors").unlink()
    report = check_universal(root, metadata)
    assert sorted(f.problem for f in report.failures) == ["checksum", "missing"]


def test_check_universal_of_version_1_checks_headers_and_says_blocks_were_not(tmp_path):
    root = tmp_path / "ucp"
    metadata = _fake_universal(root, checksums=False)
    report = check_universal(root, metadata)
    assert report.ok and report.files == 0
    assert report.notes == ("2 tensor file(s) have no checksums (written by a megatron-ucp without them, metadata "
                            "version 1): their blocks were not checked, only sizes and headers",)
    f = root / "tensors" / "decoder.final_layernorm.weight.safetensors"
    with open(f, "ab") as out:
        out.write(b"\0" * 4)
    assert [x.problem for x in check_universal(root, metadata).failures] == ["header"]


def test_check_universal_of_a_lazy_checkpoint_checks_source_regions_and_their_coverage(tmp_path):
    src_root = tmp_path / "iter_0000004"
    src_root.mkdir()
    src = src_root / "__0_0.distcp"
    src.write_bytes(os.urandom(300_000))
    records = digest_regions([(str(src), 100, 120_000), (str(src), 150_000, 100_000)], block_size=BLOCK)
    placement = {"shape": [30_000], "shards": [{"shape": [30_000], "regions": [["__0_0.distcp", 100, 120_000]]}],
                 "blocks": [[0, [[0, 30_000]], [[0, 30_000]]]]}
    metadata = {"version": 2, "parameters": {PARAM: {"file": None, "source_bytes": {"fp32": placement}}},
                "lazy": {"source": str(src_root), "files": {"__0_0.distcp": {
                    "size": 300_000, "mtime_ns": 0,
                    "checksums": SourceDigests(records).to_json(lambda p: os.path.relpath(p, src_root))[
                        "__0_0.distcp"]}}}}
    assert check_universal(tmp_path, metadata).ok
    flip(src, 200_000)
    [failure] = check_universal(tmp_path, metadata).failures
    assert failure.problem == "checksum" and (failure.block, failure.start) == (0, 150_000)
    placement["shards"][0]["regions"] = [["__0_0.distcp", 100, 119_000], ["__0_0.distcp", 130_000, 1000]]
    problems = sorted(f.problem for f in check_universal(tmp_path, metadata).failures)
    assert problems == ["checksum", "coverage"]


# --------------------------------------------------------------------------------------------------
# Verified reads as the loader and the lazy reader make them


def test_verified_tensor_file_reads_what_safetensors_reads_and_refuses_damage(tmp_path):
    torch.manual_seed(2)
    path = tmp_path / "w.safetensors"
    tensors = {"fp32": torch.randn(256, 96), "exp_avg": torch.randn(256, 96), "bias": torch.randn(96)}
    save_file(tensors, str(path))
    record = hash_file(path, 4096)  # 96 floats = 384-byte rows: a block holds ~10 rows
    indexes = [None, (slice(0, 32),), (slice(100, 164),), (slice(None), slice(48, 96)), (slice(7, 9), slice(3, 5)),
               (slice(5, 5),)]
    with universal.VerifiedTensorFile(path, record, LABEL) as f, safe_open(str(path), "pt") as ref:
        for key in ("fp32", "exp_avg"):
            for index in indexes:
                want = ref.get_tensor(key) if index is None else ref.get_slice(key)[index]
                assert torch.equal(f.read(key, index), want), (key, index)
        assert torch.equal(f.read("bias", (slice(10, 20),)), tensors["bias"][10:20])
        _, _, start, _ = f.tensors["fp32"]
    byte = start + 200 * 384 + 17  # row 200 of fp32
    flip(path, byte)
    k = byte // 4096
    with universal.VerifiedTensorFile(path, record, LABEL) as f:
        assert torch.equal(f.read("fp32", (slice(0, 128),)), tensors["fp32"][:128])  # rows far away: fine
        for index in ((slice(190, 210),), (slice(None), slice(0, 8)), None):  # rows holding it, any columns
            with pytest.raises(ChecksumError, match=rf"block {k} \(bytes {k * 4096}..{k * 4096 + 4095}\) of {LABEL}"):
                f.read("fp32", index)
    with safe_open(str(path), "pt") as ref:  # negative control: safetensors hands out the damaged value
        assert not torch.equal(ref.get_slice("fp32")[190:210], tensors["fp32"][190:210])


def test_lazy_box_sources_are_checked_for_the_rows_a_box_touches(tmp_path):
    """A row-parallel weight [8, 6] stored as two TP shards [8, 3] in a source file: a box reads the rows it
    spans of every shard it overlaps, and only those are checked."""
    from megatron_ucp.io.byteio import Placement, StoredTensor, read_box
    from megatron_ucp.core.patterns import Block

    torch.manual_seed(3)
    full = torch.randn(8, 6)
    shards = [full[:, :3].contiguous(), full[:, 3:].contiguous()]
    src = tmp_path / "__0_0.distcp"
    junk = os.urandom(1000)
    src.write_bytes(junk + shards[0].numpy().tobytes() + junk + shards[1].numpy().tobytes() + junk)
    stored = [StoredTensor((8, 3), torch.float32, (FileRegion(str(src), 1000 + i * (96 + 1000), 96),)) for i in (0, 1)]
    placement = Placement((8, 6), torch.float32, tuple(stored),
                          (Block(0, (slice(0, 8), slice(0, 3)), (slice(0, 8), slice(0, 3))),
                           Block(1, (slice(0, 8), slice(3, 6)), (slice(0, 8), slice(0, 3)))))
    digests = SourceDigests(digest_regions([(str(src), r.offset, r.nbytes) for s in stored for r in s.regions],
                                           block_size=16))  # 16-byte blocks: 4 floats, a 3-float row spans two
    label = f"a source region read by {PARAM}'s lazy entry"
    with FileHandles() as files:
        for index in (None, (slice(2, 5),), (slice(None), slice(0, 3)), (slice(6, 8), slice(4, 6))):
            integrity.verify_box_sources(files, placement, index, digests, label=label)
            want = full if index is None else full[index]
            assert torch.equal(read_box(files, placement, index), want)
        assert integrity.verify_box_sources(files, placement, (slice(2, 5), slice(0, 2)), digests, label=label) == 36
        flip(src, 1000 + 96 + 1000 + 5 * 12 + 4)  # shard 1, row 5
        integrity.verify_box_sources(files, placement, (slice(None), slice(0, 3)), digests, label=label)  # shard 0 only
        integrity.verify_box_sources(files, placement, (slice(0, 4),), digests, label=label)  # rows 0..3
        for index in ((slice(5, 6),), (slice(None), slice(4, 5)), None):
            with pytest.raises(ChecksumError, match="the source checkpoint was damaged after the lazy conversion"):
                integrity.verify_box_sources(files, placement, index, digests, label=label)
        assert not torch.equal(read_box(files, placement, (slice(5, 6),)), full[5:6])  # negative control


# --------------------------------------------------------------------------------------------------
# On a real conversion (Megatron-LM fixture B, torch_dist TP2 PP2 DP2): what the writers will record


def test_records_of_a_real_universal_checkpoint_and_its_lazy_index(tmp_path):
    """Records added to the converter's own output (as the writer will add them while writing) pass
    check_universal, and verified reads equal UniversalCheckpoint.read for every parameter's TP-2 row and
    column slices; on the lazy index of a copy of the source, verify_box_sources covers every read and a
    flipped bit in a referenced region is found. The fixture itself is only read."""
    from pretrain_runs import FIXTURE_CKPTS

    from megatron_ucp.convert import to_universal
    from megatron_ucp.universal import UniversalCheckpoint

    source = tmp_path / "src"
    shutil.copytree(FIXTURE_CKPTS["B"], source)
    ucp = UniversalCheckpoint.open(to_universal(source, tmp_path / "ucp", iteration=4, progress=False))
    metadata = json.loads(json.dumps(ucp.metadata))
    for name, entry in metadata["parameters"].items():
        entry["checksum"] = hash_file(ucp.path / entry["file"], 4096).to_json()
    report = check_universal(ucp.path, metadata, workers=2)
    assert report.ok and report.files == len(ucp.parameters) and not report.notes
    cache = integrity.VerifiedBlocks()
    for name, info in ucp.parameters.items():
        record = DigestRecord.from_json(metadata["parameters"][name]["checksum"])
        with universal.VerifiedTensorFile(ucp.path / info.file, record, integrity.tensor_file_label(name),
                                          cache=cache) as f:
            for key in info.tensors:
                n = info.shape[0]
                indexes = [None, (slice(0, n // 2),), (slice(n // 2, n),)]
                if len(info.shape) == 2:
                    indexes.append((slice(None), slice(0, info.shape[1] // 2)))
                for index in indexes:
                    assert torch.equal(f.read(key, index), ucp.read(name, key, index)), (name, key, index)
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    victim = ucp.path / metadata["parameters"][name]["file"]
    flip(victim, victim.stat().st_size // 2)
    [failure] = check_universal(ucp.path, metadata).failures
    assert failure.problem == "checksum" and failure.path == str(victim)
    assert f"of {name}'s tensor file fails its checksum" in failure.message

    lazy = UniversalCheckpoint.open(to_universal(source, tmp_path / "lazy", iteration=4, lazy=True, progress=False))
    regions = [(r.path, r.offset, r.nbytes) for info in lazy.parameters.values()
               for placement in info.placements.values() for shard in placement.shards for r in shard.regions]
    digests = SourceDigests(digest_regions(regions, block_size=4096, workers=2))
    lazy_meta = json.loads(json.dumps(lazy.metadata))
    root = lazy_meta["lazy"]["source"]
    for rel, records in digests.to_json(lambda p: os.path.relpath(p, root)).items():
        lazy_meta["lazy"]["files"][rel]["checksums"] = records
    assert check_universal(lazy.path, lazy_meta).ok
    with FileHandles() as files:
        for name, info in lazy.parameters.items():
            for key, placement in info.placements.items():
                checked = integrity.verify_box_sources(files, placement, None, digests, label=name)
                assert checked == placement.shards[0].nbytes * (len(placement.shards) if len(placement.blocks) > 1 else 1)
        name = "decoder.layers.0.self_attention.linear_qkv.weight"
        region = lazy.parameters[name].placements["exp_avg"].shards[1].regions[0]
        flip(region.path, region.offset + region.nbytes - 1)
        with pytest.raises(ChecksumError, match="the source checkpoint was damaged after the lazy conversion"):
            integrity.verify_box_sources(files, lazy.parameters[name].placements["exp_avg"], None, digests, label=name)
        integrity.verify_box_sources(files, lazy.parameters[name].placements["fp32"], None, digests, label=name)
    failures = check_universal(lazy.path, lazy_meta).failures
    assert [(f.problem, f.path) for f in failures] == [("checksum", region.path)]
