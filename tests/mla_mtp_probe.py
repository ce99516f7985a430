"""Child process of tests/test_mla_mtp.py: megatron-core 0.19's own GPTModel with multi-latent attention and
multi-token prediction, built from Megatron-LM flags as the entry point builds it (its parser and validate_args,
core_transformer_config_from_args, the local layer spec, the MTP block spec of the decoder's last layer), for each
case of CASES; writes what the model holds as JSON:

    python tests/mla_mtp_probe.py OUT.json

{case: {"params": [[name, shape]...] (named_parameters, registration order), "state": [[key, shape]...] (the
state dict less _extra_state: what legacy files hold), "extra": [module...] (modules saving an _extra_state),
"sharded": [[key, global shape, global offset]...] (sharded_state_dict after its factories: torch_dist)}}.

A case at PP > 1 builds one pipeline stage in this one process: megatron-core is told the stage's rank where it
asks (get_pg_rank), and the cross-stage embedding all-reduce is skipped (it changes values, not names).
cpu_shims are installed (the MLA core attention needs them): run it in a child process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mcore_gpt import single_process  # noqa: E402
from megatron_lm_args import megatron_lm_args  # noqa: E402

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 1 --lr 1e-3 --tokenizer-type NullTokenizer "
        "--vocab-size 1000 --mock-data --eval-interval 1000 --transformer-impl local --position-embedding-type rope "
        "--no-rope-fusion --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
        "--no-bias-swiglu-fusion --no-bias-gelu-fusion --no-persist-layer-norm --disable-jit-fuser").split()
MLA = ("--multi-latent-attention --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
       "--v-head-dim 16").split()
DEEPSEEK = [*MLA, *("--q-lora-rank 32 --qk-layernorm --swiglu --normalization RMSNorm --disable-bias-linear "
                    "--untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
                    "--moe-layer-freq [0,1] --moe-shared-expert-intermediate-size 32 --moe-router-score-function sigmoid "
                    "--moe-router-enable-expert-bias --mtp-num-layers 1").split()]

# case -> (flags, world size, pipeline rank built)
CASES = {
    # DeepSeek-V3-shaped: q-LoRA with its norm, the KV norm, first layer dense, experts with the router's bias, MTP
    "deepseek": (DEEPSEEK, 1, 0),
    # its last stage at PP2 (4 layers): the MTP stage's own copy of the word embeddings, the MTP block after the
    # decoder's final norm, before the output layer
    "deepseek_pp2_last_stage": ([*DEEPSEEK, "--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]",
                                 "--pipeline-model-parallel-size", "2"], 2, 1),
    # no q-LoRA (linear_q_proj), LayerNorm with biases, tied embeddings, two MTP layers, dense
    "mla_noqlora_layernorm_tied_mtp2": ([*MLA, "--normalization", "LayerNorm", "--mtp-num-layers", "2"], 1, 0),
    # MTP over GPT attention with GQA and QK layernorm: the MTP layer's norms spelled as the decoder's (key map)
    "gqa_qk_layernorm_mtp": (["--group-query-attention", "--num-query-groups", "2", "--qk-layernorm", "--swiglu",
                              "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
                              "--mtp-num-layers", "1"], 1, 0),
}


def build(flags, world_size: int, pp_rank: int):
    import torch  # noqa: F401
    from megatron.core.models.common.language_module import language_module
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs,
                                                          get_gpt_layer_local_spec, get_gpt_mtp_block_spec)
    from megatron.core.transformer import transformer_block, transformer_layer
    from megatron.training.arguments import core_transformer_config_from_args

    args = megatron_lm_args([*BASE, *flags], world_size=world_size)
    config = core_transformer_config_from_args(args)
    pp = args.pipeline_model_parallel_size
    for module in (transformer_block, transformer_layer):
        module.get_pg_rank = lambda group, r=pp_rank: r
    language_module.is_pp_first_stage = lambda group, r=pp_rank: r == 0
    language_module.is_pp_last_stage = lambda group, r=pp_rank, n=pp: r == n - 1
    language_module.LanguageModule._is_in_embd_group = lambda self: False
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          qk_l2_norm=False, pp_rank=pp_rank)
    else:
        spec = get_gpt_layer_local_spec(None, False, args.qk_layernorm, args.multi_latent_attention,
                                        normalization=args.normalization)
    last_layer = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=args.normalization,
                                             qk_l2_norm=False)[-1]
    mtp = get_gpt_mtp_block_spec(config, last_layer, use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=1024, max_sequence_length=32,
                     pre_process=pp_rank == 0, post_process=pp_rank == pp - 1, mtp_block_spec=mtp,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, parallel_output=True)
    return args, model


def describe(model) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    return {
        "params": [[n, list(p.shape)] for n, p in model.named_parameters()],
        "state": [[k, list(v.shape)] for k, v in model.state_dict().items() if not k.endswith("._extra_state")],
        "extra": sorted(k.rsplit(".", 1)[0] for k in model.state_dict() if k.endswith("._extra_state")),
        "sharded": [[sh.key, list(sh.global_shape), list(sh.global_offset)] for sh in nested_values(sharded)
                    if isinstance(sh, ShardedTensor) and not sh.key.endswith("._extra_state")],
    }


def main(out: str) -> None:
    from megatron.core import tensor_parallel

    report = {}
    with single_process():
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        for case, (flags, world_size, pp_rank) in CASES.items():
            args, model = build(flags, world_size, pp_rank)
            report[case] = {**describe(model), "args": {k: v for k, v in vars(args).items()
                                                        if isinstance(v, (int, float, str, bool, list, type(None)))}}
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
