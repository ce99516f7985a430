"""Reading torch.save archives and DCP's `.metadata` without torch and without running their code.

Generic torch serialization: nothing here knows Megatron. What a family of packages adds to the pickles it
writes (its enums, the namespaces of its classes, its subclasses of DCP's records) comes in as a `PickleFamily`
value from the caller (formats/pickles.py spells Megatron's); without one only torch's, numpy's and the standard
library's plain values load.

- `load_archive` parses a torch.save zip archive (a whole file, or one `.distcp` item at [offset,
  offset + length)) with a small zip reader of its own and runs a restricted unpickler on its
  `data.pkl`. Every tensor comes back as a `TensorRecord`: where its bytes are in the file, never
  the bytes themselves. Every size the archive declares is checked against the file first.
- `load_dcp_metadata` reads `iter_dir/.metadata` into plain frozen records (`DcpMetadata`) and checks
  that every data file it names is a plain file of iter_dir holding the bytes it points to.
- `read_tensor_bytes`, `iter_region_bytes` and `to_torch` (torch imported lazily) read tensor bytes;
  `materialize` turns a loaded tree into what torch.load(weights_only=True) would have given.

The unpickler knows an explicit allow-list of globals (`ARCHIVE_GLOBALS`, `DCP_METADATA_GLOBALS`, plus the
family's enums), each mapped to a stand-in written here, never to the real callable: calling or building a
stand-in only makes data. A class of the family's packages (`PickleFamily.namespaces`) that is not on the list (a
newer release's enum or dataclass) loads as an `InertRecord`: its class path, arguments and state as data, the
class never imported (named with --debug). A pickle naming anything else (os, builtins, subprocess, ...) raises
`UnsafePickleError` before anything runs.
Stand-ins refuse BUILD (pickle's `__setstate__`) except where one is part of the format (a Namespace,
a numpy array, a DCP record, each on its own fresh object), so no pickle can alter a shared object.
This module imports neither torch nor numpy; `to_torch` and `NumpyArray.to_numpy` import them on use.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import functools
import io
import logging
import os
import pathlib
import pickle
import reprlib
import stat
import struct
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Union

from megatron_ucp.core.dtypes import FLOAT_DTYPES, ITEMSIZE, TYPED_STORAGES

__all__ = [
    "ARCHIVE_GLOBALS", "DCP_METADATA_GLOBALS", "TORCH", "ByteRegion", "DcpBytesMeta", "DcpChunk", "DcpIndex", "DcpMetadata",
    "DcpStorageItem", "DcpTensorMeta", "InertRecord", "NumpyArray", "NumpyDType", "PickleFamily", "PickledEnum", "SafeLoadError", "StorageRef",
    "TensorRecord", "TorchDType", "TorchDevice", "UnsafePickleError", "inert_class", "is_class_path", "iter_region_bytes", "load_archive",
    "load_dcp_item", "load_dcp_metadata", "materialize", "read_scalar", "read_tensor_bytes", "to_torch",
]

FIX = "re-copy the checkpoint from a trusted source; megatron-ucp never disables this check"
RECOPY = "truncated or crafted; re-copy it"
MAX_PICKLE_BYTES = 1 << 30  # a data.pkl or .metadata larger than this is refused before it is read
READ_CHUNK_BYTES = 4 * 2 ** 20  # bounded reads of tensor bytes
_SMALL_WINDOW = 64 * 1024  # archives up to this size are read with one pread
_log = logging.getLogger(__name__)


class SafeLoadError(ValueError):
    """A checkpoint file that was refused; the message is one line naming the file, the cause and the fix."""


class UnsafePickleError(SafeLoadError):
    """A pickle asked for a global outside the allow-list (it could run code); nothing was loaded."""

    def __init__(self, message: str, where: str = "", global_name: str = ""):
        super().__init__(message)
        self.where = where
        self.global_name = global_name


def _unsafe(where: str, global_name: str, holder: str) -> UnsafePickleError:
    return UnsafePickleError(
        f"{where}: tried to run code: its pickle loads {global_name!r}, which is outside the allow-list of what "
        f"{holder} holds; the file was NOT loaded and nothing in it ran. {FIX[0].upper()}{FIX[1:]}.",
        where, global_name)


class _Malformed(Exception):
    """Raised by stand-ins and the zip reader; load functions turn it into a SafeLoadError naming the file."""


def _expect(ok: bool, message: Union[str, Callable[[], str]]) -> None:
    if not ok:  # messages are lambdas where formatting them costs (a repr): only on failure
        raise _Malformed(message() if callable(message) else message)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_tuple(x: Any, what: str) -> tuple[int, ...]:
    if type(x) is list:
        x = tuple(x)
    # type(v) is int for every v (bool excluded), all >= 0: checked in C, this runs for every shape and chunk
    if type(x) is not tuple or x and (not _INT_TYPE.issuperset(map(type, x)) or min(x) < 0):
        raise _Malformed(f"{what} is {_short(x)}, not a tuple of non-negative integers")
    return x


_INT_TYPE = frozenset({int})


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _short(x: Any) -> str:
    """A bounded repr for messages (a crafted pickle can hold deep or huge values)."""
    try:
        text = _REPR.repr(x)
    except Exception:  # a repr that fails, or recursion
        text = f"<{type(x).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse_build(self, state) -> None:
    raise _Malformed(f"the pickle tries to change a {type(self).__name__} after it was made (BUILD)")


def _frozen_record(cls):
    """A frozen slotted dataclass that refuses pickle's BUILD and pickles itself by its fields.
    (Python adds a __setstate__ to frozen slotted dataclasses that sets fields; ours refuses.)"""
    cls.__setstate__ = _refuse_build

    def __reduce__(self):
        return type(self), tuple(getattr(self, f.name) for f in fields(self))

    cls.__reduce__ = __reduce__
    return dataclass(frozen=True, slots=True)(cls)


# --------------------------------------------------------------------------------------------------
# Records the unpickler returns


class ByteRegion(NamedTuple):
    """`nbytes` bytes of `path` from `offset` (the fields of io.byteio.FileRegion)."""

    path: str
    offset: int
    nbytes: int




@_frozen_record
class TensorRecord:
    """A saved tensor, as the archive describes it: `shape`/`stride`/`storage_offset` (elements) over a
    storage record of `storage_nbytes` bytes that starts at byte `data_offset` of `path` (absolute)."""

    dtype: str  # torch dtype name: 'float32', 'bfloat16', ...
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_key: str  # the archive's record name is <archive>/data/<storage_key>
    path: str
    data_offset: int
    storage_nbytes: int

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def is_c_contiguous(self) -> bool:
        """torch's is_contiguous(): size-1 dimensions may have any stride."""
        expected = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride)):
            if size == 0:
                return True
            if size != 1 and step != expected:
                return False
            expected *= size
        return True

    def region(self) -> Optional[ByteRegion]:
        """(path, offset, nbytes) of the tensor's C-order bytes, or None when it is not C-contiguous."""
        if not self.is_c_contiguous():
            return None
        return ByteRegion(self.path, self.data_offset + self.storage_offset * self.itemsize, self.nbytes)


@_frozen_record
class StorageRef:
    """A storage record of an archive (what torch.save's persistent ids name); dtype None = untyped bytes."""

    key: str
    dtype: Optional[str]
    path: str
    data_offset: int
    nbytes: int


@_frozen_record
class TorchDType:
    """A torch dtype (e.g. args.params_dtype, a reader's ShardRef.dtype) without torch; str() is torch's
    spelling. It compares equal to the torch dtype of the same name (`ref.dtype == torch.float32`), but
    hashes by its name: as a dict or set key it only meets other TorchDTypes."""

    name: str

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.name]

    @property
    def is_floating_point(self) -> bool:
        return self.name in FLOAT_DTYPES

    def __eq__(self, other) -> bool:
        if isinstance(other, TorchDType):
            return self.name == other.name
        if type(other).__name__ == "dtype" and type(other).__module__ == "torch":  # without importing torch
            return str(other) == f"torch.{self.name}"
        return NotImplemented

    def __str__(self) -> str:
        return f"torch.{self.name}"


@_frozen_record
class TorchDevice:
    type: str
    index: Optional[int] = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


@_frozen_record
class TorchLayout:
    name: str  # 'strided'


@_frozen_record
class TorchMemoryFormat:
    name: str  # 'contiguous_format'


@dataclass(frozen=True, slots=True)
class PickledEnum:
    """An enum member found in a pickle, kept as (class path, value) without importing its module, e.g.
    PickledEnum('pkg.enums.Color', 5): a dotted class path with a plain value (checked
    when made, also when a pickle makes one). Which enums a load admits is the unpickler's allow-list; writers
    pickle a member again only for the enums of their own family."""

    qualname: str
    value: Any

    def __post_init__(self) -> None:
        _expect(is_class_path(self.qualname), lambda: f"a PickledEnum of {_short(self.qualname)}, not a class path")
        _expect(_is_scalar(self.value), lambda: f"a PickledEnum with value {_short(self.value)}")

    def __setstate__(self, state) -> None:
        # Only PickledEnums pickled by megatron-ucp itself arrive by NEWOBJ + BUILD: fill an empty one, once.
        try:
            self.qualname
        except AttributeError:
            pass
        else:
            _refuse_build(self, state)
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (no __dict__, slot values)
        _expect(isinstance(state, dict) and set(state) == {"qualname", "value"},
                lambda: f"a PickledEnum with state {_short(state)}")
        _expect(is_class_path(state["qualname"]),
                lambda: f"a PickledEnum of {_short(state['qualname'])}, not a class path")
        _expect(_is_scalar(state["value"]), lambda: f"a PickledEnum with value {_short(state['value'])}")
        object.__setattr__(self, "qualname", state["qualname"])
        object.__setattr__(self, "value", state["value"])

    def __reduce__(self):
        return PickledEnum, (self.qualname, self.value)


def _is_scalar(x: Any) -> bool:
    return x is None or isinstance(x, (bool, int, float, str))


def is_class_path(qualname: Any) -> bool:
    """A dotted path of Python identifiers (`pkg.module.Class`), ASCII only."""
    return isinstance(qualname, str) and "." in qualname and qualname.isascii() and all(
        part.isidentifier() for part in qualname.split("."))


class InertRecord:
    """An object of a class of the family's packages that megatron-ucp does not know, kept as data: the class path, the
    arguments the pickle gave it (REDUCE / NEWOBJ) and the state it set (BUILD, once). The class is never
    imported and nothing of it runs; readers that need a value check what they find, as for any record.
    A single scalar argument and no state is how an enum member pickles: `enum_value` gives it."""

    __slots__ = ("args", "kwargs", "state")
    qualname = ""

    def __new__(cls, *args, **kwargs):
        _expect(cls is not InertRecord, "an InertRecord without a class")
        self = object.__new__(cls)
        self.args, self.kwargs, self.state = args, kwargs, None
        return self

    def __init__(self, *args, **kwargs) -> None:  # REDUCE calls the class: __new__ kept the arguments
        pass

    def __setstate__(self, state) -> None:
        _expect(self.state is None and state is not None,
                lambda: f"the pickle sets {self.qualname} to {_short(state)} twice")
        self.state = state

    @property
    def enum_value(self) -> Any:
        """The member's value when this looks like an enum member (one scalar argument, no state), else None."""
        if len(self.args) == 1 and not self.kwargs and self.state is None and _is_scalar(self.args[0]):
            return self.args[0]
        return None

    def __eq__(self, other) -> bool:
        return (isinstance(other, InertRecord) and other.qualname == self.qualname
                and (self.args, self.kwargs, self.state) == (other.args, other.kwargs, other.state))

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<inert {self.qualname}{_short(self.args)}>"


def inert_class(qualname: str) -> type:
    """A fresh InertRecord subclass standing in for the unknown class `qualname` (one per load: no pickle can
    reach a class another load uses)."""
    _expect(is_class_path(qualname), lambda: f"an inert record of {_short(qualname)}")
    return type(qualname.rsplit(".", 1)[1], (InertRecord,), {"__slots__": (), "qualname": qualname})


class NumpyDType:
    """A numpy dtype as pickled (numpy.dtype(spec, align, copy) then BUILD with its byte order)."""

    __slots__ = ("kind", "size", "byteorder", "_built")

    def __init__(self, spec: str):
        _expect(isinstance(spec, str) and spec in _NUMPY_SPECS,
                lambda: f"numpy dtype {_short(spec)} (only plain numbers are read)")
        object.__setattr__(self, "kind", spec[0])
        object.__setattr__(self, "size", int(spec[1:]))
        object.__setattr__(self, "byteorder", "|" if int(spec[1:]) == 1 else "=")
        object.__setattr__(self, "_built", False)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __setstate__(self, state) -> None:
        _expect(not self._built, "the pickle changes a numpy dtype twice")
        _expect(isinstance(state, tuple) and len(state) == 8 and state[0] == 3 and state[1] in ("<", ">", "|", "=")
                and state[2:5] == (None, None, None),
                lambda: f"numpy dtype state {_short(state)} (only plain numbers are read)")
        object.__setattr__(self, "byteorder", state[1])
        object.__setattr__(self, "_built", True)

    @property
    def str(self) -> str:
        """numpy's dtype.str, e.g. '<u4'."""
        order = "|" if self.size == 1 else ("<" if self.byteorder in ("=", "|") else self.byteorder)
        return f"{order}{self.kind}{self.size}"

    def __repr__(self) -> str:
        return f"NumpyDType({self.str!r})"


# numpy dtypes read: plain numbers (no strings, objects or records)
_NUMPY_SPECS = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"})


class NumpyArray:
    """A numpy array as pickled (numpy's _reconstruct, then BUILD with shape, dtype and raw bytes), e.g. the
    Mersenne-Twister keys of an RNG state. `to_numpy()` imports numpy."""

    __slots__ = ("shape", "dtype", "fortran_order", "data", "_built")

    def __init__(self):
        for name, value in (("shape", (0,)), ("dtype", None), ("fortran_order", False), ("data", b""),
                            ("_built", False)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __setstate__(self, state) -> None:
        _expect(not self._built, "the pickle changes a numpy array twice")
        _expect(isinstance(state, tuple) and len(state) == 5 and state[0] == 1,
                lambda: f"numpy array state {_short(state)}")
        _, shape, dtype, fortran, data = state
        shape = _int_tuple(shape, "a numpy array's shape")
        _expect(isinstance(dtype, NumpyDType),
                lambda: f"numpy array of dtype {_short(dtype)} (only plain numbers are read)")
        _expect(isinstance(fortran, bool), lambda: f"numpy array order flag {_short(fortran)}")
        _expect(isinstance(data, (bytes, bytearray)), "a numpy array of Python objects (only plain numbers are read)")
        n = 1
        for s in shape:
            n *= s
        _expect(len(data) == n * dtype.size,
                lambda: f"a numpy array of shape {shape} ({dtype.str}) declares {n * dtype.size} bytes but holds "
                        f"{len(data)}")
        for name, value in (("shape", shape), ("dtype", dtype), ("fortran_order", fortran), ("data", bytes(data)),
                            ("_built", True)):
            object.__setattr__(self, name, value)

    def to_numpy(self):
        import numpy

        return numpy.frombuffer(self.data, dtype=numpy.dtype(self.dtype.str)).reshape(
            self.shape, order="F" if self.fortran_order else "C").copy()

    def __repr__(self) -> str:
        return f"NumpyArray(shape={self.shape}, dtype={self.dtype!r})"


class _Namespace(argparse.Namespace):
    """argparse.Namespace whose BUILD only sets attributes from a dict of names (a training run's `args`)."""

    def __setstate__(self, state) -> None:
        # attribute names only: no dunders, nothing that would shadow a Namespace method
        _expect(isinstance(state, dict) and all(isinstance(k, str) and not k.startswith("__")
                                                and k not in _NAMESPACE_NAMES for k in state),
                lambda: f"an argparse.Namespace with state {_short(state)}")
        self.__dict__.update(state)

    def __reduce__(self):
        return argparse.Namespace, (), dict(self.__dict__)


_NAMESPACE_NAMES = frozenset(dir(argparse.Namespace))


class _BytesIO(io.BytesIO):
    """io.BytesIO as pickled (Transformer Engine's extra state in older versions): bytes, position, no attributes."""

    def __setstate__(self, state) -> None:
        _expect(isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], (bytes, bytearray))
                and _is_int(state[1]) and 0 <= state[1] <= len(state[0]) and state[2] in (None, {}),
                lambda: f"an io.BytesIO with state {_short(state)}")
        _expect(self.tell() == 0 and not self.getvalue(), "the pickle changes an io.BytesIO twice")
        self.write(state[0])
        self.seek(state[1])


# --------------------------------------------------------------------------------------------------
# Stand-ins the allow-list maps globals to


class _Global:
    """An allowed global as the unpickler hands it out: calling it runs a stand-in written here."""

    __slots__ = ("name", "_make")

    def __init__(self, name: str, make: Callable):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_make", make)

    def __call__(self, *args):  # pickle passes positional arguments only
        try:
            return self._make(*args)
        except TypeError as e:  # wrong number of arguments
            raise _Malformed(f"{self.name}{_short(args)}: {e}") from None

    def __setattr__(self, name, value):
        raise AttributeError(f"{self.name} is read-only")

    __setstate__ = _refuse_build

    def __repr__(self) -> str:
        return f"<stand-in for {self.name}>"


class _Marker:
    """An allowed global that is only ever an argument (torch.FloatStorage, numpy.ndarray, torch.Tensor)."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: Optional[str] = None):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", dtype)

    def __setattr__(self, name, value):
        raise AttributeError(f"{self.name} is read-only")

    __setstate__ = _refuse_build

    def __repr__(self) -> str:
        return f"<stand-in for {self.name}>"


_UNTYPED_STORAGE = _Marker("torch.UntypedStorage")
_TENSOR_TYPES = (_Marker("torch.Tensor"), _Marker("torch.nn.parameter.Parameter"))
_NDARRAY = _Marker("numpy.ndarray")


def _tensor(storage: Any, dtype: str, storage_offset: Any, size: Any, stride: Any, backward_hooks: Any,
            metadata: Any) -> TensorRecord:
    _expect(isinstance(storage, StorageRef), lambda: f"a tensor over {_short(storage)}, not over a storage record")
    shape = _int_tuple(size, "a tensor's shape")
    strides = _int_tuple(stride, "a tensor's stride")
    _expect(len(shape) == len(strides), lambda: f"a tensor of shape {shape} with stride {strides}")
    _expect(_is_int(storage_offset) and storage_offset >= 0,
            lambda: f"a tensor at storage offset {_short(storage_offset)}")
    _expect(isinstance(backward_hooks, dict) and not backward_hooks, "a tensor with backward hooks")
    _expect(metadata is None or isinstance(metadata, dict) and not any(metadata.values()),
            lambda: f"a tensor with conjugate/negative bits {_short(metadata)} (not plain values)")
    itemsize = ITEMSIZE[dtype]
    if 0 in shape:
        needed = 0
    else:
        needed = (storage_offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides))) * itemsize
    _expect(needed <= storage.nbytes,
            lambda: f"a {dtype} tensor of shape {shape} (stride {strides}, offset {storage_offset}) in storage record "
            f"{storage.key} declares {needed} bytes, the file holds {storage.nbytes}: {RECOPY}")
    return TensorRecord(dtype, shape, strides, storage_offset, storage.key, storage.path, storage.data_offset,
                        storage.nbytes)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    _expect(isinstance(storage, StorageRef) and storage.dtype is not None,
            lambda: f"_rebuild_tensor_v2 over {_short(storage)}, not a typed storage")
    return _tensor(storage, storage.dtype, storage_offset, size, stride, backward_hooks, metadata)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    _expect(isinstance(storage, StorageRef) and storage.dtype is None,
            lambda: f"_rebuild_tensor_v3 over {_short(storage)}, not an untyped storage")
    _expect(isinstance(dtype, TorchDType), lambda: f"_rebuild_tensor_v3 with dtype {_short(dtype)}")
    return _tensor(storage, dtype.name, storage_offset, size, stride, backward_hooks, metadata)


def _rebuild_parameter(data, requires_grad, backward_hooks, state=None):
    _expect(isinstance(data, TensorRecord), lambda: f"a Parameter of {_short(data)}, not a tensor")
    _expect(isinstance(backward_hooks, dict) and not backward_hooks, "a Parameter with backward hooks")
    return data  # Python attributes of a Parameter (state) are dropped: the bytes are what is read


def _rebuild_from_type_v2(func, new_type, args, state):
    # torch.save of a tensor with Python attributes: rebuild the plain tensor, drop the attributes
    _expect(any(func is f for f in _TENSOR_REBUILDERS), lambda: f"_rebuild_from_type_v2 with {_short(func)}")
    _expect(any(new_type is t for t in _TENSOR_TYPES), lambda: f"_rebuild_from_type_v2 to {_short(new_type)}")
    _expect(isinstance(args, tuple), lambda: f"_rebuild_from_type_v2 with arguments {_short(args)}")
    return func(*args)


def _torch_size(dims):
    return _int_tuple(dims, "a torch.Size")


def _torch_device(kind, index=None):
    _expect(isinstance(kind, str) and len(kind) < 64 and (index is None or _is_int(index)),
            lambda: f"torch.device{_short((kind, index))}")
    if index is None and ":" in kind:
        kind, _, number = kind.partition(":")
        _expect(number.isdigit(), lambda: f"torch.device({kind}:{number})")
        index = int(number)
    return TorchDevice(kind, index)


_LAYOUTS = {"torch.strided": TorchLayout("strided")}


def _get_layout(name):
    _expect(name in _LAYOUTS, lambda: f"tensor layout {_short(name)} (only strided tensors are read)")
    return _LAYOUTS[name]


def _codecs_encode(text, encoding="utf-8"):
    # protocol-2 pickles spell bytes as _codecs.encode(latin-1 text, 'latin1')
    _expect(isinstance(text, str) and encoding in ("latin1", "latin-1"),
            lambda: f"_codecs.encode{_short((text, encoding))}")
    return text.encode("latin-1")


def _ordered_dict(items=()):
    _expect(isinstance(items, (dict, list, tuple)), lambda: f"OrderedDict({_short(items)})")
    return OrderedDict(items)


def _simple_namespace():
    return types.SimpleNamespace()


def _posix_path(*parts):
    _expect(all(isinstance(p, str) for p in parts), lambda: f"PosixPath{_short(parts)}")
    return pathlib.PosixPath(*parts)  # a fresh object: building it touches no file


def _collection(kind):
    def make(items=()):
        _expect(isinstance(items, (list, tuple, set, frozenset)), lambda: f"{kind.__name__}({_short(items)})")
        return kind(items)

    return make


def _complex(real=0.0, imag=0.0):
    _expect(all(isinstance(x, (int, float)) for x in (real, imag)), lambda: f"complex{_short((real, imag))}")
    return complex(real, imag)


def _bytearray(data=b""):
    _expect(isinstance(data, (bytes, bytearray)), lambda: f"bytearray({_short(data)})")  # never bytearray(n): n bytes
    return bytearray(data)


def _slice(*args):
    _expect(1 <= len(args) <= 3 and all(a is None or _is_int(a) for a in args), lambda: f"slice{_short(args)}")
    return slice(*args)


def _enum(qualname: str, value_ok: Callable[[Any], bool] = _is_scalar):
    def make(value):
        _expect(value_ok(value), lambda: f"{qualname}({_short(value)})")
        return PickledEnum(qualname, value)

    return make


def _numpy_reconstruct(subtype, shape, typecode):
    _expect(subtype is _NDARRAY and shape == (0,) and typecode in (b"b", "b"),
            lambda: f"numpy _reconstruct{_short((subtype, shape, typecode))}")
    return NumpyArray()


def _numpy_scalar(dtype, data=None):
    # np.float64 & co. pickle as scalar(dtype, raw bytes): read them as the Python number
    _expect(isinstance(dtype, NumpyDType) and isinstance(data, (bytes, bytearray)) and len(data) == dtype.size,
            lambda: f"numpy scalar{_short((dtype, data))}")
    fmt = _SCALAR_FORMATS[dtype.kind + str(dtype.size)]
    values = struct.unpack((">" if dtype.byteorder == ">" else "<") + fmt, bytes(data))
    return complex(*values) if dtype.kind == "c" else values[0]


# numpy dtype spec -> struct format of one value
_SCALAR_FORMATS = {"b1": "?", "i1": "b", "i2": "h", "i4": "i", "i8": "q", "u1": "B", "u2": "H", "u4": "I", "u8": "Q",
                   "f2": "e", "f4": "f", "f8": "d", "c8": "2f", "c16": "2d"}


class _DcpRecord:
    """A torch.distributed.checkpoint dataclass as pickled in `.metadata` (NEWOBJ, then BUILD with its
    fields, once); load_dcp_metadata checks the fields it uses and turns the tree into DcpMetadata."""

    __slots__ = ("state",)
    qualname = short = ""

    def __new__(cls, *args):
        if args:
            raise _Malformed(f"{cls.qualname} made with arguments {_short(args)}")
        self = object.__new__(cls)
        self.state = None
        return self

    def __setstate__(self, state) -> None:
        if self.state is not None or not isinstance(state, (dict, tuple)):
            raise _Malformed(f"the pickle sets {self.qualname} to {_short(state)} (twice, or not its fields)")
        if type(state) is tuple and len(state) == 2 and isinstance(state[1], dict) and (
                state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **state[1]}  # (__dict__, slot values)
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname} {_short(self.state)}>"


def _dcp_class(qualname: str, short: Optional[str] = None) -> type:
    """A record class standing in for DCP's class `qualname` (or a subclass of the DCP class `short`)."""
    short = short or qualname.rsplit(".", 1)[1]
    return type(qualname.rsplit(".", 1)[1], (_DcpRecord,), {"__slots__": (), "qualname": qualname, "short": short})


# --------------------------------------------------------------------------------------------------
# The allow-lists


_DCP_ENUMS = ("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
              "torch.distributed.checkpoint.planner.WriteItemType")

_TENSOR_REBUILDERS = (
    _Global("torch._utils._rebuild_tensor_v2", _rebuild_tensor_v2),
    _Global("torch._utils._rebuild_tensor_v3", _rebuild_tensor_v3),
)
_TORCH_DTYPES = {f"torch.{name}": TorchDType(name) for name in ITEMSIZE}


def _numpy_dtype(spec, align=False, copy=True):
    _expect(align in (False, 0) and copy in (True, 1), lambda: f"numpy.dtype{_short((spec, align, copy))}")
    return NumpyDType(spec)


def _numpy_globals() -> dict:
    out: dict = {"numpy.ndarray": _NDARRAY, "numpy.dtype": _Global("numpy.dtype", _numpy_dtype)}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1.x, 2.x
        out[f"{module}._reconstruct"] = _Global(f"{module}._reconstruct", _numpy_reconstruct)
        out[f"{module}.scalar"] = _Global(f"{module}.scalar", _numpy_scalar)
    return out


# Globals any torch.save archive of plain values may name (a training checkpoint's rank files, DCP's items), each
# with its stand-in; a family adds its own enums (PickleFamily.archive_globals).
ARCHIVE_GLOBALS: Mapping[str, Any] = types.MappingProxyType({
    **{g.name: g for g in _TENSOR_REBUILDERS},
    "torch._utils._rebuild_parameter": _Global("torch._utils._rebuild_parameter", _rebuild_parameter),
    "torch._utils._rebuild_parameter_with_state": _Global("torch._utils._rebuild_parameter_with_state",
                                                          _rebuild_parameter),
    "torch._tensor._rebuild_from_type_v2": _Global("torch._tensor._rebuild_from_type_v2", _rebuild_from_type_v2),
    "torch.Tensor": _TENSOR_TYPES[0],
    "torch.nn.parameter.Parameter": _TENSOR_TYPES[1],
    **{f"torch.{name}": _Marker(f"torch.{name}", dtype) for name, dtype in TYPED_STORAGES.items()},
    "torch.UntypedStorage": _UNTYPED_STORAGE,
    "torch.storage.UntypedStorage": _UNTYPED_STORAGE,
    **_TORCH_DTYPES,
    "torch.Size": _Global("torch.Size", _torch_size),
    "torch.device": _Global("torch.device", _torch_device),
    "torch.serialization._get_layout": _Global("torch.serialization._get_layout", _get_layout),
    "torch.strided": _LAYOUTS["torch.strided"],
    **{f"torch.{n}": TorchMemoryFormat(n) for n in ("contiguous_format", "channels_last", "preserve_format")},
    "collections.OrderedDict": _Global("collections.OrderedDict", _ordered_dict),
    "argparse.Namespace": _Namespace,
    "types.SimpleNamespace": _Global("types.SimpleNamespace", _simple_namespace),
    "pathlib.PosixPath": _Global("pathlib.PosixPath", _posix_path),
    "pathlib._local.PosixPath": _Global("pathlib._local.PosixPath", _posix_path),  # Python >= 3.13
    "signal.Signals": _Global("signal.Signals", _enum("signal.Signals", _is_int)),
    # megatron-ucp's own stand-in, in trees it re-saved with torch.save: where the class lived before (NEWOBJ +
    # BUILD), where it lived until the generic package (REDUCE), and here
    "megatron_ucp.formats.common.PickledEnum": PickledEnum,
    "megatron_ucp.formats.safe_pickle.PickledEnum": PickledEnum,
    "megatron_ucp.serialization.safe_pickle.PickledEnum": PickledEnum,
    "_codecs.encode": _Global("_codecs.encode", _codecs_encode),
    "builtins.set": _Global("builtins.set", _collection(set)),
    "builtins.frozenset": _Global("builtins.frozenset", _collection(frozenset)),
    "builtins.complex": _Global("builtins.complex", _complex),
    "builtins.bytearray": _Global("builtins.bytearray", _bytearray),
    "builtins.slice": _Global("builtins.slice", _slice),
    "_io.BytesIO": _BytesIO,
    "io.BytesIO": _BytesIO,
    **_numpy_globals(),
})

_DCP_CLASSES = (
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    # megatron-core stores every rank's save plan in the metadata (Metadata.all_local_plans)
    "torch.distributed.checkpoint.planner.SavePlan",
    "torch.distributed.checkpoint.planner.WriteItem",
    "torch.distributed.checkpoint.planner.TensorWriteData",
    "torch.distributed.checkpoint.planner.BytesIOWriteData",
)
_DCP_TYPES = {q: _dcp_class(q) for q in _DCP_CLASSES}

# Globals DCP's `.metadata` may name.
DCP_METADATA_GLOBALS: Mapping[str, Any] = types.MappingProxyType({
    **_DCP_TYPES,
    **{q: _Global(q, _enum(q, _is_int)) for q in _DCP_ENUMS},
    **_TORCH_DTYPES,
    "torch.Size": ARCHIVE_GLOBALS["torch.Size"],
    "torch.serialization._get_layout": ARCHIVE_GLOBALS["torch.serialization._get_layout"],
    "torch.strided": _LAYOUTS["torch.strided"],
    "pathlib.PosixPath": ARCHIVE_GLOBALS["pathlib.PosixPath"],  # StorageMeta.checkpoint_id may be a path
    "pathlib._local.PosixPath": ARCHIVE_GLOBALS["pathlib._local.PosixPath"],
})

@dataclass(frozen=True, eq=False)
class PickleFamily:
    """What the pickles of one family of packages hold beyond plain torch values: the caller's knowledge, given to
    every load (formats/pickles.py spells Megatron's). `holder` names such a file in messages ("a Megatron
    checkpoint"); `enums`: the enum classes its pickles hold, loaded as PickledEnum; `namespaces`: the package
    prefixes ("pkg.") whose other classes load as InertRecords (data, never imported) instead of being refused;
    `dcp_records`: its subclasses of DCP's metadata records, each with the DCP class it stands for (short name)."""

    holder: str
    enums: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    dcp_records: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [q for q in (*self.enums, *self.dcp_records) if not is_class_path(q)]
        bad += [p for p in self.namespaces if not (p.endswith(".") and is_class_path(p + "x"))]
        bad += [s for s in self.dcp_records.values() if s not in _DCP_SHORT_NAMES]
        if bad:
            raise ValueError(f"PickleFamily {self.holder!r}: not class paths, package prefixes or DCP records: {bad}")

    def is_record_name(self, qualname: str) -> bool:
        """A class path of the family's packages, loaded as data (PickledEnum / InertRecord) whatever it is."""
        return bool(self.namespaces) and is_class_path(qualname) and qualname.startswith(self.namespaces)

    @functools.cached_property
    def archive_globals(self) -> Mapping[str, Any]:
        """ARCHIVE_GLOBALS and the family's enums."""
        return types.MappingProxyType({**ARCHIVE_GLOBALS, **{q: _Global(q, _enum(q)) for q in self.enums}})

    @functools.cached_property
    def dcp_globals(self) -> Mapping[str, Any]:
        """DCP_METADATA_GLOBALS and the family's record classes."""
        return types.MappingProxyType({**DCP_METADATA_GLOBALS,
                                       **{q: _dcp_class(q, short) for q, short in self.dcp_records.items()}})


_DCP_SHORT_NAMES = frozenset(q.rsplit(".", 1)[1] for q in _DCP_CLASSES)
# Plain torch values only: no family's enums or classes.
TORCH = PickleFamily("a torch checkpoint")

# torch globals that are safe but mean content megatron-ucp cannot describe as bytes in a file
_UNSUPPORTED = {
    "torch._utils._rebuild_qtensor": "a quantized tensor",
    "torch._utils._rebuild_sparse_tensor": "a sparse tensor",
    "torch._utils._rebuild_sparse_csr_tensor": "a sparse tensor",
    "torch._utils._rebuild_nested_tensor": "a nested tensor",
    "torch._utils._rebuild_wrapper_subclass": "a tensor subclass",
    "torch._utils._rebuild_meta_tensor_no_storage": "a meta tensor (no data)",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": "an XLA/MTIA device tensor",
    **{f"torch.{q}Storage": "a quantized tensor" for q in ("QInt8", "QInt32", "QUInt8", "QUInt4x2", "QUInt2x4")},
}


class _RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves globals only through an allow-list of stand-ins and persistent ids
    only as torch storages of one archive."""

    def __init__(self, data: bytes, where: str, allowed: Mapping[str, Any], archive: Optional["_TorchArchive"],
                 family: PickleFamily):
        super().__init__(io.BytesIO(data))
        self._where, self._allowed, self._archive, self._family = where, allowed, archive, family
        self.inert: dict[str, type] = {}  # qualname -> its InertRecord class, for this load

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{module}.{name}"
        found = self._allowed.get(qualname)
        if found is None:
            # protocol-2 pickles spell Python 3 names the Python 2 way (__builtin__.set): normalise like pickle does
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            qualname = f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"
            found = self._allowed.get(qualname)
        if found is None:
            if qualname in _UNSUPPORTED and "torch.Tensor" in self._allowed:  # an archive, not DCP metadata
                raise SafeLoadError(f"{self._where}: holds {_UNSUPPORTED[qualname]} ({qualname}), which megatron-ucp "
                                    f"cannot read; save plain dense tensors.")
            if self._family.is_record_name(qualname):  # e.g. a newer release's class: data, never imported
                if qualname not in self.inert:
                    self.inert[qualname] = inert_class(qualname)
                    _log.debug("%s: %s is not a class megatron-ucp knows; loaded as an inert record (never "
                               "imported or run)", self._where, qualname)
                return self.inert[qualname]
            raise _unsafe(self._where, qualname, self._family.holder)
        return found

    def persistent_load(self, pid: Any) -> Any:
        if not (self._archive is not None and isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _Marker) and (pid[1].dtype is not None or pid[1] is _UNTYPED_STORAGE)
                and isinstance(pid[2], str) and isinstance(pid[3], str) and _is_int(pid[4]) and pid[4] >= 0):
            raise _unsafe(self._where, f"persistent id {_short(pid)}", self._family.holder)
        return self._archive.storage(pid[2], pid[1], pid[4])


def _refused(where: str, error: _Malformed) -> SafeLoadError:
    text = str(error)
    return SafeLoadError(f"{where}: {text}" if "re-copy" in text or "re-save" in text else
                         f"{where}: {text}: the file is corrupt or crafted; {FIX}.")


def _unpickle(data: bytes, where: str, allowed: Mapping[str, Any], archive: Optional["_TorchArchive"] = None,
              family: Optional[PickleFamily] = None) -> Any:
    try:
        return _RestrictedUnpickler(data, where, allowed, archive, family or TORCH).load()
    except SafeLoadError:
        raise
    except _Malformed as e:
        raise _refused(where, e) from None
    except Exception as e:  # truncated or invalid opcodes, wrong argument types
        text = str(e).splitlines()[0][:200] if str(e) else ""
        raise SafeLoadError(f"{where}: not a valid pickle ({type(e).__name__}: {text}): the file is truncated, "
                            f"corrupt or crafted; {FIX}.") from None


# --------------------------------------------------------------------------------------------------
# torch.save archives: a zip reader over a bounded window of a file


_EOCD = struct.Struct("<4s4H2LH")  # zip end of central directory record
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header
_FULL32 = 0xFFFFFFFF  # a 32-bit zip field whose value is in the zip64 extra field


class _TorchArchive:
    """The records of one torch.save zip archive at bytes [base, base + length) of an open file: a zip
    reader that checks every offset and size against the window before using it, and hands the
    unpickler the storage records (persistent ids)."""

    def __init__(self, fd: int, path: str, base: int, length: int):
        self.fd, self.path, self.base, self.length = fd, path, base, length
        self.buf = self._pread(length, base) if length <= _SMALL_WINDOW else None
        self.storages: dict[str, StorageRef] = {}
        self.directory = length  # where the central directory starts: every record ends before it
        self.records = self._read_directory()  # name (bytes) -> (local header offset, size, method, flags)
        if not self.records:
            raise _Malformed(f"an empty zip archive: {RECOPY}")
        self.prefix = next(iter(self.records)).split(b"/", 1)[0]  # torch names every record <archive>/...

    def _pread(self, n: int, at: int) -> bytes:
        data = os.pread(self.fd, n, at)
        if len(data) != n:
            raise _Malformed(f"the file ends at byte {at + len(data)}, before byte {at + n}: {RECOPY}")
        return data

    def read(self, pos: int, n: int) -> bytes:
        if pos < 0 or n < 0 or pos + n > self.length:
            raise _Malformed(f"the zip structure points to bytes [{pos}, {pos + n}) of an archive of {self.length} "
                             f"bytes: {RECOPY}")
        if self.buf is not None:
            return self.buf[pos:pos + n]
        return self._pread(n, self.base + pos)

    def _end_record(self) -> tuple[int, bytes]:
        if self.length < _EOCD.size:
            raise _Malformed(f"{self.length} bytes are too few for a torch.save archive: {RECOPY}")
        end = self.length - _EOCD.size
        tail = self.read(end, _EOCD.size)
        if tail[:4] == b"PK\x05\x06":
            return end, tail
        span = min(self.length, _EOCD.size + 0xFFFF)  # an archive comment follows the end record
        block = self.read(self.length - span, span)
        at = block.rfind(b"PK\x05\x06", 0, span - _EOCD.size + 4)
        while at >= 0 and at + _EOCD.size + _EOCD.unpack_from(block, at)[-1] != span:
            at = block.rfind(b"PK\x05\x06", 0, at + 3)
        if at < 0:
            raise _Malformed(f"not a torch.save zip archive (no zip end record; files of torch < 1.6 are not read): "
                             f"{RECOPY}")
        return self.length - span + at, block[at:at + _EOCD.size]

    def _read_directory(self) -> dict:
        end, tail = self._end_record()
        _, disk, cd_disk, _, count, cd_size, cd_offset, _ = _EOCD.unpack(tail)
        limit = end
        if end >= _EOCD64_LOCATOR.size:
            locator = self.read(end - _EOCD64_LOCATOR.size, _EOCD64_LOCATOR.size)
            if locator[:4] == b"PK\x06\x07":  # zip64: archives over 4 GiB or with over 65535 records
                eocd64 = _EOCD64_LOCATOR.unpack(locator)[2]
                if eocd64 + _EOCD64.size > end - _EOCD64_LOCATOR.size:
                    raise _Malformed(f"the zip64 end record points to byte {eocd64}, outside the archive: {RECOPY}")
                sig, _, _, _, disk, cd_disk, _, count, cd_size, cd_offset = _EOCD64.unpack(
                    self.read(eocd64, _EOCD64.size))
                if sig != b"PK\x06\x06":
                    raise _Malformed(f"bad zip64 end record: {RECOPY}")
                limit = eocd64
        if disk or cd_disk:
            raise _Malformed(f"a multi-part zip archive: {RECOPY}")
        if cd_offset + cd_size > limit or count * _CENTRAL.size > cd_size or cd_size > MAX_PICKLE_BYTES:
            raise _Malformed(f"the zip directory declares {count} records at bytes [{cd_offset}, "
                             f"{cd_offset + cd_size}), outside the archive's {limit} bytes: {RECOPY}")
        self.directory = cd_offset
        raw = self.read(cd_offset, cd_size)
        records: dict = {}
        pos = 0
        for _ in range(count):
            if pos + _CENTRAL.size > cd_size:
                raise _Malformed(f"the zip directory ends inside a record: {RECOPY}")
            (sig, _, _, flags, method, _, _, _, csize, usize, name_len, extra_len, comment_len, _, _, _,
             header) = _CENTRAL.unpack_from(raw, pos)
            name_at = pos + _CENTRAL.size
            pos = name_at + name_len + extra_len + comment_len
            if sig != b"PK\x01\x02" or pos > cd_size:
                raise _Malformed(f"bad zip directory record at byte {cd_offset + name_at - _CENTRAL.size}: {RECOPY}")
            name = raw[name_at:name_at + name_len]
            if _FULL32 in (csize, usize, header):
                usize, csize, header = _zip64_sizes(raw[name_at + name_len:name_at + name_len + extra_len], usize,
                                                    csize, header, name)
            if header + _LOCAL.size > cd_offset or (method == 0 and csize != usize) or name in records:
                raise _Malformed(f"zip record {name[:80]!r} at byte {header} of {usize} bytes does not fit before the "
                                 f"zip directory at byte {cd_offset} (or is listed twice): {RECOPY}")
            records[name] = (header, usize, method, flags)
        return records

    def entry(self, suffix: str) -> Optional[tuple]:
        return self.records.get(self.prefix + b"/" + suffix.encode())

    def data_start(self, name: str, entry: tuple) -> int:
        """Where a record's bytes start, after its local header; checked to end before the zip directory."""
        header, size, method, flags = entry
        if method != 0 or flags & 1:
            raise _Malformed(f"record {name} is compressed or encrypted (method {method}); torch.save writes stored "
                             f"records, so the file was re-zipped or crafted; re-copy it")
        sig, _, _, _, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack(self.read(header, _LOCAL.size))
        start = header + _LOCAL.size + name_len + extra_len  # torch pads records to 64 bytes in the extra field
        if sig != b"PK\x03\x04" or self.read(header + _LOCAL.size, name_len) != self.prefix + b"/" + name.encode():
            raise _Malformed(f"record {name} has no matching local header at byte {self.base + header}: {RECOPY}")
        if start + size > self.directory:
            raise _Malformed(f"record {name} declares {size} bytes at byte {self.base + start}, the file holds "
                             f"{max(0, self.directory - start)} there: {RECOPY}")
        return start

    def record_bytes(self, name: str, entry: tuple) -> bytes:
        return self.read(self.data_start(name, entry), entry[1])

    def storage(self, key: str, kind: _Marker, numel: int) -> StorageRef:
        """The storage record a persistent id names, its declared size checked against the record."""
        dtype = kind.dtype
        found = self.storages.get(key)
        if found is not None:
            _expect(found.dtype == dtype, lambda: f"storage record {key} is used as {found.dtype} and as {dtype}")
            return found
        name = f"data/{key}"
        entry = self.entry(name)
        _expect(entry is not None, lambda: f"a tensor uses storage record {name}, which the archive does not have: "
                                           f"{RECOPY}")
        declared = numel * (ITEMSIZE[dtype] if dtype else 1)
        _expect(declared <= entry[1], lambda: f"storage record {name} declares {declared} bytes, the file holds "
                                              f"{entry[1]}: {RECOPY}")
        ref = StorageRef(key, dtype, self.path, self.base + self.data_start(name, entry), declared)
        self.storages[key] = ref
        return ref


def _zip64_sizes(extra: bytes, usize: int, csize: int, header: int, name: bytes) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 1 and pos + 4 + size <= len(extra):
            values = list(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
            out = []
            for v in (usize, csize, header):
                if v == _FULL32:
                    _expect(bool(values), lambda: f"record {name[:80]!r}'s zip64 sizes are missing: {RECOPY}")
                    v = values.pop(0)
                out.append(v)
            return out[0], out[1], out[2]
        pos += 4 + size
    raise _Malformed(f"record {name[:80]!r}'s zip64 sizes are missing: {RECOPY}")


def _open_read_only(path: str, where: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise SafeLoadError(f"{where}: cannot open ({e.strerror}); re-copy the checkpoint.") from None


def load_archive(path: Union[str, os.PathLike], offset: int = 0, length: Optional[int] = None, *, what: str,
                 family: PickleFamily = TORCH) -> Any:
    """The object torch.save wrote into the archive at [offset, offset + length) of `path` (default: the
    whole file), unpickled through the allow-list (with `family`'s enums and classes), with every tensor a
    TensorRecord. `what` names it in errors (e.g. "model/optimizer state of rank tp=0 pp=1", "item ...")."""
    path = os.fspath(path)
    path = path if os.path.isabs(path) else os.path.abspath(path)
    where = f"{path} ({what})" if length is None else f"{path} ({what}, bytes {offset}..{offset + length})"
    fd = _open_read_only(path, where)
    try:
        size = os.fstat(fd).st_size
        if length is None:
            length = size - offset
        if not (_is_int(offset) and _is_int(length) and offset >= 0 and length >= 0 and offset + length <= size):
            raise SafeLoadError(f"{where}: the archive spans bytes [{offset}, {offset + length}) but the file holds "
                                f"{size}: {RECOPY}.")
        try:
            archive = _TorchArchive(fd, path, offset, length)
            pickle_entry = archive.entry("data.pkl")
            if pickle_entry is None:
                raise _Malformed("a zip archive without <archive>/data.pkl: not a torch.save file; re-copy it")
            if pickle_entry[1] > MAX_PICKLE_BYTES:
                raise _Malformed(f"data.pkl declares {pickle_entry[1]} bytes, more than the {MAX_PICKLE_BYTES} a "
                                 f"checkpoint's pickle can need: {RECOPY}")
            order = archive.entry("byteorder")
            if order is not None:
                value = archive.record_bytes("byteorder", order) if order[1] <= 16 else b"?"
                if value == b"big":
                    raise _Malformed("a big-endian checkpoint (byteorder 'big'); megatron-ucp reads little-endian ones "
                                     "only: load and re-save it with torch on a little-endian machine")
                if value != b"little":
                    raise _Malformed(f"the byteorder record holds {value[:16]!r}: {RECOPY}")
            data = archive.record_bytes("data.pkl", pickle_entry)
        except _Malformed as e:
            raise _refused(where, e) from None
        return _unpickle(data, where, family.archive_globals, archive, family)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# DCP metadata


@_frozen_record
class DcpChunk:
    """One saved chunk of a tensor: its offsets and sizes in the global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@_frozen_record
class DcpTensorMeta:
    dtype: str  # torch dtype name
    size: tuple[int, ...]  # global shape
    chunks: tuple[DcpChunk, ...]


@_frozen_record
class DcpBytesMeta:
    """A pickled object saved as one torch.save archive (optimizer param groups, RNG states, extra state)."""


@dataclass(frozen=True, slots=True)
class DcpIndex:
    """A saved item's key (DCP's MetadataIndex): fqn and chunk offsets (None for bytes); `index` is a hint
    and takes no part in equality."""

    fqn: str
    offset: Optional[tuple[int, ...]] = None
    index: Optional[int] = field(default=None, compare=False, hash=False)


@_frozen_record
class DcpStorageItem:
    """Where a saved item's torch.save archive is: bytes [offset, offset + length) of `path`."""

    relative_path: str  # a plain file name inside the iteration folder
    path: str  # absolute
    offset: int
    length: int
    transform_descriptors: tuple[str, ...] = ()  # non-empty: the bytes were transformed (e.g. compressed)


@_frozen_record
class DcpMetadata:
    """What DCP's `.metadata` says: per saved key its tensor metadata or bytes, and per item its place."""

    path: str  # the .metadata file
    state_dict_metadata: Mapping[str, Union[DcpTensorMeta, DcpBytesMeta]]
    storage_data: Mapping[DcpIndex, DcpStorageItem]
    version: Optional[str] = None
    family: PickleFamily = TORCH  # what the items' pickles may hold (load_dcp_item)


_BYTES_META = DcpBytesMeta()


def _dcp_state(obj: Any, *names: str) -> Any:
    """The pickled fields of a DCP record whose class is one of `names` (short class names)."""
    if not isinstance(obj, _DcpRecord) or obj.short not in names:
        raise _Malformed(f"{' or '.join(names)} expected, found {_short(obj)}")
    return obj.state if obj.state is not None else {}


def _dcp_tensor_meta(md: Any, fqn: str) -> DcpTensorMeta:
    state = _dcp_state(md, "TensorStorageMetadata")
    _expect(isinstance(state, dict), lambda: f"{fqn}: TensorStorageMetadata state {_short(state)}")
    props = _dcp_state(state.get("properties"), "TensorProperties")
    dtype = props[0] if isinstance(props, tuple) and props else props.get("dtype") if isinstance(props, dict) else None
    _expect(isinstance(dtype, TorchDType), lambda: f"{fqn}: dtype {_short(dtype)}")
    size = _int_tuple(state.get("size"), f"{fqn}: size")
    chunks = state.get("chunks")
    _expect(isinstance(chunks, list), lambda: f"{fqn}: chunks {_short(chunks)}")
    out = []
    for c in chunks:
        cs = _dcp_state(c, "ChunkStorageMetadata")
        _expect(isinstance(cs, dict), lambda: f"{fqn}: chunk {_short(cs)}")
        offsets = _int_tuple(cs.get("offsets"), f"{fqn}: chunk offsets")
        sizes = _int_tuple(cs.get("sizes"), f"{fqn}: chunk sizes")
        _expect(len(offsets) == len(sizes) == len(size) and all(o + s <= n for o, s, n in zip(offsets, sizes, size)),
                lambda: f"{fqn}: chunk at {offsets} of size {sizes} lies outside the tensor's {size}")
        out.append(DcpChunk(offsets, sizes))
    return DcpTensorMeta(dtype.name, size, tuple(out))


class _DataFiles:
    """The iteration folder's data files named by .metadata: plain names, inside the folder, sizes cached."""

    def __init__(self, iter_dir: str, meta_path: str):
        self.iter_dir, self.meta_path = iter_dir, meta_path
        self.real_dir = os.path.realpath(iter_dir)
        self.sizes: dict[str, int] = {}

    def size(self, rel: Any) -> int:
        found = self.sizes.get(rel)
        if found is not None:
            return found
        if not (isinstance(rel, str) and rel not in ("", ".", "..") and "/" not in rel and "\0" not in rel
                and os.sep not in rel and not os.path.isabs(rel)):
            raise SafeLoadError(f"{self.meta_path}: names data file {_short(rel)}, which is not a plain file name "
                                f"inside {self.iter_dir}; it was NOT read; {FIX}.")
        full = os.path.join(self.iter_dir, rel)
        try:
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                real = os.path.realpath(full)
                if os.path.dirname(real) != self.real_dir:
                    raise SafeLoadError(f"{full}: a symbolic link to {real}, outside {self.iter_dir}; it was NOT read; "
                                        f"{FIX}.")
                st = os.stat(full)
        except FileNotFoundError:
            raise SafeLoadError(f"{full}: missing data file listed in {self.meta_path}; re-copy the iteration "
                                f"folder.") from None
        if not stat.S_ISREG(st.st_mode):
            raise SafeLoadError(f"{full}: listed in {self.meta_path} but not a regular file; {FIX}.")
        self.sizes[rel] = st.st_size
        return st.st_size


def load_dcp_metadata(iter_dir: Union[str, os.PathLike], family: PickleFamily = TORCH) -> DcpMetadata:
    """DCP's `iter_dir/.metadata`, read through the allow-list (with `family`'s records; its items' pickles are
    loaded with `family` too, load_dcp_item): every saved key's tensor metadata (global
    size, dtype, chunks) or bytes, and where each item's archive is. Every data file must be a plain file
    of iter_dir (no path, no link out of it) holding the bytes the metadata points to."""
    iter_dir = os.path.abspath(os.fspath(iter_dir))
    meta_path = os.path.join(iter_dir, ".metadata")
    where = f"{meta_path} (DCP metadata)"
    fd = _open_read_only(meta_path, where)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_PICKLE_BYTES:
            raise SafeLoadError(f"{where}: {size} bytes, more than the {MAX_PICKLE_BYTES} DCP metadata can need: "
                                f"{RECOPY}.")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    raw = _unpickle(data, where, family.dcp_globals, family=family)
    try:
        state = _dcp_state(raw, "Metadata")
        _expect(isinstance(state, dict), lambda: f"Metadata state {_short(state)}")
        sdm = state.get("state_dict_metadata")
        _expect(isinstance(sdm, dict) and all(isinstance(k, str) for k in sdm),
                "state_dict_metadata is not a dict by name")
        keys: dict[str, Union[DcpTensorMeta, DcpBytesMeta]] = {}
        for fqn, md in sdm.items():
            if isinstance(md, _DcpRecord) and md.short == "BytesStorageMetadata":
                keys[fqn] = _BYTES_META
            else:
                keys[fqn] = _dcp_tensor_meta(md, fqn)
        storage = state.get("storage_data")
        _expect(isinstance(storage, dict), lambda: f"storage_data is {_short(storage)}, not a dict")
        files = _DataFiles(iter_dir, meta_path)
        items: dict[DcpIndex, DcpStorageItem] = {}
        for index, info in storage.items():
            ist = _dcp_state(index, "MetadataIndex")
            _expect(isinstance(ist, dict) and isinstance(ist.get("fqn"), str), lambda: f"MetadataIndex {_short(ist)}")
            fqn, off = ist["fqn"], ist.get("offset")
            _expect(fqn in keys, lambda: f"storage_data names {fqn!r}, which state_dict_metadata does not have")
            off = None if off is None else _int_tuple(off, f"{fqn}: item offset")
            hint = ist.get("index")
            key = DcpIndex(fqn, off, hint if _is_int(hint) else None)
            sst = _dcp_state(info, "_StorageInfo")
            _expect(isinstance(sst, dict), lambda: f"{fqn}: _StorageInfo {_short(sst)}")
            rel, start, length = sst.get("relative_path"), sst.get("offset"), sst.get("length")
            _expect(_is_int(start) and _is_int(length) and start >= 0 and length >= 0,
                    lambda: f"{fqn}: item at offset {_short(start)} of length {_short(length)}")
            held = files.size(rel)
            if start + length > held:
                raise SafeLoadError(f"{os.path.join(iter_dir, rel)}: item {fqn} spans bytes [{start}, "
                                    f"{start + length}) but the file holds {held}: {RECOPY}.")
            transforms = sst.get("transform_descriptors") or ()
            _expect(isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms),
                    lambda: f"{fqn}: transform_descriptors {_short(transforms)}")
            items[key] = DcpStorageItem(rel, os.path.join(iter_dir, rel), start, length, tuple(transforms))
        version = state.get("version")
    except _Malformed as e:
        raise _refused(where, e) from None
    return DcpMetadata(meta_path, types.MappingProxyType(keys), types.MappingProxyType(items),
                       version if isinstance(version, str) else None, family)


def load_dcp_item(metadata: DcpMetadata, index: DcpIndex) -> Any:
    """One saved item (a tensor chunk -> TensorRecord, or a pickled object) through load_archive."""
    item = metadata.storage_data[index]
    return load_archive(item.path, item.offset, item.length, what=f"item {index.fqn}",
                        family=metadata.family)


# --------------------------------------------------------------------------------------------------
# Reading bytes


def _region_of(source: Union[TensorRecord, ByteRegion]) -> ByteRegion:
    if isinstance(source, TensorRecord):
        region = source.region()
        if region is None:
            raise ValueError(f"{source.path}: the {source.dtype} tensor of shape {source.shape} (stride "
                             f"{source.stride}) is not C-contiguous; read it with to_torch()")
        return region
    return ByteRegion(*source)


def iter_region_bytes(source: Union[TensorRecord, ByteRegion], chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of a C-contiguous tensor (or a region), in pieces of at most chunk_bytes (pread)."""
    region = _region_of(source)
    fd = _open_read_only(region.path, region.path)
    try:
        _check_holds(fd, region)
        pos, end = region.offset, region.offset + region.nbytes
        while pos < end:
            data = os.pread(fd, min(chunk_bytes, end - pos), pos)
            if not data:
                raise SafeLoadError(f"{region.path}: ends at byte {pos}, before byte {end}: {RECOPY}.")
            pos += len(data)
            yield data
    finally:
        os.close(fd)


def _check_holds(fd: int, region: ByteRegion) -> None:
    size = os.fstat(fd).st_size
    if region.offset + region.nbytes > size:
        raise SafeLoadError(f"{region.path}: bytes [{region.offset}, {region.offset + region.nbytes}) are wanted, the "
                            f"file holds {size}: {RECOPY}.")


def _read_into(fd: int, buf: bytearray, offset: int, path: str) -> None:
    view = memoryview(buf)
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [view[done:done + READ_CHUNK_BYTES]], offset + done)
        if n == 0:
            raise SafeLoadError(f"{path}: ends at byte {offset + done}, before byte {offset + len(buf)}: {RECOPY}.")
        done += n


def read_tensor_bytes(source: Union[TensorRecord, ByteRegion]) -> bytearray:
    """The C-order bytes of a C-contiguous tensor (or a region): one buffer of exactly its size, allocated
    after the file was checked to hold them."""
    region = _region_of(source)
    fd = _open_read_only(region.path, region.path)
    try:
        _check_holds(fd, region)
        buf = bytearray(region.nbytes)
        _read_into(fd, buf, region.offset, region.path)
        return buf
    finally:
        os.close(fd)


# dtype name -> struct format of one little-endian value (bfloat16 is read as the top half of a float32)
_VALUE_FORMATS = {"float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h",
                  "int8": "<b", "uint8": "<B", "bool": "<?", "uint16": "<H", "uint32": "<I", "uint64": "<Q"}


def read_scalar(record: TensorRecord) -> Union[int, float, bool]:
    """The value of a one-element tensor (e.g. a saved Adam step) as a Python number, without torch."""
    if record.numel != 1 or (record.dtype not in _VALUE_FORMATS and record.dtype != "bfloat16"):
        raise SafeLoadError(f"{record.path}: a {record.dtype} tensor of shape {record.shape} where one number is "
                            f"expected: {RECOPY}.")
    data = bytes(read_tensor_bytes(ByteRegion(record.path, record.data_offset + record.storage_offset
                                              * record.itemsize, record.itemsize)))
    if record.dtype == "bfloat16":
        return struct.unpack("<f", b"\0\0" + data)[0]
    return struct.unpack(_VALUE_FORMATS[record.dtype], data)[0]


def to_torch(record: TensorRecord, *, mmap: bool = False):
    """The tensor as a CPU torch.Tensor (imports torch; any layout and dtype, bf16 included). It owns a copy
    of the storage span it covers, or with mmap=True views a private (copy-on-write) mapping of it."""
    import torch

    dtype = getattr(torch, record.dtype)
    if record.numel == 0:
        return torch.empty(record.shape, dtype=dtype)
    span = 1 + sum((n - 1) * s for n, s in zip(record.shape, record.stride))
    region = ByteRegion(record.path, record.data_offset + record.storage_offset * record.itemsize,
                        span * record.itemsize)
    if mmap:
        import numpy

        fd = _open_read_only(region.path, region.path)
        try:
            _check_holds(fd, region)  # a mapping past the end of the file would fault (SIGBUS) when touched
        finally:
            os.close(fd)
        flat = torch.from_numpy(numpy.memmap(region.path, dtype=numpy.uint8, mode="c", offset=region.offset,
                                             shape=(region.nbytes,)))
    else:
        flat = torch.frombuffer(read_tensor_bytes(region), dtype=torch.uint8)
    return flat.view(dtype).as_strided(record.shape, record.stride, 0)


def materialize(tree: Any, *, mmap: bool = True) -> Any:
    """What torch.load(weights_only=True) gives for a loaded tree (imports torch and numpy): tensors
    (mmap=True: mapped, read when touched, like torch.load(mmap=True)), torch dtypes and devices,
    numpy arrays, argparse.Namespace, signal.Signals; a family's enums stay PickledEnum, as a torch allow-list of
    stand-ins gives them. Views of one storage become separate tensors."""
    import signal

    import torch

    done: dict[int, Any] = {}  # by id: shared sub-trees are converted once (a pickle can share a lot)

    def convert(x: Any) -> Any:
        found = done.get(id(x))
        if found is not None:
            return found[1]
        if isinstance(x, TensorRecord):
            out = to_torch(x, mmap=mmap)
        elif isinstance(x, (TorchDType, TorchLayout, TorchMemoryFormat)):
            out = getattr(torch, x.name)
        elif isinstance(x, TorchDevice):
            out = torch.device(str(x))
        elif isinstance(x, NumpyArray):
            out = x.to_numpy()
        elif isinstance(x, PickledEnum) and x.qualname == "signal.Signals":
            out = signal.Signals(x.value)
        elif isinstance(x, argparse.Namespace):
            out = argparse.Namespace(**{k: convert(v) for k, v in vars(x).items()})
        elif isinstance(x, types.SimpleNamespace):
            out = types.SimpleNamespace(**{k: convert(v) for k, v in vars(x).items()})
        elif isinstance(x, dict):
            out = type(x)((convert(k), convert(v)) for k, v in x.items())
        elif isinstance(x, (list, tuple, set, frozenset)):
            out = type(x)(convert(v) for v in x)
        else:
            return x
        done[id(x)] = (x, out)  # keep x alive so its id is not reused while converting
        return out

    try:
        return convert(tree)
    except RecursionError:
        raise SafeLoadError(f"a pickled object nested over {sys.getrecursionlimit()} levels deep: no checkpoint is; "
                            f"{FIX}.") from None
