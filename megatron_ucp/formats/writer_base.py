"""The interface every Megatron checkpoint writer implements (`from-universal`), and the target it writes.

`from_universal` validates what is common to every format (layout, batch, optimizer steps), builds a
`WriteTarget`, asks the writer for its `plan` (every file, before anything is written; format-specific
refusals are raised there with the cause and the fix), then has it `write` into a staging directory that
it moves into place. Writers register in `megatron_ucp.formats.writers` (WRITERS).
"""

from __future__ import annotations

import abc
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional

from megatron_ucp.core import optimizers, versions
from megatron_ucp.core.layout import ParallelLayout


def writer_threads(workers: Optional[int], error=None) -> int:
    """`--workers`: the threads a writer uses (default min(4, CPUs)); below 1 is refused (`error`: the
    writer's own WriteError class)."""
    if workers is not None and int(workers) < 1:
        raise (error or WriteError)(f"--workers {workers}: use at least 1")
    return int(workers) if workers else max(1, min(4, os.cpu_count() or 1))


class WriteError(ValueError):
    """The universal checkpoint cannot be written in this format at this layout (cause + fix)."""


@dataclass(frozen=True)
class WriteTarget:
    """What to write: the layout, the optimizer kind, the padded vocabulary and Megatron args at that layout."""

    layout: ParallelLayout
    vpp_layers: Optional[int]  # --num-layers-per-virtual-pipeline-stage (None without VPP)
    use_distributed_optimizer: bool
    padded_vocab_size: int
    args: Mapping[str, Any]  # Megatron-LM args (JSON values) with the target layout's values filled in
    # 'cuda' | 'cpu' | 'none': the fresh RNG state written for Megatron-LM to load; 'source': the stored ones
    rng_state: str = "cuda"
    # the megatron-core release whose save this is (versions.write_choice), and the one whose run the universal
    # checkpoint's args come from (None: no Megatron source); the pickled args are translated between them
    release: versions.MegatronRelease = versions.NEWEST
    source_release: Optional[versions.MegatronRelease] = None
    # write tensors holding NaN/Inf (--allow-non-finite); otherwise the writers refuse them
    allow_non_finite: bool = False


@dataclass(frozen=True)
class PlannedFile:
    """One file of the output: path relative to the checkpoint root, tensor bytes it will hold."""

    path: str
    nbytes: int
    tp_rank: int = -1
    pp_rank: int = -1


def target_args(metadata: Mapping[str, Any], layout: ParallelLayout, *, use_distributed_optimizer: bool,
                padded_vocab_size: int, ckpt_format: str, vpp_layers: Optional[int]) -> dict:
    """The universal checkpoint's Megatron args with the target layout's values (JSON values)."""
    args = dict(metadata.get("args") or {})
    layer_wise = optimizers.runs_layer_wise(args.get("optimizer"))
    args.update(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_per_virtual_pipeline_stage=vpp_layers if layout.vpp else None,
        data_parallel_size=layout.dp,
        # the target's expert layout (Megatron-LM's default ETP is the TP), never the source's
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        # the target's pipeline split, never the source's (an even target of an uneven source is even)
        decoder_first_pipeline_num_layers=layout.first_stage_layers,
        decoder_last_pipeline_num_layers=layout.last_stage_layers,
        account_for_embedding_in_pipeline_split=bool(layout.embedding_in_split),
        account_for_loss_in_pipeline_split=bool(layout.loss_in_split),
        num_virtual_stages_per_pipeline_rank=layout.vpp if layout.vpp and not vpp_layers else None,
        context_parallel_size=layout.cp,
        world_size=layout.world_size,
        sequence_parallel=bool(layout.sp),
        use_distributed_optimizer=bool(use_distributed_optimizer) and not layer_wise,
        # megatron-core 0.19 runs Lion / Muon with --use-distributed-optimizer as its layer-wise distributed optimizer
        use_layer_wise_distributed_optimizer=bool(use_distributed_optimizer) and layer_wise,
        padded_vocab_size=int(padded_vocab_size),
        ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format != "torch",
        consumed_train_samples=int(metadata.get("consumed_train_samples") or 0),
        consumed_valid_samples=int(metadata.get("consumed_valid_samples") or 0),
    )
    # megatron-core's hierarchical CP splits the CP group in sub-groups whose sizes multiply to CP: kept only where
    # they still split the target's CP (they decide communication only, never what a checkpoint holds)
    sizes = args.get("hierarchical_context_parallel_sizes")
    if sizes is not None and not (isinstance(sizes, list) and sizes and all(type(n) is int and n > 0 for n in sizes)
                                  and math.prod(sizes) == layout.cp):
        args["hierarchical_context_parallel_sizes"] = None
    return args


class CheckpointWriter(abc.ABC):
    """Writes a universal checkpoint as one Megatron checkpoint format (see the module docstring)."""

    ckpt_format: ClassVar[str]
    OPTIONS: ClassVar[tuple[str, ...]] = ()  # keyword options its constructor takes (make_writer passes them)

    @abc.abstractmethod
    def plan(self, ucp, target: WriteTarget, notes: list) -> list[PlannedFile]:
        """Every file the writer will produce (no I/O besides reading metadata); raise WriteError for what
        this format cannot hold, append substitutions the user should know about to `notes`."""

    def describe(self, ucp, target: WriteTarget) -> list[str]:
        """Extra lines a dry run shows (e.g. how the files will be produced); none by default."""
        return []

    @abc.abstractmethod
    def write(self, ucp, target: WriteTarget, root: Path, on_file: Optional[Callable[[Path, int], None]] = None
              ) -> None:
        """Write the checkpoint under `root` (a staging directory), the tracker file last."""

    # Writers whose files can be written by several processes of a torchrun job (a shared filesystem):
    # from_universal runs write_share on every process, then finish_shares on rank 0 (the staging owner).
    splits_over_processes: ClassVar[bool] = False

    def write_share(self, ucp, target: WriteTarget, root: Path, rank: int, world: int,
                    on_file: Optional[Callable[[Path, int], None]] = None) -> Any:
        """Write process `rank`'s share of the files (of `world` processes), each fsynced; return what
        finish_shares needs from it (picklable)."""
        raise NotImplementedError(f"{type(self).__name__} writes in one process")

    def finish_shares(self, ucp, target: WriteTarget, root: Path, shares: list) -> None:
        """On rank 0, once every process wrote its share (`shares`: their write_share results in rank
        order): the remaining files, the tracker file last."""
        raise NotImplementedError(f"{type(self).__name__} writes in one process")
