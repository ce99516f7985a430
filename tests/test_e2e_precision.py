"""bf16 and fp16 end to end through Megatron-LM 0.19's own training loop (tests/pretrain_runs.py): train,
save, to-universal, resume at another layout, compare iterations 5..12 (fp16: 5..20, where a third of the
steps overflow; always at least 8 optimizer steps) with the uninterrupted run (warmup 2 + cosine, weight
decay 0.1).

Tolerances, and what was measured here (a resume against the uninterrupted run):
- bf16: BF16_TOL = 1e-4; gpt2 TP2 DP2 + SP (distributed optimizer) -> TP1 PP2 (Float16 optimizer) 1.9e-5,
  llama PP2 (uneven, Float16 optimizer) -> TP2 (distributed optimizer) 1.0e-5. (Before the move, the same runs from scratch at other layouts
  differed by up to 2.9e-5.)
- fp16 (dynamic loss scaling, initial scale 2^20, window 3, hysteresis 2): FP16_TOL = 1e-5; gpt2 TP2 ->
  TP1 PP2 2.5e-6 with the same overflow (skipped) steps and loss scales at every iteration. A change of DP
  is not in this noise: fp16 gradients are accumulated per DP rank over its micro-batches before the
  all-reduce, so the overflow test sees other values (measured with the 0.16.1 harness, DP2 vs DP1:
  iteration 7 overflowed at DP2 only and the curves then differ by 4.3e-3). So the fp16 resume keeps DP
  (TP2 -> TP1 PP2) and also asserts the same skipped steps and scales.

Cases:
- bf16 with the distributed optimizer: GPT-2-like TP2 DP2 + SP -> TP1 PP2 with the Float16 optimizer (no
  distributed optimizer); the universal checkpoint holds the fp32 main weights (equal, bit for bit, to the
  source's fp32 mains; not bf16-representable), never the bf16 copies.
- bf16 without the distributed optimizer (Float16OptimizerWithFloat16Params), uneven source (Llama-like
  PP2, first stage 1 layer) -> TP2 with the distributed optimizer: a bf16 target rebuilt from fp32 mains.
- fp16: GPT-2-like TP2 (Float16 optimizer, scaler in the optimizer state Megatron-LM saves) -> TP1 PP2 with
  the distributed optimizer, through --universal-checkpoint (the plugin's loader.restore_run_state loads
  the scaler into Megatron-LM's optimizer) and through `from-universal` (legacy: grad_scaler in the
  optimizer state; torch_dist: the direct writer) loaded by Megatron-LM with a plain --load; the scaler
  state is in metadata.json and restored (same skipped steps and loss scales, from --log-jsonl, as the
  uninterrupted run). Negative control: the same universal checkpoint without its loss_scaler restarts the
  scaler from --initial-loss-scale and logs other scales.
"""

import json

import pytest
import torch

from pretrain_runs import BF16_TOL, DISTOPT, SAVED_AT, Layout, rel_diff

import ucp_edits
from megatron_ucp.adapters.gpt import canonical_name
from megatron_ucp.formats import open_checkpoint
from megatron_ucp.formats.common import load_pickled
from megatron_ucp.commands.from_universal import from_universal
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.universal import UniversalCheckpoint

pytestmark = pytest.mark.torchrun

FP16_TOL = 1e-5
FP16 = ["--fp16", "--initial-loss-scale", str(2 ** 20), "--loss-scale-window", "3", "--hysteresis", "2"]


def column(run, name):
    return {i: r[name] for i, r in run.records.items()}


# ------------------------------------------------------------------------------------------------
# bf16


def assert_universal_keeps_fp32_mains(ckpt_root, ucp_path) -> None:
    """Every shard's fp32 main weight in the source equals the universal checkpoint's slice bit for bit, and
    the stored weights are not bf16 values (bf16 copies would be exactly representable)."""
    ckpt, ucp = open_checkpoint(ckpt_root, iteration=SAVED_AT), UniversalCheckpoint.open(ucp_path)
    layout, config = ckpt.layout, ucp.config
    not_bf16 = total = 0
    for ref in ckpt.shards():
        name = canonical_name(ref.local_name, layout, ref.pp_rank, ref.vpp_chunk if layout.vpp else None,
                              config.num_layers, tied=config.tied, config=config)
        if name is None:
            continue
        main = ckpt.read(ref, keys=("fp32", "param"))
        assert main["param"].dtype == torch.bfloat16 and main["fp32"].dtype == torch.float32, name
        stored = ucp.read_local(name, "fp32", ref.tp_rank, layout.tp)
        assert torch.equal(stored, main["fp32"]), name
        assert ucp.parameters[name].model_dtype == "bfloat16", name
        not_bf16 += int((stored != stored.to(torch.bfloat16).float()).sum())
        total += stored.numel()
    assert not_bf16 > 0.9 * total, (not_bf16, total)


def test_bf16_distributed_optimizer_to_float16_optimizer(runs):
    family, extra = "gpt2", ["--bf16"]
    source = runs.source(family, Layout(tp=2, dp=2, sp=True), [*extra, *DISTOPT])
    ucp = runs.universal(source.save)
    assert_universal_keeps_fp32_mains(source.save, ucp)
    resumed = runs.resume(family, Layout(pp=2), ucp, extra)
    diff = rel_diff(resumed.losses, source.losses)
    print(f"bf16 {family}: {diff:.2e} (tolerance {BF16_TOL:g})")
    assert diff <= BF16_TOL, (diff, resumed.losses, source.losses)


def test_bf16_float16_optimizer_uneven_source_to_distributed_optimizer(runs):
    family, extra = "llama", ["--bf16"]
    source = runs.source(family, Layout(pp=2), [*extra, "--decoder-first-pipeline-num-layers", "1"])
    ucp = runs.universal(source.save)
    meta = json.loads((ucp / "metadata.json").read_text())
    assert meta["source"]["optimizer_kind"] == "mixed_precision"
    assert meta["source"]["layout"]["first_stage_layers"] == 1
    assert_universal_keeps_fp32_mains(source.save, ucp)
    resumed = runs.resume(family, Layout(tp=2), ucp, [*extra, *DISTOPT])
    diff = rel_diff(resumed.losses, source.losses)
    print(f"bf16 {family}: {diff:.2e} (tolerance {BF16_TOL:g})")
    assert diff <= BF16_TOL, (diff, resumed.losses, source.losses)


# ------------------------------------------------------------------------------------------------
# fp16


FP16_FAMILY, FP16_SOURCE, FP16_TARGET = "gpt2", Layout(tp=2), Layout(pp=2)
# A third or more of fp16's steps overflow with this scaler (window 3): 20 iterations give the resume >= 8 steps.
FP16_ITERS = 20
FP16_RESUMED = range(SAVED_AT + 1, FP16_ITERS + 1)


@pytest.fixture(scope="module")
def fp16_source(runs):
    source = runs.source(FP16_FAMILY, FP16_SOURCE, FP16, iters=FP16_ITERS)
    skipped = column(source, "skipped")
    assert sum(skipped.values()) >= 3 and not all(skipped[i] for i in range(1, SAVED_AT + 1))
    assert sum(not skipped[i] for i in FP16_RESUMED) >= 8, skipped  # optimizer steps after the resume
    assert len(set(column(source, "loss_scale").values())) >= 2  # overflows, back-offs and growth
    return source


def assert_fp16_continues(resumed, source) -> None:
    assert column(resumed, "skipped") == {i: column(source, "skipped")[i] for i in resumed.records}
    assert column(resumed, "loss_scale") == {i: column(source, "loss_scale")[i] for i in resumed.records}
    diff = rel_diff(resumed.losses, source.losses, FP16_RESUMED)
    assert diff <= FP16_TOL, (diff, resumed.losses, source.losses)


def test_fp16_loss_scaler_survives_the_universal_checkpoint(fp16_source, runs):
    ucp = runs.universal(fp16_source.save)
    scaler = json.loads((ucp / "metadata.json").read_text())["loss_scaler"]
    # the logged scale of an iteration is the scaler's after that step's update: what iteration 4 saved
    assert scaler["scale"] == column(fp16_source, "loss_scale")[SAVED_AT] < 2 ** 20
    assert set(scaler) == {"scale", "growth_tracker", "hysteresis_tracker"}
    resumed = runs.resume(FP16_FAMILY, FP16_TARGET, ucp, [*FP16, *DISTOPT], iters=FP16_ITERS)
    assert "fp16 loss scale" in resumed.log.read_text() and "restored" in resumed.log.read_text()
    assert_fp16_continues(resumed, fp16_source)

    # Negative control: without the stored scaler the target starts from --initial-loss-scale.
    fresh = runs.resume(FP16_FAMILY, FP16_TARGET, ucp_edits.without_loss_scaler(ucp, ucp.parent / "no_scaler"),
                        [*FP16, *DISTOPT], iters=FP16_ITERS)
    assert column(fresh, "loss_scale") != {i: column(fp16_source, "loss_scale")[i] for i in fresh.records}
    assert rel_diff(fresh.losses, fp16_source.losses, FP16_RESUMED) > FP16_TOL


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_fp16_from_universal_loads_in_megatron_core(fp16_source, runs, tmp_path, ckpt_format):
    """from-universal at TP1 PP2 with the distributed optimizer: legacy (grad_scaler in the optimizer state
    DistributedOptimizer.load_state_dict restores) and torch_dist by the direct writer (the object
    optimizer.distributed.dp_group_idx_<m>.grad_scaler, where megatron-core's dp_reshardable save keeps it; read
    back equal to the universal checkpoint's scaler); both loaded with a plain --load. The harness route's flags
    carry the scaler's settings too."""
    out = tmp_path / "megatron"
    ucp = runs.universal(fp16_source.save)
    if ckpt_format == "torch_dist":
        from megatron_ucp.formats.torch_dist.megatron_lm_writer import megatron_lm_flags_from_universal

        flags = " ".join(megatron_lm_flags_from_universal(UniversalCheckpoint.open(ucp).metadata, ParallelLayout(pp=2)))
        assert "--fp16" in flags and "--initial-loss-scale 1048576" in flags and "--hysteresis 2" in flags, flags
        assert "--loss-scale-window 3" in flags, flags
    from_universal(ucp, out, pipeline_model_parallel_size=2, use_distributed_optimizer=True, ckpt_format=ckpt_format,
                   rng_state="cpu", progress=False)
    if ckpt_format == "torch":
        state = load_pickled(out / f"iter_{SAVED_AT:07d}" / "mp_rank_00_001" / "model_optim_rng.pt", what="test")
        assert list(state["optimizer"]) == ["optimizer", "grad_scaler"]
        assert vars(state["args"])["fp16"] is True
    else:
        scaler = UniversalCheckpoint.open(ucp).loss_scaler
        assert scaler is not None and open_checkpoint(out, iteration=SAVED_AT).loss_scaler() == scaler
    resumed = runs.resume(FP16_FAMILY, FP16_TARGET, out, [*FP16, *DISTOPT], universal=False, iters=FP16_ITERS)
    assert_fp16_continues(resumed, fp16_source)
