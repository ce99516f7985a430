"""Partial bugs, planted: copies of a universal checkpoint with one thing wrong, written through the
format's own writer (checksums and marker valid, so only the planted change differs). Negative controls
resume from them and must leave the continuation tolerance, proving the tolerance sees partial bugs.

Each edit is what a converter bug of that kind would produce:
- `swap_tp_shards`: one parameter's tensor with its two TP shards (halves along the pattern's dim) in
  the wrong order, as a consolidation that concatenated the ranks backwards would write;
- `steps_plus_one`: every parameter's Adam step off by one (bias correction);
- `scheduler_reset`: the LR scheduler's num_steps back to 0 (warmup restarts);
- `swap_qkv_groups`: one layer's fused QKV rows with query groups 0 and 1 exchanged (weights and both
  moments), as a wrong group order in the grouped_qkv pattern would write;
- `without_loss_scaler`: the fp16 loss-scaler state dropped from metadata.json (a converter that ignores it).
`repadded` is not a bug: the vocabulary re-padded offline exactly as the loader re-pads it, the reference
for the loader's own re-padding at another TP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from megatron_ucp.adapters.gpt import expected_parameters
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.universal import UniversalCheckpoint, UniversalWriter

TensorEdit = Callable[[str, str, torch.Tensor], torch.Tensor]  # (name, key, tensor) -> tensor


def edited_copy(src: Path, dst: Path, *, tensors: Optional[TensorEdit] = None,
                metadata: Optional[Callable[[dict], None]] = None,
                steps: Optional[Callable[[str, Optional[int]], Optional[int]]] = None) -> Path:
    """Rewrite the universal checkpoint `src` as `dst` with the given edits (no RNG file: a resume at another
    layout re-seeds anyway)."""
    ucp = UniversalCheckpoint.open(src)
    meta = {k: v for k, v in ucp.metadata.items() if k not in ("format", "version", "parameters", "rng", "lazy")}
    if metadata:
        metadata(meta)
    with UniversalWriter(dst) as writer:
        for name, info in ucp.parameters.items():
            data: Dict[str, torch.Tensor] = {key: ucp.read(name, key) for key in info.tensors}
            if tensors:
                data = {key: tensors(name, key, t).contiguous() for key, t in data.items()}
            step = steps(name, info.step) if steps else info.step
            writer.write_parameter(name, data, {"model_dtype": info.model_dtype, "pattern": info.pattern,
                                                "step": step, "param_group": info.param_group})
        return writer.finish(meta, expected_parameters(GPTModelConfig.from_dict(meta["model_config"])))


def swap_tp_shards(src: Path, dst: Path, param: str, key: str = "exp_avg_sq") -> Path:
    """`param`'s `key` with its two TP=2 shards (halves along the pattern's dim) exchanged."""
    ucp = UniversalCheckpoint.open(src)
    dim = ucp.parameters[param].pattern.dim

    def edit(name, k, t):
        if name != param or k != key:
            return t
        a, b = t.chunk(2, dim=dim)
        return torch.cat([b, a], dim=dim)

    return edited_copy(src, dst, tensors=edit)


def steps_plus_one(src: Path, dst: Path) -> Path:
    return edited_copy(src, dst, steps=lambda name, step: None if step is None else step + 1)


def scheduler_reset(src: Path, dst: Path) -> Path:
    def edit(meta):
        meta["scheduler"] = dict(meta["scheduler"], num_steps=0)

    return edited_copy(src, dst, metadata=edit)


def swap_qkv_groups(src: Path, dst: Path, layer: int) -> Path:
    """Layer `layer`'s linear_qkv weight rows (every stored tensor) with query groups 0 and 1 exchanged."""
    param = f"decoder.layers.{layer}.self_attention.linear_qkv.weight"
    ucp = UniversalCheckpoint.open(src)
    pattern = ucp.parameters[param].pattern.to_json()
    rows = (pattern["heads_per_group"] + 2) * pattern["head_dim"]

    def edit(name, key, t):
        if name != param:
            return t
        out = t.clone()
        out[:rows], out[rows:2 * rows] = t[rows:2 * rows], t[:rows]
        return out

    return edited_copy(src, dst, tensors=edit)


def without_loss_scaler(src: Path, dst: Path) -> Path:
    def edit(meta):
        meta["loss_scaler"] = None

    return edited_copy(src, dst, metadata=edit)


def repadded(src: Path, dst: Path, padded_vocab_size: int) -> Path:
    """The vocabulary tensors re-padded to `padded_vocab_size` rows with patterns.resize_vocab (weights: the
    mean padding row, moments: zeros), model_config.padded_vocab_size updated."""
    from megatron_ucp.adapters.gpt import is_vocab_parameter
    from megatron_ucp.core.patterns import resize_vocab

    true_vocab = UniversalCheckpoint.open(src).config.vocab_size

    def edit(name, key, t):
        if not is_vocab_parameter(name):
            return t
        return resize_vocab(t, padded_vocab_size, true_vocab, fill="zeros" if key != "fp32" else "mean_padding")[0]

    def config(meta):
        meta["model_config"] = dict(meta["model_config"], padded_vocab_size=padded_vocab_size)

    return edited_copy(src, dst, tensors=edit, metadata=config)
