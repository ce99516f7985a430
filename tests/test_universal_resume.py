"""Universal checkpoints end to end: train at layout A (8 iterations, saving at 4), convert iteration 4,
resume at layout B with --universal-checkpoint, and compare iterations 5..8 with A's uninterrupted run.

Tolerance: 1e-4 relative on the lm loss (fp32, dropout 0). Negative control: resuming without the
optimizer state must leave A's curve by more than 1e-3 at some iteration >= 5.
Each source checkpoint is trained once per test session and resumed at many layouts.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pretrain_runs import Layout, max_rel_diff, train

from megatron_ucp.convert import to_universal

pytestmark = pytest.mark.torchrun

DISTOPT = ["--use-distributed-optimizer"]
TOL = 1e-4

# name -> (source layout, extra training flags)
SOURCES = {
    "tp2pp2sp": (Layout(tp=2, pp=2, sp=True), DISTOPT),
    "tp1dp2": (Layout(dp=2), DISTOPT),
    "pp2vpp": (Layout(pp=2, vpp_layers=1), []),  # VPP + plain (non-distributed) Adam
}

# (source, target layout, what changes)
MATRIX = [
    ("tp2pp2sp", Layout(pp=2), "TP 2->1, SP off"),
    ("tp2pp2sp", Layout(tp=2), "PP 2->1"),
    ("tp2pp2sp", Layout(pp=4), "PP 2->4, TP 2->1"),
    ("tp2pp2sp", Layout(tp=2, pp=2), "SP on->off"),
    ("tp2pp2sp", Layout(dp=4), "mixed TP2PP2DP1 -> TP1PP1DP4"),
    ("tp2pp2sp", Layout(tp=2, pp=2, dp=2, sp=True), "DP 1->2"),
    ("tp1dp2", Layout(tp=2, sp=True), "TP 1->2, DP 2->1"),
    ("tp1dp2", Layout(pp=2), "PP 1->2"),
    ("tp1dp2", Layout(dp=4), "DP 2->4"),
    ("tp1dp2", Layout(), "DP 2->1"),
    ("pp2vpp", Layout(pp=2, dp=2), "VPP on->off, DP 1->2"),
]
GPT2_ONLY = [("tp2pp2sp", Layout(tp=4), "TP 2->4")]  # Llama-like has 2 query groups: TP4 cannot hold it


class Source:
    def __init__(self, family, name, work: Path):
        layout, extra = SOURCES[name]
        self.family, self.layout, self.extra = family, layout, extra
        self.work = work
        self.losses = train(family, layout, work, "source", 8,
                            [*extra, "--save", str(work / "ckpt"), "--save-interval", "4"])
        self.ucp = to_universal(work / "ckpt", work / "ucp", iteration=4, progress=False)
        self._resumed: dict = {}

    def resume(self, target: Layout, name: str, extra=(), ucp=None):
        """Iterations 5..8 resumed from the universal checkpoint (cached per name)."""
        if name not in self._resumed:
            self._resumed[name] = train(self.family, target, self.work, name, 8,
                                        [*DISTOPT, "--load", str(ucp or self.ucp), "--universal-checkpoint", *extra])
        return self._resumed[name]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    cache = {}

    def get(family, name):
        if (family, name) not in cache:
            cache[(family, name)] = Source(family, name, tmp_path_factory.mktemp(f"{family}_{name}"))
        return cache[(family, name)]

    return get


CASES = [(f, *case) for f in ("llama", "gpt2") for case in MATRIX] + [("gpt2", *case) for case in GPT2_ONLY]


@pytest.mark.parametrize("family,source,target,change", CASES,
                         ids=[f"{f}-{s}->{t}" for f, s, t, _ in CASES])
def test_loss_continues_at_new_layout(sources, family, source, target, change):
    src = sources(family, source)
    resumed = src.resume(target, f"to_{target}")
    assert sorted(resumed) == [5, 6, 7, 8], resumed
    diff = max_rel_diff(resumed, src.losses, range(5, 9))
    assert diff < TOL, f"{family} {src.layout} -> {target} ({change}): rel diff {diff:.2e}\n{resumed}\n{src.losses}"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_negative_control_without_optimizer_state(sources, family):
    src = sources(family, "tp2pp2sp")
    resumed = src.resume(Layout(), "no_optim", ["--no-load-optim"])
    assert max_rel_diff(resumed, src.losses, range(5, 9)) > 1e-3, (resumed, src.losses)


def test_llama_tp4_is_refused_with_a_clear_error(sources, tmp_path):
    from pretrain_runs import FAMILIES, run_pretrain

    src = sources("llama", "tp2pp2sp")
    proc = run_pretrain(Layout(tp=4), [*FAMILIES["llama"], "--train-iters", "8", "--load", str(src.ucp),
                                      "--universal-checkpoint"], tmp_path, "tp4", expect_failure=True)
    assert "num-query-groups 2 is not divisible by TP=4" in proc.stdout


def test_lazy_checkpoint_resumes_like_the_copy(sources):
    """`to-universal --lazy` (an index into the source checkpoint, no tensor files) resumes at
    TP2PP2+SP -> TP1PP1DP4 with the losses of the copied universal checkpoint (same bytes loaded:
    rel diff <= 1e-6) and of the uninterrupted run (TOL)."""
    src = sources("llama", "tp2pp2sp")
    lazy = to_universal(src.work / "ckpt", src.work / "ucp_lazy", iteration=4, progress=False, lazy=True)
    assert not (Path(lazy) / "tensors").exists() and json.loads((Path(lazy) / "metadata.json").read_text())["lazy"]
    target = Layout(dp=4)
    eager = src.resume(target, f"to_{target}")
    resumed = src.resume(target, "lazy_dp4", ucp=lazy)
    assert sorted(resumed) == [5, 6, 7, 8], resumed
    assert max_rel_diff(resumed, eager, range(5, 9)) <= 1e-6, (resumed, eager)
    assert max_rel_diff(resumed, src.losses, range(5, 9)) < TOL


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_round_trip_is_bitwise(sources, family):
    """Load the universal checkpoint at the source layout, save with the harness, convert again."""
    src = sources(family, "tp2pp2sp")
    resaved = src.work / "resaved"
    train(family, src.layout, src.work, "resave", 4,
          [*src.extra, "--load", str(src.ucp), "--universal-checkpoint", "--save", str(resaved)])
    again = to_universal(resaved, src.work / "ucp_again", iteration=4, progress=False)
    first = json.loads((Path(src.ucp) / "metadata.json").read_text())
    second = json.loads((Path(again) / "metadata.json").read_text())
    assert first["parameters"].keys() == second["parameters"].keys()
    for name, info in first["parameters"].items():
        with safe_open(Path(src.ucp) / info["file"], "pt") as a, \
                safe_open(Path(again) / second["parameters"][name]["file"], "pt") as b:
            assert set(a.keys()) == set(b.keys()), name
            for key in a.keys():
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), f"{name}/{key} changed in the round trip"
        assert info["step"] == second["parameters"][name]["step"], name
    assert first["iteration"] == second["iteration"] == 4
    assert first["consumed_train_samples"] == second["consumed_train_samples"] == 32
    assert first["scheduler"] == second["scheduler"]
