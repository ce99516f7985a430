"""`--universal-checkpoint` for Megatron-LM 0.19: a plugin through its extra-args mechanism.

`add_arguments` is an `extra_args_provider` (pass it to `parse_and_validate_args` / `pretrain`); `install()`
routes Megatron-LM's own `load_checkpoint` call (in setup_model_and_optimizer) to megatron_ucp.megatron_lm.loader when
the flag is given: every rank reads its slices of the universal checkpoint at `--load` into the model and
the (distributed) optimizer Megatron-LM built, then the scheduler, iteration, consumed samples and FLOP
count, as Megatron-LM's load would. Without the flag Megatron-LM's load runs unchanged.
"""

from __future__ import annotations

import functools


def add_arguments(parser):
    group = parser.add_argument_group(title="megatron-ucp")
    group.add_argument("--universal-checkpoint", action="store_true",
                       help="--load is a universal checkpoint (megatron-ucp to-universal): resume from it at "
                            "this run's layout, with the optimizer state")
    group.add_argument("--universal-allow-batch-change", action="store_true",
                       help="allow another --global-batch-size than the checkpoint's")
    return parser


def install() -> None:
    from megatron.training import checkpointing, training

    original = checkpointing.load_checkpoint
    if getattr(original, "__wrapped_by_megatron_ucp__", False):
        return

    @functools.wraps(original)
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *args, **kwargs):
        from megatron.training import get_args

        run_args = get_args()
        if load_arg != "load" or not getattr(run_args, "universal_checkpoint", False):
            return original(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)
        return load_universal(run_args, ddp_model, optimizer, opt_param_scheduler)

    load_checkpoint.__wrapped_by_megatron_ucp__ = True
    checkpointing.load_checkpoint = load_checkpoint
    training.load_checkpoint = load_checkpoint  # imported there by name


def load_universal(args, model, optimizer, scheduler):
    """Megatron-LM's load_checkpoint contract: fills model and optimizer, returns (iteration, FLOPs so far).
    A checkpoint the user has to fix (damaged, of another model, a layout it cannot take) stops the run with
    one line, `error: <cause and fix>`, from each rank that found it, and exit status 2; no traceback."""
    import sys

    from megatron_ucp.core.layout import LayoutError
    from megatron_ucp.megatron_lm import loader
    from megatron_ucp.universal import UniversalFormatError

    try:
        return _load_universal(args, model, optimizer, scheduler)
    except (loader.UniversalLoadError, UniversalFormatError, LayoutError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _load_universal(args, model, optimizer, scheduler):
    from megatron.core.num_microbatches_calculator import update_num_microbatches

    from megatron_ucp.megatron_lm import loader

    ucp = loader.open_for_run(args)  # sets args.padded_vocab_size to the checkpoint's when TP allows
    if args.padded_vocab_size != ucp.config.padded_vocab_size:
        raise loader.UniversalLoadError(
            f"{ucp.path}: stored padded vocabulary {ucp.config.padded_vocab_size} rows, this run's model was built "
            f"with {args.padded_vocab_size}; choose a TP that divides {ucp.config.padded_vocab_size} (the "
            "Megatron-LM 0.19 plugin cannot re-pad: the model is built before the load)")
    iteration = loader.load_universal_checkpoint(args, model, optimizer, scheduler, ucp)
    update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
    return iteration, args.num_floating_point_operations_so_far
