"""`from-universal --ckpt-format torch_dist` written directly (formats/torch_dist/writer.py).

Sources (shared by the whole module, converted once): Megatron-LM 0.16.1's fixtures A (llama: GQA, SwiGLU,
RMSNorm, RoPE, untied, no biases; TP2PP2DP2+SP, distributed optimizer) at iterations 4 and 8, C (GPT-2:
tied, biases, LayerNorm, learned positions; plain Adam) at 4, and one Megatron-LM 0.19 run of GPT-2 with --bf16
(TP1PP2, 1 layer per virtual stage, distributed optimizer, saved fully_reshardable at iteration 2).

1. Megatron-LM 0.19's own `--load` (megatron-core's dist_checkpointing.load, no --universal-checkpoint; the
   0.16.1 fixtures' mock data: pretrain_runs.MOCK_DATA_016) reads the files at the target layout and continues
   Megatron-LM 0.16.1's uninterrupted run (LOSSES.txt: 7 significant digits, i.e. 7e-8 relative rounding) at
   iterations 5..8 within TOL = 1e-6 relative (the tests print the measured figure):
   A -> TP2DP2+SP dp_reshardable (4 processes); C -> TP1PP2 with VPP (1 layer per virtual stage), plain Adam;
   one fully_reshardable write of A at an uneven pipeline (PP3: embedding and loss counted as layers,
   so stages hold 1, 2, 1 layers), loaded there and at TP1PP1DP2.
2. Equal to megatron-core's own saves, `.metadata` structure (keys, global shapes, dtypes, chunk boxes)
   identical, every chunk byte for byte except the flat buckets' alignment gaps (uninitialised in
   megatron-core, zeros here) and RNG states, `verify` with atol 0:
   - A@8 -> TP2PP2DP2+SP dp_reshardable vs Megatron-LM 0.16.1's own torch_dist save of that run (fixture B@8);
   - bf16 GPT-2 at TP1PP2+VPP (megatron-core 0.19 files: the writer follows the source's release):
     fully_reshardable vs the training run's own save (every object too, the common state and RNG included:
     rng_state="source"), dp_reshardable vs Megatron-LM 0.19 saving what its plugin loaded from the universal
     checkpoint (`--via-megatron-lm`; tensors, optimizer objects and the common state's iteration, optimizer,
     scheduler and model/layout args).
   Negative control: one flipped byte of an fp32 main-weight chunk is named and fails verify.
3. Offline: the torch.save framing equals torch.save's; written at other layouts (uneven pipeline
   included, also by the legacy writer) and read back with to-universal, the universal checkpoint is
   bitwise the original; a lazy universal source gives the same bytes as its copy; a re-padded
   vocabulary; a damaged universal block (copied or read) stops the write; torchrun processes write the
   same files as one process; errors before anything is written (MoE, optimizer format, steps).
4. Memory: peak RSS growth of the writer <= 1 GiB + 3 x the largest parameter, flat as the model doubles.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from pretrain_runs import (FIXTURE_LOSS_TOL, FIXTURES, MOCK_DATA_016, REPO, Layout, max_rel_diff,
                           megatron_lm_losses, train)
from test_megatron_versions import _plain as plain_object
from test_megatron_versions import differences_from_megatron
from torch_dist_checks import (COMPARED_ARGS, _iter_dir, assert_equal_to_megatron, chunk_differences, dcp_metadata,
                               gap_chunks, load_item, structure)

from megatron_ucp.formats.pickles import MEGATRON
from megatron_ucp.commands import from_universal as fu
from megatron_ucp.convert import to_universal
from megatron_ucp.serialization import safe_pickle as sp
from megatron_ucp.formats.common import load_pickled
from megatron_ucp.serialization.torch_save import tensor_archive
from megatron_ucp.universal import UniversalCheckpoint
from megatron_ucp.commands.verify import verify
from megatron_ucp.formats.torch_dist.writer import Gap, TensorItem, plan_checkpoint

TOL = FIXTURE_LOSS_TOL  # printed digits, cross-CPU and layout noise (pretrain_runs.py)
DISTOPT = ["--use-distributed-optimizer"]
A = "A_llama_tp2pp2dp2_distopt_sp_torch"
B = "B_llama_tp2pp2dp2_distopt_sp_torch_dist"
C = "C_gpt2_tp2pp2dp1_adam_torch"
# PP3 with the embedding and the loss counted as layers: 6 / 3 = 2 per stage, so layers 1, 2, 1
UNEVEN = {"embedding_in_split": True, "loss_in_split": True}
UNEVEN_FLAGS = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
def _layout_kwargs(layout: Layout) -> dict:
    return dict(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                data_parallel_size=layout.dp, num_layers_per_virtual_pipeline_stage=layout.vpp_layers,
                sequence_parallel=layout.sp)


def _write(ucp: Path, out: Path, layout: Layout, **kwargs) -> fu.FromUniversalSummary:
    kwargs.setdefault("rng_state", "cpu")  # Megatron-LM on CPU (cpu_shims) restores CPU generator states
    return fu.from_universal(ucp, out, ckpt_format="torch_dist", progress=False, **_layout_kwargs(layout), **kwargs)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torch_dist_direct")


@pytest.fixture(scope="module")
def sources(work) -> dict:
    """Universal checkpoints of the Megatron-LM fixtures: A@4, A@8, C@4, C@8 (converted once)."""
    out = {}
    for name, iteration in ((A, 4), (A, 8), (C, 4), (C, 8)):
        out[(name, iteration)] = to_universal(FIXTURES / name / "ckpt", work / f"ucp_{name[0]}{iteration}",
                                              iteration=iteration, progress=False)
    return out


def flip_a_main_weight_byte(root: Path, summary: fu.FromUniversalSummary, ucp: Path) -> tuple:
    """Flip the high byte of the first element of one fp32 main-weight chunk; its (key, offsets)."""
    plan = plan_checkpoint(UniversalCheckpoint.open(ucp), summary.plan.target, "dp_reshardable")
    item = next(i for f in plan.files for i in f.items if isinstance(i, TensorItem) and i.key.endswith(".param")
                and not isinstance(i.pieces[0], Gap))
    iter_dir = _iter_dir(root)
    info = dcp_metadata(iter_dir).storage_data[MetadataIndex(item.key, item.offsets)]
    with open(iter_dir / info.relative_path, "r+b") as f:
        f.seek(info.offset + tensor_archive(item.sizes, item.dtype.name).data_offset + 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    return item.key, item.offsets


# ------------------------------------------------------------------------------------------------
# 1. megatron-core loads the direct writer's files and continues the run


def _resume(family: str, ckpt: Path, target: Layout, work: Path, name: str, extra=()) -> dict:
    """Iterations 5..8 from `--load ckpt` (Megatron-LM 0.19's plain torch_dist load) on the fixtures' data."""
    return train(family, target, work, name, 8, [*MOCK_DATA_016, *extra, "--load", str(ckpt)])


@pytest.mark.torchrun
@pytest.mark.parametrize("name,family,target,kwargs,flags", [
    (A, "llama", Layout(tp=2, dp=2, sp=True), dict(use_distributed_optimizer=True), DISTOPT),
    (C, "gpt2", Layout(pp=2, vpp_layers=1), {}, []),
], ids=["A-TP2DP2+SP-dp_reshardable", "C-TP1PP2VPP-plain-adam"])
def test_resume_continues_megatron_lm_run(sources, work, capsys, name, family, target, kwargs, flags):
    out = work / f"resume_{name[0]}_{target}"
    summary = _write(sources[(name, 4)], out, target, **kwargs)
    assert summary.plan.details[0] == f"optimizer state: {'dp_reshardable' if kwargs else 'adam'}"
    files = sorted(p.name for p in _iter_dir(out).glob("*.distcp"))
    assert {f.split("_")[2] for f in files} == {str(r) for r in range(target.nproc)}  # every rank writes
    resumed = _resume(family, out, target, work, f"run_{out.name}", flags)
    theirs = megatron_lm_losses(name)
    assert sorted(resumed) == [5, 6, 7, 8], resumed
    diff = max_rel_diff(resumed, theirs, range(5, 9))
    with capsys.disabled():
        print(f"\n[direct torch_dist resume] {name[:1]} -> {target}: max rel diff {diff:.1e}")
    assert diff < TOL, f"{name} -> {target}: rel diff {diff:.2e}\n{resumed}\n{theirs}"


@pytest.mark.torchrun
def test_fully_reshardable_uneven_write_loads_at_two_layouts(sources, work, capsys):
    """One fully_reshardable write of A@4 at PP3 with the embedding and loss counted (layers 1, 2, 1);
    megatron-core loads it there and reshards it at TP1PP1DP2."""
    out = work / "full_uneven"
    summary = _write(sources[(A, 4)], out, Layout(pp=3), use_distributed_optimizer=True,
                     optimizer_format="fully_reshardable", pipeline_split=UNEVEN)
    assert summary.plan.layout.describe() == "TP1PP3DP1[embedding counted, loss counted]"
    common = load_pickled(_iter_dir(out) / "common.pt", what="common.pt")
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert (common["args"].account_for_embedding_in_pipeline_split, common["args"].pipeline_model_parallel_size) \
        == (True, 3)
    theirs = megatron_lm_losses(A)
    for target, extra in ((Layout(pp=3), UNEVEN_FLAGS), (Layout(dp=2), [])):
        resumed = _resume("llama", out, target, work, f"run_full_{target}", [*DISTOPT, *extra])
        diff = max_rel_diff(resumed, theirs, range(5, 9))
        with capsys.disabled():
            print(f"\n[direct torch_dist resume] A fully_reshardable PP3 uneven -> {target}: max rel diff {diff:.1e}")
        assert diff < TOL, f"fully_reshardable -> {target}: rel diff {diff:.2e}\n{resumed}\n{theirs}"


# ------------------------------------------------------------------------------------------------
# 2. Equal to megatron-core's own saves


def test_equal_to_megatron_lms_own_save(sources, work):
    """A@8 -> TP2PP2DP2+SP dp_reshardable equals fixture B@8, Megatron-LM's torch_dist save of the same run;
    a flipped byte is named and fails verify."""
    out = work / "like_B"
    summary = _write(sources[(A, 8)], out, Layout(tp=2, pp=2, dp=2, sp=True), use_distributed_optimizer=True)
    theirs = _iter_dir(FIXTURES / B / "ckpt", 8)
    gaps = gap_chunks(summary, sources[(A, 8)])
    assert gaps  # hidden 48: parameters start at multiples of 64 elements
    assert_equal_to_megatron(_iter_dir(out), theirs, gaps)

    broken = work / "like_B_broken"
    shutil.copytree(out, broken)
    flipped = flip_a_main_weight_byte(broken, summary, sources[(A, 8)])
    assert chunk_differences(_iter_dir(broken), theirs, gaps) == [flipped]
    assert not verify(_iter_dir(broken), theirs, progress=False).equal


@pytest.fixture(scope="module")
def bf16(work) -> Path:
    """GPT-2 --bf16 trained 2 iterations by Megatron-LM 0.19 at TP1PP2, 1 layer per virtual stage, saved
    fully_reshardable."""
    train("gpt2", Layout(pp=2, vpp_layers=1), work, "bf16_source", 2,
          [*DISTOPT, "--bf16", "--dist-ckpt-optim-fully-reshardable", "--save", str(work / "bf16_ckpt"),
           "--save-interval", "2"])
    return work / "bf16_ckpt"


# Objects of a Megatron-LM save that belong to the run rather than to the checkpointed state: RNG and rerun
# states (a live run's), and the common state, compared field by field below.
RUN_OBJECTS = ("rng_state", "rerun_state_machine_state", "common_state")
COMMON_FIELDS = ("checkpoint_version", "iteration", "optimizer", "opt_param_scheduler", "content_metadata",
                 "num_floating_point_operations_so_far")


def _common_state(iter_dir: Path) -> dict:
    state = sp.load_dcp_item(sp.load_dcp_metadata(iter_dir, MEGATRON), sp.DcpIndex("common_state/shard_0_1"))
    return state[0] if isinstance(state, list) else state


def state_differences(ours: Path, theirs: Path, skip: set = frozenset()) -> list:
    """Where two megatron-core 0.19 torch_dist iteration folders of the same state, saved by different runs,
    differ: structure, tensor bytes (but `skip`), objects (but the run's own; parsed by the restricted
    unpickler), and of the common state the checkpointed fields and the args a resumed run derives its model
    and layout from."""
    if structure(ours) != structure(theirs):
        return [("structure", sorted(set(structure(ours)) ^ set(structure(theirs)))[:5])]
    found = []
    md_ours, md_theirs = sp.load_dcp_metadata(ours, MEGATRON), sp.load_dcp_metadata(theirs, MEGATRON)
    for key, entry in structure(theirs).items():
        if entry == ("bytes",):
            a, b = (plain_object(sp.load_dcp_item(md, sp.DcpIndex(key))) for md in (md_ours, md_theirs))
            if not key.startswith(RUN_OBJECTS) and repr(a) != repr(b):
                found.append(key)
            continue
        for offsets, _ in entry[2]:
            if (key, offsets) not in skip:
                a, b = load_item(ours, key, offsets), load_item(theirs, key, offsets)
                if a.dtype != b.dtype or not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                    found.append((key, offsets))
    a, b = _common_state(ours), _common_state(theirs)
    found += [f"common_state {k}" for k in COMMON_FIELDS if repr(plain_object(a.get(k))) != repr(plain_object(b.get(k)))]
    a_args, b_args = model_args(a["args"]), model_args(b["args"])
    found += [f"args.{k}" for k in COMPARED_ARGS if repr(plain_object(a_args[k])) != repr(plain_object(b_args[k]))]
    return found


def model_args(args) -> dict:
    """COMPARED_ARGS as the model reads them: num_query_groups only with group_query_attention (Megatron-LM
    sets it to the head count as a side effect of counting a trained step's FLOPs, training.py
    transformer_flops; a run that trains nothing, like the --via-megatron-lm save, keeps 0.19's default 1)."""
    values = {k: vars(args).get(k) for k in COMPARED_ARGS}
    if not vars(args).get("group_query_attention"):
        values["num_query_groups"] = None
    return values


@pytest.mark.torchrun
def test_bf16_vpp_equal_to_megatron_core_saves(bf16, work):
    """bf16 model (fp32 mains) with tied embeddings over PP2 x VPP2: fully_reshardable equals the training
    run's own save, dp_reshardable equals Megatron-LM's own save of what its plugin loaded (--via-megatron-lm)."""
    ucp = to_universal(bf16, work / "bf16_ucp", progress=False)
    target = Layout(pp=2, vpp_layers=1)
    full = _write(ucp, work / "bf16_full", target, use_distributed_optimizer=True,
                  optimizer_format="fully_reshardable", rng_state="source")
    assert differences_from_megatron(_iter_dir(work / "bf16_full"), _iter_dir(bf16)) == []
    assert full.plan.details[0] == "optimizer state: fully_reshardable"

    direct = _write(ucp, work / "bf16_dp", target, use_distributed_optimizer=True)
    harness = _write(ucp, work / "bf16_dp_harness", target, use_distributed_optimizer=True, via_megatron_lm=True,
                     timeout_s=600)
    assert harness.plan.details[0].startswith("Megatron-LM flags:")
    dtypes = {v[1] for v in structure(_iter_dir(work / "bf16_dp")).values() if v != ("bytes",)}
    assert dtypes == {torch.bfloat16, torch.float32}
    gaps = gap_chunks(direct, ucp)
    assert state_differences(_iter_dir(work / "bf16_dp"), _iter_dir(work / "bf16_dp_harness"), gaps) == []
    # negative control: one flipped byte of a main weight is named
    shutil.copytree(work / "bf16_dp", work / "bf16_dp_broken")
    flipped = flip_a_main_weight_byte(work / "bf16_dp_broken", direct, ucp)
    assert state_differences(_iter_dir(work / "bf16_dp_broken"), _iter_dir(work / "bf16_dp_harness"), gaps) == [flipped]


# ------------------------------------------------------------------------------------------------
# 3. Offline checks


def assert_universal_equal(ours: Path, theirs: Path) -> None:
    a, b = UniversalCheckpoint.open(ours), UniversalCheckpoint.open(theirs)
    assert list(a.parameters) == list(b.parameters) and a.iteration == b.iteration
    assert a.scheduler_state == b.scheduler_state and a.config == b.config
    for name, info in b.parameters.items():
        assert (a.parameters[name].tensors, a.parameters[name].step) == (info.tensors, info.step), name
        for key in info.tensors:
            assert torch.equal(a.read(name, key).view(torch.int32), b.read(name, key).view(torch.int32)), (name, key)


@pytest.mark.parametrize("name,target,kwargs", [
    (A, Layout(pp=3), dict(use_distributed_optimizer=True, pipeline_split=UNEVEN)),
    (A, Layout(pp=2, dp=2), dict(use_distributed_optimizer=True, pipeline_split={"first_stage_layers": 1})),
    (C, Layout(tp=2, pp=2), {}),
], ids=["A-PP3-embedding-loss-counted-dp_reshardable", "A-PP2DP2-first-stage-1-layer-dp_reshardable",
        "C-TP2PP2-adam"])
def test_written_and_read_back_is_the_universal_checkpoint(sources, tmp_path, name, target, kwargs):
    """A@8 / C@8 -> direct torch_dist at another layout -> to-universal: bitwise the first universal
    checkpoint (uneven pipelines: the layers each stage holds, its DDP buckets, its extra states)."""
    out = tmp_path / "megatron"
    _write(sources[(name, 8)], out, target, workers=2, **kwargs)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "8"
    assert json.loads((out / "megatron-ucp.json").read_text())["kind"] == "megatron"
    assert_universal_equal(to_universal(out, tmp_path / "back", progress=False), sources[(name, 8)])
    assert not list(tmp_path.glob("*.partial-*"))


def test_legacy_writer_takes_uneven_pipelines(sources, tmp_path):
    """--ckpt-format torch at PP2 with 1 layer on the first stage: stage 1 holds layers 1..3; read back,
    bitwise the universal checkpoint."""
    out = tmp_path / "legacy"
    fu.from_universal(sources[(A, 8)], out, pipeline_model_parallel_size=2, use_distributed_optimizer=True,
                      ckpt_format="torch", rng_state="cpu", progress=False,
                      pipeline_split={"first_stage_layers": 1})
    rank1 = load_pickled(out / "iter_0000008" / "mp_rank_00_001" / "model_optim_rng.pt", what="rank")
    assert rank1["args"].decoder_first_pipeline_num_layers == 1
    assert sorted({k.split(".")[2] for k in rank1["model"] if k.startswith("decoder.layers.")}) == ["0", "1", "2"]
    assert_universal_equal(to_universal(out, tmp_path / "back", progress=False), sources[(A, 8)])


def test_lazy_universal_source_gives_the_same_files(tmp_path):
    """From a lazy universal checkpoint (an index into Megatron-LM's fixture B) the writer reads rows through
    the index (checked against the source checksums) instead of copying file ranges; the .distcp files
    are byte for byte those written from the copied universal checkpoint (-> TP1PP2DP2, both formats)."""
    src = FIXTURES / B / "ckpt"
    lazy = to_universal(src, tmp_path / "lazy", iteration=4, lazy=True, progress=False)
    copy = to_universal(src, tmp_path / "copy", iteration=4, progress=False)
    for optimizer_format in ("dp_reshardable", "fully_reshardable"):
        outs = []
        for ucp in (lazy, copy):
            outs.append(tmp_path / f"{ucp.name}_{optimizer_format}")
            _write(ucp, outs[-1], Layout(pp=2, dp=2), use_distributed_optimizer=True,
                   optimizer_format=optimizer_format)
        names = sorted(p.name for p in _iter_dir(outs[1]).glob("*.distcp"))
        assert len(names) == 8 and names == sorted(p.name for p in _iter_dir(outs[0]).glob("*.distcp"))
        for n in names:
            assert (_iter_dir(outs[0]) / n).read_bytes() == (_iter_dir(outs[1]) / n).read_bytes(), n
        assert structure(_iter_dir(outs[0])) == structure(_iter_dir(outs[1]))


def _rewrite_metadata(ucp: Path, edit) -> None:
    meta = json.loads((ucp / "metadata.json").read_text())
    edit(meta)
    (ucp / "metadata.json").write_text(json.dumps(meta))
    (ucp / "COMPLETE").write_text(json.dumps({**json.loads((ucp / "COMPLETE").read_text()), "metadata_sha256":
                                              hashlib.sha256((ucp / "metadata.json").read_bytes()).hexdigest()}))


def test_vocabulary_is_repadded(sources, tmp_path):
    """Stored 1024 rows with make_vocab_size_divisible_by 100: Megatron-LM computes 1200 rows at TP2; the
    writer appends padding rows (weights: the mean padding row, moments: zeros), as the legacy writer."""
    ucp = tmp_path / "ucp100"
    shutil.copytree(sources[(C, 8)], ucp)

    def divisible_by_100(meta):
        meta["model_config"]["make_vocab_size_divisible_by"] = meta["args"]["make_vocab_size_divisible_by"] = 100

    _rewrite_metadata(ucp, divisible_by_100)
    warnings = []
    summary = _write(ucp, tmp_path / "megatron", Layout(tp=2), warn=warnings.append)
    assert summary.plan.padded_vocab_size == 1200 and "1024 to 1200" in warnings[0]
    back = UniversalCheckpoint.open(to_universal(tmp_path / "megatron", tmp_path / "back", progress=False))
    orig = UniversalCheckpoint.open(ucp)
    name = "embedding.word_embeddings.weight"
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert torch.equal(back.read(name, key)[:1024], orig.read(name, key)), key
    assert torch.equal(back.read(name, "exp_avg")[1024:], torch.zeros(176, 48))
    mean = orig.read(name, "fp32")[1001:].to(torch.float64).mean(0).to(torch.float32)
    assert torch.equal(back.read(name, "fp32")[1024:], mean.expand(176, 48))


@pytest.mark.parametrize("param,target,path", [
    ("decoder.layers.0.self_attention.linear_qkv.weight", Layout(), "copied"),  # dim-0 layout: a byte copy
    ("decoder.layers.0.self_attention.linear_proj.weight", Layout(tp=2), "read"),  # row-parallel: bands
], ids=["copied", "read"])
def test_damaged_universal_block_stops_the_write(sources, tmp_path, param, target, path):
    """One flipped byte in a universal tensor file: whether its bytes are copied file to file (then
    checked) or read in bands (checked first), the write fails naming the file and block, and DST and
    its staging directory are absent."""
    ucp = tmp_path / "ucp"
    shutil.copytree(sources[(A, 8)], ucp)
    info = UniversalCheckpoint.open(ucp).parameters[param]
    region = UniversalCheckpoint.open(ucp).locate(param, "exp_avg")
    with open(region.path, "r+b") as f:
        f.seek(region.offset + region.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(fu.FromUniversalError, match=rf"{info.file}: block 0 .*fails its checksum"):
        _write(ucp, tmp_path / "out", target, use_distributed_optimizer=True, optimizer_format="fully_reshardable")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ucp"]


def test_errors_before_anything_is_written(sources, tmp_path):
    ucp = sources[(C, 8)]
    with pytest.raises(fu.FromUniversalError, match="--optimizer-format fully_reshardable describes the "
                                                    "distributed optimizer"):
        _write(ucp, tmp_path / "x", Layout(), optimizer_format="fully_reshardable")
    with pytest.raises(fu.FromUniversalError, match="--optimizer-format does not apply to --ckpt-format torch"):
        fu.from_universal(ucp, tmp_path / "x", ckpt_format="torch", optimizer_format="dp_reshardable",
                          use_distributed_optimizer=True, progress=False)
    with pytest.raises(fu.FromUniversalError, match="--via-megatron-lm writes torch_dist"):
        fu.from_universal(ucp, tmp_path / "x", ckpt_format="torch", via_megatron_lm=True, progress=False)
    with pytest.raises(fu.FromUniversalError, match="num_layers=4 is not divisible by PP x VPP = 3"):
        _write(ucp, tmp_path / "x", Layout(pp=3))
    with pytest.raises(fu.FromUniversalError, match="give the virtual pipeline size as "
                                                    "--num-virtual-stages-per-pipeline-rank"):
        _write(ucp, tmp_path / "x", Layout(pp=2, vpp_layers=1), pipeline_split={"first_stage_layers": 1})
    steps = tmp_path / "steps"  # parameters with different Adam steps cannot be torch_dist
    shutil.copytree(ucp, steps)
    _rewrite_metadata(steps, lambda meta: next(iter(meta["parameters"].values())).update(step=7))
    with pytest.raises(fu.FromUniversalError, match=r"different Adam steps \[7, 8\].*write --ckpt-format torch"):
        _write(steps, tmp_path / "x", Layout())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps"]


def test_plan_takes_uneven_pipelines(sources):
    """`megatron-ucp plan` with Megatron-LM's uneven-split flags: PP3 with the embedding and loss counted
    holds layers [0], [1, 2], [3]; a first stage that leaves the other stages no layer is refused."""
    from megatron_ucp.commands.plan import Target, make_plan

    plan = make_plan(sources[(A, 8)], Target(tp=1, pp=3, dp=1, embedding_in_split=True, loss_in_split=True,
                                            use_distributed_optimizer=True))
    assert plan["compatible"] and plan["target"]["layout"]["embedding_in_split"]
    assert [sorted({int(n.split(".")[2]) for n in s["parameters"] if n.startswith("decoder.layers.")})
            for s in plan["stages"]] == [[0], [1, 2], [3]]
    plan = make_plan(sources[(A, 8)], Target(tp=1, pp=2, dp=1, first_stage_layers=4))
    assert not plan["compatible"] and "first stage 4 layers: 0 layers left" in plan["problems"][0]


def test_dry_run_lists_every_file(sources, tmp_path):
    summary = _write(sources[(C, 8)], tmp_path / "x", Layout(pp=2), dry_run=True)
    assert [p for p, _ in summary.plan.files] == [
        "iter_0000008/__0_0.distcp", "iter_0000008/__0_1.distcp", "iter_0000008/__1_0.distcp",
        "iter_0000008/__1_1.distcp", "iter_0000008/.metadata", "iter_0000008/common.pt",
        "iter_0000008/metadata.json", "latest_checkpointed_iteration.txt"]
    assert summary.plan.details[0] == "optimizer state: adam" and not (tmp_path / "x").exists()


def test_metadata_is_dcps_own_objects_written_without_importing_dcp(sources, tmp_path):
    """.metadata is pickled from references to DCP's classes (the writer never imports
    torch.distributed.checkpoint: ~0.7 s of every write): unpickled by torch it is DCP's own Metadata, every
    entry of DCP's types, found by a fresh MetadataIndex; the CLI process never imported DCP."""
    import pickle

    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       StorageMeta, TensorProperties)

    child = ("import runpy, sys; sys.argv = ['megatron-ucp', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('megatron_ucp.cli', run_name='__main__')\n"
             "finally:\n    print('DCP imported:', 'torch.distributed.checkpoint' in sys.modules)")
    out = tmp_path / "x"
    proc = subprocess.run([sys.executable, "-c", child, "from-universal", str(sources[(A, 8)]), str(out), "-p", "2",
                           "-d", "2", "--use-distributed-optimizer", "--ckpt-format", "torch_dist", "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DCP imported: False" in proc.stdout, proc.stdout
    with open(_iter_dir(out) / ".metadata", "rb") as f:
        md = pickle.load(f)
    assert type(md) is Metadata and md.version == CURRENT_DCP_VERSION and md.planner_data is None
    assert type(md.storage_meta) is StorageMeta and md.storage_meta.checkpoint_id == "iter_0000008"
    tensors = [v for v in md.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata)]
    assert tensors and all(isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
                           for v in md.state_dict_metadata.values())
    for value in tensors:
        assert type(value.properties) is TensorProperties and isinstance(value.properties.dtype, torch.dtype)
        assert value.properties.memory_format == torch.contiguous_format and type(value.size) is torch.Size
        assert all(type(c) is ChunkStorageMetadata and type(c.offsets) is torch.Size for c in value.chunks)
    assert all(type(info) is _StorageInfo for info in md.storage_data.values())
    key, value = next((k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    assert md.storage_data[MetadataIndex(key, value.chunks[0].offsets)].relative_path.endswith(".distcp")


@pytest.mark.torchrun
def test_torchrun_processes_split_the_files(sources, tmp_path):
    """2 torchrun processes write the same .distcp files, byte for byte, and the same .metadata chunks as
    one process (A -> TP1PP2DP2, dp_reshardable)."""
    flags = ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2", "--use-distributed-optimizer",
             "--ckpt-format", "torch_dist", "--rng-state", "cpu", "--quiet", "--json"]
    single, split = tmp_path / "single", tmp_path / "split"
    _write(sources[(A, 8)], single, Layout(pp=2, dp=2), use_distributed_optimizer=True)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "megatron_ucp.cli", "from-universal", str(sources[(A, 8)]), str(split), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # one JSON result per process; the two processes share the pipe, so their lines may interleave
    results, text, decoder = [], proc.stdout, json.JSONDecoder()
    while "{" in text:
        obj, end = decoder.raw_decode(text, text.index("{"))
        results.append(obj)
        text = text[end:]
    assert len(results) == 2, proc.stdout
    names = sorted(p.name for p in _iter_dir(single).glob("*.distcp"))
    assert names == sorted(p.name for p in _iter_dir(split).glob("*.distcp")) and len(names) == 8
    for n in names:
        assert (_iter_dir(single) / n).read_bytes() == (_iter_dir(split) / n).read_bytes(), n
    assert structure(_iter_dir(single)) == structure(_iter_dir(split))
    assert json.loads((split / "megatron-ucp.json").read_text())["kind"] == "megatron"
    assert not list(tmp_path.glob("*.partial-*")) and not list(tmp_path.glob(".*.lock"))


# ------------------------------------------------------------------------------------------------
# 4. Memory: bounded by a few bands, flat in the model size

MIB, GIB = 2 ** 20, 2 ** 30


def _fabricate(dst: Path, num_layers: int, num_experts=None, hidden: int = 512) -> Path:
    """A universal checkpoint of a llama-like bf16 model (random weights and moments), without training."""
    from megatron_ucp.adapters.gpt import expected_parameters, pattern_for
    from megatron_ucp.core.layout import ParallelLayout
    from megatron_ucp.core.model_config import GPTModelConfig
    from megatron_ucp.universal import UniversalWriter

    config = GPTModelConfig(num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                            num_attention_heads=8, num_query_groups=4, kv_channels=hidden // 8, vocab_size=8000,
                            padded_vocab_size=8192,
                            make_vocab_size_divisible_by=128, max_position_embeddings=64, swiglu=True,
                            normalization="RMSNorm", position_embedding_type="rope",
                            untie_embeddings_and_output_weights=True, add_bias_linear=False,
                            num_experts=num_experts, moe_ffn_hidden_size=64 if num_experts else None)
    with UniversalWriter(dst) as writer:
        for seed, (name, shape) in enumerate(expected_parameters(config)):
            g = torch.Generator().manual_seed(seed)
            tensors = {"fp32": torch.randn(shape, generator=g), "exp_avg": torch.randn(shape, generator=g),
                       "exp_avg_sq": torch.rand(shape, generator=g)}
            # Megatron's groups: weight decay for >= 2-D weights (group 0), none for 1-D (group 1)
            writer.write_parameter(name, tensors, {"model_dtype": "bfloat16", "pattern": pattern_for(name, config),
                                                   "step": 3, "param_group": {"index": int(len(shape) == 1)}})
        return writer.finish({
            "iteration": 3, "consumed_train_samples": 24, "model_config": config.to_dict(),
            "args": {"micro_batch_size": 1, "global_batch_size": 8, "bf16": True, "seed": 1234},
            "source": {"format": "torch_dist", "path": "/nowhere", "layout": ParallelLayout().to_dict(),
                       "optimizer_kind": "distributed"},
            "optimizer": {"type": "adam", "param_groups": [{"wd_mult": 1.0, "lr": 1e-3, "weight_decay": 0.1},
                                                           {"wd_mult": 0.0, "lr": 1e-3, "weight_decay": 0.0}]},
            "scheduler": {}}, expected_parameters(config))


# Peak RSS is VmHWM, reset to the current RSS just before writing (as tests/test_performance_properties.py).
WRITE_CHILD = r"""
import json, sys
from megatron_ucp.commands import from_universal as fu

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

kwargs = dict(tensor_model_parallel_size=2, data_parallel_size=2, use_distributed_optimizer=True,
              ckpt_format="torch_dist", workers=1, progress=False)
fu.from_universal(sys.argv[1], sys.argv[2] + "_warm", **kwargs)  # imports, first-use allocations
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
baseline = status("VmRSS")
fu.from_universal(sys.argv[1], sys.argv[2], **kwargs)
print(json.dumps({"baseline": baseline, "peak": status("VmHWM")}))
"""


def test_write_memory_is_bounded_and_flat(tmp_path, capsys):
    """Peak RSS growth of the direct writer (TP2 DP2, dp_reshardable, bf16 model: copies, row-parallel bands
    and casts; one writer thread, so the peak does not depend on how threads interleave) is at most
    1 GiB + 3 x the largest parameter (all states), and flat (within 20% or 16 MiB) when the model doubles
    from 4 to 8 layers (+45 MiB of universal checkpoint). The child runs with a fixed glibc mmap threshold
    (1 MiB): with glibc's dynamic one, whether a freed 8 MiB band is reused from the heap or mapped afresh
    varied run to run (peaks of 21.8 or 38.6 MiB for the same write); fixed, the peak measured 38.0 +- 0.1 MiB
    in 12 runs."""
    growth, largest = {}, {}
    for layers in (4, 8):
        ucp = _fabricate(tmp_path / f"ucp{layers}", layers, hidden=256)
        u = UniversalCheckpoint.open(ucp)
        largest[layers] = max(torch.Size(p.shape).numel() * 4 * len(p.tensors) for p in u.parameters.values())
        proc = subprocess.run([sys.executable, "-c", WRITE_CHILD, str(ucp), str(tmp_path / f"out{layers}")],
                              cwd=REPO, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        growth[layers] = result["peak"] - result["baseline"]
        written = sum(f.stat().st_size for f in (tmp_path / f"out{layers}").rglob("*") if f.is_file())
        with capsys.disabled():
            print(f"\n[torch_dist direct write memory] {layers} layers: universal {u.total_bytes() / MIB:.0f} MiB, "
                  f"written {written / MIB:.0f} MiB, largest parameter {largest[layers] / MIB:.0f} MiB (all states), "
                  f"peak RSS growth {growth[layers] / MIB:.1f} MiB")
        assert growth[layers] <= GIB + 3 * largest[layers]
        shutil.rmtree(tmp_path / f"out{layers}_warm")
    assert largest[4] == largest[8]
    assert abs(growth[8] - growth[4]) <= max(0.2 * growth[4], 16 * MIB), growth


# ------------------------------------------------------------------------------------------------
# 5. The TP ranks' files of a stage are written together: each band of a row-parallel weight is read once


@pytest.mark.parametrize("optimizer", ["fully_reshardable", "dp_reshardable"])
def test_tp_slices_of_a_band_are_read_once_for_all_tp_ranks(tmp_path, monkeypatch, optimizer):
    """At TP4 a row-parallel weight's shards are column slices of the same stored rows. Written by units
    (share_units: files whose pieces read the same rows, at most a TP group's 4), each band of those rows is
    mapped and checked once per unit holding its slices; written one file at a time (write_file, the negative
    control: what the writer did before) once per file. Counted exactly for linear_fc2 (one band per tensor at
    this size), and the files are the same bytes either way (bf16 weights cast from the band, fp32 optimizer
    state sliced from it)."""
    from megatron_ucp.formats.torch_dist import writer as tdw
    from megatron_ucp.formats.universal_pieces import Piece, Sources, shared_rows_key

    ucp_path = _fabricate(tmp_path / "ucp", 2, hidden=256)
    summary = _write(ucp_path, tmp_path / "units", Layout(tp=4, dp=2), use_distributed_optimizer=True,
                     optimizer_format=optimizer, workers=1)
    ucp = UniversalCheckpoint.open(ucp_path)
    plan = plan_checkpoint(ucp, summary.plan.target, optimizer)
    units = tdw.share_units(ucp, plan.files)
    assert max(len(u) for u in units) == 4 and sum(len(u) for u in units) == len(plan.files) == 16
    unit_of = {f.name: i for i, u in enumerate(units) for f in u}
    row_parallel = "decoder.layers.0.mlp.linear_fc2.weight"
    spread: dict = {}  # shared-rows key of row_parallel's pieces -> the files holding one
    for f in plan.files:
        for item in f.items:
            for piece in getattr(item, "pieces", ()):
                if isinstance(piece, Piece) and piece.name == row_parallel:
                    key = shared_rows_key(ucp.parameters[piece.name].shape, piece, item.dtype)
                    if key is not None:
                        spread.setdefault(key, []).append(f.name)
    expected = {"units": sum(len({unit_of[n] for n in names}) for names in spread.values()),
                "files": sum(len(names) for names in spread.values())}
    assert expected["files"] >= 2 * expected["units"], expected  # the sharing is there to be seen

    reads: list = []
    original = UniversalCheckpoint.read_view

    def counting(self, name, key="fp32", index=None):
        reads.append(name)
        return original(self, name, key, index)

    monkeypatch.setattr(UniversalCheckpoint, "read_view", counting)
    config = replace(ucp.config, padded_vocab_size=plan.padded_vocab_size)
    counts = {}
    for mode in ("units", "files"):
        reads.clear()
        out = tmp_path / f"again_{mode}" / _iter_dir(tmp_path / "units").name
        out.mkdir(parents=True)
        sources = Sources(ucp, config)
        try:
            for unit in units:
                if mode == "units":
                    tdw.write_unit(sources, out, unit)
                else:
                    for f in unit:
                        tdw.write_file(sources, out, f)
        finally:
            sources.close()
        counts[mode] = reads.count(row_parallel)
        for f in plan.files:
            assert (out / f.name).read_bytes() == (_iter_dir(tmp_path / "units") / f.name).read_bytes(), (mode, f.name)
    assert counts == expected
