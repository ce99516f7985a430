"""GPT-MoE on Megatron-LM 0.19's own training loop on CPU/gloo (pretrain_scripts/pretrain_gpt.py): the
router's aux loss as --log-jsonl records it, the lm loss free of it, a same-layout legacy resume through
Megatron-LM's own --load, and the plugin's refusal of a universal checkpoint of another MoE model.

Model: pretrain_runs' llama_moe (MoE layers 1 and 3 of 4: 4 experts, top-2, expert ffn 32, a shared
expert of 32, aux-loss coefficient 1e-2). The sources are pretrain_runs.MOE_SOURCES, shared with
tests/test_moe_universal.py through the session's `runs` cache (each trained once per session).

Where the proofs of the retired home-made loop's MoE tests live now:
- the same model and curve at any EP / ETP and with either token dispatcher (was: fresh runs with
  --layout-invariant-init compared with each other): one universal checkpoint resumed at EP1, EP4 DP4
  (alltoall), TP2 ETP2 (experts sliced), PP2 EP2 DP2 (alltoall), biased experts at PP2 EP2 VPP, each against
  the source's uninterrupted curve within 1e-6 (tests/test_moe_universal.py). Biased experts under TP2 ETP1
  are not: megatron-core 0.19.2 sums the expert fc2 biases' gradients over the dense TP group (the retired
  harness patched it; see test_moe_universal's docstring);
- --layout-invariant-init's bitwise-equal initial experts at any EP / ETP, and the harness's own argument
  refusals (defaults, EP / topk / layer-freq / ETP contradictions, --moe-grouped-gemm on CPU): retired with
  the loop and its flag; Megatron-LM 0.19 validates its own arguments. The checkpoint tool's MoE refusals
  (EP that does not divide the experts, ETP != TP for the legacy format) are in test_moe_universal's
  test_tools_on_moe_checkpoints; the loader's, below.
"""

import re

import pytest

from pretrain_runs import DISTOPT, FAMILIES, MOE_SOURCES, SAVED_AT, SCHEDULE, SOURCE_ITERS, Layout, run_pretrain

pytestmark = pytest.mark.torchrun

TOL = 1e-6
# The ep1 source with and without the aux loss, iterations 5..12: the lm loss parts by 2.1e-6..1.7e-5 relative
# (measured); a run whose aux loss reached the lm loss would part from iteration 1.
LM_PART = 1e-6
RESUMED = range(SAVED_AT + 1, SOURCE_ITERS + 1)


def _source(runs, name):
    family, layout, model_flags, flags = MOE_SOURCES[name]
    return runs.source(family, layout, [*model_flags, *flags])


def _printed(log_text: str, iteration: int, field: str) -> tuple[float, float]:
    """(value, one unit of its last printed digit) of `field` on Megatron-LM's log line of `iteration`."""
    line = next(line for line in log_text.splitlines() if re.search(rf"iteration +{iteration}/", line))
    mantissa, exponent = re.search(rf"\| {field}: (\d\.\d+)E([+-]\d+) \|", line).groups()
    return float(f"{mantissa}E{exponent}"), 10.0 ** (int(exponent) - (len(mantissa) - 2))


def test_jsonl_aux_loss_is_megatrons_value_of_each_iteration(runs):
    """The ep2dp4 source (EP2 DP4, 12 iterations): --log-jsonl has every iteration's load_balancing_loss, and
    it is Megatron-LM's own value of THAT iteration: Megatron-LM prints each iteration's value (log interval 1;
    7 digits) except iteration 2, where 0.19 prints the mean of iterations 1 and 2; the jsonl matches the print
    to its last digit. Negative controls: the values change every iteration, so a record of the mean, of the
    running sum or of the previous iteration would miss the print by far more than one digit (checked)."""
    run = _source(runs, "ep2dp4")
    records, log = run.records, run.log.read_text()
    assert sorted(records) == list(range(1, SOURCE_ITERS + 1))
    aux = {i: r["load_balancing_loss"] for i, r in records.items()}
    # Switch-style load-balancing loss averaged over the MoE layers: 1.0 for perfectly balanced routing
    # (measured 1.0016-1.0042 here), larger when experts are unevenly loaded.
    assert all(0.99 < a < 1.2 for a in aux.values()), aux
    assert run.losses[SOURCE_ITERS] < run.losses[1] - 0.1, run.losses  # it learns (measured 6.944 -> 6.769)
    for field, values in (("lm loss", run.losses), ("load_balancing_loss", aux)):
        for i in records:
            printed, unit = _printed(log, i, field)
            expected = (values[1] + values[2]) / 2 if i == 2 else values[i]
            assert abs(printed - expected) <= unit, (field, i, printed, expected)
            if i > 2:  # what a wrong record would have been: previous iteration, running mean, running sum
                for wrong in (values[i - 1], sum(values[j] for j in range(1, i + 1)) / i,
                              sum(values[j] for j in range(1, i + 1))):
                    assert abs(printed - wrong) > unit, (field, i, printed, wrong)


def test_lm_loss_is_the_pure_language_model_loss(runs):
    """The aux loss reaches only the gradients (MoEAuxLossAutoScaler), never `lm loss`: the ep1 source and the
    same run with --moe-aux-loss-coeff 0 have bitwise equal lm loss at iteration 1 (the first forward) and 2 (the
    warmup's first step has learning rate 0); from iteration 3 the curves part, because the router learned from
    the aux loss in one run only (see LM_PART). Without a coefficient megatron-core computes no aux loss: 0 in the
    jsonl, and 0.19 prints the 0."""
    with_aux = _source(runs, "ep1")
    family, layout, model_flags, flags = MOE_SOURCES["ep1"]
    without = runs.run(family, layout, SOURCE_ITERS, [*SCHEDULE, *model_flags, *flags, "--moe-aux-loss-coeff", "0"])
    assert with_aux.losses[1] == without.losses[1] and with_aux.losses[2] == without.losses[2]
    parted = max(abs(with_aux.losses[i] - without.losses[i]) / without.losses[i] for i in RESUMED)
    assert parted > LM_PART, parted
    assert all(r["load_balancing_loss"] == 0.0 for r in without.records.values())
    assert _printed(without.log.read_text(), 3, "load_balancing_loss")[0] == 0.0
    assert all(r["load_balancing_loss"] > 0.99 for r in with_aux.records.values())


def test_same_layout_resume_through_megatron_lms_own_load(runs, tmp_path):
    """The legacy_bias source (EP2 DP2, legacy --ckpt-format torch, chained dense + expert distributed optimizer,
    the router's expert_bias buffer) resumed at the same layout by Megatron-LM's own --load from iteration 4
    (cpu_shims' torch-Adam resume fixes included; Megatron-LM 0.19 honours --ckpt-step only for torch_dist, so
    --load is a folder whose tracker names 4, holding a link to the source's iter_0000004): iterations 5..12
    reproduce the uninterrupted run within TOL on lm loss and aux loss (measured: lm loss bitwise equal, aux loss
    1.2e-7). Negative control: the same resume with --no-load-optim leaves the curve by more than 1e-4 (measured
    7.7e-3)."""
    family, layout, model_flags, flags = MOE_SOURCES["legacy_bias"]
    source = runs.source(family, layout, [*model_flags, *flags])
    at4 = tmp_path / "at4"
    at4.mkdir()
    (at4 / "iter_0000004").symlink_to(source.save / "iter_0000004", target_is_directory=True)
    (at4 / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))
    load = [*model_flags, *DISTOPT, "--ckpt-format", "torch"]
    resumed = runs.resume(family, layout, at4, load, universal=False)
    assert sorted(resumed.records) == list(RESUMED)
    for key in ("lm_loss", "load_balancing_loss"):
        diff = max(abs(resumed.records[i][key] - source.records[i][key]) / abs(source.records[i][key])
                   for i in RESUMED)
        assert diff < TOL, (key, diff)
    no_optim = runs.resume(family, layout, at4, [*load, "--no-load-optim"], universal=False)
    assert max(abs(no_optim.losses[i] - source.losses[i]) / source.losses[i] for i in RESUMED) > 1e-4


def test_universal_resume_refuses_another_moe_model(runs, tmp_path):
    """--universal-checkpoint of the ep1 source (4 experts, MoE layers 1 and 3) into a run with 8 experts in
    every layer: the plugin refuses before loading anything, naming each differing field, both values and the
    flag to set. Negative control: the matching run is accepted (the ep1 source's resumes in
    test_moe_universal)."""
    ucp = runs.universal(_source(runs, "ep1").save)
    proc = run_pretrain(Layout(), [*FAMILIES["llama_moe"], *SCHEDULE, *DISTOPT, "--num-experts", "8",
                                   "--moe-layer-freq", "1", "--train-iters", str(SOURCE_ITERS),
                                   "--load", str(ucp), "--universal-checkpoint"],
                        tmp_path, "refused", expect_failure=True)
    assert "the model config differs from this run's" in proc.stdout
    assert "num_experts: checkpoint 4, this run 8 (set --num-experts)" in proc.stdout
    assert "moe_layers: checkpoint (False, True, False, True), this run (True, True, True, True) " \
           "(set --moe-layer-freq)" in proc.stdout
