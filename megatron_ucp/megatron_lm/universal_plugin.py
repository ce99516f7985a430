"""`--universal-checkpoint` for Megatron-LM 0.19: a plugin through its extra-args mechanism.

`add_arguments` is an `extra_args_provider` (pass it to `parse_and_validate_args` / `pretrain`); `install()`
hooks two places of Megatron-LM when the flag is given, and leaves both unchanged without it (but for one line
instead of a traceback where Megatron-LM's own load meets a checkpoint the run cannot take: cpu_shims' CPU RNG
check):
- after `validate_args` (inside `parse_and_validate_args`; `--universal-checkpoint` without `--load` is
  refused there, before `set_global_variables` builds the
  tokenizer and long before the model is built): `args.padded_vocab_size` is set from the universal
  checkpoint, as Megatron-LM's own `--use-checkpoint-args` (load_args_from_checkpoint) sets it from a
  Megatron checkpoint at the same point; the tokenizer build then keeps it ("if not already set from a
  checkpoint"). It is the stored padded vocabulary when this run's TP divides it, else that vocabulary
  re-padded by Megatron-LM's rule (adapters.gpt.padded_vocab_at); the loader fills the re-padded rows. There
  too the run's learning-rate schedule is checked against the checkpoint's (check_schedule), as the load would;
- Megatron-LM's own `load_checkpoint` call (in setup_model_and_optimizer) is routed to
  megatron_ucp.megatron_lm.loader: every rank reads its slices of the universal checkpoint at `--load`
  into the model and the (distributed) optimizer Megatron-LM built, then the scheduler, iteration,
  consumed samples and FLOP count, as Megatron-LM's load would.

`--load` may also be the run's own Megatron-LM checkpoint (its --save root, or an iteration folder; torch_dist in
any optimizer format or legacy torch, megatron-core 0.13-0.19): relaunching with a new node count and the flag
is then the whole resume. Every rank opens it for its args at the first hook; at the second, rank 0 indexes it
(the lazy universal checkpoint `to-universal --lazy` would write, in memory) and shares the index, and every
rank reads its slices straight from the source files (loader.open_for_load). Nothing is written anywhere but
Megatron-LM's own --save.
"""

from __future__ import annotations

import contextlib
import functools
import re


def add_arguments(parser):
    group = parser.add_argument_group(title="megatron-ucp")
    group.add_argument("--universal-checkpoint", action="store_true",
                       help="resume from --load at this run's layout, with the optimizer state: --load is the "
                            "run's Megatron-LM checkpoint (any layout, format and release megatron-ucp reads), "
                            "or a universal checkpoint (megatron-ucp to-universal)")
    group.add_argument("--universal-allow-batch-change", action="store_true",
                       help="allow another --global-batch-size than the checkpoint's")
    group.add_argument("--universal-reset-lost-optimizer-state", action="store_true",
                       help="a direct resume from a Megatron-LM checkpoint whose release saved some optimizer "
                            "state nowhere (megatron-core 0.15-0.19's fully_reshardable with several DDP buckets): "
                            "reset just those elements (Adam moments to zero, named in one line) instead of "
                            "refusing")
    return parser


def install() -> None:
    from megatron.training import arguments, checkpointing, training

    original = checkpointing.load_checkpoint
    if getattr(original, "__wrapped_by_megatron_ucp__", False):
        return

    @functools.wraps(original)
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *args, **kwargs):
        from megatron.training import get_args

        run_args = get_args()
        if load_arg != "load" or not getattr(run_args, "universal_checkpoint", False):
            return _stop_on_user_error(functools.partial(original, ddp_model, optimizer, opt_param_scheduler,
                                                         load_arg, *args, **kwargs))
        return load_universal(run_args, ddp_model, optimizer, opt_param_scheduler)

    load_checkpoint.__wrapped_by_megatron_ucp__ = True
    checkpointing.load_checkpoint = load_checkpoint
    training.load_checkpoint = load_checkpoint  # imported there by name

    validate = arguments.validate_args

    @functools.wraps(validate)
    def validate_args(args, *rest, **kwargs):
        result = validate(args, *rest, **kwargs)
        if getattr(args, "universal_checkpoint", False):
            _stop_on_user_error(loader_check_run_optimizer, args)
            _stop_on_user_error(set_padded_vocab_size, args)
            _stop_on_user_error(check_schedule, args)
        return result

    arguments.validate_args = validate_args  # parse_and_validate_args looks it up in its module


def loader_check_run_optimizer(args) -> None:
    """This run's --optimizer, at argument time (loader.check_run_optimizer)."""
    from megatron_ucp.megatron_lm import loader

    loader.check_run_optimizer(args)


def set_padded_vocab_size(args) -> None:
    """The embedding and output-layer rows of the model Megatron-LM will build: the universal checkpoint's
    padded vocabulary, re-padded when this run's TP does not divide it."""
    from megatron_ucp.adapters.gpt import padded_vocab_at
    from megatron_ucp.megatron_lm import loader

    if not args.load:  # Megatron-LM calls load_checkpoint only with --load: the flag alone would train from scratch
        raise loader.UniversalLoadError("--universal-checkpoint needs --load CHECKPOINT (the run's Megatron-LM "
                                        "checkpoint, its --save folder, or a universal checkpoint)")
    config = loader.checkpoint_config(args)
    loader.start_indexing(args)  # a direct resume: rank 0 indexes --load while Megatron-LM builds the model
    target = padded_vocab_at(config, args.tensor_model_parallel_size)
    if target != config.padded_vocab_size and args.rank == 0:
        print(f"WARNING: the universal checkpoint's padded vocabulary ({config.padded_vocab_size} rows) is not "
              f"divisible by TP={args.tensor_model_parallel_size}; re-padding to {target} rows. Padding rows "
              "enter the softmax, so the loss shifts slightly after this resume.", flush=True)
    args.padded_vocab_size = target


def check_schedule(args) -> None:
    """The learning-rate schedule this run's flags make against the checkpoint's, before the model is built: the
    check the load makes (Megatron-LM's OptimizerParamScheduler.load_state_dict asserts each value equal unless
    told which to keep), on the scheduler Megatron-LM's own get_optimizer_param_scheduler builds from these args.
    A difference stops the run naming it and Megatron-LM's two flags, instead of its AssertionError after the load."""
    from megatron_ucp.megatron_lm import loader

    if not loader.loads_optimizer_state(args) or args.override_opt_param_scheduler \
            or args.use_checkpoint_opt_param_scheduler:
        return
    if args.train_iters is None and args.step_batch_size_schedule is not None:
        return  # the iterations of a batch-size schedule need Megatron-LM's batch calculator: the load checks it
    stored = loader.checkpoint_schedule(args)
    if not stored:
        return  # no optimizer state saved (an import-hf checkpoint): the run starts its schedule
    with _scheduler_of_this_run(args) as scheduler:
        try:
            scheduler.load_state_dict(dict(stored))
        except AssertionError as e:
            found = re.search(r"class input value (.+) and checkpoint ?value (.+) for (.+) do not match", str(e))
            what = f"{found[3]}: checkpoint {found[2]}, this run {found[1]}" if found else " ".join(str(e).split())
            if "iterations" in what:  # Megatron-LM's name for the counts its scheduler keeps in samples
                what += ", in samples: iterations x --global-batch-size"
            raise loader.UniversalLoadError(
                f"{args.load}: this run's learning-rate schedule differs from the checkpoint's ({what}): give the "
                "schedule flags it was trained with, or pass --use-checkpoint-opt-param-scheduler (keep the "
                "checkpoint's schedule) or --override-opt-param-scheduler (this run's, from the checkpoint's "
                "step)") from None


@contextlib.contextmanager
def _scheduler_of_this_run(args):
    """The OptimizerParamScheduler Megatron-LM will build for `args` (its get_optimizer_param_scheduler on a copy of
    them, for an optimizer without parameter groups), its log lines silenced while in use."""
    import copy
    import logging
    import types

    from megatron.training import training

    probe = copy.copy(args)  # get_optimizer_param_scheduler fills lr_decay_iters / train_iters in
    log = logging.getLogger("megatron.core.optimizer_param_scheduler")
    get_args, level = training.get_args, log.level
    training.get_args = lambda: probe
    log.setLevel(logging.WARNING)
    try:
        yield training.get_optimizer_param_scheduler(types.SimpleNamespace(param_groups=[]))
    finally:
        training.get_args = get_args
        log.setLevel(level)


def _stop_on_user_error(step, *args):
    """`step(*args)`; a checkpoint or flag the user has to fix (damaged, not universal, of another model, a layout
    it cannot take, no --load) stops the run with one line, `error: <cause and fix>`, from each rank that found
    it, and exit status 2; no traceback."""
    import sys

    from megatron_ucp.core.layout import LayoutError
    from megatron_ucp.megatron_lm import cpu_shims, loader
    from megatron_ucp.universal import UniversalFormatError

    try:
        return step(*args)
    except (loader.UniversalLoadError, UniversalFormatError, LayoutError, cpu_shims.CheckpointRNGStateError) as e:
        sys.stderr.write(f"error: {e}\n")  # one write: ranks sharing a log do not interleave their lines
        sys.stderr.flush()
        _wait_for_every_rank(e)
        raise SystemExit(2) from None


def _wait_for_every_rank(e: Exception) -> None:
    """An error every rank raised alike (loader.JobLoadError): wait until every rank has said it before exiting,
    or the launcher, stopping the job at the first exit, could silence the others."""
    import torch

    from megatron_ucp.megatron_lm import loader

    if isinstance(e, loader.JobLoadError) and torch.distributed.is_initialized():
        torch.distributed.barrier()


def load_universal(args, model, optimizer, scheduler):
    """Megatron-LM's load_checkpoint contract: fills model and optimizer, returns (iteration, FLOPs so far);
    errors the user has to fix as `_stop_on_user_error` says."""
    return _stop_on_user_error(_load_universal, args, model, optimizer, scheduler)


def _load_universal(args, model, optimizer, scheduler):
    from megatron.core.num_microbatches_calculator import update_num_microbatches

    from megatron_ucp.adapters.gpt import padded_vocab_at
    from megatron_ucp.megatron_lm import loader

    ucp = loader.open_for_load(args)  # a universal checkpoint, or the index of the run's Megatron-LM checkpoint
    expected = padded_vocab_at(ucp.config, args.tensor_model_parallel_size)
    if args.padded_vocab_size != expected:
        raise loader.UniversalLoadError(
            f"{ucp.path}: the model was built with {args.padded_vocab_size} vocabulary rows, the universal "
            f"checkpoint needs {expected} at TP={args.tensor_model_parallel_size}: call "
            "universal_plugin.install() before parse_and_validate_args (it sets args.padded_vocab_size)")
    iteration = loader.load_universal_checkpoint(args, model, optimizer, scheduler, ucp)
    update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
    return iteration, args.num_floating_point_operations_so_far
