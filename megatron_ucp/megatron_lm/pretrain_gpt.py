"""GPT pretraining on Megatron-LM 0.19's own training loop (`megatron.training.pretrain`).

A thin provider set, as Megatron-LM's pretrain_gpt.py plugs into the same loop: a model provider (local
spec: dense GPT, or GPT-MoE through the decoder block spec), a forward step with the masked LM loss, and
the datasets provider (three sources, all through megatron-core's BlendedMegatronDatasetBuilder):
- `--mock-data`: megatron-core's MockGPTDataset;
- `--data-path PREFIX ...`: Megatron indexed datasets (`PREFIX.bin/.idx`, tools/preprocess_data.py);
- neither: the embedded corpus (corpus.py), bytes as tokens: `--tokenizer-type NullTokenizer --vocab-size 257`
  (ids 0..255 and EOD 256), the entry point's defaults then (args_defaults).
Megatron-LM does everything else: arguments, initialization, the schedule, the optimizer, logging,
`--save` / `--load`. Added through its extra-args mechanism: `--universal-checkpoint` (universal_plugin)
and `--log-jsonl` (run_log). On CPU, cpu_shims' patches are installed first and its CPU flags are added
where the command line does not choose them:

    torchrun --nproc-per-node 4 pretrain_scripts/pretrain_gpt.py <Megatron-LM flags> --mock-data ...
"""

from __future__ import annotations

import sys
from functools import partial

from megatron_ucp.megatron_lm import cpu_shims

cpu_shims.install_import_patches()  # Python 3.11 and no triton: before megatron is imported

import torch  # noqa: E402

from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.datasets.utils import get_blend_from_list  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank  # noqa: E402
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank, get_batch_on_this_tp_rank  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args  # noqa: E402
from megatron.training.utils import is_first_or_last_pipeline_stage  # noqa: E402

from megatron_ucp.megatron_lm import corpus, run_log, universal_plugin  # noqa: E402

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """One pipeline chunk of a GPT (or GPT-MoE) model: megatron-core's local layers, or TransformerEngine's
    with --transformer-impl transformer_engine (GPUs; not run on this project's CPU machines)."""
    args = get_args()
    use_te = args.transformer_impl == "transformer_engine"
    print_rank_0("building GPT model ...")
    config = config or core_transformer_config_from_args(args)
    if args.num_experts:
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
                                                vp_stage=vp_stage)
    elif use_te:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm,
                                                                args.qk_layernorm, args.multi_latent_attention)
    else:
        layer_spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                              args.multi_latent_attention, normalization=args.normalization)
    mtp_block_spec = None
    if args.mtp_num_layers is not None:
        # As Megatron-LM's gpt_builders: the MTP layers are built like the decoder's last layer
        last_layer_spec = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te,
                                                      normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
                                                      vp_stage=vp_stage)[-1]
        mtp_block_spec = get_gpt_mtp_block_spec(config, last_layer_spec, use_transformer_engine=use_te,
                                                vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,  # Megatron-LM 0.19's gpt_builders.py drops it (GPTModel: 8)
        mtp_block_spec=mtp_block_spec,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch: TP rank 0 reads it, the TP group receives it; middle stages need none. A stage
    with multi-token prediction layers needs the tokens and positions too (they embed the shifted tokens)."""
    args = get_args()
    mtp_here = mtp_on_this_rank(mtp_num_layers=args.mtp_num_layers, ignore_virtual=False, vp_stage=vp_stage)
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        batch = {key: sample[key].cuda(non_blocking=True) if sample.get(key) is not None else None
                 for key in BATCH_KEYS}
        batch["cu_seqlens"] = None
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch[key] for key in BATCH_KEYS)


def loss_func(loss_mask, output_tensor):
    """Sum of the masked token losses and the token count; Megatron-LM averages over the global batch."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            get_rerun_state_machine().validate_result(
                result=loss, rejection_func=reject, message=f"found {what} in local forward loss calculation",
                tolerance=0.0, fatal=True)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock data, indexed data (--data-path) or the embedded corpus, seeded by --seed: the same samples on
    every layout."""
    args = get_args()
    tokenizer = get_tokenizer()  # the one Megatron-LM built from --tokenizer-type at initialization
    blend, split, dataset_type = None, args.split, MockGPTDataset
    if reads_embedded_corpus(args.mock_data, args.data_path):
        dataset_type = GPTDataset
        blend = ([corpus.indexed_dataset_prefix(corpus.cache_dir(args.data_cache_path), tokenizer)], None)
        # all train: the corpus' ~140 documents leave a 1% test split empty, and megatron-core's
        # GPTDataset never ends on an empty split
        split = "100,0,0"
    elif not args.mock_data:
        dataset_type = GPTDataset
        blend = get_blend_from_list(args.data_path)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=None,
        split=split, path_to_cache=args.data_cache_path, tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader)
    print_rank_0(f"> building {'mock' if args.mock_data else 'indexed'} train, validation, and test datasets "
                 "for GPT ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage), config
    ).build()


def extra_args_provider(parser):
    return run_log.add_arguments(universal_plugin.add_arguments(parser))


def reads_embedded_corpus(mock_data: bool, data_path) -> bool:
    """Whether the run trains on the embedded corpus: neither --mock-data nor --data-path."""
    return not mock_data and not data_path


# No evaluation during training: what Megatron-LM 0.19 means by an unset --eval-interval (its training loop asks
# `if args.eval_interval`), which its count of validation samples cannot take (it divides by it).
NO_EVALUATION_DURING_TRAINING = 2**31 - 1


def args_defaults(argv) -> dict:
    """Values for what Megatron-LM 0.19 leaves unset and cannot run without, passed as Megatron-LM's own
    `args_defaults`, which sets each only where the command line leaves it unset (a flag given always wins):
    --eval-interval (see NO_EVALUATION_DURING_TRAINING), and the tokenizer: on the embedded corpus the one it
    stores (NullTokenizer, --vocab-size 257: bytes 0..255, EOD 256), else Megatron-LM's pretrain_gpt.py's
    (GPT2BPETokenizer, which needs --vocab-file and --merge-file)."""
    import argparse

    data = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # Megatron-LM's spelling of both flags
    data.add_argument("--mock-data", action="store_true")
    data.add_argument("--data-path", nargs="*")
    given, _ = data.parse_known_args(argv)
    defaults = {"eval_interval": NO_EVALUATION_DURING_TRAINING, "tokenizer_type": "GPT2BPETokenizer"}
    if reads_embedded_corpus(given.mock_data, given.data_path):
        defaults.update(tokenizer_type="NullTokenizer", vocab_size=corpus.BYTE_VOCAB + 1)
    return defaults


# Flags of Megatron-LM this entry point cannot serve, each with why (one line at start instead of a failure later).
UNSUPPORTED_FLAGS = {
    # megatron-core's hybrid CP gives each packed (THD) sequence its own CP group size: it needs packed batches with
    # cu_seqlens, which the entry point's datasets (mock, indexed, the corpus) never make. Checkpoints of such runs
    # are laid out as any CP run's (the optimizer shards over DP x CP): megatron-ucp reads and writes them.
    "--hybrid-context-parallel": "the entry point's datasets are not packed (THD); hybrid context parallelism "
                                 "needs packed sequences: drop the flag (--context-parallel-size alone works)",
}


def unsupported_flag(argv) -> str:
    """The first flag of `argv` the entry point refuses, as one line naming it and why ('' when none)."""
    for arg in argv:
        why = UNSUPPORTED_FLAGS.get(arg.split("=", 1)[0])
        if why:
            return f"{arg.split('=', 1)[0]}: {why}"
    return ""


def main():
    problem = unsupported_flag(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    on_cpu = cpu_shims.install()  # before the arguments: validate_args asks for the GPU architecture
    if on_cpu:
        sys.argv[1:] = cpu_shims.with_cpu_flags(sys.argv[1:])
    universal_plugin.install()  # --universal-checkpoint: --load reads a universal checkpoint
    run_log.install()  # --log-jsonl
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=args_defaults(sys.argv[1:]))
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
             forward_step, model_provider=model_provider)


if __name__ == "__main__":
    main()
