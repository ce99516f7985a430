"""`check`: a universal checkpoint checked as a whole (every block of every tensor file against its digest,
every tensor file's header against metadata.json, a lazy checkpoint's source regions), at disk speed."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from megatron_ucp.io.integrity import (
    FILE_REMEDY, SOURCE_REMEDY, CheckReport, ChecksumError, DigestRecord, Failure, FileCheck, SourceDigests,
    check_files, pread_exact, remedy_clause, state_word, tensor_file_label, verified_pread)
from megatron_ucp.universal.format import PathLike
from megatron_ucp.universal.tensorfile import HeaderError, parse_header

# --------------------------------------------------------------------------------------------------
# A universal checkpoint, checked as a whole

UNIVERSAL_CHECKS = (
    "every parameter's tensor file exists and has the size recorded with its checksums",
    "every block of every tensor file matches its XXH3-128 digest (metadata.json version 2)",
    "each tensor file's safetensors header (read from checked blocks) lists exactly the parameter's tensors, "
    "each F32 with the parameter's shape, their data tiling the file after the header without gap or overlap",
    "lazy checkpoints: every source file exists with at least the checksummed size, every checksummed "
    "region's blocks match, and every byte region the index reads lies in a checksummed region",
    "every value of every tensor file (weight, exp_avg, exp_avg_sq) is finite: no NaN or Inf (searched in each "
    "block right after it is hashed)",
)


def _safetensors_problems(fd: int, path: str, entry: Mapping[str, Any], record: Optional[DigestRecord],
                          label: str, name: str, floats: list) -> Optional[str]:
    """Why the file's safetensors header disagrees with the metadata entry (None when it agrees); when it
    agrees, `floats` gets each tensor's ("PARAM state", start, stop) bytes, to search for NaN/Inf."""
    size = os.fstat(fd).st_size

    def read(offset: int, n: int):
        if record is not None and offset + n <= record.stop:
            return verified_pread(fd, offset, n, record, path=path, label=label)
        return pread_exact(fd, n, offset, path)

    try:
        header = parse_header(read, size)
    except HeaderError as e:
        return f"{path}: {e}; {FILE_REMEDY}"
    keys = sorted(header)
    want = sorted(entry.get("tensors", []))
    if keys != want:
        return f"{path}: holds tensors {keys}, metadata.json lists {want}; {FILE_REMEDY}"
    shape = tuple(int(s) for s in entry.get("shape", []))
    for key in keys:
        code, got, _, _ = header[key]
        if code != "F32" or got != shape:
            return f"{path}: '{key}' is {code} {list(got)}, metadata.json says F32 {list(shape)}; {FILE_REMEDY}"
    floats.extend((f"{name} {state_word(key)}", a, b) for key, (_, _, a, b) in header.items())
    return None


def check_universal(path: PathLike, metadata: Mapping[str, Any], workers: int = 4) -> CheckReport:
    """Check a universal checkpoint directory against its parsed metadata.json (see UNIVERSAL_CHECKS); a
    version-1 checkpoint (no checksums) gets sizes and headers checked and a note saying blocks were not."""
    start = time.perf_counter()
    root = Path(path)
    failures: list[Failure] = []
    notes: list[str] = []
    checks: list[FileCheck] = []
    params = metadata.get("parameters", {})
    unchecked = []
    lazy = metadata.get("lazy")
    for name, entry in params.items():
        label = tensor_file_label(name)
        if entry.get("file") is None:
            continue
        file = str(root / entry["file"])
        record = None
        if entry.get("checksum") is not None:
            try:
                record = DigestRecord.from_json(entry["checksum"], f"{root}/metadata.json: {name}")
            except ValueError as e:
                failures.append(Failure(file, "header", str(e)))
        else:
            unchecked.append(name)
        try:
            fd = os.open(file, os.O_RDONLY)
        except FileNotFoundError:
            failures.append(Failure(file, "missing", f"{file}: missing ({label}); {remedy_clause(FILE_REMEDY)}"))
            continue
        floats: list = []
        try:  # a file of the wrong size is reported once, by the size check below
            resized = record is not None and os.fstat(fd).st_size != record.stop
            problem = None if resized else _safetensors_problems(fd, file, entry, record, label, name, floats)
        except ChecksumError:
            problem = None  # the block check below reports it with the others
        except OSError as e:
            problem = f"{file}: cannot read ({e.strerror}); {FILE_REMEDY}"
        finally:
            os.close(fd)
        if problem:
            failures.append(Failure(file, "header", problem))
        if record is not None:
            checks.append(FileCheck(file, record, label, floats=tuple(floats)))
    if unchecked:
        notes.append(f"{len(unchecked)} tensor file(s) have no checksums (written by a megatron-ucp without them, "
                     f"metadata version {metadata.get('version')}): their blocks were not checked, only sizes and "
                     f"headers")
    if lazy is not None:
        failures.extend(_lazy_failures(lazy, params, checks, notes))
    report = check_files(checks, workers)
    # one list in the order of metadata.json's parameters (then source files), each file's blocks in order
    order = {str(root / e["file"]): i for i, e in enumerate(params.values()) if e.get("file")}
    found = sorted(tuple(failures) + report.failures,
                   key=lambda f: (order.get(f.path, len(order)), f.block if f.block is not None else -1))
    return CheckReport(files=len(checks), blocks=report.blocks, bytes=report.bytes,
                       seconds=time.perf_counter() - start, failures=tuple(found),
                       checks=UNIVERSAL_CHECKS, notes=tuple(notes))


def _lazy_failures(lazy: Mapping[str, Any], params: Mapping[str, Any], checks: list[FileCheck],
                   notes: list[str]) -> list[Failure]:
    source = Path(lazy.get("source", ""))
    failures = []
    records: dict[str, list[DigestRecord]] = {}
    for rel, info in (lazy.get("files") or {}).items():
        for d in (info or {}).get("checksums") or []:
            try:
                records.setdefault(str(source / rel), []).append(DigestRecord.from_json(d, f"lazy {rel}"))
            except ValueError as e:
                failures.append(Failure(str(source / rel), "header", str(e)))
    if not records:
        notes.append("lazy checkpoint without source checksums: source regions were not checked")
        return failures
    for path, recs in records.items():
        checks.extend(FileCheck(path, r, f"a region of the source checkpoint ({r.offset}..{r.stop - 1})",
                                exact_size=False, remedy=SOURCE_REMEDY) for r in recs)
    digests = SourceDigests(records)
    for name, entry in params.items():
        for key, placement in (entry.get("source_bytes") or {}).items():
            for shard in placement.get("shards", []):
                for rel, offset, nbytes in shard.get("regions", []):
                    try:
                        digests.pieces(str(source / rel), int(offset), int(offset) + int(nbytes))
                    except ChecksumError as e:
                        failures.append(Failure(str(source / rel), "coverage", f"{name} [{key}]: {e}"))
    return failures

