"""Save and resume Megatron checkpoints in megatron-core's `torch_dist` format.

The state dict has the structure Megatron-LM's checkpointing.generate_state_dict builds (args,
checkpoint_version 3.0, iteration, model / model0..model{V-1}, optimizer with the distributed
optimizer's `dp_reshardable` (default) or `fully_reshardable` sharding, opt_param_scheduler,
rng_state), so Megatron-LM and this harness read each other's checkpoints.
Layout: SAVE/iter_0000004/{.metadata, __*.distcp, common.pt, metadata.json},
SAVE/latest_checkpointed_iteration.txt (written last, by rank 0, after every rank finished).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy, get_default_save_sharded_strategy)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)

from megatron_ucp.formats.common import TRACKER_FILENAME, iteration_dir_name
from megatron_ucp.formats.legacy import names as legacy_names
from megatron_ucp.formats.torch_dist import names as torch_dist_names
from megatron_ucp.training import cpu_backend

CHECKPOINT_VERSION = 3.0
TRACKER = TRACKER_FILENAME

# Args that must match between a checkpoint and the run that resumes it.
MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "swiglu", "normalization", "position_embedding_type",
              "untie_embeddings_and_output_weights", "add_bias_linear", "padded_vocab_size",
              "num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
              "moe_shared_expert_gate", "moe_router_enable_expert_bias")


class CheckpointError(RuntimeError):
    pass


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / iteration_dir_name(iteration)


def read_tracker(root: str | Path) -> int:
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        raise CheckpointError(f"{tracker} not found: {root} is not a Megatron checkpoint root "
                              "(pass the directory that holds latest_checkpointed_iteration.txt)")
    text = tracker.read_text().strip()
    if text == "release":
        raise CheckpointError(f"{tracker} says 'release': release checkpoints are not supported here")
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number") from None


def _sharded_sd_metadata(args) -> dict:
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = (
            "fully_reshardable" if args.dist_ckpt_optim_fully_reshardable else "dp_reshardable")
        if args.dist_ckpt_optim_fully_reshardable:
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def rng_state_dict() -> dict:
    """This rank's RNG state, as Megatron-LM's get_rng_state collects it (the CPU generator stands in
    for CUDA's on CPU)."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _rng_state(args) -> ShardedObject:
    state = rng_state_dict()
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    if args.expert_model_parallel_size > 1:
        # As Megatron-LM: with EP the DP ranks hold different expert-parallel RNG streams, so the
        # state is sharded by (PP, TP, DP) instead of being one replicated (PP, TP) object.
        dp = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        return ShardedObject(
            "rng_state", [state],
            (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_data_parallel_world_size(with_context_parallel=True)),
            (pp, tp, dp), replica_id=0)
    return ShardedObject(
        "rng_state", [state],
        (parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()),
        (pp, tp), replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def _foreign_rng_state(states) -> Optional[str]:
    """Why the saved RNG state cannot be restored on this device kind (None when it can)."""
    state = states[0] if isinstance(states, list) else states
    here = torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()
    saved = [state.get("cuda_rng_state"), *dict(state.get("rng_tracker_states") or {}).values()]
    sizes = {int(s.numel()) for s in saved if torch.is_tensor(s)}
    if sizes and sizes != {int(here.numel())}:
        kind = "CUDA" if sizes == {16} else "CPU" if sizes == {int(torch.get_rng_state().numel())} else "unknown"
        return (f"the checkpoint's RNG state is for {kind} generators ({sorted(sizes)} bytes) but this run uses "
                f"{'CUDA' if torch.cuda.is_available() else 'CPU'} generators ({int(here.numel())} bytes)")
    return None


def reseed(seed: int, iteration: int) -> None:
    """Deterministic RNG streams for a resume that cannot restore the saved ones (same rule as the
    universal loader: seed + 100 * pp_rank + 7919 * iteration)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank() + 7919 * int(iteration)
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _set_rng_state(states) -> None:
    state = states[0] if isinstance(states, list) else states
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def unwrap(chunk):
    """The GPTModel inside megatron-core's DDP / Float16Module wrappers (checkpoints hold its names)."""
    from megatron_ucp.training.model import unwrap_model
    return unwrap_model(chunk)


def model_keys(model) -> list:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _state_dict(args, model, optimizer, scheduler, iteration, metadata, is_loading, with_optim, with_rng):
    sd = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    for key, chunk in zip(model_keys(model), model):
        sd[key] = unwrap(chunk).sharded_state_dict(metadata=metadata)
    if with_optim:
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
        sd["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        sd["rng_state"] = _rng_state(args)
    sd["num_floating_point_operations_so_far"] = args.num_floating_point_operations_so_far
    return sd


def saveable_args(args) -> argparse.Namespace:
    """The args as stored in common.pt: plain values only, so any reader can unpickle them safely."""
    plain = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None), list, tuple))}
    return argparse.Namespace(**plain)


def save_checkpoint(args, iteration: int, model, optimizer, scheduler) -> Path:
    if args.ckpt_format == "torch":
        return save_legacy_checkpoint(args, iteration, model, optimizer, scheduler, rng_state_dict())
    ckpt_dir = iteration_dir(args.save, iteration)
    rank = torch.distributed.get_rank()
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    metadata = _sharded_sd_metadata(args)
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    args.iteration = iteration
    sd = _state_dict(saveable_args(args), model, optimizer, scheduler, iteration, metadata, is_loading=False,
                     with_optim=not args.no_save_optim, with_rng=not args.no_save_rng)
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"),
        parallel_state.get_data_parallel_group(with_context_parallel=True))
    content_metadata = {k: v for k, v in metadata.items() if k != "dp_cp_group"}
    dist_checkpointing.save(sd, str(ckpt_dir), strategy, validate_access_integrity=True,
                            content_metadata=content_metadata)
    torch.distributed.barrier()
    if rank == 0:
        tmp = Path(args.save) / f".{TRACKER}.tmp"
        tmp.write_text(str(iteration))
        os.replace(tmp, Path(args.save) / TRACKER)
    torch.distributed.barrier()
    return ckpt_dir


def model_parallel_layout(args) -> tuple:
    """(TP, PP, EP, ETP) of a run's or a checkpoint's args (older checkpoints: EP 1, ETP = TP)."""
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    return (tp, getattr(args, "pipeline_model_parallel_size", None) or 1,
            getattr(args, "expert_model_parallel_size", None) or 1,
            getattr(args, "expert_tensor_parallel_size", None) or tp)


def describe_layout(layout: tuple) -> str:
    tp, pp, ep, etp = layout
    return f"TP{tp}PP{pp}" + (f"EP{ep}ETP{etp}" if (ep, etp) != (1, tp) else "")


def experts_have_own_optimizer(args) -> bool:
    """Whether the expert parameters live in their own DDP buffers and optimizer (megatron-core's
    ChainedOptimizer [dense, expert]): with experts at EP > 1 or ETP != TP (cpu_backend's fixed rule)."""
    tp, _, ep, etp = model_parallel_layout(args)
    return bool(getattr(args, "num_experts", None)) and (ep > 1 or etp != tp)


def check_checkpoint_args(ckpt_args, args, ckpt_dir: Path) -> None:
    for name in MODEL_ARGS:
        theirs, ours = getattr(ckpt_args, name, None), getattr(args, name, None)
        if theirs is not None and theirs != ours:
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(f"{ckpt_dir}: checkpoint has {name}={theirs!r} but this run has {ours!r}; "
                                  f"pass {flag} {theirs} (or load a matching checkpoint)")


def load_checkpoint(args, model, optimizer, scheduler) -> Optional[int]:
    """Resume from args.load at the same TP/PP (DP may change with dp_reshardable). Returns the iteration."""
    root = Path(args.load)
    if args.ckpt_step is not None:
        iteration = args.ckpt_step
    elif (root / TRACKER).exists():
        iteration = read_tracker(root)
    else:
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {root}: no {TRACKER} found and --exit-on-missing-checkpoint is set")
        return None
    ckpt_dir = iteration_dir(root, iteration)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} does not exist: no iteration {iteration} under --load {root}")
    if not (ckpt_dir / torch_dist_names.METADATA_JSON_FILENAME).exists():
        if any(legacy_names.is_rank_dir_name(p.name) for p in ckpt_dir.iterdir()):
            return load_legacy_checkpoint(args, model, optimizer, scheduler, ckpt_dir)
        raise CheckpointError(f"{ckpt_dir} is neither a torch_dist checkpoint (no metadata.json) nor a legacy "
                              "torch one (no mp_rank_* folders)")

    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    ckpt_args = common["args"]
    check_checkpoint_args(ckpt_args, args, ckpt_dir)
    same_mp = model_parallel_layout(ckpt_args) == model_parallel_layout(args)
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    load_optim = not args.no_load_optim and not args.finetune and not getattr(ckpt_args, "no_save_optim", False)
    if load_optim and args.use_distributed_optimizer and not same_mp and \
            metadata.get("distrib_optim_sharding_type") == "dp_reshardable":
        saved, here = describe_layout(model_parallel_layout(ckpt_args)), describe_layout(model_parallel_layout(args))
        raise CheckpointError(
            f"{ckpt_dir}: saved at {saved} with the dp_reshardable optimizer; to resume at {here} "
            f"convert it: megatron-ucp to-universal {root} UCP_DIR, then --load UCP_DIR --universal-checkpoint")
    if load_optim and experts_have_own_optimizer(ckpt_args) != experts_have_own_optimizer(args):
        def where(a):
            tp, pp, ep, etp = model_parallel_layout(a)
            kind = "have an optimizer of their own" if experts_have_own_optimizer(a) else "share the dense optimizer"
            return f"at TP{tp}PP{pp}EP{ep}ETP{etp} the experts {kind}"
        raise CheckpointError(
            f"{ckpt_dir}: {where(ckpt_args)} but {where(args)} (megatron-core chains a separate expert optimizer "
            "only with EP > 1 or ETP != TP), so megatron-core cannot map the optimizer state; convert it: "
            f"megatron-ucp to-universal {root} UCP_DIR, then --load UCP_DIR --universal-checkpoint")
    # With EP the RNG state is one object per (PP, TP, DP) rank: it needs the same DP too.
    same_rng_shards = same_mp and (model_parallel_layout(args)[2] == 1 or getattr(
        ckpt_args, "data_parallel_size", None) == args.data_parallel_size)
    load_rng = same_rng_shards and not args.no_load_rng and not args.finetune and not getattr(ckpt_args, "no_save_rng", False)
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if load_optim:
        cpu_backend.init_adam_state_for_loading(optimizer)
    sd = _state_dict(args, model, optimizer, scheduler, iteration, metadata, is_loading=True,
                     with_optim=load_optim, with_rng=load_rng)
    strategy = FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(str(ckpt_dir)),
        parallel_state.get_data_parallel_group(with_context_parallel=True))
    with torch.no_grad():  # optimizer-state restore copies into leaf tensors
        state = dist_checkpointing.load(sd, str(ckpt_dir), strategy)
        for key, chunk in zip(model_keys(model), model):
            unwrap(chunk).load_state_dict(state[key], strict=True)
        if load_optim:
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["opt_param_scheduler"])
    return _finish_load(args, optimizer, state, ckpt_args, load_optim, load_rng=True)


def _finish_load(args, optimizer, state, ckpt_args, load_optim: bool, load_rng: bool) -> int:
    """What every resume does after the tensors are in: fp32 masters, RNG, iteration, consumed samples."""
    if (args.bf16 or args.fp16) and not load_optim:
        # As Megatron-LM: without optimizer state the fp32 main params start from the loaded weights.
        optimizer.reload_model_params()
    if load_rng and "rng_state" in state:
        problem = _foreign_rng_state(state["rng_state"])
        if problem is None:
            _set_rng_state(state["rng_state"])
        else:
            # A checkpoint saved on another device kind (CUDA's 16-byte Philox states on CPU, or the reverse):
            # its streams cannot continue here. Re-seed as the universal loader does, deterministically.
            if torch.distributed.get_rank() == 0:
                print(f"WARNING: {problem}; re-seeding deterministically from --seed and the iteration (dropout "
                      f"masks differ from the original run). Pass --no-load-rng to skip the saved RNG state.",
                      flush=True)
            reseed(args.seed, state["iteration"])
    if not args.finetune:
        args.iteration = state["iteration"]
        args.consumed_train_samples = getattr(ckpt_args, "consumed_train_samples", 0)
        args.num_floating_point_operations_so_far = state.get("num_floating_point_operations_so_far", 0)
    torch.distributed.barrier()
    return args.iteration


def load_legacy_checkpoint(args, model, optimizer, scheduler, ckpt_dir: Path) -> int:
    """Resume from Megatron-LM's legacy `torch` format (model_optim_rng.pt [+ distrib_optim.pt]) at
    its own TP/PP/EP, as Megatron-LM's load_checkpoint does: every rank reads its (tp, pp, ep) folder."""
    from megatron_ucp.formats.common import load_pickled

    rank_dir = this_rank_dir(ckpt_dir)
    state = load_pickled(rank_dir / legacy_names.MODEL_FILENAME, what="legacy model checkpoint",
                         fix="was the checkpoint saved at this TP/PP/EP? otherwise convert it with megatron-ucp "
                             "to-universal")
    ckpt_args = state["args"]
    check_checkpoint_args(ckpt_args, args, ckpt_dir)
    if model_parallel_layout(ckpt_args) != model_parallel_layout(args):
        saved, here = describe_layout(model_parallel_layout(ckpt_args)), describe_layout(model_parallel_layout(args))
        raise CheckpointError(
            f"{ckpt_dir}: legacy checkpoint saved at {saved}, this run uses {here}; convert it: megatron-ucp "
            f"to-universal {ckpt_dir.parent} UCP_DIR, then --load UCP_DIR --universal-checkpoint")
    load_optim = not args.no_load_optim and not args.finetune and "optimizer" in state
    with torch.no_grad():
        for key, chunk in zip(model_keys(model), model):
            unwrap(chunk).load_state_dict(state[key], strict=False)
        if load_optim:
            cpu_backend.init_adam_state_for_loading(optimizer)
            optimizer.load_state_dict(state["optimizer"])
            if args.use_distributed_optimizer:
                distrib = rank_dir / legacy_names.DISTRIB_OPTIM_FILENAME
                if not distrib.exists():
                    raise CheckpointError(f"{distrib} missing: the checkpoint was saved without "
                                          "--use-distributed-optimizer; drop the flag to resume it")
                optimizer.load_parameter_state(str(distrib))
            scheduler.load_state_dict(state["opt_param_scheduler"])
    return _finish_load(args, optimizer, state, ckpt_args, load_optim,
                        load_rng=not args.no_load_rng and not args.finetune)


# --------------------------------------------------------------------------------------------------
# Saving in Megatron-LM's legacy `torch` format (--ckpt-format torch), as Megatron-LM does.
#
#Megatron-LM's checkpointing.save_checkpoint, CheckpointType.LEGACY branch (core_v0.16.1):
#- every rank calls the distributed optimizer's `save_parameter_state` (megatron-core's own
#  get_parameter_state_dp_zero: a gloo gather of the DP shards) and DP rank 0 writes
#  `iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/distrib_optim.pt`;
#- DP rank 0 of each (TP, PP) writes `model_optim_rng.pt` = {args, checkpoint_version 3.0, iteration,
#  model / model0..model{V-1} (state_dict_for_save_checkpoint), optimizer (the optimizer's
#  state_dict(): param groups without parameter state for the distributed optimizer, the full torch
#  Adam state dict otherwise, plus `grad_scaler` with fp16/bf16), opt_param_scheduler, rng_state
#  (a one-element list: no --data-parallel-random-init), num_floating_point_operations_so_far};
#- after a barrier, rank 0 writes latest_checkpointed_iteration.txt.
#Loading is checkpointing.load_legacy_checkpoint.


def this_rank_dir(ckpt_dir: Path) -> Path:
    return Path(ckpt_dir) / legacy_names.rank_dir_name(
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
        optimizer.save_parameter_state(str(rank_dir / legacy_names.DISTRIB_OPTIM_FILENAME))
    args.iteration = iteration
    if parallel_state.get_expert_data_parallel_rank() == 0:
        torch.save(legacy_state_dict(args, iteration, model, optimizer, scheduler, rng_state),
                   rank_dir / legacy_names.MODEL_FILENAME)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        tmp = Path(args.save) / f".{TRACKER_FILENAME}.tmp"
        tmp.write_text(str(iteration))
        os.replace(tmp, Path(args.save) / TRACKER_FILENAME)
    torch.distributed.barrier()
    return ckpt_dir
