"""One torchrun job that writes one output from many processes (e.g. one per node on a shared filesystem):
the sequence both conversions (`to-universal`, `from-universal`) run under torchrun.

1. rank 0 takes the destination (its lock and staging directory) before anything is opened;
2. the other ranks join that staging directory; every rank opens the input and plans the same work;
3. every rank writes its share (each file durable before it reports);
4. rank 0 gathers the shares, writes the rest and publishes;
5. every rank gets rank 0's result.

After each step the ranks agree: if any rank failed, every rank raises the first failure (prefixed with
its rank on the others), so no rank waits forever in the next collective, and rank 0 removes its staging
directory. The job knows nothing about what is written: the steps are the caller's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Optional, TypeVar

Plan = TypeVar("Plan")


@dataclass
class JobResult(Generic[Plan]):
    plan: Plan  # what every rank planned
    share: Any  # what this rank wrote (write_share's return)
    result: Any  # rank 0's finish() return, on every rank
    rank: int
    world: int


def in_torchrun() -> bool:
    """Launched by torchrun with more than one process (WORLD_SIZE/RANK set)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def reports() -> bool:
    """This process prints the command's result: the only one, or rank 0 of a torchrun job."""
    return not in_torchrun() or int(os.environ["RANK"]) == 0


def all_ranks_agree(dist, error: Optional[str], error_type: type) -> None:
    """Raise `error_type` on every rank of a torchrun job if any rank failed (the first failure, prefixed with
    its rank on the others), so that all ranks stop together instead of waiting in the next collective."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        r, e = failed[0]
        raise error_type(e if r == dist.get_rank() else f"rank {r}: {e}")


def run_sharded_job(*, take_destination: Callable[[], Path], join: Callable[[str], Path],
                    open_and_plan: Callable[[Path], Plan], write_share: Callable[[Plan, int, int], Any],
                    finish: Callable[[Plan, list], Any], abort: Callable[[], None], error_type: type,
                    describe: Callable[[Exception], str]) -> JobResult[Plan]:
    """Run the five steps above in this torchrun job (a gloo group is created, and destroyed, when none
    exists). `take_destination` (rank 0) returns the staging directory; `join(path)` (other ranks) joins
    it; `open_and_plan(staging dir)`; `write_share(plan, rank, world)`; `finish(plan, shares by rank)` (rank 0)
    publishes; `abort()` (rank 0, on any failure) removes what take_destination made. `describe(e)` is the
    line reported for an exception of a step (on every rank, as `error_type`)."""
    import torch.distributed as dist

    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo")
    took = False
    try:
        rank, world = dist.get_rank(), dist.get_world_size()

        def step(fn: Callable[[], Any], on: bool = True) -> Any:
            value, error = None, None
            if on:
                try:
                    value = fn()
                except Exception as e:  # noqa: BLE001 - reported on every rank by all_ranks_agree
                    error = describe(e) or type(e).__name__
            all_ranks_agree(dist, error, error_type)
            return value

        staging = step(take_destination, on=rank == 0)
        took = rank == 0
        shared = [str(staging) if staging is not None else None]
        dist.broadcast_object_list(shared, src=0)
        root = Path(shared[0])
        plan = step(lambda: open_and_plan(root if rank == 0 else join(shared[0])))
        share = step(lambda: write_share(plan, rank, world))
        gathered = [None] * world
        dist.gather_object(share, gathered if rank == 0 else None, dst=0)
        result = step(lambda: finish(plan, gathered), on=rank == 0)
        took = False  # published: nothing to remove any more
        out = [result]
        dist.broadcast_object_list(out, src=0)
        return JobResult(plan, share, out[0], rank, world)
    except BaseException:
        if took:
            abort()
        raise
    finally:
        if owns_group:  # a gloo group left to the interpreter's exit can abort the process
            dist.destroy_process_group()
