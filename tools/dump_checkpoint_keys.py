#!/usr/bin/env python
"""Print what a `torch_dist` checkpoint stores, so docs/MOE_CHECKPOINTS.md's claims can be re-checked.

Checkpoint listing (one process, reads only .metadata, the common state and the small pickled objects):

    python tools/dump_checkpoint_keys.py CKPT [--iteration N] [--grep REGEX] [--chunks] [--objects]

  every key of .metadata with its global shape and dtype, the number of saved chunks (--chunks: each
  chunk's offsets and sizes, i.e. where each rank's shard sits in the global tensor), the pickled
  byte entries collapsed per key family (--objects: decoded, e.g. the distributed optimizer's param
  groups and per-bucket sizes), then the structure of the common state (common.pt up to megatron-core
  0.18, a ShardedObject from 0.19; args summarised, optimizer state).

The live parameter and DDP-buffer order of a model Megatron-LM 0.19 builds (per rank, beside what a converter
predicts from args): tests/ddp_bucket_probe.py, under torchrun with Megatron-LM's flags.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _iteration_dir(path: str, iteration) -> Path:
    from megatron_ucp.formats.common import resolve_iteration_dir

    return resolve_iteration_dir(path, iteration)[0]


# --- listing ------------------------------------------------------------------------------------

_SHARD_SUFFIX = re.compile(r"/shard_[0-9_.]+$")


def read_objects(iter_dir: Path, keys) -> dict:
    """Unpickle DCP byte entries (ShardedObjects) with the project's allow-listed unpickler."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    import tempfile

    from megatron_ucp.formats.pickles import MEGATRON
    from megatron_ucp.serialization.safe_pickle import load_archive

    raw = {}

    class _Capture(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raw[read_item.dest_index.fqn] = value.read()

    import io
    load({k: io.BytesIO() for k in keys}, storage_reader=FileSystemReader(str(iter_dir)), planner=_Capture(),
         no_dist=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:  # each item is a torch.save archive: parse it with the allow-list
        for i, (k, v) in enumerate(raw.items()):
            path = Path(tmp) / f"{i}.pt"
            path.write_bytes(v)
            out[k] = load_archive(path, what=k, family=MEGATRON)
    return out


def _summary(value, depth: int = 0, max_depth: int = 6) -> str:
    import torch

    pad = "  " * depth
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, dict):
        if depth >= max_depth:
            return f"dict({len(value)} keys: {', '.join(map(repr, list(value)[:6]))}{', ...' if len(value) > 6 else ''})"
        lines = [f"dict({len(value)})"]
        for k, v in value.items():
            if k == "params" and isinstance(v, list):
                lines.append(f"{pad}  {k!r}: list of {len(v)} parameter indices")
                continue
            lines.append(f"{pad}  {k!r}: {_summary(v, depth + 1, max_depth)}")
        return "\n".join(lines)
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, dict) for v in value) and depth < max_depth:
            return f"{type(value).__name__}({len(value)})\n" + "\n".join(
                f"{pad}  [{i}]: {_summary(v, depth + 1, max_depth)}" for i, v in enumerate(value))
        text = repr(value)
        return text if len(text) < 160 else f"{type(value).__name__} of {len(value)}: {text[:150]}..."
    text = repr(value)
    return text if len(text) < 160 else text[:150] + "..."


def list_checkpoint(iter_dir: Path, pattern, show_chunks: bool, show_objects: bool) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_ucp.formats.common import load_pickled

    metadata = FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
    print(f"# {iter_dir}/.metadata: {len(metadata)} entries")
    byte_families = defaultdict(list)
    for key in sorted(metadata):
        if pattern and not pattern.search(key):
            continue
        item = metadata[key]
        if not isinstance(item, TensorStorageMetadata):
            byte_families[_SHARD_SUFFIX.sub("", key)].append(key)
            continue
        dtype = str(item.properties.dtype).replace("torch.", "")
        print(f"{key}  shape={tuple(item.size)} {dtype} chunks={len(item.chunks)}")
        if show_chunks:
            for chunk in sorted(item.chunks, key=lambda c: tuple(c.offsets)):
                print(f"    offsets={tuple(chunk.offsets)} sizes={tuple(chunk.sizes)}")
    print(f"# byte entries (ShardedObjects), by key: {len(byte_families)}")
    for family, keys in sorted(byte_families.items()):
        shards = ", ".join(k[len(family) + 1:] for k in sorted(keys)[:4])
        print(f"{family}  [{len(keys)} object(s): {shards}{', ...' if len(keys) > 4 else ''}]")
    if show_objects:
        keys = [k for ks in byte_families.values() for k in ks
                if "_extra_state" not in k and not k.startswith("rng_state")]
        for key, value in sorted(read_objects(iter_dir, keys).items()):
            print(f"## {key}: {_summary(value, 1)}")
    from megatron_ucp.formats.torch_dist import names

    if (iter_dir / names.COMMON_FILENAME).exists():  # megatron-core <= 0.18
        common = load_pickled(iter_dir / names.COMMON_FILENAME, what="common state")
        print(f"# {iter_dir}/{names.COMMON_FILENAME}")
    else:  # megatron-core 0.19 keeps it as a ShardedObject in the .distcp files
        [common] = read_objects(iter_dir, [names.COMMON_STATE_ITEM])[names.COMMON_STATE_ITEM]  # saved as [object]
        print(f"# {iter_dir}: {names.COMMON_STATE_ITEM}")
    for key, value in common.items():
        if key == "args":
            names = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size", "data_parallel_size", "num_layers", "num_experts",
                     "moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "swiglu",
                     "use_distributed_optimizer", "dist_ckpt_optim_fully_reshardable")
            print("args: " + ", ".join(f"{n}={getattr(value, n, None)!r}" for n in names))
        else:
            print(f"{key!r}: {_summary(value, 0)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="checkpoint root (with latest_checkpointed_iteration.txt) or an iter_* folder")
    p.add_argument("--iteration", type=int, default=None)
    p.add_argument("--grep", default=None, help="only .metadata keys matching this regex")
    p.add_argument("--chunks", action="store_true", help="print every saved chunk's offsets and sizes")
    p.add_argument("--objects", action="store_true", help="decode the pickled byte entries (not rng/_extra_state)")
    a = p.parse_args(argv)
    iter_dir = _iteration_dir(a.checkpoint, a.iteration)
    list_checkpoint(iter_dir, re.compile(a.grep) if a.grep else None, a.chunks, a.objects)
    return 0


if __name__ == "__main__":
    sys.exit(main())
