"""Save checkpoints in Megatron-LM's legacy `torch` format (--ckpt-format torch), as Megatron-LM does.

Megatron-LM's checkpointing.save_checkpoint, CheckpointType.LEGACY branch (core_v0.16.1):
- every rank calls the distributed optimizer's `save_parameter_state` (megatron-core's own
  get_parameter_state_dp_zero: a gloo gather of the DP shards) and DP rank 0 writes
  `iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/distrib_optim.pt`;
- DP rank 0 of each (TP, PP) writes `model_optim_rng.pt` = {args, checkpoint_version 3.0, iteration,
  model / model0..model{V-1} (state_dict_for_save_checkpoint), optimizer (the optimizer's
  state_dict(): param groups without parameter state for the distributed optimizer, the full torch
  Adam state dict otherwise, plus `grad_scaler` with fp16/bf16), opt_param_scheduler, rng_state
  (a one-element list: no --data-parallel-random-init), num_floating_point_operations_so_far};
- after a barrier, rank 0 writes latest_checkpointed_iteration.txt.
Loading is checkpointing.load_legacy_checkpoint.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from megatron.core import parallel_state

from megatron_ucp.formats.common import TRACKER_FILENAME, iteration_dir_name
from megatron_ucp.training.checkpointing import CHECKPOINT_VERSION, model_keys, saveable_args, unwrap

MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Megatron-LM's get_checkpoint_name folder: mp_rank_TT, _PPP with PP > 1, _EEE with EP > 1."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name + (f"_{ep_rank:03d}" if ep_size > 1 else "")


def this_rank_dir(ckpt_dir: Path) -> Path:
    return Path(ckpt_dir) / rank_dir_name(
        parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size())


def megatron_lm_args(args) -> argparse.Namespace:
    """The args as Megatron-LM pickles them: the harness's plain values, params_dtype a torch dtype."""
    saved = saveable_args(args)
    saved.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return saved


def legacy_state_dict(args, iteration: int, model, optimizer, scheduler, rng_state: dict) -> dict:
    """model_optim_rng.pt's content, key order as Megatron-LM's generate_state_dict."""
    sd = {"args": megatron_lm_args(args), "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    for key, chunk in zip(model_keys(model), model):
        sd[key] = unwrap(chunk).state_dict_for_save_checkpoint()
    if not args.no_save_optim:
        sd["optimizer"] = optimizer.state_dict()
        sd["opt_param_scheduler"] = scheduler.state_dict()
    if not args.no_save_rng:
        sd["rng_state"] = [rng_state]
    sd["num_floating_point_operations_so_far"] = args.num_floating_point_operations_so_far
    return sd


def save_legacy_checkpoint(args, iteration: int, model, optimizer, scheduler, rng_state: dict) -> Path:
    """Write SAVE/iter_XXXXXXX/mp_rank_*/{model_optim_rng.pt, distrib_optim.pt} and the tracker."""
    ckpt_dir = Path(args.save) / iteration_dir_name(iteration)
    rank_dir = this_rank_dir(ckpt_dir)
    rank_dir.mkdir(parents=True, exist_ok=True)  # every rank, as Megatron-LM's ensure_directory_exists
    if args.use_distributed_optimizer and not args.no_save_optim:
        # A collective over the DP group; megatron-core writes the file on DP rank 0.
        optimizer.save_parameter_state(str(rank_dir / DISTRIB_OPTIM_FILE))
    args.iteration = iteration
    if parallel_state.get_expert_data_parallel_rank() == 0:
        torch.save(legacy_state_dict(args, iteration, model, optimizer, scheduler, rng_state),
                   rank_dir / MODEL_FILE)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        tmp = Path(args.save) / f".{TRACKER_FILENAME}.tmp"
        tmp.write_text(str(iteration))
        os.replace(tmp, Path(args.save) / TRACKER_FILENAME)
    torch.distributed.barrier()
    return ckpt_dir
