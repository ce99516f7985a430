"""Saved tensors as records of their bytes: from safe_pickle's `TensorRecord` (what a torch.save archive says about
a tensor, found without torch) to views of part of it (`sub_record`, `box_record`) and to a byteio.StoredTensor
(where its bytes are, for byte copies); safe_pickle.to_torch gives the values.

torch and byteio (which needs torch) are imported on first use, as everywhere in the readers: only read()
and locate() need them; opening a checkpoint, listing its shards and its common state never import them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from megatron_ucp.serialization.safe_pickle import TensorRecord


def torch_dtype(dtype: Any):
    """The torch dtype for a dtype name, a TorchDType, or a torch dtype (imports torch)."""
    import torch

    name = str(dtype).removeprefix("torch.")
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype")
    return found


def sub_record(record: TensorRecord, start: int, shape: tuple[int, ...]) -> TensorRecord:
    """Elements [start, start + numel(shape)) of a C-contiguous 1-D saved tensor (a flat optimizer buffer) seen
    as a C-contiguous tensor of `shape`: the bytes of one parameter, nothing else (checked to lie inside)."""
    numel = 1
    for s in shape:
        numel *= s
    if len(record.shape) != 1 or not record.is_c_contiguous() or start < 0 or start + numel > record.numel:
        raise ValueError(f"elements [{start}, {start + numel}) of a tensor of shape {record.shape}")
    stride, strides = 1, []
    for s in reversed(shape):
        strides.append(stride)
        stride *= s
    return replace(record, shape=tuple(shape), stride=tuple(reversed(strides)),
                   storage_offset=record.storage_offset + start)


def box_record(record: TensorRecord, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> TensorRecord:
    """The box `offsets`/`lengths` of a saved tensor, as a (strided) record of the same storage."""
    if len(offsets) != len(record.shape) or any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, record.shape)):
        raise ValueError(f"box at {offsets} of size {lengths} outside a tensor of shape {record.shape}")
    start = record.storage_offset + sum(o * st for o, st in zip(offsets, record.stride))
    return replace(record, shape=tuple(lengths), storage_offset=start)


def stored_tensor(record: TensorRecord) -> Optional[Any]:
    """Where a saved tensor's C-order bytes are (a byteio.StoredTensor with the dtype's name, e.g. "float32":
    copying bytes needs no torch); None when they are not one contiguous run (read it as a tensor then)."""
    region = record.region()
    if region is None:
        return None
    from megatron_ucp.io.byteio import FileRegion, StoredTensor

    regions = (FileRegion(region.path, region.offset, region.nbytes),) if region.nbytes else ()
    return StoredTensor(tuple(record.shape), str(record.dtype), regions)


__all__ = ["box_record", "stored_tensor", "sub_record", "torch_dtype"]
