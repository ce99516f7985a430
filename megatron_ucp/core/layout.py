"""Parallel layouts (TP x PP x CP x DP, virtual pipeline, sequence parallelism, expert parallelism) as plain values.

megatron-core's rank order is tp-cp-ep-dp-pp: global rank = tp + TP * (cp + CP * (dp + DP * pp)). Context
parallelism (CP) splits every sequence over CP ranks that hold the same parameters: for checkpoints a CP rank is a
replica like a DP rank, and the distributed optimizer shards every buffer over the DP x CP group (megatron-core's
intra_dp_cp group, whose rank is cp + CP * dp: `dp_cp_rank`). Data-parallel quantities (the global batch's split,
args.data_parallel_size, per-DP RNG states) count DP alone. Expert parallelism is carved out of the same ranks:
the routed experts see ETP x EP x expert-DP x PP (rank order etp-ep-edp-pp), with
world = TP*PP*CP*DP = ETP*EP*EDP*PP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class LayoutError(ValueError):
    """A parallel layout that cannot hold the model (raised with the cause and the fix)."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: Optional[int] = None  # virtual pipeline chunks per stage; None = not interleaved
    sp: bool = False
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel size; None = the dense TP (Megatron-LM's default)
    cp: int = 1  # context parallel size (--context-parallel-size): each CP rank holds 2 of 2*CP sequence chunks
    # Uneven pipelines (Megatron-LM's --decoder-first/last-pipeline-num-layers,
    # --account-for-embedding/loss-in-pipeline-split); layers per chunk: adapters.gpt.chunk_layers
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    embedding_in_split: bool = False
    loss_in_split: bool = False

    def __post_init__(self):
        if self.etp is not None and self.etp == self.tp:
            object.__setattr__(self, "etp", None)  # one spelling of "ETP = TP"
        for name in ("tp", "pp", "dp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)} must be >= 1")
        if self.etp is not None and self.etp < 1:
            raise LayoutError(f"etp={self.etp} must be >= 1")
        if self.stage_ranks % (self.expert_tp * self.ep):
            raise LayoutError(
                f"TP x {'CP x ' if self.cp > 1 else ''}DP = {self.stage_ranks} ranks per pipeline stage cannot be "
                f"split into ETP x EP = {self.expert_tp} x {self.ep} expert groups; choose EP and ETP whose product "
                f"divides {self.stage_ranks}")
        if self.vpp is not None and self.vpp < 1:
            raise LayoutError(f"vpp={self.vpp} must be >= 1 or None")
        if self.sp and self.tp == 1:
            # Megatron-LM silently turns SP off at TP=1; keep that rule in one place.
            object.__setattr__(self, "sp", False)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def stage_ranks(self) -> int:
        """Ranks per pipeline stage: TP x CP x DP (= ETP x EP x EDP)."""
        return self.tp * self.cp * self.dp

    @property
    def dp_cp(self) -> int:
        """Size of the DP x CP group: the replicas of every dense parameter, over which the distributed optimizer
        shards each buffer (megatron-core's intra_dp_cp group)."""
        return self.dp * self.cp

    def dp_cp_rank(self, dp_rank: int, cp_rank: int = 0) -> int:
        """Rank in the DP x CP group of the rank with these DP and CP ranks (the inverse of data_coordinates)."""
        return cp_rank + self.cp * dp_rank

    def data_coordinates(self, dp_cp_rank: int) -> tuple[int, int]:
        """(DP rank, CP rank) of a rank in the DP x CP group."""
        return dp_cp_rank // self.cp, dp_cp_rank % self.cp

    @property
    def expert_tp(self) -> int:
        """Tensor-parallel size of the routed experts (--expert-tensor-parallel-size)."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the routed experts (their replicas)."""
        return self.stage_ranks // (self.expert_tp * self.ep)

    def dense_mp_rank(self, tp_rank: int, pp_rank: int) -> int:
        """Rank in the TP x PP model-parallel group (the dense optimizer's `dp_group_idx`)."""
        return tp_rank + self.tp * pp_rank

    def expert_mp_rank(self, etp_rank: int, ep_rank: int, pp_rank: int) -> int:
        """Rank in the ETP x EP x PP group (the expert optimizer's `dp_group_idx`; rank order tp-ep-dp-pp)."""
        return etp_rank + self.expert_tp * (ep_rank + self.ep * pp_rank)

    def global_rank(self, tp_rank: int, pp_rank: int, dp_cp_rank: int) -> int:
        """The global rank with these dense coordinates, `dp_cp_rank` its rank in the DP x CP group (megatron-core's
        order tp-cp-ep-dp-pp: tp + TP * (cp + CP * (dp + DP * pp)); at CP = 1 the DP rank)."""
        return tp_rank + self.tp * (dp_cp_rank + self.dp_cp * pp_rank)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(TP rank, DP x CP rank, PP rank) of a global rank (the inverse of global_rank; data_coordinates splits
        the middle one into DP and CP ranks)."""
        return rank % self.tp, rank // self.tp % self.dp_cp, rank // (self.tp * self.dp_cp)

    def expert_global_rank(self, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int) -> int:
        """The global rank with these expert coordinates (the inverse of expert_coordinates)."""
        return etp_rank + self.expert_tp * (ep_rank + self.ep * (edp_rank + self.expert_dp * pp_rank))

    def expert_coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(expert-TP rank, EP rank, expert-DP rank, PP rank) of a global rank (megatron-core's expert rank
        order etp-ep-edp-pp over the same ranks as the dense tp-cp-dp-pp)."""
        etp_rank, rest = rank % self.expert_tp, rank // self.expert_tp
        ep_rank, rest = rest % self.ep, rest // self.ep
        edp_rank, pp_rank = rest % self.expert_dp, rest // self.expert_dp
        return etp_rank, ep_rank, edp_rank, pp_rank

    def sequence_problem(self, seq_length: Optional[int]) -> Optional[str]:
        """Why a run of this layout cannot take sequences of `seq_length` tokens (None: it can, or unknown).
        Context parallelism splits every sequence into 2*CP equal chunks (rank r keeps chunks r and 2*CP-1-r)."""
        if self.cp > 1 and seq_length is not None and seq_length % (2 * self.cp):
            return (f"CP={self.cp} splits every sequence into 2*CP = {2 * self.cp} equal chunks, which "
                    f"--seq-length {seq_length} does not divide into; choose a CP whose 2*CP divides {seq_length}")
        return None

    @property
    def even_pipeline(self) -> bool:
        """Layers split evenly over the pipeline chunks (none of the uneven-split settings)."""
        return (self.first_stage_layers is None and self.last_stage_layers is None and not self.embedding_in_split
                and not self.loss_in_split)

    @property
    def num_chunks(self) -> int:
        """Model chunks per pipeline stage (1 without VPP)."""
        return self.vpp or 1

    def check_chunk(self, pp_rank: int, vpp_chunk: Optional[int] = None) -> int:
        """The model chunk index (0 without VPP) of a pipeline stage's chunk; LayoutError outside the layout."""
        chunk = 0 if vpp_chunk is None else vpp_chunk
        if not 0 <= pp_rank < self.pp:
            raise LayoutError(f"pp_rank={pp_rank} is not a stage of PP={self.pp}; use 0 <= pp_rank < {self.pp}")
        if not 0 <= chunk < self.num_chunks:
            raise LayoutError(f"vpp_chunk={vpp_chunk} is not a chunk of {self.describe()}; "
                              f"use 0 <= vpp_chunk < {self.num_chunks}")
        return chunk

    def is_first_chunk(self, pp_rank: int, vpp_chunk: Optional[int] = None) -> bool:
        """Holds the embedding (megatron-core's pre_process)."""
        return pp_rank == 0 and self.check_chunk(pp_rank, vpp_chunk) == 0

    def is_last_chunk(self, pp_rank: int, vpp_chunk: Optional[int] = None) -> bool:
        """Holds the final norm and the output layer (megatron-core's post_process)."""
        return pp_rank == self.pp - 1 and self.check_chunk(pp_rank, vpp_chunk) == self.num_chunks - 1

    @property
    def last_chunk(self) -> tuple[int, int]:
        """(pp rank, chunk) of the model's last chunk."""
        return self.pp - 1, self.num_chunks - 1

    def describe(self) -> str:
        s = f"TP{self.tp}PP{self.pp}" + (f"CP{self.cp}" if self.cp > 1 else "") + f"DP{self.dp}"
        if self.vpp:
            s += f"VPP{self.vpp}"
        if self.ep > 1 or self.etp is not None:
            s += f"EP{self.ep}" + (f"ETP{self.etp}" if self.etp is not None else "")
        if not self.even_pipeline:
            split = [f"first stage {self.first_stage_layers} layers" if self.first_stage_layers is not None else "",
                     f"last stage {self.last_stage_layers} layers" if self.last_stage_layers is not None else "",
                     "embedding counted" if self.embedding_in_split else "", "loss counted" if self.loss_in_split else ""]
            s += "[" + ", ".join(x for x in split if x) + "]"
        if self.sp:
            s += "+SP"
        return s

    def to_dict(self) -> dict:
        d = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "vpp": self.vpp, "sp": self.sp, "ep": self.ep,
             "etp": self.etp}
        if self.cp > 1:  # written only where it says something: layouts without CP keep their old dicts
            d["cp"] = self.cp
        if not self.even_pipeline:
            d.update(first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
                     embedding_in_split=self.embedding_in_split, loss_in_split=self.loss_in_split)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelLayout":
        return cls(**{k: d[k] for k in ("tp", "pp", "dp", "vpp", "sp", "ep", "etp", "cp", "first_stage_layers",
                                         "last_stage_layers", "embedding_in_split", "loss_in_split") if k in d})
