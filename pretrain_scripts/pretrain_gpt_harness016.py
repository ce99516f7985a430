#!/usr/bin/env python
"""GPT pretraining on megatron-core with Megatron-LM's flags, plus --universal-checkpoint.

    torchrun --nproc-per-node 4 pretrain_scripts/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 --save ckpt

Runs on GPUs with NCCL, and on CPU with gloo (megatron_ucp.training.cpu_backend patches megatron-core).
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

from megatron_ucp.core import placement as layer_placement
from megatron_ucp.training import cpu_backend

cpu_backend.import_megatron_core()  # first: on CPU, megatron-core without torch.compile (saves ~10 s)

from megatron_ucp.training import arguments, checkpointing, data, flops, loop, seeding  # noqa: E402


def initialize(args):
    """Process groups, parallel state and seeds (Megatron-LM's initialize_megatron)."""
    on_cpu = cpu_backend.apply()
    backend = args.distributed_backend = args.distributed_backend or ("gloo" if on_cpu else "nccl")
    if not on_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend=backend,
                                         timeout=timedelta(minutes=args.distributed_timeout_minutes))
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    seeding.seed_everything(args.seed, parallel_state.get_pipeline_model_parallel_rank())
    # Megatron-LM's pretrain() warms its fused kernels up on random inputs before building the model.
    seeding.advance_like_megatron_lm_warmup(args, args.tensor_model_parallel_size)
    return parallel_state


def main(argv=None):
    args = arguments.parse_args(argv)
    mpu = initialize(args)
    from megatron_ucp.training import model as model_lib

    rank = torch.distributed.get_rank()
    args.transformer_impl = model_lib.transformer_impl(args)  # resolved, as Megatron-LM's args record it
    tokenizer = data.build_tokenizer(args)
    args.padded_vocab_size = arguments.padded_vocab_size(tokenizer.vocab_size, args)
    ucp = None
    if args.load and args.universal_checkpoint:
        from megatron_ucp.megatron_lm import loader
        ucp = loader.open_for_run(args)  # keeps the checkpoint's padded vocab size when TP allows
    if rank == 0:
        print(f"> megatron-ucp pretrain_gpt: TP{args.tensor_model_parallel_size} PP{args.pipeline_model_parallel_size} "
              f"DP{args.data_parallel_size}" + (f" VPP{args.virtual_pipeline_model_parallel_size}"
                                               if args.virtual_pipeline_model_parallel_size else "")
              + (" SP" if args.sequence_parallel else "")
              + (f", {args.num_experts} experts EP{args.expert_model_parallel_size} "
                 f"ETP{args.expert_tensor_parallel_size} (expert DP{mpu.get_expert_data_parallel_world_size()}, "
                 f"{args.moe_token_dispatcher_type} dispatcher)" if args.num_experts else "")
              + f", {model_lib.transformer_impl(args)} spec, "
              f"{'CPU/gloo' if not torch.cuda.is_available() else 'GPU/nccl'}", flush=True)
        if args.pipeline_model_parallel_size > 1:
            print(" > pipeline split: " + layer_placement.describe_placements(layer_placement.split_from_args(args)),
                  flush=True)
        print(f" > padded vocab (size: {tokenizer.vocab_size}) with "
              f"{args.padded_vocab_size - tokenizer.vocab_size} dummy tokens (new size: {args.padded_vocab_size})",
              flush=True)

    # Model, optimizer, scheduler.
    config = model_lib.transformer_config_from_args(args)
    model = model_lib.build_model(args, config)
    optimizer = model_lib.build_optimizer(args, model)
    scheduler = model_lib.build_scheduler(args, optimizer)
    model_lib.finalize_config_for_training(config, model)
    config.grad_scale_func = optimizer.scale_loss
    loop.set_overlap_sync_funcs(args, config, model)
    # Before any load (Megatron-LM draws them after it): a resume then continues the RNG streams exactly.
    seeding.advance_like_megatron_lm_data_loaders(
        mpu.is_pipeline_first_stage(ignore_virtual=True) or mpu.is_pipeline_last_stage(ignore_virtual=True))

    # Resume.
    if ucp is not None:
        loader.load_universal_checkpoint(args, model, optimizer, scheduler, ucp)
    elif args.load:
        checkpointing.load_checkpoint(args, model, optimizer, scheduler)
    start_iteration, consumed = args.iteration, args.consumed_train_samples
    if rank == 0 and args.load:
        print(f" > resuming at iteration {start_iteration}, consumed samples {consumed}", flush=True)

    # Data: only the first and last pipeline stages read batches.
    needs_data = mpu.is_pipeline_first_stage(ignore_virtual=True) or mpu.is_pipeline_last_stage(ignore_virtual=True)
    if rank == 0:  # build (and cache) indices once before the other ranks read them
        train_ds = data.build_train_dataset(args, tokenizer, build_on_this_rank=True)
    torch.distributed.barrier()
    if rank != 0:
        train_ds = data.build_train_dataset(args, tokenizer, build_on_this_rank=needs_data)
    device = cpu_backend.device()

    def iterator():
        sampler = data.PretrainingSampler(len(train_ds), consumed, args.micro_batch_size,
                                          mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
        return data.micro_batches(train_ds, sampler)

    # With VPP each model chunk pulls its own micro-batches from its own iterator.
    data_iterators = [iterator() if needs_data and start_iteration < args.train_iters else None
                      for _ in model]
    forward_step = loop.make_forward_step(device)
    logger = loop.TrainingLogger(args)

    param_gather = loop.ParamGatherHooks(args, config, model)
    iteration = start_iteration
    saved_at = None
    while iteration < args.train_iters:
        loss, grad_norm, lr, ok = loop.train_step(args, forward_step, data_iterators, model, optimizer, scheduler)
        param_gather.after_step(ok)
        iteration += 1
        args.consumed_train_samples += args.global_batch_size
        aux_losses = loop.moe_aux_losses(args, iteration, logger.tb) if args.num_experts else {}
        args.num_floating_point_operations_so_far += flops.num_floating_point_operations(args, args.global_batch_size)
        logger.log(iteration, loss, grad_norm, lr, args.consumed_train_samples, skipped=not ok,
                   loss_scale=optimizer.get_loss_scale().item(), aux_losses=aux_losses)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            param_gather.before_save()
            checkpointing.save_checkpoint(args, iteration, model, optimizer, scheduler)
            saved_at = iteration
            if rank == 0:
                print(f" > saved checkpoint at iteration {iteration} to {args.save}", flush=True)
        if args.exit_interval and iteration % args.exit_interval == 0:
            break
    # As Megatron-LM: the final state is saved even off the interval (and right after a load
    # with nothing left to train, which re-saves a checkpoint at this run's layout).
    param_gather.close()
    if args.save and saved_at != iteration:
        checkpointing.save_checkpoint(args, iteration, model, optimizer, scheduler)
        if rank == 0:
            print(f" > saved checkpoint at iteration {iteration} to {args.save}", flush=True)
    logger.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _user_facing_errors():
    errors = []
    try:
        from megatron_ucp.megatron_lm.loader import UniversalLoadError
        from megatron_ucp.universal import UniversalFormatError
        errors += [UniversalLoadError, UniversalFormatError]
    except ImportError:
        pass
    from megatron_ucp.core.layout import LayoutError
    return tuple(errors) + (LayoutError,)


UserFacingErrors = _user_facing_errors()

if __name__ == "__main__":
    try:
        main()
    except (arguments.ArgumentError, checkpointing.CheckpointError) + UserFacingErrors as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
