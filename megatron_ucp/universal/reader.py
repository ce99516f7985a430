"""The universal checkpoint on disk: its writer (locked, staged, checksummed, marker-last) and its lazy,
slice-reading, verifying reader.

A universal checkpoint is one directory: `metadata.json` (iteration, model config, optimizer
hyper-parameters, scheduler, and one entry per canonical parameter with its pattern and the block
checksums of its file), one safetensors file per parameter under `tensors/` holding fp32 consolidated
tensors (`fp32`, `exp_avg`, `exp_avg_sq`), and a `COMPLETE` marker written last. docs/FORMAT.md is the
specification; this module is one implementation of it. Nothing here is pickled.

Writing goes through `staging.Staging` (one writer per destination, nothing half-written under DST's
name, an existing DST replaced only with overwrite and only if this tool wrote it) and digests every
byte as it is written (`integrity.BlockHasher`). Reading checks every block a read touches against
those digests (`VerifiedTensorFile`; for a lazy checkpoint, the source regions'
`integrity.SourceDigests`), and every declared shape against the bytes that back it before anything
is allocated. torch and safetensors are imported only by the functions that make tensors, so opening,
describing and checking a checkpoint needs neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

from megatron_ucp.core.dtypes import to_torch
from megatron_ucp.core import optimizers
from megatron_ucp.core.optimizers import refusal
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.formats import megatron_kind
from megatron_ucp.io import integrity
from megatron_ucp.io.byteio import (
    FileHandles, FileRegion, Placement, StorageError, placement_from_json, read_box_bits, relative_inside)
from megatron_ucp.io.integrity import ChecksumError, DigestRecord, SourceDigests, VerifiedBlocks
from megatron_ucp.io.staging import check_not_staging
from megatron_ucp.universal.format import (
    OPTIMIZER_STATES_VERSION, ZEROED_VERSION, COMPLETE_FILENAME, FORMAT_NAME, MAX_HEADER, MAX_RNG_FILE, METADATA_FILENAME, READABLE_VERSIONS,
    REQUIRED_METADATA,
    RNG_FILENAME, TENSORS_DIRNAME, TENSOR_KEYS, ParamInfo, PathLike, UniversalFormatError, check_name, sha256_file,
    tensor_file, tensor_keys)
from megatron_ucp.universal.tensorfile import VerifiedTensorFile

if TYPE_CHECKING:
    import torch



# metadata.json is refused before it is parsed when it is larger than the checkpoint's real size can explain:
# a base, plus per tensor file under tensors/ and per MiB of tensor bytes (a checksum block is ~36 bytes of
# JSON); a lazy checkpoint (no tensors/) gets a flat budget (its source regions and their checksums).
_METADATA_BASE = 16 << 20
_METADATA_PER_FILE = 16 << 10
_METADATA_PER_MIB = 128
_LAZY_METADATA_MAX = 128 << 20
# Hyper-parameters every optimizer param group of a checkpoint with optimizer state records (Megatron's groups
# hold them all; a writer cannot rebuild a group without them).
_GROUP_HYPER = ("lr", "weight_decay")


# --------------------------------------------------------------------------------------------------
# Reading


def _not_universal(path: Path) -> UniversalFormatError:
    kind = megatron_kind(path)
    if kind is not None:
        return UniversalFormatError(f"{path}: is {kind}, not a universal checkpoint; convert it first with "
                                    f"`megatron-ucp to-universal {path} UCP_DIR` and pass UCP_DIR")
    return UniversalFormatError(f"{path}: incomplete universal checkpoint: no {COMPLETE_FILENAME} marker (the "
                                f"conversion did not finish, or this is not a universal checkpoint); pass the DST of "
                                f"a finished `megatron-ucp to-universal`, or convert again into a new directory")


def _malformed(meta_path: Path, name: str, why: str) -> UniversalFormatError:
    return UniversalFormatError(f"{meta_path}: parameter {name!r} has a malformed entry ({why}); the file was "
                                f"edited or is corrupt, reconvert")


def _check_record(name: str, shape: tuple[int, ...], tensors: tuple[str, ...], record: DigestRecord) -> None:
    """The tensor file a record describes must hold the declared tensors: refuse a shape (or record) that
    cannot be, before anything is read or allocated (a shape bomb in an edited metadata.json)."""
    data = math.prod(shape) * 4 * len(tensors)
    if record.offset != 0 or not data + 8 < record.size <= data + 8 + MAX_HEADER:
        raise ValueError(f"shape {list(shape)} x {len(tensors)} tensor(s) needs {data} bytes of data, but its "
                         f"checksummed tensor file holds {record.size} bytes")


def _param_info(name: str, d: Mapping[str, Any], meta_path: Path, version: int,
                lazy_root: Optional[Path] = None, lazy_files: Optional[Mapping[str, Any]] = None,
                keys: tuple[tuple[str, ...], ...] = (TENSOR_KEYS,)) -> ParamInfo:
    from megatron_ucp.core.patterns import PatternError, pattern_from_json

    try:
        check_name(name)
        pattern = pattern_from_json(d["pattern"])
        tensors = tuple(d["tensors"])
        shape = tuple(int(s) for s in d["shape"])
        if any(n < 0 for n in shape):
            raise ValueError(f"negative dimension in shape {list(shape)}")
        # `keys`: per optimizer the run gives parameters, 'fp32' and its states by name (tensor_keys); a parameter
        # holds all of one or only 'fp32' (a buffer)
        if not all(isinstance(k, str) for k in tensors) or len(set(tensors)) != len(tensors) or (
                tensors != ("fp32",) and set(tensors) not in [set(k) for k in keys]):
            raise UniversalFormatError(f"tensors {list(tensors)} must be {' or '.join(str(list(k)) for k in keys)} "
                                       f"(or 'fp32' alone)")
        if d.get("dtype") != "float32":
            raise ValueError(f"dtype {d.get('dtype')!r}, the format stores float32")
        placements, record, zeroed = None, None, None
        if lazy_root is not None:
            placements = {key: placement_from_json(d["source_bytes"][key], str(lazy_root)) for key in tensors}
            if any(p.shape != shape for p in placements.values()):
                raise UniversalFormatError(f"source_bytes shapes differ from {shape}")
            _check_regions(placements, lazy_root, lazy_files or {})
            zeroed = _zeroed_runs(d.get("zeroed"), tensors, math.prod(shape))
            if zeroed and version < ZEROED_VERSION:
                raise ValueError(f"'zeroed' runs in a version-{version} checkpoint (they need version "
                                 f"{ZEROED_VERSION})")
        else:
            if d["file"] != tensor_file(name):
                raise UniversalFormatError(f"file {d['file']!r} is not {tensor_file(name)!r}")
            if version >= 2:
                if d.get("checksum") is None:
                    raise ValueError(f"no checksum record (version {version} requires one per tensor file)")
                record = DigestRecord.from_json(d["checksum"], "checksum")
                _check_record(name, shape, tensors, record)
        return ParamInfo(name=name, shape=shape, dtype=d["dtype"],
                         model_dtype=d.get("model_dtype", d["dtype"]), pattern=pattern, file=d["file"],
                         tensors=tensors, step=None if d.get("step") is None else int(d["step"]),
                         param_group=dict(d.get("param_group") or {}), placements=placements, checksum=record,
                         zeroed=zeroed)
    except (KeyError, TypeError, ValueError, PatternError, UniversalFormatError) as e:
        raise _malformed(meta_path, name, f"{type(e).__name__}: {e}") from None


def _optimizer_states(optimizer: Any, meta_path: Path, version: int, args: Mapping[str, Any]
                      ) -> tuple[Optional[str], tuple[tuple[str, ...], ...]]:
    """metadata.json's optimizer type and, per optimizer its run gives parameters (core/optimizers.py
    run_optimizers: one, or an emerging optimizer's two), the tensor keys a parameter of it holds ('fp32' and the
    row's state names). Adam's checkpoints of versions 1-3 name no states (Adam's, TENSOR_KEYS); any other type is
    version 4 and declares the states of all its rows by name, each with its pattern ("elementwise": sharded as its
    parameter), which must be the table's."""
    kind = optimizer.get("type") if isinstance(optimizer, dict) else None
    if kind in (None, "adam"):
        declared = optimizer.get("states") if isinstance(optimizer, dict) else None
        if declared is not None and declared != {k: "elementwise" for k in TENSOR_KEYS[1:]}:
            raise UniversalFormatError(f"{meta_path}: optimizer.states {declared!r} are not Adam's; metadata.json "
                                       f"was edited, reconvert")
        return kind, (TENSOR_KEYS,)
    if not isinstance(kind, str) or version < OPTIMIZER_STATES_VERSION:
        raise UniversalFormatError(f"{meta_path}: optimizer.type {kind!r} in a version-{version} checkpoint (state "
                                   f"other than Adam's needs version {OPTIMIZER_STATES_VERSION}); reconvert")
    why = refusal(kind)
    if why is not None:
        raise UniversalFormatError(f"{meta_path}: {why}")
    try:
        rows = optimizers.run_optimizers(kind, args if isinstance(args, Mapping) else {})
    except optimizers.OptimizerNotSupported as e:
        raise UniversalFormatError(f"{meta_path}: {e}") from None
    keys = tuple(tensor_keys(row) for row in rows)
    states = optimizers.run_states(kind, args if isinstance(args, Mapping) else {})
    declared = optimizer.get("states")
    if declared != {k: "elementwise" for k in states}:
        raise UniversalFormatError(f"{meta_path}: optimizer.states {declared!r} are not {kind}'s "
                                   f"({', '.join(states)}, elementwise); metadata.json was edited, reconvert")
    return kind, keys


def _check_group_optimizers(parameters: Mapping[str, ParamInfo], groups: list, kind: Optional[str],
                            meta_path: Path) -> None:
    """Under an emerging optimizer (two rows), each parameter holds the states of its own param group's optimizer
    (core/optimizers.py group_optimizer: megatron-core's rule), not the other row's."""
    for name, info in parameters.items():
        index = info.param_group.get("index")
        if len(info.tensors) == 1 or not _is_int(index) or not 0 <= index < len(groups):
            continue  # a buffer or weights alone; a bad index is refused with the other problems
        try:
            row = optimizers.OPTIMIZERS[optimizers.group_optimizer(groups[index], kind)]
        except optimizers.OptimizerNotSupported as e:
            raise UniversalFormatError(f"{meta_path}: optimizer.param_groups[{index}]: {e}") from None
        if set(info.tensors) != {"fp32", *row.states}:
            raise UniversalFormatError(
                f"{meta_path}: {name} holds {list(info.tensors)} but its param group {index} is {row.name}'s "
                f"({', '.join(('fp32',) + row.states)}); metadata.json was edited, reconvert")


def _zero_runs(values, runs, shape: tuple, index) -> None:
    """Zero, in `values` (the box `index` of a tensor of `shape`, as read), the elements of the flat runs."""
    import numpy

    flat = numpy.concatenate([numpy.arange(start, start + length) for start, length in runs])
    coords = numpy.unravel_index(flat, shape)
    box = [slice(*s.indices(n)[:2]) for s, n in zip(index or (), shape)]
    inside = numpy.ones(flat.shape, dtype=bool)
    for c, s in zip(coords, box):
        inside &= (c >= s.start) & (c < s.stop)
    local = tuple(c[inside] - (box[i].start if i < len(box) else 0) for i, c in enumerate(coords))
    values.reshape([s.stop - s.start for s in box] + list(shape[len(box):]))[local] = 0


def _zeroed_runs(found: Any, tensors: tuple, numel: int) -> Optional[dict]:
    """A lazy entry's 'zeroed' section checked: {tensor key: [[start, length], ...]} with sorted, disjoint runs
    inside the tensor (ValueError otherwise); None when absent."""
    if found is None:
        return None
    if not isinstance(found, dict) or set(found) - set(tensors):
        raise ValueError(f"'zeroed' must map some of {list(tensors)} to element runs")
    out = {}
    for key, runs in found.items():
        end, checked = 0, []
        for run in runs:
            start, length = (int(x) for x in run)
            if start < end or length < 1 or start + length > numel:
                raise ValueError(f"'zeroed' {key} run {run} is not sorted, disjoint and inside {numel} elements")
            end = start + length
            checked.append((start, length))
        out[key] = tuple(checked)
    return out


def _check_regions(placements: Mapping[str, Placement], root: Path, files: Mapping[str, Any]) -> None:
    """Every byte a lazy entry reads lies inside a file the index lists, within its recorded size: the
    declared shapes are backed by real bytes before anything is allocated."""
    prefix = str(root) + os.sep
    for placement in placements.values():
        for shard in placement.shards:
            for region in shard.regions:
                rel = region.path[len(prefix):] if region.path.startswith(prefix) else None
                want = files.get(rel) if rel is not None else None
                if want is None:
                    raise ValueError(f"reads {region.path}, which the lazy index does not list")
                if region.offset + region.nbytes > int(want.get("size", -1)):
                    raise ValueError(f"reads bytes {region.offset}..{region.offset + region.nbytes} of {rel}, which "
                                     f"has {want.get('size')} bytes")


def _inside(path: Path, root: Path) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def _check_lazy_source(lazy: Any, meta_path: Path, version: int, source: Any, direct: bool = False
                       ) -> tuple[Path, dict, Optional[SourceDigests]]:
    """A lazy checkpoint's source folder, its files and their checksums (version 2), after checking every
    file it refers to is there, a regular file of tensor bytes of the Megatron-LM checkpoint recorded as the
    conversion's source (by that format's file names), reached without a link, unchanged. Containment does
    not rest on checksums: anything else is refused before a byte is read. `direct`: a direct resume's
    in-memory index (UniversalCheckpoint.from_source_index), made by this run from the source: no
    checksums (no second pass over the source), the same containment and stat() checks."""
    from megatron_ucp.formats import is_data_file

    try:
        root = Path(lazy["source"])
        files = {relative_inside(rel): dict(want) for rel, want in dict(lazy["files"]).items()}
        if not root.is_absolute():
            raise ValueError(f"source {str(root)!r} is not an absolute path")
        recorded = source.get("path") if isinstance(source, dict) else None
        if str(root) != recorded:
            raise ValueError(f"source {str(root)!r} is not the checkpoint the conversion read ({recorded!r})")
    except (KeyError, TypeError, ValueError) as e:
        raise UniversalFormatError(f"{meta_path}: malformed 'lazy' section ({e}); reconvert") from None
    for rel, want in files.items():
        f = root / rel
        if not is_data_file(rel):
            raise UniversalFormatError(
                f"{meta_path}: the lazy index reads {f}, which is not a tensor file of a Megatron-LM checkpoint "
                f"folder (__R_N.distcp, mp_rank_*/model_optim_rng.pt or distrib_optim.pt); a lazy checkpoint "
                f"reads only its source checkpoint's files: the metadata was edited, reconvert")
        if os.path.realpath(f) != os.path.join(os.path.realpath(root), rel):
            raise UniversalFormatError(f"{f}: reached through a symbolic link; a lazy checkpoint reads only files "
                                       f"inside {root} itself: restore the source checkpoint, or reconvert")
        try:
            st = os.lstat(f)
        except OSError:
            if direct:
                raise UniversalFormatError(f"{f}: missing on this node although rank 0 indexed it; every node must "
                                           f"see the same checkpoint at {root} (a shared filesystem)") from None
            raise UniversalFormatError(
                f"{f}: missing. {meta_path.parent} is a lazy universal checkpoint (an index into {root}, "
                f"not a copy) and its source was moved or deleted; restore it, or convert again without "
                f"--lazy from a checkpoint that exists") from None
        if not stat.S_ISREG(st.st_mode) or not _inside(f, root):
            raise UniversalFormatError(f"{f}: is not a regular file inside {root} (a symbolic link or other file "
                                       f"was put in its place); restore the source checkpoint, or reconvert")
        if (st.st_size != want.get("size") or st.st_mtime_ns != want.get("mtime_ns")) and direct:
            raise UniversalFormatError(
                f"{f}: size {st.st_size} and mtime {st.st_mtime_ns} on this node, rank 0 indexed {want.get('size')} "
                f"and {want.get('mtime_ns')}; the checkpoint changed while the run started (is another job writing "
                f"it?) or the nodes see different copies: relaunch once it is finished, from one shared copy")
        if st.st_size != want.get("size") or st.st_mtime_ns != want.get("mtime_ns"):
            raise UniversalFormatError(
                f"{f}: changed since the lazy conversion (size {st.st_size} vs {want.get('size')}, mtime "
                f"{st.st_mtime_ns} vs {want.get('mtime_ns')}); {meta_path.parent} indexes the old bytes. "
                f"Run `megatron-ucp to-universal --lazy` again (or without --lazy for a standalone copy)")
    digests = None
    if version >= 2 and not direct:
        try:
            digests = SourceDigests({str(root / rel): [DigestRecord.from_json(r, f"lazy {rel}")
                                                       for r in want["checksums"]] for rel, want in files.items()})
        except (KeyError, TypeError, ValueError) as e:
            raise UniversalFormatError(f"{meta_path}: lazy section without valid source checksums ({e}); "
                                       f"reconvert with this megatron-ucp") from None
    return root, files, digests


def _model_parameters(config: GPTModelConfig, parameters: Mapping[str, Any], meta_path: Path) -> Union[list, str]:
    """The parameters (name, global shape) of the model metadata.json's model_config describes (the GPT
    rulebook), or why there is none (a problem line). Bounded by what the file really lists: a config
    declaring more layers or experts than there are parameters is not expanded, and more parameters than the
    model has are refused here, before any entry is parsed."""
    from megatron_ucp.adapters.gpt import expected_parameters
    from megatron_ucp.core.layout import LayoutError
    from megatron_ucp.core.patterns import PatternError

    declared = len(parameters)
    if max(config.num_layers, config.num_experts or 0) > declared:
        return (f"{meta_path}: model_config declares num_layers={config.num_layers}, num_experts="
                f"{config.num_experts} but only {declared} parameters are listed; the checkpoint is incomplete or "
                f"metadata.json was edited, reconvert")
    try:
        expected = expected_parameters(config)
    except (LayoutError, PatternError, ValueError, NotImplementedError) as e:
        return f"{meta_path}: its model_config describes no model this tool knows ({e}); reconvert"
    if declared > len(expected):
        names = {name for name, _ in expected}
        extra = [name for name in parameters if name not in names]
        raise UniversalFormatError(
            f"{meta_path}: lists {declared} parameters, {len(extra)} of them ({', '.join(extra[:3])}"
            f"{' ...' if len(extra) > 3 else ''}) not in the model of its model_config (num_layers="
            f"{config.num_layers}, {len(expected)} parameters); metadata.json was edited or belongs to another "
            f"model, reconvert")
    return expected


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_metadata_size(path: Path, meta_path: Path) -> None:
    """Refuse, before parsing, a metadata.json larger than the checkpoint's real size can explain (a file of a
    million invented entries would take gigabytes and minutes to parse and check)."""
    files, nbytes = 0, 0
    try:
        with os.scandir(path / TENSORS_DIRNAME) as it:
            for entry in it:
                files += 1
                nbytes += entry.stat(follow_symlinks=False).st_size
        limit = _METADATA_BASE + _METADATA_PER_FILE * files + _METADATA_PER_MIB * (nbytes >> 20)
    except OSError:  # a lazy checkpoint has no tensors/
        limit = _LAZY_METADATA_MAX
    size = meta_path.stat().st_size
    if size > limit:
        raise UniversalFormatError(
            f"{meta_path}: {size} bytes, more than a checkpoint of {files} tensor files ({nbytes} bytes) can need "
            f"(at most {limit}); metadata.json was edited or does not belong to this checkpoint, reconvert")


def _as_format_error(e: Exception) -> UniversalFormatError:
    return UniversalFormatError(" ".join(str(e).split()))


class UniversalCheckpoint:
    """A complete universal checkpoint opened for lazy reading (open() verifies the marker and metadata).
    Every read checks the blocks it touches against the checksums recorded when the file was written
    (version 2); a lazy checkpoint (`to-universal --lazy`) reads every tensor from the source
    checkpoint's files, checked against the source checksums recorded by the lazy conversion."""

    def __init__(self, path: Path, metadata: dict, *, rng_bytes: Optional[bytes] = None, direct: bool = False):
        self.path = path
        self.metadata = metadata
        self.version: int = int(metadata["version"])
        # a direct resume's index lives in memory (from_source_index): its RNG file too
        self.direct = direct
        self._rng_bytes = rng_bytes
        meta_path = Path(f"{path} (this run's index)") if direct else path / METADATA_FILENAME
        try:
            self.iteration: int = int(metadata["iteration"])
            self.consumed_train_samples: int = int(metadata["consumed_train_samples"])
            self.config = GPTModelConfig.from_dict(metadata["model_config"])
            self.source_layout = ParallelLayout.from_dict(metadata["source"]["layout"])
        except (KeyError, TypeError, ValueError) as e:
            raise UniversalFormatError(f"{meta_path}: malformed ({type(e).__name__}: {e}); reconvert") from None
        self.args: dict = metadata.get("args", {})
        self.scheduler_state: dict = metadata.get("scheduler") or {}
        self.loss_scaler, self.rng_section = _run_state_metadata(metadata, meta_path)
        optimizer = metadata.get("optimizer")
        groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
        self.param_groups: list[dict] = list(groups) if isinstance(groups, list) else []
        # the optimizer whose state the parameters hold, by name (None: none, or Adam's before version 4)
        self.optimizer_type, keys = _optimizer_states(optimizer, meta_path, self.version, self.args)
        lazy = metadata.get("lazy")
        self.lazy_source: Optional[Path] = None
        self.source_digests: Optional[SourceDigests] = None
        lazy_files = None
        if lazy is not None:
            self.lazy_source, lazy_files, self.source_digests = _check_lazy_source(
                lazy, meta_path, self.version, metadata.get("source"), direct)
        if not isinstance(metadata["parameters"], dict):
            raise UniversalFormatError(f"{meta_path}: 'parameters' is not an object; reconvert")
        self._expected = _model_parameters(self.config, metadata["parameters"], meta_path)
        self.parameters: dict[str, ParamInfo] = {
            name: _param_info(name, d, meta_path, self.version, self.lazy_source, lazy_files, keys)
            for name, d in metadata["parameters"].items()}
        if self.optimizer_type is None and self.has_optimizer_state:
            self.optimizer_type = "adam"  # written before the type was checked: Adam's keys are all it could hold
        if len(keys) > 1:
            _check_group_optimizers(self.parameters, self.param_groups, self.optimizer_type, meta_path)
        self.bytes_read = 0
        self._files = threading.local()  # lazy reads: source descriptors per thread
        self._verified = VerifiedBlocks()  # blocks already checked by this reader
        self._headers: dict = {}  # tensor file identity -> its parsed (checked) safetensors header
        self._backed: set = set()  # parameters whose tensor file was found to hold the declared bytes

    @classmethod
    def open(cls, path: PathLike, *, validate: bool = True) -> "UniversalCheckpoint":
        """Open the checkpoint at `path`: the marker, metadata.json's sha256 and every entry, then (with
        `validate`, every command that reads one) everything `problems()` finds, the first refused in one
        line. `check` and `inspect` open without it and list every problem."""
        ucp = cls._open(Path(path))
        if validate:
            problems = ucp.problems()
            if problems:
                more = (f" ({len(problems) - 1} more problem(s): `megatron-ucp check {ucp.path}` lists them)"
                        if len(problems) > 1 else "")
                raise UniversalFormatError(" ".join(problems[0].split()) + more)
        return ucp

    @classmethod
    def from_source_index(cls, document: dict, rng_bytes: Optional[bytes] = None) -> "UniversalCheckpoint":
        """A direct resume's index (convert.runner.source_index: a lazy checkpoint's metadata.json document
        and RNG file, made in memory from a Megatron-LM checkpoint, never written) opened for reading with the
        validation every reader gets. Its path is the source iteration folder; reads are not checked against
        checksums (the index has none: making them would read the whole source), everything else is."""
        lazy = document.get("lazy") if isinstance(document, dict) else None
        if not isinstance(lazy, dict) or not isinstance(lazy.get("source"), str):
            raise UniversalFormatError("a direct resume's index has no source folder (an internal error)")
        ucp = cls(Path(lazy["source"]), document, rng_bytes=rng_bytes, direct=True)
        problems = ucp.problems()
        if problems:
            raise UniversalFormatError(" ".join(problems[0].split()))
        return ucp

    @classmethod
    def _open(cls, path: Path) -> "UniversalCheckpoint":
        check_not_staging(path, error=UniversalFormatError)
        if not path.is_dir():
            raise UniversalFormatError(f"{path}: no such universal checkpoint directory; pass the DST of "
                                       f"`megatron-ucp to-universal`")
        marker = path / COMPLETE_FILENAME
        meta_path = path / METADATA_FILENAME
        if not marker.is_file():
            raise _not_universal(path)
        try:
            complete = json.loads(marker.read_text())
        except (ValueError, UnicodeDecodeError):
            raise _not_universal(path) from None
        if not isinstance(complete, dict) or complete.get("format") != FORMAT_NAME:
            raise UniversalFormatError(f"{marker}: not a {FORMAT_NAME} marker; {path} is not a universal checkpoint")
        if not meta_path.is_file():
            raise UniversalFormatError(f"{meta_path}: missing although {marker} exists; the checkpoint was "
                                       f"damaged after conversion, reconvert it")
        if complete.get("metadata_sha256") != sha256_file(meta_path):
            raise UniversalFormatError(f"{meta_path}: its sha256 differs from the one in {marker}; the metadata "
                                       f"was edited or damaged after conversion, reconvert it")
        _check_metadata_size(path, meta_path)
        try:
            metadata = json.loads(meta_path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise UniversalFormatError(f"{meta_path}: not valid JSON ({e}); reconvert") from None
        except RecursionError:
            raise UniversalFormatError(f"{meta_path}: nested too deeply to be a universal checkpoint's metadata "
                                       f"(arrays or objects thousands of levels deep); the file was edited or is "
                                       f"corrupt, reconvert") from None
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
            raise UniversalFormatError(f"{meta_path}: format is {metadata.get('format') if isinstance(metadata, dict) else None!r}, "
                                       f"expected {FORMAT_NAME!r}; not a universal checkpoint")
        version = metadata.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise UniversalFormatError(f"{meta_path}: format version {version!r}, this megatron-ucp reads versions "
                                       f"{', '.join(map(str, READABLE_VERSIONS))}; upgrade megatron-ucp or reconvert "
                                       f"with this one")
        missing = [k for k in REQUIRED_METADATA + ("parameters",) if k not in metadata]
        if missing:
            raise UniversalFormatError(f"{meta_path}: lacks {missing}; reconvert")
        return cls(path, metadata)

    # -- metadata-only findings --------------------------------------------------------------------

    def problems(self) -> list[str]:
        """What metadata.json and stat() show to be wrong, one line each (docs/FORMAT.md "Validation"): tensor
        files missing, not regular files inside the checkpoint or of the wrong size; parameters of the model
        its model_config describes (the GPT rulebook) missing, of another shape or extra; optimizer param
        groups missing, without hyper-parameters or referred to by an index they do not have; the run state's
        file. Every command that opens a checkpoint refuses it when there is any; `check` lists them all (and
        reads every byte). No tensor byte is read."""
        out = self.file_problems()
        if isinstance(self._expected, str):
            out.append(self._expected)
        else:
            out += self.model_problems(self._expected)
        return out + self._optimizer_problems() + self._run_state_problems()

    def _optimizer_problems(self) -> list[str]:
        meta_path = self.path / METADATA_FILENAME
        optimizer = self.metadata.get("optimizer")
        groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
        if not isinstance(optimizer, dict) or not isinstance(groups, (list, type(None))) or not all(
                isinstance(g, dict) for g in groups or ()):
            return [f"{meta_path}: 'optimizer' is not {{\"type\", \"param_groups\": [objects]}}; metadata.json was "
                    f"edited, reconvert"]
        out = []
        stateful = [name for name, info in self.parameters.items() if len(info.tensors) > 1]
        if stateful and not groups:
            out.append(f"{meta_path}: {len(stateful)} parameters hold optimizer state (e.g. {stateful[0]}) but "
                       f"optimizer.param_groups is empty or missing, so the groups' lr, weight decay and betas are "
                       f"lost; metadata.json was edited, reconvert")
        for i, group in enumerate(groups or () if stateful else ()):
            lacking = [k for k in _GROUP_HYPER if not _is_number(group.get(k))]
            if lacking:
                out.append(f"{meta_path}: optimizer.param_groups[{i}] has no {' or '.join(lacking)} (a number); "
                           f"metadata.json was edited, reconvert")
                break
        bad = [(name, info.param_group.get("index")) for name, info in self.parameters.items()
               if info.param_group.get("index") is not None and not (
                   _is_int(info.param_group["index"]) and 0 <= info.param_group["index"] < len(groups or ()))]
        if bad:
            out.append(f"{meta_path}: {bad[0][0]} (and {len(bad) - 1} other parameter(s)) is in param_group.index "
                       f"{bad[0][1]!r}, but optimizer.param_groups has {len(groups or ())} group(s); metadata.json "
                       f"was edited, reconvert")
        return out

    def _run_state_problems(self) -> list[str]:
        """The `rng` section against the file it describes (size by stat; `check` hashes it)."""
        section = self.rng_section
        if section is None:
            return []
        path = self.path / RNG_FILENAME
        size, ranks = section.get("size"), section.get("ranks")
        if self.direct:
            held = len(self._rng_bytes) if self._rng_bytes is not None else None
        else:
            try:
                st = os.lstat(path)
            except OSError:
                return [f"{path}: missing although metadata.json records RNG states; restore it from a copy or "
                        f"reconvert"]
            if not stat.S_ISREG(st.st_mode) or not _inside(path, self.path):
                return [f"{path}: is not a regular file inside {self.path}; restore it from a copy or reconvert"]
            held = st.st_size
        if not _is_int(size) or size != held or size > MAX_RNG_FILE:
            return [f"{self.path / METADATA_FILENAME}: rng.size is {size!r}, {path} has {held} bytes (at most "
                    f"{MAX_RNG_FILE}); metadata.json was edited, reconvert"]
        if not _is_int(ranks) or not 1 <= ranks <= ParallelLayout.from_dict(section["layout"]).world_size:
            return [f"{self.path / METADATA_FILENAME}: rng.ranks is {ranks!r}, not a rank count of the layout it "
                    f"records; metadata.json was edited, reconvert"]
        return []

    def file_problems(self) -> list[str]:
        """Tensor files missing, not regular files inside the checkpoint, or of a size that cannot hold the
        declared tensors (version 2: exactly the checksummed size), from stat() alone: one line each."""
        out = []
        for info in self.parameters.values():
            if info.file is None:
                continue
            problem = self._backing_problem(info)
            if problem:
                out.append(problem)
        return out

    def model_problems(self, expected: Sequence[tuple[str, Sequence[int]]]) -> list[str]:
        """Parameters of the model (`expected`: name, global shape, from its rulebook) missing here, stored
        with another shape, or stored but not in the model: what from-universal and a resume would refuse."""
        want = {name: tuple(int(s) for s in shape) for name, shape in expected}
        out = []
        missing = [n for n in want if n not in self.parameters]
        if missing:
            out.append(f"{self.path}: parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} of the model "
                       f"({len(missing)} in all) are missing; the checkpoint is incomplete, reconvert")
        for name, shape in want.items():
            if name in self.parameters and self.parameters[name].shape != shape:
                out.append(f"{self.path}: {name} has shape {list(self.parameters[name].shape)}, the model config "
                           f"gives {list(shape)}; metadata.json was edited, reconvert")
        extra = sorted(set(self.parameters) - set(want))
        if extra:
            out.append(f"{self.path}: parameters {extra[:5]}{' ...' if len(extra) > 5 else ''} are not in the "
                       f"model of its model_config; metadata.json was edited, reconvert")
        return out

    def _backing_problem(self, info: ParamInfo) -> Optional[str]:
        file = self.path / info.file
        label = integrity.tensor_file_label(info.name)
        try:
            st = os.lstat(file)
        except FileNotFoundError:
            return f"{file}: missing ({label}); restore it from a copy or reconvert"
        except OSError as e:
            return f"{file}: cannot be read ({e.strerror}; {label}); restore it from a copy or reconvert"
        if not stat.S_ISREG(st.st_mode) or not _inside(file, self.path):
            return (f"{file}: is not a regular file inside {self.path} ({label}: a symbolic link or other file was "
                    f"put in its place); restore it from a copy or reconvert")
        if info.checksum is not None:
            if st.st_size != info.checksum.size:
                return (f"{file}: {st.st_size} bytes, {label} was written with {info.checksum.size}; restore it from a "
                        f"copy or reconvert")
        elif not info.data_bytes + 8 < st.st_size <= info.data_bytes + 8 + MAX_HEADER:
            return (f"{file}: {st.st_size} bytes cannot hold {label}'s {len(info.tensors)} float32 tensor(s) of shape "
                    f"{list(info.shape)} ({info.data_bytes} bytes); restore it from a copy or reconvert")
        return None

    # -- reads -------------------------------------------------------------------------------------

    def _info(self, name: str) -> ParamInfo:
        info = self.parameters.get(name)
        if info is None:
            raise UniversalFormatError(f"{self.path}: no parameter {name!r} (it has {len(self.parameters)}, e.g. "
                                       f"{next(iter(self.parameters), None)!r}); names are canonical with global "
                                       f"layer indices")
        return info

    def _check_backed(self, info: ParamInfo) -> None:
        """Refuse (one line) a tensor file that cannot hold the declared tensors, before anything the size
        of a declared shape is allocated: its size (stat), then its safetensors header (read from checked
        blocks in version 2) against metadata.json; once per parameter."""
        if info.file is None or info.name in self._backed:
            return
        problem = self._backing_problem(info)
        if problem:
            raise UniversalFormatError(problem)
        file = self.path / info.file
        if info.checksum is not None:
            try:
                with VerifiedTensorFile(file, info.checksum, integrity.tensor_file_label(info.name),
                                                  cache=self._verified, headers=self._headers) as f:
                    header = {k: (t[0], tuple(t[1])) for k, t in f.tensors.items()}
            except ChecksumError as e:
                raise _as_format_error(e) from None
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise UniversalFormatError(f"{file}: unreadable safetensors header ({type(e).__name__}: {e}); "
                                           f"restore the file from a copy or reconvert") from None
        else:
            header = self._unverified_header(file)
        want = {key: ("F32", info.shape) for key in info.tensors}
        if header != want:
            got = ", ".join(f"{k} {d} {list(s)}" for k, (d, s) in sorted(header.items()))
            raise UniversalFormatError(f"{file}: holds {got}; metadata.json says {', '.join(sorted(want))} F32 "
                                       f"{list(info.shape)}; restore the file from a copy or reconvert")
        self._backed.add(info.name)

    @staticmethod
    def _unverified_header(file: Path) -> dict:
        """{key: (dtype, shape)} of a version-1 tensor file, by safetensors (which checks the header against
        the file's size)."""
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - any failure to parse is a damaged file
            raise UniversalFormatError(f"{file}: not a readable safetensors file ({type(e).__name__}: "
                                       f"{' '.join(str(e).split())}); restore it from a copy or reconvert") from None

    def _source_files(self) -> FileHandles:
        files = getattr(self._files, "handles", None)
        if files is None:
            files = self._files.handles = FileHandles()
        return files

    def read(self, name: str, key: str = "fp32", index: Optional[tuple[slice, ...]] = None, *,
             array: bool = False) -> "torch.Tensor":
        """One stored tensor of a parameter, or only the region `index` of it (just those bytes, and every
        checksum block they lie in, are read and checked). `index` is a tuple of step-1 slices, one per
        leading dimension. `array`: a numpy float32 array instead of a torch tensor (no torch imported)."""
        info, index = self._read_request(name, key, index)
        if info.placements is not None:
            values = self._read_lazy(info, key, index)
        elif info.checksum is not None:
            with self._verified_view(info, key, index) as view:
                values = view.copy()
                del view  # no view of the mapping may outlive the with-block
        else:
            values = self._read_unverified(info, key, index, array)
        self.bytes_read += values.nbytes
        if array:
            return values.view("float32")
        return values if self._is_tensor(values) else to_torch(values, "float32")

    @contextlib.contextmanager
    def read_view(self, name: str, key: str = "fp32", index: Optional[tuple[slice, ...]] = None):
        """read(..., array=True) for a caller that only reads the values once inside a with-block (a cast, a
        strided copy): a read-only float32 view of the checked mapping of the stored bytes, not copied first;
        valid inside the block only. Lazy and version-1 checkpoints yield read()'s array."""
        info, index = self._read_request(name, key, index)
        if info.placements is not None or info.checksum is None:
            yield self.read(name, key, index, array=True)
            return
        with self._verified_view(info, key, index) as view:
            self.bytes_read += view.nbytes
            values = view.view("float32")
            del view
            try:
                yield values
            finally:
                del values

    def _read_request(self, name: str, key: str, index) -> tuple:
        info = self._info(name)
        if key not in info.tensors:
            where = self.path / info.file if info.file else self.path
            raise UniversalFormatError(f"{where}: {name} has no {key!r} (it has {list(info.tensors)}); the source "
                                       f"checkpoint had no optimizer state")
        if index is not None:
            index = tuple(index)
            if len(index) > len(info.shape) or any(
                    not isinstance(s, slice) or s.step not in (None, 1) for s in index):
                raise UniversalFormatError(f"{name}: index {index} must be at most {len(info.shape)} step-1 slices")
        self._check_backed(info)
        return info, index

    @staticmethod
    def _is_tensor(values) -> bool:
        return type(values).__module__.startswith("torch")

    @contextlib.contextmanager
    def _verified_view(self, info: ParamInfo, key: str, index):  # raw float32 bits (numpy), a view
        file = self.path / info.file
        label = integrity.tensor_file_label(info.name)
        stack = contextlib.ExitStack()
        try:  # reading and checking; what the caller's block raises is not a read error and passes unchanged
            fd = self._source_files().fd(str(file))  # the thread's descriptor, kept open (not one per read)
            f = stack.enter_context(VerifiedTensorFile(file, info.checksum, label, cache=self._verified,
                                                       headers=self._headers, fd=fd))
            stored = f.tensors.get(key)
            if stored is None or stored[0] != "F32" or tuple(stored[1]) != info.shape:
                got = "absent" if stored is None else f"{stored[0]} {list(stored[1])}"
                raise UniversalFormatError(f"{file}: '{key}' is {got}, metadata.json says F32 {list(info.shape)}; "
                                           f"restore the file from a copy or reconvert")
            view = stack.enter_context(f.view_bits(key, index))
        except BaseException as e:
            stack.close()
            if isinstance(e, ChecksumError):
                raise _as_format_error(e) from None
            if isinstance(e, (OSError, ValueError, KeyError, TypeError)) and not isinstance(e, UniversalFormatError):
                raise UniversalFormatError(f"{file}: cannot read '{key}' of {info.name} ({type(e).__name__}: {e}); "
                                           f"the file is missing or damaged, restore it from a copy or reconvert"
                                           ) from None
            raise
        with stack:
            try:
                yield view
            finally:
                del view

    def _read_unverified(self, info: ParamInfo, key: str, index, array: bool):
        """Version 1 (no checksums): safetensors' own reader (numpy with `array`), after the header is checked
        against metadata."""
        from safetensors import safe_open

        file = self.path / info.file
        try:
            with safe_open(str(file), framework="numpy" if array else "pt", device="cpu") as f:
                region = f.get_slice(key)
                if tuple(region.get_shape()) != info.shape or region.get_dtype() != "F32":
                    raise UniversalFormatError(f"{file}: '{key}' has shape {tuple(region.get_shape())} "
                                               f"{region.get_dtype()}, metadata says F32 {info.shape}; reconvert")
                tensor = region[index] if index is not None else f.get_tensor(key)
        except UniversalFormatError:
            raise
        except Exception as e:  # missing, truncated or foreign file
            raise UniversalFormatError(f"{file}: cannot read '{key}' of {info.name} ({type(e).__name__}: "
                                       f"{' '.join(str(e).split())}); the file is missing or damaged, reconvert") from e
        return tensor

    def _read_lazy(self, info: ParamInfo, key: str, index):  # raw float32 bits (numpy)
        files = self._source_files()
        placement = info.placements[key]
        try:
            if self.source_digests is not None:
                integrity.verify_box_sources(files, placement, index, self.source_digests,
                                             label=f"{info.name} [{key}] in the source checkpoint", cache=self._verified)
            values = read_box_bits(files, placement, index)
        except ChecksumError as e:
            raise UniversalFormatError(f"{' '.join(str(e).split())} (read through the lazy checkpoint "
                                       f"{self.path})") from None
        except (OSError, StorageError) as e:
            raise UniversalFormatError(f"{self.path}: reading {info.name} [{key}] from the source checkpoint "
                                       f"{self.lazy_source} failed ({e}); restore the source or reconvert") from e
        if info.zeroed and info.zeroed.get(key):
            _zero_runs(values, info.zeroed[key], info.shape, index)
        return values

    def read_local(self, name: str, key: str, tp_rank: int, tp_size: int,
                   local_box: Optional[Sequence[slice]] = None) -> "torch.Tensor":
        """The region `local_box` (leading-dim slices; default all) of TP rank `tp_rank`'s shard of a
        parameter, reading only the pieces of the global tensor it needs (the stored pattern's
        local_reads), each checked against its checksums."""
        import torch

        info = self._info(name)
        self._check_backed(info)  # before the output is allocated
        reads = info.pattern.local_reads(info.shape, tp_rank, tp_size, local_box, name=name)
        if len(reads) == 1 and local_box is None:
            return self.read(name, key, reads[0][0])
        local = info.pattern.local_shape(info.shape, tp_size, name=name)
        box = [slice(*s.indices(n)[:2]) for s, n in zip(local_box or (), local)]
        out = torch.empty([s.stop - s.start for s in box] + list(local[len(box):]), dtype=torch.float32)
        for src, dst in reads:
            out[dst] = self.read(name, key, src)
        return out

    def read_for_rank(self, name: str, tp_rank: int, tp_size: int, key: str = "fp32") -> "torch.Tensor":
        """The TP rank's whole shard of a parameter, reading only its regions."""
        return self.read_local(name, key, tp_rank, tp_size)

    # -- byte copies (writers that copy stored bytes file to file) ----------------------------------

    def locate(self, name: str, key: str = "fp32") -> Optional[FileRegion]:
        """Where one stored tensor's C-order float32 bytes are in its tensor file (header parsed from checked
        blocks), for a writer that copies them file to file and then checks them with `verify_copied`; None
        where bytes cannot be copied with checksums (a lazy checkpoint's are scattered over the source
        checkpoint, version 1 has none): read() those."""
        info = self._info(name)
        if info.placements is not None or info.checksum is None:
            return None
        if key not in info.tensors:
            raise UniversalFormatError(f"{self.path / info.file}: {name} has no {key!r} (it has {list(info.tensors)})")
        self._check_backed(info)  # size and header against metadata.json
        file = self.path / info.file
        try:
            with VerifiedTensorFile(file, info.checksum, integrity.tensor_file_label(info.name),
                                              cache=self._verified, headers=self._headers) as f:
                _, _, start, stop = f.tensors[key]
        except ChecksumError as e:
            raise _as_format_error(e) from None
        return FileRegion(str(file), start, stop - start)

    def verify_copied(self, name: str, region: FileRegion, on_view: Optional[Callable] = None) -> None:
        """Check every block of `name`'s tensor file that holds `region` (bytes a writer just copied from
        locate()'s region, still in the page cache) against its checksums, mapping at most
        integrity.COPY_STEP bytes at a time; a damaged block raises UniversalFormatError naming it.
        `on_view`: called with each checked piece of the region, in order (a memoryview, valid in the call)."""
        info = self._info(name)
        fd = self._source_files().fd(region.path)
        label = integrity.tensor_file_label(info.name)
        try:
            for lo in range(region.offset, region.offset + region.nbytes, integrity.COPY_STEP):
                n = min(integrity.COPY_STEP, region.offset + region.nbytes - lo)
                with integrity.verified_view(fd, lo, n, info.checksum, path=region.path, label=label,
                                             cache=self._verified) as view:
                    if on_view is not None:
                        on_view(view)
        except ChecksumError as e:
            raise _as_format_error(e) from None
        self.bytes_read += region.nbytes
    # -- run state besides tensors (FORMAT.md "Loss scaler", "RNG states") -------------------------------

    @property
    def has_optimizer_state(self) -> bool:
        """Whether every parameter has its optimizer's state (persistent buffers, e.g. MoE's expert_bias, have none)."""
        from megatron_ucp.adapters.gpt import is_buffer

        stateful = [len(info.tensors) > 1 for name, info in self.parameters.items() if not is_buffer(name)]
        return bool(stateful) and all(stateful)

    @property
    def optimizer_state_keys(self) -> tuple[str, ...]:
        """The state names the parameters hold besides 'fp32' (() without any): every one under adam and sgd, those
        of its own row under an emerging optimizer (Lion, Muon: a parameter's `tensors`)."""
        return optimizers.run_states(self.optimizer_type, self.args) if self.has_optimizer_state else ()

    @property
    def num_floating_point_operations_so_far(self) -> float:
        """Megatron's FLOP counter at this iteration (0 when the source did not record it)."""
        value = self.metadata.get("num_floating_point_operations_so_far")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

    def rng_states(self) -> list:
        """The source's per-rank RNG states (run_state.RankRngState), read from RNG_FILENAME after checking it
        against the sha256 metadata.json records; [] when the checkpoint holds none."""
        if self.rng_section is None:
            return []
        path = self.path / RNG_FILENAME
        try:
            data = self._rng_bytes if self.direct else _read_small_file(path, self.path)
        except OSError as e:
            raise UniversalFormatError(f"{path}: cannot be read ({e.strerror or e}); restore it from a copy or "
                                       f"reconvert") from None
        if hashlib.sha256(data).hexdigest() != self.rng_section["sha256"]:
            raise UniversalFormatError(f"{path}: its sha256 differs from the one metadata.json records; the file "
                                       f"was edited or damaged, restore it from a copy or reconvert")
        from megatron_ucp.core.run_state import RunStateError, parse_rng_file

        try:
            return parse_rng_file(json.loads(data), str(path))
        except (ValueError, RunStateError) as e:
            raise UniversalFormatError(f"{path}: {e}; restore it from a copy or reconvert") from None

    def rng_layout_problem(self, layout: ParallelLayout, micro_batch_size: Optional[int]) -> Optional[str]:
        """Why the stored RNG states cannot be restored at `layout` (None when they can): they were drawn at
        the source layout and micro-batch size, and mean nothing elsewhere."""
        if self.rng_section is None:
            return "the universal checkpoint holds no RNG states"
        stored = ParallelLayout.from_dict(self.rng_section["layout"])
        if stored != layout:
            return f"the RNG states were saved at {stored.describe()}, this run is {layout.describe()}"
        mbs = self.rng_section.get("micro_batch_size")
        if mbs is not None and micro_batch_size is not None and mbs != micro_batch_size:
            return f"the RNG states were saved with --micro-batch-size {mbs}, this run uses {micro_batch_size}"
        return None

    def total_bytes(self) -> int:
        """Bytes of all stored tensors (fp32)."""
        return sum(info.data_bytes for info in self.parameters.values())


def _read_small_file(path: Path, root: Path) -> bytes:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or not _inside(path, root) or st.st_size > MAX_RNG_FILE:
        raise OSError(0, f"not a regular file of at most {MAX_RNG_FILE} bytes inside {root}")
    with open(path, "rb") as f:
        return f.read(MAX_RNG_FILE + 1)


def _run_state_metadata(metadata: Mapping[str, Any], meta_path: Path) -> tuple:
    """(loss scaler state or None, the `rng` section or None) of metadata.json, checked."""
    from megatron_ucp.core.run_state import LossScalerState, RunStateError

    try:
        scaler = LossScalerState.from_json(metadata.get("loss_scaler"), f"{meta_path} loss_scaler")
    except RunStateError as e:
        raise UniversalFormatError(f"{e}; the metadata was edited, reconvert") from None
    section = metadata.get("rng")
    if section is not None:
        try:
            if section["file"] != RNG_FILENAME or not isinstance(section["sha256"], str):
                raise ValueError(f"file {section['file']!r} is not {RNG_FILENAME!r} or no sha256")
            ParallelLayout.from_dict(section["layout"])
        except (KeyError, TypeError, ValueError) as e:
            raise UniversalFormatError(f"{meta_path}: malformed 'rng' section ({type(e).__name__}: {e}); "
                                       f"reconvert") from None
    return scaler, section

