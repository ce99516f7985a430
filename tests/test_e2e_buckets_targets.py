"""Many DDP buckets and targets never run before, end to end through Megatron-LM 0.19's own training loop
(tests/pretrain_runs.py): train, save, to-universal, resume at another layout, compare iterations 5..12
(8 optimizer steps) with the uninterrupted run.

Source (trained once per session): Llama-like fp32, TP2 DP2 + SP, distributed optimizer with
--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 4000 (9 buckets per rank), warmup 2 +
cosine, weight decay 0.1 (pretrain_runs.SCHEDULE), saved at iteration 4 by megatron-core itself twice:
as torch_dist (dp_reshardable: one flat tensor per bucket) and as legacy torch (distrib_optim.pt, buckets
coalesced; the same run stopped at 4).

Tolerance: FP32_TOL = 1e-6 relative on the lm loss; measured here, the resumes below differ from the
uninterrupted run by at most 1.4e-7 (the uneven one: 0, bit for bit). The partial negative controls in
test_e2e_negative_controls.py show that planted bugs leave this tolerance.

Targets:
- TP1 PP2 DP2 with an uneven split (--decoder-first-pipeline-num-layers 3: 3 + 1 layers), distributed
  optimizer with one bucket per buffer (a different bucket count), through --universal-checkpoint, and
  through `from-universal --ckpt-format torch` loaded by megatron-core with a plain --load (and read back by
  the legacy reader: the same tensors bit for bit); `plan` at that layout lists the uneven stages and
  predicts exactly the bytes the loader reported reading;
- TP1 PP1 DP1 with plain Adam (no distributed optimizer);
- TP1 PP2 (VPP: 1 layer per virtual stage) DP1;
- from the legacy source: TP2 DP1 + SP with --ddp-bucket-size 2500 (another bucket count), and a lazy
  universal checkpoint (an index into the legacy files) at TP1 DP2.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pretrain_runs import (DISTOPT, FP32_TOL, OVERLAP, SAVED_AT, SCHEDULE, SOURCE_ITERS, Layout, rel_diff)

from megatron_ucp.formats.pickles import MEGATRON
from megatron_ucp.adapters.gpt import parameters_for_rank
from megatron_ucp.convert import to_universal
from megatron_ucp.formats.bucket_layout import BufferParam, DDPBucketConfig, build_chunk_buffers
from megatron_ucp.formats.common import layout_from_args, load_pickled
from megatron_ucp.serialization.safe_pickle import load_dcp_metadata
from megatron_ucp.commands.from_universal import from_universal
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.commands.plan import Target, make_plan
from megatron_ucp.universal import UniversalCheckpoint

pytestmark = pytest.mark.torchrun

FAMILY = "llama"
SOURCE_LAYOUT = Layout(tp=2, dp=2, sp=True)
BUCKETED = [*OVERLAP, "--ddp-bucket-size", "4000"]
UNEVEN = ["--decoder-first-pipeline-num-layers", "3"]
UNEVEN_LAYOUT = Layout(pp=2, dp=2)


@pytest.fixture(scope="module")
def source(runs):
    return runs.source(FAMILY, SOURCE_LAYOUT, BUCKETED)


@pytest.fixture(scope="module")
def legacy_source(runs):
    """The same run, saved by megatron-core's legacy path at iteration 4 (and stopped there)."""
    return runs.run(FAMILY, SOURCE_LAYOUT, SOURCE_ITERS,
                    [*SCHEDULE, *BUCKETED, "--save-interval", str(SAVED_AT), "--exit-interval", str(SAVED_AT),
                     "--ckpt-format", "torch"], save=True)


def bucket_count(args: dict, rank_params) -> int:
    """Buckets megatron-core's DDP gives PP rank 0's first buffer for these args (bucket_layout.py, checked
    against live buffers in test_ddp_buckets.py)."""
    config = DDPBucketConfig.from_megatron_args(args, layout_from_args(args), pp_rank=0, vpp_chunk=0,
                                                rank_num_parameters=sum(p.numel for p in rank_params))
    return len(build_chunk_buffers(rank_params, config)[0].buckets)


def test_source_has_many_buckets_in_both_formats(source, legacy_source, runs):
    saved = load_dcp_metadata(source.save / f"iter_{SAVED_AT:07d}", MEGATRON).state_dict_metadata
    buckets = {int(m.group(1)) for k in saved
               for m in [re.match(r"optimizer\.distributed\.dp_group_idx_0\.gbuf_idx_0\..*bucket_idx_(\d+)\.param$", k)]
               if m}
    assert len(buckets) >= 5, sorted(buckets)  # torch_dist: one flat tensor per bucket
    assert legacy_source.losses == {i: source.losses[i] for i in range(1, SAVED_AT + 1)}  # same run, bitwise
    # legacy distrib_optim.pt: the buckets are coalesced; the reader places parameters with the 9-bucket layout,
    # and the consolidated tensors equal the torch_dist source's bit for bit.
    a, b = runs.universal(source.save), runs.universal(legacy_source.save)
    meta_a = json.loads((a / "metadata.json").read_text())
    meta_b = json.loads((b / "metadata.json").read_text())
    assert meta_a["parameters"].keys() == meta_b["parameters"].keys()
    for name, info in meta_a["parameters"].items():
        with safe_open(a / info["file"], "pt") as x, safe_open(b / meta_b["parameters"][name]["file"], "pt") as y:
            assert set(x.keys()) == set(y.keys()) == {"fp32", "exp_avg", "exp_avg_sq"}, name
            for key in x.keys():
                assert torch.equal(x.get_tensor(key), y.get_tensor(key)), (name, key)
        assert info["step"] == meta_b["parameters"][name]["step"] == SAVED_AT, name
    assert meta_a["scheduler"] == meta_b["scheduler"] and meta_a["scheduler"]["num_steps"] == SAVED_AT * 8
    assert meta_a["loss_scaler"] is None and meta_a["rng"]["layout"] == meta_b["rng"]["layout"]


def _loaded_bytes(log: Path) -> int:
    found = re.findall(r"all ranks read (\d+) bytes of tensors", log.read_text())
    assert len(found) == 1, log
    return int(found[0])


def test_uneven_target_with_another_bucket_count(source, runs):
    """TP2 DP2 + SP, 9 buckets -> TP1 PP2 DP2, first stage 3 layers, last 1, one bucket per buffer."""
    ucp = runs.universal(source.save)
    resumed = runs.resume(FAMILY, UNEVEN_LAYOUT, ucp, [*DISTOPT, *UNEVEN])
    # the loader walked the stages Megatron-LM built from --decoder-first-pipeline-num-layers 3
    assert "at TP1PP2DP2[first stage 3 layers]; all ranks read" in resumed.log.read_text()
    assert sorted(resumed.losses) == list(range(SAVED_AT + 1, SOURCE_ITERS + 1))
    diff = rel_diff(resumed.losses, source.losses)
    assert diff <= FP32_TOL, (diff, resumed.losses, source.losses)

    # `plan` at that layout: the uneven stages, and exactly the bytes the loader read.
    plan = make_plan(ucp, Target(tp=1, pp=2, dp=2, use_distributed_optimizer=True, first_stage_layers=3))
    assert plan["compatible"], plan["problems"]
    layers = [sorted({int(m) for n in s["parameters"] for m in re.findall(r"decoder\.layers\.(\d+)\.", n)})
              for s in plan["stages"]]
    assert layers == [[0, 1, 2], [3]]
    assert plan["totals"]["read_bytes"] == _loaded_bytes(resumed.log)


def test_from_universal_legacy_at_the_uneven_layout_loads_in_megatron_core(source, runs, tmp_path):
    """from-universal --ckpt-format torch at TP1 PP2 DP2 (first stage 3 layers), distributed optimizer; the
    run loads it with a plain --load (Megatron-LM's load_checkpoint, megatron-core's load_parameter_state)
    and continues."""
    out = tmp_path / "megatron"
    from_universal(runs.universal(source.save), out, pipeline_model_parallel_size=2, data_parallel_size=2,
                   use_distributed_optimizer=True, ckpt_format="torch", rng_state="cpu", progress=False,
                   pipeline_split={"first_stage_layers": 3})
    rank_dirs = sorted(p.name for p in (out / f"iter_{SAVED_AT:07d}").iterdir())
    assert rank_dirs == ["mp_rank_00_000", "mp_rank_00_001"]
    first = load_pickled(out / f"iter_{SAVED_AT:07d}" / "mp_rank_00_000" / "model_optim_rng.pt", what="test")
    assert vars(first["args"])["decoder_first_pipeline_num_layers"] == 3
    assert sorted({int(k.split(".")[2]) for k in first["model"] if k.startswith("decoder.layers.")}) == [0, 1, 2]
    # the legacy reader places the uneven stages' parameters back exactly
    back = UniversalCheckpoint.open(to_universal(out, tmp_path / "back", progress=False))
    original = UniversalCheckpoint.open(runs.universal(source.save))
    assert back.source_layout.first_stage_layers == 3 and list(back.parameters) == list(original.parameters)
    for name, info in original.parameters.items():
        assert back.parameters[name].step == info.step, name
        for key in info.tensors:
            assert torch.equal(back.read(name, key), original.read(name, key)), (name, key)
    resumed = runs.resume(FAMILY, UNEVEN_LAYOUT, out, [*DISTOPT, *UNEVEN], universal=False)
    diff = rel_diff(resumed.losses, source.losses)
    assert diff <= FP32_TOL, (diff, resumed.losses, source.losses)


@pytest.mark.parametrize("layout,extra,what", [
    (Layout(), [], "TP1 PP1 DP1, plain Adam (no distributed optimizer)"),
    (Layout(pp=2, vpp_layers=1), DISTOPT, "TP1 PP2 DP1, VPP (2 virtual stages per rank)"),
], ids=["plain-adam", "vpp"])
def test_targets_never_run_before(source, runs, layout, extra, what):
    resumed = runs.resume(FAMILY, layout, runs.universal(source.save), extra)
    diff = rel_diff(resumed.losses, source.losses)
    assert diff <= FP32_TOL, (what, diff, resumed.losses, source.losses)


def test_legacy_many_buckets_resume_with_another_bucket_count(source, legacy_source, runs):
    """Legacy distrib_optim.pt (9 coalesced buckets per rank) -> TP2 DP1 + SP, --ddp-bucket-size 2500."""
    target = Layout(tp=2, sp=True)
    extra = [*OVERLAP, "--ddp-bucket-size", "2500"]
    ucp = runs.universal(legacy_source.save)
    config = UniversalCheckpoint.open(ucp).config
    args = json.loads((ucp / "metadata.json").read_text())["args"]

    def buckets(layout, size):
        params = [BufferParam(local, tuple(shape), torch.float32)
                  for local, shape, _ in parameters_for_rank(config, layout, 0, None)]
        return bucket_count({**args, "data_parallel_size": layout.dp, "world_size": layout.world_size,
                             "ddp_bucket_size": size}, params)

    at_source = buckets(ParallelLayout(tp=2, dp=2, sp=True), 4000)
    at_target = buckets(ParallelLayout(tp=2, sp=True), 2500)
    assert at_source >= 5 and at_target >= 5 and at_target != at_source, (at_source, at_target)
    resumed = runs.resume(FAMILY, target, ucp, extra)
    diff = rel_diff(resumed.losses, source.losses)
    assert diff <= FP32_TOL, (diff, resumed.losses, source.losses)


def test_lazy_checkpoint_of_a_legacy_source(source, legacy_source, runs):
    """to-universal --lazy of the legacy files (no tensor copies) resumes at TP1 DP2."""
    lazy = runs.universal(legacy_source.save, lazy=True)
    assert not (lazy / "tensors").exists() and json.loads((lazy / "metadata.json").read_text())["lazy"]
    resumed = runs.resume(FAMILY, Layout(dp=2), lazy, DISTOPT)
    diff = rel_diff(resumed.losses, source.losses)
    assert diff <= FP32_TOL, (diff, resumed.losses, source.losses)
