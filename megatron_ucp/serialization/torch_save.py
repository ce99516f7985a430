"""torch.save's file format, written without torch.

Writers of checkpoints (the formats/ writers of Megatron's torch_dist and legacy files) produce files that
torch.load reads. Importing torch costs ~1.4 s of every command (about what copying a 1 GiB checkpoint
costs), so the bytes torch.save would write are produced here instead, from plain values, and
tests/test_torch_save.py checks them against torch.save byte for byte.

What torch.save(obj, f) writes (torch 2.x, `_use_new_zipfile_serialization`): a zip archive, every record
stored (no compression), laid out by PyTorch's patched miniz (`caffe2/serialize/inline_container.cc`):

    <prefix>/data.pkl                 the pickle (protocol 2) of obj; each tensor is
                                      `torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False,
                                      OrderedDict())`, its storage a persistent id
                                      ('storage', torch.<Type>Storage, '<key>', 'cpu', numel)
    <prefix>/.format_version          "1"
    <prefix>/.storage_alignment       "64"
    <prefix>/byteorder                "little"
    <prefix>/data/<key>               each storage's bytes, keys '0', '1', ... in pickling order
    <prefix>/version                  "3\\n"
    <prefix>/.data/serialization_id   40 digits (torch's reader only logs it)

Each local header: version 0, flags 0x0808 (data descriptor follows, UTF-8 names; 0x0800 and no
descriptor for an empty record), method 0, time/date/CRC/sizes 0, the name, then an extra field "FB"
<u16 n> and n bytes "Z" so that the record's data starts at a multiple of 64 bytes from the archive's
start. After the data: a data descriptor (signature, CRC-32, size, size). At the end: the central
directory (one entry per record), a zip64 end-of-central-directory record and locator, and the classic
end record. Records of 4 GiB or more (zip64 extra fields) are left to torch itself (imported then).

`prefix` is "archive" when torch.save writes to a stream (DCP items, megatron-core's common.pt writes
name it after the file: "common").

Tensors are given as `SavedTensor` (raw C-order bytes, dtype name, shape); other values are pickled as
Python's pickle does, with stand-ins for classes this process does not import: `GlobalRef` (a class or
function by its qualified name), `EnumMember` (an enum member, `cls(value)` on load), `Obj` (an instance
as pickle writes a dataclass: NEWOBJ, then BUILD of its state), `TorchSize`, and safe_pickle.TorchDType
(pickled as the torch dtype of its name). `cast_float32` converts float32 values to bfloat16/float16 bits
as torch's `.to()` rounds them.

`save_streamed(obj, file, prefix)` writes the same bytes to a file record by record, each `StreamedTensor`'s
storage produced chunk by chunk while its record is written (its CRC-32 computed on the way): the legacy
writer's files, whatever their size, in the memory of one chunk. Past zip32 it leaves the framing to torch's
own zip writer and fills the storages into the holes that leaves (CRC-32s 0 there, as under skip_data).

`tensor_archive(shape, dtype)` is the framing of one tensor's archive without its data (what the
direct writer fills by copying bytes file to file): `head + <data> + tail`, as torch.save writes it
under `torch.serialization.skip_data()` (the data record's CRC-32 is 0 there, torch's reader does not
check CRC-32s).
"""

from __future__ import annotations

import copyreg
import functools
import io
import math
import pickle
import secrets
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from megatron_ucp.core.dtypes import ITEMSIZE, TYPED_STORAGES
from megatron_ucp.serialization.safe_pickle import TorchDType

ALIGNMENT = 64  # torch's kFieldAlignment: every record's data starts at a multiple of it
FILE_FORMAT_VERSION = b"3\n"  # the "version" record (torch's kProducedFileFormatVersion)
_ZIP32_LIMIT = 0xFFFFFFFF  # records and offsets at or above this need zip64 fields: torch frames those
STORAGE_TYPES = {dtype: name for name, dtype in TYPED_STORAGES.items()}  # dtype name -> torch.<Name>Storage


class TorchSaveError(ValueError):
    """A value this module cannot write as torch.save would."""


# --------------------------------------------------------------------------------------------------
# Stand-ins for values of classes that are not imported here


class GlobalRef:
    """A class or function named by its module and name, pickled as that global (GLOBAL opcode) without
    importing the module: DCP's classes, a family's enums, torch's dtypes and rebuild functions. One instance
    per name, so that pickle's memo refers back to it (BINGET) where the real object would be memoized."""

    _interned: dict[str, "GlobalRef"] = {}

    def __new__(cls, qualified: str):
        ref = cls._interned.get(qualified)
        if ref is None:
            ref = cls._interned[qualified] = super().__new__(cls)
            ref.module, ref.name = qualified.rsplit(".", 1)
        return ref

    def __call__(self, *args):  # pickle's save_reduce wants a callable; only its reference is written
        raise TypeError(f"{self.module}.{self.name} is only a reference for pickling")

    def __repr__(self) -> str:
        return f"GlobalRef({self.module}.{self.name})"


class EnumMember:
    """A member of an enum class (a GlobalRef), unpickled as `cls(value)`."""

    def __init__(self, cls: GlobalRef, value: Any):
        self.cls, self.value = cls, value

    def __reduce__(self):
        return self.cls, (self.value,)


class Obj:
    """An instance of the class `cls` (a GlobalRef) as pickle writes a dataclass: NEWOBJ of the class, then
    BUILD with `state` (the __dict__, or what the class's __getstate__ returns)."""

    def __init__(self, cls: GlobalRef, state: Any):
        self.cls, self.state = cls, state


class TorchSize(tuple):
    """torch.Size, pickled as torch.Size.__reduce__ does: the class applied to a tuple."""

    def __reduce__(self):
        return _TORCH_SIZE, (tuple(self),)


def torch_dtype(name: str) -> GlobalRef:
    """A torch dtype ("float32" or "torch.float32"), pickled as torch pickles it: the global torch.float32."""
    name = str(name).replace("torch.", "")
    if name not in ITEMSIZE:
        raise TorchSaveError(f"unknown torch dtype {name!r}")
    return GlobalRef(f"torch.{name}")


@dataclass(frozen=True, eq=False)
class SavedTensor:
    """A CPU tensor for torch.save: `data` is its C-order bytes (little endian; None: not given, for framing
    only), `dtype` a torch dtype name."""

    data: Optional[bytes]
    dtype: str
    shape: tuple

    def __post_init__(self):
        if self.dtype not in STORAGE_TYPES:
            raise TorchSaveError(f"tensors of dtype {self.dtype} are not written by this module")
        if self.data is not None and len(self.data) != math.prod(self.shape) * ITEMSIZE[self.dtype]:
            raise TorchSaveError(f"{len(self.data)} bytes for a {self.dtype} tensor of shape {self.shape}")

    @classmethod
    def of(cls, data, dtype: str, shape: Optional[tuple] = None) -> "SavedTensor":
        """From bytes or a numpy array (its bytes; shape from the array unless given)."""
        if shape is None:
            shape = tuple(getattr(data, "shape", (len(data) // ITEMSIZE[dtype],)))
        raw = data.tobytes() if hasattr(data, "tobytes") else bytes(data)
        return cls(raw, dtype, tuple(int(n) for n in shape))


@dataclass(frozen=True, eq=False)
class StreamedTensor:
    """A CPU tensor for `save_streamed` whose C-order bytes are produced only when its storage record is
    written: `chunks()` yields them in order (bytes-like values, any split, `nbytes` in all), so a writer
    holds one chunk, never the tensor. A chunk may also be an object that writes itself into the file
    (`nbytes`, `copy_into(fd, pos, crc) -> crc`: e.g. universal_pieces.StoredRun, file to file). `dtype` a
    torch dtype name."""

    dtype: str
    shape: tuple
    chunks: Callable[[], Iterable[Any]]

    def __post_init__(self):
        if self.dtype not in STORAGE_TYPES:
            raise TorchSaveError(f"tensors of dtype {self.dtype} are not written by this module")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


class _Storage:
    """The storage of one SavedTensor or StreamedTensor (its persistent id names it); `data` None: skipped
    (framing only); callable: StreamedTensor.chunks."""

    def __init__(self, dtype: str, numel: int, data):
        self.dtype, self.numel, self.data = dtype, numel, data
        self.key: Optional[str] = None


_TORCH_SIZE = GlobalRef("torch.Size")
_REBUILD_TENSOR = GlobalRef("torch._utils._rebuild_tensor_v2")


def _strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


class Pickler(pickle._Pickler):  # the pure-Python pickler: its dispatch table can name the stand-ins
    """Protocol-2 pickles of values holding GlobalRef / Obj / SavedTensor stand-ins; tensors' storages become
    persistent ids (collected in `storages`), as torch.save's pickler does."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file, protocol: int = 2):
        super().__init__(file, protocol)
        self.storages: list[_Storage] = []

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            if obj.key is None:
                obj.key = str(len(self.storages))
                self.storages.append(obj)
            return ("storage", GlobalRef(f"torch.{STORAGE_TYPES[obj.dtype]}"), obj.key, "cpu", obj.numel)
        return None

    def _save_ref(self, obj: GlobalRef) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())  # what save_global writes (protocol 2)
        self.memoize(obj)

    def _save_obj(self, obj: Obj) -> None:  # what save_reduce writes for copyreg.__newobj__ (protocol >= 2)
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    def _save_tensor(self, obj) -> None:  # Tensor.__reduce_ex__ of a plain CPU tensor
        numel = math.prod(obj.shape)
        storage = _Storage(obj.dtype, numel, obj.data if isinstance(obj, SavedTensor) else obj.chunks)
        size = tuple(int(n) for n in obj.shape)  # a new tuple per tensor, as Tensor.size() is: never a memo hit
        self.save_reduce(_REBUILD_TENSOR, (storage, 0, size, _strides(obj.shape), False, OrderedDict()), obj=obj)

    def _save_dtype(self, obj: TorchDType) -> None:  # a torch dtype named without torch: the global torch.<name>
        self.save(torch_dtype(obj.name))

    dispatch[GlobalRef] = _save_ref
    dispatch[Obj] = _save_obj
    dispatch[SavedTensor] = _save_tensor
    dispatch[StreamedTensor] = _save_tensor
    dispatch[TorchDType] = _save_dtype


def pickle_bytes(obj: Any, protocol: int = 2) -> bytes:
    """The pickle of a value holding stand-ins but no tensors (DCP's .metadata). Protocol 2 through Python's C
    pickler where the value is made of the stand-ins and plain containers only (`_fast_pickle`: the same
    bytes, ~10x faster: a 64-rank .metadata took 0.6 s in the pure-Python pickler); otherwise, or for another
    protocol, the pure-Python one."""
    if protocol == 2:
        fast = _fast_pickle(obj)
        if fast is not None:
            return fast
    buf = io.BytesIO()
    pickler = Pickler(buf, protocol)
    pickler.dump(obj)
    if pickler.storages:
        raise TorchSaveError("tensors need torch.save's archive (save()), not a bare pickle")
    return buf.getvalue()


# The C pickler writes a class as a GLOBAL only after importing its module and finding the class there, so it
# cannot name DCP's classes without importing torch. `_fast_pickle` gives it stand-ins it can find: for each
# GlobalRef a class in this module, named with a random token, then replaces each such GLOBAL line (written
# once: the memo refers back to it) with the GlobalRef's real one. Protocol 2 has no frames or byte offsets,
# so a line may change length. The token is random per process and each line must occur exactly once, so
# no pickled data (a key, a path) can be taken for a stand-in; if one is not found exactly once, the
# pure-Python pickler writes the value instead.
_TOKEN = secrets.token_hex(8)
_STAND_INS: dict = {}  # GlobalRef -> its class here
_STAND_INS_LOCK = threading.Lock()
_PLAIN = (str, int, float, bool, bytes, type(None))


class _Reduced:
    """A stand-in pickled as `func(*args)` (REDUCE), as EnumMember and TorchSize are."""

    __slots__ = ("func", "args")

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _newobj_reduce(self, protocol):
    return copyreg.__newobj__, (type(self),), self.__dict__["_state"]


def _stand_in(ref: GlobalRef) -> type:
    with _STAND_INS_LOCK:
        cls = _STAND_INS.get(ref)
        if cls is None:
            name = f"_pickled_{_TOKEN}_{len(_STAND_INS)}"
            cls = type(name, (), {"__module__": __name__, "__qualname__": name, "__reduce_ex__": _newobj_reduce})
            globals()[name] = cls
            _STAND_INS[ref] = cls
        return cls


def _fast_pickle(obj: Any) -> Optional[bytes]:
    """pickle_bytes(obj, 2) by the C pickler, or None where the value holds something else than plain values,
    containers and the stand-ins (the pure-Python pickler's case)."""
    memo: dict[int, Any] = {}  # id of an original (alive in `obj` throughout) -> its stand-in
    used: set = set()

    def convert(value):
        if type(value) in _PLAIN:
            return value
        found = memo.get(id(value))
        if found is not None:
            return found
        t = type(value)
        if t is dict:
            out = {}
            memo[id(value)] = out
            for k, v in value.items():
                out[convert(k)] = convert(v)
        elif t is list:
            out = []
            memo[id(value)] = out
            out.extend(convert(v) for v in value)
        elif t is tuple:
            out = tuple(convert(v) for v in value)
        elif t is Obj:
            cls = ref(value.cls)
            out = cls.__new__(cls)
            memo[id(value)] = out
            out.__dict__["_state"] = convert(value.state)
        elif t is GlobalRef:
            out = ref(value)
        elif t is TorchDType:
            out = ref(torch_dtype(value.name))
        elif t is EnumMember:
            out = _Reduced(ref(value.cls), (convert(value.value),))
        elif t is TorchSize:
            out = _Reduced(ref(_TORCH_SIZE), (tuple(convert(v) for v in value),))
        else:
            raise _NotPlain
        memo[id(value)] = out
        return out

    def ref(r) -> type:
        if not isinstance(r, GlobalRef):
            raise _NotPlain
        cls = _stand_in(r)
        used.add(r)
        return cls

    try:
        data = pickle.dumps(convert(obj), protocol=2)
    except (_NotPlain, RecursionError, pickle.PicklingError):
        return None
    for r in used:
        marker = f"c{__name__}\n{_STAND_INS[r].__name__}\n".encode()
        if data.count(marker) != 1:
            return None
        data = data.replace(marker, f"c{r.module}\n{r.name}\n".encode())
    if data.count(_TOKEN.encode()):
        return None
    return data


class _NotPlain(Exception):
    """A value _fast_pickle leaves to the pure-Python pickler."""


# --------------------------------------------------------------------------------------------------
# The archive


class _Archive:
    """PyTorchStreamWriter's zip layout (see the module docstring); parts are bytes, or an int: that many
    bytes of data not written here (a hole the caller fills). With `out` (a binary file) every part is
    written there as it is made instead, and streamed data (a callable yielding chunks) with it."""

    def __init__(self, prefix: str, out=None):
        self.prefix = prefix
        self.out = out
        self.parts: list = []
        self.pos = 0
        self.central: list[bytes] = []
        self.names: list[str] = []
        self.crc_ids: list[int] = []

    def _put(self, part) -> None:
        if self.out is None:
            self.parts.append(part)
        elif isinstance(part, int):
            raise TorchSaveError("a record without its data cannot be written to a file")
        else:
            self.out.write(part)
        self.pos += part if isinstance(part, int) else len(part)

    def _stream(self, name: str, chunks: Callable[[], Iterable[Any]], nbytes: int) -> int:
        """Write a storage's chunks as they are produced; its CRC-32."""
        crc, n = 0, 0
        for chunk in chunks():
            written, crc = _write_chunk(self.out, chunk, crc)
            n += written
        if n != nbytes:
            raise TorchSaveError(f"record {name}: {n} bytes produced, {nbytes} declared")
        self.pos += n
        return crc

    def record(self, name: str, data, nbytes: Optional[int] = None) -> None:
        """One record; `data` None (or, without `out`, a callable): `nbytes` of data left out (CRC-32 0, as
        under torch's skip_data); a callable with `out`: chunks streamed into it."""
        full = f"{self.prefix}/{name}".encode()
        nbytes = len(data) if isinstance(data, (bytes, bytearray)) else int(nbytes)
        if nbytes >= _ZIP32_LIMIT or self.pos >= _ZIP32_LIMIT:
            raise _NeedsZip64(name)
        offset = self.pos
        pad = -(offset + 30 + len(full) + 4) % ALIGNMENT
        crc = 0
        flags = 0x0808 if nbytes else 0x0800
        self._put(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), 4 + pad) + full
                  + b"FB" + struct.pack("<H", pad) + b"Z" * pad)
        if nbytes:
            if callable(data) and self.out is not None:
                crc = self._stream(name, data, nbytes)
            elif data is None or callable(data):
                self._put(nbytes)
            else:
                crc = zlib.crc32(data)
                self._put(data)
            self._put(struct.pack("<IIII", 0x08074B50, crc, nbytes, nbytes))
        self.central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, flags, 0, 0, 0, crc, nbytes, nbytes,
                                        len(full), 0, 0, 0, 0, 0, offset) + full)
        self.names.append(full.decode())
        self.crc_ids.append(crc)

    def finish(self) -> None:
        """The version and serialization id records, the central directory and the end records."""
        self.record("version", FILE_FORMAT_VERSION)
        names = zlib.crc32("\0".join(self.names).encode())
        combined = 0
        for crc in self.crc_ids:
            combined = zlib.crc32(struct.pack("<I", crc), combined)
        # torch's id is a hash of the record names and a combined CRC-32, 20 digits each; its reader only logs it
        self.record(".data/serialization_id", f"{names:020d}{combined:020d}".encode())
        start, count = self.pos, len(self.central)
        for entry in self.central:
            self._put(entry)
        size = self.pos - start
        if self.pos >= _ZIP32_LIMIT:
            raise _NeedsZip64("central directory")
        eocd64 = self.pos
        self._put(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, count, count, size, start))
        self._put(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
        self._put(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, size, start, 0))


class _NeedsZip64(Exception):
    pass


def _write_chunk(file, chunk, crc: int) -> tuple[int, int]:
    """Write one StreamedTensor chunk at `file`'s position: bytes-like, or an object that copies itself in
    (`copy_into(fd, pos, crc) -> crc`, `nbytes`: e.g. file to file). Returns (bytes, CRC-32 continued)."""
    copy_into = getattr(chunk, "copy_into", None)
    if copy_into is None:
        view = memoryview(chunk).cast("B")
        file.write(view)
        return len(view), zlib.crc32(view, crc)
    file.flush()
    pos = file.tell()
    crc = copy_into(file.fileno(), pos, crc)
    file.seek(pos + chunk.nbytes)
    return chunk.nbytes, crc


def _pickled(obj: Any) -> tuple[bytes, list[_Storage]]:
    """data.pkl of torch.save(obj) and the storages it names, in key order."""
    buf = io.BytesIO()
    pickler = Pickler(buf)
    pickler.dump(obj)
    return buf.getvalue(), pickler.storages


def _records(archive: _Archive, pickled: bytes, storages: list[_Storage]) -> _Archive:
    archive.record("data.pkl", pickled)
    archive.record(".format_version", b"1")
    archive.record(".storage_alignment", str(ALIGNMENT).encode())
    archive.record("byteorder", b"little")
    for storage in storages:
        nbytes = storage.numel * ITEMSIZE[storage.dtype]
        archive.record(f"data/{storage.key}", storage.data, nbytes)
    archive.finish()
    return archive


def _archive(obj: Any, prefix: str) -> _Archive:
    """The records of torch.save(obj); a tensor given without data (SavedTensor(None, ...)) leaves a hole."""
    return _records(_Archive(prefix), *_pickled(obj))


def save_streamed(obj: Any, file, prefix: str = "archive") -> int:
    """Write what torch.save(obj, f) writes (apart from the serialization id's digits) to the binary file
    `file`, record by record: each StreamedTensor's bytes are produced and written one chunk at a time, so
    memory holds the pickle and one chunk, whatever the tensors' size. `prefix`: the archive's folder
    (torch.save to a path names it after the file: "model_optim_rng" for model_optim_rng.pt). Returns the
    bytes written.

    Records or offsets of 4 GiB or more need zip64 fields: then torch's own zip writer frames the archive
    (imported then) and the storages are filled into the holes it leaves, as under torch's skip_data (their
    CRC-32s 0: torch's reader and safe_pickle do not check them; the prefix is torch's "archive")."""
    pickled, storages = _pickled(obj)
    try:  # framing only, before a byte is written: does it fit zip32?
        _records(_Archive(prefix), pickled, storages)  # streamed storages are holes here
    except _NeedsZip64:
        return _save_streamed_by_torch(pickled, storages, file)
    return _records(_Archive(prefix, out=file), pickled, storages).pos


def _save_streamed_by_torch(pickled: bytes, storages: list[_Storage], file) -> int:
    """torch's zip writer (zip64 fields where needed) writes the records, each storage's data skipped
    (write_record_metadata, as torch.save under skip_data() does); the holes are then filled in order."""
    import torch

    start = file.tell()

    class Sink:  # torch's writes pass through to `file`; its forward seeks are the storages' holes
        def __init__(self):
            self.holes: list[tuple[int, int]] = []

        def write(self, data) -> int:
            return file.write(data)

        def tell(self) -> int:
            return file.tell() - start

        def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
            target = offset if whence == io.SEEK_SET else self.tell() + offset
            if target < self.tell():
                raise TorchSaveError("torch's zip writer seeked backwards")
            if target > self.tell():
                self.holes.append((self.tell(), target - self.tell()))
                file.seek(start + target)
            return target

        def flush(self) -> None:
            file.flush()

    sink = Sink()
    writer = torch._C.PyTorchFileWriter(sink, True, ALIGNMENT)
    writer.write_record("data.pkl", pickled, len(pickled))
    writer.write_record(".format_version", "1", 1)
    writer.write_record(".storage_alignment", str(ALIGNMENT), len(str(ALIGNMENT)))
    writer.write_record("byteorder", "little", len("little"))
    filled = [s for s in storages if s.numel]
    for storage in storages:
        writer.write_record_metadata(f"data/{storage.key}", storage.numel * ITEMSIZE[storage.dtype])
    writer.write_end_of_file()
    end = file.tell()
    if [n for _, n in sink.holes] != [s.numel * ITEMSIZE[s.dtype] for s in filled]:
        raise TorchSaveError(f"torch's zip writer skipped {[n for _, n in sink.holes]} bytes, expected the "
                             f"storages' {[s.numel * ITEMSIZE[s.dtype] for s in filled]}")
    for (at, nbytes), storage in zip(sink.holes, filled):
        file.seek(start + at)
        n = 0
        for chunk in (storage.data() if callable(storage.data) else (storage.data,)):
            n += _write_chunk(file, chunk, 0)[0]
        if n != nbytes:
            raise TorchSaveError(f"data/{storage.key}: {n} bytes produced, {nbytes} declared")
    file.seek(end)
    return end - start


def save_bytes(obj: Any, prefix: str = "archive") -> bytes:
    """What torch.save(obj, f) writes (tensors as SavedTensor), apart from the serialization id's digits."""
    try:
        parts = _archive(obj, prefix).parts
    except _NeedsZip64:
        raise TorchSaveError("a record of 4 GiB or more needs torch.save's zip64 framing") from None
    if any(isinstance(p, int) for p in parts):
        raise TorchSaveError("a tensor without its data (SavedTensor(None, ...)) is framing only: use tensor_archive")
    return b"".join(parts)


@dataclass(frozen=True)
class TensorArchive:
    """torch.save(tensor) framing: `head`, then `nbytes` of tensor data, then `tail`."""

    shape: tuple[int, ...]
    dtype: str
    head: bytes
    tail: bytes

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @property
    def data_offset(self) -> int:
        """Offset of the tensor's first byte from the start of the archive."""
        return len(self.head)

    @property
    def length(self) -> int:
        return len(self.head) + self.nbytes + len(self.tail)


def tensor_archive(shape: tuple[int, ...], dtype) -> TensorArchive:
    """The framing of torch.save(tensor) (to a stream) for a C-contiguous tensor of `shape` and `dtype` (a
    name, "float32", or anything whose str() is torch's spelling), cached."""
    return _tensor_archive(tuple(int(n) for n in shape), str(dtype).replace("torch.", ""))


@functools.lru_cache(maxsize=4096)
def _tensor_archive(shape: tuple[int, ...], dtype: str) -> TensorArchive:
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    try:
        parts = _archive(SavedTensor(None, dtype, shape), "archive").parts
    except _NeedsZip64:  # >= 4 GiB: torch's own writer frames it (zip64 extra fields)
        return _torch_framing(shape, dtype)
    holes = [i for i, p in enumerate(parts) if isinstance(p, int)]
    if not nbytes:
        return TensorArchive(shape, dtype, b"".join(parts), b"")
    (hole,) = holes
    return TensorArchive(shape, dtype, b"".join(parts[:hole]), b"".join(parts[hole + 1:]))


def _torch_framing(shape: tuple, dtype: str) -> TensorArchive:
    """torch.save's framing of a tensor too large for zip32 records, from torch itself under skip_data()."""
    import torch

    class Recorder(io.RawIOBase):
        def __init__(self):
            super().__init__()
            self.parts, self.pos = [], 0

        def writable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return True

        def tell(self) -> int:
            return self.pos

        def write(self, data) -> int:
            self.parts.append(bytes(data))
            self.pos += len(data)
            return len(data)

        def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
            target = offset if whence == io.SEEK_SET else self.pos + offset
            if target < self.pos:
                raise TorchSaveError("torch.save seeked backwards while framing a tensor archive")
            if target > self.pos:
                self.parts.append(target - self.pos)
            self.pos = target
            return self.pos

    recorder = Recorder()
    with torch.serialization.skip_data():
        torch.save(torch.empty(shape, dtype=getattr(torch, dtype)), recorder)
    holes = [i for i, p in enumerate(recorder.parts) if isinstance(p, int)]
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if len(holes) != 1 or recorder.parts[holes[0]] != nbytes:
        raise TorchSaveError(f"torch.save of a {dtype} tensor of shape {shape} under skip_data skipped "
                             f"{[recorder.parts[i] for i in holes]} bytes, expected {nbytes}")
    hole = holes[0]
    return TensorArchive(shape, dtype, b"".join(recorder.parts[:hole]), b"".join(recorder.parts[hole + 1:]))


def cast_float32(values, dtype: str):
    """float32 numpy values as the bits of `dtype` ("float32", "bfloat16", "float16"), as torch's CPU
    `Tensor.to(dtype)` (torch 2.13) converts them: round to nearest even, overflow to infinity; a NaN becomes
    0xFFFF in bfloat16 (torch's vectorised conversion), and a quiet NaN keeping its payload's top bits in
    float16. tests/test_torch_save.py compares every case with torch."""
    import numpy as np

    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "float32":
        return values.view(np.uint32)
    nan = np.isnan(values)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            out = values.astype(np.float16).view(np.uint16)
        if nan.any():  # torch: quiet NaN, sign and the payload's top 10 bits kept
            bits = values.view(np.uint32)[nan]
            out[nan] = (((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)).astype(np.uint16)
        return out
    if dtype == "bfloat16":
        # round to nearest even in uint32, in place: bits + 0x7FFF + lsb stays below 2**32 for every non-NaN
        # (at most 0xFF808000, -inf's), NaNs are overwritten below (uint64 temporaries made it 20x slower)
        bits = values.view(np.uint32)
        rounded = bits >> 16
        rounded &= 1
        rounded += 0x7FFF
        rounded += bits
        rounded >>= 16
        out = rounded.astype(np.uint16)
        if nan.any():
            out[nan] = 0xFFFF
        return out
    raise TorchSaveError(f"float32 values are not cast to {dtype} here")
