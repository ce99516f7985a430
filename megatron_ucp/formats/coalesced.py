"""The distributed optimizer's state gathered over DP with the bucket-end padding removed: megatron-core's
`dp_zero_gather_scatter` form, `{'buckets_coalesced': True, gbuf: {(param dtype, grad dtype): {'param',
'exp_avg', 'exp_avg_sq': flat fp32, 'numel_unpadded'}}}`. Legacy `torch` checkpoints keep it in
`distrib_optim.pt`; torch_dist checkpoints of megatron-core <= 0.14 saved with `dp_zero_gather_scatter` keep
one such object per model-parallel rank. Both readers check and read it here."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional

from megatron_ucp.adapters.gpt import is_buffer
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.serialization.records import sub_record
from megatron_ucp.formats.bucket_layout import (
    BufferLayout, BufferParam, DDPBucketConfig, build_chunk_buffers, shared_embedding_names)
from megatron_ucp.formats.common import STATE_DTYPE, CheckpointFormatError, check_dtype, structure_error


def coalesced_buffers(distopt: Any, chunks: list[list[BufferParam]], args: Mapping[str, Any], layout: ParallelLayout,
                      *, pp_rank: int, experts: bool, where: Any, what: str) -> tuple[list[int], list[list[BufferLayout]]]:
    """One optimizer's DDP buffers gathered over DP with the bucket-end padding removed ({'buckets_coalesced': True,
    gbuf: {(param dtype, grad dtype): {'param', 'exp_avg', 'exp_avg_sq': flat fp32, 'numel_unpadded'}}}: a
    distrib_optim.pt entry, and torch_dist's dp_zero_gather_scatter object of one model-parallel rank), checked
    against the buffer layout the args give for the rank's `chunks` of parameters (each chunk in registration
    order, persistent buffers included: skipped). Returns (first gbuf index per chunk, buffers per chunk)."""
    if not isinstance(distopt, dict):
        raise structure_error(where, f"{what} (a dict)", distopt)
    if not distopt.get("buckets_coalesced"):
        raise CheckpointFormatError(
            f"{where}: distributed optimizer state without 'buckets_coalesced' (written by an older "
            f"Megatron-LM with per-bucket lists, or not a distrib_optim.pt); resave it with "
            f"megatron-core >= 0.7 (load it there and save again) before converting.")
    num_params = sum(p.numel for chunk in chunks for p in chunk if not is_buffer(p.name))
    gbuf, bases, layouts = 0, [], []
    for chunk, params in enumerate(chunks):
        config = DDPBucketConfig.from_megatron_args(args, layout, pp_rank=pp_rank, vpp_chunk=chunk,
                                                    rank_num_parameters=num_params, experts=experts)
        shared = shared_embedding_names(args, layout, pp_rank=pp_rank, vpp_chunk=chunk,
                                        names=[p.name for p in params])
        params = [replace(p, shared_embedding=p.name in shared) for p in params if not is_buffer(p.name)]
        buffers = build_chunk_buffers(params, config, experts=experts) if params else []
        bases.append(gbuf)
        layouts.append(buffers)
        for buf in buffers:
            dtypes = (buf.param_dtype, buf.grad_dtype)
            saved = distopt.get(gbuf)
            found = saved.get(dtypes) if isinstance(saved, dict) else None
            if not isinstance(found, dict):
                held = [(k, [tuple(map(str, d)) if isinstance(d, tuple) else str(d) for d in v])
                        for k, v in distopt.items() if k != "buckets_coalesced" and isinstance(v, dict)]
                raise CheckpointFormatError(
                    f"{where}: no buffer {gbuf} with dtypes {tuple(map(str, dtypes))} (found {held}); "
                    f"the DDP settings in args do not match the saved buffers.")
            for key in ("param", "exp_avg", "exp_avg_sq"):
                t = check_dtype(found.get(key), (STATE_DTYPE,), path=where, what=f"buffer {gbuf} '{key}'")
                if (len(t.shape) != 1 or not t.is_c_contiguous() or t.numel != buf.numel_unpadded
                        or found.get("numel_unpadded") != buf.numel_unpadded):
                    raise CheckpointFormatError(
                        f"{where}: buffer {gbuf} '{key}' has shape {t.shape} (numel_unpadded="
                        f"{found.get('numel_unpadded')}) but the model's parameters with 64-element alignment "
                        f"need {buf.numel_unpadded} elements in one flat tensor; the file does not belong to this "
                        f"model or uses an unsupported buffer layout.")
            gbuf += 1
    held = [k for k in distopt if k != "buckets_coalesced"]
    if gbuf != len(held):
        raise CheckpointFormatError(f"{where}: holds {len(held)} buffers, the model needs {gbuf} "
                                    f"({'expert' if experts else 'dense'} optimizer).")
    return bases, layouts


def coalesced_records(distopt: dict, gbuf_base: list[int], buffers: list[list[BufferLayout]], chunk: int,
                      name: str) -> Optional[dict]:
    """The parameter's main weight ('fp32') and Adam moments in checked coalesced buffers (`coalesced_buffers`), as
    tensor records of its span; None when no buffer of the chunk holds it."""
    for i, buf in enumerate(buffers[chunk]):
        try:
            span = buf.span(name)
        except KeyError:
            continue
        saved = distopt[gbuf_base[chunk] + i][(buf.param_dtype, buf.grad_dtype)]
        start = buf.coalesced_offset(span)
        return {("fp32" if key == "param" else key): sub_record(saved[key], start, span.shape)
                for key in ("param", "exp_avg", "exp_avg_sq")}
    return None
