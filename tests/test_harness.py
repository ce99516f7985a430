"""The training harness: real multi-process pretrain_gpt.py runs on CPU (gloo), compared with
Megatron-LM's own loss logs, across layouts, and across save/resume.

Tolerances: Megatron-LM parity FIXTURE_LOSS_TOL = 1e-6 relative (its log prints 7 significant digits: <= 7e-8
relative rounding; the harness runs Megatron-LM's computation, bit for bit on a CPU like the fixtures' and
within 5.2e-8 on other kernel paths: pretrain_runs.py); layouts 1e-6 relative (same math, different
reduction order: measured fp32 layout noise <= 5.2e-8); same-layout resume 1e-6 relative.
"""

import pytest

from pretrain_runs import FIXTURE_LOSS_TOL, FIXTURES, Layout, max_rel_diff, megatron_lm_losses, train

pytestmark = pytest.mark.torchrun

LLAMA_FIXTURE_LAYOUT = Layout(tp=2, pp=2, dp=2, sp=True)


@pytest.fixture(scope="session")
def llama_fixture_run(tmp_path_factory):
    """Megatron-LM fixture A/B's exact run (TP2PP2DP2, SP, distributed optimizer), saved at 4 and 8."""
    work = tmp_path_factory.mktemp("llama_fixture_run")
    losses = train("llama", LLAMA_FIXTURE_LAYOUT, work, "train", 8,
                   ["--use-distributed-optimizer", "--save", str(work / "ckpt"), "--save-interval", "4"])
    return work, losses


def test_llama_losses_equal_megatron_lm(llama_fixture_run):
    """Same flags and seed as Megatron-LM's run: init, mock data, loss and Adam agree number for number."""
    _, ours = llama_fixture_run
    theirs = megatron_lm_losses("A_llama_tp2pp2dp2_distopt_sp_torch")
    assert max_rel_diff(ours, theirs, range(1, 9)) <= FIXTURE_LOSS_TOL, (ours, theirs)


def test_same_layout_resume_is_exact(llama_fixture_run):
    work, uninterrupted = llama_fixture_run
    resumed = train("llama", LLAMA_FIXTURE_LAYOUT, work, "resume", 8,
                    ["--use-distributed-optimizer", "--load", str(work / "ckpt"), "--ckpt-step", "4"])
    assert sorted(resumed) == [5, 6, 7, 8]
    assert max_rel_diff(resumed, uninterrupted, range(5, 9)) < 1e-6, (resumed, uninterrupted)

    # Negative control: without the optimizer state the curve must leave the uninterrupted one.
    no_optim = train("llama", LLAMA_FIXTURE_LAYOUT, work, "resume_no_optim", 8,
                     ["--use-distributed-optimizer", "--load", str(work / "ckpt"), "--ckpt-step", "4",
                      "--no-load-optim"])
    assert max_rel_diff(no_optim, uninterrupted, range(5, 9)) > 1e-3, (no_optim, uninterrupted)


MEGATRON_LM_CHECKPOINTS = [
    # fixture, family, layout, optimizer flags
    ("B_llama_tp2pp2dp2_distopt_sp_torch_dist", "llama", LLAMA_FIXTURE_LAYOUT, ["--use-distributed-optimizer"]),
    ("A_llama_tp2pp2dp2_distopt_sp_torch", "llama", LLAMA_FIXTURE_LAYOUT, ["--use-distributed-optimizer"]),
    ("C_gpt2_tp2pp2dp1_adam_torch", "gpt2", Layout(tp=2, pp=2), []),
]


@pytest.mark.parametrize("fixture,family,layout,optim", MEGATRON_LM_CHECKPOINTS,
                         ids=[m[0].split("_")[0] + "-" + m[0].rsplit("_", 1)[-1] for m in MEGATRON_LM_CHECKPOINTS])
def test_resumes_megatron_lm_checkpoint(fixture, family, layout, optim, tmp_path):
    """Megatron-LM's own checkpoint at iteration 4 (torch_dist, legacy + distrib_optim.pt, legacy plain
    Adam) continues Megatron-LM's uninterrupted run, iterations 5..8."""
    ckpt = FIXTURES / fixture / "ckpt"
    resumed = train(family, layout, tmp_path, "resume_megatron_lm", 8, [*optim, "--load", str(ckpt), "--ckpt-step", "4"])
    theirs = megatron_lm_losses(fixture)
    assert max_rel_diff(resumed, theirs, range(5, 9)) <= FIXTURE_LOSS_TOL, (resumed, theirs)


def test_gpt2_plain_adam_resume_is_exact(tmp_path):
    """GPT-2-like (tied, biases, LayerNorm, learned positions), TP2PP2, non-distributed Adam."""
    layout = Layout(tp=2, pp=2)
    full = train("gpt2", layout, tmp_path, "train", 8, ["--save", str(tmp_path / "ckpt"), "--save-interval", "4"])
    resumed = train("gpt2", layout, tmp_path, "resume", 8, ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "4"])
    assert max_rel_diff(resumed, full, range(5, 9)) < 1e-6, (resumed, full)


def test_bf16_resume_keeps_fp32_master_weights(tmp_path):
    """bf16 params with fp32 main params in the distributed optimizer: the resume restores the fp32
    masters from the checkpoint (not from the rounded bf16 weights), so the curve is unchanged."""
    layout = Layout(tp=2)
    flags = ["--bf16", "--use-distributed-optimizer"]
    full = train("gpt2", layout, tmp_path, "train", 6, [*flags, "--save", str(tmp_path / "ckpt"), "--save-interval", "3"])
    resumed = train("gpt2", layout, tmp_path, "resume", 6, [*flags, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "3"])
    assert max_rel_diff(resumed, full, range(4, 7)) < 1e-6, (resumed, full)


LAYOUTS = [
    Layout(),                                   # TP1PP1
    Layout(tp=2, pp=2, sp=True),                # TP2PP2 + SP
    Layout(pp=2, dp=2),                         # TP1PP2DP2
    Layout(tp=2, dp=2, sp=True),                # TP2DP2 + SP
    Layout(pp=2, vpp_layers=1),                 # TP1PP2, interleaved (2 virtual stages per rank)
]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_layouts_agree_from_same_initial_model(family, tmp_path):
    """--layout-invariant-init: the same model and data at every layout give the same losses."""
    runs = {}
    for i, layout in enumerate(LAYOUTS):
        extra = ["--layout-invariant-init"] + (["--use-distributed-optimizer"] if i % 2 else [])
        runs[str(layout)] = train(family, layout, tmp_path, f"run{i}", 5, extra)
    reference = runs[str(LAYOUTS[0])]
    for name, losses in runs.items():
        assert max_rel_diff(losses, reference, range(1, 6)) <= 1e-6, (family, name, losses, reference)
