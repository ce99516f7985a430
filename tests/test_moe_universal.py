"""GPT-MoE universal checkpoints end to end, on Megatron-LM 0.19's own training loop: train a source once
(12 iterations, saving at 4), convert iteration 4, resume at another EP x ETP x TP x PP x DP (x VPP) layout
with --universal-checkpoint, and compare iterations 5..12 (8 optimizer steps) with the source's
uninterrupted run (warmup 2 + cosine decay, weight decay 0.1: pretrain_runs.SCHEDULE).

Tolerance: 1e-6 relative on the lm loss and on the router's load-balancing loss (fp32, dropout 0; measured on
Megatron-LM 0.19: <= 1.4e-7 on the lm loss, <= 2.4e-7 on the aux loss: the same math in another reduction
order, and with either token dispatcher: the sources use allgather, two targets alltoall). Negative controls
(each test names its own): the same check against a universal checkpoint with one kind of state damaged (the
routed experts' Adam moments zeroed, two experts swapped, MoE layers 1 and 3 swapped, the experts' SwiGLU fc1
rows in a plain row split, the router's expert_bias zeroed) or loaded without
optimizer state must fail it by far (> 1e-4 on the lm loss or the load-balancing loss unless said, measured in
the comments), and every curve must fail it against the source's curve shifted by one iteration (a resume
that replays the wrong batches).

Sources: pretrain_runs.MOE_SOURCES (llama_moe: MoE layers 1 and 3 of 4 mixed with dense ones, 4 experts
top-2, a shared expert; gpt2_moe: biased experts and router, GELU, tied embeddings), trained once per session
through the `runs` cache (tests/test_moe_harness.py reuses them):
- ep2dp4: llama_moe at EP2 DP4 (expert-DP 2), distributed optimizer, torch_dist dp_reshardable;
- ep1: llama_moe at EP1 (the experts in the dense optimizer), distributed optimizer;
- tp2etp1ep2: llama_moe at TP2 SP ETP1 EP2 (experts over the TP ranks), distributed optimizer;
- adam_allmoe: gpt2_moe with every layer MoE (--moe-layer-freq 1: torch_dist stacks layers on a leading
  axis before the expert axis), EP2 DP2, plain Adam (no distributed optimizer);
- legacy_bias: llama_moe with a sigmoid router, its expert_bias buffer and a gated shared expert, EP2 DP2,
  distributed optimizer, saved in Megatron-LM's legacy format (--ckpt-format torch);
- ep2_fp16: llama_moe at EP2 DP2 with --fp16 (dynamic loss scaling), distributed optimizer (only written
  again by from-universal and compared with megatron-core's save; not resumed).
Biased experts are resumed at TP1 only: under TP2 (MoE needs sequence parallelism there) at ETP1, megatron-core
0.19.2 marks each expert fc2 bias `sequence_parallel` and finalize_model_grads sums its gradient over the dense
TP group, i.e. over other experts (EP2) or a replica (EP1). A resume of adam_allmoe at TP2 SP EP2 ETP1
reproduced iteration 5 (6.9e-8: the state is loaded right), then its grad norm was 1.472 where TP1's is 1.256
and the curve left by 1.8e-4 (measured). The retired 0.16.1 harness patched this in its own loop; Megatron-LM
0.19 on its own does not. At EP1 ETP1 biased experts cannot train at all on Megatron-LM 0.19 (local spec): the
expert MLP adds fc2's bias in place into the view a one-rank all-reduce Function returns, and autograd refuses;
so biased experts are resumed at EP2 (the retired harness patched this too).
from-universal --ckpt-format torch_dist is written directly (no training process) and compared with
megatron-core's own save of the same layout (the --via-megatron-lm route): EP4 DP4 chained dp_reshardable, EP1
dp_reshardable, plain Adam with stacked MoE layers, fp16 dp_reshardable; three writes are loaded by
Megatron-LM's own --load and continue the run (legacy EP4, torch_dist EP4 dp_reshardable, fully_reshardable
written at TP2 ETP1 EP2 and loaded at EP4).
"""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from pretrain_runs import DISTOPT, MOE_SOURCES, SAVED_AT, SOURCE_ITERS, Layout, Trained
from torch_dist_checks import assert_equal_to_megatron, gap_chunks, structure

from megatron_ucp.adapters import gpt
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.universal import UniversalCheckpoint, UniversalWriter

pytestmark = pytest.mark.torchrun

TOL = 1e-6
RESUMED = range(SAVED_AT + 1, SOURCE_ITERS + 1)
BROKEN = 1e-4  # a damaged state leaves the curve by more than this (100x the tolerance)
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]  # the sources use Megatron-LM's default, allgather


def rel_diff(a: dict, b: dict, key: str = "lm_loss", shift: int = 0) -> float:
    """Largest relative difference of `key` over the resumed iterations (b read `shift` iterations later)."""
    return max(abs(a[i][key] - b[i + shift][key]) / abs(b[i + shift][key]) for i in RESUMED if i + shift in b)


def leaves(broken: Trained, src: "Source") -> float:
    """How far a negative control leaves the source's curve on what check_continues compares: the larger
    relative difference of the lm loss and the load-balancing loss."""
    return max(rel_diff(broken.records, src.records, key) for key in ("lm_loss", "load_balancing_loss"))


class Source:
    """One of pretrain_runs.MOE_SOURCES, trained and converted at iteration SAVED_AT (cached by `runs`)."""

    def __init__(self, runs, name: str):
        self.family, self.layout, model_flags, flags = MOE_SOURCES[name]
        self.model_flags = list(model_flags)  # repeated on every resume (SCHEDULE is added by `runs`)
        self.name, self.runs = name, runs
        self.trained = runs.source(self.family, self.layout, [*model_flags, *flags])
        self.records, self.work = self.trained.records, self.trained.work
        self.ucp = runs.universal(self.trained.save)

    def resume(self, target: Layout, extra=(), ucp=None, universal: bool = True) -> Trained:
        """Iterations 5..12 at `target` from `ucp` (default: this source's universal checkpoint), with the
        distributed optimizer; `universal=False`: Megatron-LM's own --load."""
        return self.runs.resume(self.family, target, ucp or self.ucp, [*self.model_flags, *DISTOPT, *extra],
                                universal=universal)

    def check_continues(self, resumed: Trained, what: str) -> None:
        records = resumed.records
        assert sorted(records) == list(RESUMED), records
        for key in ("lm_loss", "load_balancing_loss"):
            diff = rel_diff(records, self.records, key)
            assert diff < TOL, f"{self.name} -> {what}: {key} rel diff {diff:.2e}"
        # negative control: the same check fails against the curve one iteration later (wrong batches)
        assert rel_diff(records, self.records, shift=1) > BROKEN

    def edited(self, what: str, edit) -> Path:
        """This source's universal checkpoint with `edit` applied (written once per session)."""
        dst = self.work / f"ucp_{what}"
        return dst if dst.exists() else edited_copy(Path(self.ucp), dst, edit)


@pytest.fixture(scope="module")
def sources(runs):
    return lambda name: Source(runs, name)


def bytes_read(run: Trained) -> int:
    """What the loader reports all ranks read of the universal checkpoint's tensors."""
    return int(re.search(r"all ranks read (\d+) bytes", run.log.read_text()).group(1))


def edited_copy(src: Path, dst: Path, edit) -> Path:
    """A universal checkpoint equal to `src` except for the tensors `edit(name, key, tensor)` returns changed
    (None: unchanged); written through UniversalWriter, so it is a valid checkpoint with fresh checksums."""
    ucp = UniversalCheckpoint.open(src)
    with UniversalWriter(dst) as writer:
        for name, info in ucp.parameters.items():
            tensors = {}
            for key in info.tensors:
                tensor = ucp.read(name, key)
                changed = edit(name, key, tensor)
                tensors[key] = tensor if changed is None else changed
            writer.write_parameter(name, tensors, {"model_dtype": info.model_dtype, "pattern": info.pattern,
                                                   "step": info.step, "param_group": info.param_group})
        # without the source's RNG file (the copy's metadata must not point at one it does not have)
        meta = {k: v for k, v in ucp.metadata.items() if k not in ("format", "version", "parameters", "rng")}
        writer.finish(meta, [(n, i.shape) for n, i in ucp.parameters.items()])
    return dst


def _expert(name: str):
    """(layer, global expert, rest of the name) of a routed expert's canonical name, else None."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)", name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def _zero_expert_moments(name, key, tensor):
    return torch.zeros_like(tensor) if _expert(name) and key != "fp32" else None


# --------------------------------------------------------------------------------------------------
# Loss continuation


def test_ep2_dp4_to_ep1(sources):
    """EP2 DP4 (chained dense + expert distributed optimizer, expert-DP 2, torch_dist) -> EP1 DP1 (one optimizer).
    Negative control: the routed experts' Adam moments zeroed (measured: 2.0e-4 relative, 200x TOL)."""
    src = sources("ep2dp4")
    src.check_continues(src.resume(Layout()), "EP1")
    broken = src.resume(Layout(), ucp=src.edited("zero_expert_moments", _zero_expert_moments))
    assert leaves(broken, src) > BROKEN


def test_ep1_to_ep4_dp4(sources):
    """EP1 (experts in the dense optimizer) -> EP4 DP4 (one expert per rank, chained optimizers). Every rank reads
    only its own expert's slices: all ranks together read each stored byte about once (measured +0.02%).
    Negative control: experts 0 and 3 of every MoE layer swapped (weights and moments; measured: 1.8e-4)."""
    src = sources("ep1")
    target = Layout(dp=4, ep=4)
    resumed = src.resume(target)
    src.check_continues(resumed, str(target))
    ucp = UniversalCheckpoint.open(src.ucp)
    stored = sum(i.data_bytes for i in ucp.parameters.values())
    assert stored <= bytes_read(resumed) <= 1.01 * stored

    def swap(name, key, tensor):
        found = _expert(name)
        if found and found[1] in (0, 3):
            layer, e, rest = found
            return ucp.read(f"decoder.layers.{layer}.mlp.experts.local_experts.{3 - e}.{rest}", key)
        return None

    assert leaves(src.resume(Layout(), ucp=src.edited("swapped_experts", swap)), src) > BROKEN


def test_tp2_etp1_ep2_to_ep4_tp1_alltoall(sources):
    """TP2 SP ETP1 EP2 (whole experts on each TP rank, the shared expert split over TP; allgather dispatcher)
    -> TP1 EP4 DP4 with the alltoall dispatcher. Negative control: the same universal checkpoint without its
    optimizer state (measured: 8.0e-3)."""
    src = sources("tp2etp1ep2")
    target = Layout(dp=4, ep=4)
    src.check_continues(src.resume(target, ALLTOALL), f"{target} alltoall")
    assert leaves(src.resume(Layout(), ["--no-load-optim"]), src) > BROKEN


def test_etp1_to_etp2_slices_every_expert(sources):
    """TP2 SP ETP1 EP2 -> TP2 SP ETP2 EP1: every routed expert's fc1 (SwiGLU: gate and up halves, each split) and
    fc2 (split on its input dim) sliced over the expert-TP ranks; gloo's all-gather of the allgather dispatcher
    runs at ETP2 in Megatron-LM 0.19. Negative control: the experts' fc1 rows rearranged so that each ETP rank
    gets a plain row split (rank 0 both gate halves, rank 1 both up halves: a loader that ignored SwiGLU's
    fused halves; measured: 4.8e-4)."""
    src = sources("tp2etp1ep2")
    target = Layout(tp=2, sp=True)
    src.check_continues(src.resume(target), f"{target} ETP2")

    def plain_row_split(name, key, tensor):
        found = _expert(name)
        if found and found[2] == "linear_fc1.weight":
            g0, g1, u0, u1 = tensor.chunk(4)  # stored [gate; up]; ETP rank r reads [gate_r; up_r]
            return torch.cat([g0, u0, g1, u1])
        return None

    broken = src.resume(target, ucp=src.edited("plain_row_split", plain_row_split))
    assert leaves(broken, src) > BROKEN


def test_pp_change_with_moe_layers_on_both_stages_alltoall(sources):
    """EP2 DP4 PP1 (allgather) -> PP2 EP2 DP2 with the alltoall dispatcher (the layout and dispatcher of
    Megatron-LM's own E19 fixture run): MoE layer 1 on stage 0, MoE layer 3 on stage 1 (dense layers 0 and 2
    beside them). Negative control: the whole MoE blocks of layers 1 and 3 (router, experts, shared expert)
    swapped, a stage mix-up (measured: 5.9e-5 on the lm loss, 2.1e-3 on the load-balancing loss)."""
    src = sources("ep2dp4")
    target = Layout(pp=2, dp=2, ep=2)
    config = UniversalCheckpoint.open(src.ucp).config
    stages = [gpt.chunk_layers(config.num_layers, ParallelLayout(pp=2, dp=2, ep=2), p) for p in range(2)]
    assert [[config.moe_layers[i] for i in s] for s in stages] == [[False, True], [False, True]]
    src.check_continues(src.resume(target, ALLTOALL), f"{target} alltoall")
    ucp = UniversalCheckpoint.open(src.ucp)

    def swap_layers(name, key, tensor):
        m = re.fullmatch(r"decoder\.layers\.([13])\.(mlp\..+)", name)
        return ucp.read(f"decoder.layers.{4 - int(m.group(1))}.{m.group(2)}", key) if m else None

    broken = src.resume(target, ALLTOALL, ucp=src.edited("swapped_moe_layers", swap_layers))
    assert leaves(broken, src) > BROKEN


def test_plain_adam_all_moe_source_to_vpp(sources):
    """gpt2_moe, every layer MoE (stacked torch_dist keys with the expert axis after the layer axis), biased
    experts and router, plain Adam at EP2 DP2 -> PP2 DP2 EP2 with virtual stages (1 layer per chunk), distributed
    optimizer. Negative control: the curve of the same run shifted by one iteration (check_continues)."""
    src = sources("adam_allmoe")
    meta = json.loads((Path(src.ucp) / "metadata.json").read_text())
    assert meta["source"]["optimizer_kind"] == "adam" and meta["model_config"]["moe_layer_freq"] == 1
    assert "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.bias" in meta["parameters"]
    target = Layout(pp=2, dp=2, ep=2, vpp_layers=1)
    src.check_continues(src.resume(target), str(target))


def test_legacy_source_with_expert_bias(sources):
    """Megatron-LM's legacy format (mp_rank_00_000 / mp_rank_00_001 folders, chained optimizer lists,
    distrib_optim.pt [dense, expert] / [None, expert]) with the router's expert_bias buffer -> EP4 DP4.
    Negative control: expert_bias zeroed in the universal checkpoint, i.e. the buffer not restored: after 4 steps
    at Megatron-LM's update rate it is small (0 or +-0.001..0.002), yet routing depends on it and the curve leaves
    the tolerance (measured 6.0e-6 on the lm loss, 6.4e-5 on the load-balancing loss: 64x the tolerance)."""
    src = sources("legacy_bias")
    folders = sorted(p.name for p in (src.trained.save / "iter_0000004").iterdir())
    assert folders == ["mp_rank_00_000", "mp_rank_00_001"]
    ucp = UniversalCheckpoint.open(src.ucp)
    bias = ucp.parameters["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.tensors == ("fp32",) and bias.step is None and ucp.read(bias.name).abs().sum() > 0
    target = Layout(dp=4, ep=4)
    src.check_continues(src.resume(target), str(target))
    zeroed = src.edited("zero_bias", lambda n, k, t: torch.zeros_like(t) if gpt.is_buffer(n) else None)
    assert leaves(src.resume(Layout(), ucp=zeroed), src) > 5 * TOL


def test_from_universal_legacy_at_new_ep_is_loaded_by_megatron_lm(sources):
    """from-universal --ckpt-format torch at EP4 DP4 (EP2 DP4 source): Megatron-LM's folders and optimizer
    lists, loaded by Megatron-LM's own --load (load_parameter_state) and continued.
    Negative control: the same files loaded with --no-load-optim (measured 7.8e-3)."""
    from megatron_ucp.commands.from_universal import from_universal

    src = sources("ep2dp4")
    dst = src.work / "fu_ep4"
    if not dst.exists():
        from_universal(src.ucp, dst, data_parallel_size=4, expert_model_parallel_size=4,
                       use_distributed_optimizer=True, ckpt_format="torch", rng_state="cpu", progress=False)
    it = dst / "iter_0000004"
    assert sorted(p.name for p in it.iterdir()) == [f"mp_rank_00_{e:03d}" for e in range(4)]
    lists = [torch.load(it / f"mp_rank_00_{e:03d}" / "distrib_optim.pt", weights_only=False) for e in range(4)]
    assert [[s is not None for s in d] for d in lists] == [[True, True]] + [[False, True]] * 3
    model = torch.load(it / "mp_rank_00_002" / "model_optim_rng.pt", weights_only=False)
    assert [g["is_expert_parallel"] for opt in model["optimizer"] for g in opt["optimizer"]["param_groups"]] == [
        False, False, True]
    target = Layout(dp=4, ep=4)
    src.check_continues(src.resume(target, ucp=dst, universal=False), "legacy EP4 via --load")
    broken = src.resume(target, ["--no-load-optim"], ucp=dst, universal=False)
    assert leaves(broken, src) > BROKEN


def test_from_universal_torch_dist_at_new_ep_is_loaded_by_megatron_lm(sources):
    """from-universal --ckpt-format torch_dist at EP4 DP4 with the distributed optimizer from the EP2 DP4
    source, written directly (no training process): every key, chunk box and byte, every optimizer object
    (chained `chained_0.` dense / `chained_1.` expert buckets over the ETP x EP x PP groups, param groups, bucket
    numels) equal megatron-core's own save at that layout (`--via-harness`; alignment gaps and RNG states
    aside), verify atol 0; Megatron-LM's own --load (dist_checkpointing.load) continues the source's run within
    TOL (with the shifted-curve negative control of check_continues)."""
    from megatron_ucp.commands.from_universal import from_universal

    src = sources("ep2dp4")
    target = dict(data_parallel_size=4, expert_model_parallel_size=4, use_distributed_optimizer=True,
                  ckpt_format="torch_dist", rng_state="cpu", progress=False)
    direct = from_universal(src.ucp, src.work / "td_ep4", **target)
    from_universal(src.ucp, src.work / "td_ep4_harness", via_megatron_lm=True, **target)
    ours, theirs = (src.work / name / "iter_0000004" for name in ("td_ep4", "td_ep4_harness"))
    assert any(k.startswith("chained_1.optimizer.distributed.dp_group_idx_3.") for k in structure(ours))
    assert_equal_to_megatron(ours, theirs, gap_chunks(direct, src.ucp))
    src.check_continues(src.resume(Layout(dp=4, ep=4), ucp=src.work / "td_ep4", universal=False),
                        "torch_dist EP4 via --load")


@pytest.mark.parametrize("name,source,target,kwargs", [
    ("ep1_dp_reshardable", "ep2dp4", Layout(dp=2), dict(use_distributed_optimizer=True)),
    ("adam_stacked", "adam_allmoe", Layout(dp=2, ep=2), {}),
    ("fp16_dp_reshardable", "ep2_fp16", Layout(dp=2, ep=2), dict(use_distributed_optimizer=True)),
])
def test_direct_torch_dist_equals_megatron_cores_save(sources, name, source, target, kwargs):
    """The direct torch_dist writer equals megatron-core's own save (the --via-megatron-lm route) where the MoE
    layout differs from the test above: EP1 (experts in the dense optimizer's buffers, no ChainedOptimizer),
    plain Adam with every layer MoE (stacked keys: layer axis, then expert axis; two optimizers' common_step),
    and an fp16 model (fp16 weights cast as torch casts them, each chained optimizer's loss-scaler object)."""
    from megatron_ucp.commands.from_universal import from_universal

    src = sources(source)
    args = dict(data_parallel_size=target.dp, expert_model_parallel_size=target.ep, ckpt_format="torch_dist",
                rng_state="cpu", progress=False, **kwargs)
    direct = from_universal(src.ucp, src.work / f"direct_{name}", **args)
    from_universal(src.ucp, src.work / f"harness_{name}", via_megatron_lm=True, **args)
    ours, theirs = (src.work / f"{kind}_{name}" / "iter_0000004" for kind in ("direct", "harness"))
    skip = gap_chunks(direct, src.ucp) if kwargs.get("use_distributed_optimizer") else set()
    assert_equal_to_megatron(ours, theirs, skip)


def test_fully_reshardable_moe_write_loads_at_another_ep(sources):
    """fully_reshardable (model-space optimizer state, expert state keyed with the global expert axis) written
    directly at TP2 SP ETP1 EP2 DP2 and loaded by Megatron-LM at TP1 EP4 DP4 (megatron-core reshards the chained
    optimizers' state itself): the run continues within TOL."""
    from megatron_ucp.commands.from_universal import from_universal

    src = sources("ep2dp4")
    dst = src.work / "td_full"
    if not dst.exists():
        from_universal(src.ucp, dst, tensor_model_parallel_size=2, data_parallel_size=2,
                       expert_model_parallel_size=2, expert_tensor_parallel_size=1, sequence_parallel=True,
                       use_distributed_optimizer=True, optimizer_format="fully_reshardable",
                       ckpt_format="torch_dist", rng_state="cpu", progress=False)
    keys = structure(dst / "iter_0000004")
    assert "optimizer.state.exp_avg.decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in keys
    assert not any(k.startswith("chained_") for k in keys)
    src.check_continues(src.resume(Layout(dp=4, ep=4), ucp=dst, universal=False),
                        "fully_reshardable TP2 ETP1 EP2 -> EP4 via --load")


# --------------------------------------------------------------------------------------------------
# Tools on MoE checkpoints


def test_tools_on_moe_checkpoints(sources, tmp_path):
    """verify: the torch_dist and legacy sources equal their universal checkpoints bitwise (experts by global
    index, Adam state, expert_bias); inspect shows the MoE config; plan and from-universal refuse an EP that does
    not divide the experts before anything is written (negative control: EP4 is accepted)."""
    from megatron_ucp.cli import main

    def run(*argv) -> tuple[int, dict]:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main([*map(str, argv), "--json", "--quiet"])
        return code, json.loads(buf.getvalue())

    a, e = sources("ep2dp4"), sources("legacy_bias")
    for src in (a, e):
        code, result = run("verify", src.trained.save, src.ucp, "--iteration-a", SAVED_AT)
        names = UniversalCheckpoint.open(src.ucp).parameters
        buffers = sum(gpt.is_buffer(n) for n in names)
        # every parameter compared (weight, both moments, step), buffers by value: experts included
        assert code == 0 and result["equal"] and result["num_tensors"] == 4 * (len(names) - buffers) + buffers
        assert sum(gpt.is_expert(n) for n in names) == 16
    code, info = run("inspect", e.ucp)
    assert code == 0 and info["moe"]["num_experts"] == 4 and info["moe"]["moe_layers"] == [1, 3]
    assert info["moe"]["router_expert_bias"] and info["layout"]["ep"] == 2
    kinds = {p["name"]: p["kind"] for p in info["parameters"]}
    assert kinds["decoder.layers.3.mlp.router.expert_bias"] == "buffer"
    assert kinds["decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight"] == "expert"
    code, plan = run("plan", a.ucp, "-t", 1, "-d", 3, "--expert-model-parallel-size", 3)
    assert code == 1 and "num_experts=4 is not divisible by EP=3" in plan["problems"][0]
    code, plan = run("plan", a.ucp, "-t", 1, "-d", 4, "--expert-model-parallel-size", 4, "--use-distributed-optimizer")
    assert code == 0 and {r["ep_rank"] for r in plan["ranks"]} == {0, 1, 2, 3}
    from megatron_ucp.commands.from_universal import FromUniversalError, from_universal

    with pytest.raises(FromUniversalError, match=r"num_experts=4 is not divisible by EP=3.*\[1, 2, 4\]"):
        from_universal(a.ucp, tmp_path / "ep3", data_parallel_size=3, expert_model_parallel_size=3,
                       ckpt_format="torch", progress=False)
    with pytest.raises(FromUniversalError, match="--expert-tensor-parallel-size 1 != --tensor-model-parallel-size 2"):
        from_universal(a.ucp, tmp_path / "etp1", tensor_model_parallel_size=2, sequence_parallel=True,
                       data_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                       ckpt_format="torch", progress=False)
    assert not any(tmp_path.glob("ep3*")) and not any(tmp_path.glob("etp1*"))
