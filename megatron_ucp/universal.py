"""The universal checkpoint on disk: its writer (staged, marker-last) and its lazy, slice-reading reader.

A universal checkpoint is one directory: `metadata.json` (iteration, model config, optimizer
hyper-parameters, scheduler, and one entry per canonical parameter with its pattern), one
safetensors file per parameter under `tensors/` holding fp32 consolidated tensors (`fp32`,
`exp_avg`, `exp_avg_sq`), and a `COMPLETE` marker written last. docs/FORMAT.md is the specification;
this module is one implementation of it. Nothing here is pickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_ucp.byteio import (
    FileHandles, Placement, StorageError, placement_from_json, placement_to_json, read_box, write_placement)
from megatron_ucp.layout import ParallelLayout
from megatron_ucp.model_config import GPTModelConfig
from megatron_ucp.patterns import Pattern, PatternError, pattern_from_json

FORMAT_NAME = "megatron-ucp-universal"
FORMAT_VERSION = 1

METADATA_FILENAME = "metadata.json"
COMPLETE_FILENAME = "COMPLETE"
TENSORS_DIRNAME = "tensors"
TENSOR_KEYS = ("fp32", "exp_avg", "exp_avg_sq")  # file order; `fp32` is always present
REQUIRED_METADATA = ("iteration", "consumed_train_samples", "source", "model_config", "args", "optimizer",
                     "scheduler")

# Canonical names are dotted module paths; anything else could escape tensors/ or clash on disk.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")

PathLike = Union[str, os.PathLike]


class UniversalFormatError(Exception):
    """A universal checkpoint that cannot be written or read; the message names the path and the fix."""


@dataclass(frozen=True)
class ParamInfo:
    """One parameter's entry in metadata.json (see docs/FORMAT.md, "parameters")."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # stored dtype, always "float32" in version 1
    model_dtype: str  # dtype of the model parameter during training ("float32", "bfloat16", "float16")
    pattern: Pattern
    file: str  # relative to the checkpoint directory
    tensors: tuple[str, ...]
    step: Optional[int]  # Adam step of this parameter; None without optimizer state
    param_group: dict
    placements: Optional[dict] = None  # lazy checkpoints: key -> Placement (bytes in the source checkpoint)


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (the spelling used in metadata.json)."""
    return str(dtype).replace("torch.", "")


def tensor_file(name: str) -> str:
    """Relative path of a parameter's safetensors file."""
    return f"{TENSORS_DIRNAME}/{name}.safetensors"


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UniversalFormatError(f"parameter name {name!r} is not a dotted canonical name "
                                   "(letters, digits, '_' and '.'); it cannot name a file under tensors/")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, doc: Any) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# Writing


def _check_tensors(name: str, tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[int, ...]:
    """Refuse a parameter whose tensors (key -> (shape, dtype)) the format cannot hold; returns the shape."""
    _check_name(name)
    unknown = sorted(set(tensors) - set(TENSOR_KEYS))
    if unknown or "fp32" not in tensors:
        raise UniversalFormatError(f"{name}: tensors {sorted(tensors)}; a parameter needs 'fp32' and may add "
                                   f"'exp_avg', 'exp_avg_sq' (unknown: {unknown})")
    if ("exp_avg" in tensors) != ("exp_avg_sq" in tensors):
        raise UniversalFormatError(f"{name}: has only one of exp_avg / exp_avg_sq; Adam needs both")
    shape = tuple(tensors["fp32"][0])
    for key, (s, dtype) in tensors.items():
        if dtype != torch.float32 or tuple(s) != shape:
            raise UniversalFormatError(f"{name}: '{key}' is {tuple(s)} {dtype}; every tensor of a "
                                       f"parameter must be float32 of shape {shape}")
    return shape


def _entry(name: str, shape: tuple[int, ...], keys: list[str], info: Mapping[str, Any]) -> dict:
    """The parameter's metadata.json entry."""
    pattern = info["pattern"]
    pattern_json = pattern.to_json() if isinstance(pattern, Pattern) else dict(pattern)
    pattern_from_json(pattern_json)  # refuse what a reader could not parse
    model_dtype = info.get("model_dtype", "float32")
    step = info.get("step")
    return {
        "shape": list(shape),
        "dtype": "float32",
        "model_dtype": dtype_name(model_dtype) if isinstance(model_dtype, torch.dtype) else str(model_dtype),
        "pattern": pattern_json,
        "file": tensor_file(name),
        "tensors": keys,
        "step": None if step is None else int(step),
        "param_group": info.get("param_group", {}),
    }


def _file_metadata(name: str) -> dict[str, str]:
    return {"format": FORMAT_NAME, "name": name, "version": str(FORMAT_VERSION)}


def write_tensor_file(staging_dir: PathLike, name: str, tensors: Mapping[str, torch.Tensor],
                      info: Mapping[str, Any]) -> dict:
    """Write one parameter's safetensors file into `staging_dir` and return its metadata entry.

    Process-safe: it touches only `tensors/<name>.safetensors`, so worker processes call it directly and
    send the returned entry to the parent, which records it with UniversalWriter.record_parameter.
    `info` holds "model_dtype" (str or torch.dtype), "pattern" (Pattern or its JSON), "step" (int or
    None) and "param_group" (dict).
    """
    shape = _check_tensors(name, {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()})
    ordered = {key: tensors[key].detach().to("cpu").contiguous() for key in TENSOR_KEYS if key in tensors}
    entry = _entry(name, shape, list(ordered), info)
    target = Path(staging_dir) / entry["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(ordered, str(target), metadata=_file_metadata(name))
    return entry


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


def write_tensor_file_placed(staging_dir: PathLike, name: str, placements: Mapping[str, Placement],
                             info: Mapping[str, Any], files: FileHandles) -> dict:
    """write_tensor_file for tensors given as Placements (where their bytes are in the source files): the
    file is sized, its header written, and each tensor's bytes copied straight into place (see
    byteio.write_placement), so no tensor is materialised."""
    shape = _check_tensors(name, {k: (p.shape, p.dtype) for k, p in placements.items()})
    keys = [key for key in TENSOR_KEYS if key in placements]
    entry = _entry(name, shape, keys, info)
    target = Path(staging_dir) / entry["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix, offsets = safetensors_header({k: shape for k in keys}, _file_metadata(name))
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, len(prefix) + len(keys) * math.prod(shape) * 4)
        os.pwrite(fd, prefix, 0)
        for key in keys:
            write_placement(files, fd, offsets[key], placements[key])
    except OSError as e:
        if e.filename is None:  # name the file (ENOSPC from a copy names none)
            raise OSError(e.errno, e.strerror, str(target)) from e
        raise
    finally:
        os.close(fd)
    return entry


def lazy_entry(name: str, placements: Mapping[str, Placement], info: Mapping[str, Any], source_root: PathLike) -> dict:
    """A lazy checkpoint's metadata entry: instead of a tensor file, where each consolidated tensor's bytes
    are in the source checkpoint (paths relative to `source_root`, its iteration folder)."""
    shape = _check_tensors(name, {k: (p.shape, p.dtype) for k, p in placements.items()})
    keys = [key for key in TENSOR_KEYS if key in placements]
    entry = _entry(name, shape, keys, info)
    entry["file"] = None
    entry["source_bytes"] = {key: placement_to_json(placements[key], str(source_root)) for key in keys}
    return entry


def source_file_stats(root: PathLike, entries: Mapping[str, Mapping[str, Any]]) -> dict:
    """{relative path: {"size", "mtime_ns"}} of every source file lazy entries refer to."""
    files = sorted({region[0] for e in entries.values() for p in (e.get("source_bytes") or {}).values()
                    for shard in p["shards"] for region in shard["regions"]})
    out = {}
    for rel in files:
        st = os.stat(Path(root) / rel)
        out[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def _is_universal_dir(path: Path) -> bool:
    return (path / COMPLETE_FILENAME).is_file() or (path / METADATA_FILENAME).is_file()


def check_destination(dst: PathLike, overwrite: bool = False, *, replaceable: Callable[[Path], bool] = None,
                      kind: str = "universal checkpoint", error: type = None) -> None:
    """Raise unless `dst` may be written: absent, or (with overwrite) an empty directory or an earlier
    output of the same kind (`replaceable`). Every writer (to-universal, from-universal, export-hf) calls
    it before any work, so a user's own files are never replaced."""
    dst, error = Path(dst), error or UniversalFormatError
    if not dst.exists():
        return
    if not overwrite:
        raise error(f"{dst}: already exists; choose another destination or pass --overwrite to replace it")
    if not dst.is_dir():
        raise error(f"{dst}: exists and is a file; choose another destination")
    if any(dst.iterdir()) and not (replaceable or _is_universal_dir)(dst):
        raise error(f"{dst}: exists and is not a {kind}; refusing to overwrite it, delete it yourself or "
                    f"choose another destination")


class UniversalWriter:
    """Builds a universal checkpoint in a sibling staging directory `DST.partial-<pid>` and moves it to
    DST only after metadata.json and the COMPLETE marker are written, so DST is either absent or complete.

    Use as a context manager (an exception inside removes the staging directory) or call abort().
    write_parameter is for one process; worker processes call write_tensor_file(writer.staging_dir, ...)
    and the parent passes the returned entries to record_parameter.
    """

    def __init__(self, dst: PathLike, overwrite: bool = False):
        self.dst = Path(dst).absolute()
        self.overwrite = overwrite
        check_destination(self.dst, overwrite)
        self.staging_dir = self.dst.parent / f"{self.dst.name}.partial-{os.getpid()}"
        if self.staging_dir.exists():  # left by a killed run that had our pid
            shutil.rmtree(self.staging_dir)
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        self.staging_dir.mkdir()
        (self.staging_dir / TENSORS_DIRNAME).mkdir()
        self.parameters: dict[str, dict] = {}
        self._done = False

    def __enter__(self) -> "UniversalWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def abort(self) -> None:
        """Remove the staging directory (DST itself is never touched before finish)."""
        self._done = True
        shutil.rmtree(self.staging_dir, ignore_errors=True)

    def record_parameter(self, name: str, entry: dict) -> None:
        if name in self.parameters:
            self.abort()
            raise UniversalFormatError(f"{name}: written twice; each canonical parameter appears once")
        self.parameters[name] = entry

    def write_parameter(self, name: str, tensors: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> dict:
        """Write one parameter (see write_tensor_file) and record its metadata entry."""
        try:
            entry = write_tensor_file(self.staging_dir, name, tensors, info)
            self.record_parameter(name, entry)
        except BaseException:
            self.abort()
            raise
        return entry

    def finish(self, metadata: Mapping[str, Any], expected: Sequence[tuple[str, Sequence[int]]]) -> Path:
        """Write metadata.json (format, version and the recorded parameters added), then COMPLETE, then move
        the directory into place. `metadata` holds the other top-level keys of docs/FORMAT.md; `expected`
        lists every parameter of the model with its global shape, in registration order (the model's
        rulebook gives it), so an incomplete conversion is never marked complete."""
        if self._done:
            raise UniversalFormatError(f"{self.dst}: writer already finished or aborted")
        try:
            missing = [k for k in REQUIRED_METADATA if k not in metadata]
            if missing:
                raise UniversalFormatError(f"{self.dst}: metadata lacks {missing}")
            self._check_complete(expected)
            doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
            doc.update({k: v for k, v in metadata.items() if k not in ("format", "version", "parameters")})
            doc["parameters"] = self.parameters
            meta_path = self.staging_dir / METADATA_FILENAME
            try:
                _write_json(meta_path, doc)
            except ValueError as e:  # NaN/inf or a non-JSON value slipped in
                raise UniversalFormatError(f"{self.dst}: metadata is not plain JSON ({e})") from e
            _write_json(self.staging_dir / COMPLETE_FILENAME, {
                "format": FORMAT_NAME, "version": FORMAT_VERSION,
                "metadata_sha256": _sha256(meta_path)})
            _fsync_dir(self.staging_dir)
            self._move_into_place()
        except BaseException:
            self.abort()
            raise
        self._done = True
        return self.dst

    def _check_complete(self, expected: Sequence[tuple[str, Sequence[int]]]) -> None:
        expected = {name: tuple(shape) for name, shape in expected}
        missing = [n for n in expected if n not in self.parameters]
        extra = sorted(set(self.parameters) - set(expected))
        if missing or extra:
            raise UniversalFormatError(
                f"{self.dst}: parameters do not match the model config: missing {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}; a universal checkpoint holds "
                f"every parameter of the model exactly once")
        for name, shape in expected.items():
            if tuple(self.parameters[name]["shape"]) != shape:
                raise UniversalFormatError(f"{name}: shape {tuple(self.parameters[name]['shape'])} but the model "
                                           f"config gives {shape}")
        # metadata.json lists parameters in registration order, whatever order workers finished in
        self.parameters = {name: self.parameters[name] for name in expected}

    def _move_into_place(self) -> None:
        old = None
        if self.dst.exists():  # overwrite=True, checked in __init__
            old = self.dst.parent / f"{self.dst.name}.old-{os.getpid()}"
            os.rename(self.dst, old)
        os.rename(self.staging_dir, self.dst)
        _fsync_dir(self.dst.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Reading


def _incomplete(path: Path) -> UniversalFormatError:
    return UniversalFormatError(f"{path}: incomplete universal checkpoint: conversion did not finish; "
                                f"delete {path} and rerun the conversion")


def _param_info(name: str, d: Mapping[str, Any], meta_path: Path, lazy_root: Optional[Path] = None) -> ParamInfo:
    try:
        _check_name(name)
        pattern = pattern_from_json(d["pattern"])
        tensors = tuple(d["tensors"])
        shape = tuple(int(s) for s in d["shape"])
        if "fp32" not in tensors or set(tensors) - set(TENSOR_KEYS):
            raise UniversalFormatError(f"tensors {list(tensors)} must include 'fp32' and only {TENSOR_KEYS}")
        placements = None
        if lazy_root is not None:
            placements = {key: placement_from_json(d["source_bytes"][key], str(lazy_root)) for key in tensors}
            if any(p.shape != shape for p in placements.values()):
                raise UniversalFormatError(f"source_bytes shapes differ from {shape}")
        elif d["file"] != tensor_file(name):
            raise UniversalFormatError(f"file {d['file']!r} is not {tensor_file(name)!r}")
        return ParamInfo(name=name, shape=shape, dtype=d["dtype"],
                         model_dtype=d.get("model_dtype", d["dtype"]), pattern=pattern, file=d["file"],
                         tensors=tensors, step=None if d.get("step") is None else int(d["step"]),
                         param_group=dict(d.get("param_group") or {}), placements=placements)
    except (KeyError, TypeError, ValueError, PatternError, UniversalFormatError) as e:
        raise UniversalFormatError(f"{meta_path}: parameter {name!r} has a malformed entry ({type(e).__name__}: "
                                   f"{e}); the file was edited or is corrupt, reconvert") from None


def _check_lazy_source(lazy: Any, meta_path: Path) -> Path:
    """A lazy checkpoint's source folder, after checking every file it refers to is there, unchanged."""
    try:
        root = Path(lazy["source"])
        files = dict(lazy["files"])
    except (KeyError, TypeError, ValueError):
        raise UniversalFormatError(f"{meta_path}: malformed 'lazy' section; reconvert") from None
    for rel, want in files.items():
        f = root / rel
        try:
            st = f.stat()
        except OSError:
            raise UniversalFormatError(
                f"{f}: missing. {meta_path.parent} is a lazy universal checkpoint (an index into {root}, "
                f"not a copy) and its source was moved or deleted; restore it, or convert again without "
                f"--lazy from a checkpoint that exists") from None
        if st.st_size != want.get("size") or st.st_mtime_ns != want.get("mtime_ns"):
            raise UniversalFormatError(
                f"{f}: changed since the lazy conversion (size {st.st_size} vs {want.get('size')}, mtime "
                f"{st.st_mtime_ns} vs {want.get('mtime_ns')}); {meta_path.parent} indexes the old bytes. "
                f"Run `megatron-ucp to-universal --lazy` again (or without --lazy for a standalone copy)")
    return root


class UniversalCheckpoint:
    """A complete universal checkpoint opened for lazy reading (open() verifies the marker and metadata).
    A lazy checkpoint (`to-universal --lazy`) reads every tensor from the source checkpoint's files."""

    def __init__(self, path: Path, metadata: dict):
        self.path = path
        self.metadata = metadata
        self.iteration: int = int(metadata["iteration"])
        self.consumed_train_samples: int = int(metadata["consumed_train_samples"])
        self.config = GPTModelConfig.from_dict(metadata["model_config"])
        self.source_layout = ParallelLayout.from_dict(metadata["source"]["layout"])
        self.args: dict = metadata.get("args", {})
        self.scheduler_state: dict = metadata.get("scheduler") or {}
        self.param_groups: list[dict] = list((metadata.get("optimizer") or {}).get("param_groups", []))
        meta_path = path / METADATA_FILENAME
        lazy = metadata.get("lazy")
        self.lazy_source: Optional[Path] = None
        if lazy is not None:
            self.lazy_source = _check_lazy_source(lazy, meta_path)
        self.parameters: dict[str, ParamInfo] = {
            name: _param_info(name, d, meta_path, self.lazy_source) for name, d in metadata["parameters"].items()}
        self.bytes_read = 0
        self._files = threading.local()  # lazy reads: source descriptors per thread

    @classmethod
    def open(cls, path: PathLike) -> "UniversalCheckpoint":
        path = Path(path)
        if not path.is_dir():
            raise UniversalFormatError(f"{path}: no such universal checkpoint directory; pass the DST of "
                                       f"`megatron-ucp to-universal`")
        marker = path / COMPLETE_FILENAME
        meta_path = path / METADATA_FILENAME
        if not marker.is_file():
            raise _incomplete(path)
        try:
            complete = json.loads(marker.read_text())
        except ValueError:
            raise _incomplete(path) from None
        if not isinstance(complete, dict) or complete.get("format") != FORMAT_NAME:
            raise UniversalFormatError(f"{marker}: not a {FORMAT_NAME} marker; {path} is not a universal checkpoint")
        if not meta_path.is_file():
            raise UniversalFormatError(f"{meta_path}: missing although {marker} exists; the checkpoint was "
                                       f"damaged after conversion, reconvert it")
        if complete.get("metadata_sha256") != _sha256(meta_path):
            raise UniversalFormatError(f"{meta_path}: its sha256 differs from the one in {marker}; the metadata "
                                       f"was edited or damaged after conversion, reconvert it")
        try:
            metadata = json.loads(meta_path.read_text())
        except ValueError as e:
            raise UniversalFormatError(f"{meta_path}: not valid JSON ({e}); reconvert") from None
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
            raise UniversalFormatError(f"{meta_path}: format is {metadata.get('format') if isinstance(metadata, dict) else None!r}, "
                                       f"expected {FORMAT_NAME!r}; not a universal checkpoint")
        version = metadata.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            raise UniversalFormatError(f"{meta_path}: format version {version!r}, this megatron-ucp reads version "
                                       f"{FORMAT_VERSION}; upgrade megatron-ucp or reconvert with this one")
        missing = [k for k in REQUIRED_METADATA + ("parameters",) if k not in metadata]
        if missing:
            raise UniversalFormatError(f"{meta_path}: lacks {missing}; reconvert")
        return cls(path, metadata)

    def _file(self, name: str) -> Path:
        info = self.parameters.get(name)
        if info is None:
            raise UniversalFormatError(f"{self.path}: no parameter {name!r} (it has {len(self.parameters)}, e.g. "
                                       f"{next(iter(self.parameters), None)!r}); names are canonical with global "
                                       f"layer indices")
        return self.path / info.file if info.file else self.path

    def _source_files(self) -> FileHandles:
        files = getattr(self._files, "handles", None)
        if files is None:
            files = self._files.handles = FileHandles()
        return files

    def read(self, name: str, key: str = "fp32", index: Optional[tuple[slice, ...]] = None) -> torch.Tensor:
        """One stored tensor of a parameter, or only the region `index` of it (read through mmap: just
        those bytes). `index` is a tuple of step-1 slices, one per leading dimension."""
        file = self._file(name)
        info = self.parameters[name]
        if key not in info.tensors:
            raise UniversalFormatError(f"{file}: {name} has no {key!r} (it has {list(info.tensors)}); the source "
                                       f"checkpoint had no optimizer state")
        if index is not None:
            index = tuple(index)
            if len(index) > len(info.shape) or any(
                    not isinstance(s, slice) or s.step not in (None, 1) for s in index):
                raise UniversalFormatError(f"{name}: index {index} must be at most {len(info.shape)} step-1 slices")
        tensor = self._read_lazy(info, key, index) if info.placements is not None else \
            self._read_file(file, info, key, index)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _read_file(self, file: Path, info: ParamInfo, key: str, index) -> torch.Tensor:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                if index is None:
                    tensor = f.get_tensor(key)
                else:
                    region = f.get_slice(key)
                    if tuple(region.get_shape()) != info.shape:
                        raise UniversalFormatError(f"{file}: '{key}' has shape {tuple(region.get_shape())}, "
                                                   f"metadata says {info.shape}; reconvert")
                    tensor = region[index]
        except UniversalFormatError:
            raise
        except Exception as e:  # missing, truncated or foreign file
            raise UniversalFormatError(f"{file}: cannot read '{key}' of {info.name} ({type(e).__name__}: {e}); the "
                                       f"file is missing or damaged, reconvert") from e
        if index is None and tuple(tensor.shape) != info.shape:
            raise UniversalFormatError(f"{file}: '{key}' has shape {tuple(tensor.shape)}, metadata says "
                                       f"{info.shape}; reconvert")
        return tensor

    def _read_lazy(self, info: ParamInfo, key: str, index) -> torch.Tensor:
        try:
            return read_box(self._source_files(), info.placements[key], index)
        except (OSError, StorageError) as e:
            raise UniversalFormatError(f"{self.path}: reading {info.name} [{key}] from the source checkpoint "
                                       f"{self.lazy_source} failed ({e}); restore the source or reconvert") from e

    def read_local(self, name: str, key: str, tp_rank: int, tp_size: int,
                   local_box: Optional[Sequence[slice]] = None) -> torch.Tensor:
        """The region `local_box` (leading-dim slices; default all) of TP rank `tp_rank`'s shard of a
        parameter, reading only the pieces of the global tensor it needs (the stored pattern's
        local_reads)."""
        info = self.parameters.get(name)
        if info is None:
            self._file(name)
        reads = info.pattern.local_reads(info.shape, tp_rank, tp_size, local_box, name=name)
        if len(reads) == 1 and local_box is None:
            return self.read(name, key, reads[0][0])
        local = info.pattern.local_shape(info.shape, tp_size, name=name)
        box = [slice(*s.indices(n)[:2]) for s, n in zip(local_box or (), local)]
        out = torch.empty([s.stop - s.start for s in box] + list(local[len(box):]), dtype=torch.float32)
        for src, dst in reads:
            out[dst] = self.read(name, key, src)
        return out

    def read_for_rank(self, name: str, tp_rank: int, tp_size: int, key: str = "fp32") -> torch.Tensor:
        """The TP rank's whole shard of a parameter, reading only its regions."""
        return self.read_local(name, key, tp_rank, tp_size)

    def total_bytes(self) -> int:
        """Bytes of all stored tensors (fp32)."""
        return sum(math.prod(p.shape) * 4 * len(p.tensors) for p in self.parameters.values())
