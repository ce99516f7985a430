"""Model FLOPs per iteration, as Megatron-LM counts them (checkpoints carry the running total).

Megatron-LM's training.num_floating_point_operations (core_v0.16.1), dense GPT branch: per token,
3 (forward, weight grad, data grad) x 2 (multiply-add) x [MLP GEMMs + attention GEMMs + causal
attention scores + logits]. Checked against fixture A's `num_floating_point_operations_so_far`
(962592768.0 after 4 iterations). Pure: args in, a float out.
"""

from __future__ import annotations


def num_floating_point_operations(args, batch_size: int) -> float:
    """FLOPs of one iteration over `batch_size` sequences (dense GPTModel, standard attention)."""
    fwd_bwd, fma = 3, 2
    ffn_factor = 3 if args.swiglu else 2  # SwiGLU stacks h->2*ffn and ffn->h; GELU h->ffn and ffn->h
    query = args.kv_channels * args.num_attention_heads
    key_value = args.kv_channels * (args.num_query_groups if args.group_query_attention
                                    else args.num_attention_heads)
    attention = fwd_bwd * fma * (
        args.hidden_size * (query + 2 * key_value)  # QKV projection
        + query * args.seq_length / 2 * 2           # QK^T and (QK^T)V under the causal mask
        + query * args.hidden_size                  # output projection
    )
    mlp = fwd_bwd * fma * args.hidden_size * args.ffn_hidden_size * ffn_factor
    logits = fwd_bwd * fma * args.hidden_size * args.padded_vocab_size
    return batch_size * args.seq_length * (args.num_layers * (mlp + attention) + logits)
