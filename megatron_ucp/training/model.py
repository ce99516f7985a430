"""Build the megatron-core GPT model chunks, DDP wrappers, optimizer and LR scheduler from args.

Mirrors Megatron-LM's pretrain_gpt.py model_provider + training.setup_model_and_optimizer, with the
fused CUDA kernels turned off when running on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig

from megatron_ucp.training import cpu_backend


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def transformer_impl(args) -> str:
    if args.transformer_impl:
        if args.transformer_impl == "transformer_engine" and not _have_te():
            raise RuntimeError("--transformer-impl transformer_engine needs TransformerEngine "
                               "(pip install 'megatron-ucp[te]' on a CUDA machine); use --transformer-impl local")
        return args.transformer_impl
    return "transformer_engine" if (torch.cuda.is_available() and _have_te()) else "local"


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
        return True
    except Exception:
        return False


def transformer_config_from_args(args) -> TransformerConfig:
    on_gpu = torch.cuda.is_available()
    dtype = params_dtype(args)
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        sequence_parallel=args.sequence_parallel,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        deallocate_pipeline_outputs=True,
        # gloo matches point-to-point messages by order per peer; batched p2p posts sends to the
        # previous and next stage in an order that swaps same-shaped tensors when prev == next
        # (PP=2 with virtual stages). The unbatched even/odd ordering is correct on gloo.
        batch_p2p_comm=on_gpu,
        # Fused kernels need CUDA (and Apex/TE); Megatron-LM's CPU fixtures ran with them off too.
        masked_softmax_fusion=on_gpu,
        bias_activation_fusion=on_gpu and args.add_bias_linear,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
    )
    if args.num_experts is not None:
        kwargs.update(moe_config_kwargs(args))
    return TransformerConfig(**kwargs)


def moe_config_kwargs(args) -> dict:
    """The TransformerConfig fields of the MoE flags (Megatron-LM copies same-named args onto the config)."""
    return dict(
        num_moe_experts=args.num_experts,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_layer_freq=args.moe_layer_freq,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_shared_expert_overlap=args.moe_shared_expert_overlap,
        moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_per_layer_logging=args.moe_per_layer_logging,
    )


def layer_spec(args, config: TransformerConfig, vp_stage=None):
    """The layer spec Megatron-LM's gpt_builder picks: with experts, a block spec that mixes dense and MoE
    layers per --moe-layer-freq (sliced to this pipeline stage / virtual stage); otherwise one layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec, get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    if args.num_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=transformer_impl(args) == "transformer_engine",
                                          normalization=args.normalization, vp_stage=vp_stage)
    if transformer_impl(args) == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec(num_experts=None, moe_grouped_gemm=False,
                                                          qk_layernorm=False)
    return get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                                    normalization=args.normalization)


def build_model(args, config: TransformerConfig) -> List[DistributedDataParallel]:
    """GPT model chunks (one per virtual stage), wrapped in megatron-core's DDP."""
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        spec = layer_spec(args, config, vp_stage=vp_stage if vpp else None)
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            vp_stage=vp_stage if vpp else None,
        )
        model.model_type = ModelType.encoder_or_decoder
        cpu_backend.prepare_expert_linears(model, config)  # before DDP: it picks each parameter's buffer
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        model.to(cpu_backend.device())
        chunks.append(model)

    if args.layout_invariant_init:
        from megatron_ucp.training.init import layout_invariant_init
        layout_invariant_init(chunks, args)
    if args.bf16 or args.fp16:
        # As Megatron-LM's get_model: casts the remaining fp32 params (norms) and the forward's inputs/outputs.
        from megatron.core.transformer.module import Float16Module
        chunks = [Float16Module(config, chunk) for chunk in chunks]

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=ddp_bucket_size(args, sum(p.numel() for chunk in chunks for p in chunk.parameters())),
        pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]


def ddp_bucket_size(args, rank_num_parameters: int):
    """Megatron-LM's get_model: --ddp-num-buckets splits this rank's parameters, else --ddp-bucket-size;
    None (one bucket per buffer) without --overlap-grad-reduce. megatron-core's DDP fills the default
    (max(4e7, 1e6 x DP)) and uses one bucket anyway on pipeline stages > 0 and VPP chunks > 0."""
    if not args.overlap_grad_reduce:
        return None
    if args.ddp_num_buckets is not None:
        return rank_num_parameters // args.ddp_num_buckets
    return args.ddp_bucket_size


def unwrap_model(chunk):
    """The GPTModel inside megatron-core's DDP and Float16Module wrappers (checkpoints hold its names)."""
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def build_optimizer(args, model):
    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, model, config_overrides=get_standard_config_overrides(config))
    cpu_backend.filter_expert_duplicates_over_etp(optimizer)
    return optimizer


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )


def finalize_config_for_training(config: TransformerConfig, model) -> None:
    """Hooks the pipeline schedules need (Megatron-LM sets them in its train())."""
    # Without this megatron-core never all-reduces DP/SP/tied-embedding grads.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in model]
    if len(model) == 1:
        config.no_sync_func = config.no_sync_func[0]
    config.grad_scale_func = None
