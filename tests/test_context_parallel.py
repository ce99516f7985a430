"""Context parallelism (CP) end to end, through Megatron-LM 0.19's own training loop (the entry point, CPU, gloo).

1. CP trains on CPU (cpu_shims' local core attention: keys and values all-gathered over the CP group in sequence
   order, the causal mask by global position; the rotary embedding sliced on the CPU): a run at CP2 prints the
   losses of the same run at CP1 (same global batch, same initial weights) over 8 steps within 1e-6 relative
   (FP32_TOL; measured: dense llama 7.0e-8, GPT-MoE with EP2 lm 7.0e-8 and load balancing 2.4e-7). Negative
   control: the same CP2 run with the gathered chunks left in rank order (tests/cp_wrong_chunk_order_script.py)
   misses by far (measured 7.7e-4 relative over the 8 steps: 770x the tolerance;
   the test asks 100x).
2. Fixtures trained at CP2 (tests/fixtures/megatron-core-0.19/CPA19-CPD19, tools/make_cp_fixtures.sh, each with
   the uninterrupted 8 iterations' --log-jsonl) resumed at other layouts; iterations 5-8 against the fixture's own
   losses.jsonl (lm and load-balancing losses) within FP32_TOL (measured <= 1.4e-7 for each below: one float32
   ulp of a loss near 6.9, the layout noise of the dense fixtures; the MoE routing adds none here):
   - CPA19 (TP1 CP2 DP2, torch_dist dp_reshardable) -> CP1 DP4, --universal-checkpoint straight from its files;
   - CPB19 (TP2 CP2, legacy torch) -> TP1 CP4 (context extension's layout, with a TP change), through to-universal;
   - A19 (TP2 PP2, CP1, Megatron-LM's own run) -> TP1 PP2 CP2, straight from its files (vs its train.log);
   - CPC19 (GPT-MoE TP1 CP2 DP2 EP2) -> CP1 DP4 EP4 straight from its files;
   - CPD19 (GPT-MoE, EP2 over the two CP ranks, fully_reshardable) -> from-universal -c 4 fully_reshardable at CP4
     EP2 -> Megatron-LM's own --load (no plugin);
   - CPA19 -> from-universal -c 2 legacy torch at TP2 CP2 -> Megatron-LM's own --load.
   Negative control: CPA19's universal checkpoint with one parameter's optimizer state taken from another DP x CP
   shard (two same-shape parameters of different shards exchanged: both moments) misses by far (measured 1.1e-4:
   113x the tolerance; the test asks 30x).
3. Written back at the source layout, the writes are Megatron-LM's own files: CPA19 as torch_dist at TP1 CP2 DP2
   (every key and chunk, the DP x CP ranks' bucket shards and files), CPB19 as legacy torch at TP2 CP2 (every rank
   file, its args' context_parallel_size and data_parallel_size as Megatron-LM writes them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import pytest

from pretrain_runs import (A19, CPA19, CPB19, CPC19, CPD19, F19, FP32_TOL, Layout, entry_point_model_flags,
                           read_records, run_pretrain)

from megatron_ucp.commands import from_universal as fu

pytestmark = pytest.mark.torchrun

WRONG_ORDER = Path(__file__).resolve().parent / "cp_wrong_chunk_order_script.py"
LOSSES = ("lm_loss", "load_balancing_loss")
ITER = "iter_0000004"


def rel_diffs(resumed: Dict[int, dict], reference: Dict[int, dict], iterations=range(5, 9)) -> Dict[str, float]:
    """max relative difference over `iterations` of each loss the reference logged."""
    assert sorted(resumed) == list(iterations), f"the run logged {sorted(resumed)}"
    return {loss: max(abs(resumed[i][loss] - reference[i][loss]) / abs(reference[i][loss]) for i in iterations)
            for loss in LOSSES if loss in reference[iterations[0]]}


class Runs:
    """Each conversion and each run once per module."""

    def __init__(self, root: Path):
        self.root = root
        self._done: Dict[str, Dict[int, dict]] = {}

    def universal(self, name: str) -> Path:
        from megatron_ucp.convert import to_universal

        dst = self.root / f"{name}.ucp"
        if not dst.exists():
            to_universal(F19 / name / "ckpt", dst, iteration=4, progress=False)
        return dst

    def run(self, label: str, layout: Layout, flags: List[str], script=None) -> Dict[int, dict]:
        if label not in self._done:
            jsonl = self.root / label / "run.jsonl"
            run_pretrain(layout, [*flags, "--log-jsonl", str(jsonl)], self.root / label, "run",
                         **({"script": script} if script else {}))
            self._done[label] = read_records(jsonl)
        return self._done[label]

    def resume(self, label: str, name: str, layout: Layout, load: Path, universal: bool) -> Dict[int, dict]:
        return self.run(label, layout, [*entry_point_model_flags(F19 / name), "--load", str(load),
                                        *(["--universal-checkpoint"] if universal else [])])


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("cp"))


def uninterrupted(name: str) -> Dict[int, dict]:
    return read_records(F19 / name / "losses.jsonl")


# ------------------------------------------------------------------------------------------------
# 1. CP trains on CPU as CP1 does

FRESH = entry_point_model_flags(F19 / CPA19)  # CPA19's run (8 iterations), without --save: trained afresh
FRESH_MOE = entry_point_model_flags(F19 / CPC19)


@pytest.mark.parametrize("flags,cp1,cp2", [
    (FRESH, Layout(dp=2), Layout(cp=2)),
    (FRESH_MOE, Layout(dp=2, ep=2), Layout(cp=2, ep=2)),
], ids=["dense", "moe-ep2"])
def test_cp2_trains_as_cp1(cp_runs, flags, cp1, cp2):
    """The same global batch at CP1 (DP2) and CP2: 8 steps within FP32_TOL (measured <= 1.4e-7)."""
    a = cp_runs.run(f"fresh_{cp1}", cp1, flags)
    b = cp_runs.run(f"fresh_{cp2}", cp2, flags)
    got = rel_diffs(b, a, range(1, 9))
    assert got and all(v <= FP32_TOL for v in got.values()), got


def test_cp2_with_chunks_in_rank_order_misses(cp_runs):
    """Negative control: the gathered keys and values in rank order, not sequence order (cp_wrong_chunk_order_script)."""
    good = cp_runs.run(f"fresh_{Layout(dp=2)}", Layout(dp=2), FRESH)
    bad = cp_runs.run("fresh_cp2_rank_order", Layout(cp=2), FRESH, script=WRONG_ORDER)
    got = rel_diffs(bad, good, range(1, 9))
    assert got["lm_loss"] > 100 * FP32_TOL, got  # measured 7.7e-4: 770x the tolerance


# ------------------------------------------------------------------------------------------------
# 2. Resumes at other CP (and TP, PP, DP, EP)

def test_cp2_to_cp1_dp4_straight_from_megatron_lms_files(cp_runs):
    got = rel_diffs(cp_runs.resume("cpa19_dp4", CPA19, Layout(dp=4), F19 / CPA19 / "ckpt", True),
                    uninterrupted(CPA19))
    assert all(v <= FP32_TOL for v in got.values()), got


def test_tp2_cp2_legacy_to_tp1_cp4_through_the_universal_format(cp_runs):
    got = rel_diffs(cp_runs.resume("cpb19_cp4", CPB19, Layout(cp=4), cp_runs.universal(CPB19), True),
                    uninterrupted(CPB19))
    assert all(v <= FP32_TOL for v in got.values()), got


def test_cp1_fixture_to_cp2(cp_runs):
    """A19 (Megatron-LM 0.19's own TP2 PP2 run, CP1) -> TP1 PP2 CP2 straight from its files; vs its train.log (its
    printed 7 digits: iterations 5-8 of an uninterrupted run print their own values)."""
    from megatron_ucp.megatron_lm import launch
    from test_megatron_lm_019 import fixture_flags

    flags = [f for f in fixture_flags(A19)]
    for flag, n in (("--tensor-model-parallel-size", 1), ("--pipeline-model-parallel-size", 1),
                    ("--sequence-parallel", 0)):
        i = flags.index(flag)
        del flags[i:i + 1 + n]
    got = cp_runs.run("a19_cp2", Layout(pp=2, cp=2), [*flags, "--load", str(F19 / A19 / "ckpt"), "--ckpt-step", "4",
                                                       "--universal-checkpoint"])
    printed = launch.printed_losses((F19 / A19 / "train.log").read_text())
    worst = max(abs(got[i]["lm_loss"] - float(printed[i])) / float(printed[i]) for i in range(5, 9))
    assert sorted(got) == [5, 6, 7, 8] and worst <= FP32_TOL, worst


def test_moe_cp2_ep2_to_cp1_ep4(cp_runs):
    got = rel_diffs(cp_runs.resume("cpc19_ep4", CPC19, Layout(dp=4, ep=4), F19 / CPC19 / "ckpt", True),
                    uninterrupted(CPC19))
    assert set(got) == set(LOSSES) and all(v <= FP32_TOL for v in got.values()), got


def test_moe_fully_reshardable_written_at_cp4_resumes_through_megatron_lms_own_load(cp_runs):
    out = cp_runs.root / "cpd19_cp4"
    if not out.exists():
        fu.from_universal(cp_runs.universal(CPD19), out, ckpt_format="torch_dist", use_distributed_optimizer=True,
                          optimizer_format="fully_reshardable", context_parallel_size=4,
                          expert_model_parallel_size=2, rng_state="cpu", progress=False)
    args = json.loads((out / "megatron-ucp.json").read_text())["layout"]
    assert args == {"tp": 1, "pp": 1, "dp": 1, "vpp": None, "sp": False, "ep": 2, "etp": None, "cp": 4}
    got = rel_diffs(cp_runs.resume("cpd19_cp4", CPD19, Layout(cp=4, ep=2), out, False), uninterrupted(CPD19))
    assert set(got) == set(LOSSES) and all(v <= FP32_TOL for v in got.values()), got


def test_legacy_written_at_tp2_cp2_resumes_through_megatron_lms_own_load(cp_runs):
    out = cp_runs.root / "cpa19_tp2cp2_legacy"
    if not out.exists():
        fu.from_universal(cp_runs.universal(CPA19), out, ckpt_format="torch", use_distributed_optimizer=True,
                          tensor_model_parallel_size=2, context_parallel_size=2, rng_state="cpu", progress=False)
    got = rel_diffs(cp_runs.resume("cpa19_tp2cp2_legacy", CPA19, Layout(tp=2, cp=2), out, False),
                    uninterrupted(CPA19))
    assert all(v <= FP32_TOL for v in got.values()), got


def test_optimizer_state_from_another_dp_cp_shard_misses(cp_runs):
    """Negative control: in CPA19's universal checkpoint, layer 0's and layer 3's linear_fc1 (same shape; in
    different DP x CP shards of the bucket, checked against the buffer layout) exchange their Adam moments, as a
    reader that took one parameter's state from another rank's shard would write. The CP1 DP4 resume misses."""
    import torch

    from megatron_ucp.adapters.gpt import parameters_for_rank
    from megatron_ucp.core.layout import ParallelLayout
    from megatron_ucp.formats.bucket_layout import BufferParam, DDPBucketConfig, build_chunk_buffers
    from megatron_ucp.universal import UniversalCheckpoint
    from ucp_edits import edited_copy

    ucp_path = cp_runs.universal(CPA19)
    ucp = UniversalCheckpoint.open(ucp_path)
    layout = ParallelLayout(cp=2, dp=2)
    a, b = (f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in (0, 3))
    entries = parameters_for_rank(ucp.config, layout, 0)
    local = {canonical: name for name, _, canonical in entries}
    (buffer,) = build_chunk_buffers([BufferParam(n, tuple(s), torch.float32) for n, s, _ in entries],
                                    DDPBucketConfig(dp_size=layout.dp_cp, use_distributed_optimizer=True))
    shard = buffer.numel // layout.dp_cp
    assert len({buffer.span(local[p]).start // shard for p in (a, b)}) == 2  # the two lie in different shards
    broken = edited_copy(ucp_path, cp_runs.root / "cpa19_swapped.ucp", tensors=lambda name, key, t: (
        ucp.read(b if name == a else a, key) if name in (a, b) and key in ("exp_avg", "exp_avg_sq") else t))
    got = rel_diffs(cp_runs.resume("cpa19_dp4_swapped", CPA19, Layout(dp=4), broken, True), uninterrupted(CPA19))
    assert got["lm_loss"] > 30 * FP32_TOL, got


# ------------------------------------------------------------------------------------------------
# 3. Written back at the source layout: Megatron-LM's own files

def test_torch_dist_write_at_cp2_is_megatron_lms_own_save(cp_runs, tmp_path):
    from test_megatron_versions import differences_from_megatron
    from torch_dist_checks import gap_chunks

    out = tmp_path / "cpa19"
    summary = fu.from_universal(cp_runs.universal(CPA19), out, ckpt_format="torch_dist", use_distributed_optimizer=True,
                                context_parallel_size=2, data_parallel_size=2, rng_state="source", progress=False)
    found = differences_from_megatron(out / ITER, F19 / CPA19 / "ckpt" / ITER, gap_chunks(summary,
                                                                                          cp_runs.universal(CPA19)))
    assert found == [], found[:5]


def test_legacy_write_at_tp2_cp2_is_megatron_lms_own_save(cp_runs, tmp_path):
    from test_from_universal import compare_with_fixture

    out = tmp_path / "cpb19"
    fu.from_universal(cp_runs.universal(CPB19), out, ckpt_format="torch", use_distributed_optimizer=True,
                      tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True, rng_state="cpu",
                      progress=False)
    # Megatron-LM's legacy save: every CP rank of DP rank 0 writes its TP rank's file, the same state; the file's
    # args.rank is whichever wrote last (Megatron-LM's race), ours the first's
    assert compare_with_fixture(out / ITER, F19 / CPB19 / "ckpt" / ITER, skip_args=("rank",)) == 4
