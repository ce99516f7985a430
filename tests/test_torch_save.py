"""serialization/torch_save.py writes torch.save's format without torch; these tests hold it to torch.save itself
(torch 2.13), byte for byte.

The only bytes allowed to differ are the 40-digit `.data/serialization_id` (torch hashes the record names
with std::hash, which this module does not reproduce; torch's reader only logs the id) and the CRC-32
fields of that record and, for framing without data (`tensor_archive`, as under torch's skip_data), of the
data record (torch's reader does not check CRC-32s). Everything else (record order, alignment padding,
data descriptors, central directory, zip64 end records, the pickle opcodes and memo references) must be
equal. Also checked: torch.load and megatron-ucp's own allow-list reader read what is written; the CPU
generator state and the bf16/fp16 casts equal torch's, including NaN, infinities, subnormals and overflow.
Runtime: ~5 s.
"""

from __future__ import annotations

import argparse
import http
import io
import math
import struct
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

from megatron_ucp.serialization import torch_save
from megatron_ucp.serialization.safe_pickle import TensorRecord, TorchDType, load_archive, read_tensor_bytes
from megatron_ucp.serialization.torch_save import (EnumMember, GlobalRef, Obj, SavedTensor, TorchSaveError, TorchSize,
                                             cast_float32, save_bytes, tensor_archive, torch_dtype)
from megatron_ucp.core.run_state import cpu_generator_state


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def differing_allowed(theirs: bytes, records=("/.data/serialization_id",)) -> set:
    """Byte positions of `theirs` that may differ: the serialization id's digits, and the CRC-32 fields (data
    descriptor and central directory entry) of the named records."""
    allowed = set()
    for info in zipfile.ZipFile(io.BytesIO(theirs)).infolist():
        if not info.filename.endswith(records):
            continue
        name_len, extra_len = struct.unpack_from("<HH", theirs, info.header_offset + 26)
        start = info.header_offset + 30 + name_len + extra_len
        allowed |= set(range(start + info.file_size, start + info.file_size + 8))  # descriptor signature + CRC
        if info.filename.endswith("serialization_id"):
            allowed |= set(range(start, start + info.file_size))
    pos = theirs.index(b"PK\x01\x02")
    while pos >= 0:  # central directory entries of those records: their CRC field
        name_len = struct.unpack_from("<H", theirs, pos + 28)[0]
        if theirs[pos + 46:pos + 46 + name_len].decode().endswith(records):
            allowed |= set(range(pos + 16, pos + 20))
        pos = theirs.find(b"PK\x01\x02", pos + 46)
    return allowed


def assert_same_bytes(ours: bytes, theirs: bytes, records=("/.data/serialization_id",)) -> None:
    assert len(ours) == len(theirs)
    differing = {i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y}
    assert differing <= differing_allowed(theirs, records), sorted(differing - differing_allowed(theirs, records))[:10]


def numpy_of(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------------------------------
# One tensor's framing (the direct torch_dist writer's items)


SHAPES = [((3, 5), "float32"), ((1, 48, 24), "bfloat16"), ((70000,), "float16"), ((), "float32"),
          ((0, 4), "float32"), ((2, 3, 4, 5), "float64"), ((7,), "int64"), ((9,), "bool"), ((2, 2), "uint8"),
          ((3,), "int32"), ((1000, 33), "float32"), ((5, 0, 2), "int16"), ((4,), "int8")]


@pytest.mark.parametrize("shape,dtype", SHAPES, ids=[f"{d}{list(s)}" for s, d in SHAPES])
def test_tensor_archive_is_torch_saves_framing(shape, dtype):
    """head + data + tail == torch.save(tensor) but for the data CRC (0, as under skip_data) and the
    serialization id; torch.load reads it back."""
    tensor = (torch.randn(shape) * 100).to(getattr(torch, dtype))
    theirs = torch_saved(tensor)
    archive = tensor_archive(shape, dtype)
    ours = archive.head + numpy_of(tensor) + archive.tail
    assert archive.length == len(ours) and (archive.data_offset % 64 == 0 or not archive.nbytes)
    assert_same_bytes(ours, theirs, ("/data/0", "/.data/serialization_id"))
    assert tensor_archive(shape, f"torch.{dtype}") is archive  # torch's spelling, cached
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_tensor_archive_leaves_zip64_records_to_torch(monkeypatch):
    """A record at or past 4 GiB needs zip64 fields: torch frames it (here a small limit forces that path,
    and its framing is the same as ours for a small tensor)."""
    ours = tensor_archive((64, 3), "bfloat16")
    torch_save._tensor_archive.cache_clear()
    monkeypatch.setattr(torch_save, "_ZIP32_LIMIT", 100)
    try:
        with pytest.raises(TorchSaveError, match="4 GiB"):
            save_bytes(SavedTensor(bytes(384), "bfloat16", (64, 3)))
        theirs = tensor_archive((64, 3), "bfloat16")
        assert (theirs.head, len(theirs.tail)) == (ours.head, len(ours.tail)) and theirs.nbytes == ours.nbytes
        full = theirs.head + bytes(384) + theirs.tail
        assert_same_bytes(ours.head + bytes(384) + ours.tail, full, ("/data/0", "/.data/serialization_id"))
    finally:
        torch_save._tensor_archive.cache_clear()


# --------------------------------------------------------------------------------------------------
# Whole objects (common.pt, ShardedObject items)


def _pair():
    """The same value as torch objects and as torch_save's stand-ins."""
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    half = torch.tensor([1.5, -2.25, 65504.0], dtype=torch.bfloat16)
    state = np.random.RandomState(7).get_state()
    theirs = {"weights": weights, "scalar": torch.tensor(3.0), "half": half, "empty": torch.zeros(0, 2),
              "rng": torch.Generator().manual_seed(11).get_state(), "np": state,
              "args": argparse.Namespace(params_dtype=torch.bfloat16, main_dtype=torch.float32,
                                         status=http.HTTPStatus(404), lr=1e-3, name="x", none=None),
              "dtypes": {(torch.bfloat16, torch.float32): [64, 128]}, "plain": [1, 2.5, "s", True, None, (1, 2)],
              "ordered": OrderedDict(a=1)}
    ours = {"weights": SavedTensor.of(weights.numpy(), "float32"),
            "scalar": SavedTensor(struct.pack("<f", 3.0), "float32", ()),
            "half": SavedTensor(numpy_of(half), "bfloat16", (3,)), "empty": SavedTensor(b"", "float32", (0, 2)),
            "rng": SavedTensor.of(cpu_generator_state(11), "uint8"), "np": state,
            "args": Obj(GlobalRef("argparse.Namespace"), {
                "params_dtype": torch_dtype("torch.bfloat16"), "main_dtype": torch_dtype("float32"),
                "status": EnumMember(GlobalRef("http.HTTPStatus"), 404), "lr": 1e-3, "name": "x", "none": None}),
            "dtypes": {(TorchDType("bfloat16"), TorchDType("float32")): [64, 128]},
            "plain": [1, 2.5, "s", True, None, (1, 2)], "ordered": OrderedDict(a=1)}
    return ours, theirs


@pytest.mark.parametrize("prefix", ["archive", "common"])
def test_save_bytes_is_torch_save(prefix, tmp_path):
    """Tensors of several dtypes (a scalar, an empty one), numpy state, a Namespace with dtypes and an enum,
    dtype-keyed dicts: the same bytes as torch.save (to a stream: "archive"; to a path named common.pt:
    "common", as megatron-core saves common.pt), the same value on torch.load."""
    ours, theirs = _pair()
    if prefix == "archive":
        expected = torch_saved(theirs)
    else:
        torch.save(theirs, tmp_path / "common.pt")
        expected = (tmp_path / "common.pt").read_bytes()
    written = save_bytes(ours, prefix=prefix)
    assert_same_bytes(written, expected)
    back = torch.load(io.BytesIO(written), weights_only=False)
    assert back.keys() == theirs.keys()
    for key in ("weights", "scalar", "half", "empty", "rng"):
        assert back[key].dtype == theirs[key].dtype and torch.equal(back[key], theirs[key]), key
    assert vars(back["args"]) == vars(theirs["args"]) and back["dtypes"] == theirs["dtypes"]
    assert back["np"][0] == "MT19937" and np.array_equal(back["np"][1], theirs["np"][1])
    assert back["plain"] == theirs["plain"] and back["ordered"] == theirs["ordered"]


def _streamed(ours: dict) -> dict:
    """The same value with every SavedTensor of data a StreamedTensor yielding it in uneven chunks (a memoryview, a
    numpy array, bytes: what producers hand over), each produced only when its record is written."""
    produced = []

    def streamed(key, t):
        def chunks():
            produced.append(key)
            data = t.data
            cuts = sorted({min(c, len(data)) for c in (0, 1, 7, len(data) // 2, len(data))})
            for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
                yield (memoryview, lambda b: np.frombuffer(b, dtype=np.uint8), bytes)[i % 3](data[lo:hi])
        return torch_save.StreamedTensor(t.dtype, t.shape, chunks)

    out = {k: streamed(k, v) if isinstance(v, SavedTensor) else v for k, v in ours.items()}
    out["produced"] = produced  # not saved: the caller pops it
    return out


@pytest.mark.parametrize("prefix", ["archive", "model_optim_rng"])
def test_save_streamed_is_torch_save(prefix, tmp_path):
    """save_streamed writes save_bytes' bytes (torch.save's, see above) record by record: StreamedTensor storages
    are produced one at a time while their records are written, in any chunking."""
    ours, theirs = _pair()
    streamed = _streamed(ours)
    produced = streamed.pop("produced")
    path = tmp_path / f"{prefix}.pt"
    with open(path, "wb") as f:
        n = torch_save.save_streamed(streamed, f, prefix=prefix)
    written = path.read_bytes()
    assert n == len(written) and written == save_bytes(ours, prefix=prefix)
    assert produced == ["weights", "scalar", "half", "rng"]  # in storage key order; the empty one has no data
    back = torch.load(path, weights_only=False)
    for key in ("weights", "scalar", "half", "empty", "rng"):
        assert back[key].dtype == theirs[key].dtype and torch.equal(back[key], theirs[key]), key


def test_save_streamed_leaves_zip64_framing_to_torch(monkeypatch, tmp_path):
    """Past zip32's limit (here forced low) torch's own zip writer frames the archive with each storage's data
    skipped, and save_streamed fills the holes: torch.load and the allow-list reader read the same values."""
    ours, theirs = _pair()
    del ours["args"], ours["np"], theirs["args"], theirs["np"]  # http.HTTPStatus is not on the allow-list
    streamed = _streamed(ours)
    streamed.pop("produced")
    monkeypatch.setattr(torch_save, "_ZIP32_LIMIT", 100)
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        f.write(b"x" * 10)  # not at the file's start: holes are found relative to it
        n = torch_save.save_streamed(streamed, f)
    data = path.read_bytes()[10:]
    assert n == len(data)
    path.write_bytes(data)
    back = torch.load(path, weights_only=True)
    for key in ("weights", "scalar", "half", "empty", "rng"):
        assert back[key].dtype == theirs[key].dtype and torch.equal(back[key], theirs[key]), key
    assert back["dtypes"] == theirs["dtypes"] and back["plain"] == theirs["plain"]
    value = load_archive(path, what="a zip64-framed archive")
    assert bytes(read_tensor_bytes(value["weights"])) == ours["weights"].data


def test_save_streamed_refuses_a_wrong_length(tmp_path):
    short = torch_save.StreamedTensor("float32", (4,), lambda: iter([bytes(12)]))
    with open(tmp_path / "x.pt", "wb") as f, pytest.raises(TorchSaveError, match="12 bytes produced, 16 declared"):
        torch_save.save_streamed({"w": short}, f)


def test_allow_list_reader_reads_it(tmp_path):
    """megatron-ucp's own reader (no unpickling outside the allow-list) reads what torch_save writes."""
    ours, _ = _pair()
    del ours["args"], ours["np"]  # http.HTTPStatus is (rightly) not on the allow-list
    path = tmp_path / "item.pt"
    path.write_bytes(save_bytes([ours]))
    (value,) = load_archive(path, what="a ShardedObject item")
    assert isinstance(value["weights"], TensorRecord) and value["weights"].shape == (3, 4)
    assert bytes(read_tensor_bytes(value["weights"])) == ours["weights"].data
    assert bytes(read_tensor_bytes(value["rng"])) == cpu_generator_state(11)
    assert value["plain"] == [1, 2.5, "s", True, None, (1, 2)]


def test_refuses_what_it_cannot_write():
    with pytest.raises(TorchSaveError, match="bytes for a float32 tensor"):
        SavedTensor(b"abc", "float32", (1,))
    with pytest.raises(TorchSaveError, match="float8_e4m3fn"):
        SavedTensor(bytes(1), "float8_e4m3fn", (1,))
    with pytest.raises(TorchSaveError, match="unknown torch dtype"):
        torch_dtype("float17")
    with pytest.raises(TorchSaveError, match="tensors need"):
        torch_save.pickle_bytes([SavedTensor(bytes(4), "float32", (1,))])


def _pure_pickle(value) -> bytes:
    buf = io.BytesIO()
    torch_save.Pickler(buf, 2).dump(value)
    return buf.getvalue()


def _metadata_like():
    """A value like DCP's .metadata in stand-ins: dataclass-like Obj (dict and tuple states), torch.Size,
    dtypes, enum members, shared references (the memo), keys repeated across entries."""
    size = TorchSize((4, 8))
    props = Obj(GlobalRef("torch.distributed.checkpoint.metadata.TensorProperties"),
                (torch_dtype("bfloat16"), GlobalRef("torch.strided"), False,
                 EnumMember(GlobalRef("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"), 0), False))
    shared = {"relative_path": "__0_0.distcp", "offset": 0, "length": 64}
    chunks = [Obj(GlobalRef("torch.distributed.checkpoint.metadata.ChunkStorageMetadata"),
                  {"offsets": TorchSize((i, 0)), "sizes": TorchSize((1, 8))}) for i in range(4)]
    return {"md": Obj(GlobalRef("torch.distributed.checkpoint.metadata.TensorStorageMetadata"),
                      {"properties": props, "size": size, "chunks": chunks}),
            "again": [props, shared, shared, size], "dtype": TorchDType("float32"), "plain": (1, 2.5, "s", None, b"b"),
            "big": list(range(2500)), "keys": {f"k{i}": {"x": i} for i in range(1500)}}


def test_c_pickler_path_writes_the_pure_picklers_bytes():
    """pickle_bytes(value, 2) goes through Python's C pickler with importable stand-in classes whose GLOBAL
    lines are then renamed: the bytes are exactly the pure-Python pickler's (memo references, batching, every
    stand-in kind), and torch unpickles them to its own objects."""
    value = _metadata_like()
    fast = torch_save._fast_pickle(value)
    assert fast is not None and fast == _pure_pickle(value)
    assert torch_save.pickle_bytes(value) == fast
    loaded = pickle_loads(fast)
    md = loaded["md"]
    assert type(md).__name__ == "TensorStorageMetadata" and md.size == torch.Size((4, 8))
    assert md.properties.dtype is torch.bfloat16 and md.properties.memory_format == torch.contiguous_format
    assert loaded["again"][0] is md.properties and loaded["again"][1] is loaded["again"][2]
    assert loaded["dtype"] is torch.float32 and [c.offsets for c in md.chunks] == [torch.Size((i, 0)) for i in range(4)]


def test_c_pickler_path_steps_aside_when_data_could_be_taken_for_a_stand_in():
    """A string holding a stand-in's GLOBAL line (only reachable by knowing the process's random token), or a
    value of a type the path does not convert, goes to the pure-Python pickler: same result, never a renamed
    piece of data."""
    value = _metadata_like()
    torch_save._fast_pickle(value)  # stand-ins exist now
    marker = next(iter(torch_save._STAND_INS.values())).__name__
    tricky = {**value, "path": f"x\nc{torch_save.__name__}\n{marker}\n"}
    assert torch_save._fast_pickle(tricky) is None
    assert torch_save.pickle_bytes(tricky) == _pure_pickle(tricky)
    other = {**value, "ordered": OrderedDict(a=1)}
    assert torch_save._fast_pickle(other) is None
    assert torch_save.pickle_bytes(other) == _pure_pickle(other)


def pickle_loads(data: bytes):
    import pickle

    return pickle.loads(data)  # our own bytes, read back in the test


# --------------------------------------------------------------------------------------------------
# Values torch computes


@pytest.mark.parametrize("seed", [0, 1, 1234, 1234 + 7919 * 8 + 100, 2 ** 32 + 5, 2 ** 63 - 1, 2 ** 64 - 1])
def test_cpu_generator_state_is_torchs(seed):
    assert cpu_generator_state(seed) == numpy_of(torch.Generator().manual_seed(seed).get_state())


def test_cpu_generator_state_sees_a_wrong_word():
    """Negative control: the comparison above sees one word of 624 off (the seed's high bits ignored)."""
    a, b = cpu_generator_state(2 ** 32 + 5), cpu_generator_state(5)
    assert a != b and a[8:] == b[8:]  # only the stored initial seed differs: mt19937 takes the low 32 bits


SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1e-40, 6e-8, 3e-8, 2.98e-8,
                    65504.0, 65519.99, 65520.0, 1e38, 3.3895314e38, 3.4e38, -3.4e38, 1.00390625, 1.01171875,
                    1.0078125, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8], dtype=np.float32)


def _cast_inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    scaled = rng.standard_normal(50000).astype(np.float32) * np.float32(10) ** rng.integers(-45, 38, 50000).astype(
        np.float32)
    any_bits = rng.integers(0, 2 ** 32, 50000, dtype=np.uint64).astype(np.uint32).view(np.float32)  # NaN payloads
    return np.concatenate([SPECIAL, scaled, any_bits])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n", [1, 7, 24, None])
def test_cast_rounds_as_torch(dtype, n):
    """cast_float32 == torch's CPU Tensor.to(dtype), bit for bit: rounding to nearest even (ties included),
    subnormals, overflow to infinity, NaNs with any payload; short inputs too (torch's scalar tail path)."""
    values = _cast_inputs()[:n]
    ours = cast_float32(values, dtype)
    theirs = numpy_of(torch.from_numpy(values.copy()).to(getattr(torch, dtype)))
    assert ours.tobytes() == theirs


def test_cast_comparison_sees_truncation():
    """Negative control: truncating instead of rounding differs from torch on the ties and many values."""
    values = _cast_inputs()
    truncated = (values.view(np.uint32) >> 16).astype(np.uint16)
    theirs = np.frombuffer(numpy_of(torch.from_numpy(values.copy()).to(torch.bfloat16)), dtype=np.uint16)
    assert (truncated != theirs).sum() > len(values) // 4


def test_saved_tensor_of_numpy():
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = SavedTensor.of(values, "float32")
    assert t.shape == (2, 3) and t.data == values.tobytes()
    assert math.prod(SavedTensor.of(b"\0" * 8, "uint8").shape) == 8
