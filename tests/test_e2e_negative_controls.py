"""Partial negative controls: the continuation tolerance sees partial bugs, not only a missing optimizer.

The source is test_e2e_buckets_targets.py's (Llama-like fp32, TP2 DP2 + SP, 9 DDP buckets per rank, warmup
2 + cosine, weight decay 0.1, saved at 4; the session trains it once). Its universal checkpoint, resumed at
TP1 PP1 DP1 with plain Adam, continues the uninterrupted run within FP32_TOL = 1e-6 over iterations 5..12
(test_targets_never_run_before[plain-adam]). Here a copy with one planted bug (tests/ucp_edits.py) is
resumed at the same target and must leave that tolerance; each test reports its margin (difference /
tolerance). Measured through Megatron-LM 0.19's loop (CPU, gloo; the good resume: 7.1e-8): exp_avg_sq
shards swapped 4.5e-5 (45x the tolerance), every Adam step + 1 4.5e-4 (450x), scheduler num_steps 0
8.1e-3 (8100x), layer 2's QKV query groups swapped 8.7e-4 (870x). The suite's former tolerance of 1e-4
would have passed the swapped shards.
"""

import pytest

from pretrain_runs import FP32_TOL, OVERLAP, Layout, rel_diff

import ucp_edits

pytestmark = pytest.mark.torchrun

FAMILY, SOURCE_LAYOUT = "llama", Layout(tp=2, dp=2, sp=True)
BUCKETED = [*OVERLAP, "--ddp-bucket-size", "4000"]  # test_e2e_buckets_targets.py's source
TARGET = Layout()  # TP1 PP1 DP1, plain Adam

PLANTED = {
    # name: (edit, what a converter bug of this kind would do)
    "exp_avg_sq-tp-shards-swapped": (
        lambda src, dst: ucp_edits.swap_tp_shards(src, dst, "decoder.layers.1.self_attention.linear_proj.weight"),
        "concatenate layer 1 linear_proj's exp_avg_sq TP shards in the wrong order"),
    "adam-step-plus-one": (ucp_edits.steps_plus_one, "store every parameter's Adam step off by one"),
    "scheduler-num-steps-0": (ucp_edits.scheduler_reset, "lose the LR scheduler's position"),
    "qkv-groups-swapped": (lambda src, dst: ucp_edits.swap_qkv_groups(src, dst, layer=2),
                           "put layer 2's query groups in the wrong order"),
}


@pytest.fixture(scope="module")
def source(runs):
    return runs.source(FAMILY, SOURCE_LAYOUT, BUCKETED)


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_partial_bug_leaves_the_tolerance(source, runs, tmp_path_factory, name):
    edit, what = PLANTED[name]
    good = runs.resume(FAMILY, TARGET, runs.universal(source.save))
    assert rel_diff(good.losses, source.losses) <= FP32_TOL  # the same target without the bug
    bad = runs.resume(FAMILY, TARGET, edit(runs.universal(source.save), tmp_path_factory.mktemp(name) / "ucp"))
    diff = rel_diff(bad.losses, source.losses)
    print(f"{name}: rel diff {diff:.2e}, margin {diff / FP32_TOL:.0f}x the tolerance {FP32_TOL:g}")
    assert diff > FP32_TOL, f"a converter that would {what} passes the continuation check ({diff:.2e})"
