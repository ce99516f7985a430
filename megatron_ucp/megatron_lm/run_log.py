"""`--log-jsonl PATH`: every iteration's training numbers at full precision, one JSON object per line.

Megatron-LM prints its losses with 7 significant digits and averages them over each log interval
(in 0.19 a run's first two iterations too); resume checks need each iteration's own value. Installed by
wrapping megatron.training.training.training_log, which Megatron-LM calls once per iteration on every
rank: the last rank (Megatron-LM's logging rank, on the last pipeline stage) appends
{"iteration", "lm_loss", "grad_norm", "lr", "loss_scale", "skipped", "consumed_samples"} plus, for MoE,
each tracked auxiliary loss ("load_balancing_loss", "z_loss", ...) and, with multi-token prediction, each MTP
layer's loss ("mtp_1_loss", ...) as Megatron-LM reports them.
Nothing else changes: the wrapped function runs as before.
"""

from __future__ import annotations

import functools
import json
import math

_this_iteration: dict = {}  # auxiliary losses (MoE, MTP) Megatron-LM reported for the iteration being logged


def add_arguments(parser):
    group = parser.add_argument_group(title="megatron-ucp logging")
    group.add_argument("--log-jsonl", type=str, default=None,
                       help="append every iteration's lm loss, grad norm, learning rate, loss scale, skipped "
                            "flag and MoE auxiliary losses, at full precision, to this JSON-lines file")
    return parser


def _number(value):
    if value is None:
        return None
    value = float(value.item() if hasattr(value, "item") else value)
    return value if math.isfinite(value) else str(value)


_NOT_AUXILIARY = ("advanced iterations", "skipped iterations", "nan iterations", "lm loss")


def _is_mtp_loss(key: str) -> bool:
    return key.startswith("mtp_") and key.endswith(" loss")  # MTPLossLoggingHelper: "mtp_<k> loss"


def _keeping_this_iteration(report, owns):
    """`report` (a Megatron-LM reporter adding to total_loss_dict: MoE's, MTP's) also keeping, in
    _this_iteration, what it added for this iteration to the keys it `owns`."""
    @functools.wraps(report)
    def report_and_keep(*args, total_loss_dict=None, **kwargs):
        before = {k: _number(v) for k, v in (total_loss_dict or {}).items()}
        result = report(*args, total_loss_dict=total_loss_dict, **kwargs)
        for key, value in (total_loss_dict or {}).items():
            if key not in _NOT_AUXILIARY and owns(key):
                now = _number(value)
                if isinstance(now, float):
                    _this_iteration[key.replace(" ", "_")] = now - (before.get(key) or 0.0)
        return result

    return report_and_keep


def install() -> None:
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.training import training

    original = training.training_log
    if getattr(original, "__wrapped_by_megatron_ucp__", False):
        return

    @functools.wraps(original)
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs):
        _this_iteration.clear()
        result = original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                          skipped_iter, grad_norm, *args, **kwargs)
        from megatron.training import get_args
        from megatron.training.utils import is_last_rank

        run_args = get_args()
        if run_args.log_jsonl and is_last_rank():
            record = {"iteration": int(iteration),
                      "lm_loss": _number(loss_dict["lm loss"]) if "lm loss" in loss_dict else None,
                      "grad_norm": _number(grad_norm), "lr": _number(learning_rate),
                      "loss_scale": _number(loss_scale), "skipped": bool(skipped_iter),
                      "consumed_samples": int(run_args.consumed_train_samples)}
            record.update(_this_iteration)
            with open(run_args.log_jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
        return result

    training_log.__wrapped_by_megatron_ucp__ = True
    training.training_log = training_log

    MoEMetricsTracker.report = _keeping_this_iteration(MoEMetricsTracker.report, lambda key: not _is_mtp_loss(key))
    track_mtp = _keeping_this_iteration(MTPLossLoggingHelper.track_mtp_metrics, _is_mtp_loss)

    def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
        # training_log passes total_loss_dict by position
        return track_mtp(loss_scale, iteration, writer, wandb_writer, total_loss_dict=total_loss_dict)

    MTPLossLoggingHelper.track_mtp_metrics = staticmethod(track_mtp_metrics)
