"""Command-line arguments of pretrain_gpt.py: Megatron-LM's flag names and defaults.

Only the flags this harness implements are accepted; an unknown flag is an error (argparse), and
contradictory combinations are rejected in `validate_args` with the cause and the fix.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import List, Optional, Sequence, Union


class ArgumentError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT pretraining on megatron-core (Megatron-LM flag names) with universal checkpointing.",
        allow_abbrev=False,
    )

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")

    g = p.add_argument_group("data-parallel buckets (Megatron-LM's distributed args)")
    g.add_argument("--ddp-num-buckets", type=int, default=None)
    g.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true")
    g.add_argument("--no-align-grad-reduce", action="store_false", dest="align_grad_reduce")
    g.add_argument("--no-align-param-gather", action="store_false", dest="align_param_gather")

    g = p.add_argument_group("pipeline split (Megatron-LM's uneven pipeline flags)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="default: transformer_engine when it is installed and CUDA is available, else local")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--layout-invariant-init", action="store_true",
                   help="initialise every parameter from (seed, its global name), so the initial model "
                        "is the same at any TP/PP/DP layout (not a Megatron-LM flag)")

    g = p.add_argument_group("mixture of experts (Megatron-LM's names and defaults)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (None: dense model)")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="N: one MoE layer every N layers (layer i is MoE when i %% N == 0), or a python "
                        "list expression of 0 (dense) / 1 (MoE) per layer, e.g. \"[0,1,0,1]\" or \"([0]+[1]*3)\"")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default: --ffn-hidden-size")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="hidden size of the shared expert(s) (num_shared_experts x their ffn size)")
    g.add_argument("--moe-shared-expert-gate", action="store_true")
    g.add_argument("--moe-shared-expert-overlap", action="store_true")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-load-balancing-type", nargs="+", type=str,
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"], default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather")
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-per-layer-logging", action="store_true")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: --tensor-model-parallel-size")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-jsonl", type=str, default=None,
                   help="write one JSON object per iteration (iteration, lm_loss, grad_norm, lr, ...)")
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=0)
    g.add_argument("--eval-interval", type=int, default=1000)

    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=["adam"], default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="linear")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32)

    g = p.add_argument_group("mixed precision (Megatron-LM's names and defaults)")
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad")

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default=None)
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--tokenizer-type", choices=["NullTokenizer", "ByteLevelTokenizer"], default=None,
                   help="default: ByteLevelTokenizer for the embedded corpus and --data-path, "
                        "NullTokenizer (with --vocab-size) for --mock-data")
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--ckpt-step", type=int, default=None)
    g.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="torch_dist (megatron-core dist_checkpointing) or torch (Megatron-LM's legacy "
                        "mp_rank_* files, distrib_optim.pt with the distributed optimizer); --load reads both")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true")
    g.add_argument("--universal-checkpoint", action="store_true",
                   help="--load names a universal checkpoint: load it at this run's layout")
    g.add_argument("--universal-allow-batch-change", action="store_true",
                   help="allow --global-batch-size to differ from the universal checkpoint's")
    return p


def moe_freq_type(value: Union[int, str]) -> Union[int, List[int]]:
    """--moe-layer-freq as Megatron-LM reads it: an int N, or a list expression such as "([0]+[1]*3)"."""
    if isinstance(value, int):
        return value
    if "[" not in value:
        return int(value)
    # Megatron-LM evaluates the expression after allowing only these characters; so do we.
    if re.search(r"[^,\d\[\]\(\)\+\*]", value):
        raise argparse.ArgumentTypeError(f"invalid --moe-layer-freq pattern {value!r}: use digits, commas, "
                                         "brackets, + and * only, e.g. \"[0,1,0,1]\" or \"([0]+[1]*3)\"")
    pattern = eval(value, {"__builtins__": {}})  # noqa: S307 (characters restricted above)
    if not isinstance(pattern, list):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {value!r} is not a list; write e.g. \"[0,1,0,1]\"")
    return pattern


def moe_layer_pattern(num_layers: int, moe_layer_freq: Union[int, List[int]]) -> List[int]:
    """1 for an MoE layer, 0 for a dense one, per global layer (megatron-core's get_gpt_decoder_layer_specs)."""
    if isinstance(moe_layer_freq, int):
        return [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    return list(moe_layer_freq)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    validate_args(args)
    return args


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Fill derived values the way Megatron-LM does and reject contradictions."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        raise ArgumentError(
            f"world size {world_size} is not divisible by TP*PP = {tp}*{pp}; "
            f"launch a multiple of {tp * pp} processes (torchrun --nproc-per-node)")
    args.data_parallel_size = world_size // (tp * pp)

    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron-LM: SP needs TP > 1
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 are exclusive; pick one")
    _validate_mixed_precision(args)

    # Data source.
    if args.mock_data and args.data_path:
        raise ArgumentError("--mock-data and --data-path are exclusive; pass one (or neither for the embedded corpus)")
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data else "ByteLevelTokenizer"
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ArgumentError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type == "ByteLevelTokenizer" and args.vocab_size not in (None, 256):
        raise ArgumentError("ByteLevelTokenizer has 256 byte tokens (+EOD); drop --vocab-size")

    # Batch sizes.
    dp = args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp) != 0:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by micro-batch-size x DP = "
            f"{args.micro_batch_size} x {dp}; choose a global batch that is a multiple of {args.micro_batch_size * dp}")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)

    # Model shape.
    if args.num_attention_heads % tp != 0:
        raise ArgumentError(f"--num-attention-heads {args.num_attention_heads} is not divisible by TP={tp}")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups != 0:
        raise ArgumentError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                            f"--num-query-groups {args.num_query_groups}")
    if args.num_query_groups % tp != 0:
        raise ArgumentError(
            f"--num-query-groups {args.num_query_groups} is not divisible by TP={tp}; choose a TP that divides it")
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads != 0:
            raise ArgumentError("--hidden-size must be divisible by --num-attention-heads (or pass --kv-channels)")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    if args.ffn_hidden_size % tp != 0:
        raise ArgumentError(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by TP={tp}")
    if args.add_bias_linear:
        args.add_qkv_bias = True  # as Megatron-LM: the 'add bias' args stay in sync
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        raise ArgumentError("--seq-length exceeds --max-position-embeddings")

    _validate_moe(args, world_size)

    # Pipeline layout.
    _validate_pipeline_split(args)

    _validate_ddp_buckets(args)

    # Schedule.
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.min_lr > args.lr:
        raise ArgumentError("--min-lr is larger than --lr")

    # Checkpointing.
    if args.save is not None and args.save_interval is None:
        args.save_interval = args.train_iters
    if args.universal_checkpoint and not args.load:
        raise ArgumentError("--universal-checkpoint needs --load pointing at a universal checkpoint directory")
    if args.ckpt_step is not None and not args.load:
        raise ArgumentError("--ckpt-step needs --load")
    args.use_dist_ckpt = args.ckpt_format == "torch_dist"
    args.iteration = 0
    args.consumed_train_samples = 0
    args.num_floating_point_operations_so_far = 0
    return args


def _validate_moe(args: argparse.Namespace, world_size: int) -> None:
    """Megatron-LM's MoE checks (arguments.py and megatron-core's TransformerConfig / parallel_state),
    raised up front as one line with the fix, plus what the CPU backend cannot run."""
    import torch

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    if args.num_experts == 0:
        args.num_experts = None  # as Megatron-LM
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    # Megatron-LM unwraps one-element lists.
    if isinstance(args.moe_router_load_balancing_type, list) and len(args.moe_router_load_balancing_type) == 1:
        args.moe_router_load_balancing_type = args.moe_router_load_balancing_type[0]
    if isinstance(args.moe_aux_loss_coeff, list) and len(args.moe_aux_loss_coeff) == 1:
        args.moe_aux_loss_coeff = args.moe_aux_loss_coeff[0]

    if args.num_experts is None:
        if ep > 1:
            raise ArgumentError("num_experts must be non None to use expert model parallelism: "
                                f"--expert-model-parallel-size {ep} needs --num-experts")
        moe_only = [flag for flag, set_ in (
            ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size is not None),
            ("--moe-shared-expert-intermediate-size", args.moe_shared_expert_intermediate_size is not None),
            ("--moe-grouped-gemm", args.moe_grouped_gemm)) if set_]
        if moe_only:
            raise ArgumentError(f"{moe_only[0]} applies to MoE layers only; pass --num-experts or drop it")
        return
    if args.num_experts < 1:
        raise ArgumentError(f"--num-experts {args.num_experts} must be positive (0 or unset: a dense model)")
    if args.num_experts % ep != 0:
        divisors = [d for d in range(1, args.num_experts + 1) if args.num_experts % d == 0]
        raise ArgumentError(
            f"Number of experts should be a multiple of expert model parallel_size: --num-experts "
            f"{args.num_experts} is not divisible by --expert-model-parallel-size {ep}; use an EP in {divisors}")
    if world_size % (etp * ep * pp) != 0:
        raise ArgumentError(
            f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel size "
            f"({etp * ep * pp} = ETP {etp} x EP {ep} x PP {pp}); launch a multiple of {etp * ep * pp} processes "
            "or change --expert-model-parallel-size / --expert-tensor-parallel-size")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.moe_ffn_hidden_size % etp != 0:
        raise ArgumentError(f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size} is not divisible by "
                            f"--expert-tensor-parallel-size {etp}; choose an ETP that divides it")
    shared = args.moe_shared_expert_intermediate_size
    if shared is not None:
        if shared <= 0:
            raise ArgumentError(f"--moe-shared-expert-intermediate-size {shared} must be positive "
                                "(num_shared_experts x ffn size of each shared expert)")
        if shared % tp != 0:
            raise ArgumentError(f"--moe-shared-expert-intermediate-size {shared} is not divisible by TP={tp}")
        if args.add_bias_linear:
            raise ArgumentError("bias is not supported in the shared experts, please set '--disable-bias-linear' "
                                "instead (or drop --moe-shared-expert-intermediate-size)")
    elif args.moe_shared_expert_gate or args.moe_shared_expert_overlap:
        raise ArgumentError("--moe-shared-expert-gate/--moe-shared-expert-overlap need "
                            "--moe-shared-expert-intermediate-size")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise ArgumentError(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts "
                            f"{args.num_experts}")
    balancing = args.moe_router_load_balancing_type
    if isinstance(balancing, list) != isinstance(args.moe_aux_loss_coeff, list) or (
            isinstance(balancing, list) and len(balancing) != len(args.moe_aux_loss_coeff)):
        raise ArgumentError("moe_aux_loss_coeff must be a list of the same length as moe_router_load_balancing_type: "
                            "pass one --moe-aux-loss-coeff per --moe-router-load-balancing-type")
    if (args.moe_router_topk == 1 and args.moe_router_score_function == "softmax"
            and not args.moe_router_pre_softmax and balancing != "sinkhorn"):
        raise ArgumentError("Please use --moe-router-pre-softmax when topk is 1 (megatron-core refuses "
                            "--moe-router-topk 1 with a post-top-k softmax)")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        raise ArgumentError("Expert bias for aux-loss-free routing only supports sigmoid score function: "
                            "pass --moe-router-score-function sigmoid with --moe-router-enable-expert-bias")
    if args.add_bias_linear and etp != 1:
        raise ArgumentError(f"Bias in Moe is only supported when ETP==1: pass --disable-bias-linear or "
                            f"--expert-tensor-parallel-size 1 (ETP is {etp})")
    if tp > 1 and not args.sequence_parallel:
        # megatron-core's MoELayer raises this in the first training forward; say it before launching.
        raise ArgumentError(f"MoE layers with TP={tp} need --sequence-parallel (megatron-core's MoELayer refuses "
                            "tensor parallelism without sequence parallelism in training)")
    pattern = moe_layer_pattern(args.num_layers, args.moe_layer_freq)
    if isinstance(args.moe_layer_freq, int) and args.moe_layer_freq < 1:
        raise ArgumentError(f"--moe-layer-freq {args.moe_layer_freq} must be >= 1")
    if len(pattern) != args.num_layers or any(v not in (0, 1) for v in pattern):
        raise ArgumentError(f"--moe-layer-freq {args.moe_layer_freq} must list 0 (dense) or 1 (MoE) for each of "
                            f"the {args.num_layers} layers")
    if args.ckpt_format == "torch" and etp != tp and args.save:
        # Megatron-LM 0.16.1 names legacy folders by the dense TP rank but lets expert-DP rank 0 write them:
        # with ETP != TP some folders are never written and others twice (docs/MOE_CHECKPOINTS.md).
        raise ArgumentError(f"--ckpt-format torch with --expert-tensor-parallel-size {etp} != "
                            f"--tensor-model-parallel-size {tp}: Megatron-LM's legacy format cannot hold this layout "
                            "consistently; use --ckpt-format torch_dist (or ETP = TP)")
    if args.moe_token_dispatcher_type == "flex":
        raise ArgumentError("--moe-token-dispatcher-type flex needs DeepEP/HybridEP kernels, which this harness "
                            "does not set up; use allgather or alltoall")
    if args.moe_shared_expert_overlap and args.moe_token_dispatcher_type != "alltoall":
        raise ArgumentError("moe_shared_expert_overlap only works with alltoall token dispatcher: pass "
                            "--moe-token-dispatcher-type alltoall or drop --moe-shared-expert-overlap")
    if not torch.cuda.is_available():
        if args.moe_grouped_gemm:
            raise ArgumentError("--moe-grouped-gemm runs the experts as one grouped GEMM (TransformerEngine/"
                                "grouped_gemm on CUDA GPUs); on CPU drop --moe-grouped-gemm (experts then run "
                                "one by one as SequentialMLP: same math and checkpoint keys)")
        if args.moe_shared_expert_overlap:
            raise ArgumentError("--moe-shared-expert-overlap runs the shared expert on a side CUDA stream; on "
                                "CPU drop it (same math)")


def _validate_pipeline_split(args: argparse.Namespace) -> None:
    """Megatron-LM's validate_args for the virtual pipeline size, then megatron-core's placement rules
    (megatron_ucp.core.placement, which also refuses splits megatron-core 0.16.1 builds wrongly)."""
    from megatron_ucp.core.placement import PlacementError, split_from_args, validate

    pp = args.pipeline_model_parallel_size
    vpp_layers, vpp_stages = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    counted = (args.num_layers + args.account_for_embedding_in_pipeline_split
               + args.account_for_loss_in_pipeline_split)
    if not uneven and counted % pp != 0:
        extras = counted - args.num_layers
        raise ArgumentError(f"--num-layers {args.num_layers}{f' + {extras} (embedding/loss)' if extras else ''} "
                            f"is not divisible by PP={pp}")
    if vpp_layers is not None and vpp_stages is not None:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                            "are exclusive; pass one")
    args.virtual_pipeline_model_parallel_size = None
    if vpp_layers is not None or vpp_stages is not None:
        if pp == 1:
            flag = "--num-layers-per-virtual-pipeline-stage" if vpp_layers else "--num-virtual-stages-per-pipeline-rank"
            raise ArgumentError(f"{flag} needs --pipeline-model-parallel-size > 1")
        if vpp_layers is not None:
            if uneven:
                raise ArgumentError("with --decoder-first/last-pipeline-num-layers give the virtual pipeline size "
                                    "as --num-virtual-stages-per-pipeline-rank (Megatron-LM's rule)")
            layers_per_stage = counted // pp
            if layers_per_stage % vpp_layers != 0:
                raise ArgumentError(
                    f"{layers_per_stage} layers per pipeline stage are not divisible by "
                    f"--num-layers-per-virtual-pipeline-stage {vpp_layers}")
            args.virtual_pipeline_model_parallel_size = layers_per_stage // vpp_layers
        else:
            args.virtual_pipeline_model_parallel_size = vpp_stages
        if args.virtual_pipeline_model_parallel_size == 1:
            args.virtual_pipeline_model_parallel_size = None
        elif args.num_microbatches % pp != 0:
            raise ArgumentError(
                f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches}) "
                f"divisible by PP={pp}; raise --global-batch-size")
    try:
        validate(split_from_args(args))
    except PlacementError as e:
        raise ArgumentError(str(e)) from None


def _validate_mixed_precision(args: argparse.Namespace) -> None:
    """Megatron-LM's validate_args for --fp16 / --bf16."""
    args.params_dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
    if args.fp16 and not args.loss_scale:
        # NaN/inf gradients are the dynamic loss scaler's signal to skip the step and back off.
        args.check_for_nan_in_loss_and_grad = False
    if args.bf16 and not args.grad_reduce_in_bf16:
        args.accumulate_allreduce_grads_in_fp32 = True  # Megatron-LM's default for bf16
    if args.grad_reduce_in_bf16:
        if not args.bf16:
            raise ArgumentError("--grad-reduce-in-bf16 needs --bf16")
        args.accumulate_allreduce_grads_in_fp32 = False
    if args.min_loss_scale > args.initial_loss_scale:
        raise ArgumentError(f"--min-loss-scale {args.min_loss_scale} exceeds --initial-loss-scale "
                            f"{args.initial_loss_scale}")


def _validate_ddp_buckets(args: argparse.Namespace) -> None:
    """Megatron-LM's checks on overlapped DP communication (validate_args / get_model)."""
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer (Megatron-LM asserts it)")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ArgumentError("--overlap-param-gather needs --overlap-grad-reduce (Megatron-LM asserts it)")
    if args.ddp_num_buckets is not None:
        if args.ddp_bucket_size is not None:
            raise ArgumentError("--ddp-num-buckets and --ddp-bucket-size are exclusive; pass one")
        if args.ddp_num_buckets <= 0:
            raise ArgumentError(f"--ddp-num-buckets {args.ddp_num_buckets} must be greater than 0")
    if args.virtual_pipeline_model_parallel_size is None:
        args.align_param_gather = False  # as Megatron-LM: only the interleaved schedule aligns param AG


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    from megatron_ucp.core.model_config import pad_vocab_size
    return pad_vocab_size(vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
