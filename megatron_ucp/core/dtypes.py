"""Element types, once: each dtype's name (torch's spelling without "torch."), bytes per element, safetensors
code and the typed-storage class torch.save names it by. A leaf: no torch at import (`torch_dtype`,
`to_torch` import it on use), no other module of the project. Every table of dtypes elsewhere is a view
of this one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    name: str  # torch's name: "float32", "bfloat16", ...
    itemsize: int  # bytes per element
    safetensors: Optional[str] = None  # safetensors' code ("F32"); None where safetensors has none used here
    storage: Optional[str] = None  # torch.<storage> that torch.save's legacy typed storages name
    is_float: bool = False


_ALL = (
    DType("float64", 8, "F64", "DoubleStorage", True),
    DType("float32", 4, "F32", "FloatStorage", True),
    DType("float16", 2, "F16", "HalfStorage", True),
    DType("bfloat16", 2, "BF16", "BFloat16Storage", True),
    DType("int64", 8, "I64", "LongStorage"),
    DType("int32", 4, "I32", "IntStorage"),
    DType("int16", 2, "I16", "ShortStorage"),
    DType("int8", 1, "I8", "CharStorage"),
    DType("uint8", 1, "U8", "ByteStorage"),
    DType("bool", 1, "BOOL", "BoolStorage"),
    DType("complex64", 8, None, "ComplexFloatStorage"),
    DType("complex128", 16, None, "ComplexDoubleStorage"),
    DType("uint16", 2), DType("uint32", 4), DType("uint64", 8),
    DType("float8_e4m3fn", 1), DType("float8_e5m2", 1), DType("float8_e4m3fnuz", 1), DType("float8_e5m2fnuz", 1),
    DType("float8_e8m0fnu", 1),
)
DTYPES = {d.name: d for d in _ALL}
ITEMSIZE = {d.name: d.itemsize for d in _ALL}
FLOAT_DTYPES = frozenset(d.name for d in _ALL if d.is_float)
SAFETENSORS = {d.safetensors: d.name for d in _ALL if d.safetensors}  # "F32" -> "float32"
TYPED_STORAGES = {d.storage: d.name for d in _ALL if d.storage}  # "FloatStorage" -> "float32"
# what a model parameter (and so a Megatron checkpoint's weights) may be; the universal tensors are float32
PARAM_DTYPES = ("float32", "bfloat16", "float16")


class DTypeError(ValueError):
    """A dtype that is not a plain number type."""


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32 or 'float32' (the spelling of metadata.json and of safe_pickle records)."""
    return str(dtype).replace("torch.", "")


def itemsize(dtype: Any) -> int:
    """Bytes per element of a torch dtype or a dtype name."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    try:
        return ITEMSIZE[dtype_name(dtype)]
    except KeyError:
        raise DTypeError(f"dtype {dtype!r} is not a plain number type") from None


def bits(dtype: Any) -> str:
    """The numpy dtype that moves elements of `dtype` as raw bits (bytes are copied, never interpreted: numpy
    has no bfloat16, and needs none here)."""
    return {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}[itemsize(dtype)]


def torch_dtype(dtype: Any) -> "torch.dtype":
    """The torch dtype of a torch dtype or a dtype name (imports torch)."""
    import torch

    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype_name(dtype))


def to_torch(array, dtype: Any) -> "torch.Tensor":
    """A numpy array of raw bits (see `bits`) as a torch tensor of `dtype`, sharing its memory."""
    import torch

    if array.size == 0:
        return torch.empty(array.shape, dtype=torch_dtype(dtype))
    return torch.from_numpy(array).view(torch_dtype(dtype))
