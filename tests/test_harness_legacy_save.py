"""`--ckpt-format torch`: the harness writes Megatron-LM's legacy files, bitwise equal to Megatron-LM's own.

Fixture A (Llama-like, TP2 PP2 DP2 + SP, distributed optimizer: model_optim_rng.pt + distrib_optim.pt)
and fixture C (GPT-2-like, tied embeddings, TP2 PP2 DP1, plain Adam) are re-run with Megatron-LM's
flags and saved at iteration 4. Every file of every rank must equal Megatron-LM's
tests/fixtures/megatron-lm/*/ckpt/iter_0000004: the same nested keys in the same order, every tensor
bitwise (dtype, shape, bytes: weights, Adam moments and steps, the flat distrib_optim.pt buffers, RNG
generator states), every other value equal; only `args` may differ, and only in the harness's extras
and run-specific values listed below, and on TP rank 1 the CPU generator state is Megatron-LM's
advanced by exactly 3 draws (seeding.py: data-loader draws on every TP rank, so that hidden dropout
stays TP-consistent on CPU). Then the harness resumes from its own legacy files (C) and must
continue Megatron-LM's uninterrupted run (iterations 5..8, 1e-6 relative: its log prints 7 digits).
Negative controls: the comparison reports the iteration-8 files as different, and a resume without the
optimizer state leaves the curve by more than 1e-3.
"""

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain_runs import FIXTURES, Layout, max_rel_diff, megatron_lm_losses, train

pytestmark = pytest.mark.torchrun

A = "A_llama_tp2pp2dp2_distopt_sp_torch"
C = "C_gpt2_tp2pp2dp1_adam_torch"
SAVE_AT_4 = ["--ckpt-format", "torch", "--train-iters", "8", "--exit-interval", "4", "--save-interval", "4"]

# args the harness has and Megatron-LM does not (harness features; norm_epsilon is Megatron-LM's
# layernorm_epsilon; num_microbatches is a derived value Megatron-LM keeps in a global).
HARNESS_ONLY_ARGS = {"layout_invariant_init", "log_jsonl", "norm_epsilon", "num_microbatches",
                     "universal_checkpoint", "universal_allow_batch_change"}
# args whose values legitimately differ: paths, this run's stop, store_true defaults (Megatron-LM
# None, harness False), and values the harness keeps current in args (Megatron-LM leaves its
# args.iteration at the loaded iteration, 0 for a fresh run, and keeps the FLOP count outside args).
RUN_SPECIFIC_ARGS = {"save", "load", "exit_interval", "train_iters", "lr_decay_iters", "no_load_optim",
                     "no_load_rng", "no_save_optim", "no_save_rng", "iteration",
                     "num_floating_point_operations_so_far"}


def tree_differences(ours, theirs, path="") -> list:
    """Where two unpickled checkpoint objects differ: keys (and their order), types, tensors bitwise,
    numpy arrays, plain values. `args` namespaces are compared separately (args_differences)."""
    if isinstance(ours, argparse.Namespace) and isinstance(theirs, argparse.Namespace):
        return []
    if torch.is_tensor(ours) or torch.is_tensor(theirs):
        if not (torch.is_tensor(ours) and torch.is_tensor(theirs)):
            return [f"{path}: {type(ours).__name__} vs {type(theirs).__name__}"]
        if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
            return [f"{path}: {ours.dtype}{tuple(ours.shape)} vs {theirs.dtype}{tuple(theirs.shape)}"]
        same = torch.equal(ours.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8))
        return [] if same else [f"{path}: tensor bytes differ"]
    if isinstance(ours, dict) and isinstance(theirs, dict):
        # megatron-core's state_dict_for_save_checkpoint returns torch's OrderedDict; the fixtures hold
        # plain dicts (their pickles were rewritten to relativise paths in args): same mapping, order kept.
        if list(ours) != list(theirs):
            return [f"{path}: keys {list(ours)} vs {list(theirs)}"]
        return [d for k in ours for d in tree_differences(ours[k], theirs[k], f"{path}/{k}")]
    if type(ours) is not type(theirs):
        return [f"{path}: {type(ours).__name__} vs {type(theirs).__name__}"]
    if isinstance(ours, (list, tuple)):
        if len(ours) != len(theirs):
            return [f"{path}: length {len(ours)} vs {len(theirs)}"]
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in tree_differences(a, b, f"{path}[{i}]")]
    if isinstance(ours, np.ndarray):
        same = ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
        return [] if same else [f"{path}: numpy array differs"]
    return [] if ours == theirs else [f"{path}: {ours!r} vs {theirs!r}"]


def args_differences(ours: argparse.Namespace, theirs: argparse.Namespace) -> dict:
    ours, theirs = vars(ours), vars(theirs)
    return {"only_ours": set(ours) - set(theirs),
            "differing": {k for k in ours if k in theirs and ours[k] != theirs[k]}}


def advanced(generator_state: torch.Tensor, draws: int) -> torch.Tensor:
    """A CPU generator state after `draws` more 64-bit draws (a DataLoader's base seed each)."""
    generator = torch.Generator()
    generator.set_state(generator_state)
    for _ in range(draws):
        torch.empty((), dtype=torch.int64).random_(generator=generator)
    return generator.get_state()


def harness_rng_deviation(rel: Path, ours: dict, theirs: dict) -> list:
    """megatron_ucp/training/seeding.py draws Megatron-LM's 3 DataLoader seeds on every TP rank of the
    data stages (Megatron-LM: TP rank 0 only), so that hidden dropout stays TP-consistent on CPU. On
    TP rank >= 1 the CPU generator (saved as torch_ and cuda_rng_state) is then exactly 3 draws ahead.
    Returns the differences left after accounting for that (and substitutes the advanced state)."""
    tp_rank = int(rel.parts[0].split("_")[2])
    if tp_rank == 0 or "rng_state" not in ours:
        return []
    diffs = []
    for key in ("torch_rng_state", "cuda_rng_state"):
        expected = advanced(theirs["rng_state"][0][key], 3)
        if not torch.equal(ours["rng_state"][0][key], expected):
            diffs.append(f"/rng_state[0]/{key}: not Megatron-LM's state advanced by 3 draws")
        theirs["rng_state"][0][key] = ours["rng_state"][0][key]
    return diffs


def compare_iteration_dirs(ours: Path, theirs: Path) -> dict:
    """{relative file: differences} over every file of both iteration directories."""
    files = sorted({p.relative_to(ours) for p in ours.rglob("*.pt")} | {p.relative_to(theirs) for p in theirs.rglob("*.pt")})
    report = {}
    for rel in files:
        if not (ours / rel).exists() or not (theirs / rel).exists():
            report[str(rel)] = ["missing on one side"]
            continue
        a = torch.load(ours / rel, map_location="cpu", weights_only=False)
        b = torch.load(theirs / rel, map_location="cpu", weights_only=False)
        diffs = harness_rng_deviation(rel, a, b) if isinstance(a, dict) else []
        diffs += tree_differences(a, b)
        if isinstance(a, dict) and "args" in a:
            args = args_differences(a["args"], b["args"])
            diffs += [f"args only in ours: {k}" for k in sorted(args["only_ours"] - HARNESS_ONLY_ARGS)]
            diffs += [f"args value: {k}" for k in sorted(args["differing"] - RUN_SPECIFIC_ARGS)]
        report[str(rel)] = diffs
    return report


@pytest.fixture(scope="module")
def fixture_a_legacy(tmp_path_factory):
    work = tmp_path_factory.mktemp("legacy_a")
    losses = train("llama", Layout(tp=2, pp=2, dp=2, sp=True), work, "train", 8,
                   ["--use-distributed-optimizer", *SAVE_AT_4, "--save", str(work / "ckpt")])
    return work, losses


@pytest.fixture(scope="module")
def fixture_c_legacy(tmp_path_factory):
    work = tmp_path_factory.mktemp("legacy_c")
    losses = train("gpt2", Layout(tp=2, pp=2), work, "train", 8, [*SAVE_AT_4, "--save", str(work / "ckpt")])
    return work, losses


@pytest.mark.parametrize("which", ["A", "C"])
def test_legacy_files_equal_megatron_lm(which, request):
    work, losses = request.getfixturevalue({"A": "fixture_a_legacy", "C": "fixture_c_legacy"}[which])
    fixture = {"A": A, "C": C}[which]
    assert sorted(losses) == [1, 2, 3, 4]
    ours, theirs = work / "ckpt" / "iter_0000004", FIXTURES / fixture / "ckpt" / "iter_0000004"
    report = compare_iteration_dirs(ours, theirs)
    expected_files = 8 if which == "A" else 4  # A: 4 (TP, PP) ranks x {model_optim_rng, distrib_optim}
    assert len(report) == expected_files, sorted(report)
    assert all(not d for d in report.values()), {f: d[:5] for f, d in report.items() if d}
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"

    # Negative control: Megatron-LM's iteration-8 files differ (weights, moments, steps, RNG).
    later = compare_iteration_dirs(ours, FIXTURES / fixture / "ckpt" / "iter_0000008")
    assert all(any("tensor bytes differ" in d for d in diffs) for diffs in later.values()), later


def test_legacy_args_keep_megatron_lm_names_and_values(fixture_a_legacy):
    """args are a Namespace with Megatron-LM's names; besides the listed extras every shared value
    equals Megatron-LM's (layout, model shape, optimizer, schedule, data, params_dtype as torch dtype)."""
    work, _ = fixture_a_legacy
    ours = torch.load(work / "ckpt" / "iter_0000004" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    theirs = torch.load(FIXTURES / A / "ckpt" / "iter_0000004" / "mp_rank_01_001" / "model_optim_rng.pt",
                        weights_only=False)
    diff = args_differences(ours["args"], theirs["args"])
    assert diff["only_ours"] == HARNESS_ONLY_ARGS
    assert diff["differing"] <= RUN_SPECIFIC_ARGS, diff["differing"] - RUN_SPECIFIC_ARGS
    shared = set(vars(ours["args"])) - HARNESS_ONLY_ARGS
    assert len(shared) > 80  # the harness's whole flag set, under Megatron-LM's names
    assert ours["args"].params_dtype is torch.float32 and ours["args"].ckpt_format == "torch"
    assert ours["num_floating_point_operations_so_far"] == theirs["num_floating_point_operations_so_far"]


def test_resume_from_own_legacy_files_continues_megatron_lm(fixture_c_legacy, tmp_path):
    """C (plain Adam, tied): iterations 5..8 continue Megatron-LM's run. For A the files are bitwise
    Megatron-LM's (test above), whose resume tests/test_harness.py already checks
    (test_resumes_megatron_lm_checkpoint[A-torch]); an 8-process rerun here would add nothing."""
    work, _ = fixture_c_legacy
    resumed = train("gpt2", Layout(tp=2, pp=2), tmp_path, "resume", 8, ["--load", str(work / "ckpt")])
    theirs = megatron_lm_losses(C)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert max_rel_diff(resumed, theirs, range(5, 9)) <= 1e-6, (resumed, theirs)
    # Negative control: without the Adam state the curve leaves Megatron-LM's.
    no_optim = train("gpt2", Layout(tp=2, pp=2), tmp_path, "resume_no_optim", 8,
                     ["--load", str(work / "ckpt"), "--no-load-optim"])
    assert max_rel_diff(no_optim, theirs, range(5, 9)) > 1e-3, (no_optim, theirs)
