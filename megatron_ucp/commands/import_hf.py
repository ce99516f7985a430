"""`megatron-ucp import-hf`: a universal checkpoint (weights only, iteration 0) from a Hugging Face model directory.

The input is untrusted and only read as data: `config.json` (and `model.safetensors.index.json`,
`tokenizer.json`) as JSON, the weights as safetensors parsed here (header JSON, then raw bytes read with pread);
no pickle, no remote code. Every file must resolve inside HF_DIR (or, for a Hugging Face hub cache snapshot, inside
that repository's `blobs/`), every header's declared dtype, shape and byte range is checked against the file's
size before anything is allocated, config.json's layer and expert counts are checked against the tensors the
headers hold before any per-layer work, and one band of rows (16 MiB in fp32; GPT-2's transposed Conv1D weights
whole) is in memory at a time, so memory stays bounded whatever the model size.

`adapters/hf.py` is the mapping (the same table `export-hf` uses) and the per-family facts of config.json:
Megatron's fused QKV per query group, SwiGLU `[gate; up]`, routed experts by global index, DeepSeek-V3's
multi-latent attention (RoPE rows permuted when config.json's rope_interleave is false), its router's correction
bias as megatron-core's expert_bias buffer, its MTP layers (stored after the decoder's) as Megatron's
mtp.layers.<k> (--mtp-num-layers) or, with --drop-mtp, left out. config.json is read
as transformers 5 reads it (its config classes' defaults, its RoPE parameters: `rope_scaling` before
`rope_parameters`), every value type-checked. Weights are widened to fp32 exactly (bf16 and fp16 are subsets of
fp32); the vocabulary is padded to Megatron-LM's rule at TP1 (`--make-vocab-size-divisible-by`, the padding rows
filled as `patterns.resize_vocab` fills them: the mean row). The HF config becomes the universal checkpoint's
model config and Megatron-LM args, and the flags that build the model (tokenizer included) are returned and
printed. Configurations Megatron's GPT cannot compute exactly are refused in one line naming the field and why.
Output: through UniversalWriter (locked, staged, checksummed, published only when complete), after checking that
it fits the free space at DST.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from megatron_ucp.adapters.hf import (DEEPSEEK_LATENT_NORM_EPS, MEGATRON_LLAMA3_ROPE, MEGATRON_MLA_YARN,
                                      MLA_WITHOUT_Q_LORA, MODEL_TYPES, VOCAB, ZERO, HFConfigFacts, HFFamily, HFRow,
                                      family, from_hf_bands, hf_rows,
                                      hf_shapes, layer_of, stored_layers_and_experts, yarn_mscale)
from megatron_ucp.commands.common import add_publication_flags
from megatron_ucp.core.dtypes import SAFETENSORS, itemsize
from megatron_ucp.core.model_config import GPTModelConfig, pad_vocab_size
from megatron_ucp.core.versions import NEWEST, MegatronRelease

PathLike = Union[str, os.PathLike]
MAX_JSON = 64 << 20  # bytes a config.json, index, tokenizer.json or safetensors header may take
_DTYPES = {code: SAFETENSORS[code] for code in ("F32", "BF16", "F16")}  # what a checkpoint may hold
BAND_BYTES = 16 << 20  # fp32 bytes of a parameter widened at a time (one band of rows)
# HF tensors that are derived buffers, never weights (older Llama checkpoints store RoPE's inv_freq).
_DERIVED = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
# Megatron-LM pads to a multiple of this times TP (default 128); larger only adds rows no token uses
MAX_VOCAB_MULTIPLE = 1 << 16
# RoPE types transformers computes and megatron-core's GPT does not, and why
_ROPE_REFUSALS = {
    "linear": "Megatron-LM's GPT builder does not pass --rotary-seq-len-interpolation-factor to the model",
    "dynamic": "dynamic NTK rescales RoPE with the sequence length at run time; megatron-core has no such mode",
    "yarn": "megatron-core applies YaRN to multi-latent attention (--rope-type yarn) and to GPTModel's "
            "--position-embedding-type yarn, whose original_max_position_embeddings, beta_fast and beta_slow "
            "Megatron-LM 0.19's GPT builder does not pass on",
}
# A tokenizer Megatron-LM's HuggingFaceTokenizer loads from the folder (transformers' AutoTokenizer files)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class HFImportError(ValueError):
    """The HF directory cannot be imported; the message names the file or field, the cause and the fix."""


def _fail(message: str) -> None:
    raise HFImportError(message)


# --------------------------------------------------------------------------------------------------
# Reading the HF directory (JSON and safetensors only)


def _parse_json(data: bytes, path: Path, what: str) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        _fail(f"{path}: {what} is nested too deeply to be a Hugging Face {what}; re-download or re-save the model")
    except (ValueError, UnicodeDecodeError) as e:
        _fail(f"{path}: {what} is not valid JSON ({e}); re-download or re-save the model")


def _read_json(path: Path, what: str) -> Any:
    try:
        size = path.stat().st_size
    except OSError as e:
        _fail(f"{path}: cannot read {what} ({e.strerror}); pass a Hugging Face model directory")
    if size > MAX_JSON:
        _fail(f"{path}: {size} bytes is too large for {what}; the file is not a Hugging Face {what}")
    try:
        data = path.read_bytes()
    except OSError as e:
        _fail(f"{path}: cannot read {what} ({e.strerror})")
    return _parse_json(data, path, what)


def _allowed_roots(root: Path) -> list[Path]:
    """Where HF_DIR's files may resolve: HF_DIR, and for a snapshot of the Hugging Face hub cache
    (.../models--ORG--NAME/snapshots/REV, whose files link to ../../blobs/HASH) that repository's blobs."""
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        roots.append(root.parent.parent / "blobs")
    return roots


def _inside(root: Path, rel: Any, source: Path) -> Path:
    """`rel` resolved inside root (no absolute paths, no '..', no symlink out but a hub snapshot's into its
    repository's blobs)."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\0" in rel:
        _fail(f"{source}: shard file name {rel!r} is not a relative file name; the index must name files in "
              f"{root}")
    path = (root / rel).resolve()
    if not any(allowed in path.parents for allowed in _allowed_roots(root)):
        _fail(f"{source}: {rel!r} resolves to {path}, outside {root}; refusing to read it (fix the index, or copy "
              f"the model with its links followed: cp -rL {root} NEW_DIR)")
    return path


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes are, checked against the file's size."""

    file: Path
    offset: int
    dtype: str  # "float32", "bfloat16", "float16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (4 if self.dtype == "float32" else 2)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, every declared range checked against the file before reading."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                _fail(f"{path}: {size} bytes, too short for a safetensors file; re-download it")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(MAX_JSON, size - 8):
                _fail(f"{path}: declares a {hlen}-byte header in a {size}-byte file; the file is truncated or "
                      f"not safetensors, re-download it")
            raw = f.read(hlen)
    except OSError as e:
        _fail(f"{path}: cannot read ({e.strerror})")
    header = _parse_json(raw, path, "safetensors header")
    if not isinstance(header, dict):
        _fail(f"{path}: safetensors header is not an object; re-download it")
    data_start, out, ranges = 8 + hlen, {}, []
    for name, d in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, offsets = (d.get(k) for k in ("dtype", "shape", "data_offsets")) if isinstance(d, dict) else \
            (None, None, None)
        if not (isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape) and isinstance(offsets, list)
                and len(offsets) == 2 and all(_is_int(n) for n in offsets)):
            _fail(f"{path}: tensor {name!r} has a malformed header entry {str(d)[:200]}; re-download the file")
        if dtype not in _DTYPES:
            _fail(f"{path}: tensor {name} is {dtype}; a model's weights must be F32, BF16 or F16 (quantized or "
                  f"integer checkpoints are not imported: dequantize to a float dtype first)")
        (start, end), shape = offsets, tuple(shape)
        torch_dtype, width = _DTYPES[dtype], itemsize(_DTYPES[dtype])
        if start < 0 or end - start != math.prod(shape) * width:
            _fail(f"{path}: tensor {name} declares shape {list(shape)} {dtype} but bytes [{start}, {end}); the "
                  f"header is inconsistent, re-download the file")
        if data_start + end > size:
            _fail(f"{path}: tensor {name} ends at byte {data_start + end} of a {size}-byte file; the file is "
                  f"truncated, re-download it")
        ranges.append((start, end, name))
        out[name] = StoredTensor(path, data_start + start, torch_dtype, shape)
    ranges.sort()
    for (_, end_a, a), (start_b, _, b) in zip(ranges, ranges[1:]):
        if start_b < end_a:
            _fail(f"{path}: tensors {a} and {b} overlap in the file; the header is inconsistent, re-download it")
    return out


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of HF_DIR: the index's shards (each inside root) or model.safetensors."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        doc = _read_json(_inside(root, index.name, root), "safetensors index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            _fail(f"{index}: has no 'weight_map'; re-download the index")
        files = sorted({_inside(root, rel, index) for rel in weight_map.values()})
        for f in files:
            if not f.is_file():
                _fail(f"{index}: names shard {f.name}, which is missing; download every shard of the model")
        return files
    single = root / "model.safetensors"
    if single.is_file():
        return [_inside(root, single.name, root)]
    pickled = [p.name for p in root.glob("*.bin")] + [p.name for p in root.glob("*.pt")]
    if pickled:
        _fail(f"{root}: has only pickled weights ({', '.join(sorted(pickled)[:3])}); they are never loaded "
              f"(pickle runs code). Convert them to safetensors in a trusted environment first")
    _fail(f"{root}: no model.safetensors or model.safetensors.index.json; pass a Hugging Face model directory")


def read_tensor(t: StoredTensor, rows: Optional[tuple[int, int]] = None) -> "torch.Tensor":
    """The tensor (or rows [r0, r1) of dim 0) read with pread into fresh memory, in its stored dtype."""
    import torch

    row_bytes = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
    r0, r1 = rows if rows is not None else (0, t.shape[0] if t.shape else 1)
    nbytes = (r1 - r0) * row_bytes if t.shape else t.nbytes
    buffer = bytearray(nbytes)
    with open(t.file, "rb") as f:
        view, done = memoryview(buffer), 0
        while done < nbytes:
            n = os.preadv(f.fileno(), [view[done:]], t.offset + r0 * row_bytes + done)
            if n <= 0:
                _fail(f"{t.file}: ended early while reading; the file is truncated, re-download it")
            done += n
    shape = ((r1 - r0), *t.shape[1:]) if t.shape else ()
    if nbytes == 0:
        return torch.empty(shape, dtype=getattr(torch, t.dtype))
    return torch.frombuffer(buffer, dtype=getattr(torch, t.dtype)).reshape(shape)


def tokenizer_vocabulary(root: Path) -> tuple[Optional[str], Optional[int]]:
    """(the tokenizer file Megatron-LM's HuggingFaceTokenizer would load from HF_DIR or None, the largest token
    id of tokenizer.json when it has one)."""
    present = next((n for n in _TOKENIZER_FILES if (root / n).is_file()), None)
    if present != "tokenizer.json":
        return present, None
    path = _inside(root, present, root)
    doc = _read_json(path, "tokenizer.json")
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab))) if isinstance(vocab, list) \
        else []
    added = doc.get("added_tokens") if isinstance(doc, dict) else None
    ids += [t.get("id") for t in added if isinstance(t, dict)] if isinstance(added, list) else []
    ids = [i for i in ids if _is_int(i)]
    return present, max(ids) if ids else None


# --------------------------------------------------------------------------------------------------
# config.json -> Megatron model config and args

_ABSENT = object()


class _Config:
    """config.json's values, each type-checked when read; a key config.json omits takes the family's transformers
    default (`HFConfigFacts.defaults`), then the reader's."""

    def __init__(self, doc: dict, facts: HFConfigFacts, path: str = "config.json"):
        self.doc, self.defaults, self.aliases, self.path = doc, facts.defaults, facts.aliases, path

    def raw(self, key: str, default: Any = None) -> Any:
        spelled = [k for k in (key, *self.aliases.get(key, ())) if k in self.doc]
        if len({json.dumps(self.doc[k]) for k in spelled}) > 1:
            _fail(f"{self.path}: {' and '.join(f'{k}={self.doc[k]!r}' for k in spelled)} disagree (transformers "
                  f"reads them as one field); keep one of them")
        if spelled:
            return self.doc[spelled[0]]
        return self.defaults.get(key, default)

    def _bad(self, key: str, value: Any, want: str) -> None:
        _fail(f"{self.path}: {key} {value!r} is not {want}; fix config.json")

    def int(self, key: str, default: Any = _ABSENT, minimum: int = 1) -> int:
        value = self.raw(key)
        if value is None:
            value = default
        if value is _ABSENT:
            _fail(f"{self.path}: {key} is missing; the config is incomplete (re-download config.json)")
        if not _is_int(value) or value < minimum:
            self._bad(key, value, "a positive integer" if minimum == 1 else f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: float, *, positive: bool = True) -> float:
        value = self.raw(key)
        value = default if value is None else value
        if not (_is_number(value) and (value > 0 if positive else value >= 0)):
            self._bad(key, value, "a positive number" if positive else "a number >= 0")
        return float(value)

    def _typed(self, key: str, default: Any, kind: type, want: str) -> Any:
        value = self.raw(key)
        value = default if value is None else value
        if not isinstance(value, kind):
            self._bad(key, value, want)
        return value

    def flag(self, key: str, default: bool) -> bool:
        return self._typed(key, default, bool, "true or false")

    def text(self, key: str, default: str) -> str:
        return self._typed(key, default, str, "a string")


def _refuse(model_type: str, what: str, why: str) -> None:
    _fail(f"config.json: {what}: Megatron's GPT cannot express it as {model_type} ({why})")


def _rope(cfg: _Config, model_type: str, max_positions: int, mla: bool = False) -> dict:
    """Megatron's RoPE args from config.json, read as transformers 5 reads it (PreTrainedConfig.
    convert_rope_params_to_dict / standardize_rope_params): `rope_scaling` if set, else `rope_parameters`; their
    rope_theta, else the top-level one, else the class default; rope_type, else type, else default. Under
    multi-latent attention, megatron-core's own RoPE types (`_mla_rope`)."""
    legacy, params = cfg.raw("rope_scaling"), cfg.raw("rope_parameters")
    source = "rope_scaling" if legacy else "rope_parameters"
    chosen = legacy or params or {}
    if not isinstance(chosen, dict):
        _fail(f"config.json: {source} {chosen!r} is not an object; fix config.json")
    layer_types = cfg.raw("layer_types")
    if isinstance(layer_types, list) and any(k in layer_types for k in chosen):
        _refuse(model_type, f"{source} per layer type", "Megatron's GPT uses one RoPE in every layer")
    rope_type = chosen["rope_type"] if "rope_type" in chosen else chosen.get("type", "default")
    theta = chosen["rope_theta"] if "rope_theta" in chosen else cfg.raw("rope_theta", 10000.0)
    if not (_is_number(theta) and theta > 0):
        _fail(f"config.json: rope_theta {theta!r} is not a positive number; fix config.json")
    if theta != int(theta):
        _refuse(model_type, f"rope_theta={theta}", "Megatron's --rotary-base is an integer")
    partial = chosen.get("partial_rotary_factor", cfg.raw("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) or isinstance(partial, bool):
        _refuse(model_type, f"partial_rotary_factor={partial}", "use a full-rotary model")
    out = {"rotary_base": int(theta), "rotary_percent": 1.0, "rotary_interleaved": False, "use_rope_scaling": False}
    if mla:
        return {**out, **_mla_rope(cfg, model_type, rope_type, dict(chosen), source, max_positions)}
    if rope_type == "default":
        return out
    if rope_type != "llama3":
        _refuse(model_type, f"RoPE scaling {rope_type!r} (from {source})",
                _ROPE_REFUSALS.get(rope_type, f"megatron-core's RotaryEmbedding has no {rope_type!r} scaling"))
    values = dict(chosen)
    if "original_max_position_embeddings" in cfg.doc:  # transformers: the top-level key wins (Phi-3's spelling)
        values["original_max_position_embeddings"] = cfg.doc["original_max_position_embeddings"]
    values.setdefault("original_max_position_embeddings", max_positions)
    for key, want in MEGATRON_LLAMA3_ROPE.items():
        value = values.get(key)
        if not (_is_number(value) and float(value) == want):
            given = f"{key}={value!r}" if key in values else f"no {key}"
            _refuse(model_type, f"RoPE scaling 'llama3' with {given} (from {source})",
                    "megatron-core 0.19's RotaryEmbedding takes the llama3 factor only (--rope-scaling-factor) and "
                    "computes the rest with " + ", ".join(f"{k}={v:g}" for k, v in MEGATRON_LLAMA3_ROPE.items()))
    factor = values.get("factor")
    if not (_is_number(factor) and factor > 0):
        _fail(f"config.json: RoPE scaling 'llama3' factor {factor!r} (from {source}) is not a positive number; fix "
              f"config.json")
    return {**out, "use_rope_scaling": True, "rope_scaling_factor": float(factor)}


def _mla_rope(cfg: _Config, model_type: str, rope_type: str, values: dict, source: str, max_positions: int) -> dict:
    """megatron-core's MLA RoPE (--rope-type rope, or yarn with --rotary-scaling-factor, --mscale and
    --mscale-all-dim) computing transformers' default or YaRN RoPE exactly: the same inverse frequencies, the same
    factor on cos/sin (transformers' attention_factor: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
    both are set, else mscale(factor); megatron-core: always the ratio) and the same softmax scale (both multiply
    it by mscale(factor, mscale_all_dim)^2)."""
    if rope_type == "default":
        return {"rope_type": "rope"}
    if rope_type != "yarn":
        _refuse(model_type, f"RoPE scaling {rope_type!r} (from {source})",
                "megatron-core's multi-latent attention computes plain RoPE or YaRN only")
    if "original_max_position_embeddings" in cfg.doc:  # transformers: the top-level key wins
        values["original_max_position_embeddings"] = cfg.doc["original_max_position_embeddings"]
    values.setdefault("original_max_position_embeddings", max_positions)
    if values.get("attention_factor") is not None:
        _refuse(model_type, f"YaRN attention_factor={values['attention_factor']!r} (from {source})",
                "megatron-core derives it from --mscale and --mscale-all-dim and takes no other value")
    given = {"original_max_position_embeddings": values["original_max_position_embeddings"],
             "beta_fast": values.get("beta_fast") or 32.0, "beta_slow": values.get("beta_slow") or 1.0,
             "truncate": values.get("truncate", True)}  # transformers' defaults
    for key, want in MEGATRON_MLA_YARN.items():
        if given[key] != want or isinstance(given[key], bool) != isinstance(want, bool):
            _refuse(model_type, f"YaRN {key}={given[key]!r} (from {source})",
                    f"megatron-core 0.19's multi-latent attention computes YaRN with {key}={want} "
                    "(MLATransformerConfig's default; Megatron-LM's arguments do not set it for MLA)")
    factor = values.get("factor")
    if factor is None:  # transformers: the ratio of the context lengths
        factor = max_positions / values["original_max_position_embeddings"]
    mscale, all_dim = values.get("mscale"), values.get("mscale_all_dim")
    for key, value in (("factor", factor), ("mscale", mscale), ("mscale_all_dim", all_dim)):
        if value is not None and not (_is_number(value) and value >= 0):
            _fail(f"config.json: YaRN {key} {value!r} (from {source}) is not a non-negative number; fix config.json")
    if mscale and all_dim:
        megatron = (float(mscale), float(all_dim))
    elif not all_dim:  # transformers: mscale(factor) on cos/sin, the softmax scale unchanged
        megatron = (1.0, 0.0)
    elif yarn_mscale(factor) == 1.0:
        megatron = (1.0, 0.0)
    else:
        _refuse(model_type, f"YaRN mscale_all_dim={all_dim} without mscale (from {source})",
                "transformers then scales cos/sin by mscale(factor) and the softmax by mscale(factor, "
                "mscale_all_dim)^2, megatron-core's cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)")
    return {"rope_type": "yarn", "rotary_scaling_factor": float(factor), "mscale": megatron[0],
            "mscale_all_dim": megatron[1]}


def _gpt2_model(cfg: _Config, vocab: int, divisible: int, args: dict) -> GPTModelConfig:
    model_type = "gpt2"
    act = cfg.text("activation_function", "gelu_new")
    if act != "gelu":
        _refuse(model_type, f"activation_function={act!r}", "megatron-core's GPT MLP computes exact GELU; "
                "HF's gelu_new is its tanh approximation")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if cfg.flag(key, want) != want:
            _refuse(model_type, f"{key}={cfg.raw(key)}", f"Megatron's attention needs {key}={want}")
    if not cfg.flag("tie_word_embeddings", True):
        _refuse(model_type, "tie_word_embeddings=false", "GPT2LMHeadModel ties its output layer to wte")
    hidden, heads = cfg.int("n_embd"), cfg.int("n_head")
    if hidden % heads:
        _refuse(model_type, f"n_embd={hidden} not divisible by n_head={heads}", "heads must split the hidden size")
    args.update(norm_epsilon=cfg.number("layer_norm_epsilon", 1e-5),
                attention_dropout=cfg.number("attn_pdrop", 0.1, positive=False),
                hidden_dropout=cfg.number("resid_pdrop", 0.1, positive=False))
    return GPTModelConfig(
        num_layers=cfg.int("n_layer"), hidden_size=hidden, ffn_hidden_size=cfg.int("n_inner", 4 * hidden),
        num_attention_heads=heads, num_query_groups=heads, kv_channels=hidden // heads, vocab_size=vocab,
        padded_vocab_size=pad_vocab_size(vocab, divisible, 1), make_vocab_size_divisible_by=divisible,
        max_position_embeddings=cfg.int("n_positions"), swiglu=False, normalization="LayerNorm",
        position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
        add_bias_linear=True, add_qkv_bias=True)


def _moe_config(cfg: _Config, fam: HFFamily, num_layers: int, args: dict) -> dict:
    keys, model_type = fam.facts.moe, fam.model_type
    jitter = cfg.number("router_jitter_noise", 0.0, positive=False)
    if jitter:
        _refuse(model_type, f"router_jitter_noise={jitter}", "Megatron's router has no such noise")
    experts = cfg.int(keys.num_experts)
    topk = cfg.int("num_experts_per_tok")
    if topk > experts:
        _fail(f"config.json: num_experts_per_tok={topk} exceeds {keys.num_experts}={experts}; fix config.json")
    # Megatron's default router (top-k of the logits, softmax over the k) is the renormalized top-k of the softmax;
    # --moe-router-pre-softmax (top-k of the full softmax) the top-k not renormalized (norm_topk_prob=false)
    normalized = cfg.flag(keys.norm_topk, False) if keys.norm_topk else True
    args.update(moe_router_topk=topk, moe_aux_loss_coeff=cfg.number("router_aux_loss_coef", 0.0, positive=False),
                moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
                moe_router_pre_softmax=not normalized)
    out = {"num_experts": experts, "moe_ffn_hidden_size": cfg.int(keys.expert_ffn), "moe_layer_freq": 1}
    if keys.sigmoid_router:
        _sigmoid_router(cfg, model_type, experts, topk, normalized, args)
        out["moe_router_enable_expert_bias"] = True  # e_score_correction_bias, a buffer in both
    if keys.shared_count:
        count = cfg.int(keys.shared_count, 0, minimum=0)
        if not count:
            _refuse(model_type, f"{keys.shared_count}=0", "megatron-ucp imports the shared experts as Megatron's "
                    "--moe-shared-expert-intermediate-size; a model without them is not supported")
        out["moe_shared_expert_intermediate_size"] = count * out["moe_ffn_hidden_size"]  # ungated
    if keys.first_dense:
        dense = cfg.int(keys.first_dense, 0, minimum=0)
        if dense >= num_layers:
            _refuse(model_type, f"{keys.first_dense}={dense} with num_hidden_layers={num_layers} (no MoE layer)",
                    f"megatron-ucp imports {fam.architecture} as a Megatron GPT-MoE")
        out["moe_layer_freq"] = tuple(int(i >= dense) for i in range(num_layers)) if dense else 1
    if keys.shared_ffn:
        shared = cfg.int(keys.shared_ffn, 0, minimum=0)
        if not shared:
            _refuse(model_type, f"{keys.shared_ffn}=0", f"{fam.architecture}'s shared expert is always there; use "
                    "--model-type qwen3_moe or mixtral for routed experts only")
        out.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    if keys.sparse_step:
        step = cfg.int("decoder_sparse_step", 1)
        dense = cfg.raw("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(_is_int(i) and 0 <= i < num_layers for i in dense):
            _fail(f"config.json: mlp_only_layers {str(dense)[:100]} is not a list of layer indices below "
                  f"num_hidden_layers={num_layers}; fix config.json")
        freq = tuple(int(i not in set(dense) and (i + 1) % step == 0) for i in range(num_layers))
        out["moe_layer_freq"] = 1 if all(freq) else freq
    return out


def _sigmoid_router(cfg: _Config, model_type: str, experts: int, topk: int, normalized: bool, args: dict) -> None:
    """DeepSeek-V3's router as megatron-core's sigmoid router with the expert bias: its top-k weights are
    renormalized exactly when k > 1 (norm_topk_prob must say so), then scaled (routed_scaling_factor); its groups
    (n_group, topk_group) scored by the sum of their top topk/topk_group experts, transformers' by their top 2."""
    if normalized != (topk > 1):
        _refuse(model_type, f"norm_topk_prob={str(normalized).lower()} with num_experts_per_tok={topk}",
                "megatron-core's sigmoid router renormalizes the top-k weights exactly when k > 1")
    groups, chosen = cfg.int("n_group"), cfg.int("topk_group")
    if experts % groups or chosen > groups:
        _fail(f"config.json: n_group={groups}, topk_group={chosen} do not split {experts} routed experts "
              f"(n_group must divide them, topk_group be at most n_group); fix config.json")
    limited = chosen < groups  # otherwise every group is chosen: no limit on either side
    if limited and topk // chosen != 2:
        _refuse(model_type, f"n_group={groups}, topk_group={chosen} with num_experts_per_tok={topk}",
                "megatron-core scores a group by the sum of its top num_experts_per_tok // topk_group experts, "
                "transformers' DeepseekV3 by its top 2")
    args.update(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                moe_router_topk_scaling_factor=cfg.number("routed_scaling_factor", 1.0),
                moe_router_num_groups=groups if limited else None, moe_router_group_topk=chosen if limited else None,
                moe_router_dtype="fp32")  # transformers keeps the gate and its bias in fp32


def _mla_model(cfg: _Config, fam: HFFamily, vocab: int, divisible: int, args: dict) -> GPTModelConfig:
    """DeepSeek-V3: multi-latent attention with query compression and the q/kv latent norms (megatron-core's
    --multi-latent-attention --q-lora-rank --qk-layernorm), SwiGLU, RMSNorm, the first layers dense, then MoE."""
    model_type = fam.model_type
    act = cfg.text("hidden_act", "silu")
    if act != "silu":
        _refuse(model_type, f"hidden_act={act!r}", "Megatron's --swiglu gates with SiLU")
    if cfg.int("pretraining_tp", 1) != 1:
        _refuse(model_type, f"pretraining_tp={cfg.raw('pretraining_tp')}", "set it to 1")
    if cfg.flag("attention_bias", False):
        _refuse(model_type, "attention_bias=true", "megatron-core's multi-latent attention projections have no "
                "biases but the output projection's, which --add-bias-linear gives the MLP too")
    if cfg.raw("q_lora_rank", 1) is None:  # an explicit null: DeepSeek-V2-Lite's q_proj
        _refuse(model_type, "q_lora_rank=null (a query projection without compression: DeepSeek-V2-Lite)",
                MLA_WITHOUT_Q_LORA)
    eps = cfg.number("rms_norm_eps", 1e-6)
    if eps != DEEPSEEK_LATENT_NORM_EPS:
        _refuse(model_type, f"rms_norm_eps={eps}", f"transformers' q_a_layernorm and kv_a_layernorm use eps "
                f"{DEEPSEEK_LATENT_NORM_EPS:g} whatever rms_norm_eps says, megatron-core's q/kv layernorms "
                "--norm-epsilon like every other norm")
    layers, hidden, heads = cfg.int("num_hidden_layers"), cfg.int("hidden_size"), cfg.int("num_attention_heads")
    rope_dim = cfg.int("qk_rope_head_dim")
    if rope_dim % 2:
        _fail(f"config.json: qk_rope_head_dim={rope_dim} is odd; RoPE rotates pairs of dimensions, fix config.json")
    max_positions = cfg.int("max_position_embeddings")
    # num_key_value_heads is not read: kv_b_proj gives every head its own key and value
    moe = _moe_config(cfg, fam, layers, args)
    args.update(norm_epsilon=eps, attention_dropout=cfg.number("attention_dropout", 0.0, positive=False),
                hidden_dropout=0.0, **_rope(cfg, model_type, max_positions, mla=True))
    v_head = cfg.int("v_head_dim")
    return GPTModelConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=cfg.int("intermediate_size"),
        num_attention_heads=heads, num_query_groups=heads,
        kv_channels=hidden // heads if hidden % heads == 0 else v_head,  # not used by MLA; Megatron-LM's default
        vocab_size=vocab, padded_vocab_size=pad_vocab_size(vocab, divisible, 1),
        make_vocab_size_divisible_by=divisible, max_position_embeddings=max_positions, swiglu=True,
        normalization="RMSNorm", position_embedding_type="rope",
        untie_embeddings_and_output_weights=not cfg.flag("tie_word_embeddings", False), add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=True, multi_latent_attention=True, q_lora_rank=cfg.int("q_lora_rank"),
        kv_lora_rank=cfg.int("kv_lora_rank"), qk_head_dim=cfg.int("qk_nope_head_dim"), qk_pos_emb_head_dim=rope_dim,
        v_head_dim=v_head, **moe)


def _llama_like_model(cfg: _Config, fam: HFFamily, vocab: int, divisible: int, args: dict) -> GPTModelConfig:
    model_type, facts = fam.model_type, fam.facts
    act = cfg.text("hidden_act", "silu")
    if act != "silu":
        _refuse(model_type, f"hidden_act={act!r}", "Megatron's --swiglu gates with SiLU")
    if cfg.int("pretraining_tp", 1) != 1:
        _refuse(model_type, f"pretraining_tp={cfg.raw('pretraining_tp')}", "set it to 1 (it only changes how HF "
                "splits matmuls)")
    layers, hidden, heads = cfg.int("num_hidden_layers"), cfg.int("hidden_size"), cfg.int("num_attention_heads")
    max_positions = cfg.int("max_position_embeddings", 2048)
    window = cfg.raw("sliding_window") if facts.sliding_window else None
    if facts.sliding_switch and not cfg.flag(facts.sliding_switch, False):
        window = None  # transformers' Qwen configs drop the window unless use_sliding_window
    if window is not None and cfg.int("sliding_window") < max_positions:
        _refuse(model_type, f"sliding_window={window} < max_position_embeddings={max_positions}",
                "Megatron's GPT attends causally over the whole sequence; for sequences of at most "
                f"{window} tokens the window changes nothing: set sliding_window to null")
    groups = cfg.int("num_key_value_heads", heads)
    if heads % groups:
        _refuse(model_type, f"num_attention_heads={heads} not divisible by num_key_value_heads={groups}",
                "query groups must split the heads evenly")
    if "head_dim" not in cfg.doc and "head_dim" not in facts.defaults and hidden % heads:
        _fail(f"config.json: hidden_size={hidden} is not divisible by num_attention_heads={heads} and there is no "
              f"head_dim; fix config.json")
    head_dim = cfg.int("head_dim", hidden // heads)
    qkv_bias = {"none": False, "always": True}.get(facts.qkv_bias)
    if qkv_bias is None:
        qkv_bias = cfg.flag(facts.qkv_bias, False)
    bias_linear = cfg.flag(facts.mlp_bias, False) if facts.mlp_bias else False
    if bias_linear and not (qkv_bias and facts.qkv_bias_with_o_proj):
        _refuse(model_type, f"{facts.mlp_bias} without {facts.qkv_bias}", "Megatron's --add-bias-linear gives every "
                "linear layer a bias")
    ffn, moe = cfg.int("intermediate_size"), {}
    if facts.moe:
        moe = _moe_config(cfg, fam, layers, args)
    args.update(norm_epsilon=cfg.number("rms_norm_eps", 1e-6),
                attention_dropout=cfg.number("attention_dropout", 0.0, positive=False), hidden_dropout=0.0,
                **_rope(cfg, model_type, max_positions))
    return GPTModelConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=head_dim, vocab_size=vocab,
        padded_vocab_size=pad_vocab_size(vocab, divisible, 1), make_vocab_size_divisible_by=divisible,
        max_position_embeddings=max_positions, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
        untie_embeddings_and_output_weights=not cfg.flag("tie_word_embeddings", False),
        add_bias_linear=bias_linear, add_qkv_bias=qkv_bias, qk_layernorm=facts.qk_norm, **moe)


def _family(model_type: Any, path: Union[str, Path] = "config.json") -> HFFamily:
    try:
        return family(str(model_type))
    except ValueError as e:
        _fail(f"{path}: {e}")


def megatron_model(cfg: dict, model_type: str, make_vocab_size_divisible_by: int = 128, mtp_layers: int = 0
                   ) -> tuple[GPTModelConfig, dict]:
    """The Megatron model config and Megatron-LM args (names and values as Megatron-LM's argparse keeps them) of
    an HF config, with `mtp_layers` multi-token prediction layers (--mtp-num-layers); refuses what the GPT model
    cannot compute exactly."""
    fam = _family(model_type)
    reader = _Config(cfg, fam.facts)
    vocab = reader.int("vocab_size")
    args: dict[str, Any] = {"tokenizer_type": "NullTokenizer", "vocab_size": vocab - 1,
                            "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
                            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                            "data_parallel_size": 1, "world_size": 1}
    if model_type == "gpt2":
        config = _gpt2_model(reader, vocab, make_vocab_size_divisible_by, args)
    elif fam.facts.mla:
        config = _mla_model(reader, fam, vocab, make_vocab_size_divisible_by, args)
    else:
        config = _llama_like_model(reader, fam, vocab, make_vocab_size_divisible_by, args)
    if mtp_layers:
        config = dataclasses.replace(config, mtp_num_layers=mtp_layers)
    args.update({k: v for k, v in config.to_dict().items() if k not in ("vocab_size",)})
    args["group_query_attention"] = config.num_query_groups != config.num_attention_heads
    args["seq_length"] = config.max_position_embeddings
    return config, args


def megatron_flags(config: GPTModelConfig, args: dict, release: MegatronRelease = NEWEST) -> list[str]:
    """The Megatron-LM flags (of `release`, by default the newest: the training entry point's) that build this
    model and its vocabulary: the HF tokenizer of the folder (args' tokenizer_model) with --vocab-size the model's
    vocabulary, else NullTokenizer ids (--vocab-size counts EOD from 0.18 on, not before)."""
    c = config
    if args.get("tokenizer_type") == "HuggingFaceTokenizer":
        tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", args["tokenizer_model"],
                     "--vocab-size", c.vocab_size]
    else:
        tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size",
                     c.vocab_size if release.null_tokenizer_eod_in_vocab else c.vocab_size - 1]
    flags = ["--num-layers", c.num_layers, "--hidden-size", c.hidden_size, "--ffn-hidden-size", c.ffn_hidden_size,
             "--num-attention-heads", c.num_attention_heads, "--kv-channels", c.kv_channels,
             "--max-position-embeddings", c.max_position_embeddings, "--normalization", c.normalization,
             "--norm-epsilon", args["norm_epsilon"], "--position-embedding-type", c.position_embedding_type,
             *tokenizer, "--make-vocab-size-divisible-by", c.make_vocab_size_divisible_by,
             "--attention-dropout", args.get("attention_dropout", 0.0), "--hidden-dropout",
             args.get("hidden_dropout", 0.0)]
    if c.num_query_groups != c.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", c.num_query_groups]
    if c.position_embedding_type == "rope":
        flags += ["--rotary-base", args["rotary_base"]]
        if args.get("use_rope_scaling"):
            flags += ["--use-rope-scaling", "--rope-scaling-factor", args["rope_scaling_factor"]]
    if c.multi_latent_attention:  # RoPE inside the attention: --rope-type, YaRN's scaling
        flags += ["--multi-latent-attention", "--q-lora-rank", c.q_lora_rank, "--kv-lora-rank", c.kv_lora_rank,
                  "--qk-head-dim", c.qk_head_dim, "--qk-pos-emb-head-dim", c.qk_pos_emb_head_dim, "--v-head-dim",
                  c.v_head_dim, "--rope-type", args["rope_type"]]
        if args["rope_type"] == "yarn":
            flags += ["--rotary-scaling-factor", args["rotary_scaling_factor"], "--mscale", args["mscale"],
                      "--mscale-all-dim", args["mscale_all_dim"]]
    flags += ["--swiglu"] * c.swiglu + ["--untie-embeddings-and-output-weights"] * (not c.tied)
    flags += ["--disable-bias-linear"] * (not c.add_bias_linear) + ["--add-qkv-bias"] * (c.add_qkv_bias
                                                                                          and not c.add_bias_linear)
    flags += ["--qk-layernorm"] * c.qk_layernorm
    if c.mtp_num_layers:
        flags += ["--mtp-num-layers", c.mtp_num_layers]
    if c.num_experts:
        freq = c.moe_layer_freq
        flags += ["--num-experts", c.num_experts, "--moe-ffn-hidden-size", c.moe_ffn_hidden_size,
                  "--moe-router-topk", args["moe_router_topk"], "--moe-aux-loss-coeff", args["moe_aux_loss_coeff"],
                  "--moe-layer-freq", ("[" + ",".join(map(str, freq)) + "]") if isinstance(freq, tuple) else freq]
        if c.moe_shared_expert_intermediate_size:
            flags += ["--moe-shared-expert-intermediate-size", c.moe_shared_expert_intermediate_size]
            flags += ["--moe-shared-expert-gate"] * c.moe_shared_expert_gate
        flags += ["--moe-router-pre-softmax"] * bool(args.get("moe_router_pre_softmax"))
        if args.get("moe_router_score_function") == "sigmoid":
            flags += ["--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor",
                      args["moe_router_topk_scaling_factor"], "--moe-router-dtype", args["moe_router_dtype"]]
        flags += ["--moe-router-enable-expert-bias"] * c.moe_router_enable_expert_bias
        if args.get("moe_router_num_groups"):
            flags += ["--moe-router-num-groups", args["moe_router_num_groups"], "--moe-router-group-topk",
                      args["moe_router_group_topk"]]
    return [str(f) for f in flags]


def detect_model_type(cfg: dict, path: Path) -> str:
    model_type = cfg.get("model_type")
    try:
        family(str(model_type))
    except ValueError as e:
        _fail(f"{path}: {e} (pass --model-type only for a config of one of the supported architectures)")
    return model_type


# --------------------------------------------------------------------------------------------------
# The import


def _check_counts(cfg: dict, model_type: str, stored: dict[str, StoredTensor], root: Path, mtp: int = 0) -> None:
    """config.json's layer and expert counts against the layers and experts the tensors hold (and the `mtp` MTP
    layers after the decoder's), before any work that grows with them."""
    fam = _family(model_type, root / "config.json")
    reader = _Config(cfg, fam.facts)
    layers = reader.int(fam.facts.num_layers)
    held, experts = stored_layers_and_experts(model_type, list(stored))
    if held != set(range(layers + mtp)):
        have = f"layers {min(held)}-{max(held)} ({len(held)} layers)" if held else "no layers"
        _fail(f"{root / 'config.json'}: says {layers} layers but the weights hold {have}; config.json does not "
              f"match the weights")
    if fam.facts.moe:
        count = reader.int(fam.facts.moe.num_experts)
        if experts != set(range(count)):
            have = f"experts 0-{max(experts)}" if experts else "no routed experts"
            _fail(f"{root / 'config.json'}: says {fam.facts.moe.num_experts}={count} but the weights hold {have}; "
                  f"config.json does not match the weights")


def _mtp_layers(cfg: dict, model_type: str, stored: dict[str, StoredTensor], root: Path) -> list[int]:
    """The HF layers of a DeepSeek checkpoint's multi-token prediction layers: stored after the decoder's, at most
    num_nextn_predict_layers of them (transformers builds none and ignores them). They map to Megatron's
    mtp.layers.<k> (the family's MTP rows and a decoder layer's, adapters/hf.hf_rows)."""
    fam = _family(model_type, root / "config.json")
    if not fam.facts.mtp_layers:
        return []
    reader = _Config(cfg, fam.facts)
    layers, declared = reader.int(fam.facts.num_layers), reader.int(fam.facts.mtp_layers, 0, minimum=0)
    beyond = {layer_of(model_type, n) for n in stored} - {None} - set(range(layers))
    if not beyond or beyond != set(range(layers, layers + len(beyond))) or len(beyond) > declared:
        return []  # not MTP layers: the layer count check names the mismatch
    return sorted(beyond)


def _check_tensors(rows: list[HFRow], stored: dict[str, StoredTensor], config: GPTModelConfig,
                   expected: dict[str, tuple[int, ...]], root: Path) -> None:
    wanted: dict[str, tuple[int, ...]] = {}
    for row in rows:
        shape = expected.get(row.megatron) if row.megatron else None
        wanted.update(zip(row.hf, hf_shapes(row, config, shape)))
    optional = {n for row in rows if row.duplicate for n in row.hf}  # copies some folders leave out
    missing = [n for n in wanted if n not in stored and n not in optional]
    if missing:
        hint = ("the weights do not belong to this config.json, or a shard is missing" if missing != ["lm_head.weight"]
                else "config.json says the embeddings are untied (tie_word_embeddings=false) but there is no "
                     "lm_head.weight; set tie_word_embeddings to true if the model ties them")
        _fail(f"{root}: {len(missing)} tensor(s) missing, e.g. {missing[0]}; {hint}")
    for name, shape in wanted.items():
        if name in stored and stored[name].shape != tuple(shape):
            _fail(f"{stored[name].file}: {name} has shape {list(stored[name].shape)}, config.json implies "
                  f"{list(shape)}; the weights do not match config.json")
    extra = [n for n in stored if n not in wanted and not n.endswith(_DERIVED)]
    tied_head = [n for n in extra if n == "lm_head.weight" and config.tied]
    extra = [n for n in extra if n not in tied_head]
    if extra:
        _fail(f"{root}: {len(extra)} tensor(s) config.json does not explain, e.g. {extra[0]}; the model has "
              f"modules Megatron's GPT lacks or config.json does not match the weights")
    if tied_head:
        embed = next(r.hf[0] for r in rows if r.megatron == "embedding.word_embeddings.weight")
        a, b = stored["lm_head.weight"], stored[embed]
        if a.dtype != b.dtype or a.shape != b.shape or not _same_bytes(a, b):
            _fail(f"{a.file}: tie_word_embeddings=true but lm_head.weight differs from {embed}; the weights "
                  f"are untied: set tie_word_embeddings to false in config.json (GPT-2 always ties: not importable)")
    mapped = {r.megatron: r.hf[0] for r in rows if r.megatron and not r.duplicate}
    for row in rows:  # an MTP layer's copies of the embedding and output layer: Megatron's MTP uses the model's own
        copy = stored.get(row.hf[0]) if row.duplicate else None
        if copy is not None and not (copy.dtype == stored[mapped[row.megatron]].dtype
                                     and _same_bytes(copy, stored[mapped[row.megatron]])):
            _fail(f"{copy.file}: {row.hf[0]} differs from {mapped[row.megatron]}; megatron-core's multi-token "
                  f"prediction layers use the model's own {'embedding' if 'embed' in row.hf[0] else 'output layer'}, "
                  f"so the copy must equal it (pass --drop-mtp to import the model without its MTP layers)")


def _same_bytes(a: StoredTensor, b: StoredTensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same bits (compared a band of rows at a time)."""
    import torch

    bits = torch.int32 if a.dtype == "float32" else torch.int16
    step = _band_rows(math.prod(a.shape[1:]))
    for r0 in range(0, a.shape[0], step):
        rows = (r0, min(a.shape[0], r0 + step))
        if not torch.equal(read_tensor(a, rows).view(bits), read_tensor(b, rows).view(bits)):
            return False
    return True


def _band_rows(elements_per_row: int) -> int:
    return max(1, BAND_BYTES // (4 * max(1, elements_per_row)))


def _param_bands(row: HFRow, parts: list[StoredTensor], config: GPTModelConfig, padded_rows: int
                 ) -> Iterator["torch.Tensor"]:
    """The parameter's fp32 bands (hf.from_hf_bands over pread row ranges); a vocabulary's padding rows after its
    true rows, filled with their mean row (as patterns.resize_vocab fills rows appended to a vocabulary without
    padding rows)."""
    import torch

    def read_rows(part: int, r0: int, r1: int) -> torch.Tensor:
        return read_tensor(parts[part], (r0, r1)).to(torch.float32)

    bands = from_hf_bands(row, config, [p.shape for p in parts], read_rows, _band_rows)
    rows, width = parts[0].shape[0], parts[0].shape[1:]
    if row.join != VOCAB or padded_rows == rows:
        yield from bands
        return
    total = torch.zeros(width, dtype=torch.float64)
    for band in bands:
        total += band.double().sum(0)
        yield band
    mean = (total / rows).to(torch.float32)
    step = _band_rows(math.prod(width))
    for r0 in range(rows, padded_rows, step):
        yield mean.expand(min(padded_rows, r0 + step) - r0, *width).contiguous()


def _check_free_space(dst: Path, nbytes: int, config: GPTModelConfig) -> None:
    """The output (fp32 masters plus headers and checksums, a few per mille) must fit where it is staged (beside
    DST, on its file system)."""
    existing = dst.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    need = int(nbytes * 1.01) + (1 << 20)
    if need > free:
        def size(n: int) -> str:
            return f"{n / 2 ** 30:.2f} GiB" if n >= 1 << 30 else f"{n / 2 ** 20:.1f} MiB"

        _fail(f"{dst}: the universal checkpoint needs {size(need)} (fp32 masters; vocabulary {config.vocab_size} "
              f"padded to {config.padded_vocab_size} rows), {size(free)} are free there; free space or write it "
              f"elsewhere")


def import_hf(src: PathLike, dst: PathLike, *, model_type: Optional[str] = None, overwrite: bool = False,
              clean_stale: bool = False, make_vocab_size_divisible_by: int = 128, progress: bool = True,
              drop_mtp: bool = False, allow_non_finite: bool = False) -> dict:
    """Write the universal checkpoint `dst` from the HF model directory `src`; returns a summary. `drop_mtp`:
    leave out the multi-token prediction layers a DeepSeek checkpoint carries (Megatron's MTP layers otherwise).
    NaN/Inf in a weight are refused (found while the written bytes are hashed) unless `allow_non_finite`."""
    import sys

    from tqdm import tqdm

    from megatron_ucp.adapters.gpt import expected_parameters, pattern_for
    from megatron_ucp.core.layout import ParallelLayout
    from megatron_ucp.universal import UniversalFormatError, UniversalWriter, write_tensor_file_streamed
    from megatron_ucp.universal.tensorfile import NonFiniteTensorError

    root = Path(src).resolve()
    if not root.is_dir():
        _fail(f"{src}: no such directory; pass a Hugging Face model directory (config.json + safetensors)")
    if not 1 <= make_vocab_size_divisible_by <= MAX_VOCAB_MULTIPLE:
        _fail(f"--make-vocab-size-divisible-by {make_vocab_size_divisible_by}: must be 1-{MAX_VOCAB_MULTIPLE} "
              f"(Megatron-LM's default is 128; a run multiplies it by its TP when it loads the checkpoint)")
    if not (root / "config.json").exists() and (root / "snapshots").is_dir():
        _fail(f"{root}: is a Hugging Face hub cache repository, not a model folder; pass one of its snapshots "
              f"({root / 'snapshots'}/REVISION)")
    cfg = _read_json(_inside(root, "config.json", root), "config.json")
    if not isinstance(cfg, dict):
        _fail(f"{root / 'config.json'}: not a JSON object; pass a Hugging Face model directory")
    detected = detect_model_type(cfg, root / "config.json") if model_type is None else model_type
    if model_type is not None and cfg.get("model_type") not in (None, model_type):
        _fail(f"{root / 'config.json'}: model_type is {cfg.get('model_type')!r} but --model-type {model_type}; "
              f"drop --model-type to use the config's")
    stored: dict[str, StoredTensor] = {}
    for f in weight_files(root):
        for name, t in parse_safetensors_header(f).items():
            if name in stored:
                _fail(f"{f}: tensor {name} is also in {stored[name].file.name}; keep one copy of each tensor")
            stored[name] = t
    mtp_layers = _mtp_layers(cfg, detected, stored, root)
    dropped = sorted(n for n in stored if layer_of(detected, n) in mtp_layers) if drop_mtp else []
    for name in dropped:
        del stored[name]
    mtp = 0 if drop_mtp else len(mtp_layers)
    _check_counts(cfg, detected, stored, root, mtp)
    try:
        config, args = megatron_model(cfg, detected, make_vocab_size_divisible_by, mtp_layers=mtp)
        expected = dict(expected_parameters(config))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, HFImportError):
            raise
        _fail(f"{root / 'config.json'}: {type(e).__name__} {e} reading it as {detected}; the config is incomplete "
              f"or not a {detected} config")
    fam = family(detected)
    reader = _Config(cfg, fam.facts)
    conventions = {key: reader.flag(key, default) for key, default in fam.conventions.items()}
    rows = hf_rows(config, detected, conventions)
    _check_tensors(rows, stored, config, expected, root)
    tokenizer, largest_id = tokenizer_vocabulary(root)
    if largest_id is not None and largest_id >= config.vocab_size:
        _fail(f"{root / tokenizer}: has token id {largest_id}, config.json's vocab_size is {config.vocab_size} (no "
              f"embedding row for it); the tokenizer does not belong to this model")
    if tokenizer:  # Megatron-LM's HuggingFaceTokenizer reads the folder; --vocab-size is the model's rows
        args.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(root), vocab_size=config.vocab_size)
    float_dtypes = sorted({stored[n].dtype for r in rows for n in r.hf})
    flags = megatron_flags(config, args)
    total = sum(math.prod(s) * 4 for s in expected.values())
    _check_free_space(Path(dst), total, config)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="import-hf", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        with UniversalWriter(dst, overwrite=overwrite, clean_stale=clean_stale, command="import-hf") as writer:
            for row in rows:
                if row.duplicate:  # checked equal to the tensor its parameter is written from (_check_tensors)
                    continue
                parts = [stored[n] for n in row.hf]
                if row.join == ZERO:
                    if read_tensor(parts[0]).abs().max().item() != 0:
                        _fail(f"{parts[0].file}: {row.hf[0]} is not zero, and Megatron's model has no such bias "
                              f"(attention_bias without mlp_bias gives only QKV a bias); it cannot be imported")
                    continue
                info = {"pattern": pattern_for(row.megatron, config), "step": None,
                        "model_dtype": parts[0].dtype}
                shape = expected[row.megatron]
                try:
                    entry = write_tensor_file_streamed(writer.staging_dir, row.megatron, shape,
                                                       _param_bands(row, parts, config, shape[0]), info,
                                                       check_finite=not allow_non_finite)
                except NonFiniteTensorError:
                    files = sorted({str(part.file) for part in parts})
                    raise UniversalFormatError(
                        f"{', '.join(files)}: {' / '.join(row.hf)} hold(s) NaN or Inf (Megatron's {row.megatron}); "
                        f"the model's files are damaged or it diverged: use another copy, or pass "
                        f"--allow-non-finite to import them as they are") from None
                writer.record_parameter(row.megatron, entry)
                bar.update(math.prod(shape) * 4)
            metadata = {
                "iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0,
                "num_floating_point_operations_so_far": 0,
                "source": {"format": "huggingface", "path": str(root), "layout": ParallelLayout().to_dict(),
                           "optimizer_kind": "none", "model_type": detected},
                "model_config": config.to_dict(), "args": args, "args_dropped": [],
                "optimizer": {"type": None, "param_groups": []}, "scheduler": {}, "loss_scaler": None,
                "conversion": {"tool": "megatron-ucp import-hf", "model_type": detected, "hf_dtypes": float_dtypes,
                               "hf_conventions": conventions, "dropped_mtp_tensors": len(dropped),
                               "mtp_layers": mtp,
                               "megatron_flags": flags},
            }
            writer.finish(metadata, list(expected.items()))
    except UniversalFormatError as e:
        _fail(str(e))
    finally:
        bar.close()
    return {"path": str(Path(dst).absolute()), "source": str(root), "model_type": detected,
            "num_parameters": len(expected), "elements": sum(math.prod(s) for s in expected.values()),
            "hf_dtypes": float_dtypes, "vocab_size": config.vocab_size, "tokenizer": tokenizer,
            "padded_vocab_size": config.padded_vocab_size, "dropped_mtp_tensors": len(dropped), "mtp_layers": mtp,
            "megatron_flags": flags}


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "import-hf", parents=[common], help="write a universal checkpoint from a Hugging Face model (weights only)",
        description="Import a Hugging Face transformers model directory (config.json + safetensors, sharded or not; "
                    f"{', '.join(MODEL_TYPES)}) as a universal checkpoint at iteration 0 without optimizer state: "
                    "QKV fused per query group, SwiGLU [gate; up], experts by global index, vocabulary padded, fp32 "
                    "masters. Start training from it at any layout with --load UCP --universal-checkpoint and the "
                    "printed flags (fresh optimizer and scheduler), or write it as a Megatron checkpoint with "
                    "from-universal. Nothing in HF_DIR is executed.")
    p.add_argument("src", help="Hugging Face model directory (a hub cache snapshot folder works too)")
    p.add_argument("dst", help="universal checkpoint directory to write (must not exist unless --overwrite)")
    p.add_argument("--model-type", choices=MODEL_TYPES, default=None,
                   help="the architecture (default: config.json's model_type)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help=f"Megatron-LM's vocabulary padding multiple (default 128, at most {MAX_VOCAB_MULTIPLE})")
    p.add_argument("--drop-mtp", action="store_true",
                   help="leave out the multi-token prediction layers a DeepSeek checkpoint stores after the decoder's "
                        "(transformers ignores them; without this flag they become Megatron's --mtp-num-layers)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="import weights holding NaN/Inf as they are (refused by default, naming them)")
    add_publication_flags(p, "universal checkpoint", "COMPLETE")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    result = import_hf(args.src, args.dst, model_type=args.model_type, overwrite=args.overwrite,
                       clean_stale=args.clean_stale, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                       progress=not args.quiet, drop_mtp=args.drop_mtp, allow_non_finite=args.allow_non_finite)
    tokenizer = (f"the folder's tokenizer ({result['tokenizer']})" if result["tokenizer"] else
                 "NullTokenizer ids (no tokenizer in the folder: bring one for real data)")
    result["message"] = (f"wrote {result['path']}: {result['model_type']} ({result['num_parameters']} parameters, "
                         f"{result['elements'] / 1e6:.1f} M elements from {'/'.join(result['hf_dtypes'])}, fp32 "
                         f"masters), iteration 0, no optimizer state, vocab {result['vocab_size']} padded to "
                         f"{result['padded_vocab_size']}, {tokenizer}"
                         + (f", {result['dropped_mtp_tensors']} MTP tensors left out" if result["dropped_mtp_tensors"]
                            else "")
                         + (f", {result['mtp_layers']} multi-token prediction layer(s)" if result["mtp_layers"]
                            else "") + ".\nTrain from it with: pretrain_gpt.py "
                         + " ".join(result["megatron_flags"])
                         + " --load " + result["path"] + " --universal-checkpoint")
    return result
