"""Spec of the UCP language: every pattern's slice and consolidate are exact inverses for every TP."""

import json

import pytest
import torch

from megatron_ucp.core.layout import LayoutError
from megatron_ucp.core.patterns import (FusedSubParams, GroupedQKV, PatternError, Replicated, Sharded, VocabSharded,
                                   bitwise_equal, pattern_from_json, resize_vocab)

TPS = range(1, 9)

# (pattern, global shape): sizes chosen so some TPs in 1..8 divide and others do not.
CASES = [
    (Replicated(), (10, 6)),
    (Replicated(), (7,)),
    (Sharded(0), (24, 5)),
    (Sharded(0), (24,)),
    (Sharded(1), (5, 24)),
    (Sharded(1), (3, 12, 2)),
    (VocabSharded(), (48, 6)),
    (FusedSubParams(0, (1, 1)), (48, 5)),  # SwiGLU fc1 weight
    (FusedSubParams(0, (1, 1)), (48,)),  # SwiGLU fc1 bias
    (FusedSubParams(0, (2, 1, 1)), (32, 3)),
    (FusedSubParams(1, (1, 1)), (3, 24)),
    (GroupedQKV(8, 1, 2), (8 * 3 * 2, 5)),  # MHA
    (GroupedQKV(4, 2, 3), (4 * 4 * 3, 5)),  # GQA
    (GroupedQKV(4, 2, 3), (4 * 4 * 3,)),  # GQA bias
    (GroupedQKV(1, 8, 2), (1 * 10 * 2, 5)),  # MQA
    (GroupedQKV(6, 2, 1), (6 * 4 * 1, 4)),
]


def _valid(pattern, shape, tp) -> bool:
    if isinstance(pattern, Replicated):
        return True
    if isinstance(pattern, GroupedQKV):
        return pattern.num_query_groups % tp == 0
    if isinstance(pattern, FusedSubParams):
        return all(size % tp == 0 for size in pattern.part_sizes(shape[pattern.dim]))
    return shape[pattern.dim] % tp == 0


def _random(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("pattern,shape", CASES, ids=lambda x: str(x))
def test_round_trips_for_every_tp(pattern, shape):
    for tp in TPS:
        if not _valid(pattern, shape, tp):
            for call in (lambda: pattern.validate(shape, tp), lambda: pattern.local_shape(shape, tp),
                         lambda: pattern.slice_ranges(shape, 0, tp),
                         lambda: pattern.slice_for_rank(torch.zeros(shape), 0, tp)):
                with pytest.raises(LayoutError, match=f"TP={tp}"):
                    call()
            continue
        full = _random(shape, seed=tp)
        shards = [pattern.slice_for_rank(full, r, tp) for r in range(tp)]
        assert bitwise_equal(pattern.consolidate(shards), full)
        for r, shard in enumerate(shards):
            assert tuple(shard.shape) == pattern.local_shape(shape, tp)
            pieces = [full[idx] for idx in pattern.slice_ranges(shape, r, tp)]
            via_ranges = pieces[0] if pattern.dim is None else torch.cat(pieces, dim=pattern.dim)
            assert bitwise_equal(via_ranges, shard)
            assert shard.is_contiguous() and shard.untyped_storage().nbytes() == shard.nbytes
        # consolidate then slice is the identity too (on independently random shards)
        if isinstance(pattern, Replicated):
            local = [_random(shape, seed=99)] * tp
        else:
            local = [_random(pattern.local_shape(shape, tp), seed=100 + r) for r in range(tp)]
        merged = pattern.consolidate(local)
        assert tuple(merged.shape) == tuple(shape)
        for r in range(tp):
            assert bitwise_equal(pattern.slice_for_rank(merged, r, tp), local[r])


def test_slice_ranges_piece_counts():
    shape = (48, 5)
    assert len(Sharded(0).slice_ranges(shape, 1, 2)) == 1
    assert Replicated().slice_ranges(shape, 1, 4) == [(slice(0, 48), slice(0, 5))]
    assert FusedSubParams(0, (1, 1)).slice_ranges(shape, 1, 2) == [(slice(12, 24), slice(0, 5)),
                                                                 (slice(36, 48), slice(0, 5))]
    assert Sharded(1).slice_ranges((5, 24), 2, 3) == [(slice(0, 5), slice(16, 24))]


def test_bad_rank_raises():
    with pytest.raises(LayoutError, match="tp_rank=2"):
        Sharded(0).slice_ranges((8, 2), 2, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64])
def test_round_trip_other_dtypes(dtype):
    full = (_random((24, 6), 3) * 100).to(dtype)
    for pattern in (Sharded(0), FusedSubParams(0, (1, 1)), GroupedQKV(2, 2, 3)):
        shards = [pattern.slice_for_rank(full, r, 2) for r in range(2)]
        assert bitwise_equal(pattern.consolidate(shards), full)


def test_swiglu_consolidate_matches_megatron_per_rank_layout():
    gate, up = _random((16, 3), 1), _random((16, 3), 2)
    for tp in (1, 2, 4, 8):
        n = 16 // tp
        per_rank = [torch.cat([gate[r * n:(r + 1) * n], up[r * n:(r + 1) * n]]) for r in range(tp)]
        pattern = FusedSubParams(0, (1, 1))
        assert torch.equal(pattern.consolidate(per_rank), torch.cat([gate, up]))
        assert all(torch.equal(pattern.slice_for_rank(torch.cat([gate, up]), r, tp), per_rank[r]) for r in range(tp))
    # A plain Sharded(0) consolidate would interleave gate and up: that is the trap this pattern avoids.
    assert not torch.equal(Sharded(0).consolidate(per_rank), torch.cat([gate, up]))


@pytest.mark.parametrize("groups,heads", [(4, 4), (2, 4), (1, 4), (2, 6)], ids=["MHA", "GQA", "MQA", "GQA3"])
def test_qkv_grouped_layout_and_split(groups, heads):
    head_dim, hidden = 3, 5
    q = _random((heads, head_dim, hidden), 1)  # per query head
    k, v = _random((groups, head_dim, hidden), 2), _random((groups, head_dim, hidden), 3)
    hpg = heads // groups
    pattern = GroupedQKV(groups, hpg, head_dim)
    # Megatron's rows: for each group g, [q heads g*hpg .. g*hpg+hpg-1, k_g, v_g].
    rows = []
    for g in range(groups):
        rows += [q[g * hpg + j] for j in range(hpg)] + [k[g], v[g]]
    full = torch.cat(rows)
    for tp in [t for t in TPS if groups % t == 0]:
        # Each TP rank builds the same grouped layout over its own groups.
        local_groups = groups // tp
        per_rank = [torch.cat(rows[r * local_groups * (hpg + 2):(r + 1) * local_groups * (hpg + 2)])
                    for r in range(tp)]
        assert torch.equal(pattern.consolidate(per_rank), full)
    sq, sk, sv = pattern.split_qkv(full)
    assert torch.equal(sq, q.reshape(-1, hidden)) and torch.equal(sk, k.reshape(-1, hidden))
    assert torch.equal(sv, v.reshape(-1, hidden))
    assert torch.equal(pattern.merge_qkv(sq, sk, sv), full)
    bias = full[:, 0].contiguous()
    bq, bk, bv = pattern.split_qkv(bias)
    assert torch.equal(pattern.merge_qkv(bq, bk, bv), bias)


def test_qkv_errors_name_the_cause_and_fix():
    pattern = GroupedQKV(6, 2, 4)
    with pytest.raises(LayoutError, match=r"num_query_groups=6 not divisible by TP=4; choose TP in \[1, 2, 3, 6\]"):
        pattern.validate((96, 8), 4, name="decoder.layers.0.self_attention.linear_qkv.weight")
    with pytest.raises(PatternError, match="does not have 96 rows"):
        pattern.validate((95, 8), 1)
    with pytest.raises(PatternError, match="merge_qkv: k"):
        pattern.merge_qkv(torch.zeros(48, 2), torch.zeros(23, 2), torch.zeros(24, 2))


def test_replicated_checks_agreement():
    a = _random((4, 3), 1)
    b = a.clone()
    b[2, 1] += 1e-3
    with pytest.raises(PatternError, match=r"layer_norm\.weight: the copy on TP rank 2 differs.*1 of 12"):
        Replicated().consolidate([a, a.clone(), b], name="layer_norm.weight")
    assert torch.equal(Replicated().consolidate([a, b], check=False), a)
    assert torch.allclose(Replicated().consolidate([a, b], average=True), (a + b) / 2)
    nan = torch.tensor([float("nan"), 1.0])
    assert torch.equal(Replicated().consolidate([nan, nan.clone()])[1:], nan[1:])  # same bits: no error
    with pytest.raises(PatternError, match="TP shard 1"):
        Replicated().consolidate([a, a[:2]])


@pytest.mark.parametrize("pattern", [Replicated(), Sharded(0), Sharded(1), VocabSharded(), FusedSubParams(0, (1, 1)),
                                     FusedSubParams(1, (2, 1)), GroupedQKV(2, 4, 16)], ids=str)
def test_json_round_trip(pattern):
    assert pattern_from_json(json.loads(json.dumps(pattern.to_json()))) == pattern


@pytest.mark.parametrize("bad", [{"kind": "diagonal"}, {"kind": "sharded"}, {"kind": "replicated", "dim": 0},
                                 {"kind": "grouped_qkv", "num_query_groups": 2}, [], {"kind": "fused_sub_params", "dim": 0}])
def test_json_rejects_malformed(bad):
    with pytest.raises(PatternError):
        pattern_from_json(bad)


def test_vocab_sharded_error_suggests_repadding():
    with pytest.raises(LayoutError, match="padded vocabulary of 1024 rows is not divisible by TP=3.*padded_vocab_at"):
        VocabSharded().validate((1024, 48), 3, name="embedding.word_embeddings.weight")
    assert VocabSharded() != Sharded(0)


def test_resize_vocab():
    full = _random((1024, 4), 7)
    same, warning = resize_vocab(full, 1024, 1001)
    assert same is full and warning is None

    grown, warning = resize_vocab(full, 1152, 1001)
    assert grown.shape == (1152, 4) and torch.equal(grown[:1024], full)
    expected_row = full[1001:].to(torch.float64).mean(0).to(full.dtype)
    assert all(torch.equal(row, expected_row) for row in grown[1024:])
    assert "loss will shift" in warning and "1024 to 1152" in warning

    zeros, _ = resize_vocab(full, 1152, 1001, fill="zeros")
    assert torch.equal(zeros[1024:], torch.zeros(128, 4))

    shrunk, warning = resize_vocab(grown, 1024, 1001)
    assert torch.equal(shrunk, full) and "dropped padding rows 1024..1151" in warning

    no_padding, _ = resize_vocab(full[:1001], 1008, 1001)  # no padding rows: mean of all rows
    assert torch.equal(no_padding[1001], full[:1001].to(torch.float64).mean(0).to(full.dtype))

    # Why the mean of padding rows: its logit never adds more softmax mass than the rows it averages.
    h = _random((4,), 8)
    logits_pad = full[1001:] @ h
    assert torch.exp(grown[1100] @ h) <= torch.exp(logits_pad).mean() + 1e-6

    with pytest.raises(PatternError, match="true vocabulary has 1001"):
        resize_vocab(full, 1000, 1001)
    with pytest.raises(PatternError, match="unknown fill"):
        resize_vocab(full, 1152, 1001, fill="random")


@pytest.mark.parametrize("pattern,shape", CASES, ids=lambda x: str(x))
def test_blocks_and_local_reads_rebuild_every_shard_and_box(pattern, shape):
    """rank_blocks tile each shard exactly, and local_reads of any leading-dim box of a shard return the
    pieces of the global tensor that fill it (what the loader, lazy reads and plan rely on)."""
    g = torch.Generator().manual_seed(0)
    for tp in TPS:
        if not _valid(pattern, shape, tp):
            continue
        full = _random(shape, seed=100 + tp)
        for rank in range(tp):
            want = pattern.slice_for_rank(full, rank, tp)
            from_blocks = torch.full(want.shape, float("nan"))
            for b in pattern.rank_blocks(shape, rank, tp):
                assert b.shard == rank
                from_blocks[b.src] = full[b.dst]
            assert bitwise_equal(from_blocks, want)
            for _ in range(4):  # random boxes over the leading dim, and one over two dims
                lo = int(torch.randint(0, want.shape[0], (1,), generator=g))
                hi = int(torch.randint(lo + 1, want.shape[0] + 1, (1,), generator=g))
                box = (slice(lo, hi),)
                if want.dim() > 1 and want.shape[1] > 1:
                    box += (slice(1, want.shape[1]),) if _ % 2 else ()
                out = torch.full(want[box].shape, float("nan"))
                for src, dst in pattern.local_reads(shape, rank, tp, box):
                    out[dst] = full[src]
                assert bitwise_equal(out, want[box]), (pattern, tp, rank, box)


def test_local_reads_negative_control_wrong_rank_is_seen():
    """The box check above can fail: reading rank 1's pieces for rank 0's shard gives other values."""
    pattern, shape = FusedSubParams(0, (1, 1)), (48, 5)
    full = _random(shape, seed=3)
    want = pattern.slice_for_rank(full, 0, 2)
    out = torch.empty_like(want)
    for src, dst in pattern.local_reads(shape, 1, 2):
        out[dst] = full[src]
    assert not bitwise_equal(out, want)
