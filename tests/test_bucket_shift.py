"""megatron-core 0.15-0.19's shifted multi-bucket fully_reshardable optimizer state: predicted, seen, repaired.

The bug (docs/VERSIONS.md "Multi-bucket fully_reshardable"): with several DDP buckets in a buffer those releases'
DistributedOptimizer.sharded_param_state_fully_reshardable saves parameter q's state as compact[q.start:q.end]
(the state gathered over DP, bucket-end padding stripped, sliced with the buffer's padded offsets, zero-padded
past its end). `bucket_layout.shifted_save_runs` says where every parameter's true state went.

Evidence (no training here; the fixtures are committed, tools/make_bucket_fixtures.sh):
- J19 and K19 are the same deterministic run (TP1 DP2, --overlap-grad-reduce --ddp-bucket-size 3000: 6 buckets,
  buckets 1-4 with 64 elements of end padding): their losses.jsonl are equal byte for byte and their saved model
  weights bit for bit; J19 saved dp_reshardable (flat buckets, right: the truth), K19 fully_reshardable.
- the damage is exactly the prediction: K19's saved state of every parameter equals the truth's compact tensor at
  the parameter's padded offsets (zero past its end), for all three states; the 6 parameters of buckets 0-1 are
  right, the 11 of buckets 2-5 wrong; megatron-core's own warning ('... exceeds unpadded buffer by 256 elements')
  names the shift the layout gives;
- the repair: to-universal of K19 with --reset-lost-optimizer-state equals to-universal of J19 bitwise, fp32 main
  weights included, except the 352 elements of each Adam moment the layout says were saved nowhere (reset to 0;
  nonzero in the truth); without the flag the conversion is refused in one line naming the release, the
  parameters and the flag; the lazy index and the direct resume's in-memory index read the same values;
- the rule itself on synthetic buffers (DP sizes, bucket sizes, 16-bit and fp32 parameters): simulating the
  buggy save on random state and repairing it gives the true state everywhere but the predicted lost elements.
The resumes (Megatron-LM's own --load of K19, the repaired direct resume, the writes) are in
tests/test_bucket_shift_resume.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

from pretrain_runs import B19, CPD19, F19, J19, K19
from writer_cli import assert_one_line_error, cli

from megatron_ucp.commands.inspect import describe, format_report
from megatron_ucp.convert import source_index, to_universal
from megatron_ucp.convert.tasks import ConversionError
from megatron_ucp.core import versions
from megatron_ucp.formats import open_checkpoint
from megatron_ucp.formats.bucket_layout import (
    BufferParam, DDPBucketConfig, build_buffer_layout, build_chunk_buffers, shifted_save_runs)
from megatron_ucp.universal import UniversalCheckpoint, UniversalFormatError

STATES = ("fp32", "exp_avg", "exp_avg_sq")
LOST_PER_STATE = 352  # elements of each state K19's shifted save put nowhere (the layout's prediction, below)


def ckpt_dir(name: str) -> Path:
    return F19 / name / "ckpt"


def buffer_of(ckpt):
    """The one DDP buffer of the checkpoint's one rank, from its args (bucket_layout, as the reader builds it)."""
    params = [BufferParam(r.local_name, r.shape, r.dtype) for r in ckpt.shards()]
    config = DDPBucketConfig.from_megatron_args(ckpt.args, ckpt.layout, pp_rank=0, vpp_chunk=0,
                                                rank_num_parameters=sum(p.numel for p in params))
    buffers = build_chunk_buffers(params, config)
    assert len(buffers) == 1
    return buffers[0]


@pytest.fixture(scope="module")
def truth():
    return open_checkpoint(ckpt_dir(J19))


@pytest.fixture(scope="module")
def damaged():
    return open_checkpoint(ckpt_dir(K19))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("shift")
    return {"truth": UniversalCheckpoint.open(to_universal(ckpt_dir(J19), root / "j", progress=False)),
            "repaired": UniversalCheckpoint.open(to_universal(ckpt_dir(K19), root / "k", progress=False,
                                                              reset_lost_optimizer_state=True)),
            "lazy": UniversalCheckpoint.open(to_universal(ckpt_dir(K19), root / "kl", progress=False, lazy=True,
                                                          reset_lost_optimizer_state=True)),
            "root": root}


def test_the_two_fixtures_are_one_run(truth, damaged):
    """Same losses (byte for byte) and the same saved model weights (bit for bit): K19's optimizer state can be
    judged against J19's."""
    assert (F19 / J19 / "losses.jsonl").read_bytes() == (F19 / K19 / "losses.jsonl").read_bytes()
    refs = {r.local_name: r for r in truth.shards()}
    for ref in damaged.shards():
        assert torch.equal(damaged.read(ref, ["param"])["param"], truth.read(refs[ref.local_name], ["param"])["param"])
    assert truth.distrib_optim_sharding == "dp_reshardable" and damaged.distrib_optim_sharding == "fully_reshardable"


def test_layout_predicts_megatron_cores_own_warning(damaged):
    buffer = buffer_of(damaged)
    assert len(buffer.buckets) == 6
    assert [b.numel - b.numel_unpadded for b in buffer.buckets] == [0, 64, 64, 64, 64, 64]
    warned = set(re.findall(r"'(\S+)' param range exceeds unpadded buffer by (\d+) elements",
                            (F19 / K19 / "train.log").read_text()))
    # the last parameter's window runs past the compact tensor by all the padding stripped before its bucket
    last = max(buffer.params, key=lambda s: s.end)
    assert warned == {(last.name, str(buffer.padding_before(last.bucket)))} == {("embedding.word_embeddings.weight",
                                                                                "256")}
    runs = shifted_save_runs(buffer)
    assert sorted(runs) == sorted(s.name for s in buffer.params if s.bucket >= 2) and len(runs) == 11
    assert {name: sum(r.length for r in rs if r.source is None) for name, rs in runs.items() if any(
        r.source is None for r in rs)} == {
        "decoder.layers.1.pre_mlp_layernorm.weight": 32, "decoder.layers.1.self_attention.linear_qkv.weight": 32,
        "decoder.layers.0.mlp.linear_fc2.weight": 96, "decoder.layers.0.self_attention.linear_qkv.weight": 96,
        "embedding.word_embeddings.weight": 96}  # 352 in all


def test_damage_is_exactly_the_prediction(truth, damaged):
    """K19's saved state of parameter q == the truth's compact tensor at q's padded buffer offsets (zeros past its
    end), for every parameter and state; that is wrong for the 11 parameters of buckets 2-5 only."""
    buffer = buffer_of(truth)
    refs = {r.local_name: r for r in truth.shards()}
    wrong = set()
    for key in STATES:
        compact = torch.zeros(buffer.numel_unpadded)
        for span in buffer.params:
            start = buffer.coalesced_offset(span)
            compact[start:start + math.prod(span.shape)] = truth.read(refs[span.name], [key])[key].reshape(-1)
        padded = torch.cat([compact, torch.zeros(buffer.numel - buffer.numel_unpadded)])
        for ref in damaged.shards():
            span = buffer.span(ref.local_name)
            saved = damaged._read_saved(ref, [key])[key].reshape(-1)  # as megatron-core saved it, unrepaired
            assert torch.equal(saved, padded[span.start:span.end]), (ref.local_name, key)
            if not torch.equal(saved, truth.read(refs[ref.local_name], [key])[key].reshape(-1)):
                wrong.add(ref.local_name)
    assert wrong == set(shifted_save_runs(buffer))


def test_no_notice_where_nothing_is_shifted():
    """dp_reshardable (J19), fully_reshardable with one bucket per buffer (B19: no --overlap-grad-reduce; CPD19),
    and the rows: 0.14 writes no fully_reshardable, 0.15-0.19 all save it shifted."""
    for name in (J19, B19, CPD19):
        ckpt = open_checkpoint(ckpt_dir(name))
        assert ckpt.notices() == [] and ckpt.read_problem() is None, name
    assert {r.name: r.shifted_shardings for r in versions.RELEASES} == {
        "0.14": (), **{n: ("fully_reshardable",) for n in ("0.15", "0.16", "0.17", "0.18", "0.19")}}


def test_repaired_conversion_equals_the_truth_but_for_the_lost_elements(converted):
    truth, repaired = converted["truth"], converted["repaired"]
    runs = shifted_save_runs(buffer_of(open_checkpoint(ckpt_dir(J19))))
    lost = {key: 0 for key in STATES}
    for name in truth.parameters:
        lost_here = torch.zeros(math.prod(truth.parameters[name].shape), dtype=torch.bool)
        for r in runs.get(name, ()):
            if r.source is None:
                lost_here[r.start:r.start + r.length] = True
        for key in STATES:
            a, b = truth.read(name, key).reshape(-1), repaired.read(name, key).reshape(-1)
            differ = a != b
            if key == "fp32":  # the main weight of a lost element is the fp32 model weight: exact
                assert not differ.any(), name
                continue
            assert torch.equal(differ, lost_here), (name, key)
            assert (b[lost_here] == 0).all() and (a[lost_here] != 0).all(), (name, key)
            lost[key] += int(lost_here.sum())
    assert lost == {"fp32": 0, "exp_avg": LOST_PER_STATE, "exp_avg_sq": LOST_PER_STATE}
    notices = repaired.metadata["source"]["notices"]
    assert len(notices) == 1 and "megatron-core 0.19" in notices[0] and "6 buckets" in notices[0]
    assert f"{LOST_PER_STATE} elements of each Adam moment of 5 parameters" in notices[0]
    assert "notices" not in truth.metadata["source"]


def test_lazy_and_direct_indexes_read_the_repaired_values(converted):
    """The byte indexes (to-universal --lazy, a direct resume's in-memory one) point at the saved bytes holding each
    element and read the lost ones as zero ('zeroed' runs: format version 3, which a version-2 reader refuses)."""
    repaired, lazy = converted["repaired"], converted["lazy"]
    index = source_index(ckpt_dir(K19), reset_lost_optimizer_state=True)
    direct = UniversalCheckpoint.from_source_index(index.document, index.rng)
    assert lazy.version == 3 and json.loads((lazy.path / "COMPLETE").read_text())["version"] == 3
    assert converted["truth"].version == repaired.version == 2
    for name, info in repaired.parameters.items():
        for key in STATES:
            want = repaired.read(name, key)
            for ucp in (lazy, direct):
                assert torch.equal(ucp.read(name, key), want), (name, key)
            if want.dim() == 2:  # a box read: the zeroed runs cut to the box
                assert torch.equal(direct.read(name, key, (slice(3, 9),)), want[3:9]), (name, key)
    # a version-2 reader never sees zeroed runs: a document that claims version 2 with them is refused
    meta = json.loads((lazy.path / "metadata.json").read_text())
    meta["version"] = 2
    (lazy.path / "metadata.json").write_text(json.dumps(meta))
    marker = json.loads((lazy.path / "COMPLETE").read_text())
    marker["metadata_sha256"] = hashlib.sha256((lazy.path / "metadata.json").read_bytes()).hexdigest()
    (lazy.path / "COMPLETE").write_text(json.dumps(marker))
    with pytest.raises(UniversalFormatError, match="'zeroed' runs in a version-2 checkpoint"):
        UniversalCheckpoint.open(lazy.path)


def test_refused_in_one_line_without_reset_and_said_by_inspect_and_check(converted, damaged):
    with pytest.raises(ConversionError, match="Pass --reset-lost-optimizer-state"):
        source_index(ckpt_dir(K19))
    message = assert_one_line_error(cli("to-universal", ckpt_dir(K19), converted["root"] / "refused"),
                                    "megatron-core 0.19 saved this fully_reshardable optimizer state shifted",
                                    "352 elements of each Adam moment", "--reset-lost-optimizer-state",
                                    "dp_reshardable")
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in message
    assert not (converted["root"] / "refused").exists()
    report = format_report(describe(damaged))
    assert "  notice        " in report and "refused without --reset-lost-optimizer-state" in report
    universal = describe(converted["repaired"])
    assert universal["notices"] == converted["repaired"].metadata["source"]["notices"]
    from megatron_ucp.commands.check import check

    assert any(n.startswith("source: ") and "shifted" in n for n in check(converted["repaired"].path)["notes"])


@pytest.mark.parametrize("dp,bucket_size,dtype", [(2, 3000, "float32"), (4, 700, "bfloat16"), (8, 5000, "float32"),
                                                  (3, 1000, "float16")])
def test_shifted_save_runs_undo_the_shifted_slicing(dp, bucket_size, dtype):
    """Synthetic buffers: random compact state, saved as the bug saves it, repaired from the runs == the true state
    everywhere but the runs marked lost, which are exactly the elements no saved window covers."""
    rng = random.Random(dp * bucket_size)
    params = [BufferParam(f"p{i}", (rng.randint(1, 40), rng.randint(1, 70)), dtype) for i in range(40)]
    buffer = build_buffer_layout(params, DDPBucketConfig(dp_size=dp, use_distributed_optimizer=True,
                                                         bucket_size=bucket_size))
    assert len(buffer.buckets) > 3
    compact = torch.randn(buffer.numel_unpadded)
    padded = torch.cat([compact, torch.zeros(buffer.numel)])
    saved = {s.name: padded[s.start:s.end] for s in buffer.params}  # the bug
    covered = torch.zeros(buffer.numel_unpadded, dtype=torch.bool)
    for s in buffer.params:
        covered[s.start:min(s.end, buffer.numel_unpadded)] = True
    runs = shifted_save_runs(buffer)
    assert runs and set(runs) == {s.name for s in buffer.params if buffer.padding_before(s.bucket)}
    for s in buffer.params:
        start, numel = buffer.coalesced_offset(s), math.prod(s.shape)
        true = compact[start:start + numel]
        if s.name not in runs:
            assert torch.equal(saved[s.name], true)
            continue
        assert sum(r.length for r in runs[s.name]) == numel and runs[s.name][0].start == 0
        for r in runs[s.name]:
            if r.source is None:
                assert not covered[start + r.start:start + r.start + r.length].any()
            else:
                assert torch.equal(saved[r.source][r.source_start:r.source_start + r.length],
                                   true[r.start:r.start + r.length])
                assert covered[start + r.start:start + r.start + r.length].all()
    # a shift always loses elements: the saved windows reach past the compact tensor by the last bucket's shift
    last = max(buffer.params, key=lambda s: s.end)
    lost = sum(r.length for rs in runs.values() for r in rs if r.source is None)
    assert lost >= buffer.padding_before(last.bucket) > 0
    assert shifted_save_runs(build_buffer_layout(params, DDPBucketConfig(dp, True, None))) == {}
