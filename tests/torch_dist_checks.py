"""Comparing two `torch_dist` checkpoints as megatron-core sees them (shared by tests/test_torch_dist_direct.py
and tests/test_moe_universal.py): `.metadata` structure (keys, global shapes, dtypes, chunk boxes), every
chunk's bytes and every object's value (RNG states aside: fresh ones differ from a live run's by design),
the common state's (common.pt, or megatron-core 0.19's common_state object) optimizer / scheduler /
iteration / content metadata, and the args a resumed run derives its model and layout from."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from megatron_ucp.commands import from_universal as fu
from megatron_ucp.formats.common import load_pickled
from megatron_ucp.universal import UniversalCheckpoint
from megatron_ucp.commands.verify import verify
from megatron_ucp.formats.torch_dist.writer import Gap, TensorItem, plan_checkpoint

# Args a resumed run derives its model and layout from, and megatron enums (pickled as references to
# Megatron-LM's classes, without importing megatron-core): ours must equal megatron-core's.
COMPARED_ARGS = ("attention_backend", "model_type", "num_layers", "hidden_size", "ffn_hidden_size",
                 "num_attention_heads", "num_query_groups", "padded_vocab_size", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "data_parallel_size",
                 "world_size", "use_distributed_optimizer", "sequence_parallel", "consumed_train_samples",
                 "global_batch_size", "micro_batch_size", "bf16")



def _iter_dir(root: Path, iteration=None) -> Path:
    return Path(root) / f"iter_{iteration:07d}" if iteration else next(Path(root).glob("iter_*"))


def dcp_metadata(iter_dir: Path):
    return FileSystemReader(str(iter_dir)).read_metadata()


def structure(iter_dir: Path) -> dict:
    """.metadata as {key: ('bytes',) or (global shape, dtype, sorted chunk boxes)}."""
    md = dcp_metadata(iter_dir)
    out = {}
    for key, value in md.state_dict_metadata.items():
        if isinstance(value, TensorStorageMetadata):
            out[key] = (tuple(value.size), value.properties.dtype,
                        sorted((tuple(c.offsets), tuple(c.sizes)) for c in value.chunks))
        else:
            out[key] = ("bytes",)
    return out


def load_item(iter_dir: Path, key: str, offsets=None, md=None):
    if offsets is None:  # an object: unpickling it may import megatron.core, which needs the import shims
        from megatron_ucp.megatron_lm import cpu_shims

        cpu_shims.install_import_patches()
    info = (md or dcp_metadata(iter_dir)).storage_data[MetadataIndex(key, offsets)]
    with open(iter_dir / info.relative_path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    return torch.load(io.BytesIO(data), weights_only=False)


def gap_chunks(summary: fu.FromUniversalSummary, ucp: Path) -> set:
    """(key, offsets) of the flat-bucket alignment gaps the direct writer planned."""
    ckpt = UniversalCheckpoint.open(ucp)
    plan = plan_checkpoint(ckpt, summary.plan.target, "dp_reshardable")
    return {(item.key, item.offsets) for f in plan.files for item in f.items
            if isinstance(item, TensorItem) and all(isinstance(p, Gap) for p in item.pieces)}


def chunk_differences(ours: Path, theirs: Path, skip: set = frozenset()) -> list:
    """Keys / chunks whose bytes (tensors) or values (objects; RNG states aside) differ."""
    found = []
    md_ours, md_theirs = dcp_metadata(ours), dcp_metadata(theirs)
    for key, entry in structure(theirs).items():
        if entry == ("bytes",):
            # RNG states differ by design; the common state is compared field by field (common_state below)
            if not key.startswith(("rng_state", COMMON_STATE)) and repr(load_item(ours, key, md=md_ours)) != repr(
                    load_item(theirs, key, md=md_theirs)):
                found.append(key)
            continue
        for offsets, _ in entry[2]:
            if (key, offsets) in skip:
                continue
            a, b = load_item(ours, key, offsets, md_ours), load_item(theirs, key, offsets, md_theirs)
            if a.dtype != b.dtype or not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                found.append((key, offsets))
    return found


COMMON_STATE = "common_state/"  # megatron-core 0.19: the common state is a sharded object, not common.pt


def common_state(iter_dir: Path) -> dict:
    """The checkpoint's common state (args, iteration, scheduler, ...): common.pt (megatron-core <= 0.16) or
    the `common_state` sharded object (0.19)."""
    if (iter_dir / "common.pt").exists():
        return load_pickled(iter_dir / "common.pt", what="common.pt")
    key = next(k for k in structure(iter_dir) if k.startswith(COMMON_STATE))
    state = load_item(iter_dir, key)
    return state[0] if isinstance(state, list) else state


def assert_equal_to_megatron(ours: Path, theirs: Path, skip: set = frozenset()) -> None:
    """`ours` and `theirs` are iteration folders."""
    assert structure(ours) == structure(theirs)
    assert chunk_differences(ours, theirs, skip) == []
    common_ours, common_theirs = common_state(ours), common_state(theirs)
    assert sorted(common_ours) == sorted(common_theirs)
    for key in ("checkpoint_version", "iteration", "optimizer", "opt_param_scheduler"):
        assert repr(common_ours.get(key)) == repr(common_theirs.get(key)), key
    assert common_ours["content_metadata"] == common_theirs["content_metadata"]  # the harness orders it otherwise
    args_ours, args_theirs = vars(common_ours["args"]), dict(vars(common_theirs["args"]))
    if not args_theirs.get("group_query_attention") and args_theirs.get("num_query_groups") == 1:
        # Megatron-LM 0.19 sets num_query_groups = num_attention_heads (no GQA) only while counting the FLOPs of
        # a step (training.py, transformer_flops); its parser's default is 1, so a save that trained no step
        # (the --via-megatron-lm route) records 1 where every trained save records the heads, as ours does
        args_theirs["num_query_groups"] = args_theirs["num_attention_heads"]
    assert {k: args_ours.get(k) for k in COMPARED_ARGS} == {k: args_theirs.get(k) for k in COMPARED_ARGS}
    assert json.loads((ours / "metadata.json").read_text()) == json.loads((theirs / "metadata.json").read_text())
    result = verify(ours, theirs, progress=False)
    assert result.equal and result.compared_keys == ("fp32", "exp_avg", "exp_avg_sq", "step"), \
        [d for d in result.diffs if not d.equal][:3]


