"""The interface every Megatron checkpoint reader implements (declared, never probed).

A reader opens one iteration folder and yields one `ShardRef` per parameter per model-parallel rank
(names and shapes exactly as that rank's model holds them). With experts (MoE) a routed expert's shard
is named by its expert-parallel rank and its expert-TP rank (`ShardRef.ep_rank`, `tp_rank`); every
other parameter, replicated over the EP ranks like over DP, is listed once, at ep_rank 0. On request it returns a shard's tensors
(`read`) or says where their bytes are in its files (`locate`, for the byte-copy converter), plus the
state shared by all ranks (`common_state`). Readers register in `megatron_ucp.formats` (READERS);
the converter never branches on the format. Besides tensors a reader gives the run state a resume needs:
the fp16 loss scaler (`loss_scaler`) and every rank's RNG state (`rng_states`), in megatron_ucp.core.run_state's
forms.

Opening a checkpoint, listing its shards and its common state import no torch and run no code from its
files (they are parsed through serialization/safe_pickle.py's allow-list); read() and locate() import torch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Collection, Optional

from megatron_ucp.core.optimizers import STATE_ORDER
from megatron_ucp.core.versions import MegatronRelease
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig

if TYPE_CHECKING:
    from megatron_ucp.core.run_state import LossScalerState, RankRngState

# Tensors a reader can return for a shard, besides a per-parameter 'step' (Adam's): the model weight ('param'), the
# fp32 main weight ('fp32'; the weight itself when the optimizer steps it directly) and the optimizer's per-parameter
# states by their torch names (core/optimizers.py: Adam's exp_avg, exp_avg_sq; SGD's momentum_buffer).
READ_KEYS = ("param", "fp32") + STATE_ORDER
OPTIMIZER_KINDS = ("distributed", "adam", "mixed_precision", "none")


@dataclass(frozen=True)
class ShardRef:
    """One model-parallel shard of one parameter, as stored.

    `tp_rank` is the tensor-parallel rank of the parameter's own split: the expert-TP rank for a routed
    expert's parameter (rulebook `tp_size_of`), the TP rank otherwise. `ep_rank` is the expert-parallel
    rank holding a routed expert (its local index in `local_name` is local to that rank); 0 for every
    other parameter (listed once: its copies on other EP ranks are replicas, like DP replicas)."""

    tp_rank: int
    pp_rank: int
    vpp_chunk: int  # 0 without virtual pipeline parallelism
    local_name: str  # as in that rank's model state dict (stage-local layer index)
    shape: tuple[int, ...]  # local (per-TP-rank) shape
    # the model parameter's dtype: a safe_pickle.TorchDType (no torch needed to list shards; str() is
    # 'torch.float32'), equal to the torch dtype of the same name
    dtype: Any
    ep_rank: int = 0


def unknown_shard(ref: ShardRef, path: Path) -> LookupError:
    """A ShardRef the reader does not hold (not one of its shards())."""
    ep = f" ep={ref.ep_rank}" if ref.ep_rank else ""
    return LookupError(f"{path}: holds no shard {ref.local_name} on tp={ref.tp_rank} pp={ref.pp_rank}{ep} "
                       f"chunk={ref.vpp_chunk}; pass one of the reader's shards()")


class CheckpointReader(abc.ABC):
    """One iteration of a Megatron checkpoint, opened for reading (see the module docstring)."""

    format: ClassVar[str]  # 'torch' | 'torch_dist'
    # Whether read()/locate() may be called from several threads at once on one reader.
    thread_safe_reads: ClassVar[bool] = False

    path: Path  # the iter_XXXXXXX folder
    iteration: int
    args: dict  # Megatron-LM's args as plain values
    release: MegatronRelease  # the megatron-core release that wrote it (core/versions.py: detected from args)
    layout: ParallelLayout
    config: GPTModelConfig
    optimizer_kind: str  # one of OPTIMIZER_KINDS
    # set by open_checkpoint: optimizer state the checkpoint's writer saved nowhere is reset (Adam moments to zero,
    # an fp32 main weight to the model weight) instead of refused (read_problem)
    reset_lost_optimizer_state: bool = False
    # set at construction (open_checkpoint(weights_only=True)): the optimizer's state is not read, not even looked
    # at, so the weights, the schedule and the RNG state of a checkpoint whose optimizer megatron-ucp does not map
    # (core/optimizers.py: Lion, Muon, layer-wise) can move to another layout; optimizer_kind is then "none"
    weights_only: bool = False
    # the optimizer whose state a weights_only reader left unread (args.optimizer), None otherwise
    skipped_optimizer: Optional[str] = None

    @property
    def optimizer_name(self) -> Optional[str]:
        """Which optimizer's state the checkpoint holds: Megatron-LM's --optimizer as its args record it (the rows of
        core/optimizers.py; readers refuse the others at open), None without optimizer state."""
        if self.optimizer_kind == "none":
            return None
        return self.args.get("optimizer", "adam")

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The per-parameter optimizer states read() may give besides 'fp32' (the optimizer's torch names, every
        row the run gives a parameter: Lion's and Muon's with their scalar optimizer's; () without optimizer
        state). A parameter has those of its own row (`parameter_row`)."""
        from megatron_ucp.core import optimizers

        return optimizers.run_states(self.optimizer_name, self.args)

    def parameter_row(self, local: str, shape) -> "optimizers.OptimizerStates":
        """The core/optimizers.py row of the optimizer that steps one parameter (local name, local shape) in
        this checkpoint's run: its --optimizer's, or under an emerging one (Lion, Muon) the rulebook's split."""
        from megatron_ucp.adapters import gpt
        from megatron_ucp.core import optimizers

        return optimizers.OPTIMIZERS[gpt.parameter_optimizer(local, shape, self.args)]

    def notices(self) -> list[str]:
        """What the release that wrote this checkpoint saved wrongly and what reading does about it, one line
        each ([] when nothing: the usual case)."""
        return []

    def zeroed(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> dict:
        """{tensor: ((start, length), ...)}: runs (flat, C order of the local shape) of what locate() gives whose
        value is zero, not the located bytes (optimizer state reset by reset_lost_optimizer_state; read() gives
        the zeros); {} for none, the usual case."""
        return {}

    def read_problem(self) -> Optional[str]:
        """Why read()/locate() cannot give this checkpoint's true state, in one line naming the way out (e.g.
        elements the writer saved nowhere, without reset_lost_optimizer_state), or None."""
        return None

    @abc.abstractmethod
    def shards(self) -> list[ShardRef]:
        """Every parameter shard of every (tp, pp, vpp chunk), in registration order per chunk."""

    @abc.abstractmethod
    def read(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> dict:
        """The shard's tensors among READ_KEYS (default: all it has; only the bytes of those asked for
        are read, into new torch tensors) and, with Adam state, its 'step' (a 0-d float32 tensor)."""

    @abc.abstractmethod
    def locate(self, ref: ShardRef, keys: Optional[Collection[str]] = None) -> Optional[dict]:
        """Like read(), but each tensor is a byteio.StoredTensor (where its bytes are in the reader's
        files) and nothing but metadata is read ('step' is a number); None when some tensor is not one
        run of bytes per stored piece (read() it then)."""

    @abc.abstractmethod
    def common_state(self) -> dict:
        """Iteration, consumed samples, scheduler state, optimizer param groups (without parameter
        lists), checkpoint version: see formats.common.build_common_state."""

    # -- run state besides tensors (docs/FORMAT.md "Loss scaler", "RNG states") ----------------------

    @abc.abstractmethod
    def loss_scaler(self) -> Optional["LossScalerState"]:
        """The optimizer's dynamic loss-scaler state (fp16), None without one (fp32, bf16, a constant
        --loss-scale, or no optimizer state saved)."""

    @abc.abstractmethod
    def rng_states(self) -> list["RankRngState"]:
        """Every saved rank's RNG state (one per (pp, tp) rank, or per (pp, tp, dp) rank where DP ranks
        saved their own), [] when the checkpoint has none (--no-save-rng)."""
