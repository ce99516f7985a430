"""Lion and Muon weights alone (issue 40): `to-universal --weights-only` and the direct resume with Megatron-LM's own
--no-load-optim move the weights (with the schedule, the iteration and the RNG state) of every Lion / Muon checkpoint
to another layout, and the optimizer restarts from zero, exactly as Megatron-LM's own --load --no-load-optim restarts it
at the saved layout: the way out that the one-line refusals (an optimizer or an optimizer layout megatron-ucp does not
map: tests/test_optimizer_states.py) name. (Their full state: tests/test_optim_lion_muon_resume.py.)

Fixtures (tools/make_optim_fixtures.sh, Megatron-LM 0.19's own loop, megatron-core 0.19.2 + emerging-optimizers 0.3.0,
the small llama of SGA19, TP2 DP2, saved at iteration 4):
- LIA19: Lion without the distributed optimizer (fp32; megatron-core gives the embeddings, output layer and norms Adam);
- MUA19 / MUC19: Muon (blockwise TP mode, Adam scalars) without the distributed optimizer, fp32, torch_dist / legacy;
- MUB19: Muon under the layer-wise distributed optimizer, bf16 (megatron-core 0.19.2 cannot build it in fp32).
The resume proof uses Lion: its update is elementwise, so the trajectory does not depend on the layout; Muon's
blockwise Newton-Schulz runs per TP shard, so a Muon run at another TP is another trajectory by design.
Tolerance FP32_TOL (1e-6 relative, tests/pretrain_runs.py), on iterations 5-8's lm loss and grad norm; the negative
control (one weight's TP halves exchanged, what a wrong shard box would give) must miss by far.
Time: about 60 s (4 runs of 1-4 processes; 2 CPU cores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest
import torch

from pretrain_runs import F19, FP32_TOL, Layout, entry_point_model_flags, read_records, run_pretrain

from megatron_ucp.formats import open_checkpoint

pytestmark = pytest.mark.torchrun

LIA19 = "LIA19_llama_tp2dp2_lion_torch_dist"
MUA19 = "MUA19_llama_tp2dp2_muon_torch_dist"
MUB19 = "MUB19_llama_tp2dp2_muon_layerwise_bf16_torch_dist"
MUC19 = "MUC19_llama_tp2dp2_muon_torch"
OPTIMIZER = {LIA19: "lion", MUA19: "muon", MUB19: "muon", MUC19: "muon"}
SWAPPED = "decoder.layers.0.self_attention.linear_proj.weight"  # 32x32, sharded(dim=1)

# committed: a tree without them fails here (a skip would count as a pass)
assert all((F19 / f / "ckpt").is_dir() for f in OPTIMIZER), f"the Lion/Muon fixtures are missing from {F19}"


def rel_diff(resumed: Dict[int, dict], reference: Dict[int, dict]) -> float:
    assert sorted(resumed) == [5, 6, 7, 8] and set(range(5, 9)) <= set(reference), (sorted(resumed), sorted(reference))
    return max(abs(resumed[i][k] - reference[i][k]) / abs(reference[i][k]) for i in range(5, 9)
               for k in ("lm_loss", "grad_norm"))


@pytest.mark.parametrize("fixture", sorted(OPTIMIZER))
def test_weights_only_opens_every_one(fixture):
    ckpt = open_checkpoint(F19 / fixture / "ckpt", weights_only=True)
    assert ckpt.optimizer_kind == "none" and ckpt.optimizer_name is None and ckpt.state_keys == ()
    assert ckpt.skipped_optimizer == OPTIMIZER[fixture] and ckpt.loss_scaler() is None
    assert ckpt.common_state()["opt_param_scheduler"], "the schedule is kept"
    assert len(ckpt.shards()) == 2 * 15  # TP2 x the 15 parameters of the 2-layer llama


def test_weights_only_conversions_of_one_run_in_both_formats_are_equal(tmp_path):
    """MUA19 (torch_dist) and MUC19 (legacy) are one run: their weights-only universal checkpoints are bitwise equal,
    hold no optimizer state and say which optimizer's was left out."""
    from megatron_ucp.commands.verify import verify
    from megatron_ucp.convert import to_universal
    from megatron_ucp.universal import UniversalCheckpoint

    a = to_universal(F19 / MUA19 / "ckpt", tmp_path / "a", weights_only=True, progress=False)
    ucp = UniversalCheckpoint.open(a)
    assert ucp.optimizer_type is None and not ucp.has_optimizer_state and ucp.iteration == 4
    assert ucp.metadata["conversion"]["optimizer_left_out"] == "muon"
    assert all(info.tensors == ("fp32",) for info in ucp.parameters.values())
    c = to_universal(F19 / MUC19 / "ckpt", tmp_path / "c", weights_only=True, progress=False)
    result = verify(a, c, progress=False)
    assert result.compared_keys == ("fp32",) and all(d.equal for d in result.diffs)


class Runs:
    def __init__(self, root: Path):
        self.root = root
        self._done: Dict[str, Dict[int, dict]] = {}

    def resume(self, label: str, layout: Layout, load: Path, extra=()) -> Dict[int, dict]:
        if label not in self._done:
            jsonl = self.root / label / "run.jsonl"
            run_pretrain(layout, [*entry_point_model_flags(F19 / LIA19), "--load", str(load), "--no-load-optim",
                                  *extra, "--log-jsonl", str(jsonl)], self.root / label, "run")
            self._done[label] = read_records(jsonl)
        return self._done[label]

    def reference(self) -> Dict[int, dict]:
        """Megatron-LM's own --load --no-load-optim of LIA19 at its saved layout, TP2 DP2."""
        return self.resume("megatron_tp2dp2", Layout(tp=2, dp=2), F19 / LIA19 / "ckpt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("weights_only"))


def test_direct_weights_only_resume_at_tp1dp1_is_megatrons_own(runs):
    """The direct resume of LIA19 with --no-load-optim at TP1 DP1 (one process) follows Megatron-LM's own --load
    --no-load-optim at TP2 DP2; both restart Lion and Adam from zero, so both leave the uninterrupted run (losses.jsonl)
    by far (measured 5.9e-4): the reference is not the fixture's own continuation."""
    uninterrupted = read_records(F19 / LIA19 / "losses.jsonl")
    assert rel_diff(runs.reference(), uninterrupted) > 100 * FP32_TOL
    got = rel_diff(runs.resume("direct_tp1dp1", Layout(), F19 / LIA19 / "ckpt", ["--universal-checkpoint"]),
                   runs.reference())
    assert got <= FP32_TOL, got  # measured 1.0e-7


def test_universal_weights_only_resume_at_tp1pp2_and_its_control(runs):
    """to-universal --weights-only, resumed at TP1 PP2: Megatron-LM's own trajectory; the same checkpoint with one
    weight's TP halves exchanged misses by far."""
    from megatron_ucp.convert import to_universal
    from ucp_edits import edited_copy

    ucp = to_universal(F19 / LIA19 / "ckpt", runs.root / "lia19.ucp", weights_only=True, progress=False)

    def swap(name, key, t):
        if (name, key) != (SWAPPED, "fp32"):
            return t
        half = t.shape[1] // 2
        return torch.cat([t[:, half:], t[:, :half]], dim=1)

    good = rel_diff(runs.resume("universal_tp1pp2", Layout(pp=2), ucp, ["--universal-checkpoint"]), runs.reference())
    bad = rel_diff(runs.resume("swapped_tp1pp2", Layout(pp=2), edited_copy(ucp, runs.root / "swapped.ucp", tensors=swap),
                               ["--universal-checkpoint"]), runs.reference())
    assert good <= FP32_TOL, good
    assert bad > 100 * FP32_TOL, bad  # measured: good 1.0e-7, bad 3.3e-3
