"""The converter's narrow read paths return exactly what the full reads return.

The byte-copy path: every reader's locate() (where each tensor's bytes are in its files) gives, read
back, exactly read()'s tensors, and a conversion through locate()/copies writes exactly the tensors of
a conversion through read()/torch.cat, for every parameter of Megatron-LM's fixtures A, B and C.

to-universal asks a reader that can skip tensors (torch_dist's read(ref, keys=...)) only for the fp32
master weight and the Adam moments, never the model weight. Checked on Megatron-LM's own fixtures:
B (torch_dist, dp_reshardable distributed optimizer, TP2 PP2 DP2) for every shard and every subset of
keys, and A / C (legacy torch: distributed optimizer / plain fp32 Adam), which read everything; all
comparisons bitwise (torch.equal, same dtype and shape).
"""

import itertools

import pytest
import torch

from megatron_ucp.convert import consolidate as convert_mod
from megatron_ucp.convert import conversion_tasks, source_keys, to_universal
from megatron_ucp.formats import open_checkpoint
from megatron_ucp.universal import UniversalCheckpoint
from locate_checks import assert_locate_equals_read
from megatron_ucp.formats.torch_dist.reader import READ_KEYS, TorchDistCheckpoint
from pretrain_runs import FIXTURE_CKPTS

SOURCES = FIXTURE_CKPTS


def _assert_same(got: dict, full: dict, keys, where: str) -> None:
    for key in keys:
        assert key in got, f"{where}: {key} missing"
        a, b = got[key], full[key]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: {key} differs"


@pytest.fixture(scope="module")
def b_ckpt():
    return open_checkpoint(SOURCES["B"], iteration=4)


def test_torch_dist_read_keys_equal_full_read(b_ckpt):
    """Every non-empty subset of READ_KEYS, on every shard of B (Adam): exactly those tensors B has among
    them (plus 'step'), bitwise equal to the full read; a state B's optimizer does not keep (SGD's
    momentum_buffer) asked for is absent, not invented."""
    subsets = [s for n in range(1, len(READ_KEYS) + 1) for s in itertools.combinations(READ_KEYS, n)]
    has = {"param", "fp32", "exp_avg", "exp_avg_sq"}
    assert set(READ_KEYS) > has, READ_KEYS  # the non-Adam names are in the key set, and B lacks them
    for ref in b_ckpt.shards():
        full = b_ckpt.read(ref)
        assert set(full) == has | {"step"}
        for keys in subsets:
            got = b_ckpt.read(ref, keys=keys)
            assert set(got) == (set(keys) & has) | {"step"}, (ref, keys)
            keys = tuple(k for k in keys if k in has)
            _assert_same(got, full, list(keys) + ["step"], f"{ref.local_name} tp={ref.tp_rank} pp={ref.pp_rank}")


def test_torch_dist_read_keys_rejects_unknown(b_ckpt):
    with pytest.raises(ValueError, match="choose from"):
        b_ckpt.read(b_ckpt.shards()[0], keys=("fp32", "master"))


def test_converter_does_not_read_the_model_weight(b_ckpt, monkeypatch):
    """With optimizer state the converter requests only the optimizer buckets' bytes."""
    requested: list[str] = []
    real = TorchDistCheckpoint._read_box

    def spy(self, fqn, box):
        requested.append(fqn)
        return real(self, fqn, box)

    monkeypatch.setattr(TorchDistCheckpoint, "_read_box", spy)
    for ref in b_ckpt.shards():
        got = b_ckpt.read(ref, keys=source_keys(b_ckpt))
        assert set(got) == set(source_keys(b_ckpt)) | {"step"}
    assert requested and all(k.startswith("optimizer.distributed.") for k in requested), sorted(set(requested))


@pytest.mark.parametrize("label", ["A", "C"])
def test_legacy_read_path_equals_full_read(label):
    """What the converter asks the legacy reader for (source_keys) is exactly the full read's tensors of
    those keys, nothing else besides the step."""
    ckpt = open_checkpoint(SOURCES[label], iteration=4)
    for ref in ckpt.shards():
        full = ckpt.read(ref)
        got = ckpt.read(ref, keys=source_keys(ckpt))
        keys = [k for k in full if k in source_keys(ckpt) or k == "step"]
        assert sorted(got) == sorted(keys) and "param" not in got
        _assert_same(got, full, keys, f"{label} {ref.local_name} tp={ref.tp_rank} pp={ref.pp_rank}")


def test_thread_pool_failure_stops_and_cleans_up(tmp_path, monkeypatch):
    """B converts with threads (thread_safe_reads); when the FIRST task fails the conversion stops: only the
    tasks already in flight (at most 2 per thread, 3 besides the failing one at workers=2) ran, and neither
    the destination nor its staging directory is left."""
    from megatron_ucp.convert import runner

    real = runner.convert_parameter
    tasks = conversion_tasks(open_checkpoint(SOURCES["B"], iteration=4))
    first = max(tasks, key=lambda t: t.nbytes).name  # threads start with the largest parameter
    done: list[str] = []

    def failing(ckpt, task, staging_dir, **kwargs):
        if task.name == first:
            raise runner.ConversionError(f"{task.name}: injected failure")
        done.append(task.name)
        return real(ckpt, task, staging_dir, **kwargs)

    monkeypatch.setattr(runner, "convert_parameter", failing)
    with pytest.raises(runner.ConversionError, match="injected failure"):
        runner.convert(SOURCES["B"], tmp_path / "out", iteration=4, workers=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert len(tasks) > 20 and len(done) <= 3, (len(done), len(tasks))


@pytest.mark.parametrize("label", ["A", "B", "C"])
def test_locate_equals_read(label):
    ckpt = open_checkpoint(SOURCES[label], iteration=4)
    assert assert_locate_equals_read(ckpt, label) > 4 * len(ckpt.shards())


@pytest.mark.parametrize("label", ["A", "B", "C"])
def test_byte_copy_conversion_equals_tensor_conversion(label, tmp_path, monkeypatch):
    """Both ways, every tensor of every parameter bitwise equal, same metadata entries; and the byte path
    really is taken for every parameter (else this would compare the tensor path with itself)."""
    placed = []
    real_place = convert_mod.place_parameter

    def spy(ckpt, task, files):
        result = real_place(ckpt, task, files)
        placed.append((task.name, result is not None))
        return result

    monkeypatch.setattr(convert_mod, "place_parameter", spy)
    fast = UniversalCheckpoint.open(to_universal(SOURCES[label], tmp_path / "fast", iteration=4, workers=2,
                                                 progress=False))
    n_params = len(conversion_tasks(open_checkpoint(SOURCES[label], iteration=4)))
    assert len(placed) == n_params and all(ok for _, ok in placed), [n for n, ok in placed if not ok]
    monkeypatch.setattr(convert_mod, "place_parameter", lambda *a, **k: None)
    slow = UniversalCheckpoint.open(to_universal(SOURCES[label], tmp_path / "slow", iteration=4, workers=1,
                                                 progress=False))
    assert fast.metadata["parameters"] == slow.metadata["parameters"]
    for name, info in slow.parameters.items():
        for key in info.tensors:
            a, b = fast.read(name, key), slow.read(name, key)
            assert a.dtype == b.dtype and torch.equal(a, b), (label, name, key)
