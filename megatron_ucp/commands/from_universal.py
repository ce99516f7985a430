"""Universal checkpoint -> Megatron checkpoint at any layout (the `from-universal` command).

    megatron-ucp from-universal UCP DST -t T -p P -d D [-c C] [--num-layers-per-virtual-pipeline-stage V]
        [--decoder-first-pipeline-num-layers F] [--decoder-last-pipeline-num-layers L]
        [--account-for-embedding-in-pipeline-split] [--account-for-loss-in-pipeline-split]
        [--expert-model-parallel-size E] [--expert-tensor-parallel-size ET]
        [--use-distributed-optimizer [--optimizer-format {dp_reshardable,fully_reshardable,fully_sharded_model_space}]]
        [--sequence-parallel] --ckpt-format {torch,torch_dist} [--megatron-core-version X.Y] [--workers K]
        [--via-megatron-lm] [--dry-run] [--overwrite] [--clean-stale]

The target layout is validated against the model before anything is written. The vocabulary keeps its
stored padded size when Megatron-LM would compute the same one at TP=T (it recomputes
padded_vocab_size from its args and never reads it from a checkpoint); otherwise it is re-padded
(padding rows only) with a warning.

Output goes through `staging.Staging` (kind "megatron"): DST's lock is taken before the universal
checkpoint is opened, files are written into `DST.partial-<host>-<pid>-<random>`, fsynced, marked
complete with `megatron-ucp.json` and renamed to DST, so DST is either absent, the previous output, or
complete; an existing DST is replaced only with --overwrite and only when this tool wrote it. The
universal checkpoint is only read, every block checked against its checksums. The format's writer
(formats/<format>/writer.py, one declared interface) plans and writes the files; this module only checks what every
format shares. Under torchrun, with a writer that splits its files over processes (the direct
torch_dist writer), rank 0 owns DST (lock, staging directory), every process writes its share into the
shared staging directory, and rank 0 finishes and publishes once all are done.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union

from tqdm import tqdm

from megatron_ucp.adapters.gpt import (
    expected_parameters, experts_in_own_optimizer, experts_per_ep_rank, is_buffer, megatron_padded_vocab,
    virtual_chunks)
from megatron_ucp.commands.common import add_publication_flags, add_target_layout_arguments
from megatron_ucp.core.layout import LayoutError, ParallelLayout
from megatron_ucp.core.patterns import PatternError
from megatron_ucp.core.placement import PlacementError, resolve_vpp, split_options
from megatron_ucp.core import optimizers, versions
from megatron_ucp.core.versions import NEWEST as _NEWEST
from megatron_ucp.core.versions import SUPPORTED as SUPPORTED_RELEASES
from megatron_ucp.formats.common import TRACKER_FILENAME
from megatron_ucp.formats.megatron_state import RNG_STATE_KINDS
from megatron_ucp.formats.torch_dist.megatron_lm_writer import DEFAULT_TIMEOUT_S
from megatron_ucp.formats.torch_dist.writer import OPTIMIZER_FORMATS
from megatron_ucp.formats.writer_base import target_args
from megatron_ucp.formats.writers import CKPT_FORMATS, WriteError, WriteTarget, make_writer
from megatron_ucp.io.sharded_job import in_torchrun, reports, run_sharded_job
from megatron_ucp.io.staging import TOOL_MARKER_FILENAME, Staging, StagingError
from megatron_ucp.io.staging import check_destination as check_staging_destination
from megatron_ucp.io.staging import join_staging, tool_marker
from megatron_ucp.universal import UniversalCheckpoint, UniversalFormatError

NEWEST_RELEASE = _NEWEST.name

PathLike = Union[str, os.PathLike]


class FromUniversalError(ValueError):
    """The universal checkpoint cannot be written as asked; the message names the cause and the fix."""


@dataclass(frozen=True)
class TargetPlan:
    """Everything decided before writing: the target and every file."""

    target: WriteTarget
    ckpt_format: str
    warnings: tuple[str, ...]
    files: tuple[tuple[str, int], ...]  # (path relative to DST, tensor bytes); torch_dist via Megatron-LM: estimate
    details: tuple[str, ...] = ()  # the writer's own description (shown by --dry-run)
    release_reason: str = ""  # why the write is for target.release (versions.write_choice)

    @property
    def layout(self) -> ParallelLayout:
        return self.target.layout

    @property
    def use_distributed_optimizer(self) -> bool:
        return self.target.use_distributed_optimizer

    @property
    def padded_vocab_size(self) -> int:
        return self.target.padded_vocab_size


def target_layout(ucp: UniversalCheckpoint, tp: int, pp: int, dp: int, vpp_layers: Optional[int],
                  sequence_parallel: bool, *, first_stage_layers: Optional[int] = None,
                  last_stage_layers: Optional[int] = None, embedding_in_split: bool = False,
                  loss_in_split: bool = False, virtual_stages: Optional[int] = None, ep: int = 1,
                  etp: Optional[int] = None, cp: int = 1) -> ParallelLayout:
    """The layout Megatron-LM would run with these flags (VPP from layers per virtual stage, or from
    --num-virtual-stages-per-pipeline-rank; uneven splits from Megatron-LM's split flags; EP and ETP only
    for a model with experts)."""
    if (ep > 1 or etp not in (None, tp)) and not ucp.config.num_experts:
        raise FromUniversalError(f"{ucp.path}: --expert-model-parallel-size / --expert-tensor-parallel-size need a model "
                                 f"with experts (this one has num_experts=None); drop them")
    split = dict(first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                 embedding_in_split=embedding_in_split, loss_in_split=loss_in_split)
    try:
        experts_per_ep_rank(ucp.config, ep)  # first: the cause when EP does not divide the experts
        if any(split.values()) or first_stage_layers == 0 or last_stage_layers == 0 or virtual_stages:
            vpp = resolve_vpp(ucp.config.num_layers, pp, layers_per_virtual_stage=vpp_layers,
                              virtual_stages=virtual_stages, **split)
        else:
            vpp = virtual_chunks(ucp.config.num_layers, pp, vpp_layers)
        return ParallelLayout(tp=tp, pp=pp, dp=dp, vpp=vpp, sp=sequence_parallel, ep=ep, etp=etp, cp=cp, **split)
    except (LayoutError, PlacementError) as e:
        raise FromUniversalError(f"{ucp.path}: {e}") from e


def choose_release(ucp: UniversalCheckpoint, megatron_core_version: Optional[str], via_megatron_lm: bool = False
                   ) -> tuple[versions.MegatronRelease, str]:
    """The megatron-core release the write is for, and why (said to the user): --via-megatron-lm saves with the
    installed Megatron-LM; else versions.write_choice (the one named, the source's, or the installed one)."""
    if via_megatron_lm:
        return _NEWEST, "--via-megatron-lm: the installed Megatron-LM saves it"
    try:
        return versions.write_choice(ucp.metadata.get("source"), megatron_core_version)
    except ValueError as e:
        raise FromUniversalError(f"--megatron-core-version: {e}") from None


def plan_target(ucp: UniversalCheckpoint, layout: ParallelLayout, *, vpp_layers: Optional[int], ckpt_format: str,
                use_distributed_optimizer: bool, rng_state: str = "cuda", writer=None,
                megatron_core_version: Optional[str] = None, via_megatron_lm: bool = False,
                allow_non_finite: bool = False) -> TargetPlan:
    """Validate the target against the model and decide every file; no I/O besides reading metadata."""
    if ckpt_format not in CKPT_FORMATS:
        raise FromUniversalError(f"--ckpt-format {ckpt_format!r}: choose one of {', '.join(CKPT_FORMATS)}")
    config = ucp.config
    where = f"{ucp.path}: cannot write {layout.describe()}"
    warnings = []
    padded = megatron_padded_vocab(config, layout.tp)  # what Megatron-LM will compute from the args
    if padded != config.padded_vocab_size:
        warnings.append(f"padded vocabulary changes from {config.padded_vocab_size} to {padded} rows (Megatron-LM "
                        f"computes ceil({config.vocab_size}/({config.make_vocab_size_divisible_by}*{layout.tp}))*"
                        f"{config.make_vocab_size_divisible_by * layout.tp} at TP={layout.tp}); padding rows "
                        f"enter the softmax, so the loss shifts slightly after this conversion")
    target_config = replace(config, padded_vocab_size=padded)
    try:
        expected_parameters(target_config, layout)
    except (LayoutError, PatternError) as e:
        raise FromUniversalError(f"{where}: {e}") from e
    if config.num_attention_heads % layout.tp:
        raise FromUniversalError(f"{where}: num_attention_heads={config.num_attention_heads} is not divisible by "
                                 f"TP={layout.tp}; choose a TP that divides it")
    args = ucp.args
    seq_length = args.get("seq_length")
    problem = layout.sequence_problem(seq_length if type(seq_length) is int and seq_length > 0 else None)
    if problem:
        raise FromUniversalError(f"{where}: {problem}")
    mbs, gbs = args.get("micro_batch_size"), args.get("global_batch_size")
    if mbs and gbs and gbs % (mbs * layout.dp):
        raise FromUniversalError(
            f"{where}: global batch {gbs} is not divisible by micro-batch {mbs} x DP={layout.dp}; choose a DP "
            f"dividing {gbs // mbs} (the global batch must stay {gbs} to continue the same run)")
    if layout.vpp and mbs and gbs and (gbs // (mbs * layout.dp)) % layout.pp:
        raise FromUniversalError(f"{where}: the interleaved schedule needs the number of micro-batches "
                                 f"({gbs // (mbs * layout.dp)}) divisible by PP={layout.pp}; change DP or drop VPP")
    emerging = ucp.has_optimizer_state and len(optimizers.run_optimizers(ucp.optimizer_type, ucp.args)) > 1
    if emerging and experts_in_own_optimizer(target_config, layout):
        raise FromUniversalError(f"{where}: --optimizer {ucp.optimizer_type} "
                                 f"{optimizers.EMERGING_WITH_EXPERTS_WRITE_REFUSAL}")
    layer_wise = use_distributed_optimizer and optimizers.runs_layer_wise(ucp.args.get("optimizer"))
    if layer_wise and ucp.has_optimizer_state:  # megatron-core 0.19's layer-wise distributed optimizer
        why = optimizers.layer_wise_refusal(ucp.optimizer_type, ucp.args) or (
            optimizers.LAYER_WISE_LEGACY_REFUSAL if ckpt_format == "torch" else None)
        if why:
            raise FromUniversalError(f"{where}: {why}")
    elif use_distributed_optimizer and ucp.has_optimizer_state and ucp.optimizer_type != "adam":
        raise FromUniversalError(
            f"{where}: holds {ucp.optimizer_type} optimizer state, which megatron-core 0.19 keeps without the "
            f"distributed optimizer only (its DistributedOptimizer takes Adam or an optimizer with an init_state_fn); "
            f"drop --use-distributed-optimizer")
    if use_distributed_optimizer:
        steps = {info.step for name, info in ucp.parameters.items()  # the emerging optimizer's own keep none
                 if not is_buffer(name) and not (layer_wise and info.step is None)}
        if len(steps) > 1:
            raise FromUniversalError(
                f"{where}: parameters have different Adam steps {sorted(s for s in steps if s is not None)}, but "
                f"the distributed optimizer keeps one per rank; drop --use-distributed-optimizer")
    if rng_state == "source":
        why = ucp.rng_layout_problem(layout, mbs)
        if why:
            raise FromUniversalError(f"{where}: --rng-state source: {why}; the stored RNG states mean nothing "
                                     f"elsewhere, use --rng-state cuda or cpu (fresh deterministic states)")
    if ckpt_format == "torch_dist" and ucp.has_optimizer_state and ucp.optimizer_type == "sgd":
        warnings.append(f"megatron-core 0.19's own --load cannot resume a torch_dist checkpoint of {ucp.optimizer_type} "
                        f"(FP32Optimizer / Float16Optimizer.sharded_state_dict call its init_state_fn, None for "
                        f"{ucp.optimizer_type}: "
                        f"a TypeError, its own saves included); resume this one with --universal-checkpoint, or "
                        f"write --ckpt-format torch for Megatron-LM's own --load (docs/VERSIONS.md)")
    if not ucp.has_optimizer_state:
        warnings.append("the universal checkpoint holds no optimizer state: only model weights are written; resume "
                        "with --no-load-optim (or --finetune)")
    release, why = choose_release(ucp, megatron_core_version, via_megatron_lm)
    target = WriteTarget(layout, vpp_layers if layout.vpp else None, use_distributed_optimizer, padded,
                         target_args(ucp.metadata, layout, use_distributed_optimizer=use_distributed_optimizer,
                                     padded_vocab_size=padded, ckpt_format=ckpt_format, vpp_layers=vpp_layers),
                         rng_state, release=release,
                         source_release=versions.source_release(ucp.metadata.get("source"), ucp.args),
                         allow_non_finite=allow_non_finite)
    writer = writer or make_writer(ckpt_format)
    notes: list[str] = []
    try:
        files = writer.plan(ucp, target, notes)
    except WriteError as e:
        raise FromUniversalError(f"{where}: {e}") from e
    return TargetPlan(target, ckpt_format, tuple(warnings + notes), tuple((f.path, f.nbytes) for f in files),
                      tuple(writer.describe(ucp, target)), why)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --------------------------------------------------------------------------------------------------
# Destination handling


def check_destination(dst: Path, ucp_path: Path, overwrite: bool) -> None:
    """DST must lie outside the universal checkpoint (and it outside DST), and be absent or, with
    overwrite, a Megatron checkpoint this tool wrote (checked again under the lock)."""
    dst_r, src_r = dst.resolve(), ucp_path.resolve()
    if dst_r == src_r or src_r in dst_r.parents or dst_r in src_r.parents:
        raise FromUniversalError(f"{dst}: overlaps the universal checkpoint {ucp_path}; write outside it "
                                 f"(the input is never modified)")
    try:
        check_staging_destination(dst, "megatron", overwrite)
    except StagingError as e:
        raise FromUniversalError(str(e)) from None


# --------------------------------------------------------------------------------------------------
# Entry point


@dataclass(frozen=True)
class FromUniversalSummary:
    path: Path
    plan: TargetPlan
    iteration: int
    bytes_written: int
    seconds: float
    dry_run: bool

    def to_dict(self) -> dict:
        return {"path": str(self.path), "ckpt_format": self.plan.ckpt_format, "layout": self.plan.layout.to_dict(),
                "megatron_core": self.plan.target.release.name, "megatron_core_reason": self.plan.release_reason,
                "use_distributed_optimizer": self.plan.use_distributed_optimizer, "iteration": self.iteration,
                "padded_vocab_size": self.plan.padded_vocab_size, "warnings": list(self.plan.warnings),
                "details": list(self.plan.details),
                "files": [{"path": p, "bytes": b} for p, b in self.plan.files],
                "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3), "dry_run": self.dry_run}


HALF_WRITTEN = "half-written"  # the staging phase once half the files are written (crash tests)


def _check_counts(options: dict) -> None:
    """Every count option given is >= 1 (None: not given), before anything is opened or created."""
    for flag, value in options.items():
        if value is not None and value < 1:
            raise FromUniversalError(f"{flag} {value}: must be >= 1; pass a positive number")


def from_universal(ucp_path: PathLike, dst: PathLike, *, tensor_model_parallel_size: int = 1,
                   pipeline_model_parallel_size: int = 1, data_parallel_size: int = 1,
                   context_parallel_size: int = 1, num_layers_per_virtual_pipeline_stage: Optional[int] = None,
                   expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None,
                   use_distributed_optimizer: bool = False, sequence_parallel: bool = False,
                   ckpt_format: str = "torch_dist", dry_run: bool = False, overwrite: bool = False,
                   rng_state: str = "cuda", timeout_s: int = DEFAULT_TIMEOUT_S,
                   progress: bool = True, warn=None, clean_stale: bool = False,
                   optimizer_format: Optional[str] = None, workers: Optional[int] = None, via_megatron_lm: bool = False,
                   pipeline_split: Optional[dict] = None,
                   megatron_core_version: Optional[str] = None, allow_non_finite: bool = False) -> FromUniversalSummary:
    """Write the universal checkpoint at `ucp_path` as a Megatron checkpoint root `dst` at the given layout.

    Validation (layout, vocabulary, batch, destination) happens before any file is created; on any error
    nothing is left at `dst` (nor its staging directory). DST's lock is held from before the universal
    checkpoint is opened until the output is published; leftovers of killed writes to DST are reported
    (`warn`) and removed with `clean_stale`. `optimizer_format` and `workers` go to the writers that take
    them (torch_dist); `via_megatron_lm` chooses the writer that runs Megatron-LM's training loop. `pipeline_split`: an
    uneven target split, target_layout's keywords (first_stage_layers, last_stage_layers, embedding_in_split,
    loss_in_split, virtual_stages). `megatron_core_version`: the release to write for (default: the source's, or
    the installed one without a Megatron source); an optimizer format that release cannot load is refused
    before anything is opened when the release is known from the flags alone, else before any file is
    written. `allow_non_finite`: write tensors holding NaN/Inf (otherwise refused, nothing left at `dst`).
    Under torchrun (more than one process) call it on every process: they split the files (writers that can)."""
    start = time.perf_counter()
    ucp_path, dst = Path(ucp_path), Path(dst).absolute()
    if rng_state not in RNG_STATE_KINDS:
        raise FromUniversalError(f"rng_state={rng_state!r}: choose one of {', '.join(RNG_STATE_KINDS)}")
    _check_counts({"--tensor-model-parallel-size": tensor_model_parallel_size,
                   "--pipeline-model-parallel-size": pipeline_model_parallel_size,
                   "--data-parallel-size": data_parallel_size, "--context-parallel-size": context_parallel_size,
                   "--num-layers-per-virtual-pipeline-stage": num_layers_per_virtual_pipeline_stage,
                   "--expert-model-parallel-size": expert_model_parallel_size,
                   "--expert-tensor-parallel-size": expert_tensor_parallel_size, "--workers": workers,
                   "--timeout": timeout_s if via_megatron_lm else None})
    _refuse_unloadable(optimizer_format, megatron_core_version, use_distributed_optimizer)
    check_destination(dst, ucp_path, overwrite)  # fails fast; checked again under the lock
    distributed = in_torchrun() and not dry_run
    emit = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
    if distributed and not reports():
        emit = lambda message: None  # noqa: E731 - rank 0 reports
    writer = _make_writer(ckpt_format, via_megatron_lm, timeout_s=timeout_s, optimizer_format=optimizer_format,
                          workers=workers, megatron_core_version=megatron_core_version)
    if distributed and not writer.splits_over_processes:
        raise FromUniversalError(f"--ckpt-format {ckpt_format}{' --via-megatron-lm' if via_megatron_lm else ''} writes "
                                 f"from one process: launch it without torchrun (the direct torch_dist writer "
                                 f"splits its files over torchrun processes)")

    def plan_for(ucp: UniversalCheckpoint) -> TargetPlan:
        layout = target_layout(ucp, tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size,
                               num_layers_per_virtual_pipeline_stage, sequence_parallel, **(pipeline_split or {}),
                               ep=expert_model_parallel_size, etp=expert_tensor_parallel_size,
                               cp=context_parallel_size)
        plan = plan_target(ucp, layout, vpp_layers=num_layers_per_virtual_pipeline_stage, ckpt_format=ckpt_format,
                           use_distributed_optimizer=use_distributed_optimizer, rng_state=rng_state, writer=writer,
                           megatron_core_version=megatron_core_version, via_megatron_lm=via_megatron_lm,
                           allow_non_finite=allow_non_finite)
        for message in plan.warnings:
            emit(message)
        return plan

    if dry_run:
        ucp = UniversalCheckpoint.open(ucp_path)
        plan = plan_for(ucp)
        return FromUniversalSummary(dst, plan, ucp.iteration, 0, time.perf_counter() - start, True)

    def marker(ucp: UniversalCheckpoint, plan: TargetPlan) -> bytes:
        return tool_marker("megatron", ckpt_format=ckpt_format, iteration=ucp.iteration, layout=plan.layout.to_dict(),
                           use_distributed_optimizer=plan.use_distributed_optimizer, source=str(ucp_path.resolve()))

    if distributed:
        plan, iteration, written = _write_distributed(ucp_path, dst, writer, plan_for, marker, overwrite=overwrite,
                                                      clean_stale=clean_stale, emit=emit, progress=progress)
        return FromUniversalSummary(dst, plan, iteration, written, time.perf_counter() - start, False)

    written = 0
    try:
        with Staging(dst, kind="megatron", overwrite=overwrite, clean_stale=clean_stale, report=emit) as stage:
            ucp = UniversalCheckpoint.open(ucp_path)
            plan = plan_for(ucp)
            planned = sum(1 for p, _ in plan.files if p != TRACKER_FILENAME)
            bar = tqdm(total=planned, unit="file", desc="from-universal", disable=not progress, file=sys.stderr,
                       dynamic_ncols=True)
            done = 0

            def on_file(path: Path, size: int) -> None:
                nonlocal written, done
                written += size
                done += 1
                bar.update(1)
                if done == math.ceil(planned / 2):
                    stage.phase(HALF_WRITTEN)

            try:
                with warnings.catch_warnings():  # megatron-core's import-time notice, meaningless offline
                    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
                    writer.write(ucp, plan.target, stage.path, on_file=on_file)
            except (WriteError, UniversalFormatError) as e:  # e.g. a damaged block of the universal checkpoint
                raise FromUniversalError(str(e)) from e
            finally:
                bar.close()
            stage.publish(TOOL_MARKER_FILENAME, marker(ucp, plan))
    except StagingError as e:
        raise FromUniversalError(str(e)) from e
    return FromUniversalSummary(dst, plan, ucp.iteration, written, time.perf_counter() - start, False)


def _refuse_unloadable(optimizer_format: Optional[str], megatron_core_version: Optional[str],
                       use_distributed_optimizer: bool) -> None:
    """An --optimizer-format the release named by --megatron-core-version cannot load, refused before anything
    is opened (versions.load_refusal: one line naming the releases that load it). A release that depends on the
    universal checkpoint's source is checked by the writer's plan, before any file is written (--via-megatron-lm
    refuses what the installed Megatron-LM cannot save when it is made)."""
    if not (optimizer_format and use_distributed_optimizer and megatron_core_version):
        return
    try:
        release = versions.release(megatron_core_version)
    except ValueError as e:
        raise FromUniversalError(f"--megatron-core-version: {e}") from None
    refusal = versions.load_refusal(release, optimizer_format)
    if refusal:
        raise FromUniversalError(refusal)


def _make_writer(ckpt_format: str, via_megatron_lm: bool, **options):
    """The format's writer with the options it takes; an option the user gave (not None) that it does not
    take is refused, naming the flag."""
    try:
        writer = make_writer(ckpt_format, via_megatron_lm=via_megatron_lm, **options)
    except WriteError as e:
        raise FromUniversalError(str(e)) from e
    for name, value in options.items():
        if value is not None and name not in writer.OPTIONS and name != "timeout_s":
            raise FromUniversalError(f"--{name.replace('_', '-')} does not apply to --ckpt-format {ckpt_format}"
                                     f"{' --via-megatron-lm' if via_megatron_lm else ''}; drop it")
    return writer


def _write_distributed(ucp_path: Path, dst: Path, writer, plan_for, marker, *, overwrite: bool, clean_stale: bool,
                       emit, progress: bool) -> tuple[TargetPlan, int, int]:
    """from-universal across the processes of a torchrun job (a shared filesystem), as io/sharded_job.py runs
    it: rank 0 takes DST's lock and creates the staging directory before anything is opened; every process
    opens the universal checkpoint, plans the same files and writes its share (each file fsynced); rank 0
    writes the rest (writer.finish_shares) and publishes. An error on any rank stops every rank and removes
    the staging directory. Returns (plan, iteration, bytes of the files the processes wrote as their shares)."""
    stage: list = []  # rank 0's Staging

    def take_destination() -> Path:
        stage.append(Staging(dst, kind="megatron", overwrite=overwrite, clean_stale=clean_stale, report=emit))
        return stage[0].__enter__().path

    def open_and_plan(root: Path):
        ucp = UniversalCheckpoint.open(ucp_path)
        return ucp, plan_for(ucp), root

    def write_share(opened, rank: int, world: int):
        ucp, plan, root = opened
        written = [0]
        with tqdm(total=sum(b for p, b in plan.files), unit="B", unit_scale=True, unit_divisor=1024,
                  desc="from-universal", disable=not progress or rank != 0, file=sys.stderr,
                  dynamic_ncols=True) as bar:
            def on_file(path: Path, size: int) -> None:
                written[0] += size
                bar.update(size * world)  # rank 0's share stands for every rank's

            return writer.write_share(ucp, plan.target, root, rank, world, on_file), written[0]

    def finish(opened, shares: list) -> int:
        ucp, plan, root = opened
        writer.finish_shares(ucp, plan.target, root, [share for share, _ in shares])
        stage[0].publish(TOOL_MARKER_FILENAME, marker(ucp, plan))
        return sum(n for _, n in shares)

    def describe(e: Exception) -> str:
        return str(e) if isinstance(e, (FromUniversalError, WriteError, StagingError, ValueError)) else \
            f"{type(e).__name__}: {e}"

    job = run_sharded_job(take_destination=take_destination, join=join_staging, open_and_plan=open_and_plan,
                          write_share=write_share, finish=finish, abort=lambda: stage[0].abort(),
                          error_type=FromUniversalError, describe=describe)
    ucp, plan, _ = job.plan
    return plan, ucp.iteration, job.result



# --------------------------------------------------------------------------------------------------
# CLI: `megatron-ucp from-universal`


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "from-universal", parents=[common],
        help="write a universal checkpoint as a Megatron checkpoint at any layout",
        description="Write a universal checkpoint as a Megatron-LM checkpoint (torch_dist or legacy torch) at "
                    "the given TP x PP x DP (x VPP, x EP x ETP with experts) layout, with the full optimizer state.")
    p.add_argument("ucp", help="universal checkpoint directory")
    p.add_argument("dst", help="Megatron checkpoint root to create (must not exist unless --overwrite)")
    add_target_layout_arguments(p, tp_required=False)
    p.add_argument("--ckpt-format", choices=CKPT_FORMATS, required=True,
                   help="torch_dist: megatron-core's distributed checkpoint; torch: legacy model_optim_rng.pt "
                        "(+ distrib_optim.pt); both written offline, without training processes")
    p.add_argument("--optimizer-format", choices=OPTIMIZER_FORMATS, default=None,
                   help="torch_dist with --use-distributed-optimizer: dp_reshardable (default from 0.15, as "
                        "megatron-core: flat buckets for this TP x PP, cheapest to load, any DP), fully_reshardable "
                        "(model space: megatron-core loads it at any TP x PP x DP, so one write serves every layout) "
                        "or fully_sharded_model_space (megatron-core 0.13/0.14's default, the one they load)")
    p.add_argument("--megatron-core-version", default=None, metavar="X.Y",
                   help=f"write what that megatron-core release's own save writes ({', '.join(SUPPORTED_RELEASES)}; "
                        f"default: the release that wrote the universal checkpoint's source, {NEWEST_RELEASE} for "
                        f"one without a Megatron source). 0.19 keeps the common state inside the .distcp files "
                        f"(0.19 still reads the older common.pt form; 0.16-0.18 read only that)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="write tensors holding NaN or Inf as they are (default: refused, naming the parameter and "
                        "state; `megatron-ucp check UCP` lists them all)")
    p.add_argument("--workers", type=int, default=None,
                   help="threads writing the output files (default: min(4, CPUs); legacy torch: one rank's "
                        "files per thread); torch_dist under torchrun: the processes also split the files (a "
                        "shared filesystem)")
    p.add_argument("--via-megatron-lm", "--via-harness", dest="via_megatron_lm", action="store_true",
                   help="torch_dist: let Megatron-LM itself save, by launching its training loop with "
                        "T*P*D CPU processes (memory: the whole model and optimizer state); the direct "
                        "writer's reference")
    p.add_argument("--rng-state", choices=RNG_STATE_KINDS, default="cuda",
                   help="write a fresh deterministic RNG state for CUDA (default; Megatron-LM on GPUs) or CPU "
                        "generators (Megatron-LM on CPU), or none (then resume with --no-load-rng), or source: the "
                        "source run's own states (only at the source layout: dropout continues exactly)")
    p.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT_S,
                   help="--via-megatron-lm: seconds the Megatron-LM run may take")
    p.add_argument("--dry-run", action="store_true", help="print the files that would be written; write nothing")
    add_publication_flags(p, "Megatron checkpoint", "megatron-ucp.json")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    summary = from_universal(
        args.ucp, args.dst, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, data_parallel_size=args.data_parallel_size,
        context_parallel_size=args.context_parallel_size,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        use_distributed_optimizer=args.use_distributed_optimizer, sequence_parallel=args.sequence_parallel,
        ckpt_format=args.ckpt_format, dry_run=args.dry_run, overwrite=args.overwrite, rng_state=args.rng_state,
        timeout_s=args.timeout, progress=not args.quiet, clean_stale=args.clean_stale,
        optimizer_format=args.optimizer_format, workers=args.workers, via_megatron_lm=args.via_megatron_lm,
        pipeline_split=split_options(args), megatron_core_version=args.megatron_core_version,
        allow_non_finite=args.allow_non_finite)
    result = summary.to_dict()
    if not summary.dry_run and not reports():
        return result  # rank 0 reports
    plan = summary.plan
    what = f"{plan.ckpt_format} at {plan.layout.describe()}" + (" with the distributed optimizer"
                                                                if plan.use_distributed_optimizer else "")
    what += "".join(f", {line}" for line in plan.details if line.startswith("optimizer state"))
    what += f", for megatron-core {plan.target.release.name} ({plan.release_reason})"
    if summary.dry_run:
        lines = [f"dry run: would write {summary.path} ({what}, iteration {summary.iteration}):"]
        lines += [f"  {p}  {b / 2 ** 20:.2f} MiB" for p, b in plan.files]
        lines += [f"  {line}" for line in plan.details]
        result["message"] = "\n".join(lines)
    else:
        result["message"] = (f"wrote {summary.path}: {what}, iteration {summary.iteration}, "
                             f"{summary.bytes_written / 2 ** 20:.1f} MiB, {summary.seconds:.1f} s")
    return result
