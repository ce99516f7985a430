"""A target TP that forces vocabulary re-padding, end to end.

Source: GPT-2-like fp32 TP1 DP1 with --vocab-size 1001 (Megatron-LM 0.19's NullTokenizer: vocabulary 1001,
EOD 1000) and --make-vocab-size-divisible-by 1, so the padded vocabulary is the true one, 1001 rows (no
padding row); warmup 2 + cosine, weight decay 0.1, saved at 4. At TP2 Megatron-LM needs a multiple of 2:
`--universal-checkpoint` (universal_plugin sets args.padded_vocab_size before Megatron-LM builds the model,
and the loader fills the rows) and `from-universal --ckpt-format torch` re-pad to 1002 rows, the new row
being the mean of the stored rows (weights) with zero Adam moments.

A padding row enters the softmax, so the loss shifts from the uninterrupted run's: measured 1.4e-4
relative over iterations 5..12, asserted below REPAD_SHIFT = 3e-4. What must be exact is the re-padding
itself: both TP2 resumes equal, within FP32_TOL = 1e-6 (layout noise), a TP1 resume from a copy of the
universal checkpoint re-padded offline to 1002 rows by patterns.resize_vocab (ucp_edits.repadded).
Measured through Megatron-LM 0.19's loop: --universal-checkpoint 0 (bit for bit), from-universal 1.4e-7.
"""

import pytest

from pretrain_runs import DISTOPT, FP32_TOL, SAVED_AT, Layout, rel_diff

import ucp_edits
from megatron_ucp.formats.common import load_pickled
from megatron_ucp.commands.from_universal import from_universal

pytestmark = pytest.mark.torchrun

FAMILY = "gpt2"
PAD1 = ["--vocab-size", "1001", "--make-vocab-size-divisible-by", "1"]  # 1001 rows: odd
REPAD_SHIFT = 3e-4


@pytest.fixture(scope="module")
def source(runs):
    return runs.source(FAMILY, Layout(), PAD1)


@pytest.fixture(scope="module")
def reference(source, runs, tmp_path_factory):
    """TP1 resume of the universal checkpoint re-padded offline to 1002 rows (TP1 keeps the stored size)."""
    repadded = ucp_edits.repadded(runs.universal(source.save), tmp_path_factory.mktemp("repad") / "ucp", 1002)
    return runs.resume(FAMILY, Layout(), repadded, PAD1)


def test_loader_repads_at_tp2(source, reference, runs):
    """Without --make-vocab-size-divisible-by 1 Megatron-LM would build 1024 rows at TP2 (multiples of
    128 x 2); universal_plugin sets the checkpoint's rule, 1002 rows, before the model is built."""
    resumed = runs.resume(FAMILY, Layout(tp=2), runs.universal(source.save), ["--vocab-size", "1001", *DISTOPT])
    log = resumed.log.read_text()
    assert "padded vocabulary (1001 rows) is not divisible by TP=2; re-padding to 1002 rows" in log
    assert " > padded vocab (size: " not in log  # Megatron-LM's own padding (tokenizer build) kept it
    exact = rel_diff(resumed.losses, reference.losses)
    assert exact <= FP32_TOL, (exact, resumed.losses, reference.losses)
    shift = rel_diff(resumed.losses, source.losses)
    assert shift <= REPAD_SHIFT, (shift, resumed.losses, source.losses)


def test_from_universal_repads_at_tp2_and_loads_in_megatron_core(source, reference, runs, tmp_path):
    out = tmp_path / "megatron"
    warnings = []
    from_universal(runs.universal(source.save), out, tensor_model_parallel_size=2, ckpt_format="torch",
                   rng_state="cpu", progress=False, warn=warnings.append)
    assert any("from 1001 to 1002 rows" in w for w in warnings), warnings
    state = load_pickled(out / f"iter_{SAVED_AT:07d}" / "mp_rank_01" / "model_optim_rng.pt", what="test")
    assert tuple(state["model"]["embedding.word_embeddings.weight"].shape) == (501, 48)
    resumed = runs.resume(FAMILY, Layout(tp=2), out, PAD1, universal=False)
    exact = rel_diff(resumed.losses, reference.losses)
    assert exact <= FP32_TOL, (exact, resumed.losses, reference.losses)
