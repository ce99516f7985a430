"""Running a conversion: threads over parameters in one process, or the processes of a torchrun job
(e.g. one per node on a shared filesystem), writing through the universal checkpoint writer; and a direct
resume's index (`source_index`: `to-universal --lazy`'s index, kept in memory, without checksums).

The writer (DST's lock and staging directory) is entered before the source is opened, so one job owns
DST from its first check to its publication; under torchrun rank 0 owns it and the other ranks join its
staging directory."""

from __future__ import annotations

import concurrent.futures
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from tqdm import tqdm

from megatron_ucp.adapters.gpt import expected_parameters
from megatron_ucp.convert.consolidate import convert_parameter, source_keys
from megatron_ucp.convert.metadata import build_metadata, saved_rng_states
from megatron_ucp.convert.tasks import ConversionError, ParamTask, conversion_tasks
from megatron_ucp.formats import CheckpointReader, open_checkpoint
from megatron_ucp.io.sharded_job import run_sharded_job
from megatron_ucp.io.staging import fsync_path, join_staging
from megatron_ucp.universal import UniversalFormatError, UniversalWriter, lazy_section, universal_document

PathLike = Union[str, os.PathLike]


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class ConversionSummary:
    path: Path
    source: str
    source_format: str
    iteration: int
    num_parameters: int
    bytes_written: int
    seconds: float
    workers: int
    lazy: bool = False
    notices: tuple[str, ...] = ()  # what the source's release saved wrongly and what the conversion did

    def to_dict(self) -> dict:
        return {"path": str(self.path), "source": self.source, "source_format": self.source_format,
                "iteration": self.iteration, "num_parameters": self.num_parameters,
                "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3), "workers": self.workers,
                "lazy": self.lazy, "notices": list(self.notices)}


def _check_not_nested(src: Path, iter_dir: Path, dst: Path) -> None:
    dst = dst.resolve()
    for source in {src.resolve(), iter_dir.resolve()}:
        if dst == source or source in dst.parents or dst in source.parents:
            raise ConversionError(f"{dst}: the destination overlaps the source checkpoint {source}; write the "
                                  f"universal checkpoint outside it (the input is never modified)")


HALF_WRITTEN = "half-written"  # the writer's phase once half the parameters are written (crash tests)


def convert(src: PathLike, dst: PathLike, iteration: Optional[int] = None, workers: Optional[int] = None,
            average_replicas: bool = False, progress: bool = True, overwrite: bool = False,
            lazy: bool = False, clean_stale: bool = False, report=None,
            allow_non_finite: bool = False, reset_lost_optimizer_state: bool = False,
            weights_only: bool = False) -> ConversionSummary:
    """to_universal with a summary of what was written (see to_universal)."""
    start = time.perf_counter()
    if workers is not None and int(workers) < 1:
        raise ConversionError(f"workers={workers}: use at least 1")
    if lazy and average_replicas:
        raise ConversionError("--lazy references the source's bytes, --average-replicas computes new values; "
                              "use one of them")
    _check_not_nested(Path(src), Path(src), Path(dst))  # before the lock and staging names appear next to DST
    with UniversalWriter(dst, overwrite=overwrite, clean_stale=clean_stale, report=report) as writer:
        ckpt = open_checkpoint(src, iteration, reset_lost_optimizer_state=reset_lost_optimizer_state,
                               weights_only=weights_only)
        _check_not_nested(Path(src), Path(ckpt.path), Path(dst))
        tasks = conversion_tasks(ckpt)
        metadata = build_metadata(ckpt, average_replicas=average_replicas)
        if ckpt.skipped_optimizer:  # --weights-only: the source's optimizer state, left out
            metadata["conversion"]["optimizer_left_out"] = ckpt.skipped_optimizer
        total = sum(t.nbytes * len(source_keys(ckpt, t)) for t in tasks)
        if lazy:
            metadata["conversion"]["lazy"] = True
        if not ckpt.thread_safe_reads:
            workers = 1  # a reader whose reads share state is used from one thread
        workers = max(1, min(int(workers or default_workers()), len(tasks)))
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="to-universal",
                   disable=not progress, file=sys.stderr, dynamic_ncols=True)
        written = 0
        half = (len(tasks) + 1) // 2

        def record(name: str, entry: dict) -> None:
            nonlocal written
            writer.record_parameter(name, entry)
            size = math.prod(entry["shape"]) * 4 * len(entry["tensors"])
            written += 0 if lazy else size
            bar.update(size)
            bar.set_postfix_str(f"{len(writer.parameters)}/{len(tasks)} params", refresh=False)
            if len(writer.parameters) == half:
                writer.phase(HALF_WRITTEN)

        try:
            _convert_all(ckpt, tasks, writer.staging_dir, workers, average_replicas, record, lazy,
                         check_finite=not allow_non_finite)
        finally:
            bar.close()
        if lazy:  # the index records the checksums of every source byte it reads
            metadata["lazy"] = lazy_section(ckpt.path, writer.parameters, workers=max(2, workers))
        path = writer.finish(metadata, expected_parameters(ckpt.config), rng=saved_rng_states(ckpt))
    return ConversionSummary(path=path, source=str(Path(ckpt.path).resolve()), source_format=ckpt.format,
                             iteration=ckpt.iteration, num_parameters=len(tasks), bytes_written=written,
                             seconds=time.perf_counter() - start, workers=workers, lazy=lazy,
                             notices=tuple(ckpt.notices()))


def convert_distributed(src: PathLike, dst: PathLike, iteration: Optional[int] = None,
                        average_replicas: bool = False, progress: bool = True,
                        overwrite: bool = False, clean_stale: bool = False,
                        allow_non_finite: bool = False, reset_lost_optimizer_state: bool = False,
            weights_only: bool = False) -> ConversionSummary:
    """to_universal across the processes of a torchrun job (e.g. one per node on a shared filesystem), as
    io/sharded_job.py runs it.

    Rank 0 owns the destination: before anything is opened it takes DST's lock and creates the staging
    directory, which the other ranks join; once every rank is done (and has fsynced its files), it
    records the parameters and publishes metadata.json and COMPLETE. Every rank opens the source,
    plans the same parameter list and converts its share (largest parameters dealt round-robin, so
    shares are balanced), writing tensor files straight into the shared staging directory. An error on
    any rank stops every rank and removes the staging directory.
    """
    start = time.perf_counter()
    writer: list = []  # rank 0's UniversalWriter
    _check_not_nested(Path(src), Path(src), Path(dst))

    def take_destination() -> Path:
        writer.append(UniversalWriter(dst, overwrite=overwrite, clean_stale=clean_stale))
        return writer[0].staging_dir

    def open_and_plan(staging_dir: Path):
        ckpt = open_checkpoint(src, iteration, reset_lost_optimizer_state=reset_lost_optimizer_state,
                               weights_only=weights_only)
        _check_not_nested(Path(src), Path(ckpt.path), Path(dst))
        return ckpt, conversion_tasks(ckpt), staging_dir

    def write_share(plan, rank: int, world: int) -> list:
        ckpt, tasks, staging_dir = plan
        mine = sorted(tasks, key=lambda t: t.nbytes, reverse=True)[rank::world]
        entries = []
        with tqdm(total=sum(t.nbytes for t in mine), unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"to-universal rank {rank}", disable=not progress or rank != 0, file=sys.stderr,
                  dynamic_ncols=True) as bar:
            for task in mine:
                entries.append((task.name, convert_parameter(ckpt, task, staging_dir,
                                                             average_replicas=average_replicas,
                                                             check_finite=not allow_non_finite)))
                bar.update(task.nbytes)
        for _, entry in entries:  # durable before rank 0 publishes (its fsync may not reach other hosts' caches)
            fsync_path(staging_dir / entry["file"])
        return entries

    def finish(plan, shares: list) -> str:
        ckpt = plan[0]
        for rank_entries in shares:
            for name, entry in rank_entries:
                writer[0].record_parameter(name, entry)
        return str(writer[0].finish(build_metadata(ckpt, average_replicas=average_replicas),
                                    expected_parameters(ckpt.config), rng=saved_rng_states(ckpt)))

    def describe(e: Exception) -> str:
        return str(e) if isinstance(e, (ConversionError, ValueError, UniversalFormatError)) else \
            f"{type(e).__name__}: {e}"

    job = run_sharded_job(take_destination=take_destination, join=join_staging, open_and_plan=open_and_plan,
                          write_share=write_share, finish=finish, abort=lambda: writer[0].abort(),
                          error_type=ConversionError, describe=describe)
    ckpt, tasks, _ = job.plan
    written = sum(math.prod(e["shape"]) * 4 * len(e["tensors"]) for _, e in job.share)
    return ConversionSummary(path=Path(job.result), source=str(Path(ckpt.path).resolve()), source_format=ckpt.format,
                             iteration=ckpt.iteration, num_parameters=len(tasks), bytes_written=written,
                             seconds=time.perf_counter() - start, workers=job.world, notices=tuple(ckpt.notices()))


@dataclass(frozen=True)
class SourceIndex:
    """A direct resume's index of a Megatron-LM checkpoint (`--load CKPT --universal-checkpoint`): the lazy
    universal checkpoint `to-universal --lazy` would write (metadata.json's `document`, the RNG file's
    bytes), made in memory and never written anywhere, without source checksums (making them reads every
    byte: the second pass a resume avoids). UniversalCheckpoint.from_source_index reads it."""

    document: dict
    rng: Optional[bytes]
    seconds: float
    workers: int
    notices: tuple[str, ...] = ()  # CheckpointReader.notices (also in document['source']['notices'])

    @property
    def source(self) -> dict:
        return self.document["source"]


def source_index(src: PathLike, iteration: Optional[int] = None, workers: Optional[int] = None, *,
                 reset_lost_optimizer_state: bool = False, weights_only: bool = False) -> SourceIndex:
    """Index the Megatron-LM checkpoint at `src` (a root or an iteration folder) as to_universal(lazy=True)
    does, with the same checks before any tensor is read (every parameter present once on every TP rank with
    its local shape, the optimizer's byte layout as each reader knows it, file sizes against what the
    checkpoint's own metadata records) and the same byte comparisons (TP replicas and a tied output-layer
    copy equal), but no checksums and no output: nothing is written, the source is only read."""
    start = time.perf_counter()
    ckpt = open_checkpoint(src, iteration, reset_lost_optimizer_state=reset_lost_optimizer_state,
                               weights_only=weights_only)
    tasks = conversion_tasks(ckpt)
    metadata = build_metadata(ckpt, average_replicas=False)
    metadata["conversion"] = {"tool": "megatron-ucp --universal-checkpoint (direct resume)", "lazy": True,
                              "average_replicas": False}
    if ckpt.skipped_optimizer:
        metadata["conversion"]["optimizer_left_out"] = ckpt.skipped_optimizer
    workers = 1 if not ckpt.thread_safe_reads else max(1, min(int(workers or default_workers()), len(tasks)))
    entries: dict = {}
    _convert_all(ckpt, tasks, None, workers, False, entries.__setitem__, lazy=True)
    metadata["lazy"] = lazy_section(ckpt.path, entries, checksums=False)
    document, rng = universal_document(ckpt.path, metadata, entries, expected_parameters(ckpt.config),
                                       rng=saved_rng_states(ckpt))
    return SourceIndex(document, rng, time.perf_counter() - start, workers, tuple(ckpt.notices()))


def _convert_all(ckpt: CheckpointReader, tasks: list[ParamTask], staging_dir: Optional[Path], workers: int,
                 average_replicas: bool, record, lazy: bool, *, check_finite: bool = False) -> None:
    """convert_parameter for every task (in `workers` threads), each entry handed to `record(name, entry)`."""
    if workers == 1:
        for task in tasks:
            record(task.name, convert_parameter(ckpt, task, staging_dir, average_replicas=average_replicas,
                                                lazy=lazy, check_finite=check_finite))
    else:
        _convert_in_threads(ckpt, tasks, staging_dir, workers, average_replicas, record, lazy,
                            check_finite=check_finite)


def _convert_in_threads(ckpt: CheckpointReader, tasks: list[ParamTask], staging_dir: Path, workers: int,
                        average_replicas: bool, record, lazy: bool = False, *, check_finite: bool = False) -> None:
    """Threads sharing the opened checkpoint, for readers whose reads are independent (thread_safe_reads):
    no worker start-up (a spawned worker re-imports torch and re-opens the checkpoint, seconds), and the
    bulk of the work (file reads, tensor copies, safetensors writes) runs without the GIL. Largest
    parameters first, so the last ones to finish are small; at most 2 tasks per thread in flight keeps
    memory bounded by a few parameters."""
    pending = iter(sorted(tasks, key=lambda t: t.nbytes, reverse=True))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="to-universal") as pool:
        running: dict = {}  # future -> parameter name
        try:
            while True:
                for task in pending:
                    running[pool.submit(convert_parameter, ckpt, task, staging_dir, average_replicas=average_replicas,
                                        lazy=lazy, check_finite=check_finite)] = task.name
                    if len(running) >= 2 * workers:
                        break
                if not running:
                    break
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    record(running.pop(future), future.result())
        finally:
            for future in running:
                future.cancel()


def to_universal(src: PathLike, dst: PathLike, iteration: Optional[int] = None, workers: Optional[int] = None,
                 average_replicas: bool = False, progress: bool = True, overwrite: bool = False,
                 lazy: bool = False, clean_stale: bool = False, allow_non_finite: bool = False,
                 reset_lost_optimizer_state: bool = False, weights_only: bool = False) -> Path:
    """Convert the Megatron-LM checkpoint at `src` (a checkpoint root or one iter_XXXXXXX folder, legacy
    `torch` or `torch_dist`) into a universal checkpoint at `dst` and return `dst`.

    Replicated parameters must agree bitwise across TP ranks, and a tied output_layer copy must equal the
    embedding (weights and moments), unless `average_replicas`, which stores their mean. On any error
    nothing is left at `dst` (nor its staging directory) and the source is untouched. An existing `dst`
    is replaced only with `overwrite`, and only when it is a universal checkpoint; leftovers of killed
    conversions into `dst` are reported, and removed with `clean_stale`.

    lazy: write only metadata.json, whose entries say where each consolidated tensor's bytes are in the
    source checkpoint (checked as above; no copy: the referenced bytes are read once, for their checksums).
    Readers then read from the source, which must stay where it is, unchanged (size and mtime checked on
    open, checksums of every byte on every read).

    NaN/Inf in a tensor written refuse the conversion (found while its bytes are hashed, no extra pass),
    unless `allow_non_finite`; a lazy index copies no tensor and does not search (`check` does).

    A source whose release saved the optimizer state wrongly in a way the bytes undo (megatron-core 0.15-0.19's
    multi-bucket fully_reshardable) is repaired, said in source.notices; where elements were saved nowhere the
    conversion is refused, unless `reset_lost_optimizer_state` (just those restart: Adam moments at zero).

    weights_only: the source's optimizer state is not read (the weights as the model holds them, the schedule, the
    RNG state): the way to another layout for an optimizer whose state megatron-ucp does not map (Lion, Muon).
    """
    return convert(src, dst, iteration=iteration, workers=workers, average_replicas=average_replicas,
                   progress=progress, overwrite=overwrite, lazy=lazy, clean_stale=clean_stale,
                   allow_non_finite=allow_non_finite, reset_lost_optimizer_state=reset_lost_optimizer_state,
                   weights_only=weights_only).path
