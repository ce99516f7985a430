"""serialization/safe_pickle.py: every pickled file of a Megatron checkpoint read without torch and without
running its code.

- Fixtures A, B, C (Megatron-LM's own files): every model_optim_rng.pt, distrib_optim.pt, common.pt,
  .metadata and .distcp item parses, and equals torch's reading of it (torch.load(weights_only=True)
  with the readers' allow-list; FileSystemReader.read_metadata()): every tensor's dtype, shape, stride
  and bytes (compared exactly), args, iteration, scheduler, param groups and RNG states.
- A torch.save archive of every construct the allow-list admits (bf16/fp16/int64/uint8/bool/uint16
  storages, views, Parameters, numpy arrays and scalars, sets, paths, devices...) round-trips exactly.
- Crafted files of every kind (legacy model_optim_rng.pt / distrib_optim.pt, common.pt, .metadata, a
  bytes item inside a .distcp) carrying payloads that would create a marker file never run it; the
  error is one line naming the file (and item) and the global. Negative controls: the same payloads
  do create the marker under a plain pickle.Unpickler, and under torch's own DCP metadata reader.
- Bounds: a 16 GiB tensor on a 64-byte record, a zip directory claiming 16 GiB, a sparse 17 GiB file
  whose pickle claims 16 GiB are refused in a subprocess whose address space cannot hold them; unsafe
  data-file names in .metadata, symbolic links out of the folder, truncated files are refused.
Runtime: 15-25 s on 2 shared cores (4 s of CPU; importing torch and torch.distributed.checkpoint dominates).
"""

from __future__ import annotations

import argparse
import collections
import copyreg
import enum
import io
import json
import os
import pathlib
import pickle
import signal
import struct
import subprocess
import sys
import types
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ucp.formats.pickles import MEGATRON, MEGATRON_ENUMS
from megatron_ucp.serialization import safe_pickle as sp

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "megatron-lm"
FIXTURE_ITERS = sorted(FIXTURES.glob("*/ckpt/iter_*"))
LEGACY_FILES = sorted(p for d in FIXTURE_ITERS for p in d.glob("**/*.pt"))
DCP_ITERS = [d for d in FIXTURE_ITERS if (d / ".metadata").is_file()]


# --------------------------------------------------------------------------------------------------
# The oracle: torch's own reading (torch.load(weights_only=True) with the allow-list the readers gave torch
# before safe_pickle replaced it; torch.load on the meta device for byte offsets)


def _enum_rebuild(qualname: str):
    def rebuild(value):
        return sp.PickledEnum(qualname, value)

    rebuild.__name__ = qualname.rsplit(".", 1)[1]
    return rebuild


def _torch_allow_list() -> list:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    import numpy.dtypes as npd

    allowed: list = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals, np.ndarray, np.dtype,
                     (_reconstruct, "numpy._core.multiarray._reconstruct"),
                     (_reconstruct, "numpy.core.multiarray._reconstruct")]
    allowed += [getattr(npd, n) for n in ("UInt32DType", "Int64DType", "Float64DType") if hasattr(npd, n)]
    allowed += [(_enum_rebuild(q), q) for q in MEGATRON_ENUMS]
    return allowed


def torch_load(source, **kwargs):
    # The oracle sees exactly our allow-list: megatron-core registers its own process-wide safe globals when
    # an earlier test imports it (torch would then rebuild real enums).
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with torch.serialization.safe_globals(_torch_allow_list()):
            return torch.load(source, map_location=kwargs.pop("map_location", "cpu"), weights_only=True, **kwargs)
    finally:
        torch.serialization.add_safe_globals(registered)


def meta_load(path: str):
    """torch.load with every tensor on the meta device: storages carry `_checkpoint_offset`."""
    return torch_load(path, map_location="meta")


def torch_region(path: str, meta: torch.Tensor):
    """(path, offset, nbytes) of a meta-loaded tensor's bytes, as torch places them; None if not contiguous."""
    record = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if record is None or not meta.is_contiguous():
        return None
    return path, int(record) + meta.storage_offset() * meta.element_size(), meta.numel() * meta.element_size()


def _dcp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp
    return dcp


# --------------------------------------------------------------------------------------------------
# Comparing what torch reads with what safe_pickle reads


def _tensor_key(t: torch.Tensor) -> tuple:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return ("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), data)


def norm(x):
    """A plain comparable value for either reader's output (tensors by dtype, shape, stride and bytes)."""
    if isinstance(x, torch.Tensor):
        return _tensor_key(x)
    if isinstance(x, sp.TensorRecord):
        t = sp.to_torch(x)
        assert (str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride())) == (x.dtype, x.shape, x.stride)
        if x.region() is not None:  # the bounded byte reader gives the same bytes as the tensor
            assert bytes(sp.read_tensor_bytes(x)) == _tensor_key(t)[-1]
        return _tensor_key(t)
    if isinstance(x, argparse.Namespace):
        return ("namespace", norm(vars(x)))
    if isinstance(x, dict):
        return {norm(k): norm(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(norm(v) for v in x)
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, sp.NumpyArray):
        return norm(x.to_numpy())
    if isinstance(x, torch.dtype):
        return ("dtype", str(x).removeprefix("torch."))
    if isinstance(x, sp.TorchDType):
        return ("dtype", x.name)
    if isinstance(x, sp.PickledEnum):
        return ("enum", x.qualname, x.value)
    if isinstance(x, enum.Enum):
        return ("enum", f"{type(x).__module__}.{type(x).__qualname__}", x.value)
    return x


def _torch_load(path: Path):
    return torch_load(path, mmap=True)


@pytest.mark.parametrize("path", LEGACY_FILES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_fixture_archive_equals_torch(path):
    """model_optim_rng.pt, distrib_optim.pt, common.pt of A, B, C: every value, every tensor's bytes."""
    ours = sp.load_archive(path, what="fixture", family=MEGATRON)
    theirs = _torch_load(path)
    assert norm(ours) == norm(theirs)
    if path.name == "model_optim_rng.pt":  # the values the readers use, by name
        for key in ("iteration", "checkpoint_version", "opt_param_scheduler", "num_floating_point_operations_so_far"):
            assert norm(ours[key]) == norm(theirs[key])
        assert isinstance(ours["args"], argparse.Namespace) and vars(ours["args"]).keys() == vars(theirs["args"]).keys()
        assert ours["args"].attention_backend == sp.PickledEnum("megatron.core.transformer.enums.AttnBackend",
                                                                theirs["args"].attention_backend.value)
        assert ours["args"].exit_signal == sp.PickledEnum("signal.Signals", int(signal.SIGTERM))
        assert ours["args"].params_dtype == sp.TorchDType("float32")
        assert str(ours["args"].params_dtype) == "torch.float32"
        rng_ours, rng_theirs = ours["rng_state"][0], theirs["rng_state"][0]
        keys = rng_ours["np_rng_state"][1]
        assert isinstance(keys, sp.NumpyArray) and keys.shape == (624,) and keys.dtype.str == "<u4"
        assert np.array_equal(keys.to_numpy(), rng_theirs["np_rng_state"][1])
        assert rng_ours["random_rng_state"] == rng_theirs["random_rng_state"]


@pytest.mark.parametrize("path", [p for p in LEGACY_FILES if p.name != "common.pt" and "iter_0000008" in str(p)],
                         ids=lambda p: str(p.relative_to(FIXTURES)))
def test_record_regions_equal_torch_offsets(path):
    """TensorRecord.region() is where torch itself says each tensor's bytes are (meta-load offsets that
    the readers used before safe_pickle), for every tensor of the file."""
    ours, meta = sp.load_archive(path, what="fixture", family=MEGATRON), meta_load(str(path))
    pairs = []

    def walk(a, b):
        if isinstance(a, sp.TensorRecord):
            pairs.append((a, b))
        elif isinstance(a, dict):  # same insertion order on both sides (keys differ: dtype stand-ins)
            for x, y in zip(a.values(), b.values()):
                walk(x, y)
        elif isinstance(a, (list, tuple)):
            for x, y in zip(a, b):
                walk(x, y)

    walk({k: v for k, v in ours.items() if k != "rng_state"}, meta)
    assert len(pairs) >= 3  # param, exp_avg, exp_avg_sq of a distrib_optim.pt; dozens in a model file
    for record, tensor in pairs:
        expected = torch_region(str(path), tensor)
        region = record.region()
        assert expected is not None and region is not None
        assert expected == tuple(region) if expected[2] else region.nbytes == 0


def strictly_equal(a, b) -> bool:
    """Same types all the way down (PickledEnum compared by its fields: the torch side uses common's
    class), tensors equal in dtype, shape, stride and values."""
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
                and torch.equal(a, b))
    if isinstance(a, sp.PickledEnum):
        return isinstance(b, sp.PickledEnum) and (a.qualname, a.value) == (b.qualname, b.value)
    if type(a) is not type(b):
        return False
    if isinstance(a, argparse.Namespace):
        return strictly_equal(vars(a), vars(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(strictly_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(strictly_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("path", [p for p in LEGACY_FILES if "iter_0000008" in str(p)],
                         ids=lambda p: str(p.relative_to(FIXTURES)))
def test_materialize_gives_what_torch_load_gives(path):
    """materialize(load_archive(f)) gives what torch.load(weights_only=True) gives: same types (argparse.Namespace,
    torch dtypes as dict keys, signal.Signals, numpy arrays, torch tensors) and values."""
    got = sp.materialize(sp.load_archive(path, what="fixture", family=MEGATRON))
    assert strictly_equal(got, _torch_load(path))
    copied = sp.materialize(sp.load_archive(path, what="fixture", family=MEGATRON), mmap=False)
    assert strictly_equal(copied, got)


@pytest.mark.parametrize("iter_dir", DCP_ITERS, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_fixture_dcp_metadata_and_items_equal_torch(iter_dir):
    """B's .metadata equals torch's FileSystemReader.read_metadata() (keys, sizes, dtypes, chunks,
    storage_data), and every .distcp item (tensor chunks and pickled objects) equals torch.load of it."""
    dcp = _dcp()
    theirs = dcp.FileSystemReader(str(iter_dir)).read_metadata()
    ours = sp.load_dcp_metadata(iter_dir, MEGATRON)
    assert ours.version == theirs.version
    assert set(ours.state_dict_metadata) == set(theirs.state_dict_metadata)
    for fqn, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        if isinstance(md, dcp.metadata.BytesStorageMetadata):
            assert isinstance(mine, sp.DcpBytesMeta)
        else:
            assert (mine.dtype, mine.size) == (str(md.properties.dtype).removeprefix("torch."), tuple(md.size))
            want = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
            assert [(c.offsets, c.sizes) for c in mine.chunks] == want
    expected = {(i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset, s.length)
                for i, s in theirs.storage_data.items()}
    assert {(i.fqn, i.offset): (s.relative_path, s.offset, s.length) for i, s in ours.storage_data.items()} == expected
    assert all(s.path == str(iter_dir / s.relative_path) for s in ours.storage_data.values())
    kinds = collections.Counter()
    for index, item in ours.storage_data.items():
        got = sp.load_dcp_item(ours, index)
        with open(item.path, "rb") as f:
            f.seek(item.offset)
            want = torch_load(io.BytesIO(f.read(item.length)))
        assert norm(got) == norm(want), index
        kinds[type(got).__name__] += 1
    assert kinds["TensorRecord"] > 200 and len(kinds) > 1  # tensor chunks and pickled objects both seen


def test_every_allowed_construct_round_trips(tmp_path):
    """torch.save of everything the allow-list admits: what load_archive gives equals what was saved."""
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    param = torch.nn.Parameter(torch.randn(3, 2))
    with_attrs = torch.ones(2)
    with_attrs.tensor_model_parallel = True  # Megatron sets attributes on parameters
    obj = {
        "bf16": torch.randn(5, 3).to(torch.bfloat16), "fp16": torch.randn(4).half(), "int64": torch.arange(7),
        "uint8": torch.arange(9, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "float64": torch.randn(2, 2, dtype=torch.float64),
        "uint16": torch.arange(5, dtype=torch.int32).to(torch.uint16),  # a torch >= 2.3 dtype: _rebuild_tensor_v3
        "complex": torch.randn(3, dtype=torch.complex64), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
        "view_T": base.t(), "view_slice": base[1:3, 2:5], "view_row": base[2], "shared_base": base,
        "param": param, "with_attrs": with_attrs,
        "args": argparse.Namespace(lr=1e-3, params_dtype=torch.bfloat16, save=pathlib.PosixPath("/ckpt"),
                                   exit_signal=signal.SIGTERM, tags={"a", "b"}, frozen=frozenset({1}), c=complex(1, 2),
                                   blob=bytearray(b"\x00\xff"), raw=b"\x01\x02", cut=slice(1, None, 2),
                                   device=torch.device("cuda", 1), ns=types.SimpleNamespace(x=1)),
        "np_rng": np.random.RandomState(3).get_state(),
        "np_values": [np.arange(6, dtype=np.int64).reshape(2, 3), np.ones(3, dtype=">f4"), np.float64(1.25),
                      np.int32(-7), np.bool_(True), np.asfortranarray(np.arange(6.0).reshape(2, 3))],
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]), "size": torch.Size([3, 4]),
        "extra_state": io.BytesIO(b"te-extra-state"),
    }
    path = tmp_path / "all.pt"
    torch.save(obj, path)
    got = sp.load_archive(path, what="synthetic")
    for key in ("bf16", "fp16", "int64", "uint8", "bool", "float64", "uint16", "complex", "scalar", "empty",
                "view_T", "view_slice", "view_row", "shared_base", "param", "with_attrs"):
        assert isinstance(got[key], sp.TensorRecord), key
        assert norm(got[key]) == norm(obj[key]), key
    assert got["view_T"].region() is None and not got["view_T"].is_c_contiguous()
    assert got["view_slice"].region() is None and got["view_row"].region() is not None
    assert got["view_row"].storage_key == got["shared_base"].storage_key  # one storage record, two views
    assert got["uint16"].dtype == "uint16" and got["bf16"].dtype == "bfloat16"
    args = got["args"]
    assert (args.lr, args.tags, args.frozen, args.c, args.blob, args.raw, args.cut) == (
        1e-3, {"a", "b"}, frozenset({1}), complex(1, 2), bytearray(b"\x00\xff"), b"\x01\x02", slice(1, None, 2))
    assert args.params_dtype == sp.TorchDType("bfloat16") and args.save == pathlib.PosixPath("/ckpt")
    assert args.exit_signal == sp.PickledEnum("signal.Signals", 15) and str(args.device) == "cuda:1"
    assert vars(args.ns) == {"x": 1}
    assert norm(got["np_rng"]) == norm(obj["np_rng"])
    arrays = got["np_values"]
    for i in (0, 1, 5):
        assert norm(arrays[i]) == norm(obj["np_values"][i]), i
    assert arrays[2:5] == [1.25, -7, True]
    assert got["ordered"] == obj["ordered"] and isinstance(got["ordered"], collections.OrderedDict)
    assert got["size"] == (3, 4)
    assert got["extra_state"].getvalue() == b"te-extra-state"
    # torch content that is safe but not plain bytes in the file is refused by name, not as "unsafe"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch
        torch.save({"q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)}, tmp_path / "q.pt")
    with pytest.raises(sp.SafeLoadError, match="holds a quantized tensor") as e:
        sp.load_archive(tmp_path / "q.pt", what="synthetic")
    assert not isinstance(e.value, sp.UnsafePickleError)


# --------------------------------------------------------------------------------------------------
# Crafted files


class Call:
    """Pickles as a call of `func(*args)` (REDUCE); calls nest."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __call__(self, *args):  # pickle requires the reduce callable to be callable
        raise AssertionError("never called")

    def __reduce__(self):
        return self.func, self.args


def payloads(marker: Path) -> dict:
    """Pickled objects that create `marker` when unpickled without restriction, by name."""
    import builtins
    import subprocess as sub

    touch = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"
    return {
        "os.system": Call(os.system, touch),
        "subprocess.Popen": Call(sub.Popen, ["touch", str(marker)]),
        "builtins.eval": Call(builtins.eval, code),
        "builtins.exec": Call(builtins.exec, code),
        "builtins.getattr": Call(Call(builtins.getattr, Call(builtins.__import__, "os"), "system"), touch),
        "copyreg._reconstructor": Call(copyreg._reconstructor, sub.Popen, sub.Popen, ["touch", str(marker)]),
        "namespace": argparse.Namespace(lr=1e-3, hook=Call(os.system, touch)),
        "nested_reduce": Call(collections.OrderedDict, [("a", Call(builtins.exec, code))]),
    }


# what each payload's error names (os.system pickles as posix.system; the namespace's payload is os.system)
PAYLOAD_GLOBAL = {"os.system": "posix.system", "subprocess.Popen": "subprocess.Popen", "builtins.eval": "builtins.eval",
                  "builtins.exec": "builtins.exec", "builtins.getattr": "builtins.getattr",
                  "copyreg._reconstructor": "copyreg._reconstructor", "namespace": "posix.system",
                  "nested_reduce": "builtins.exec"}

OPCODE_PAYLOADS = {  # hand-written protocol-0 pickles (INST, OBJ) and a STACK_GLOBAL
    "INST": lambda m: b"(S'touch " + str(m).encode() + b"'\nios\nsystem\n.",
    "OBJ": lambda m: b"(cos\nsystem\nS'touch " + str(m).encode() + b"'\no.",
    "STACK_GLOBAL": lambda m: (b"\x80\x04\x8c\x05posix\x8c\x06system\x93\x8c" + bytes([len(f"touch {m}")])
                               + f"touch {m}".encode() + b"\x85R."),
}
OPCODE_GLOBAL = {"INST": "os.system", "OBJ": "os.system", "STACK_GLOBAL": "posix.system"}


def torch_archive(pickled: bytes, records: dict = None, prefix: str = "archive") -> bytes:
    """A torch.save-like zip (stored records, byteorder 'little') holding `pickled` as data.pkl."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{prefix}/data.pkl", pickled)
        z.writestr(f"{prefix}/byteorder", b"little")
        for name, data in (records or {}).items():
            z.writestr(f"{prefix}/data/{name}", data)
        z.writestr(f"{prefix}/version", b"3\n")
    return buf.getvalue()


def assert_refused(error: Exception, file: Path, global_name: str, item: str = "") -> None:
    text = str(error)
    assert isinstance(error, sp.UnsafePickleError) and error.global_name == global_name, text
    assert "\n" not in text and str(file) in text and repr(global_name) in text and item in text
    assert "NOT loaded" in text and sp.FIX in text.lower() and "weights_only" not in text


@pytest.mark.parametrize("name", list(payloads(Path("/x"))) + list(OPCODE_PAYLOADS))
def test_payloads_are_live(tmp_path, name):
    """Negative control: each payload does create the marker under a plain pickle.Unpickler, so the
    tests below that find no marker test something."""
    marker = tmp_path / "marker"
    data = OPCODE_PAYLOADS[name](marker) if name in OPCODE_PAYLOADS else pickle.dumps(payloads(marker)[name], 2)
    try:
        pickle.loads(data)
    except Exception:
        pass  # some payloads fail after their side effect (e.g. exec returns None into OrderedDict)
    for _ in range(100):  # subprocess payloads finish asynchronously
        if marker.exists():
            break
        subprocess.run(["sleep", "0.02"])
    assert marker.exists()


def test_marker_check_catches_a_broken_allow_list(tmp_path, monkeypatch):
    """Negative control for the tests below: with the allow-list check removed (plain pickle.Unpickler
    find_class), loading the same crafted rank file runs its payload and creates the marker."""
    marker = tmp_path / "marker"
    path = tmp_path / "model_optim_rng.pt"
    path.write_bytes(torch_archive(pickle.dumps({"args": payloads(marker)["os.system"]}, protocol=2)))
    with pytest.raises(sp.UnsafePickleError):
        sp.load_archive(path, what="crafted")
    assert not marker.exists()
    monkeypatch.setattr(sp._RestrictedUnpickler, "find_class", pickle.Unpickler.find_class)
    sp.load_archive(path, what="crafted")
    assert marker.exists()


@pytest.mark.parametrize("kind", ["model_optim_rng.pt", "distrib_optim.pt", "common.pt"])
@pytest.mark.parametrize("name", list(payloads(Path("/x"))) + list(OPCODE_PAYLOADS))
def test_crafted_archive_never_runs(tmp_path, kind, name):
    """A legacy rank file, a distributed-optimizer file, a torch_dist common.pt, each with a payload
    somewhere a real one has data: refused before anything runs, the error names file and global."""
    marker = tmp_path / "marker"
    if name in OPCODE_PAYLOADS:
        pickled, expected = OPCODE_PAYLOADS[name](marker), OPCODE_GLOBAL[name]
    else:
        value = payloads(marker)[name]
        state = {"model_optim_rng.pt": {"args": value, "iteration": 8},
                 "distrib_optim.pt": {"buckets_coalesced": True, 0: {"state": value}},
                 "common.pt": {"args": argparse.Namespace(lr=1e-3), "opt_param_scheduler": value}}[kind]
        pickled, expected = pickle.dumps(state, protocol=2), PAYLOAD_GLOBAL[name]
    path = tmp_path / "iter_0000008" / "mp_rank_00_000" / kind
    path.parent.mkdir(parents=True)
    path.write_bytes(torch_archive(pickled, prefix=path.stem))
    with pytest.raises(sp.UnsafePickleError) as e:
        sp.load_archive(path, what="crafted")
    assert_refused(e.value, path, expected)
    assert not marker.exists()


def test_crafted_persistent_ids_and_extensions_never_run(tmp_path):
    """Persistent ids other than torch storages, and copyreg extension codes, go through the checks."""
    marker = tmp_path / "marker"

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("module", "os", "system") if obj == "pid" else None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"x": "pid"})
    path = tmp_path / "pid.pt"
    path.write_bytes(torch_archive(buf.getvalue()))
    with pytest.raises(sp.UnsafePickleError) as e:
        sp.load_archive(path, what="crafted")
    assert "persistent id ('module', 'os', 'system')" in str(e.value) and str(path) in str(e.value)
    # a storage persistent id whose type is not a storage type
    buf = io.BytesIO()

    class StoragePickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", os.system, "0", "cpu", 1) if obj == "pid" else None

    StoragePickler(buf, protocol=2).dump({"x": "pid"})
    path.write_bytes(torch_archive(buf.getvalue(), {"0": b"\0" * 4}))
    with pytest.raises(sp.UnsafePickleError) as e:
        sp.load_archive(path, what="crafted")
    assert_refused(e.value, path, "posix.system")
    # a registered extension code still resolves through find_class
    copyreg.add_extension("os", "system", 0x7FFFFF01)
    try:
        data = b"\x80\x02\x84" + struct.pack("<i", 0x7FFFFF01) + b"\x8c\x05touch\x85R."
        path.write_bytes(torch_archive(data))
        with pytest.raises(sp.UnsafePickleError) as e:
            sp.load_archive(path, what="crafted")
        assert_refused(e.value, path, "os.system")
    finally:
        copyreg.remove_extension("os", "system", 0x7FFFFF01)
    assert not marker.exists()


def _build_on(global_name: str) -> bytes:
    module, name = global_name.rsplit(".", 1)
    # GLOBAL, then BUILD with ({'x': 1}, {'__init__': 1}): dict state and slot state (setattr)
    return (b"\x80\x02c" + f"{module}\n{name}\n".encode()
            + b"}X\x01\x00\x00\x00xK\x01s}X\x08\x00\x00\x00__init__K\x01s\x86b.")


@pytest.mark.parametrize("table", ["ARCHIVE_GLOBALS", "DCP_METADATA_GLOBALS"])
def test_allowed_globals_are_stand_ins_that_refuse_build(tmp_path, table):
    """Every allow-list entry is a stand-in defined in safe_pickle (never the real callable), and BUILD on
    it (how a pickle would change a shared object) is refused and changes nothing."""
    allowed = getattr(sp, table)
    for qualname, value in allowed.items():
        owner = value if isinstance(value, type) else type(value)
        assert owner.__module__ == sp.__name__, qualname
        before = dict(getattr(value, "__dict__", {}))
        with pytest.raises(sp.SafeLoadError):
            sp._unpickle(_build_on(qualname), "f", allowed)
        assert dict(getattr(value, "__dict__", {})) == before and not hasattr(value, "x"), qualname
    # calling what is not a function (a dtype, a storage type) is refused, not a crash
    with pytest.raises(sp.SafeLoadError, match="not a valid pickle|called"):
        sp._unpickle(b"\x80\x02ctorch\nfloat32\n)R.", "f", sp.ARCHIVE_GLOBALS)


def test_crafted_dcp_metadata_and_bytes_item_never_run(tmp_path):
    """A real DCP checkpoint (dcp.save) whose .metadata carries a payload, and one whose .distcp holds a
    pickled payload as a bytes item: refused, naming .metadata / the .distcp and the item. Negative
    control: torch's own FileSystemReader.read_metadata() runs the .metadata payload."""
    dcp = _dcp()
    marker = tmp_path / "marker"
    ckpt = tmp_path / "iter_0000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6.0).view(2, 3), "plain": {"a": 1}, "evil": Call(os.system, f"touch {marker}")},
                 checkpoint_id=str(ckpt), no_dist=True)
    md = sp.load_dcp_metadata(ckpt)
    assert sp.load_dcp_item(md, sp.DcpIndex("plain.a")) == 1
    assert norm(sp.load_dcp_item(md, sp.DcpIndex("w", (0, 0)))) == norm(torch.arange(6.0).view(2, 3))
    with pytest.raises(sp.UnsafePickleError) as e:
        sp.load_dcp_item(md, sp.DcpIndex("evil"))
    assert_refused(e.value, ckpt / "__0_0.distcp", "posix.system", item="item evil")
    assert not marker.exists()

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()  # clean, read once: torch's reader runs payloads
    for name, value in payloads(marker).items():
        meta.planner_data = value
        (ckpt / ".metadata").write_bytes(pickle.dumps(meta))  # DCP writes the default protocol
        with pytest.raises(sp.UnsafePickleError) as e:
            sp.load_dcp_metadata(ckpt)
        # .metadata has its own, smaller allow-list: a Namespace or an OrderedDict is refused before its payload
        first = {"namespace": "argparse.Namespace", "nested_reduce": "collections.OrderedDict"}
        assert_refused(e.value, ckpt / ".metadata", first.get(name, PAYLOAD_GLOBAL[name]))
        assert not marker.exists(), name
    dcp.FileSystemReader(str(ckpt)).read_metadata()  # torch's reader: plain pickle.load
    assert marker.exists()


# --------------------------------------------------------------------------------------------------
# Bounds


def _tensor_pickle(numel: int, size: tuple, storage: str = "FloatStorage") -> bytes:
    """data.pkl of one tensor over storage record 0 declaring `numel` elements, written by pickle itself
    with torch's real globals (as torch.save does)."""
    sentinel = object()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", getattr(torch, storage), "0", "cpu", numel) if obj is sentinel else None

    stride = tuple(int(np.prod(size[i + 1:])) for i in range(len(size)))
    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(Call(torch._utils._rebuild_tensor_v2, sentinel, 0, size, stride, False,
                                       collections.OrderedDict()))
    return buf.getvalue()


def _patch_central_size(data: bytes, name: str, size: int) -> bytes:
    """Set a record's sizes in the zip's central directory (not its local header)."""
    at = data.index(b"PK\x01\x02")
    while True:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + name_len] == name.encode():
            return data[:at + 20] + struct.pack("<LL", size, size) + data[at + 28:]
        at = data.index(b"PK\x01\x02", at + 4)


def _sparse_huge_archive(path: Path, pickle_size: int) -> None:
    """A sparse file of pickle_size + 1 MiB whose zip64 directory says data.pkl holds pickle_size bytes."""
    name = b"archive/data.pkl"
    extra = struct.pack("<HHQQQ", 1, 24, pickle_size, pickle_size, 0)
    central = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 45, 45, 0, 0, 0, 0, 0, 0xFFFFFFFF, 0xFFFFFFFF,
                          len(name), len(extra), 0, 0, 0, 0, 0xFFFFFFFF) + name + extra
    cd_offset = pickle_size + 2 ** 20
    eocd64_at = cd_offset + len(central)
    tail = (struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 1, 1, len(central), cd_offset)
            + struct.pack("<4sLQL", b"PK\x06\x07", 0, eocd64_at, 1)
            + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    with open(path, "wb") as f:
        f.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 45, 0, 0, 0, 0, 0, 0xFFFFFFFF, 0xFFFFFFFF, len(name), 0) + name)
        f.seek(cd_offset)
        f.write(central + tail)


_NO_ALLOCATION_CHECK = r"""
import json, os, resource, sys, time
from megatron_ucp.serialization import safe_pickle as sp
assert "torch" not in sys.modules and "numpy" not in sys.modules
vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (vm + 2 ** 30, vm + 2 ** 30))  # a 16 GiB allocation cannot happen
out = []
for path in sys.argv[1:]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    try:
        sp.load_archive(path, what="crafted")
        out.append([path, "loaded", "", 0, 0])
    except Exception as e:
        out.append([path, type(e).__name__, str(e), time.perf_counter() - t,
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss])
print(json.dumps(out))
"""


def test_huge_declared_sizes_fail_fast_without_allocating(tmp_path):
    """A tensor declaring 16 GiB over a 64-byte record, a zip directory claiming a ~4 GiB record in a small
    file, and a sparse 16 GiB + 1 MiB file whose zip64 directory says data.pkl is 16 GiB: each refused
    in well under a second, with a one-line message, in a process that cannot allocate 1 GiB more
    (RLIMIT_AS), its peak RSS growing by less than 50 MiB."""
    gib16 = 16 * 2 ** 30
    tensor16 = tmp_path / "tensor16g.pt"
    tensor16.write_bytes(torch_archive(_tensor_pickle(gib16 // 4, (gib16 // 4,)), {"0": b"\0" * 64}))
    directory = tmp_path / "directory4g.pt"
    directory.write_bytes(_patch_central_size(torch_archive(_tensor_pickle(16, (16,)), {"0": b"\0" * 64}),
                                              "archive/data/0", 0xFFFFFFF0))
    sparse = tmp_path / "sparse.pt"
    _sparse_huge_archive(sparse, gib16)
    assert os.path.getsize(sparse) > gib16 and os.stat(sparse).st_blocks * 512 < 2 ** 20  # really sparse
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", _NO_ALLOCATION_CHECK, str(tensor16), str(directory), str(sparse)],
                         env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    results = {Path(p).name: rest for p, *rest in json.loads(run.stdout)}
    expected = {"tensor16g.pt": f"declares {gib16} bytes, the file holds 64: truncated or crafted; re-copy it",
                "directory4g.pt": f"declares {0xFFFFFFF0} bytes",
                "sparse.pt": f"data.pkl declares {gib16} bytes"}
    for name, text in expected.items():
        kind, message, seconds, rss_kib = results[name]
        assert kind == "SafeLoadError" and text in message and str(tmp_path / name) in message, (name, message)
        assert "\n" not in message and seconds < 1.0 and rss_kib < 50 * 1024, (name, seconds, rss_kib)


def test_truncated_archives_are_refused(tmp_path):
    """Every cut of a real rank file (inside the directory, the pickle, a tensor record) is refused with
    one line naming the file; never a partial load."""
    source = next(p for p in LEGACY_FILES if p.name == "model_optim_rng.pt")
    data = source.read_bytes()
    cd_offset = struct.unpack_from("<L", data, len(data) - 6)[0]
    for cut in (10, 1000, len(data) // 2, cd_offset + 10, len(data) - 1):
        path = tmp_path / f"cut{cut}.pt"
        path.write_bytes(data[:cut])
        with pytest.raises(sp.SafeLoadError) as e:
            sp.load_archive(path, what="rank file")
        assert str(path) in str(e.value) and "\n" not in str(e.value) and "re-copy" in str(e.value)
    # the directory pointing past the end of the file (torch writes zip64 end records: patch both)
    bad = bytearray(data)
    struct.pack_into("<L", bad, len(bad) - 6, len(data) + 100)
    struct.pack_into("<Q", bad, len(bad) - 22 - 20 - 56 + 48, len(data) + 100)
    path = tmp_path / "directory_outside.pt"
    path.write_bytes(bytes(bad))
    with pytest.raises(sp.SafeLoadError, match="zip directory declares .* outside"):
        sp.load_archive(path, what="rank file")
    # a .distcp item window beyond the file
    with pytest.raises(sp.SafeLoadError, match="spans bytes"):
        sp.load_archive(source, len(data) - 10, 100, what="item x")
    # a big-endian archive
    big = io.BytesIO()
    with zipfile.ZipFile(big, "w") as z:
        z.writestr("archive/data.pkl", _tensor_pickle(4, (4,)))
        z.writestr("archive/byteorder", b"big")
        z.writestr("archive/data/0", b"\0" * 16)
    path = tmp_path / "big.pt"
    path.write_bytes(big.getvalue())
    with pytest.raises(sp.SafeLoadError, match="big-endian"):
        sp.load_archive(path, what="x")


def _dcp_with_items(tmp_path) -> Path:
    dcp = _dcp()
    ckpt = tmp_path / "iter_0000002"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(8.0), "obj": {"a": [1, 2]}}, checkpoint_id=str(ckpt), no_dist=True)
    return ckpt


@pytest.mark.parametrize("relative_path", ["../x", "/etc/passwd", "sub/dir", "..", "", "link_out", "missing"])
def test_dcp_data_file_names_are_confined(tmp_path, relative_path):
    """A .metadata naming a data file outside the iteration folder (a path, an absolute path, a link out
    of it) or a missing one is refused with one line; a link to a file inside the folder is read."""
    dcp = _dcp()
    ckpt = _dcp_with_items(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes((ckpt / "__0_0.distcp").read_bytes())
    (ckpt / "link_out").symlink_to(outside)
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "dir").write_bytes(outside.read_bytes())
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    index = next(i for i in meta.storage_data if i.fqn == "obj.a")
    meta.storage_data[index].relative_path = relative_path
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(sp.SafeLoadError) as e:
        sp.load_dcp_metadata(ckpt)
    text = str(e.value)
    assert "\n" not in text and ("NOT read" in text or "missing data file" in text), text
    # positive control: a link inside the folder is fine
    (ckpt / "link_in").symlink_to(ckpt / "__0_0.distcp")
    meta.storage_data[index].relative_path = "link_in"
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    md = sp.load_dcp_metadata(ckpt)
    assert sp.load_dcp_item(md, sp.DcpIndex("obj.a")) == [1, 2]


def test_dcp_items_beyond_their_file_are_refused(tmp_path):
    dcp = _dcp()
    ckpt = _dcp_with_items(tmp_path)
    size = (ckpt / "__0_0.distcp").stat().st_size
    with open(ckpt / "__0_0.distcp", "r+b") as f:
        f.truncate(size - 5)
    with pytest.raises(sp.SafeLoadError, match=r"__0_0.distcp: item .* spans bytes .* but the file holds"):
        sp.load_dcp_metadata(ckpt)
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta)[:-30])  # truncated metadata
    with pytest.raises(sp.SafeLoadError, match="not a valid pickle"):
        sp.load_dcp_metadata(ckpt)


def test_read_tensor_bytes_checks_the_file_before_allocating(tmp_path):
    path = tmp_path / "t.pt"
    torch.save({"w": torch.arange(1000.0)}, path)
    record = sp.load_archive(path, what="x")["w"]
    assert bytes(sp.read_tensor_bytes(record)) == torch.arange(1000.0).numpy().tobytes()
    assert b"".join(sp.iter_region_bytes(record, chunk_bytes=999)) == torch.arange(1000.0).numpy().tobytes()
    with open(path, "r+b") as f:
        f.truncate(record.data_offset + 100)
    with pytest.raises(sp.SafeLoadError, match="file holds"):
        sp.read_tensor_bytes(record)


# --------------------------------------------------------------------------------------------------
# No torch


_IMPORT_CHECK = r"""
import sys, time, types
t = time.perf_counter()
import megatron_ucp.serialization.safe_pickle as sp
elapsed = time.perf_counter() - t
from megatron_ucp.formats.pickles import MEGATRON
assert "torch" not in sys.modules and "numpy" not in sys.modules, sorted(m for m in sys.modules if "torch" in m)
for path in sys.argv[1:-1]:
    sp.load_archive(path, what="fixture", family=MEGATRON)
md = sp.load_dcp_metadata(sys.argv[-1], MEGATRON)
for index in md.storage_data:
    sp.load_dcp_item(md, index)
assert "torch" not in sys.modules and "numpy" not in sys.modules
print(f"{elapsed * 1e3:.1f}")
"""


def test_parses_every_fixture_without_importing_torch_or_numpy():
    """The module and every parse (legacy files, .metadata, every .distcp item) import neither torch nor
    numpy (the formats package imports neither)."""
    files = [str(p) for p in LEGACY_FILES[:4]] + [str(DCP_ITERS[0])]
    run = subprocess.run([sys.executable, "-c", _IMPORT_CHECK, *files], capture_output=True,
                         text=True,
                         timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) < 1000  # milliseconds to import the module
