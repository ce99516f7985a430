"""Universal checkpoint -> megatron-core `torch_dist` checkpoint at any layout, saved by Megatron-LM itself
(`from-universal --via-megatron-lm`; the default route is formats/torch_dist/writer.py, offline).

What it still serves: it is Megatron-LM's own save, so it is a reference the direct writer is tested against
(tests/test_torch_dist_direct.py: same `.metadata`, chunk for chunk equal), and the fallback for a
megatron-core whose torch_dist layout the direct writer does not reproduce.
It needs T*P*D processes and the whole model and optimizer state in memory.

The faithful route: launch the project's entry point `pretrain_scripts/pretrain_gpt.py` (Megatron-LM 0.19's
own training loop, megatron_ucp/megatron_lm) at the target layout with `--load UCP --universal-checkpoint
--train-iters <iteration> --save DST`. Megatron-LM builds the model and optimizer, the plugin fills them from
the universal checkpoint (each rank reading only its slices), no step is trained, and Megatron-LM's
pretrain() saves once after its (empty) training loop, because the iteration is not a multiple of
--save-interval. The files are megatron-core 0.19's (no common.pt: the common state is a ShardedObject).

Cost: T*P*D processes on this machine (CPU, gloo: CUDA is hidden from them), and memory about the
model's weights plus optimizer state in total (each rank holds its shard, as in training).

The hard part is rebuilding Megatron-LM flags from the Megatron args stored in the universal
metadata: `megatron_lm_flags_from_universal`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from megatron_ucp.adapters.gpt import megatron_padded_vocab, padded_vocab_at
from megatron_ucp.formats.common import TRACKER_FILENAME
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.formats.writer_base import CheckpointWriter, PlannedFile, WriteError, WriteTarget

REPO = Path(__file__).resolve().parents[3]
PRETRAIN_SCRIPT = REPO / "pretrain_scripts" / "pretrain_gpt.py"
DEFAULT_TIMEOUT_S = 3600


class MegatronLMRunError(WriteError):
    """The Megatron-LM run that writes the torch_dist checkpoint failed; the message has its log tail."""


# Megatron arg -> Megatron-LM flag for values passed through as they are (None: left at Megatron-LM's default).
_VALUE_FLAGS = (
    ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"), ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"), ("kv_channels", "--kv-channels"),
    ("normalization", "--normalization"), ("norm_epsilon", "--norm-epsilon"),
    ("layernorm_epsilon", "--norm-epsilon"),  # the dest of --norm-epsilon from Megatron-LM 0.17 on
    ("position_embedding_type", "--position-embedding-type"), ("rotary_base", "--rotary-base"),
    ("rotary_percent", "--rotary-percent"), ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by"),
    ("seq_length", "--seq-length"), ("max_position_embeddings", "--max-position-embeddings"),
    ("init_method_std", "--init-method-std"), ("attention_dropout", "--attention-dropout"),
    ("hidden_dropout", "--hidden-dropout"), ("micro_batch_size", "--micro-batch-size"),
    ("global_batch_size", "--global-batch-size"), ("seed", "--seed"),
    ("lr", "--lr"), ("min_lr", "--min-lr"), ("lr_decay_style", "--lr-decay-style"),
    ("weight_decay", "--weight-decay"), ("clip_grad", "--clip-grad"), ("adam_beta1", "--adam-beta1"),
    ("adam_beta2", "--adam-beta2"), ("adam_eps", "--adam-eps"), ("loss_scale", "--loss-scale"),
    ("initial_loss_scale", "--initial-loss-scale"), ("min_loss_scale", "--min-loss-scale"),
    ("loss_scale_window", "--loss-scale-window"), ("hysteresis", "--hysteresis"),
    ("ddp_bucket_size", "--ddp-bucket-size"),
    # mixture of experts (the model's shape from model_config, routing and losses from the args)
    ("num_experts", "--num-experts"), ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
    ("moe_router_topk", "--moe-router-topk"), ("moe_router_load_balancing_type", "--moe-router-load-balancing-type"),
    ("moe_aux_loss_coeff", "--moe-aux-loss-coeff"), ("moe_z_loss_coeff", "--moe-z-loss-coeff"),
    ("moe_router_score_function", "--moe-router-score-function"),
    ("moe_router_bias_update_rate", "--moe-router-bias-update-rate"),
    ("moe_token_dispatcher_type", "--moe-token-dispatcher-type"),
    # multi-latent attention (shape from model_config, RoPE variant from the args) and multi-token prediction
    ("q_lora_rank", "--q-lora-rank"), ("kv_lora_rank", "--kv-lora-rank"), ("qk_head_dim", "--qk-head-dim"),
    ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim"), ("v_head_dim", "--v-head-dim"), ("rope_type", "--rope-type"),
    ("rotary_scaling_factor", "--rotary-scaling-factor"), ("mscale", "--mscale"), ("mscale_all_dim", "--mscale-all-dim"),
    ("mtp_num_layers", "--mtp-num-layers"), ("mtp_loss_scaling_factor", "--mtp-loss-scaling-factor"),
)
# Megatron arg -> Megatron-LM flag for booleans passed when true.
_TRUE_FLAGS = (
    ("swiglu", "--swiglu"), ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("add_qkv_bias", "--add-qkv-bias"), ("bf16", "--bf16"), ("fp16", "--fp16"),
    ("overlap_grad_reduce", "--overlap-grad-reduce"),
    ("accumulate_allreduce_grads_in_fp32", "--accumulate-allreduce-grads-in-fp32"),
    ("dist_ckpt_optim_fully_reshardable", "--dist-ckpt-optim-fully-reshardable"),
    ("moe_shared_expert_gate", "--moe-shared-expert-gate"), ("moe_router_pre_softmax", "--moe-router-pre-softmax"),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias"),
    ("multi_latent_attention", "--multi-latent-attention"), ("qk_layernorm", "--qk-layernorm"),
)
_MEGATRON_LM_CHOICES = {
    "normalization": ("LayerNorm", "RMSNorm"),
    "position_embedding_type": ("learned_absolute", "rope"),
    "lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    "moe_token_dispatcher_type": ("allgather", "alltoall"),
}


def _flag_value(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _data_flags(args: Mapping[str, Any], true_vocab: int, notes: list) -> list[str]:
    """Tokenizer and data flags. No step is trained, so the data only has to exist and the tokenizer only
    has to give the model's true vocabulary: NullTokenizer of that size (Megatron-LM 0.19 takes --vocab-size
    as the whole vocabulary, EOD included) over --mock-data."""
    tokenizer = args.get("tokenizer_type")
    if tokenizer != "NullTokenizer":
        notes.append(f"tokenizer {tokenizer!r}: the conversion run uses NullTokenizer with the same vocabulary "
                     f"({true_vocab}) and --mock-data (no step is trained)")
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(true_vocab), "--mock-data"]


def layout_flags(layout: ParallelLayout, vpp_layers: Optional[int], use_distributed_optimizer: bool) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.vpp and vpp_layers:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(vpp_layers)]
    elif layout.vpp:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(layout.vpp)]
    for value, flag in ((layout.first_stage_layers, "--decoder-first-pipeline-num-layers"),
                        (layout.last_stage_layers, "--decoder-last-pipeline-num-layers")):
        if value is not None:
            flags += [flag, str(value)]
    if layout.embedding_in_split:
        flags.append("--account-for-embedding-in-pipeline-split")
    if layout.loss_in_split:
        flags.append("--account-for-loss-in-pipeline-split")
    if layout.ep > 1 or layout.expert_tp != layout.tp:
        flags += ["--expert-model-parallel-size", str(layout.ep), "--expert-tensor-parallel-size",
                  str(layout.expert_tp)]
    if layout.sp:
        flags.append("--sequence-parallel")
    if layout.cp > 1:
        flags += ["--context-parallel-size", str(layout.cp)]
    if use_distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    return flags


def megatron_lm_flags_from_universal(metadata: Mapping[str, Any], layout: ParallelLayout, *,
                                 vpp_layers: Optional[int] = None, use_distributed_optimizer: bool = False,
                                 optimizer_format: Optional[str] = None, notes: Optional[list] = None) -> list[str]:
    """pretrain_gpt.py flags that rebuild the universal checkpoint's model, optimizer and LR schedule at
    `layout` (without --load/--save/--train-iters). `notes` collects substitutions made on the way.
    optimizer_format ('dp_reshardable' | 'fully_reshardable') chooses how the distributed optimizer's state
    is saved; None keeps the source run's choice.

    The model shape comes from `model_config` (authoritative), the rest from Megatron's `args`.
    Schedule lengths: --lr-decay-iters and --lr-warmup-iters are given explicitly because Megatron-LM
    would otherwise derive them from --train-iters, which here is the checkpoint's iteration.
    """
    notes = notes if notes is not None else []
    args = dict(metadata.get("args") or {})
    config = dict(metadata["model_config"])
    # Model shape from model_config, so args from any source (or none) give the same model.
    args.update({k: config[k] for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                        "kv_channels", "swiglu", "normalization", "position_embedding_type",
                                        "untie_embeddings_and_output_weights", "add_qkv_bias", "qk_layernorm",
                                        "make_vocab_size_divisible_by", "multi_latent_attention", "q_lora_rank",
                                        "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                                        "mtp_num_layers") if k in config})
    if config.get("max_position_embeddings"):
        args["max_position_embeddings"] = config["max_position_embeddings"]
    if config.get("num_experts"):
        args.update({k: config[k] for k in ("num_experts", "moe_ffn_hidden_size",
                                            "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                                            "moe_router_enable_expert_bias") if k in config})
        if args.get("moe_grouped_gemm"):
            raise ValueError("--moe-grouped-gemm runs on GPUs only (TransformerEngine); the CPU entry point uses "
                             "sequential experts: write --ckpt-format torch")
    if not args.get("seq_length"):
        args["seq_length"] = args.get("max_position_embeddings") or config.get("max_position_embeddings")
    if not args.get("micro_batch_size"):
        raise ValueError("the universal checkpoint's args lack micro_batch_size; it was not written from a "
                         "Megatron-LM run")

    flags = layout_flags(layout, vpp_layers, use_distributed_optimizer)
    if config.get("num_experts"):
        freq = config.get("moe_layer_freq", 1)
        flags += ["--moe-layer-freq", "[" + ",".join(map(str, freq)) + "]" if isinstance(freq, list) else str(freq)]
    for name, flag in _VALUE_FLAGS:
        value = args.get(name)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):  # nargs="+" flags (e.g. --moe-aux-loss-coeff per loss type)
            flags += [flag, *map(_flag_value, value)]
            continue
        if name in _MEGATRON_LM_CHOICES and value not in _MEGATRON_LM_CHOICES[name]:
            raise ValueError(f"{name}={value!r} is not supported by the CPU entry point (it supports "
                             f"{', '.join(_MEGATRON_LM_CHOICES[name])}); use --ckpt-format torch")
        flags += [flag, _flag_value(value)]
    if optimizer_format is not None:
        args["dist_ckpt_optim_fully_reshardable"] = optimizer_format == "fully_reshardable"
    for name, flag in _TRUE_FLAGS:
        if args.get(name):
            flags.append(flag)
    if config.get("num_query_groups") != config.get("num_attention_heads"):
        flags += ["--group-query-attention", "--num-query-groups", str(config["num_query_groups"])]
    if not config.get("add_bias_linear", True):
        flags.append("--disable-bias-linear")

    # LR schedule lengths, in iterations, as the source run had them.
    train_iters = args.get("train_iters")
    decay = args.get("lr_decay_iters") or train_iters
    if decay:
        flags += ["--lr-decay-iters", str(int(decay))]
    warmup = args.get("lr_warmup_iters") or 0
    if not warmup and args.get("lr_warmup_fraction") and decay:
        warmup = int(float(args["lr_warmup_fraction"]) * int(decay))
    if args.get("lr_warmup_samples") and args.get("global_batch_size"):
        warmup = int(args["lr_warmup_samples"]) // int(args["global_batch_size"])
    if warmup:
        flags += ["--lr-warmup-iters", str(int(warmup))]
    if args.get("optimizer") not in (None, "adam"):
        raise ValueError(f"optimizer={args['optimizer']!r}: only Adam state is supported")

    flags += _data_flags(args, int(config["vocab_size"]), notes)
    return flags


def megatron_lm_command(ucp_path: Path, save_dir: Path, iteration: int, nproc: int, flags: Sequence[str]) -> list[str]:
    """The torchrun command line. pretrain() saves after its training loop when the iteration is not a multiple
    of --save-interval (iteration + 1 never divides it); no evaluation (Megatron-LM 0.19 needs an
    --eval-interval to skip past on a resume), no data-loader workers."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(PRETRAIN_SCRIPT), *flags, "--load", str(ucp_path), "--universal-checkpoint",
            "--train-iters", str(iteration), "--save", str(save_dir), "--save-interval", str(iteration + 1),
            "--eval-iters", "0", "--eval-interval", str(iteration + 1), "--num-workers", "0",
            # the scheduler as stored: Megatron-LM derives its weight-decay steps from --train-iters, here the
            # checkpoint's iteration, and refuses a stored schedule that differs
            "--use-checkpoint-opt_param-scheduler"]


def write(ucp_path: Path, save_dir: Path, iteration: int, layout: ParallelLayout, flags: Sequence[str], *,
          timeout_s: int = DEFAULT_TIMEOUT_S, log_path: Optional[Path] = None) -> Path:
    """Run Megatron-LM so that it saves iteration `iteration` under `save_dir` (tracker included)."""
    cmd = megatron_lm_command(ucp_path, save_dir, iteration, layout.world_size, flags)
    # CPU + gloo whatever the host has: the conversion needs no accelerator and T*P*D need not fit on GPUs.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
               CUDA_VISIBLE_DEVICES="")
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        if log_path:
            log_path.write_text(out)
        raise MegatronLMRunError(f"the Megatron-LM run writing the torch_dist checkpoint timed out after {timeout_s} s "
                              f"({layout.world_size} processes); raise --timeout") from None
    if log_path:
        log_path.write_text(proc.stdout)
    if proc.returncode != 0:
        errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
        tail = errors[-1] if errors else "\n".join(proc.stdout.splitlines()[-25:])
        raise MegatronLMRunError(f"the Megatron-LM run writing the torch_dist checkpoint failed (exit {proc.returncode}): "
                              f"{tail}\ncommand: {' '.join(cmd)}")
    return save_dir


class MegatronLMTorchDistWriter(CheckpointWriter):
    """`--ckpt-format torch_dist`: Megatron-LM itself writes the checkpoint, from its training loop launched at
    the target layout (T*P*D CPU processes)."""

    ckpt_format = "torch_dist"
    OPTIONS = ("timeout_s", "optimizer_format")

    def __init__(self, timeout_s: int = DEFAULT_TIMEOUT_S, optimizer_format: Optional[str] = None):
        self.timeout_s = timeout_s
        self.optimizer_format = optimizer_format

    def _flags(self, ucp, target: WriteTarget, notes: list) -> list[str]:
        if megatron_padded_vocab(ucp.config, target.layout.tp) != padded_vocab_at(ucp.config, target.layout.tp):
            raise WriteError(
                f"the stored padded vocabulary ({ucp.config.padded_vocab_size} rows) is divisible by TP="
                f"{target.layout.tp}, so the plugin keeps it, but Megatron-LM computes "
                f"{target.padded_vocab_size} rows at TP={target.layout.tp}; write --ckpt-format torch (it re-pads) "
                f"or choose another TP")
        if self.optimizer_format not in (None, "dp_reshardable", "fully_reshardable"):  # what 0.16.1 can save
            raise WriteError(f"--optimizer-format {self.optimizer_format}: Megatron-LM 0.19 saves "
                             f"dp_reshardable or fully_reshardable; drop --via-megatron-lm to write {self.optimizer_format}")
        if self.optimizer_format is not None and not target.use_distributed_optimizer:
            raise WriteError(f"--optimizer-format {self.optimizer_format} describes the distributed optimizer's "
                             f"state: add --use-distributed-optimizer, or drop --optimizer-format")
        # megatron-core's default (dp_reshardable) unless asked, as the direct writer
        optimizer_format = (self.optimizer_format or "dp_reshardable") if target.use_distributed_optimizer else None
        try:
            return megatron_lm_flags_from_universal(ucp.metadata, target.layout, vpp_layers=target.vpp_layers,
                                                use_distributed_optimizer=target.use_distributed_optimizer,
                                                optimizer_format=optimizer_format, notes=notes)
        except ValueError as e:
            raise WriteError(f"as torch_dist: {e}") from e

    def plan(self, ucp, target: WriteTarget, notes: list) -> list[PlannedFile]:
        self._flags(ucp, target, notes)
        state_bytes = sum(4 * len(info.tensors) * math.prod(info.shape) for info in ucp.parameters.values())
        return [PlannedFile(f"iter_{ucp.iteration:07d}/ (torch_dist, {target.layout.world_size} writer processes)",
                            state_bytes), PlannedFile(TRACKER_FILENAME, 0)]

    def describe(self, ucp, target: WriteTarget) -> list[str]:
        return ["Megatron-LM flags: " + " ".join(self._flags(ucp, target, []))]

    def write(self, ucp, target: WriteTarget, root: Path, on_file=None) -> None:
        flags = self._flags(ucp, target, [])
        log = root.parent / f"{root.name}.log"
        try:
            write(Path(ucp.path).absolute(), root, ucp.iteration, target.layout, flags, timeout_s=self.timeout_s,
                  log_path=log)
        except MegatronLMRunError as e:
            raise MegatronLMRunError(f"{e} (log: {log})") from e
        log.unlink(missing_ok=True)
        if not (root / TRACKER_FILENAME).is_file():
            raise WriteError(f"{root}: the Megatron-LM run finished without writing {TRACKER_FILENAME}")
        if on_file:
            for f in sorted(root.rglob("*")):
                if f.is_file():
                    on_file(f, f.stat().st_size)
