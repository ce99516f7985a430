"""The universal checkpoint's metadata.json content for a converted Megatron checkpoint (docs/FORMAT.md):
iteration, consumed samples, FLOP counter, source, model config, args (JSON-safe), optimizer
hyper-parameters, scheduler state, loss scaler; and the source's RNG states for the writer's RNG file."""

from __future__ import annotations

import enum
import math
import os
from pathlib import Path
from typing import Any

from megatron_ucp.convert.tasks import ConversionError
from megatron_ucp.formats import CheckpointReader, PickledEnum
from megatron_ucp.universal.format import optimizer_section


_DROP = object()


def json_safe(value: Any) -> Any:
    """A JSON value for `value`, or _DROP when it has none (non-finite floats become "nan"/"inf"/"-inf")."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__module__}.{type(value).__qualname__}.{value.name}"
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, PickledEnum):
        inner = json_safe(value.value)
        return _DROP if inner is _DROP else {"enum": value.qualname, "value": inner}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":  # torch.float32 -> "torch.float32"
        return str(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalars
        return json_safe(value.item())
    if isinstance(value, (list, tuple)):
        items = [json_safe(v) for v in value]
        return _DROP if any(v is _DROP for v in items) else items
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return _DROP
        items = {k: json_safe(v) for k, v in value.items()}
        return _DROP if any(v is _DROP for v in items.values()) else items
    return _DROP


def _json_args(args: dict) -> tuple[dict, list[str]]:
    kept, dropped = {}, []
    for key, value in args.items():
        safe = json_safe(value)
        if safe is _DROP:
            dropped.append(key)
        else:
            kept[key] = safe
    return kept, sorted(dropped)


def build_metadata(ckpt: CheckpointReader, *, average_replicas: bool) -> dict:
    common = ckpt.common_state()
    args, dropped = _json_args(ckpt.args)
    groups = common.get("param_groups")
    # `step` is per parameter in the universal format; the rest are the group's hyper-parameters.
    hyper = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups] if groups else []
    param_groups = json_safe(hyper)
    if param_groups is _DROP:
        raise ConversionError(f"{ckpt.path}: optimizer param groups hold values that are not JSON ({hyper})")
    scheduler = json_safe(common.get("opt_param_scheduler") or {})
    if scheduler is _DROP:
        raise ConversionError(f"{ckpt.path}: the scheduler state holds values that are not JSON")
    return {
        "iteration": int(ckpt.iteration),
        "consumed_train_samples": int(common.get("consumed_train_samples") or 0),
        "consumed_valid_samples": int(common.get("consumed_valid_samples") or 0),
        "num_floating_point_operations_so_far": json_safe(common.get("num_floating_point_operations_so_far")),
        "source": {
            "format": ckpt.format,
            "path": str(Path(ckpt.path).resolve()),
            "layout": ckpt.layout.to_dict(),
            "optimizer_kind": ckpt.optimizer_kind,
            "checkpoint_version": json_safe(common.get("checkpoint_version")),
            "megatron_core": ckpt.release.name,  # the release that wrote it (core/versions.py)
            **_notices(ckpt),
        },
        "model_config": ckpt.config.to_dict(),
        "args": args,
        "args_dropped": dropped,
        "optimizer": optimizer_section(ckpt.optimizer_name, param_groups, ckpt.args),
        "scheduler": scheduler,
        "loss_scaler": _loss_scaler(ckpt),
        "conversion": {"tool": "megatron-ucp to-universal", "average_replicas": bool(average_replicas)},
    }


def _notices(ckpt: CheckpointReader) -> dict:
    """What the source's release saved wrongly and what the conversion did about it (CheckpointReader.notices),
    kept as source.notices; nothing when there is nothing to say."""
    notices = ckpt.notices()
    return {"notices": list(notices)} if notices else {}


# --- run state besides tensors (docs/FORMAT.md "Loss scaler", "RNG states") -------------------------

def _loss_scaler(ckpt: CheckpointReader):
    """The source's dynamic loss-scaler state as JSON (None without one: fp32, bf16, --loss-scale)."""
    if ckpt.optimizer_kind == "none":
        return None
    scaler = ckpt.loss_scaler()
    return scaler.to_json() if scaler is not None else None


def saved_rng_states(ckpt: CheckpointReader):
    """The source's per-rank RNG states with the layout and micro-batch size they were drawn at, for
    UniversalWriter.finish (None when the checkpoint saved none)."""
    from megatron_ucp.universal import SavedRngStates

    states = ckpt.rng_states()
    if not states:
        return None
    mbs = ckpt.args.get("micro_batch_size")
    return SavedRngStates(states=tuple(states), layout=ckpt.layout,
                          micro_batch_size=int(mbs) if isinstance(mbs, int) else None)
