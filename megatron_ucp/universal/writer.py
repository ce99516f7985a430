"""Writing a universal checkpoint: `UniversalWriter` (locked, staged, marker last), metadata.json's document
and the RNG file (`universal_document`, which a direct resume's in-memory index shares), the lazy index's
source section. Tensor files come from `tensorfile`."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from megatron_ucp.io import integrity
from megatron_ucp.io.staging import Staging, StagingError
from megatron_ucp.universal.format import (
    COMPLETE_FILENAME, FORMAT_NAME, FORMAT_VERSION, METADATA_FILENAME, REQUIRED_METADATA, RNG_FILENAME,
    TENSORS_DIRNAME,
    PathLike, SavedRngStates, UniversalFormatError, document_version, sha256_file, write_json)
from megatron_ucp.universal.tensorfile import write_tensor_file

if TYPE_CHECKING:
    import torch



def _referenced_regions(entries: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, int, int]]:
    return [(region[0], int(region[1]), int(region[2])) for e in entries.values()
            for p in (e.get("source_bytes") or {}).values() for shard in p["shards"] for region in shard["regions"]]


def source_file_stats(root: PathLike, entries: Mapping[str, Mapping[str, Any]]) -> dict:
    """{relative path: {"size", "mtime_ns"}} of every source file lazy entries refer to."""
    out = {}
    for rel in sorted({r[0] for r in _referenced_regions(entries)}):
        st = os.stat(Path(root) / rel)
        out[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def lazy_section(root: PathLike, entries: Mapping[str, Mapping[str, Any]], *, workers: int = 4,
                 checksums: bool = True) -> dict:
    """metadata.json's `lazy` section for lazy entries into the source iteration folder `root`: each
    referenced file's size, mtime and the block checksums of the regions the index reads (one read of
    those bytes, `workers` threads). Refuses a source that changes while it is hashed. Without `checksums`
    (a direct resume's in-memory index, which is never written: docs/TRAINING.md), size and mtime only,
    nothing read."""
    root = Path(root).resolve()
    before = source_file_stats(root, entries)
    if not checksums:
        return {"source": str(root), "files": before}
    regions = [(str(root / rel), offset, nbytes) for rel, offset, nbytes in _referenced_regions(entries)]
    digests = integrity.digest_regions(regions, workers=workers)
    after = source_file_stats(root, entries)
    if after != before:
        changed = sorted(rel for rel in before if before[rel] != after.get(rel))
        raise UniversalFormatError(f"{root / changed[0]}: changed while the lazy index was made (is training "
                                   f"still writing it?); convert again once it is finished")
    files = {}
    for rel, stats in before.items():
        files[rel] = {**stats, "checksums": [r.to_json() for r in digests.get(str(root / rel), [])]}
    return {"source": str(root), "files": files}


class UniversalWriter:
    """Builds a universal checkpoint in a locked staging directory (staging.Staging, kind "universal") and
    publishes it as DST only after every tensor file, metadata.json and the COMPLETE marker are written
    and fsynced, so DST is either absent, the previous output, or complete.

    The constructor takes DST's lock (a second writer fails at once, naming the first), reports (or with
    clean_stale removes) leftovers of killed writes, refuses an existing DST unless `overwrite` and it is
    a universal checkpoint, and creates the staging directory `staging_dir`. Enter it before opening the
    source, so the lock covers the whole job. Use as a context manager (an exception inside removes the
    staging directory and releases the lock) or call abort(). write_parameter is for one process; other
    threads or processes call write_tensor_file(writer.staging_dir, ...) and the owner records the returned
    entries with record_parameter.
    """

    def __init__(self, dst: PathLike, overwrite: bool = False, *, clean_stale: bool = False,
                 report: Optional[Callable[[str], None]] = None, on_phase: Optional[Callable[[str], None]] = None,
                 command: Optional[str] = None):
        self.dst = Path(dst).absolute()
        self.overwrite = overwrite
        self._stage = Staging(self.dst, kind="universal", overwrite=overwrite, clean_stale=clean_stale,
                              report=report, on_phase=on_phase, command=command)
        try:
            self._stage.__enter__()
        except StagingError as e:
            raise UniversalFormatError(str(e)) from e
        self.staging_dir = self._stage.path
        self.parameters: dict[str, dict] = {}
        self._done = False
        try:
            (self.staging_dir / TENSORS_DIRNAME).mkdir()
        except BaseException:
            self.abort()
            raise

    @property
    def leftovers(self):
        """Leftovers of earlier, killed writes to DST found when the lock was taken (staging.Leftover)."""
        return self._stage.leftovers

    def __enter__(self) -> "UniversalWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._stage.__exit__(exc_type, exc, tb)
        except StagingError as e:  # a failure the stage explains better (no space left, ...)
            raise UniversalFormatError(str(e)) from e

    def abort(self) -> None:
        """Remove the staging directory and release the lock (DST itself is never touched before finish)."""
        self._done = True
        self._stage.abort()

    def phase(self, name: str) -> None:
        """Report a point of the write to on_phase (progress; tests kill the writer at these points)."""
        self._stage.phase(name)

    def record_parameter(self, name: str, entry: dict) -> None:
        if name in self.parameters:
            self.abort()
            raise UniversalFormatError(f"{name}: written twice; each canonical parameter appears once")
        self.parameters[name] = entry

    def write_parameter(self, name: str, tensors: Mapping[str, "torch.Tensor"], info: Mapping[str, Any]) -> dict:
        """Write one parameter (see write_tensor_file) and record its metadata entry."""
        try:
            entry = write_tensor_file(self.staging_dir, name, tensors, info)
            self.record_parameter(name, entry)
        except BaseException:
            self.abort()
            raise
        return entry

    def finish(self, metadata: Mapping[str, Any], expected: Sequence[tuple[str, Sequence[int]]],
               rng: Optional["SavedRngStates"] = None) -> Path:
        """Write metadata.json (format, version and the recorded parameters added), then publish: fsync
        every file, write COMPLETE last, rename into place. `metadata` holds the other top-level keys of
        docs/FORMAT.md; `expected` lists every parameter of the model with its global shape, in
        registration order (the model's rulebook gives it), so an incomplete conversion is never marked
        complete. `rng`: the source's per-rank RNG states, written to RNG_FILENAME (metadata key `rng`)."""
        if self._done:
            raise UniversalFormatError(f"{self.dst}: writer already finished or aborted")
        try:
            doc, rng_bytes = universal_document(self.dst, metadata, self.parameters, expected, rng)
            self.parameters = doc["parameters"]
            if rng_bytes is not None:
                (self.staging_dir / RNG_FILENAME).write_bytes(rng_bytes)  # publication fsyncs the tree
            meta_path = self.staging_dir / METADATA_FILENAME
            try:
                write_json(meta_path, doc)
            except ValueError as e:  # NaN/inf or a non-JSON value slipped in
                raise UniversalFormatError(f"{self.dst}: metadata is not plain JSON ({e})") from e
            if metadata.get("lazy") is not None:
                (self.staging_dir / TENSORS_DIRNAME).rmdir()
            complete = {"format": FORMAT_NAME, "version": doc["version"], "metadata_sha256": sha256_file(meta_path)}
            self._stage.publish(COMPLETE_FILENAME, complete)
        except BaseException as e:
            self._done = True
            if not self._stage.published:
                self._stage.abort()
            if isinstance(e, StagingError):
                raise UniversalFormatError(str(e)) from e
            raise
        self._done = True
        return self.dst


def universal_document(where: PathLike, metadata: Mapping[str, Any], parameters: Mapping[str, dict],
                       expected: Sequence[tuple[str, Sequence[int]]], rng: Optional[SavedRngStates] = None
                       ) -> tuple[dict, Optional[bytes]]:
    """metadata.json's document (format, version, `metadata`'s other top-level keys, the RNG section, the
    parameters in registration order) and the RNG file's bytes (None without RNG states), after checking that
    `parameters` are exactly the model's (`expected`: every parameter with its global shape, from its rulebook),
    so an incomplete checkpoint or index is never made. `where` names it in errors. The writer publishes both;
    a direct resume (convert.runner.source_index) keeps them in memory."""
    missing = [k for k in REQUIRED_METADATA if k not in metadata]
    if missing:
        raise UniversalFormatError(f"{where}: metadata lacks {missing}")
    doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
    # `rng` describes the RNG file made here, never one a copied metadata names
    doc.update({k: v for k, v in metadata.items() if k not in ("format", "version", "parameters", "rng")})
    rng_bytes = None
    if rng is not None and rng.states:
        rng_bytes, doc["rng"] = _rng_file(rng)
    doc["parameters"] = _in_model_order(where, parameters, expected)
    doc["version"] = document_version(doc)
    return doc, rng_bytes


def _in_model_order(where: PathLike, parameters: Mapping[str, dict],
                    expected: Sequence[tuple[str, Sequence[int]]]) -> dict:
    expected = {name: tuple(shape) for name, shape in expected}
    missing = [n for n in expected if n not in parameters]
    extra = sorted(set(parameters) - set(expected))
    if missing or extra:
        raise UniversalFormatError(
            f"{where}: parameters do not match the model config: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}; a universal checkpoint holds "
            f"every parameter of the model exactly once")
    for name, shape in expected.items():
        if tuple(parameters[name]["shape"]) != shape:
            raise UniversalFormatError(f"{name}: shape {tuple(parameters[name]['shape'])} but the model "
                                       f"config gives {shape}")
    # metadata.json lists parameters in registration order, whatever order workers finished in
    return {name: parameters[name] for name in expected}


def _rng_file(rng: SavedRngStates) -> tuple[bytes, dict]:
    """RNG_FILENAME's bytes and metadata.json's `rng` section describing them."""
    from megatron_ucp.core.run_state import rng_file

    data = (json.dumps(rng_file(list(rng.states), rng.layout.to_dict(), rng.micro_batch_size),
                       separators=(",", ":"), allow_nan=False) + "\n").encode()
    return data, {"file": RNG_FILENAME, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                  "layout": rng.layout.to_dict(), "micro_batch_size": rng.micro_batch_size, "ranks": len(rng.states)}
