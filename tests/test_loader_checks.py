"""The universal loader's refusals: a model config or global batch size that differs from the checkpoint.

The run's args are Megatron-LM 0.19's own (its parser and validate_args, tests/megatron_lm_args.py), as
`pretrain()` hands them to the --universal-checkpoint plugin. Megatron-LM 0.19's NullTokenizer counts EOD inside
--vocab-size, so fixture A's vocabulary (1000 ids + EOD, written by an older Megatron-LM) is --vocab-size 1001.
"""

import pytest

from megatron_lm_args import megatron_lm_args
from pretrain_runs import FIXTURES

from megatron_ucp.convert import to_universal
from megatron_ucp.convert.runner import source_index
from megatron_ucp.megatron_lm.loader import UniversalLoadError, check_compatible
from megatron_ucp.universal import UniversalCheckpoint

LLAMA = ["--num-layers", "4", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "8", "--lr", "1e-3", "--min-lr", "1e-3", "--lr-decay-style", "constant",  # fixture A's
         "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "1001", "--group-query-attention", "--num-query-groups", "2", "--swiglu",
         "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


@pytest.fixture(scope="module")
def ucp(tmp_path_factory):
    dst = tmp_path_factory.mktemp("ucp") / "a"
    to_universal(FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt", dst, iteration=4, progress=False)
    return UniversalCheckpoint.open(dst)


def args_for(*extra, world_size=1):
    args = megatron_lm_args([*LLAMA, *extra], world_size=world_size)
    args.padded_vocab_size = 1024  # Megatron-LM sets it when it builds the tokenizer
    return args


def test_matching_run_is_accepted(ucp):
    check_compatible(ucp, args_for())
    check_compatible(ucp, args_for("--tensor-model-parallel-size", "2", world_size=2))


def test_model_config_mismatch_names_field_and_flag(ucp):
    args = args_for()
    args.hidden_size = 64
    with pytest.raises(UniversalLoadError, match=r"hidden_size: checkpoint 48, this run 64 \(set --hidden-size\)"):
        check_compatible(ucp, args)
    with pytest.raises(UniversalLoadError, match="swiglu"):
        check_compatible(ucp, megatron_lm_args([a for a in LLAMA if a != "--swiglu"] + ["--ffn-hidden-size", "128"]))


def test_global_batch_change_needs_the_flag(ucp):
    args = args_for("--global-batch-size", "16")
    with pytest.raises(UniversalLoadError, match="--global-batch-size 8"):
        check_compatible(ucp, args)
    check_compatible(ucp, args_for("--global-batch-size", "16", "--universal-allow-batch-change"))


def test_train_iters_before_checkpoint_is_refused(ucp):
    with pytest.raises(UniversalLoadError, match="raise --train-iters"):
        check_compatible(ucp, args_for("--train-iters", "2"))


def test_another_optimizer_is_refused_universal_and_direct(ucp):
    """An Adam checkpoint under --optimizer sgd: Adam's moments are never put into SGD's state (its momentum would be
    silently dropped). Refused in one line naming both optimizers and both ways out, for the universal checkpoint and
    for a direct resume's index of the run's own Megatron-LM checkpoint; --no-load-optim (weights only) passes."""
    index = source_index(FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt" / "iter_0000004")
    direct = UniversalCheckpoint.from_source_index(index.document, index.rng)
    for checkpoint in (ucp, direct):
        assert checkpoint.optimizer_type == "adam" and checkpoint.optimizer_state_keys == ("exp_avg", "exp_avg_sq")
        with pytest.raises(UniversalLoadError) as e:
            check_compatible(checkpoint, args_for("--optimizer", "sgd"))
        line = str(e.value)
        assert "\n" not in line and "holds adam optimizer state (exp_avg, exp_avg_sq)" in line
        assert "--optimizer sgd, which keeps momentum_buffer" in line and "pass --optimizer adam" in line
        assert "--no-load-optim" in line
        check_compatible(checkpoint, args_for("--optimizer", "sgd", "--no-load-optim"))


@pytest.mark.parametrize("optimizer, said", [
    ("soap", "--optimizer soap: SOAP"), ("adaptive_muon", "--optimizer adaptive_muon: adaptive Muon")])
def test_unmapped_optimizers_are_refused_in_one_line(ucp, optimizer, said):
    with pytest.raises(UniversalLoadError, match=f"{said} .* is not supported yet") as e:
        check_compatible(ucp, args_for("--optimizer", optimizer))
    assert "\n" not in str(e.value)


def test_dist_muon_is_muon_under_the_layer_wise_distributed_optimizer(ucp):
    """Megatron-LM 0.19's parser turns the deprecated --optimizer dist_muon into muon under the layer-wise distributed
    optimizer, which megatron-ucp loads: an Adam checkpoint is then refused as another optimizer's state, naming both."""
    args = args_for("--optimizer", "dist_muon")
    assert args.optimizer == "muon" and args.use_layer_wise_distributed_optimizer
    with pytest.raises(UniversalLoadError, match="holds adam optimizer state .* this run uses --optimizer muon") as e:
        check_compatible(ucp, args)
    assert "\n" not in str(e.value)


def test_plugin_sets_the_padded_vocabulary_before_the_model_is_built_and_needs_load(ucp, capsys, tmp_path):
    """universal_plugin.install() hooks Megatron-LM's validate_args: with --universal-checkpoint the run's
    padded vocabulary comes from the checkpoint (kept at TP2, re-padded at TP3: 1024 rows do not split in 3),
    and the flag without --load (or with a folder that is no universal checkpoint) stops in one error line,
    exit 2, instead of silently training from scratch or a traceback."""
    from megatron_ucp.megatron_lm import universal_plugin

    universal_plugin.install()  # acts only on runs with --universal-checkpoint
    tp2 = megatron_lm_args([*LLAMA, "--tensor-model-parallel-size", "2", "--load", str(ucp.path),
                            "--universal-checkpoint"], world_size=2)
    assert tp2.padded_vocab_size == ucp.config.padded_vocab_size == 1024
    tp3 = megatron_lm_args([*LLAMA, "--tensor-model-parallel-size", "3", "--num-attention-heads", "6",
                            "--num-query-groups", "3", "--load", str(ucp.path), "--universal-checkpoint"],
                           world_size=3)
    assert tp3.padded_vocab_size == 1152  # Megatron-LM's rule: a multiple of 128 x TP above 1001
    assert megatron_lm_args(LLAMA).padded_vocab_size is None  # without the flag: left to the tokenizer build
    for bad, why in (([], "--universal-checkpoint needs --load"),
                     (["--load", str(tmp_path)], "")):  # an empty folder: not a universal checkpoint
        with pytest.raises(SystemExit) as stop:
            megatron_lm_args([*LLAMA, *bad, "--universal-checkpoint"])
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and err.startswith("error: ") and "\n" not in err and why in err, err
    assert not list(tmp_path.iterdir())  # nothing written
