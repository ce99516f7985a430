"""`megatron-ucp import-hf`: a universal checkpoint (weights only, iteration 0) from a Hugging Face model directory.

The input is untrusted and only read as data: `config.json` (and `model.safetensors.index.json`) as JSON, the
weights as safetensors parsed here (header JSON, then raw bytes read with pread); no pickle, no remote code.
Every shard named by the index must resolve inside HF_DIR, every header's declared dtype, shape and byte range
is checked against the file's size before anything is allocated, and one band of rows (16 MiB in fp32; GPT-2's
transposed Conv1D weights whole) is in memory at a time, so memory stays bounded whatever the model size.

`hf_names` is the mapping (the same table `export-hf` uses): Megatron's fused QKV per query group, SwiGLU
`[gate; up]`, routed experts by global index. Weights are widened to fp32 exactly (bf16 and fp16 are subsets
of fp32); the vocabulary is padded to Megatron-LM's rule at TP1 (`--make-vocab-size-divisible-by`, the padding
rows filled as `patterns.resize_vocab` fills them: the mean row). The HF config becomes the universal
checkpoint's model config and Megatron-LM args, and the flags that build the model are returned (and printed).
Configurations Megatron's GPT cannot compute exactly are refused in one line naming the field and why.
Output: through UniversalWriter (locked, staged, checksummed, published only when complete).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from megatron_ucp.adapters.hf import MODEL_TYPES, VOCAB, ZERO, HFRow, from_hf_bands, hf_rows, hf_shapes
from megatron_ucp.commands.common import add_publication_flags
from megatron_ucp.core.dtypes import SAFETENSORS, itemsize
from megatron_ucp.core.model_config import GPTModelConfig, pad_vocab_size
from megatron_ucp.core.versions import NEWEST, MegatronRelease

PathLike = Union[str, os.PathLike]
MAX_JSON = 64 << 20  # bytes a config.json, index or safetensors header may take
_DTYPES = {code: SAFETENSORS[code] for code in ("F32", "BF16", "F16")}  # what a checkpoint may hold
BAND_BYTES = 16 << 20  # fp32 bytes of a parameter widened at a time (one band of rows)
# HF tensors that are derived buffers, never weights (older Llama checkpoints store RoPE's inv_freq).
_DERIVED = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


class HFImportError(ValueError):
    """The HF directory cannot be imported; the message names the file or field, the cause and the fix."""


def _fail(message: str) -> None:
    raise HFImportError(message)


# --------------------------------------------------------------------------------------------------
# Reading the HF directory (JSON and safetensors only)


def _read_json(path: Path, what: str) -> Any:
    try:
        size = path.stat().st_size
    except OSError as e:
        _fail(f"{path}: cannot read {what} ({e.strerror}); pass a Hugging Face model directory")
    if size > MAX_JSON:
        _fail(f"{path}: {size} bytes is too large for {what}; the file is not a Hugging Face {what}")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        _fail(f"{path}: not valid JSON ({e}); re-download or re-save the model")


def _inside(root: Path, rel: Any, source: Path) -> Path:
    """`rel` resolved inside root (no absolute paths, no '..', no symlink out)."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\0" in rel:
        _fail(f"{source}: shard file name {rel!r} is not a relative file name; the index must name files in "
              f"{root}")
    path = (root / rel).resolve()
    if root not in path.parents:
        _fail(f"{source}: shard {rel!r} resolves to {path}, outside {root}; refusing to read it (fix the index "
              f"or move the shard into the model directory)")
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
            header = json.loads(f.read(hlen))
    except OSError as e:
        _fail(f"{path}: cannot read ({e.strerror})")
    except (ValueError, UnicodeDecodeError) as e:
        _fail(f"{path}: safetensors header is not valid JSON ({e}); re-download it")
    if not isinstance(header, dict):
        _fail(f"{path}: safetensors header is not an object; re-download it")
    data_start, out, ranges = 8 + hlen, {}, []
    for name, d in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = d["dtype"], tuple(int(n) for n in d["shape"]), d["data_offsets"]
            start, end = int(start), int(end)
        except (KeyError, TypeError, ValueError):
            _fail(f"{path}: tensor {name!r} has a malformed header entry {d!r}; re-download the file")
        if dtype not in _DTYPES:
            _fail(f"{path}: tensor {name} is {dtype}; a model's weights must be F32, BF16 or F16 (quantized or "
                  f"integer checkpoints are not imported: dequantize to a float dtype first)")
        torch_dtype, width = _DTYPES[dtype], itemsize(_DTYPES[dtype])
        if any(n < 0 for n in shape) or end - start != math.prod(shape) * width or start < 0:
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
        doc = _read_json(index, "safetensors index")
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


# --------------------------------------------------------------------------------------------------
# config.json -> Megatron model config and args


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _refuse(model_type: str, what: str, why: str) -> None:
    _fail(f"config.json: {what}: Megatron's GPT cannot express it as {model_type} ({why})")


def _rope_theta(cfg: dict, model_type: str) -> int:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        _refuse(model_type, f"RoPE scaling {rope_type!r}", "only unscaled RoPE is imported; --rotary-base alone "
                                                           "cannot reproduce it")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    if theta != int(theta):
        _refuse(model_type, f"rope_theta={theta}", "Megatron's --rotary-base is an integer")
    if float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        _refuse(model_type, "partial_rotary_factor != 1", "use a full-rotary model")
    return int(theta)


def megatron_model(cfg: dict, model_type: str, make_vocab_size_divisible_by: int = 128
                   ) -> tuple[GPTModelConfig, dict]:
    """The Megatron model config and Megatron-LM args (names and values as Megatron-LM's argparse keeps them) of
    an HF config; refuses what the GPT model cannot compute exactly."""
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        _fail(f"config.json: vocab_size {vocab!r} is not a positive integer; fix config.json")
    tied = bool(cfg.get("tie_word_embeddings", model_type == "gpt2"))
    args: dict[str, Any] = {"tokenizer_type": "NullTokenizer", "vocab_size": vocab - 1,
                            "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
                            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                            "data_parallel_size": 1, "world_size": 1}
    if model_type == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        if act != "gelu":
            _refuse(model_type, f"activation_function={act!r}", "megatron-core's GPT MLP computes exact GELU; "
                    "HF's gelu_new is its tanh approximation")
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
            if bool(cfg.get(key, want)) != want:
                _refuse(model_type, f"{key}={cfg.get(key)}", f"Megatron's attention needs {key}={want}")
        if not tied:
            _refuse(model_type, "tie_word_embeddings=false", "GPT2LMHeadModel ties its output layer to wte")
        hidden, heads = int(cfg["n_embd"]), int(cfg["n_head"])
        if hidden % heads:
            _refuse(model_type, f"n_embd={hidden} not divisible by n_head={heads}", "heads must split the hidden size")
        config = GPTModelConfig(
            num_layers=int(cfg["n_layer"]), hidden_size=hidden, ffn_hidden_size=int(cfg.get("n_inner") or 4 * hidden),
            num_attention_heads=heads, num_query_groups=heads, kv_channels=hidden // heads, vocab_size=vocab,
            padded_vocab_size=pad_vocab_size(vocab, make_vocab_size_divisible_by, 1),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            max_position_embeddings=int(cfg["n_positions"]), swiglu=False, normalization="LayerNorm",
            position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
            add_bias_linear=True, add_qkv_bias=True)
        args["norm_epsilon"] = float(cfg.get("layer_norm_epsilon", 1e-5))
    else:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            _refuse(model_type, f"hidden_act={act!r}", "Megatron's --swiglu gates with SiLU")
        if int(cfg.get("pretraining_tp", 1) or 1) != 1:
            _refuse(model_type, f"pretraining_tp={cfg['pretraining_tp']}", "set it to 1 (it only changes how HF "
                    "splits matmuls)")
        if cfg.get("use_sliding_window") or (model_type == "mixtral" and cfg.get("sliding_window")):
            _refuse(model_type, f"sliding_window={cfg.get('sliding_window')}", "Megatron's GPT attends causally "
                    "over the whole sequence")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        groups = int(cfg.get("num_key_value_heads") or heads)
        if heads % groups:
            _refuse(model_type, f"num_attention_heads={heads} not divisible by num_key_value_heads={groups}",
                    "query groups must split the heads evenly")
        if model_type == "llama":
            attention_bias, mlp_bias = bool(cfg.get("attention_bias")), bool(cfg.get("mlp_bias"))
            if mlp_bias and not attention_bias:
                _refuse(model_type, "mlp_bias without attention_bias", "Megatron's --add-bias-linear gives every "
                        "linear layer a bias")
            qkv_bias, bias_linear = attention_bias, mlp_bias
        elif model_type == "qwen2_moe":
            qkv_bias, bias_linear = bool(cfg.get("qkv_bias", True)), False
        else:
            qkv_bias, bias_linear = False, False
        moe: dict[str, Any] = {}
        ffn = int(cfg["intermediate_size"])
        if model_type in ("mixtral", "qwen2_moe"):
            moe, ffn = _moe_config(cfg, model_type, args)
        config = GPTModelConfig(
            num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden, ffn_hidden_size=ffn,
            num_attention_heads=heads, num_query_groups=groups, kv_channels=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=vocab, padded_vocab_size=pad_vocab_size(vocab, make_vocab_size_divisible_by, 1),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0), swiglu=True,
            normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=not tied,
            add_bias_linear=bias_linear, add_qkv_bias=qkv_bias, **moe)
        args.update(norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)), rotary_base=_rope_theta(cfg, model_type),
                    rotary_percent=1.0, rotary_interleaved=False)
    args.update({k: v for k, v in config.to_dict().items() if k not in ("vocab_size",)})
    args["group_query_attention"] = config.num_query_groups != config.num_attention_heads
    args["seq_length"] = config.max_position_embeddings
    return config, args


def _moe_config(cfg: dict, model_type: str, args: dict) -> tuple[dict, int]:
    if float(cfg.get("router_jitter_noise") or 0.0):
        _refuse(model_type, f"router_jitter_noise={cfg['router_jitter_noise']}", "Megatron's router has no such "
                "noise")
    topk = int(cfg["num_experts_per_tok"])
    args.update(moe_router_topk=topk, moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef") or 0.0),
                moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss")
    if model_type == "mixtral":
        n = int(cfg["num_local_experts"])
        return {"num_experts": n, "moe_ffn_hidden_size": int(cfg["intermediate_size"]), "moe_layer_freq": 1}, \
            int(cfg["intermediate_size"])
    # Qwen2-MoE: normalized top-k is Megatron's default router, plain top-k of the softmax its pre-softmax one
    args["moe_router_pre_softmax"] = not bool(cfg.get("norm_topk_prob", False))
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if not shared:
        _refuse(model_type, "shared_expert_intermediate_size=0", "Qwen2-MoE's shared expert is always there; use "
                "--model-type mixtral for routed experts only")
    layers, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    freq = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    return {"num_experts": int(cfg["num_experts"]), "moe_ffn_hidden_size": int(cfg["moe_intermediate_size"]),
            "moe_shared_expert_intermediate_size": shared, "moe_shared_expert_gate": True,
            "moe_layer_freq": freq}, int(cfg["intermediate_size"])


def megatron_flags(config: GPTModelConfig, args: dict, release: MegatronRelease = NEWEST) -> list[str]:
    """The Megatron-LM flags (of `release`, by default the newest: the training entry point's) that build this
    model, the vocabulary as NullTokenizer ids: --vocab-size counts EOD from 0.18 on, not before."""
    c = config
    vocab_flag = c.vocab_size if release.null_tokenizer_eod_in_vocab else c.vocab_size - 1
    flags = ["--num-layers", c.num_layers, "--hidden-size", c.hidden_size, "--ffn-hidden-size", c.ffn_hidden_size,
             "--num-attention-heads", c.num_attention_heads, "--kv-channels", c.kv_channels,
             "--max-position-embeddings", c.max_position_embeddings, "--normalization", c.normalization,
             "--norm-epsilon", args["norm_epsilon"], "--position-embedding-type", c.position_embedding_type,
             "--tokenizer-type", "NullTokenizer", "--vocab-size", vocab_flag,
             "--make-vocab-size-divisible-by", c.make_vocab_size_divisible_by]
    if c.num_query_groups != c.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", c.num_query_groups]
    if c.position_embedding_type == "rope":
        flags += ["--rotary-base", args["rotary_base"]]
    flags += ["--swiglu"] * c.swiglu + ["--untie-embeddings-and-output-weights"] * (not c.tied)
    flags += ["--disable-bias-linear"] * (not c.add_bias_linear) + ["--add-qkv-bias"] * (c.add_qkv_bias
                                                                                          and not c.add_bias_linear)
    if c.num_experts:
        freq = c.moe_layer_freq
        flags += ["--num-experts", c.num_experts, "--moe-ffn-hidden-size", c.moe_ffn_hidden_size,
                  "--moe-router-topk", args["moe_router_topk"], "--moe-aux-loss-coeff", args["moe_aux_loss_coeff"],
                  "--moe-layer-freq", ("[" + ",".join(map(str, freq)) + "]") if isinstance(freq, tuple) else freq]
        if c.moe_shared_expert_intermediate_size:
            flags += ["--moe-shared-expert-intermediate-size", c.moe_shared_expert_intermediate_size,
                      "--moe-shared-expert-gate"]
        flags += ["--moe-router-pre-softmax"] * bool(args.get("moe_router_pre_softmax"))
    return [str(f) for f in flags]


def detect_model_type(cfg: dict, path: Path) -> str:
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        _fail(f"{path}: model_type {model_type!r} is not importable; supported: {', '.join(MODEL_TYPES)} (pass "
              f"--model-type only for a config of one of these architectures)")
    return model_type


# --------------------------------------------------------------------------------------------------
# The import


def _check_tensors(rows: list[HFRow], stored: dict[str, StoredTensor], config: GPTModelConfig,
                   expected: dict[str, tuple[int, ...]], root: Path) -> None:
    wanted: dict[str, tuple[int, ...]] = {}
    for row in rows:
        shape = expected.get(row.megatron) if row.megatron else None
        wanted.update(zip(row.hf, hf_shapes(row, config, shape)))
    missing = [n for n in wanted if n not in stored]
    if missing:
        hint = ("the weights do not belong to this config.json, or a shard is missing" if missing != ["lm_head.weight"]
                else "config.json says the embeddings are untied (tie_word_embeddings=false) but there is no "
                     "lm_head.weight; set tie_word_embeddings to true if the model ties them")
        _fail(f"{root}: {len(missing)} tensor(s) missing, e.g. {missing[0]}; {hint}")
    for name, shape in wanted.items():
        if stored[name].shape != tuple(shape):
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
    """The parameter's fp32 bands (hf_names.from_hf_bands over pread row ranges); a vocabulary's padding rows
    after its true rows, filled with their mean row (as patterns.resize_vocab fills rows appended to a
    vocabulary without padding rows)."""
    import torch

    def read_rows(part: int, r0: int, r1: int) -> torch.Tensor:
        return read_tensor(parts[part], (r0, r1)).to(torch.float32)

    bands = from_hf_bands(row, config, [p.shape for p in parts], read_rows, _band_rows)
    if row.join != VOCAB:
        yield from bands
        return
    rows, width = parts[0].shape[0], parts[0].shape[1:]
    total = torch.zeros(width, dtype=torch.float64)
    for band in bands:
        total += torch.sum(band, dim=0, dtype=torch.float64)
        yield band
    if padded_rows > rows:
        mean = (total / rows).to(torch.float32)
        step = _band_rows(math.prod(width))
        for r0 in range(rows, padded_rows, step):
            yield mean.expand(min(padded_rows, r0 + step) - r0, *width).contiguous()


def import_hf(src: PathLike, dst: PathLike, *, model_type: Optional[str] = None, overwrite: bool = False,
              clean_stale: bool = False, make_vocab_size_divisible_by: int = 128, progress: bool = True) -> dict:
    """Write the universal checkpoint `dst` from the HF model directory `src`; returns a summary."""
    import sys

    from tqdm import tqdm

    from megatron_ucp.adapters.gpt import expected_parameters, pattern_for
    from megatron_ucp.core.layout import ParallelLayout
    from megatron_ucp.universal import UniversalFormatError, UniversalWriter, write_tensor_file_streamed

    root = Path(src).resolve()
    if not root.is_dir():
        _fail(f"{src}: no such directory; pass a Hugging Face model directory (config.json + safetensors)")
    if make_vocab_size_divisible_by < 1:
        _fail(f"--make-vocab-size-divisible-by {make_vocab_size_divisible_by}: must be >= 1")
    cfg = _read_json(_inside(root, "config.json", root), "config.json")
    if not isinstance(cfg, dict):
        _fail(f"{root / 'config.json'}: not a JSON object; pass a Hugging Face model directory")
    detected = detect_model_type(cfg, root / "config.json") if model_type is None else model_type
    if model_type is not None and cfg.get("model_type") not in (None, model_type):
        _fail(f"{root / 'config.json'}: model_type is {cfg.get('model_type')!r} but --model-type {model_type}; "
              f"drop --model-type to use the config's")
    try:
        config, args = megatron_model(cfg, detected, make_vocab_size_divisible_by)
        expected = dict(expected_parameters(config))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, HFImportError):
            raise
        _fail(f"{root / 'config.json'}: {type(e).__name__} {e} reading it as {detected}; the config is incomplete "
              f"or not a {detected} config")
    stored: dict[str, StoredTensor] = {}
    for f in weight_files(root):
        for name, t in parse_safetensors_header(f).items():
            if name in stored:
                _fail(f"{f}: tensor {name} is also in {stored[name].file.name}; keep one copy of each tensor")
            stored[name] = t
    rows = hf_rows(config, detected)
    _check_tensors(rows, stored, config, expected, root)
    float_dtypes = sorted({stored[n].dtype for r in rows for n in r.hf})
    flags = megatron_flags(config, args)
    bar = tqdm(total=sum(math.prod(s) * 4 for s in expected.values()), unit="B", unit_scale=True,
               unit_divisor=1024, desc="import-hf", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    try:
        with UniversalWriter(dst, overwrite=overwrite, clean_stale=clean_stale, command="import-hf") as writer:
            for row in rows:
                parts = [stored[n] for n in row.hf]
                if row.join == ZERO:
                    if read_tensor(parts[0]).abs().max().item() != 0:
                        _fail(f"{parts[0].file}: {row.hf[0]} is not zero, and Megatron's model has no such bias "
                              f"(attention_bias without mlp_bias gives only QKV a bias); it cannot be imported")
                    continue
                info = {"pattern": pattern_for(row.megatron, config), "step": None,
                        "model_dtype": parts[0].dtype}
                shape = expected[row.megatron]
                entry = write_tensor_file_streamed(writer.staging_dir, row.megatron, shape,
                                                   _param_bands(row, parts, config, shape[0]), info)
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
                               "megatron_flags": flags},
            }
            writer.finish(metadata, list(expected.items()))
    except UniversalFormatError as e:
        _fail(str(e))
    finally:
        bar.close()
    return {"path": str(Path(dst).absolute()), "source": str(root), "model_type": detected,
            "num_parameters": len(expected), "elements": sum(math.prod(s) for s in expected.values()),
            "hf_dtypes": float_dtypes, "vocab_size": config.vocab_size,
            "padded_vocab_size": config.padded_vocab_size, "megatron_flags": flags}


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "import-hf", parents=[common], help="write a universal checkpoint from a Hugging Face model (weights only)",
        description="Import a Hugging Face transformers model directory (config.json + safetensors, sharded or not) "
                    "as a universal checkpoint at iteration 0 without optimizer state: QKV fused per query group, "
                    "SwiGLU [gate; up], experts by global index, vocabulary padded, fp32 masters. Start training "
                    "from it at any layout with --load UCP --universal-checkpoint (fresh optimizer and scheduler), "
                    "or write it as a Megatron checkpoint with from-universal. Nothing in HF_DIR is executed.")
    p.add_argument("src", help="Hugging Face model directory")
    p.add_argument("dst", help="universal checkpoint directory to write (must not exist unless --overwrite)")
    p.add_argument("--model-type", choices=MODEL_TYPES, default=None,
                   help="the architecture (default: config.json's model_type)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Megatron-LM's vocabulary padding multiple (default 128)")
    add_publication_flags(p, "universal checkpoint", "COMPLETE")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    result = import_hf(args.src, args.dst, model_type=args.model_type, overwrite=args.overwrite,
                       clean_stale=args.clean_stale, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                       progress=not args.quiet)
    result["message"] = (f"wrote {result['path']}: {result['model_type']} ({result['num_parameters']} parameters, "
                         f"{result['elements'] / 1e6:.1f} M elements from {'/'.join(result['hf_dtypes'])}, fp32 "
                         f"masters), iteration 0, no optimizer state, vocab {result['vocab_size']} padded to "
                         f"{result['padded_vocab_size']}.\nTrain from it with: pretrain_gpt.py "
                         + " ".join(result["megatron_flags"])
                         + " --load " + result["path"] + " --universal-checkpoint")
    return result
