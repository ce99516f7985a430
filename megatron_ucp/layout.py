"""Parallel layouts (TP x PP x DP, virtual pipeline, sequence parallelism) as plain values."""

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

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)} must be >= 1")
        if self.vpp is not None and self.vpp < 1:
            raise LayoutError(f"vpp={self.vpp} must be >= 1 or None")
        if self.sp and self.tp == 1:
            # Megatron-LM silently turns SP off at TP=1; keep that rule in one place.
            object.__setattr__(self, "sp", False)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_chunks(self) -> int:
        """Model chunks per pipeline stage (1 without VPP)."""
        return self.vpp or 1

    def describe(self) -> str:
        s = f"TP{self.tp}PP{self.pp}DP{self.dp}"
        if self.vpp:
            s += f"VPP{self.vpp}"
        if self.sp:
            s += "+SP"
        return s

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "vpp": self.vpp, "sp": self.sp, "ep": self.ep}

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelLayout":
        return cls(**{k: d[k] for k in ("tp", "pp", "dp", "vpp", "sp", "ep") if k in d})
