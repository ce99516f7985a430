"""`--ckpt-format torch`: the harness writes Megatron-LM's legacy files: Megatron-LM's files, keys, byte layout
and non-float state exactly, and the tensors training computed within the measured cross-CPU noise.

Fixture A (Llama-like, TP2 PP2 DP2 + SP, distributed optimizer: model_optim_rng.pt + distrib_optim.pt)
and fixture C (GPT-2-like, tied embeddings, TP2 PP2 DP1, plain Adam) are re-run with Megatron-LM's
flags, saved at iteration 4 and, for the negative control, 5. Every file of every rank is compared with
Megatron-LM's tests/fixtures/megatron-lm/*/ckpt/iter_0000004.

Exact on every CPU: the same files, the same nested keys in the same order, every tensor's dtype and
shape, every non-float tensor and every other value (RNG generator states, Adam `step`s, param groups,
`numel_unpadded`, scheduler, iteration), and where the float tensors hold exact zeros (the flat
distrib_optim.pt buffers' alignment padding, the Adam moments of embedding rows no token touched: the
optimizer's byte layout). `args` may differ only in the harness's extras and run-specific values listed
below, and on TP rank 1 the CPU generator state is Megatron-LM's advanced by exactly 3 draws (seeding.py:
data-loader draws on every TP rank, so that hidden dropout stays TP-consistent on CPU).

Within tolerance: the float tensors training computed (weights, the distributed optimizer's fp32 mains,
Adam's exp_avg / exp_avg_sq). Their last bits depend on the CPU: the harness reproduces the fixtures bit
for bit on this project's machines (AMD EPYC, torch CPU capability AVX512), not on an Intel Xeon with
AVX-512 (issue #26). Re-running the same training on one machine with other kernel paths shows which
operations round differently (and an op-by-op check on fixed inputs, which ops change under each):
- MKL's sgemm code path (matmul, linear, the attention bmm): MKL_CBWR=COMPATIBLE. MKL picks its kernels
  by CPU vendor and model, which is why ATEN_CPU_CAPABILITY=avx2 / MKL_CBWR=AVX2 on the Xeon did not
  recreate the fixtures' bytes;
- ATen's vector width (ATEN_CPU_CAPABILITY=avx2 instead of avx512): softmax, log-softmax / cross-entropy
  and sums reduce in another order;
- ATen's scalar kernels (ATEN_CPU_CAPABILITY=default): besides the above exp, GELU, SiLU, layer / RMS
  norm and vector norms (libm instead of SLEEF);
- OpenMP threads (OMP_NUM_THREADS=2, the harness's runs use 1): sums split over threads.
The losses then still agree to 5.2e-8 relative, but Adam divides each gradient by its own running RMS, so
where a gradient is nearly zero (the key bias's is zero up to rounding: softmax ignores a shift of all
scores) rounding noise becomes a weight change of a sizable fraction of the step.

Measured against the fixtures over those four variants and all of them at once (A and C, iteration 4,
differences taken in float64): weights and fp32 mains differ by an RMS of <= 3.4e-4 lr (one element by at
most 1.9e-2 lr; lr = 1e-3 is about what one Adam step moves an element), Adam moments by
||ours - theirs|| / ||theirs|| <= 3.4e-5. Tolerances, per parameter (distrib_optim.pt's flat buffers are
cut into their parameters' spans), 29x those: WEIGHT_TOL (RMS <= 1e-2 lr) and MOMENT_TOL (1e-3). An RMS, not the largest element: one element's difference is a
gradient's rounding divided by its own small RMS, and can reach a good part of a step on some CPU.
Negative control: the same run's iteration-5 files (one Adam step more) exceed the tolerance in EVERY
trained tensor, so a step's worth of error in any one parameter's weight or moments shows (measured:
weights >= 0.31 lr RMS, 31x WEIGHT_TOL; moments >= 0.13, 130x MOMENT_TOL). And C re-run with ATen's scalar kernels
(ATEN_CPU_CAPABILITY=default: another CPU's rounding, on this one) is not bitwise Megatron-LM's yet
passes the same comparison: the tolerance is needed and sufficient.

Then the harness resumes from its own legacy files (C) and must continue Megatron-LM's uninterrupted run
(iterations 5..8, FIXTURE_LOSS_TOL = 1e-6 relative: its log prints 7 digits, cross-CPU loss noise
measured <= 5.2e-8).
Negative control: a resume without the optimizer state leaves the curve by more than 1e-3.
Runtime 2.5 min on 2 shared cores, 3.7 min at load average 17 (A: 8 processes; C, C with scalar kernels and
two resumes: 4 each). Of that, the scalar-kernel run takes 20-40 s and iteration 5 a few seconds.
"""

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain_runs import FIXTURE_LOSS_TOL, FIXTURES, Layout, max_rel_diff, megatron_lm_losses, train

from megatron_ucp.formats.bucket_layout import BufferParam, DDPBucketConfig, build_buffer_layout

pytestmark = pytest.mark.torchrun

A = "A_llama_tp2pp2dp2_distopt_sp_torch"
C = "C_gpt2_tp2pp2dp1_adam_torch"
# saved at 4 (compared with Megatron-LM's iteration 4) and at the exit, 5 (the negative control)
SAVE_AT_4_AND_5 = ["--ckpt-format", "torch", "--train-iters", "8", "--exit-interval", "5", "--save-interval", "4"]

LR = 1e-3  # the fixtures' constant learning rate: about what one Adam step moves an element
WEIGHT_TOL = 1e-2  # RMS(ours - theirs) of a weight / fp32 main tensor, in units of LR (measured <= 3.4e-4)
MOMENT_TOL = 1e-3  # ||ours - theirs|| / ||theirs|| of an Adam moment (measured <= 3.4e-5)

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


def trained_kind(path: str) -> str:
    """Which float tensors training computed (compared within tolerance), by their place in the file:
    'moment' (Adam exp_avg / exp_avg_sq), 'weight' (model parameters, distrib_optim.pt's fp32 `param`),
    or '' (exact: Adam `step`s and anything else)."""
    leaf = path.rsplit("/", 1)[-1]
    if leaf in ("exp_avg", "exp_avg_sq"):
        return "moment"
    if leaf == "param" or path.startswith("/model/"):
        return "weight"
    return ""


def deviation(kind: str, ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """A trained tensor's distance from Megatron-LM's as a fraction of its tolerance (<= 1 passes)."""
    diff = ours.double() - theirs.double()
    if kind == "weight":
        return diff.pow(2).mean().sqrt().item() / (WEIGHT_TOL * LR)
    scale = theirs.double().norm().item()
    if scale == 0:
        return 0.0 if torch.equal(ours, theirs) else float("inf")
    return diff.norm().item() / scale / MOMENT_TOL


def flat_buffer_spans(rank_dir: Path) -> dict:
    """{parameter name: (start, end)} in a legacy distrib_optim.pt's flat buffers, from the rank's
    model_optim_rng.pt (fixture A: one fp32 buffer in one bucket), so that each parameter's fp32 main and
    moments are compared on their own rather than diluted in the rank's whole buffer."""
    state = torch.load(rank_dir / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    params = [BufferParam(name, tuple(t.shape), t.dtype) for name, t in state["model"].items() if torch.is_tensor(t)]
    config = DDPBucketConfig(dp_size=state["args"].data_parallel_size, use_distributed_optimizer=True)
    layout = build_buffer_layout(params, config)
    assert len(layout.buckets) == 1, "one bucket per buffer (no --overlap-grad-reduce)"
    return {span.name: (span.start, span.end) for span in layout.params}


def tree_differences(ours, theirs, path="", deviations=None, spans=None) -> list:
    """Where two unpickled checkpoint objects differ: keys (and their order), types, tensors (dtype, shape,
    bytes, or for trained float tensors the positions of exact zeros, their deviation added to
    `deviations` by path, per parameter of `spans` for flat buffers), numpy arrays, plain values. `args`
    namespaces are compared separately (args_differences)."""
    deviations = {} if deviations is None else deviations
    if isinstance(ours, argparse.Namespace) and isinstance(theirs, argparse.Namespace):
        return []
    if torch.is_tensor(ours) or torch.is_tensor(theirs):
        if not (torch.is_tensor(ours) and torch.is_tensor(theirs)):
            return [f"{path}: {type(ours).__name__} vs {type(theirs).__name__}"]
        if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
            return [f"{path}: {ours.dtype}{tuple(ours.shape)} vs {theirs.dtype}{tuple(theirs.shape)}"]
        kind = trained_kind(path) if theirs.is_floating_point() else ""
        if kind:
            if spans and theirs.dim() == 1:
                deviations.update({f"{path}[{name}]": deviation(kind, ours[start:end], theirs[start:end])
                                   for name, (start, end) in spans.items()})
            else:
                deviations[path] = deviation(kind, ours, theirs)
            same_zeros = torch.equal(ours == 0, theirs == 0)
            return [] if same_zeros else [f"{path}: exact zeros (padding, untouched rows) at other positions"]
        same = torch.equal(ours.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8))
        return [] if same else [f"{path}: tensor bytes differ"]
    if isinstance(ours, dict) and isinstance(theirs, dict):
        # megatron-core's state_dict_for_save_checkpoint returns torch's OrderedDict; the fixtures hold
        # plain dicts (their pickles were rewritten to relativise paths in args): same mapping, order kept.
        if list(ours) != list(theirs):
            return [f"{path}: keys {list(ours)} vs {list(theirs)}"]
        return [d for k in ours for d in tree_differences(ours[k], theirs[k], f"{path}/{k}", deviations, spans)]
    if type(ours) is not type(theirs):
        return [f"{path}: {type(ours).__name__} vs {type(theirs).__name__}"]
    if isinstance(ours, (list, tuple)):
        if len(ours) != len(theirs):
            return [f"{path}: length {len(ours)} vs {len(theirs)}"]
        return [d for i, (a, b) in enumerate(zip(ours, theirs))
                for d in tree_differences(a, b, f"{path}[{i}]", deviations, spans)]
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


def compare_iteration_dirs(ours: Path, theirs: Path) -> tuple:
    """({relative file: exact differences}, {file + path: deviation of a trained tensor, <= 1 within
    tolerance}) over every file of both iteration directories."""
    files = sorted({p.relative_to(ours) for p in ours.rglob("*.pt")} | {p.relative_to(theirs) for p in theirs.rglob("*.pt")})
    report, deviations = {}, {}
    for rel in files:
        if not (ours / rel).exists() or not (theirs / rel).exists():
            report[str(rel)] = ["missing on one side"]
            continue
        a = torch.load(ours / rel, map_location="cpu", weights_only=False)
        b = torch.load(theirs / rel, map_location="cpu", weights_only=False)
        diffs = harness_rng_deviation(rel, a, b) if isinstance(a, dict) else []
        found = {}
        spans = flat_buffer_spans((theirs / rel).parent) if rel.name == "distrib_optim.pt" else None
        diffs += tree_differences(a, b, deviations=found, spans=spans)
        deviations.update({f"{rel}{k}": v for k, v in found.items()})
        if isinstance(a, dict) and "args" in a:
            args = args_differences(a["args"], b["args"])
            diffs += [f"args only in ours: {k}" for k in sorted(args["only_ours"] - HARNESS_ONLY_ARGS)]
            diffs += [f"args value: {k}" for k in sorted(args["differing"] - RUN_SPECIFIC_ARGS)]
        report[str(rel)] = diffs
    return report, deviations


def assert_equal_to_megatron_lm(ours: Path, theirs: Path, expected_files: int) -> dict:
    """Exact parts equal, every trained tensor within tolerance; returns the deviations."""
    report, deviations = compare_iteration_dirs(ours, theirs)
    assert len(report) == expected_files, sorted(report)
    assert all(not d for d in report.values()), {f: d[:5] for f, d in report.items() if d}
    assert deviations, "no trained tensor compared"
    beyond = {k: v for k, v in deviations.items() if not v <= 1}  # NaN included
    assert not beyond, beyond
    return deviations


@pytest.fixture(scope="module")
def fixture_a_legacy(tmp_path_factory):
    work = tmp_path_factory.mktemp("legacy_a")
    losses = train("llama", Layout(tp=2, pp=2, dp=2, sp=True), work, "train", 8,
                   ["--use-distributed-optimizer", *SAVE_AT_4_AND_5, "--save", str(work / "ckpt")])
    return work, losses


@pytest.fixture(scope="module")
def fixture_c_legacy(tmp_path_factory):
    work = tmp_path_factory.mktemp("legacy_c")
    losses = train("gpt2", Layout(tp=2, pp=2), work, "train", 8, [*SAVE_AT_4_AND_5, "--save", str(work / "ckpt")])
    return work, losses


@pytest.mark.parametrize("which", ["A", "C"])
def test_legacy_files_equal_megatron_lm(which, request, capsys):
    work, losses = request.getfixturevalue({"A": "fixture_a_legacy", "C": "fixture_c_legacy"}[which])
    fixture = FIXTURES / {"A": A, "C": C}[which] / "ckpt" / "iter_0000004"
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "5"
    expected_files = 8 if which == "A" else 4  # A: 4 (TP, PP) ranks x {model_optim_rng, distrib_optim}
    deviations = assert_equal_to_megatron_lm(work / "ckpt" / "iter_0000004", fixture, expected_files)

    # Negative control: one Adam step more (the run's own iteration 5) leaves the tolerance in every trained
    # tensor by >= 10x (measured >= 31x), so a tenth of a step's change in any one of them would fail; its
    # steps and iteration differ exactly.
    report, later = compare_iteration_dirs(work / "ckpt" / "iter_0000005", fixture)
    assert later.keys() == deviations.keys()
    closest = min(later, key=later.get)
    assert all(v > 10 for v in later.values()), {k: v for k, v in later.items() if not v > 10}
    assert all(any("/iteration: 5 vs 4" in d for d in diffs) for rel, diffs in report.items()
               if rel.endswith("model_optim_rng.pt")), report
    with capsys.disabled():
        print(f"\n[{which}] iteration 4: largest deviation {max(deviations.values()):.2e} of the tolerance; "
              f"one step more: smallest {later[closest]:.1f}x the tolerance ({closest})")


def test_other_cpu_kernels_within_tolerance(tmp_path, capsys):
    """C re-run with ATen's scalar kernels (ATEN_CPU_CAPABILITY=default: exp, GELU, softmax, norms, sums
    and matmuls round as on another CPU) is not bitwise Megatron-LM's but passes the comparison above."""
    losses = train("gpt2", Layout(tp=2, pp=2), tmp_path, "scalar_kernels", 8,
                   ["--ckpt-format", "torch", "--exit-interval", "4", "--save-interval", "4",
                    "--save", str(tmp_path / "ckpt")],
                   env={"ATEN_CPU_CAPABILITY": "default"})
    assert sorted(losses) == [1, 2, 3, 4]
    assert max_rel_diff(losses, megatron_lm_losses(C), range(1, 5)) <= FIXTURE_LOSS_TOL
    deviations = assert_equal_to_megatron_lm(tmp_path / "ckpt" / "iter_0000004",
                                             FIXTURES / C / "ckpt" / "iter_0000004", 4)
    assert sum(v > 0 for v in deviations.values()) > len(deviations) / 2, deviations  # the bytes did change
    with capsys.disabled():
        print(f"\n[C, ATEN_CPU_CAPABILITY=default] {sum(v > 0 for v in deviations.values())} of {len(deviations)} "
              f"trained tensors not bitwise; largest deviation {max(deviations.values()):.2e} of the tolerance")


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
    """C (plain Adam, tied): iterations 5..8 continue Megatron-LM's run. For A the files are Megatron-LM's
    (test above), whose resume tests/test_harness.py already checks (test_resumes_megatron_lm_checkpoint
    [A-torch]); an 8-process rerun here would add nothing."""
    work, _ = fixture_c_legacy
    resumed = train("gpt2", Layout(tp=2, pp=2), tmp_path, "resume", 8,
                    ["--load", str(work / "ckpt"), "--ckpt-step", "4"])
    theirs = megatron_lm_losses(C)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert max_rel_diff(resumed, theirs, range(5, 9)) <= FIXTURE_LOSS_TOL, (resumed, theirs)
    # Negative control: without the Adam state the curve leaves Megatron-LM's.
    no_optim = train("gpt2", Layout(tp=2, pp=2), tmp_path, "resume_no_optim", 8,
                     ["--load", str(work / "ckpt"), "--ckpt-step", "4", "--no-load-optim"])
    assert max_rel_diff(no_optim, theirs, range(5, 9)) > 1e-3, (no_optim, theirs)
