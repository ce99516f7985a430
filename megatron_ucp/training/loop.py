"""One training iteration and its log line, as Megatron-LM's pretrain_gpt.py / training.py do them."""

from __future__ import annotations

import json
import math
import time
from functools import partial
from typing import Dict, Optional

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ucp.training.model import unwrap_model


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's GPT loss: masked token-sum, with the token count for global averaging."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def make_forward_step(device):
    def forward_step(data_iterator, model):
        vp_stage = getattr(unwrap_model(model), "vp_stage", None)  # set by GPTModel under VPP
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        tokens = labels = loss_mask = attention_mask = position_ids = None
        if first or last:
            batch = next(data_iterator)
            batch = {k: v.to(device) for k, v in batch.items()}
            tokens, position_ids = batch["tokens"], batch["position_ids"]
            labels, loss_mask = batch["labels"], batch["loss_mask"]
            attention_mask = batch.get("attention_mask")
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
        return output_tensor, partial(loss_func, loss_mask)

    return forward_step


def train_step(args, forward_step, data_iterators, model, optimizer, scheduler):
    """Forward/backward over the global batch, optimizer step, LR step. Returns (lm_loss, grad_norm, lr)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=data_iterators if len(model) > 1 else data_iterators[0],
        model=model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    lr = optimizer.param_groups[0]["lr"]
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=args.global_batch_size)

    # Token-averaged loss over the global batch (all micro-batches, all DP ranks), on the last stage;
    # then shared with every rank so each can log it.
    lm_loss = torch.zeros(2, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for report in losses:
            lm_loss += report["lm loss"].view(-1).to(torch.float64).cpu()
    lm_loss = lm_loss.to(_comm_device())
    torch.distributed.all_reduce(lm_loss, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    # Move the value from the last stage to every rank of the pipeline.
    torch.distributed.all_reduce(lm_loss, group=parallel_state.get_pipeline_model_parallel_group())
    loss = (lm_loss[0] / lm_loss[1]).item() if lm_loss[1] > 0 else float("nan")
    if grad_norm is None:
        grad_norm = float("nan")
    return loss, float(grad_norm), lr, bool(update_successful)


def moe_track_names(args) -> list:
    """The router losses Megatron-LM's training_log tracks for these flags, in its order."""
    balancing = args.moe_router_load_balancing_type
    names = [name for kind, name in (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"),
                                     ("global_aux_loss", "global_load_balancing_loss")) if kind in balancing]
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def moe_aux_losses(args, iteration: int, writer=None) -> Dict[str, float]:
    """This iteration's router losses as Megatron-LM reports them (megatron-core's track_moe_metrics):
    each layer's loss summed over micro-batches / num_microbatches, summed over PP and TP (SP shards),
    averaged over DP, then summed over layers / number of MoE layers. Logging only: the aux loss reaches
    the gradients through the router's MoEAuxLossAutoScaler, never through `lm loss`.
    A collective: every rank calls it every iteration."""
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    from megatron_ucp.training.arguments import moe_layer_pattern

    totals: Dict[str, torch.Tensor] = {}
    names = moe_track_names(args)
    track_moe_metrics(loss_scale=1.0 / args.num_microbatches, iteration=iteration, writer=writer,
                      total_loss_dict=totals, per_layer_logging=args.moe_per_layer_logging,
                      force_initialize=True, track_names=names, num_layers=args.num_layers,
                      # the pattern, not the int: track_moe_metrics counts MoE layers from it
                      moe_layer_freq=moe_layer_pattern(args.num_layers, args.moe_layer_freq))
    return {name: float(totals[name]) for name in names if name in totals}


def _comm_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class TrainingLogger:
    """Megatron-style console lines on the last rank, JSONL and TensorBoard on request."""

    def __init__(self, args):
        self.args = args
        self.rank = torch.distributed.get_rank()
        self.is_logging_rank = self.rank == torch.distributed.get_world_size() - 1
        self.jsonl = open(args.log_jsonl, "a") if (args.log_jsonl and self.is_logging_rank) else None
        self.tb = None
        if args.tensorboard_dir and self.is_logging_rank:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=args.tensorboard_dir)
            except ImportError:
                print("WARNING: --tensorboard-dir needs the `tensorboard` package; skipping TensorBoard logs",
                      flush=True)
        self.last_time = time.time()

    def log(self, iteration: int, loss: float, grad_norm: float, lr: float, consumed_samples: int,
            skipped: bool, loss_scale: float = 1.0, aux_losses: Optional[Dict[str, float]] = None) -> None:
        now = time.time()
        elapsed_ms = (now - self.last_time) * 1000.0
        self.last_time = now
        if not self.is_logging_rank:
            return
        record = {"iteration": iteration, "lm_loss": loss, "grad_norm": grad_norm, "lr": lr,
                  "consumed_samples": consumed_samples, "skipped": skipped, "loss_scale": loss_scale,
                  "elapsed_ms": round(elapsed_ms, 3)}
        aux_losses = aux_losses or {}
        record.update(aux_losses)
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.tb:
            self.tb.add_scalar("lm loss", loss, iteration)
            self.tb.add_scalar("grad-norm", grad_norm, iteration)
            self.tb.add_scalar("learning-rate", lr, iteration)
        if iteration % self.args.log_interval == 0:
            print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{self.args.train_iters:8d} |"
                  f" consumed samples: {consumed_samples:12d} |"
                  f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
                  f" learning rate: {lr:.6E} | global batch size: {self.args.global_batch_size:5d} |"
                  f" lm loss: {loss:.6E} |"
                  + "".join(f" {name}: {value:.6E} |" for name, value in aux_losses.items() if value > 0.0)
                  + f" loss scale: {loss_scale:.1f} | grad norm: {grad_norm:.3f} |"
                  f" number of skipped iterations: {int(skipped):3d} | number of nan iterations: "
                  f"{int(math.isnan(loss)):3d} |", flush=True)

    def close(self):
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def set_overlap_sync_funcs(args, config, model) -> None:
    """Megatron-LM's train(): with overlapped DP communication the pipeline schedules launch each
    chunk's grad reduce / param gather themselves (aligned across pipeline stages by default)."""
    def per_chunk(funcs):
        return funcs[0] if len(funcs) == 1 else funcs

    if args.overlap_grad_reduce and args.align_grad_reduce:
        config.grad_sync_func = per_chunk([chunk.start_grad_sync for chunk in model])
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = per_chunk([chunk.start_param_sync for chunk in model])


class ParamGatherHooks:
    """--overlap-param-gather: megatron-core all-gathers updated parameters lazily, in forward
    pre-hooks of the next iteration. As Megatron-LM's train(): hooks off (and the schedules' param
    sync off) until one step has succeeded, a forced all-gather before every checkpoint save (else
    the saved model holds stale shards), and a synchronous all-gather when training ends."""

    def __init__(self, args, config, model):
        self.active = args.use_distributed_optimizer and args.overlap_param_gather
        self.config, self.model = config, model
        self.enabled = False
        self.param_sync_func = None
        if self.active:
            for chunk in model:
                chunk.disable_forward_pre_hook(param_sync=False)
            self.param_sync_func, config.param_sync_func = config.param_sync_func, None

    def after_step(self, update_successful: bool) -> None:
        if self.active and not self.enabled and update_successful:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()
            self.config.param_sync_func = self.param_sync_func
            self.enabled = True

    def before_save(self) -> None:
        if self.active:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    def close(self) -> None:
        if self.active and self.enabled:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=True)
            self.enabled = False
