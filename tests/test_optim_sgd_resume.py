"""SGD with momentum (issue 40) end to end through Megatron-LM 0.19's own loop: megatron-core builds torch.optim.SGD
(--sgd-momentum 0.9) under the FP32Optimizer, whose per-parameter state is `momentum_buffer` (no step). SGA19 /
SGB19 (tools/make_optim_fixtures.sh) are one run at TP2 PP2 saved as torch_dist and as legacy torch; their
losses.jsonl is the uninterrupted 8 iterations. Every resume below starts at iteration 4 at another layout and its
iterations 5-8 are compared with it (FP32_TOL, 1e-6 relative: the project's fp32 resume tolerance from measured
noise, tests/pretrain_runs.py), on the lm loss and the grad norm (both logged at full precision; measured: every
resume <= 1.0e-7):
- the universal resume of SGA19's to-universal at TP1 PP1 (one process);
- the direct resume (--universal-checkpoint on the run's own checkpoint) of SGB19 (the legacy reader) at TP2 PP1 DP2;
- the direct resume of SGA19 (the torch_dist reader) at TP1 PP2 DP2;
- from-universal --ckpt-format torch at TP1 PP2, loaded by Megatron-LM's own --load (megatron-core 0.19 cannot --load
  a torch_dist SGD checkpoint at all, its own saves included: FP32Optimizer.sharded_state_dict calls init_state_fn,
  None for SGD; docs/VERSIONS.md);
- negative controls at TP1 PP1 (the universal resume's layout): output_layer's momentum zeroed misses by 3.0e-3
  (lm loss 1.0e-3), layer 0's linear_proj momentum taken from the wrong TP shard (its two TP halves swapped) by
  7.3e-5 (lm loss 2.4e-5): 3000x and 73x the tolerance, 720x the good resume's deviation at least. (Zeroing one
  MLP weight's momentum moves the lm loss of these 4 small SGD steps by 2.6e-7 only, its grad norm by 2.4e-5: the
  grad norm is why both are compared.)
Time: 35 s (5 resumes of 1-4 processes, 2 conversions; 2 CPU cores, otherwise idle).
Conversions and verify are checked without training: to-universal == --lazy == both sources bitwise (verify).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import pytest
import torch

from pretrain_runs import F19 as _F19, FP32_TOL, Layout, entry_point_model_flags, read_records, run_pretrain

from megatron_ucp.commands import from_universal as fu

pytestmark = pytest.mark.torchrun

# the fixtures' folder (tests/fixtures/megatron-core-0.19; MEGATRON_UCP_OPTIM_FIXTURES: where
# tools/make_optim_fixtures.sh wrote them before they are committed)
F19 = Path(os.environ.get("MEGATRON_UCP_OPTIM_FIXTURES", _F19))
SGA19 = "SGA19_llama_tp2pp2dp1_sgd_torch_dist"
SGB19 = "SGB19_llama_tp2pp2dp1_sgd_torch"
ZEROED = "output_layer.weight"
SWAPPED = "decoder.layers.0.self_attention.linear_proj.weight"  # 32x32, sharded(dim=1): TP2 halves [:, :16], [:, 16:]

# committed: a tree without them fails here (a skip would count as a pass)
assert (F19 / SGA19 / "ckpt").is_dir() and (F19 / SGB19 / "ckpt").is_dir(), \
    f"the SGD fixtures SGA19/SGB19 are missing from {F19} (tools/make_optim_fixtures.sh writes them)"


def rel_diff(resumed: Dict[int, dict], reference: Dict[int, dict]) -> float:
    """Largest relative difference of iterations 5-8's lm loss and grad norm (the grad norm sees a momentum error in
    one parameter that the loss of 4 small SGD steps barely shows)."""
    assert sorted(resumed) == [5, 6, 7, 8], f"the run logged {sorted(resumed)}"
    return max(abs(resumed[i][k] - reference[i][k]) / abs(reference[i][k]) for i in range(5, 9)
               for k in ("lm_loss", "grad_norm"))


def uninterrupted() -> Dict[int, dict]:
    return read_records(F19 / SGA19 / "losses.jsonl")


class Runs:
    """Each conversion and run once per module."""

    def __init__(self, root: Path):
        self.root = root
        self._done: Dict[str, Dict[int, dict]] = {}
        self._ucp = None

    def universal(self) -> Path:
        from megatron_ucp.convert import to_universal

        if self._ucp is None:
            self._ucp = to_universal(F19 / SGA19 / "ckpt", self.root / "sga19.ucp", progress=False)
        return self._ucp

    def resume(self, label: str, layout: Layout, load: Path, extra=(), fmt: str = "torch_dist") -> Dict[int, dict]:
        if label not in self._done:
            jsonl = self.root / label / "run.jsonl"
            flags = [f for f in entry_point_model_flags(F19 / SGA19)]
            flags[flags.index("--ckpt-format") + 1] = fmt
            run_pretrain(layout, [*flags, "--load", str(load), *extra, "--log-jsonl", str(jsonl)],
                         self.root / label, "run")
            self._done[label] = read_records(jsonl)
        return self._done[label]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("sgd_resume"))


def test_conversions_carry_the_momentum_by_name(runs, tmp_path):
    """to-universal of SGA19 (torch_dist) holds SGD's state by name (format version 4, optimizer.states
    {momentum_buffer: elementwise}, no step), equal bitwise to SGB19 (legacy, the same run) and to its own --lazy
    index; inspect names the optimizer."""
    from megatron_ucp.commands.inspect import describe
    from megatron_ucp.commands.verify import verify
    from megatron_ucp.convert import to_universal
    from megatron_ucp.universal import UniversalCheckpoint

    ucp = UniversalCheckpoint.open(runs.universal())
    assert ucp.version == 4 and ucp.optimizer_type == "sgd" and ucp.optimizer_state_keys == ("momentum_buffer",)
    assert ucp.metadata["optimizer"]["states"] == {"momentum_buffer": "elementwise"}
    assert all(g["momentum"] == 0.9 for g in ucp.param_groups)
    info = ucp.parameters[ZEROED]
    assert info.tensors == ("fp32", "momentum_buffer") and info.step is None
    assert float(ucp.read(ZEROED, "momentum_buffer").abs().max()) > 0
    lazy = to_universal(F19 / SGA19 / "ckpt", tmp_path / "lazy", lazy=True, progress=False)
    for other in (lazy, F19 / SGB19 / "ckpt", F19 / SGA19 / "ckpt"):
        result = verify(runs.universal(), other, progress=False)
        assert result.compared_keys == ("fp32", "momentum_buffer") and all(d.equal for d in result.diffs), other
    shown = describe(UniversalCheckpoint.open(runs.universal()))
    assert shown["optimizer_type"] == "sgd" and shown["optimizer_states"] == [
        {"states": ["momentum_buffer"], "parameters": len(ucp.parameters)}]


def test_universal_resume_at_tp1pp1(runs):
    got = rel_diff(runs.resume("universal_tp1pp1", Layout(), runs.universal(), ["--universal-checkpoint"]),
                   uninterrupted())
    assert got <= FP32_TOL, got


def test_direct_resume_of_the_legacy_checkpoint_at_tp2pp1dp2(runs):
    got = rel_diff(runs.resume("direct_legacy_tp2dp2", Layout(tp=2, dp=2), F19 / SGB19 / "ckpt",
                               ["--universal-checkpoint"], fmt="torch"), uninterrupted())
    assert got <= FP32_TOL, got


def test_direct_resume_of_the_torch_dist_checkpoint_at_tp1pp2dp2(runs):
    got = rel_diff(runs.resume("direct_torch_dist_pp2dp2", Layout(pp=2, dp=2), F19 / SGA19 / "ckpt",
                               ["--universal-checkpoint"]), uninterrupted())
    assert got <= FP32_TOL, got


def test_from_universal_legacy_read_by_megatron_lms_own_load(runs):
    out = runs.root / "written_torch_tp1pp2"
    fu.from_universal(runs.universal(), out, ckpt_format="torch", pipeline_model_parallel_size=2, rng_state="cpu",
                      progress=False)
    got = rel_diff(runs.resume("megatron_load_torch_tp1pp2", Layout(pp=2), out, fmt="torch"), uninterrupted())
    assert got <= FP32_TOL, got


def test_from_universal_torch_dist_warns_that_megatron_cannot_load_sgd_torch_dist(runs):
    plan = fu.from_universal(runs.universal(), runs.root / "written_td", ckpt_format="torch_dist",
                             pipeline_model_parallel_size=2, rng_state="cpu", progress=False, dry_run=True).plan
    assert any("cannot resume a torch_dist checkpoint of sgd" in w for w in plan.warnings), plan.warnings
    with pytest.raises(fu.FromUniversalError, match="holds sgd optimizer state.*drop --use-distributed-optimizer"):
        fu.from_universal(runs.universal(), runs.root / "x", ckpt_format="torch", use_distributed_optimizer=True,
                          progress=False, dry_run=True)


def _edited(runs: Runs, label: str, edit) -> Path:
    from ucp_edits import edited_copy

    return edited_copy(runs.universal(), runs.root / f"{label}.ucp", tensors=edit)


def test_negative_controls_miss_by_far(runs):
    """One parameter's momentum zeroed, and one parameter's momentum with its TP shards exchanged (what a writer
    taking the wrong TP rank's slice would give): each resume misses the uninterrupted run by far, while the
    untouched universal checkpoint at the same layout is within FP32_TOL."""
    def zero(name, key, t):
        return torch.zeros_like(t) if (name, key) == (ZEROED, "momentum_buffer") else t

    def swap(name, key, t):
        if (name, key) != (SWAPPED, "momentum_buffer"):
            return t
        half = t.shape[1] // 2
        return torch.cat([t[:, half:], t[:, :half]], dim=1)

    good = rel_diff(runs.resume("universal_tp1pp1", Layout(), runs.universal(), ["--universal-checkpoint"]),
                    uninterrupted())
    zeroed = rel_diff(runs.resume("zeroed_tp1pp1", Layout(), _edited(runs, "zeroed", zero),
                                  ["--universal-checkpoint"]), uninterrupted())
    swapped = rel_diff(runs.resume("swapped_tp1pp1", Layout(), _edited(runs, "swapped", swap),
                                   ["--universal-checkpoint"]), uninterrupted())
    assert good <= FP32_TOL, good
    # measured: good 1.0e-7 (grad norm), zeroed 3.0e-3, swapped 7.3e-5
    assert zeroed > 1000 * FP32_TOL and swapped > 30 * FP32_TOL, (zeroed, swapped)
