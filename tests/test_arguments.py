"""pretrain_gpt.py's arguments: Megatron-LM's names and defaults, and clear errors for contradictions."""

import pytest

from megatron_ucp.training.arguments import ArgumentError, build_parser, parse_args, validate_args

BASE = ["--num-layers", "4", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "1000"]


def parse(extra=(), world_size=1):
    args = build_parser().parse_args([*BASE, *extra])
    return validate_args(args, world_size=world_size)


def test_defaults_are_megatron_lms():
    args = parse()
    assert (args.attention_dropout, args.hidden_dropout) == (0.1, 0.1)
    assert args.weight_decay == 0.01 and args.clip_grad == 1.0
    assert (args.adam_beta1, args.adam_beta2, args.adam_eps) == (0.9, 0.999, 1e-8)
    assert args.init_method_std == 0.02
    assert args.make_vocab_size_divisible_by == 128
    assert args.lr_decay_style == "linear" and args.min_lr == 0.0
    assert args.add_bias_linear and not args.untie_embeddings_and_output_weights
    assert args.ffn_hidden_size == 4 * 48 and args.kv_channels == 12
    assert args.num_query_groups == 4  # no GQA: one group per head
    assert args.tokenizer_type == "NullTokenizer"


def test_swiglu_ffn_default_and_derived_layout():
    args = parse(["--swiglu", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], world_size=8)
    assert args.ffn_hidden_size == int((4 * 48 * 2 / 3) / 64) * 64
    assert args.data_parallel_size == 2 and args.num_microbatches == 2


def test_unknown_flag_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*BASE, "--tensor-parallel-size", "2"])
    assert e.value.code == 2
    assert "unrecognized arguments: --tensor-parallel-size" in capsys.readouterr().err


@pytest.mark.parametrize("extra,world_size,message", [
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible by TP*PP"),
    (["--global-batch-size", "6"], 4, "--global-batch-size 6 is not divisible"),
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4,
     "--num-query-groups 2 is not divisible by TP=4"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 4 is not divisible by PP=3"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1, "needs --pipeline-model-parallel-size > 1"),
    (["--data-path", "x"], 1, "--mock-data and --data-path are exclusive"),
    (["--fp16", "--bf16"], 1, "exclusive"),
    (["--min-lr", "1"], 1, "--min-lr is larger than --lr"),
])
def test_contradictions_name_the_cause(extra, world_size, message):
    with pytest.raises(ArgumentError, match=message.replace("*", r"\*")):
        parse(extra, world_size)


def test_universal_checkpoint_needs_load():
    with pytest.raises(ArgumentError, match="--universal-checkpoint needs --load"):
        parse(["--universal-checkpoint"])


def test_sequence_parallel_is_dropped_at_tp1_like_megatron_lm():
    assert parse(["--sequence-parallel"]).sequence_parallel is False
