"""Legacy `torch` checkpoint reader and the DDP buffer index map, on Megatron-LM's own fixtures.

A: TP2 PP2 DP2 + SP, distributed optimizer (distrib_optim.pt). C: TP2 PP2 DP1, plain fp32 Adam,
tied embeddings. All comparisons are bitwise (torch.equal).
"""

import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ucp.formats import CheckpointFormatError, open_checkpoint
from megatron_ucp.formats.bucket_layout import (
    BufferParam, DDPBucketConfig, build_buffer_layout, build_chunk_buffers)
from megatron_ucp.formats.common import layout_from_args, load_pickled
from megatron_ucp.adapters.gpt import megatron_param_groups
from megatron_ucp.formats.legacy.reader import LegacyCheckpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "megatron-lm"
A = FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt"
C = FIXTURES / "C_gpt2_tp2pp2dp1_adam_torch" / "ckpt"



def by_rank(refs):
    out = {}
    for r in refs:
        out.setdefault((r.tp_rank, r.pp_rank), []).append(r)
    return out


# ---------------------------------------------------------------------------------------------
# bucket_layout (pure)

def _dp_config(**kw):
    return DDPBucketConfig(**{"dp_size": 2, "use_distributed_optimizer": True, **kw})


def test_params_reverse_order_and_64_alignment():
    params = [BufferParam("a", (48,), torch.float32), BufferParam("b", (10, 10), torch.float32),
              BufferParam("c", (7,), torch.float32)]
    buf = build_buffer_layout(params, _dp_config())
    assert [(s.name, s.start, s.end) for s in buf.params] == [("c", 0, 7), ("b", 64, 164), ("a", 192, 240)]
    assert buf.numel_unpadded == 240 and buf.numel == 256  # bucket end -> lcm(dp=2, 128)


def test_no_padding_without_distributed_optimizer():
    params = [BufferParam("a", (48,), torch.float32), BufferParam("b", (7,), torch.float32)]
    buf = build_buffer_layout(params, _dp_config(use_distributed_optimizer=False))
    assert [(s.start, s.end) for s in buf.params] == [(0, 7), (7, 55)] and buf.numel == 55


def test_bucket_size_and_high_busbw_padding():
    params = [BufferParam(n, (100,), torch.float32) for n in "abcd"]
    buf = build_buffer_layout(params, _dp_config(dp_size=3, bucket_size=150))
    # d at 0, c at 128 (64-aligned): bucket 0 closes at 228 (>= 150), padded to lcm(3, 128) = 384
    assert [(b.start, b.end, b.numel_unpadded) for b in buf.buckets] == [(0, 384, 228), (384, 768, 228)]
    assert buf.span("a").start == 512 and buf.offset_in_bucket(buf.span("a")) == 128
    assert buf.coalesced_offset(buf.span("a")) == 228 + 128  # bucket-end padding removed
    busbw = build_buffer_layout(params, _dp_config(pad_buckets_for_high_nccl_busbw=True))
    assert busbw.numel == 2 ** 16


def test_shared_embedding_gets_own_bucket():
    params = [BufferParam("emb", (64,), torch.float32, shared_embedding=True),
              BufferParam("w", (10,), torch.float32)]
    buf = build_buffer_layout(params, _dp_config())
    assert [(s.name, s.bucket) for s in buf.params] == [("w", 0), ("emb", 1)]
    assert [(b.start, b.numel_unpadded) for b in buf.buckets] == [(0, 64), (128, 64)]


def test_buffers_split_by_dtype_in_first_appearance_order():
    params = [BufferParam("a", (4,), torch.bfloat16), BufferParam("b", (4,), torch.float32),
              BufferParam("c", (4,), torch.bfloat16)]
    bufs = build_chunk_buffers(params, _dp_config(grad_reduce_in_fp32=True))
    assert [(b.param_dtype, b.grad_dtype, [s.name for s in b.params]) for b in bufs] == [
        (torch.bfloat16, torch.float32, ["c", "a"]), (torch.float32, torch.float32, ["b"])]


def test_default_bucket_size_rules():
    args = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2, "world_size": 8,
            "use_distributed_optimizer": True, "overlap_grad_reduce": True}
    layout = layout_from_args(args)
    assert DDPBucketConfig.from_megatron_args(args, layout, pp_rank=0, vpp_chunk=0,
                                              rank_num_parameters=1).bucket_size == 40_000_000
    assert DDPBucketConfig.from_megatron_args(args, layout, pp_rank=1, vpp_chunk=0,
                                              rank_num_parameters=1).bucket_size is None
    assert DDPBucketConfig.from_megatron_args({**args, "ddp_num_buckets": 4}, layout, pp_rank=0, vpp_chunk=0,
                                              rank_num_parameters=1000).bucket_size == 250
    assert DDPBucketConfig.from_megatron_args({**args, "overlap_grad_reduce": False}, layout, pp_rank=0, vpp_chunk=0,
                                              rank_num_parameters=1).bucket_size is None


def test_param_groups_sorted_default_first_then_overrides():
    chunks = {(0, 0): [[BufferParam("embedding.word_embeddings.weight", (8, 4), torch.float32),
                        BufferParam("decoder.layers.0.input_layernorm.weight", (4,), torch.float32),
                        BufferParam("decoder.layers.0.mlp.linear_fc1.weight", (8, 4), torch.float32),
                        BufferParam("decoder.layers.0.mlp.linear_fc1.bias", (8,), torch.float32)]]}
    groups = megatron_param_groups(chunks, {"pipeline_model_parallel_size": 1})[(0, 0)]
    assert [[n for _, n in g] for g in groups] == [
        ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"],
        ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.bias"]]
    # decoupled LR: (('max_lr', x),) sorts before (('wd_mult', 0.0),)
    groups = megatron_param_groups(chunks, {"pipeline_model_parallel_size": 1, "decoupled_lr": 0.1})[(0, 0)]
    assert [[n for _, n in g] for g in groups] == [
        ["decoder.layers.0.mlp.linear_fc1.weight"], ["embedding.word_embeddings.weight"],
        ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.bias"]]


# ---------------------------------------------------------------------------------------------
# A: distributed optimizer

@pytest.mark.parametrize("iteration", [4, 8])
def test_A_distributed_optimizer_state(iteration):
    ck = open_checkpoint(A, iteration)
    assert isinstance(ck, LegacyCheckpoint) and ck.format == "torch" and ck.optimizer_kind == "distributed"
    assert ck.iteration == iteration and ck.layout.describe() == "TP2PP2DP2+SP"
    refs = ck.shards()
    assert len(refs) == 2 * ((1 + 2 * 6) + (2 * 6 + 2))  # per TP rank: stage 0 + stage 1
    ranks = by_rank(refs)
    assert sorted(ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r.local_name for r in ranks[(0, 0)]][:2] == ["embedding.word_embeddings.weight",
                                                        "decoder.layers.0.input_layernorm.weight"]
    assert ranks[(1, 1)][-1].local_name == "output_layer.weight" and ranks[(1, 1)][-1].shape == (512, 48)
    for ref in refs:
        d = ck.read(ref)
        assert set(d) == {"param", "fp32", "exp_avg", "exp_avg_sq", "step"}
        assert tuple(d["param"].shape) == ref.shape and d["param"].dtype == ref.dtype
        assert torch.equal(d["fp32"], d["param"])  # fp32 training: master == model weight
        assert (d["exp_avg_sq"] >= 0).all() and d["exp_avg_sq"].abs().sum() > 0
        assert d["step"].shape == () and d["step"].item() == iteration


def test_A_padding_is_not_data():
    """Spans of all params + 64-alignment gaps reproduce numel_unpadded exactly, and every element
    outside the spans is the zero padding Megatron writes (the reader never consumes it)."""
    ck = open_checkpoint(A, 4)
    for (tp, pp), refs in by_rank(ck.shards()).items():
        params = [BufferParam(r.local_name, r.shape, r.dtype) for r in refs]
        config = DDPBucketConfig.from_megatron_args(ck.args, ck.layout, pp_rank=pp, vpp_chunk=0,
                                                    rank_num_parameters=sum(p.numel for p in params))
        (buf,) = build_chunk_buffers(params, config)
        assert len(buf.buckets) == 1
        f = A / "iter_0000004" / f"mp_rank_{tp:02d}_{pp:03d}" / "distrib_optim.pt"
        entry = load_pickled(f, what="test")[0][(torch.float32, torch.float32)]
        assert entry["numel_unpadded"] == buf.numel_unpadded == buf.params[-1].end
        numels = sum(p.numel for p in params)
        gaps = sum(b.start - a.end for a, b in zip(buf.params, buf.params[1:]))
        assert numels + gaps == entry["numel_unpadded"] == entry["param"].numel()
        assert all(s.start % 64 == 0 for s in buf.params)
        padding = torch.ones(buf.numel_unpadded, dtype=torch.bool)
        for s in buf.params:
            padding[s.start:s.end] = False
        assert padding.sum() == gaps > 0
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert (entry[key][padding] == 0).all()


def test_A_iterations_differ_and_common_state():
    ck4, ck8 = open_checkpoint(A, 4), open_checkpoint(A, 8)
    assert open_checkpoint(A).iteration == 8  # tracker
    assert open_checkpoint(A / "iter_0000004").iteration == 4
    ref = ck4.shards()[0]
    d4, d8 = ck4.read(ref), ck8.read(ref)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert not torch.equal(d4[key], d8[key])
    for ck, it in ((ck4, 4), (ck8, 8)):
        cs = ck.common_state()
        assert cs["iteration"] == it and cs["consumed_train_samples"] == 8 * it
        assert cs["opt_param_scheduler"]["num_steps"] == 8 * it
        assert cs["checkpoint_version"] == 3.0 and cs["num_floating_point_operations_so_far"] > 0
        assert [g["wd_mult"] for g in cs["param_groups"]] == [1.0, 0.0]
        assert cs["param_groups"][0]["weight_decay"] == 0.01 and cs["param_groups"][0]["betas"] == (0.9, 0.999)
        assert all("params" not in g for g in cs["param_groups"])
    assert ck4.config.padded_vocab_size == 1024 and ck4.config.num_query_groups == 2


# ---------------------------------------------------------------------------------------------
# C: plain fp32 Adam, tied embeddings

def test_C_adam_tied_embeddings():
    ck = open_checkpoint(C, 4)
    assert ck.optimizer_kind == "adam" and ck.config.tied
    ranks = by_rank(ck.shards())
    for tp in range(2):
        emb = next(r for r in ranks[(tp, 0)] if r.local_name == "embedding.word_embeddings.weight")
        out = next(r for r in ranks[(tp, 1)] if r.local_name == "output_layer.weight")
        assert emb.shape == out.shape == (512, 48)
        d_emb, d_out = ck.read(emb), ck.read(out)
        # Megatron all-reduces the tied gradients across stages, so both Adam states agree bitwise too
        for key in ("param", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(d_emb[key], d_out[key])
    for ref in ck.shards():
        d = ck.read(ref)
        assert tuple(d["exp_avg"].shape) == tuple(d["exp_avg_sq"].shape) == ref.shape
        assert torch.equal(d["fp32"], d["param"]) and d["step"].item() == 4.0
        assert (d["exp_avg_sq"] >= 0).all()


def test_C_indices_follow_megatron_param_groups():
    """Group 0 (weight decay) = 2-D weights in registration order, group 1 = biases and norms."""
    ck = open_checkpoint(C, 4)
    state = load_pickled(C / "iter_0000004" / "mp_rank_00_001" / "model_optim_rng.pt", what="test")
    groups = state["optimizer"]["param_groups"]
    ranks = by_rank(ck.shards())
    refs = ranks[(0, 1)]
    wd = [r for r in refs if len(r.shape) > 1]
    assert len(groups[0]["params"]) == len(wd) and wd[-1].local_name == "output_layer.weight"
    for idx, ref in zip(groups[0]["params"], wd):
        assert torch.equal(state["optimizer"]["state"][idx]["exp_avg"], ck.read(ref)["exp_avg"])
    no_wd = [r for r in refs if len(r.shape) == 1]
    for idx, ref in zip(groups[1]["params"], no_wd):
        assert torch.equal(state["optimizer"]["state"][idx]["exp_avg_sq"], ck.read(ref)["exp_avg_sq"])


def test_C_iteration_8():
    ck = open_checkpoint(C)
    assert ck.iteration == 8 and ck.common_state()["consumed_train_samples"] == 64
    assert all(ck.read(r)["step"].item() == 8.0 for r in ck.shards()[:5])


# ---------------------------------------------------------------------------------------------
# broken checkpoints

def _save_replacing(obj, path):
    """Write a new file and rename it over `path`: `obj` may still view the old file's mmap,
    which truncating it in place would invalidate (SIGBUS)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@pytest.fixture
def a_copy(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(A / "iter_0000004", root / "iter_0000004")
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    return root


def _raises(path, match, iteration=None):
    with pytest.raises(CheckpointFormatError, match=match) as e:
        open_checkpoint(path, iteration)
    return str(e.value)


def test_error_missing_dir_and_not_a_checkpoint(tmp_path):
    _raises(tmp_path / "nope", "no such checkpoint directory")
    _raises(tmp_path, "latest_checkpointed_iteration.txt")
    (tmp_path / "iter_0000003").mkdir()
    _raises(tmp_path / "iter_0000003", "not a Megatron-LM checkpoint")


def test_error_release_tracker(a_copy):
    (a_copy / "latest_checkpointed_iteration.txt").write_text("release")
    _raises(a_copy, "latest_checkpointed_iteration.txt.*release")


def test_error_missing_iteration(a_copy):
    (a_copy / "latest_checkpointed_iteration.txt").write_text("12")
    _raises(a_copy, "iter_0000012")


def test_error_missing_rank_folder(a_copy):
    shutil.rmtree(a_copy / "iter_0000004" / "mp_rank_01_001")
    _raises(a_copy, "mp_rank_01_001")
    shutil.rmtree(a_copy / "iter_0000004" / "mp_rank_00_000")
    _raises(a_copy, "mp_rank_00_000")


@pytest.mark.parametrize("filename", ["model_optim_rng.pt", "distrib_optim.pt"])
def test_error_truncated_file(a_copy, filename):
    f = a_copy / "iter_0000004" / "mp_rank_01_000" / filename
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    msg = _raises(a_copy, "truncated")
    assert str(f) in msg


def test_error_mixed_iterations(a_copy):
    target = a_copy / "iter_0000004" / "mp_rank_01_000"
    shutil.rmtree(target)
    shutil.copytree(A / "iter_0000008" / "mp_rank_01_000", target)
    msg = _raises(a_copy, "iteration 8")
    assert str(target / "model_optim_rng.pt") in msg


def test_error_old_distrib_optim_format(a_copy):
    f = a_copy / "iter_0000004" / "mp_rank_00_001" / "distrib_optim.pt"
    per_bucket = [torch.zeros(50304)]
    torch.save({0: {torch.float32: {"param": per_bucket, "exp_avg": per_bucket, "exp_avg_sq": per_bucket}}}, f)
    msg = _raises(a_copy, "buckets_coalesced")
    assert str(f) in msg


def test_error_distrib_optim_of_other_model(a_copy):
    f = a_copy / "iter_0000004" / "mp_rank_00_001" / "distrib_optim.pt"
    state = load_pickled(f, what="test")
    entry = state[0][(torch.float32, torch.float32)]
    for k in ("param", "exp_avg", "exp_avg_sq"):
        entry[k] = entry[k][:-64].clone()
    entry["numel_unpadded"] -= 64
    _save_replacing(state, f)
    msg = _raises(a_copy, "64-element alignment")
    assert str(f) in msg


def test_mixed_precision_optimizer_from_rewritten_C(tmp_path):
    """C rewritten as Float16OptimizerWithFloat16Params would save it: bf16 model weights and
    per-group fp32_from_fp16_params (group 0: 2-D weights, group 1: biases and norms, each in
    registration order); masters are set to weight + 1 so they cannot be confused with weights."""
    root = tmp_path / "ckpt"
    shutil.copytree(C / "iter_0000004", root / "iter_0000004")
    masters = {}
    for f in sorted((root / "iter_0000004").glob("mp_rank_*/model_optim_rng.pt")):
        state = {k: v for k, v in load_pickled(f, what="test").items()}
        params = [(n, t) for n, t in state["model"].items() if torch.is_tensor(t)]
        groups = [[(n, t) for n, t in params if t.dim() > 1], [(n, t) for n, t in params if t.dim() == 1]]
        fp32 = [[t.clone() + 1 for _, t in g] for g in groups]
        masters[f.parent.name] = {n: m for g, ms in zip(groups, fp32) for (n, _), m in zip(g, ms)}
        state["model"] = {n: (t.to(torch.bfloat16) if torch.is_tensor(t) else t) for n, t in state["model"].items()}
        state["optimizer"] = {"optimizer": state["optimizer"], "fp32_from_fp16_params": fp32}
        _save_replacing(state, f)
    ck = open_checkpoint(root / "iter_0000004")
    assert ck.optimizer_kind == "mixed_precision"
    for ref in ck.shards():
        d = ck.read(ref)
        assert d["param"].dtype == torch.bfloat16 == ref.dtype
        assert torch.equal(d["fp32"], masters[f"mp_rank_{ref.tp_rank:02d}_{ref.pp_rank:03d}"][ref.local_name])
        assert d["step"].item() == 4.0
