"""megatron-core's `torch_dist` spelling, both directions: each file name and DCP key is written by one
formatter here and parsed by its one parser here; the reader, the direct writer and the training side
import them (nothing else spells a torch_dist key).

An iteration folder holds `.metadata` (DCP's index), `__<rank>_<n>.distcp` (the data, `n` per rank from
0), `metadata.json` (`sharded_backend`, content metadata) and, up to megatron-core 0.18, `common.pt`
(from 0.19 the ShardedObject `versions.COMMON_STATE_ITEM` inside rank 0's .distcp file).

Keys of optimizer state (with a ChainedOptimizer [dense, expert] prefixed `chained_<i>.`):
- model space (`fully_reshardable`, the FP32 / Float16 optimizers): `optimizer.state.<what>.<model key>`;
- flat buckets (`dp_reshardable`): `optimizer.distributed.dp_group_idx_<m>.gbuf_idx_<g>.dtype_(<param
  dtype>, <grad dtype>).bucket_idx_<b>.<what>`, and per model-parallel rank objects
  `optimizer.distributed.dp_group_idx_<m>.<name>` (`optimizer`, `per_bucket_numel`, `grad_scaler`, ...);
- a ShardedObject's DCP key is `<key>/shard_<offset>_<shape>` (dotted tuples).
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from megatron_ucp.core.optimizers import STATE_ORDER

COMMON_FILENAME = "common.pt"  # megatron-core <= 0.18; from 0.19 the ShardedObject versions.COMMON_STATE_ITEM
DCP_METADATA_FILENAME = ".metadata"
METADATA_JSON_FILENAME = "metadata.json"
RERUN_STATE_KEY = "rerun_state_machine_state"
RNG_STATE_KEY = "rng_state"
OPTIMIZER_PREFIXES = ("optimizer.", "chained_")  # every key of optimizer state starts with one of these

_DISTCP = re.compile(r"__(\d+)_(\d+)\.distcp")
DATA_FILE = _DISTCP  # a data file of the format, relative to the iteration folder
_CHAINED = r"(?:chained_(\d+)\.)?"
# what: the main weight ('param' fully_reshardable, 'fp32_param' Float16 optimizer) or a state by its torch name
_MODEL_SPACE = re.compile(r"^" + _CHAINED + r"optimizer\.state\.(" + "|".join(("param", "fp32_param", *STATE_ORDER))
                          + r")\.(.+)$")
_BUCKET = re.compile(r"^" + _CHAINED + r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((.+), "
                     r"(.+)\)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
_DISTRIBUTED = re.compile(r"^" + _CHAINED + r"optimizer\.distributed\.")
_SCALER = re.compile(r"^" + _CHAINED + r"optimizer\.distributed\.dp_group_idx_\d+\.grad_scaler/")


def distcp_name(rank: int, n: int) -> str:
    """The n-th data file of a global rank."""
    return f"__{rank}_{n}.distcp"


def is_distcp_name(name: str) -> bool:
    return _DISTCP.fullmatch(name) is not None


def chained_prefix(index: Optional[int]) -> str:
    """`chained_<i>.` for optimizer `index` of a ChainedOptimizer; '' for a single optimizer (None)."""
    return "" if index is None else f"chained_{index}."


def model_space_state_key(what: str, model_key: str, prefix: str = "") -> str:
    """Key of optimizer state saved like the model tensor `model_key` ('param', 'fp32_param', 'exp_avg',
    'exp_avg_sq'): fully_reshardable distributed optimizer, FP32 and Float16 optimizers."""
    return f"{prefix}optimizer.state.{what}.{model_key}"


def parse_model_space_state_key(key: str) -> Optional[tuple[str, str]]:
    """(what, model key) of a model-space optimizer-state key; None for any other key."""
    m = _MODEL_SPACE.match(key)
    return (m.group(2), m.group(3)) if m else None


class BucketKey(NamedTuple):
    optimizer: Optional[int]  # index in the ChainedOptimizer; None without the chained_ prefix
    mp_rank: int  # dp_group_idx
    gbuf: int
    dtypes: tuple[str, str]  # (param dtype, grad dtype) as spelled in the key
    bucket: int
    what: str  # 'param', 'exp_avg' or 'exp_avg_sq'


def flat_bucket_key(mp_rank: int, gbuf: int, dtypes: tuple, bucket: int, what: str, prefix: str = "") -> str:
    """Key of one dp_reshardable flat bucket tensor ('param', 'exp_avg', 'exp_avg_sq'); `dtypes` is the
    buffer's (param dtype, grad dtype)."""
    return (f"{prefix}optimizer.distributed.dp_group_idx_{mp_rank}.gbuf_idx_{gbuf}.dtype_({dtypes[0]}, "
            f"{dtypes[1]}).bucket_idx_{bucket}.{what}")


def parse_flat_bucket_key(key: str) -> Optional[BucketKey]:
    m = _BUCKET.match(key)
    if not m:
        return None
    chained, mp, gbuf, d0, d1, bucket, what = m.groups()
    return BucketKey(None if chained is None else int(chained), int(mp), int(gbuf), (d0, d1), int(bucket), what)


def distributed_optimizer_object_key(mp_rank: int, name: str, prefix: str = "") -> str:
    """Key of a per model-parallel rank object of the distributed optimizer ('optimizer' (param groups),
    'per_bucket_numel', 'per_bucket_numel_unpadded', 'grad_scaler')."""
    return f"{prefix}optimizer.distributed.dp_group_idx_{mp_rank}.{name}"


def is_distributed_optimizer_key(key: str) -> bool:
    """A key of the distributed optimizer's own state (flat buckets, per-rank objects), not model-space state."""
    return _DISTRIBUTED.match(key) is not None


def is_grad_scaler_key(key: str) -> bool:
    """A dp_reshardable optimizer's fp16 loss-scaler object (one per model-parallel rank)."""
    return _SCALER.match(key) is not None


def sharded_object_key(key: str, offset: tuple, shape: tuple) -> str:
    """The DCP key of a megatron-core ShardedObject (its unique_key): `<key>/shard_<offset>_<shape>`."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


def extra_state_key(param_key: str) -> str:
    """The ShardedObject key of the `_extra_state` beside a module's parameter key (TE / fp8 modules)."""
    return f"{param_key.rsplit('.', 1)[0]}._extra_state"


_SHARDED_OBJECT = re.compile(r"^(.+)/shard_(\d+(?:\.\d+)*)_(\d+(?:\.\d+)*)$")


def parse_sharded_object_key(key: str) -> Optional[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(key, offset, shape) of a ShardedObject's DCP key; None for any other key."""
    m = _SHARDED_OBJECT.match(key)
    if not m:
        return None
    return m.group(1), tuple(int(x) for x in m.group(2).split(".")), tuple(int(x) for x in m.group(3).split("."))


# The common state (args, iteration, scheduler) where a release keeps it as a ShardedObject (versions.py's
# torch_dist_common == "sharded", megatron-core >= 0.19): the object "common_state", one shard at offset 0 of 1.
COMMON_STATE_KEY = "common_state"
COMMON_STATE_ITEM = sharded_object_key(COMMON_STATE_KEY, (0,), (1,))
