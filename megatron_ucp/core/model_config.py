"""The GPT model hyper-parameters that decide parameter names, shapes and parallel layouts."""

from __future__ import annotations

import ast
import functools
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional, Tuple, Union


@dataclass(frozen=True)
class GPTModelConfig:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # == num_attention_heads without GQA
    kv_channels: int  # head dim
    vocab_size: int  # true vocabulary (tokenizer.vocab_size, e.g. NullTokenizer: --vocab-size + 1 for EOD)
    padded_vocab_size: int  # rows of the embedding / output layer as trained
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 0
    swiglu: bool = False
    normalization: str = "LayerNorm"  # or "RMSNorm"
    position_embedding_type: str = "learned_absolute"  # or "rope"
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    # Mixture of experts (Megatron-LM's --num-experts ...; None / defaults for a dense model)
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None  # each routed expert's FFN size (default ffn_hidden_size)
    moe_shared_expert_intermediate_size: Optional[int] = None  # shared experts' FFN size (None: none)
    moe_shared_expert_gate: bool = False
    moe_layer_freq: Union[int, Tuple[int, ...]] = 1  # int: every n-th layer is MoE; a tuple: per layer 0/1
    moe_router_enable_expert_bias: bool = False
    # Multi-latent attention (--multi-latent-attention, DeepSeek-V2/V3): low-rank query (q_lora_rank; None: one
    # query projection) and joint key/value (kv_lora_rank) compressions; per head qk_head_dim + a RoPE part of
    # qk_pos_emb_head_dim for queries and keys, v_head_dim for values
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mla_down_proj_fusion: bool = False  # TransformerEngine's fused q/kv down projection (not supported: adapters/gpt.py)
    # Multi-token prediction (--mtp-num-layers, DeepSeek-V3): that many MTP layers on the last pipeline stage
    mtp_num_layers: Optional[int] = None
    # Megatron-LM's --transformer-impl of the run ("local" or "transformer_engine"): the spec's torch_dist spellings
    # of some norms (adapters/gpt.py) and, under MLA, how the down projections are split (local: column-parallel;
    # TransformerEngine: duplicated on every TP rank). A config without it (an older universal checkpoint, an HF
    # import) means megatron-core's local spec, the spelling megatron-ucp always wrote before.
    transformer_impl: str = "local"

    def __post_init__(self):
        if self.add_bias_linear and not self.add_qkv_bias:
            # The QKV bias exists with either flag; Megatron-LM keeps the two in sync.
            object.__setattr__(self, "add_qkv_bias", True)
        if not self.num_experts:
            object.__setattr__(self, "num_experts", None)
        freq = self.moe_layer_freq
        if isinstance(freq, str):  # as Megatron-LM's args may keep it: "[0,1,0,1]" or "2"
            freq = ast.literal_eval(freq)
        object.__setattr__(self, "moe_layer_freq", tuple(int(x) for x in freq) if isinstance(freq, (list, tuple))
                           else int(freq))
        if self.num_experts and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        if not self.mtp_num_layers:
            object.__setattr__(self, "mtp_num_layers", None)

    @functools.cached_property  # asked per layer and per parameter name: built once per config
    def moe_layers(self) -> Tuple[bool, ...]:
        """Per global layer: is it an MoE layer (megatron-core's moe_layer_freq rule)."""
        if not self.num_experts:
            return (False,) * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            if len(freq) != self.num_layers:
                raise ValueError(f"moe_layer_freq {list(freq)} has {len(freq)} entries, num_layers={self.num_layers}; "
                                 f"give one 0/1 per layer")
            return tuple(bool(x) for x in freq)
        if freq < 1:
            raise ValueError(f"moe_layer_freq={freq} must be >= 1")
        return tuple(i % freq == 0 for i in range(self.num_layers))

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def query_projection_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def attention_output_size(self) -> int:
        """Input features of the attention's output projection (linear_proj): all heads' values."""
        if self.multi_latent_attention:
            return self.v_head_dim * self.num_attention_heads
        return self.query_projection_size

    @property
    def mla_q_head_dim(self) -> int:
        """Under MLA, one query (and key) head: its no-position part and its RoPE part."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def kv_projection_size(self) -> int:
        return self.kv_channels * self.num_query_groups

    def to_dict(self) -> dict:
        d = asdict(self)
        if isinstance(d["moe_layer_freq"], tuple):
            d["moe_layer_freq"] = list(d["moe_layer_freq"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GPTModelConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_megatron_args(cls, args: Any) -> "GPTModelConfig":
        """Build from Megatron-LM's argparse Namespace (or a dict of the same names)."""
        get = (lambda k, default=None: args.get(k, default)) if isinstance(args, Mapping) else (
            lambda k, default=None: getattr(args, k, default))
        heads = get("num_attention_heads")
        groups = get("num_query_groups") if get("group_query_attention") else heads
        hidden = get("hidden_size")
        swiglu = bool(get("swiglu"))
        ffn = get("ffn_hidden_size")
        if ffn is None:
            # Megatron-LM's default: 4h, or 2/3 of it rounded down to a multiple of 64 with SwiGLU.
            ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
        padded = get("padded_vocab_size")
        vocab = get("vocab_size")
        if get("tokenizer_type") == "NullTokenizer" and vocab is not None:
            # EOD appended (<= 0.17) or inside --vocab-size (>= 0.18): as the release that wrote the args means it
            from megatron_ucp.core.versions import true_vocab_size

            vocab = true_vocab_size(args if isinstance(args, Mapping) else vars(args))
        elif get("tokenizer_type") == "ByteLevelTokenizer":
            vocab = 257  # megatron-ucp's byte-level tokenizer: 256 bytes + EOD
        divisible = get("make_vocab_size_divisible_by", 128) or 128
        if padded is None and vocab is not None:
            padded = pad_vocab_size(vocab, divisible, get("tensor_model_parallel_size", 1) or 1)
        return cls(
            num_layers=get("num_layers"),
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            num_attention_heads=heads,
            num_query_groups=groups or heads,
            kv_channels=get("kv_channels") or hidden // heads,
            vocab_size=vocab if vocab is not None else padded,
            padded_vocab_size=padded,
            make_vocab_size_divisible_by=divisible,
            max_position_embeddings=get("max_position_embeddings") or get("seq_length") or 0,
            swiglu=swiglu,
            normalization=get("normalization", "LayerNorm") or "LayerNorm",
            position_embedding_type=get("position_embedding_type", "learned_absolute") or "learned_absolute",
            untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights", False)),
            add_bias_linear=bool(get("add_bias_linear", True)),
            # The QKV bias exists with either flag (Megatron-LM keeps them in sync).
            add_qkv_bias=bool(get("add_qkv_bias", False)) or bool(get("add_bias_linear", True)),
            qk_layernorm=bool(get("qk_layernorm", False)),
            num_experts=get("num_experts"),
            moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
            moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size"),
            moe_shared_expert_gate=bool(get("moe_shared_expert_gate", False)),
            moe_layer_freq=get("moe_layer_freq", 1) if get("moe_layer_freq") is not None else 1,
            moe_router_enable_expert_bias=bool(get("moe_router_enable_expert_bias", False)),
            multi_latent_attention=bool(get("multi_latent_attention", False)),
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank", 32) or 32,
            qk_head_dim=get("qk_head_dim", 128) or 128,
            qk_pos_emb_head_dim=get("qk_pos_emb_head_dim", 64) or 64,
            v_head_dim=get("v_head_dim", 128) or 128,
            mla_down_proj_fusion=bool(get("mla_down_proj_fusion", False)),
            mtp_num_layers=get("mtp_num_layers"),
            transformer_impl=get("transformer_impl", "transformer_engine") or "transformer_engine",
        )


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron-LM's rule: round up to a multiple of make_vocab_size_divisible_by * TP."""
    multiple = make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
