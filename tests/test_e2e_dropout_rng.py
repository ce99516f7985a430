"""Dropout > 0 resumed at the same layout through a universal checkpoint equals the uninterrupted run, through
Megatron-LM 0.19's own training loop (tests/pretrain_runs.py).

Source: GPT-2-like TP2 PP2 DP1, attention and hidden dropout 0.1, distributed optimizer, warmup 2 + cosine,
weight decay 0.1, saved at iteration 4 (torch_dist: one rng_state item per (pp, tp) rank). Its RNG states go
into the universal checkpoint's rng_states.json (docs/FORMAT.md "RNG states") unchanged, and a resume at
the same layout restores every rank's streams: iterations 5..12 within 1e-6 relative (measured: equal to the
last bit). On CPU this needs cpu_shims' data-loader generator: without it TP rank 0's dropout runs one
draw ahead of TP rank 1's, the replicated position embeddings drift apart, and to-universal refuses the
source (its TP copies differ). The same holds for `from-universal --ckpt-format torch --rng-state source` loaded by
megatron-core with a plain --load. Negative control: the same universal resume with --no-load-rng
(deterministic re-seed, as any other layout gets) leaves the curve by more than 1e-6 (measured 1.3e-3): the
dropout masks then differ, which is what cannot be equal at another layout (FORMAT.md says why).
"""

import pytest

from pretrain_runs import DISTOPT, FP32_TOL, SAVED_AT, Layout, rel_diff

from megatron_ucp.formats import open_checkpoint
from megatron_ucp.commands.from_universal import FromUniversalError, from_universal
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.universal import UniversalCheckpoint

pytestmark = pytest.mark.torchrun

FAMILY, LAYOUT = "gpt2", Layout(tp=2, pp=2)
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1", *DISTOPT]


@pytest.fixture(scope="module")
def source(runs):
    return runs.source(FAMILY, LAYOUT, DROPOUT)


def test_rng_states_are_stored_unchanged(source, runs, tmp_path):
    ucp = UniversalCheckpoint.open(runs.universal(source.save))
    saved = open_checkpoint(source.save, iteration=SAVED_AT).rng_states()
    assert [(s.pp, s.tp, s.dp) for s in saved] == [(0, 0, None), (0, 1, None), (1, 0, None), (1, 1, None)]
    assert ucp.rng_states() == saved
    assert len({s.tracker for s in saved}) == 4  # every rank drew its own streams
    assert ucp.rng_layout_problem(ParallelLayout(tp=2, pp=2), 2) is None
    assert "saved at TP2PP2DP1, this run is TP2PP2DP2" in ucp.rng_layout_problem(ParallelLayout(tp=2, pp=2, dp=2), 2)
    assert "--micro-batch-size 2, this run uses 1" in ucp.rng_layout_problem(ParallelLayout(tp=2, pp=2), 1)
    with pytest.raises(FromUniversalError, match="--rng-state source: the RNG states were saved at TP2PP2DP1"):
        from_universal(ucp.path, tmp_path / "x", pipeline_model_parallel_size=2, ckpt_format="torch",
                       rng_state="source", progress=False)
    assert not (tmp_path / "x").exists()


def test_dropout_resume_at_the_same_layout_is_exact(source, runs):
    ucp = runs.universal(source.save)
    resumed = runs.resume(FAMILY, LAYOUT, ucp, DROPOUT)
    assert "RNG states of the source ranks restored" in resumed.log.read_text()
    diff = rel_diff(resumed.losses, source.losses)
    assert diff <= FP32_TOL, (diff, resumed.losses, source.losses)

    reseeded = runs.resume(FAMILY, LAYOUT, ucp, [*DROPOUT, "--no-load-rng"])
    assert "RNG re-seeded from --seed and the iteration (--no-load-rng)" in reseeded.log.read_text()
    control = rel_diff(reseeded.losses, source.losses)
    print(f"dropout: restored {diff:.2e}, re-seeded {control:.2e} (margin {control / FP32_TOL:.0f}x)")
    assert control > FP32_TOL, control


def test_from_universal_with_the_source_rng_states_loads_in_megatron_core(source, runs, tmp_path):
    out = tmp_path / "megatron"
    from_universal(runs.universal(source.save), out, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                   use_distributed_optimizer=True, ckpt_format="torch", rng_state="source", progress=False)
    resumed = runs.resume(FAMILY, LAYOUT, out, DROPOUT, universal=False)
    diff = rel_diff(resumed.losses, source.losses)
    assert diff <= FP32_TOL, (diff, resumed.losses, source.losses)
