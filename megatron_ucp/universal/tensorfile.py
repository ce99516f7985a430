"""One parameter's tensor file (docs/FORMAT.md, "Tensor files"): a safetensors file of float32 tensors
(`fp32` and its optimizer's states by name: Adam's `exp_avg`, `exp_avg_sq`, SGD's `momentum_buffer`). Its header is written by `safetensors_header` and parsed by
`parse_header`, the one parser both the verified reader (`VerifiedTensorFile`) and `check` use; the
three write paths (tensors, dim-0 bands, byte placements copied from a Megatron checkpoint) write the
same bytes for the same tensors and digest every byte as it is written (and, asked to, count NaN/Inf in the
blocks they digest); `lazy_entry` is a lazy checkpoint's entry that points into the source instead."""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from megatron_ucp.core.dtypes import SAFETENSORS
from megatron_ucp.core.dtypes import bits as bits_dtype
from megatron_ucp.core.dtypes import dtype_name, itemsize
from megatron_ucp.io import integrity
from megatron_ucp.io.byteio import FileHandles, Placement, placement_to_json, write_placement
from megatron_ucp.io.integrity import (
    FILE_REMEDY, ChecksumError, DigestRecord, VerifiedBlocks, remedy_clause, verified_pread, verified_view)
from megatron_ucp.universal.format import (
    FORMAT_NAME, FORMAT_VERSION, MAX_HEADER, PathLike, UniversalFormatError, check_name, ordered_keys, tensor_file)

if TYPE_CHECKING:
    import torch



def _check_tensors(name: str, tensors: Mapping[str, tuple[tuple[int, ...], Any]]) -> tuple[int, ...]:
    """Refuse a parameter whose tensors (key -> (shape, dtype)) the format cannot hold; returns the shape."""
    check_name(name)
    try:
        ordered_keys(tensors)  # 'fp32' and one optimizer's whole state, by name (core/optimizers.py)
    except UniversalFormatError as e:
        raise UniversalFormatError(f"{name}: {e}") from None
    shape = tuple(tensors["fp32"][0])
    for key, (s, dtype) in tensors.items():
        if dtype_name(dtype) != "float32" or tuple(s) != shape:
            raise UniversalFormatError(f"{name}: '{key}' is {tuple(s)} {dtype}; every tensor of a "
                                       f"parameter must be float32 of shape {shape}")
    return shape


def _entry(name: str, shape: tuple[int, ...], keys: list[str], info: Mapping[str, Any]) -> dict:
    """The parameter's metadata.json entry (without its checksum)."""
    from megatron_ucp.core.patterns import Pattern, pattern_from_json

    pattern = info["pattern"]
    pattern_json = pattern.to_json() if isinstance(pattern, Pattern) else dict(pattern)
    pattern_from_json(pattern_json)  # refuse what a reader could not parse
    step = info.get("step")
    return {
        "shape": list(shape),
        "dtype": "float32",
        "model_dtype": dtype_name(info.get("model_dtype", "float32")),
        "pattern": pattern_json,
        "file": tensor_file(name),
        "tensors": keys,
        "step": None if step is None else int(step),
        "param_group": info.get("param_group", {}),
    }


def _file_metadata(name: str) -> dict[str, str]:
    return {"format": FORMAT_NAME, "name": name, "version": str(FORMAT_VERSION)}


def safetensors_header(shapes: Mapping[str, Sequence[int]], metadata: Mapping[str, str]
                       ) -> tuple[bytes, dict[str, int]]:
    """The safetensors prefix (u64 little-endian header size + JSON header, space-padded to 8 bytes) for
    float32 tensors of `shapes`, and each tensor's data offset from the start of the file. Tensors are
    laid out in name order, as safetensors' own writer orders tensors of one dtype."""
    doc: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    pos, offsets = 0, {}
    for key in sorted(shapes):
        nbytes = math.prod(shapes[key]) * 4
        doc[key] = {"dtype": "F32", "shape": [int(n) for n in shapes[key]], "data_offsets": [pos, pos + nbytes]}
        offsets[key] = pos
        pos += nbytes
    header = json.dumps(doc, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    prefix = struct.pack("<Q", len(header)) + header
    return prefix, {key: len(prefix) + off for key, off in offsets.items()}


def _named(e: OSError, target: Path) -> OSError:
    """The error with the file named (ENOSPC from pwrite or a copy names none)."""
    return OSError(e.errno, e.strerror, str(target)) if e.filename is None else e


class NonFiniteTensorError(UniversalFormatError):
    """A tensor written into a universal checkpoint holds NaN or Inf and the writer was asked to refuse them."""


def _hasher(target: Path, size: int, offsets: Mapping[str, int], nbytes: int, check_finite: bool
            ) -> integrity.BlockHasher:
    """The output file's BlockHasher; with `check_finite` one that also counts NaN/Inf in each tensor's bytes
    as it hashes them (integrity.FiniteBlockHasher: no extra pass over the data)."""
    if not check_finite:
        return integrity.BlockHasher(size, name=str(target))
    regions = {key: (pos, pos + nbytes) for key, pos in offsets.items()}
    return integrity.FiniteBlockHasher(size, regions, name=str(target))


def _refuse_non_finite(name: str, hasher: integrity.BlockHasher) -> None:
    """NonFiniteTensorError naming the parameter and each state holding NaN/Inf (FiniteBlockHasher's counts)."""
    found = hasher.non_finite if isinstance(hasher, integrity.FiniteBlockHasher) else None
    if found:
        states = ", ".join(f"{integrity.state_word(k)} ({found[k]})" for k in sorted(found, key=lambda k: (k != "fp32", k)))
        raise NonFiniteTensorError(
            f"{name}: {states} hold(s) non-finite values (NaN/Inf), refused; {integrity.NON_FINITE_REMEDY}, or "
            f"pass --allow-non-finite to convert them as they are")


def write_tensor_file(staging_dir: PathLike, name: str, tensors: Mapping[str, "torch.Tensor"],
                      info: Mapping[str, Any], *, check_finite: bool = False) -> dict:
    """Write one parameter's safetensors file into `staging_dir` and return its metadata entry, with the
    block checksums of the file computed while writing it (integrity.write_file_hashed).

    The file is byte for byte what write_tensor_file_placed writes for the same tensors (one header
    function, tensors in name order). Process-safe: it touches only `tensors/<name>.safetensors`.
    `info` holds "model_dtype" (str or torch.dtype), "pattern" (Pattern or its JSON), "step" (int or
    None) and "param_group" (dict). The file is not fsynced here: publication fsyncs the whole tree.
    `check_finite`: refuse NaN/Inf (NonFiniteTensorError), found while the bytes are hashed.
    """
    import torch

    shape = _check_tensors(name, {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()})
    ordered = {key: tensors[key].detach().to("cpu").contiguous() for key in ordered_keys(tensors)}
    entry = _entry(name, shape, list(ordered), info)
    target = Path(staging_dir) / entry["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix, offsets = safetensors_header({k: shape for k in ordered}, _file_metadata(name))
    pieces = [(0, prefix)] + [(offsets[k], t.reshape(-1).view(torch.uint8).numpy()) for k, t in ordered.items()]
    size = len(prefix) + len(ordered) * math.prod(shape) * 4
    hasher = _hasher(target, size, offsets, math.prod(shape) * 4, check_finite)
    try:
        record = integrity.write_file_hashed(target, size, pieces, fsync=False, hasher=hasher)
    except OSError as e:
        raise _named(e, target) from e
    _refuse_non_finite(name, hasher)
    entry["checksum"] = record.to_json()
    return entry


def write_tensor_file_streamed(staging_dir: PathLike, name: str, shape: Sequence[int],
                               bands: Union[Iterable["torch.Tensor"], Mapping[str, Iterable["torch.Tensor"]]],
                               info: Mapping[str, Any], *, check_finite: bool = False) -> dict:
    """write_tensor_file for a parameter whose tensors come as consecutive dim-0 bands (so only one band is
    in memory: `import-hf` widens a vocabulary band by band; benchmarks/bench_scale.py generates a 1.3B
    checkpoint with its Adam moments). `bands`: the fp32 tensor's bands, or {key: its bands} for several of
    ordered_keys. The file is byte for byte what write_tensor_file writes for the bands' concatenations."""
    import torch

    shape = tuple(int(n) for n in shape)
    by_key = dict(bands) if isinstance(bands, Mapping) else {"fp32": bands}
    _check_tensors(name, {key: (shape, torch.float32) for key in by_key})
    keys = list(ordered_keys(by_key))
    entry = _entry(name, shape, keys, info)
    target = Path(staging_dir) / entry["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix, offsets = safetensors_header({key: shape for key in keys}, _file_metadata(name))
    nbytes = math.prod(shape) * 4
    size = len(prefix) + len(keys) * nbytes

    def pieces():
        yield 0, prefix
        for key in keys:
            pos = offsets[key]
            for band in by_key[key]:
                if band.dtype != torch.float32 or tuple(band.shape[1:]) != shape[1:]:
                    raise UniversalFormatError(f"{name}: {key} band {tuple(band.shape)} {band.dtype} does not fit "
                                               f"{shape}")
                data = band.contiguous().reshape(-1).view(torch.uint8).numpy()
                yield pos, data
                pos += data.nbytes
            if pos != offsets[key] + nbytes:
                raise UniversalFormatError(f"{name}: {key} bands hold {pos - offsets[key]} bytes, {shape} needs "
                                           f"{nbytes}")

    hasher = _hasher(target, size, offsets, nbytes, check_finite)
    try:
        record = integrity.write_file_hashed(target, size, pieces(), fsync=False, hasher=hasher)
    except OSError as e:
        raise _named(e, target) from e
    _refuse_non_finite(name, hasher)
    entry["checksum"] = record.to_json()
    return entry


def write_tensor_file_placed(staging_dir: PathLike, name: str, placements: Mapping[str, Placement],
                             info: Mapping[str, Any], files: FileHandles, *, check_finite: bool = False) -> dict:
    """write_tensor_file for tensors given as Placements (where their bytes are in the source files): the
    file is sized, its header written, and each tensor's bytes copied straight into place (see
    byteio.write_placement), so no tensor is materialised. Every byte is digested as it is written."""
    shape = _check_tensors(name, {k: (p.shape, p.dtype) for k, p in placements.items()})
    keys = list(ordered_keys(placements))
    entry = _entry(name, shape, keys, info)
    target = Path(staging_dir) / entry["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix, offsets = safetensors_header({k: shape for k in keys}, _file_metadata(name))
    size = len(prefix) + len(keys) * math.prod(shape) * 4
    hasher = _hasher(target, size, offsets, math.prod(shape) * 4, check_finite)
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        integrity.pwrite_hashed(fd, prefix, 0, hasher)
        for key in keys:
            write_placement(files, fd, offsets[key], placements[key], hasher)
    except OSError as e:
        raise _named(e, target) from e
    finally:
        os.close(fd)
    _refuse_non_finite(name, hasher)
    entry["checksum"] = hasher.record().to_json()
    return entry


def lazy_entry(name: str, placements: Mapping[str, Placement], info: Mapping[str, Any], source_root: PathLike) -> dict:
    """A lazy checkpoint's metadata entry: instead of a tensor file, where each consolidated tensor's bytes
    are in the source checkpoint (paths relative to `source_root`, its iteration folder)."""
    shape = _check_tensors(name, {k: (p.shape, p.dtype) for k, p in placements.items()})
    keys = list(ordered_keys(placements))
    entry = _entry(name, shape, keys, info)
    entry["file"] = None
    entry["source_bytes"] = {key: placement_to_json(placements[key], str(source_root)) for key in keys}
    if info.get("zeroed"):  # element runs read as zero whatever those source bytes hold (docs/FORMAT.md)
        entry["zeroed"] = {key: [[int(a), int(n)] for a, n in runs] for key, runs in info["zeroed"].items()}
    return entry


class HeaderError(ValueError):
    """A tensor file whose safetensors header does not describe its bytes; the message says how (no path)."""


def parse_header(read: Callable[[int, int], Any], size: int) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """The one parser of a tensor file's header: `read(offset, nbytes)` gives the file's bytes (checked
    ones, for the verified reader), `size` its length. Returns {tensor key: (safetensors dtype, shape, start,
    stop)} with absolute byte offsets, after checking what safetensors' own reader checks: a header that
    fits the file, known dtypes, each tensor's span its shape's size, the spans tiling the data after the
    header without gap or overlap up to the end of the file. Raises HeaderError."""
    if size < 8:
        raise HeaderError(f"{size} bytes, too short for a safetensors file")
    n = int.from_bytes(bytes(read(0, 8)), "little")
    if not 0 < n <= min(size - 8, MAX_HEADER):
        raise HeaderError(f"safetensors header of {n} bytes does not fit the file ({size} bytes)")
    try:
        header = json.loads(bytes(read(8, n)))
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise HeaderError(f"safetensors header is not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise HeaderError("safetensors header is not a JSON object")
    tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape = t["dtype"], tuple(int(d) for d in t["shape"])
            a, b = (8 + n + int(x) for x in t["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"'{name}' has no dtype, shape and data_offsets") from None
        dtype = SAFETENSORS.get(code)
        if dtype is None or min(shape, default=0) < 0 or b - a != math.prod(shape) * itemsize(dtype) \
                or not 8 + n <= a <= b <= size:
            raise HeaderError(f"'{name}' ({code} {list(shape)}) does not fit its bytes {a}..{b} of the file")
        tensors[name] = (code, shape, a, b)
    pos = 8 + n
    for _, _, a, b in sorted(tensors.values(), key=lambda v: v[2]):
        if a != pos:
            raise HeaderError(f"tensor data has a {'gap' if a > pos else 'overlap'} at byte {pos}")
        pos = b
    if pos != size:
        raise HeaderError(f"{size} bytes, its header describes {pos}")
    return tensors


class VerifiedTensorFile:
    """A safetensors file (a universal tensor file) read only through checked blocks: the header is parsed
    from verified bytes, and `read(key, index)` maps the rows the index spans, checks their blocks and
    copies out the region, like `safe_open(...).get_slice(key)[index]`. Keep one per file and reader
    thread; `cache` (VerifiedBlocks) lets readers share checked blocks (the header block, neighbours)."""

    def __init__(self, path: PathLike, record: DigestRecord, label: str, *, remedy: str = FILE_REMEDY,
                 cache: Optional[VerifiedBlocks] = None, headers: Optional[dict] = None, fd: Optional[int] = None):
        """`headers`: a dict shared by one reader's opens of the same files, {file identity: parsed header},
        so a file's header is parsed (and its blocks checked) once, not on every read. `fd`: a read-only
        descriptor of `path` the caller keeps open (byteio.FileHandles), borrowed instead of opening the file."""
        self.path, self.record, self.label, self.remedy = str(path), record, label, remedy
        self.cache = cache if cache is not None else VerifiedBlocks()
        self._owned = fd is None
        self._fd = os.open(self.path, os.O_RDONLY) if fd is None else fd
        try:
            size = os.fstat(self._fd).st_size
            if size != record.stop:
                raise ChecksumError(f"{self.path}: {size} bytes, {label} was written with {record.stop}; "
                                    f"{remedy_clause(remedy)}", self.path)
            key = VerifiedBlocks.file_key(self._fd) if headers is not None else None
            if key is not None and key in headers:
                self.tensors = headers[key]
                return
            try:
                self.tensors = parse_header(self._pread, size)
            except HeaderError as e:
                raise ChecksumError(f"{self.path}: {e}; {remedy_clause(remedy)}", self.path) from None
            if key is not None:
                headers[key] = self.tensors
        except BaseException:
            self.close()
            raise

    def _pread(self, offset: int, nbytes: int) -> memoryview:
        return verified_pread(self._fd, offset, nbytes, self.record, path=self.path, label=self.label,
                              remedy=self.remedy, cache=self.cache)

    def read(self, key: str, index: Optional[Sequence[slice]] = None):
        """Tensor `key`, or its region `index` (step-1 slices over leading dims), as a new CPU tensor."""
        from megatron_ucp.core.dtypes import to_torch

        return to_torch(self.read_bits(key, index), SAFETENSORS[self.tensors[key][0]])

    def read_bits(self, key: str, index: Optional[Sequence[slice]] = None):
        """Tensor `key`, or its region `index`, as a new numpy array of the elements' raw bits (unsigned ints of
        the element's width: numpy has no bfloat16; `.view(numpy.float32)` for F32). No torch."""
        with self.view_bits(key, index) as stored:
            out = stored.copy()
            del stored  # the mapping closes when the with-block ends: no view of it may outlive the block
        return out

    @contextlib.contextmanager
    def view_bits(self, key: str, index: Optional[Sequence[slice]] = None):
        """read_bits without the copy: a read-only numpy view of the checked mapping, valid inside the
        with-block (a cast or a strided copy reads it once, where read_bits would copy it first)."""
        import numpy

        dtype_name, shape, start, stop = self.tensors[key]
        item = itemsize(SAFETENSORS[dtype_name])
        bits = bits_dtype(SAFETENSORS[dtype_name])
        index = tuple(index or ())
        if len(index) > len(shape):
            raise ValueError(f"index {index} has more slices than '{key}' {list(shape)} has dimensions")
        box = [slice(*s.indices(n)[:2]) for s, n in zip(index, shape)]
        out_shape = tuple(max(0, s.stop - s.start) for s in box) + tuple(shape[len(box):])
        r0, r1 = (box[0].start, max(box[0].start, box[0].stop)) if box else (0, shape[0] if shape else 1)
        row_bytes = math.prod(shape[1:]) * item
        lo, n = start + r0 * row_bytes, (r1 - r0) * row_bytes
        if n == 0 or not math.prod(out_shape):
            yield numpy.empty(out_shape, dtype=bits)
            return
        with verified_view(self._fd, lo, n, self.record, path=self.path, label=self.label, remedy=self.remedy,
                           cache=self.cache) as view:
            stored = numpy.frombuffer(view, dtype=bits).reshape(((r1 - r0),) + tuple(shape[1:]) if shape else ())
            try:
                yield stored[(slice(None),) + tuple(box[1:])] if shape else stored
            finally:
                del stored  # the mapping closes with the view

    def close(self) -> None:
        if self._fd is not None:
            if self._owned:
                os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "VerifiedTensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


