"""Lion and Muon with their full optimizer state (issue 40) through Megatron-LM 0.19's own loop. megatron-core 0.19
builds either as a ChainedOptimizer of two torch optimizers: the emerging optimizer on the matrix parameters (Lion's
`exp_avg`, Muon's `momentum_buffer`, no step) and its scalar optimizer on the rest (the embedding, the output layer,
the norms: Adam, with `exp_avg`, `exp_avg_sq` and a step). The universal checkpoint holds each parameter's own states
by name and its param group names its optimizer (docs/FORMAT.md "Optimizer state by name").

Fixtures (tools/make_optim_fixtures.sh; the small llama of SGA19 at TP2 DP2, no distributed optimizer, fp32, saved at
iteration 4, losses.jsonl the uninterrupted 8 iterations): LIA19 (Lion, torch_dist), MUA19 / MUC19 (one Muon run,
--muon-tp-mode blockwise, Adam scalars, saved as torch_dist / legacy). Every resume starts at iteration 4 and its
iterations 5-8 (lm loss and grad norm, full precision) are compared within FP32_TOL (1e-6 relative,
tests/pretrain_runs.py) with the reference the math allows:
- Lion's update is elementwise, so any layout continues the uninterrupted run: the direct resume at TP1 DP1, the
  universal resume at TP1 PP2, from-universal torch_dist at TP1 read by Megatron-LM's own --load (measured 1.0e-7
  each);
- Muon's blockwise Newton-Schulz orthogonalizes each TP shard, so only a resume at the saved TP2 continues it: the
  direct resume of the legacy MUC19 at TP2 DP1, from-universal torch at TP2 PP2 read by Megatron-LM's own --load
  (3.5e-7 each); at TP1 the run is another trajectory by design (Megatron-LM's own --load of MUA19 at TP1 leaves the
  uninterrupted run by 1.8e-4), and the direct resume at TP1 must be that one: Megatron-LM's own load at TP1 (0.0);
- negative controls (the universal resume of MUA19 at TP2 DP1): one matrix's Muon momentum zeroed (measured 1.3e-4),
  and its TP halves exchanged (what a wrong shard box gives: 3.0e-4), each must miss by far (> 30x FP32_TOL).
Conversions without training: MUA19 and MUC19 convert to the same bytes; each parameter holds its own optimizer's
states; a universal checkpoint whose Lion parameter claims Adam's states is refused.

The layer-wise distributed optimizer (--use-distributed-optimizer with Muon; bf16: megatron-core 0.19.2 cannot build it
in fp32): MUB19 at TP2 DP2 and MUD19 at TP1 PP2 DP2, and Lion's LIB19 at TP2 DP2 (tools/make_optim_fixtures.sh). megatron-core chains
[LayerWiseDistributedOptimizer([Muon]), the Adam scalars' DistributedOptimizer]: each matrix whole on one DP rank,
saved in model space (`chained_0.optimizer.state.{fp32_param,momentum_buffer}.*`), the scalars in the dp_reshardable
buckets of their own DDP buffer (`chained_1.optimizer.distributed.*`). Megatron-LM's own --load of these restores
only the saved TP and PP (another one fails: "Global shape mismatch" of the chained_1 buckets, measured at TP1 and PP1).
References: MUD19's own load continues its uninterrupted run exactly (0.0), so its losses.jsonl is the reference;
MUB19's own load at the saved TP2 DP2 leaves its uninterrupted run by 3.2e-5 (bf16), so that own load is the reference
(the direct resume at TP2 DP2 equals it: 0.0, measured once). Measured: MUB19 direct at TP2 DP1 1.0e-7, universal at
TP2 PP2 1.0e-7, MUD19 direct at TP1 PP1 DP1 2.7e-7; controls (MUB19's universal at TP2 DP1): linear_fc2's momentum
zeroed 2.0e-4, its TP halves exchanged 3.7e-4 (the output layer's Adam exp_avg halves exchanged, measured once:
1.5e-2).
LIB19: direct at TP2 DP1 8.6e-8 of its uninterrupted run; at TP1 the direct resume equals Megatron-LM's own load of
the from-universal write at TP1 (0.0).
MUE19 (Muon with an MoE layer, TP1 DP2 EP1, fp32: the experts, the router and the shared expert are Muon's matrices):
direct at TP1 PP2, universal at TP1 DP1 and at DP2 EP2 (four chained optimizers) 1.0e-7 of its uninterrupted run;
one expert's momentum zeroed 1.9e-5.
Time: about 165 s (22 runs of 1-4 processes; 2 CPU cores).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Dict

import pytest
import torch

from pretrain_runs import F19, FP32_TOL, Layout, entry_point_model_flags, read_records, run_pretrain

from megatron_ucp.commands import from_universal as fu

pytestmark = pytest.mark.torchrun

LIA19 = "LIA19_llama_tp2dp2_lion_torch_dist"
MUA19 = "MUA19_llama_tp2dp2_muon_torch_dist"
MUC19 = "MUC19_llama_tp2dp2_muon_torch"
MUB19 = "MUB19_llama_tp2dp2_muon_layerwise_bf16_torch_dist"
MUD19 = "MUD19_llama_tp1pp2dp2_muon_layerwise_bf16_torch_dist"
LIB19 = "LIB19_llama_tp2dp2_lion_layerwise_bf16_torch_dist"
MUE19 = "MUE19_moe_tp1dp2_muon_torch_dist"
MATRIX = "decoder.layers.0.self_attention.linear_proj.weight"  # 32x32, sharded(dim=1): Lion's / Muon's
NORM = "decoder.layers.0.input_layernorm.weight"  # Adam's
CONTROL = "decoder.layers.0.mlp.linear_fc2.weight"  # 32x64, sharded(dim=1): Muon's

assert all((F19 / f / "ckpt").is_dir() for f in (LIA19, MUA19, MUC19, MUB19, MUD19, LIB19, MUE19)), (
    f"the Lion/Muon fixtures are missing from {F19}")


def rel_diff(resumed: Dict[int, dict], reference: Dict[int, dict]) -> float:
    assert sorted(resumed) == [5, 6, 7, 8] and set(range(5, 9)) <= set(reference), (sorted(resumed), sorted(reference))
    return max(abs(resumed[i][k] - reference[i][k]) / abs(reference[i][k]) for i in range(5, 9)
               for k in ("lm_loss", "grad_norm"))


class Runs:
    """Each conversion and run once per module."""

    def __init__(self, root: Path):
        self.root = root
        self._done: Dict[str, Dict[int, dict]] = {}
        self._ucp: Dict[str, Path] = {}

    def universal(self, fixture: str) -> Path:
        from megatron_ucp.convert import to_universal

        if fixture not in self._ucp:
            self._ucp[fixture] = to_universal(F19 / fixture / "ckpt", self.root / f"{fixture[:5]}.ucp", progress=False)
        return self._ucp[fixture]

    def resume(self, label: str, fixture: str, layout: Layout, load: Path, extra=(), fmt: str = "torch_dist"):
        if label not in self._done:
            jsonl = self.root / label / "run.jsonl"
            flags = list(entry_point_model_flags(F19 / fixture))
            flags[flags.index("--ckpt-format") + 1] = fmt
            run_pretrain(layout, [*flags, "--load", str(load), *extra, "--log-jsonl", str(jsonl)], self.root / label,
                         "run")
            self._done[label] = read_records(jsonl)
        return self._done[label]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("lion_muon_resume"))


def uninterrupted(fixture: str) -> Dict[int, dict]:
    return read_records(F19 / fixture / "losses.jsonl")


def test_conversions_hold_each_parameters_own_optimizer_state(runs, tmp_path):
    from megatron_ucp.commands.inspect import describe
    from megatron_ucp.commands.verify import verify
    from megatron_ucp.universal import UniversalCheckpoint, UniversalFormatError

    lion = UniversalCheckpoint.open(runs.universal(LIA19))
    assert lion.optimizer_type == "lion" and lion.metadata["optimizer"]["states"] == {
        "exp_avg": "elementwise", "exp_avg_sq": "elementwise"}
    assert lion.parameters[MATRIX].tensors == ("fp32", "exp_avg") and lion.parameters[MATRIX].step is None
    assert lion.parameters[NORM].tensors == ("fp32", "exp_avg", "exp_avg_sq") and lion.parameters[NORM].step == 4
    # megatron-core's chain: Lion's one group, then Adam's two (weight decay, none); parameters point at theirs
    assert [g.get("optimizer") for g in lion.param_groups] == [None, "adam", "adam"]
    assert lion.parameters[MATRIX].param_group["index"] == 0 and lion.parameters[NORM].param_group["index"] == 2
    muon = UniversalCheckpoint.open(runs.universal(MUA19))
    assert muon.parameters[MATRIX].tensors == ("fp32", "momentum_buffer")
    assert muon.parameters[NORM].tensors == ("fp32", "exp_avg", "exp_avg_sq")
    shown = describe(muon)
    assert {tuple(o["states"]): o["parameters"] for o in shown["optimizer_states"]} == {
        ("exp_avg", "exp_avg_sq"): 7, ("momentum_buffer",): 8}
    # one run saved as torch_dist and as legacy: the same state, tensor for tensor (steps included), as the lazy
    # index of either gives it
    from megatron_ucp.convert import to_universal

    lazy = to_universal(F19 / MUC19 / "ckpt", tmp_path / "muc19.lazy", lazy=True, progress=False)
    for other in (F19 / MUC19 / "ckpt", lazy):
        result = verify(runs.universal(MUA19), other, progress=False)
        assert result.compared_keys == ("fp32", "exp_avg", "exp_avg_sq", "momentum_buffer", "step")
        assert all(d.equal for d in result.diffs) and len(result.diffs) == 44, (other, result.diffs)

    # Lion's param group said to be Adam's (metadata.json edited): its parameters' states are not Adam's, refused
    # naming the first of them
    from ucp_edits import edited_copy

    def claim(meta):
        meta["optimizer"]["param_groups"][0]["optimizer"] = "adam"
    bad = edited_copy(runs.universal(LIA19), tmp_path / "claims_adam.ucp", metadata=claim)
    with pytest.raises(UniversalFormatError, match=f"{MATRIX} holds .* its param group 0 is adam's"):
        UniversalCheckpoint.open(bad)


def test_lion_direct_resume_at_tp1dp1(runs):
    got = rel_diff(runs.resume("lion_direct_tp1dp1", LIA19, Layout(), F19 / LIA19 / "ckpt", ["--universal-checkpoint"]),
                   uninterrupted(LIA19))
    assert got <= FP32_TOL, got


def test_lion_universal_resume_at_tp1pp2(runs):
    got = rel_diff(runs.resume("lion_universal_tp1pp2", LIA19, Layout(pp=2), runs.universal(LIA19),
                               ["--universal-checkpoint"]), uninterrupted(LIA19))
    assert got <= FP32_TOL, got


def test_lion_from_universal_torch_dist_read_by_megatron_lms_own_load(runs):
    out = runs.root / "lion_td_tp1"
    fu.from_universal(runs.universal(LIA19), out, ckpt_format="torch_dist", rng_state="cpu", progress=False)
    got = rel_diff(runs.resume("lion_own_load_tp1", LIA19, Layout(), out), uninterrupted(LIA19))
    assert got <= FP32_TOL, got


def test_muon_direct_resume_of_the_legacy_checkpoint_at_tp2dp1(runs):
    got = rel_diff(runs.resume("muon_direct_legacy_tp2", MUC19, Layout(tp=2), F19 / MUC19 / "ckpt",
                               ["--universal-checkpoint"], fmt="torch"), uninterrupted(MUC19))
    assert got <= FP32_TOL, got


def test_muon_from_universal_legacy_read_by_megatron_lms_own_load_at_tp2pp2(runs):
    out = runs.root / "muon_torch_tp2pp2"
    fu.from_universal(runs.universal(MUA19), out, ckpt_format="torch", tensor_model_parallel_size=2,
                      pipeline_model_parallel_size=2, rng_state="cpu", progress=False)
    got = rel_diff(runs.resume("muon_own_load_tp2pp2", MUA19, Layout(tp=2, pp=2), out, fmt="torch"),
                   uninterrupted(MUA19))
    assert got <= FP32_TOL, got


def test_muon_at_another_tp_is_megatron_lms_own_resharding_load(runs, capfd):
    """Blockwise Muon at TP1 is another trajectory (Megatron-LM's own --load at TP1 leaves the uninterrupted run by
    far); the direct resume at TP1 is exactly that trajectory, and says why it differs from the old run."""
    own = runs.resume("muon_own_load_tp1", MUA19, Layout(), F19 / MUA19 / "ckpt")
    assert rel_diff(own, uninterrupted(MUA19)) > 30 * FP32_TOL  # measured 1.8e-4
    got = rel_diff(runs.resume("muon_direct_tp1", MUA19, Layout(), F19 / MUA19 / "ckpt", ["--universal-checkpoint"]),
                   own)
    assert got <= FP32_TOL, got  # measured 0.0
    log = (runs.root / "muon_direct_tp1" / "run.log").read_text()
    assert "Muon with --muon-tp-mode blockwise orthogonalizes each TP shard: at TP=1 (saved at TP=2)" in log


def test_negative_controls_miss_by_far(runs):
    """One matrix's Muon momentum zeroed, and one matrix's Muon momentum with its TP halves exchanged (what a wrong
    shard box gives): each resume at the saved TP2 misses the uninterrupted run by far, while the untouched universal
    checkpoint at the same layout is within FP32_TOL. (Lion's momentum moves these 4 steps at lr 1e-4 too little for
    a control of one matrix: zeroing or swapping one matrix's exp_avg measured 0.7e-6 to 3.7e-6.)"""
    from ucp_edits import edited_copy, swap_tp_shards

    def zero(name, key, t):
        return torch.zeros_like(t) if (name, key) == (CONTROL, "momentum_buffer") else t

    ucp = runs.universal(MUA19)
    args = ["--universal-checkpoint"]
    good = rel_diff(runs.resume("muon_universal_tp2", MUA19, Layout(tp=2), ucp, args), uninterrupted(MUA19))
    zeroed = rel_diff(runs.resume("muon_zeroed_tp2", MUA19, Layout(tp=2),
                                  edited_copy(ucp, runs.root / "zeroed.ucp", tensors=zero), args), uninterrupted(MUA19))
    swapped = rel_diff(runs.resume("muon_swapped_tp2", MUA19, Layout(tp=2),
                                   swap_tp_shards(ucp, runs.root / "swapped.ucp", CONTROL, "momentum_buffer"), args),
                       uninterrupted(MUA19))
    assert good <= FP32_TOL, good
    # measured: good 3.5e-7, zeroed 1.3e-4, swapped 3.0e-4
    assert zeroed > 30 * FP32_TOL and swapped > 30 * FP32_TOL, (zeroed, swapped)


# --- the layer-wise distributed optimizer (bf16) ------------------------------------------------------------------------

def test_layer_wise_conversions_hold_every_parameters_state():
    """Each matrix's Muon momentum and fp32 main weight (model space), each scalar's Adam moments, step and fp32 main
    weight (flat buckets): every shard's fp32 main weight rounds to its saved bf16 weight (a bucket read at the wrong
    offset, or the embedding and the output layer (both 128x32 per TP rank) exchanged, would not), and the universal
    checkpoint holds the same tensors as the checkpoint read directly and as its lazy index."""
    from megatron_ucp.commands.inspect import describe
    from megatron_ucp.commands.verify import verify
    from megatron_ucp.convert import to_universal
    from megatron_ucp.formats import open_checkpoint
    from megatron_ucp.universal import UniversalCheckpoint

    for fixture, shards, matrix_state in ((MUB19, 30, "momentum_buffer"), (MUD19, 15, "momentum_buffer"),
                                          (LIB19, 30, "exp_avg")):
        ckpt = open_checkpoint(F19 / fixture / "ckpt")
        assert ckpt.state_keys == tuple(sorted({"exp_avg", "exp_avg_sq", matrix_state})) and len(ckpt.shards()) == shards
        for ref in ckpt.shards():
            got = ckpt.read(ref)
            assert set(got) == ({"param", "fp32", matrix_state} if "linear" in ref.local_name else
                                {"param", "fp32", "exp_avg", "exp_avg_sq", "step"}), (ref.local_name, sorted(got))
            assert torch.equal(got["fp32"].to(torch.bfloat16), got["param"]), ref
            assert "step" not in got or float(got["step"]) == 4.0
        with tempfile.TemporaryDirectory() as tmp:
            ucp = to_universal(F19 / fixture / "ckpt", Path(tmp) / "u", progress=False)
            lazy = to_universal(F19 / fixture / "ckpt", Path(tmp) / "lazy", lazy=True, progress=False)
            for other in (F19 / fixture / "ckpt", lazy):
                result = verify(ucp, other, progress=False)
                assert result.compared_keys == ("fp32", *ckpt.state_keys, "step")
                assert all(d.equal for d in result.diffs) and len(result.diffs) == 44, (other, result.diffs)
            opened = UniversalCheckpoint.open(ucp)
            assert [g.get("optimizer") for g in opened.param_groups] == [None, "adam", "adam"]
            assert describe(opened)["optimizer_layout"] == "layer-wise distributed optimizer"


def test_layer_wise_direct_resume_at_another_dp_is_megatron_lms_own_load(runs):
    own = runs.resume("layer_wise_own_load_tp2dp2", MUB19, Layout(tp=2, dp=2), F19 / MUB19 / "ckpt")
    assert rel_diff(own, uninterrupted(MUB19)) < 1e-4  # measured 3.2e-5: bf16; the own load is the reference
    got = rel_diff(runs.resume("layer_wise_direct_tp2dp1", MUB19, Layout(tp=2), F19 / MUB19 / "ckpt",
                               ["--universal-checkpoint"]), own)
    assert got <= FP32_TOL, got


def test_layer_wise_universal_resume_at_another_pp_and_its_controls(runs):
    """At TP2 PP2 (Megatron-LM's own load cannot change PP) the universal resume follows the own load at the saved
    layout; one matrix's Muon momentum zeroed, or with its TP halves exchanged, misses by far at TP2 DP1."""
    from ucp_edits import edited_copy, swap_tp_shards

    own = runs.resume("layer_wise_own_load_tp2dp2", MUB19, Layout(tp=2, dp=2), F19 / MUB19 / "ckpt")
    ucp = runs.universal(MUB19)
    args = ["--universal-checkpoint"]
    good = rel_diff(runs.resume("layer_wise_universal_tp2pp2", MUB19, Layout(tp=2, pp=2), ucp, args), own)

    def zero(name, key, t):
        return torch.zeros_like(t) if (name, key) == (CONTROL, "momentum_buffer") else t

    zeroed = rel_diff(runs.resume("layer_wise_zeroed_tp2", MUB19, Layout(tp=2),
                                  edited_copy(ucp, runs.root / "lw_zeroed.ucp", tensors=zero), args), own)
    swapped = rel_diff(runs.resume("layer_wise_swapped_tp2", MUB19, Layout(tp=2),
                                   swap_tp_shards(ucp, runs.root / "lw_swapped.ucp", CONTROL, "momentum_buffer"), args),
                       own)
    assert good <= FP32_TOL, good
    assert zeroed > 30 * FP32_TOL and swapped > 30 * FP32_TOL, (zeroed, swapped)  # measured 2.0e-4, 3.7e-4


def test_layer_wise_direct_resume_of_tp1pp2dp2_on_one_process(runs):
    """MUD19 (TP1 PP2 DP2) resumed directly at TP1 PP1 DP1: its uninterrupted run (Megatron-LM's own load of it
    measured equal to that, 0.0, and refuses PP1)."""
    got = rel_diff(runs.resume("layer_wise_direct_tp1", MUD19, Layout(), F19 / MUD19 / "ckpt",
                               ["--universal-checkpoint"]), uninterrupted(MUD19))
    assert got <= FP32_TOL, got


def test_layer_wise_from_universal_is_megatron_lms_own_save_and_its_own_load_resumes_it(runs, tmp_path):
    """from-universal --use-distributed-optimizer writes Lion / Muon as megatron-core 0.19's layer-wise distributed
    optimizer: at MUB19's layout the same keys, global shapes, chunks and dtypes as Megatron-LM's own save; at TP2 PP2
    (another PP, which Megatron-LM's own load of MUB19 cannot reach) its own --load continues the own load at the saved
    layout (measured 1.0e-7; its own load of the TP2 DP2 write measured equal to it, 0.0). The legacy format is refused
    in one line (not written)."""
    from torch.distributed.checkpoint import FileSystemReader

    def saved(iter_dir: Path) -> dict:  # DCP's index: key -> (global shape, dtype, chunks)
        return {k: (tuple(m.size), m.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks))
                if hasattr(m, "chunks") else None for k, m in FileSystemReader(iter_dir).read_metadata()
                .state_dict_metadata.items()}

    ucp = runs.universal(MUB19)
    fu.from_universal(ucp, tmp_path / "tp2dp2", ckpt_format="torch_dist", tensor_model_parallel_size=2,
                      data_parallel_size=2, use_distributed_optimizer=True, rng_state="cpu", progress=False)
    ours, theirs = (saved(p / "iter_0000004") for p in (tmp_path / "tp2dp2", F19 / MUB19 / "ckpt"))
    assert ours == theirs and len(theirs) == 44
    out = runs.root / "layer_wise_td_tp2pp2"
    fu.from_universal(ucp, out, ckpt_format="torch_dist", tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                      use_distributed_optimizer=True, rng_state="cpu", progress=False)
    own = runs.resume("layer_wise_own_load_tp2dp2", MUB19, Layout(tp=2, dp=2), F19 / MUB19 / "ckpt")
    got = rel_diff(runs.resume("layer_wise_own_load_of_written_tp2pp2", MUB19, Layout(tp=2, pp=2), out), own)
    assert got <= FP32_TOL, got
    with pytest.raises(fu.FromUniversalError, match="in a --ckpt-format torch checkpoint .* not supported") as e:
        fu.from_universal(ucp, tmp_path / "legacy", ckpt_format="torch", tensor_model_parallel_size=2,
                          use_distributed_optimizer=True, rng_state="cpu", progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "legacy").exists()


def test_layer_wise_lion_resumes_and_megatron_lms_own_load_of_its_write_is_the_direct_resume(runs):
    """LIB19 (Lion, layer-wise, bf16, TP2 DP2; its own load continues its uninterrupted run exactly, 0.0): the direct
    resume at TP2 DP1 continues it; at TP1 PP1 (which Megatron-LM's own load of LIB19 cannot reach) bf16's TP-dependent
    rounding moves the run (measured 6.5e-5; Lion is elementwise, in fp32 LIA19 at TP1: 1.0e-7), and the direct resume
    there is exactly what Megatron-LM's own --load makes of the from-universal write at TP1 (0.0)."""
    got = rel_diff(runs.resume("layer_wise_lion_direct_tp2dp1", LIB19, Layout(tp=2), F19 / LIB19 / "ckpt",
                               ["--universal-checkpoint"]), uninterrupted(LIB19))
    assert got <= FP32_TOL, got  # measured 8.6e-8
    out = runs.root / "layer_wise_lion_td_tp1"
    fu.from_universal(runs.universal(LIB19), out, ckpt_format="torch_dist", use_distributed_optimizer=True,
                      rng_state="cpu", progress=False)
    own = runs.resume("layer_wise_lion_own_load_of_written_tp1", LIB19, Layout(), out)
    direct = runs.resume("layer_wise_lion_direct_tp1", LIB19, Layout(), F19 / LIB19 / "ckpt", ["--universal-checkpoint"])
    assert rel_diff(direct, own) <= FP32_TOL, rel_diff(direct, own)  # measured 0.0


def test_muon_with_experts_resumes_and_its_control(runs):
    """MUE19: Muon on an MoE run at EP1 (the experts in the dense optimizers): the routed experts, the router and the shared expert take Muon's
    momentum, the norms and embeddings Adam's; the direct resume at TP1 PP2 and the universal one at TP1 DP1 continue
    the uninterrupted run; routed expert 0's fc1 momentum zeroed misses it by far."""
    from ucp_edits import edited_copy

    ucp = runs.universal(MUE19)
    from megatron_ucp.universal import UniversalCheckpoint

    opened = UniversalCheckpoint.open(ucp)
    expert = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    assert opened.parameters[expert].tensors == ("fp32", "momentum_buffer")
    assert opened.parameters["decoder.layers.1.mlp.router.weight"].tensors == ("fp32", "momentum_buffer")
    args = ["--universal-checkpoint"]
    direct = rel_diff(runs.resume("moe_muon_direct_tp1pp2", MUE19, Layout(pp=2), F19 / MUE19 / "ckpt", args),
                      uninterrupted(MUE19))
    universal = rel_diff(runs.resume("moe_muon_universal_tp1", MUE19, Layout(), ucp, args), uninterrupted(MUE19))

    def zero(name, key, t):
        return torch.zeros_like(t) if (name, key) == (expert, "momentum_buffer") else t

    zeroed = rel_diff(runs.resume("moe_muon_zeroed_tp1", MUE19, Layout(),
                                  edited_copy(ucp, runs.root / "moe_zeroed.ucp", tensors=zero), args),
                      uninterrupted(MUE19))
    assert direct <= FP32_TOL and universal <= FP32_TOL, (direct, universal)  # measured 1.0e-7 each
    assert zeroed > 10 * FP32_TOL, zeroed  # measured 1.9e-5
    # at EP2 the experts have their own optimizers (megatron-core chains four): the universal resume loads them
    # (Muon's experts are whole matrices at any EP: the same run), a write for that layout is refused in one line
    ep2 = rel_diff(runs.resume("moe_muon_universal_dp2ep2", MUE19, Layout(dp=2, ep=2), ucp, args), uninterrupted(MUE19))
    assert ep2 <= FP32_TOL, ep2  # measured 1.0e-7
    with pytest.raises(fu.FromUniversalError, match="chains four optimizers, which megatron-ucp does not write") as e:
        fu.from_universal(ucp, runs.root / "moe_ep2_write", ckpt_format="torch_dist", data_parallel_size=2,
                          expert_model_parallel_size=2, rng_state="cpu", progress=False)
    assert "\n" not in str(e.value) and not (runs.root / "moe_ep2_write").exists()
