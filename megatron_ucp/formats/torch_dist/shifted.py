"""megatron-core 0.15-0.19's shifted fully_reshardable optimizer state, recognised and repaired on read.

With several buckets in a DDP buffer (--overlap-grad-reduce), those releases' DistributedOptimizer.
sharded_param_state_fully_reshardable saves each parameter's main weight and Adam moments from the wrong elements
of the compact state gathered over DP (formats/bucket_layout.py's module docstring and `shifted_save_runs`;
docs/VERSIONS.md "Multi-bucket fully_reshardable"). Which releases do it is their row's `shifted_shardings`
(core/versions.py); which parameters, and where their true state went, follows from the bucket layout the
checkpoint's args give, the one its dp_reshardable save would have had.

Every element of the compact state that lies under some parameter's buffer offsets was saved once, under that
parameter's key: the true state of a parameter is then a list of runs of other parameters' saved tensors
(`SavedRun`), read (or located, as byte regions) from there. Elements whose compact position falls on buffer
padding were saved nowhere: their fp32 main weight is the saved model weight where that is fp32 (the main weight
is the weight itself then), their Adam moments are lost. Reading them is refused (`problem`) unless the reader's
`reset_lost_optimizer_state`: then the moments of just those elements restart at zero (and a 16-bit run's main
weight at the model weight), named in the notice.

The reader (reader.py) asks `ShiftedState.of` at open and routes read()/locate() of an affected parameter here;
`raw_read` / `raw_locate` are its own unrepaired reads of the saved tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Optional

from megatron_ucp.formats.base import ShardRef
from megatron_ucp.formats.bucket_layout import BufferLayout, SavedRun, shifted_save_runs

STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")  # the reader's output names of the optimizer state
_NAMES_SHOWN = 3  # parameters named in a one-line notice


@dataclass(frozen=True)
class ShiftedParam:
    """One parameter whose saved optimizer state is not its own: the runs of its true state (flat, its local
    shape's C order) and the shards of the parameters whose saved tensors hold them."""

    ref: ShardRef
    runs: tuple[SavedRun, ...]
    sources: Mapping[str, ShardRef]  # local name -> that rank's shard of it

    @property
    def lost(self) -> int:
        """Elements saved nowhere (per state tensor)."""
        return sum(r.length for r in self.runs if r.source is None)


@dataclass(frozen=True)
class ShiftedBuffer:
    """One DDP buffer of one model-parallel rank whose fully_reshardable state was saved shifted."""

    rank: str  # 'tp=0 pp=0' (or 'expert etp=.. ep=.. pp=..')
    chunk: int
    index: int  # the buffer's gbuf index in that rank's optimizer
    buckets: int


class ShiftedState:
    """The shifted parameters of one checkpoint (see the module docstring)."""

    def __init__(self, where: str, release: str, sharding: str, buffers: list[ShiftedBuffer],
                 params: dict[tuple, ShiftedParam], fp32_weights: bool):
        self.where = where
        self.release = release
        self.sharding = sharding
        self.buffers = buffers
        self.params = params  # (tp, pp, chunk, ep, local name) -> ShiftedParam
        self.fp32_weights = fp32_weights  # the model weights are fp32: the main weight is the weight itself

    @staticmethod
    def key(ref: ShardRef) -> tuple:
        return ref.tp_rank, ref.pp_rank, ref.vpp_chunk, ref.ep_rank, ref.local_name

    @classmethod
    def of(cls, where: str, release, sharding: Optional[str], ranks: list[tuple[str, list[list[BufferLayout]],
                                                                               Callable[[int, str], ShardRef]]],
           fp32_weights: bool) -> Optional["ShiftedState"]:
        """The shifted state of a checkpoint written by `release` with distributed-optimizer `sharding`, given
        each model-parallel rank's description, its buffers per chunk and a function (chunk, local name) -> its
        shard; None when nothing is shifted (another release or sharding, or no buffer with bucket-end padding
        before its last bucket)."""
        if sharding not in release.shifted_shardings:
            return None
        buffers, params = [], {}
        for rank, chunks, shard in ranks:
            for chunk, chunk_buffers in enumerate(chunks):
                for index, buffer in enumerate(chunk_buffers):
                    runs = shifted_save_runs(buffer)
                    if not runs:
                        continue
                    buffers.append(ShiftedBuffer(rank, chunk, index, len(buffer.buckets)))
                    names = {s.name for s in buffer.params}
                    for name, param_runs in runs.items():
                        ref = shard(chunk, name)
                        sources = {n: shard(chunk, n) for n in {r.source for r in param_runs} - {None} if n in names}
                        params[cls.key(ref)] = ShiftedParam(ref, param_runs, sources)
        if not params:
            return None
        return cls(where, release.name, sharding, buffers, params, fp32_weights)

    # -- what is said ------------------------------------------------------------------------------------

    def _lost_params(self) -> list[ShiftedParam]:
        return [p for p in self.params.values() if p.lost]

    def lost_moments(self) -> int:
        return sum(p.lost for p in self._lost_params())

    @staticmethod
    def _named(params: list[ShiftedParam]) -> str:
        names = [p.ref.local_name for p in params]
        shown = ", ".join(names[:_NAMES_SHOWN])
        return shown + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")

    def _cause(self) -> str:
        buffers = "; ".join(f"{b.rank}{f' chunk {b.chunk}' if b.chunk else ''} buffer {b.index}: {b.buckets} buckets"
                            for b in self.buffers[:_NAMES_SHOWN])
        more = f"; and {len(self.buffers) - _NAMES_SHOWN} more buffers" if len(self.buffers) > _NAMES_SHOWN else ""
        params = list(self.params.values())
        return (f"megatron-core {self.release} saved this {self.sharding} optimizer state shifted (several DDP "
                f"buckets per buffer; fixed only on Megatron-LM main, NVIDIA/Megatron-LM#5077): {len(self.buffers)} "
                f"buffer{'s' if len(self.buffers) != 1 else ''} ({buffers}{more}), {len(params)} parameters "
                f"({self._named(params)})")

    def notice(self, reset: bool) -> str:
        """The one line inspect, to-universal and the direct resume print (and the universal metadata keeps)."""
        lost = self._lost_params()
        if not lost:
            tail = "repaired on read: every element was saved under another parameter's key"
        else:
            fp32 = ("their fp32 main weight from the saved fp32 model weight" if self.fp32_weights
                    else "their fp32 main weight from the 16-bit model weight")
            done = "reset to zero (Adam restarts them)" if reset else "refused without --reset-lost-optimizer-state"
            tail = (f"repaired on read; {self.lost_moments()} elements of each Adam moment of {len(lost)} parameters "
                    f"({self._named(lost)}) were saved nowhere: {done}, {fp32}")
        return f"{self.where}: {self._cause()}; {tail}"

    def problem(self, reset: bool) -> Optional[str]:
        """Why the true state cannot be read (elements saved nowhere, without reset), or None."""
        lost = self._lost_params()
        if not lost or reset:
            return None
        return (f"{self.where}: {self._cause()}; {self.lost_moments()} elements of each Adam moment of {len(lost)} "
                f"parameters ({self._named(lost)}) were saved nowhere. Pass --reset-lost-optimizer-state "
                f"(to-universal; --universal-reset-lost-optimizer-state on a direct resume) to reset just those "
                f"elements (moments to zero), or convert a dp_reshardable save of the run (its default format, "
                f"which megatron-core saves right)")

    # -- reading -----------------------------------------------------------------------------------------

    def read(self, param: ShiftedParam, keys: Optional[Collection[str]], raw_read, reset: bool) -> dict:
        """reader.read() of a shifted parameter: its true state gathered from the saved tensors holding it."""
        import torch

        out = raw_read(param.ref, keys)
        wanted = [k for k in STATE_KEYS if k in out]
        if not wanted:
            return out
        numel = math.prod(param.ref.shape)
        saved: dict = {}  # local name -> the flat saved tensors read for it
        for name, ref in param.sources.items():
            found = out if ref == param.ref else raw_read(ref, wanted)
            saved[name] = {k: found[k].reshape(-1) for k in wanted}
        weight = None
        for key in wanted:
            flat = torch.empty(numel, dtype=torch.float32)
            for run in param.runs:
                dst = flat[run.start:run.start + run.length]
                if run.source is not None:
                    dst.copy_(saved[run.source][key][run.source_start:run.source_start + run.length])
                    continue
                if key == "fp32" and (self.fp32_weights or reset):
                    if weight is None:
                        weight = (out["param"] if "param" in out else raw_read(param.ref, ["param"])["param"])
                        weight = weight.reshape(-1).to(torch.float32)
                    dst.copy_(weight[run.start:run.start + run.length])
                elif reset:
                    dst.zero_()
                else:
                    raise ValueError(self.problem(reset) or "lost optimizer state")
            out[key] = flat.view(param.ref.shape)
        return out

    def zeroed(self, param: ShiftedParam, keys: Optional[Collection[str]], reset: bool) -> dict:
        """reader.zeroed(): with `reset`, the Adam moments' runs saved nowhere (locate() points them at the
        parameter's own saved bytes there, which are not its state: zero is)."""
        if not reset or not param.lost:
            return {}
        lost = tuple((r.start, r.length) for r in param.runs if r.source is None)
        return {k: lost for k in ("exp_avg", "exp_avg_sq") if keys is None or k in keys}

    def locate(self, param: ShiftedParam, keys: Optional[Collection[str]], raw_locate,
               reset: bool = False) -> Optional[dict]:
        """reader.locate() of a shifted parameter: its true state as byte regions of the saved tensors holding it;
        None when an element was saved nowhere and is neither the fp32 model weight nor (with `reset`) an Adam
        moment, whose runs `zeroed` names (read() resets them)."""
        from megatron_ucp.core.dtypes import dtype_name, itemsize
        from megatron_ucp.io.byteio import StoredTensor

        out = raw_locate(param.ref, keys)
        if out is None:
            return None
        wanted = [k for k in STATE_KEYS if k in out]
        if not wanted:
            return out
        located = {}
        for name, ref in param.sources.items():
            found = out if ref == param.ref else raw_locate(ref, wanted)
            if found is None:
                return None
            located[name] = found
        weight = None
        for key in wanted:
            dtype = out[key].dtype
            size = itemsize(dtype_name(dtype))
            regions = []
            for run in param.runs:
                if run.source is not None:
                    stored = located[run.source][key]
                    regions += stored.byte_slice(run.source_start * size, (run.source_start + run.length) * size)
                    continue
                if key != "fp32" and reset:  # bytes of the right size; their value is zero (zeroed)
                    regions += out[key].byte_slice(run.start * size, (run.start + run.length) * size)
                    continue
                if key != "fp32" or not self.fp32_weights:
                    return None
                if weight is None:
                    weight = out.get("param")
                    if weight is None:
                        found = raw_locate(param.ref, ["param"])
                        weight = found.get("param") if found else None
                    if weight is None:
                        return None
                regions += weight.byte_slice(run.start * size, (run.start + run.length) * size)
            out[key] = StoredTensor(tuple(param.ref.shape), dtype, tuple(regions))
        return out
