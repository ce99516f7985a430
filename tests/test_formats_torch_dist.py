"""torch_dist checkpoint reader on Megatron-LM's own fixtures.

B is the same TP2 PP2 DP2 + SP run as A, saved as torch_dist with the distributed optimizer in
'dp_reshardable' form: every shard's weight and optimizer state must equal A's bitwise
(torch.equal), which checks local-name mapping, SwiGLU fc1 reassembly, layer unstacking and
the flat-buffer offsets at once.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ucp.formats import CheckpointFormatError, open_checkpoint
from megatron_ucp.formats.torch_dist import names
from megatron_ucp.formats.torch_dist.reader import TorchDistCheckpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "megatron-lm"
A = FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt"
B = FIXTURES / "B_llama_tp2pp2dp2_distopt_sp_torch_dist" / "ckpt"



def test_model_space_optimizer_keys():
    """'optimizer.state.<state>.<model key>' (optim_state_to_sharding_state, fully_reshardable), optionally
    'chained_<i>.'-prefixed by a ChainedOptimizer."""
    cases = {
        "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight": ("exp_avg", "decoder.layers.mlp.linear_fc1.weight"),
        "optimizer.state.exp_avg_sq.output_layer.weight": ("exp_avg_sq", "output_layer.weight"),
        "optimizer.state.fp32_param.embedding.word_embeddings.weight": ("fp32_param", "embedding.word_embeddings.weight"),
        "chained_1.optimizer.state.param.decoder.final_layernorm.bias": ("param", "decoder.final_layernorm.bias"),
    }
    for key, groups in cases.items():
        assert names.parse_model_space_state_key(key) == groups
        prefix = key[:key.index("optimizer.")]
        assert names.model_space_state_key(*groups, prefix=prefix) == key  # the writer's spelling, inverted
    for key in ("optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.param",
                "optimizer.state.step.x", "decoder.final_layernorm.weight"):
        assert names.parse_model_space_state_key(key) is None


def test_torch_dist_spellings_parse_what_they_format():
    """Every torch_dist name the writer formats is parsed back by the reader's parser (formats/torch_dist/names.py),
    and a near miss is not."""
    key = names.flat_bucket_key(3, 1, ("torch.bfloat16", "torch.float32"), 2, "exp_avg_sq", prefix=names.chained_prefix(1))
    assert key == ("chained_1.optimizer.distributed.dp_group_idx_3.gbuf_idx_1.dtype_(torch.bfloat16, torch.float32)"
                   ".bucket_idx_2.exp_avg_sq")
    assert names.parse_flat_bucket_key(key) == (1, 3, 1, ("torch.bfloat16", "torch.float32"), 2, "exp_avg_sq")
    assert names.parse_flat_bucket_key(names.flat_bucket_key(0, 0, ("a", "b"), 0, "param")).optimizer is None
    assert names.parse_flat_bucket_key(key.replace("exp_avg_sq", "step")) is None
    assert names.distcp_name(17, 1) == "__17_1.distcp" and names.is_distcp_name(names.distcp_name(17, 1))
    assert not names.is_distcp_name("__1_0.pt") and not names.is_distcp_name("x__1_0.distcp")
    obj = names.sharded_object_key(names.RNG_STATE_KEY, (1, 0, 3), (2, 2, 4))
    assert obj == "rng_state/shard_1.0.3_2.2.4"
    assert names.parse_sharded_object_key(obj) == (names.RNG_STATE_KEY, (1, 0, 3), (2, 2, 4))
    assert names.COMMON_STATE_ITEM == "common_state/shard_0_1"
    assert names.is_grad_scaler_key(names.distributed_optimizer_object_key(0, "grad_scaler", prefix="chained_0.") + "/x")
    assert not names.is_grad_scaler_key(names.distributed_optimizer_object_key(0, "optimizer") + "/x")


@pytest.mark.parametrize("iteration", [4, 8])
def test_B_equals_A_bitwise(iteration):
    a, b = open_checkpoint(A, iteration), open_checkpoint(B, iteration)
    assert isinstance(b, TorchDistCheckpoint) and b.format == "torch_dist" and b.optimizer_kind == "distributed"
    assert b.layout == a.layout and b.config == a.config and b.iteration == iteration
    assert b.shards() == a.shards()  # names (local spec, stage-local), local shapes, order
    for ref in b.shards():
        da, db = a.read(ref), b.read(ref)
        assert set(db) == {"param", "fp32", "exp_avg", "exp_avg_sq", "step"}
        for key in db:
            assert torch.equal(da[key], db[key]), (ref, key)
        assert torch.equal(db["fp32"], db["param"]) and (db["exp_avg_sq"] >= 0).all()
        assert db["step"].item() == iteration
    ca, cb = a.common_state(), b.common_state()
    assert cb == ca and cb["consumed_train_samples"] == 8 * iteration


def test_B_swiglu_fc1_is_local_gate_up():
    """fc1 of TP rank r is [gate_r; up_r] while the global tensor is [gate; up]."""
    b = open_checkpoint(B, 4)
    fc1 = [r for r in b.shards() if r.pp_rank == 0 and r.local_name == "decoder.layers.1.mlp.linear_fc1.weight"]
    assert [r.shape for r in fc1] == [(128, 48), (128, 48)]
    local = [b.read(r)["param"] for r in sorted(fc1, key=lambda r: r.tp_rank)]
    gate = torch.cat([t[:64] for t in local])
    up = torch.cat([t[64:] for t in local])
    assert not torch.equal(torch.cat(local), torch.cat([gate, up]))


def test_B_iterations_differ():
    b4, b8 = open_checkpoint(B, 4), open_checkpoint(B)
    assert b8.iteration == 8
    ref = b4.shards()[-1]
    assert not torch.equal(b4.read(ref)["exp_avg"], b8.read(ref)["exp_avg"])


# ---------------------------------------------------------------------------------------------
# broken checkpoints

def _save_replacing(obj, path):
    """Write a new file and rename it over `path`: `obj` may still view the old file's mmap,
    which truncating it in place would invalidate (SIGBUS)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@pytest.fixture
def b_copy(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(B / "iter_0000004", root / "iter_0000004")
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    return root


def _raises(path, match):
    with pytest.raises(CheckpointFormatError, match=match) as e:
        open_checkpoint(path)
    return str(e.value)


@pytest.mark.parametrize("name", ["__3_1.distcp", ".metadata", "common.pt"])
def test_error_truncated(b_copy, name):
    f = b_copy / "iter_0000004" / name
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert str(f) in _raises(b_copy, "truncated")


def test_error_missing_data_file(b_copy):
    f = b_copy / "iter_0000004" / "__5_0.distcp"
    f.unlink()
    assert str(f) in _raises(b_copy, "missing")


def test_error_mixed_iterations(b_copy):
    f = b_copy / "iter_0000004" / "common.pt"
    shutil.copy(B / "iter_0000008" / "common.pt", f)
    assert str(f) in _raises(b_copy, "iteration 8")


@pytest.mark.parametrize("sharding", ["fully_sharded_model_space", "fully_reshardable", None])
def test_error_unsupported_optimizer_sharding(b_copy, sharding):
    """Flat-bucket keys are only read as 'dp_reshardable'; any other declared sharding is refused."""
    f = b_copy / "iter_0000004" / "common.pt"
    from megatron_ucp.formats.common import load_pickled
    common = load_pickled(f, what="test")
    if sharding is None:
        del common["content_metadata"]["distrib_optim_sharding_type"]
    else:
        common["content_metadata"]["distrib_optim_sharding_type"] = sharding
    _save_replacing(common, f)
    message = _raises(b_copy, "distrib_optim_sharding_type")
    assert str(f) in message and repr(sharding) in message and "dp_reshardable" in message

