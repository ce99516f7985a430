"""Lazy universal checkpoints (`to-universal --lazy`): metadata.json indexes where each consolidated
tensor's bytes are in the Megatron-LM checkpoint; nothing is copied.

On Megatron-LM's fixtures A (legacy + distrib_optim.pt), B (torch_dist, dp_reshardable) and C (legacy,
plain Adam, tied embeddings over PP2): every tensor, whole and as every TP rank's slice at TP 1, 2, 4
(where the pattern allows), equals the copied universal checkpoint's bitwise (torch.equal), and
from-universal writes byte-identical Megatron files from either. A source that changed or moved is
refused when the lazy checkpoint is opened.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ucp.convert import ConversionError, to_universal
from megatron_ucp.core.layout import LayoutError
from megatron_ucp.universal import UniversalCheckpoint, UniversalFormatError
from pretrain_runs import FIXTURE_CKPTS

REPO = Path(__file__).resolve().parents[1]
SOURCES = FIXTURE_CKPTS


@pytest.mark.parametrize("label", sorted(SOURCES))
def test_lazy_reads_equal_the_copy(label, tmp_path):
    lazy = UniversalCheckpoint.open(to_universal(SOURCES[label], tmp_path / "lazy", iteration=4, lazy=True,
                                                 progress=False))
    copy = UniversalCheckpoint.open(to_universal(SOURCES[label], tmp_path / "copy", iteration=4, progress=False))
    assert lazy.lazy_source == (SOURCES[label] / "iter_0000004").resolve() and copy.lazy_source is None
    assert not (tmp_path / "lazy" / "tensors").exists()
    assert sorted(p.name for p in (tmp_path / "lazy").iterdir()) == ["COMPLETE", "metadata.json", "rng_states.json"]
    meta_lazy = json.loads((tmp_path / "lazy" / "metadata.json").read_text())
    meta_copy = json.loads((tmp_path / "copy" / "metadata.json").read_text())
    for name, entry in meta_copy["parameters"].items():
        got = dict(meta_lazy["parameters"][name])
        assert got.pop("file") is None and set(got.pop("source_bytes")) == set(entry["tensors"])
        assert got == {k: v for k, v in entry.items() if k not in ("file", "checksum")}, name
    slices = 0
    for name, info in copy.parameters.items():
        for key in info.tensors:
            assert torch.equal(lazy.read(name, key), copy.read(name, key)), (name, key)
            for tp in (1, 2, 4):
                try:
                    info.pattern.validate(info.shape, tp)
                except LayoutError:
                    continue
                for rank in range(tp):
                    a, b = lazy.read_for_rank(name, rank, tp, key), copy.read_for_rank(name, rank, tp, key)
                    assert torch.equal(a, b), (name, key, tp, rank)
                    slices += 1
    assert slices > 3 * len(copy.parameters)
    assert lazy.bytes_read == copy.bytes_read  # reading a slice costs the slice, lazily too


def _lazy_copy_of_c(tmp_path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    shutil.copytree(SOURCES["C"], src)
    return src, to_universal(src, tmp_path / "lazy", iteration=4, lazy=True, progress=False)


def test_changed_source_is_refused(tmp_path):
    src, lazy = _lazy_copy_of_c(tmp_path)
    target = src / "iter_0000004" / "mp_rank_01_001" / "model_optim_rng.pt"
    os.utime(target, ns=(0, 0))  # same bytes, different mtime: cannot tell, so refuse
    with pytest.raises(UniversalFormatError, match="changed since the lazy conversion.*to-universal --lazy"):
        UniversalCheckpoint.open(lazy)


def test_moved_source_is_refused(tmp_path):
    src, lazy = _lazy_copy_of_c(tmp_path)
    src.rename(tmp_path / "elsewhere")
    with pytest.raises(UniversalFormatError, match="missing.*lazy universal checkpoint"):
        UniversalCheckpoint.open(lazy)


def test_lazy_with_average_replicas_is_refused(tmp_path):
    with pytest.raises(ConversionError, match="--lazy .* --average-replicas"):
        to_universal(SOURCES["C"], tmp_path / "x", iteration=4, lazy=True, average_replicas=True, progress=False)
    assert not (tmp_path / "x").exists()


def test_cli_lazy_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", "to-universal", str(SOURCES["B"]),
                           str(tmp_path / "lazy"), "--lazy"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "wrote lazy" in proc.stdout and "keep the source in place and unchanged" in proc.stdout
    assert UniversalCheckpoint.open(tmp_path / "lazy").lazy_source is not None


def test_from_universal_of_a_lazy_checkpoint_is_bitwise_the_copys(tmp_path):
    """Writing Megatron-LM legacy files at another layout (TP2PP2DP2 -> TP1PP2DP1, distributed optimizer)
    from the lazy index gives the same files, byte for byte, as from the copied checkpoint."""
    from megatron_ucp.commands.from_universal import from_universal

    lazy = to_universal(SOURCES["A"], tmp_path / "lazy", iteration=4, lazy=True, progress=False)
    copy = to_universal(SOURCES["A"], tmp_path / "copy", iteration=4, progress=False)
    layout = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, data_parallel_size=1,
                  use_distributed_optimizer=True, ckpt_format="torch", rng_state="cpu", progress=False)
    from_universal(lazy, tmp_path / "from_lazy", **layout)
    from_universal(copy, tmp_path / "from_copy", **layout)
    files = sorted(p.relative_to(tmp_path / "from_copy") for p in (tmp_path / "from_copy").rglob("*") if p.is_file())
    assert len(files) >= 6  # marker + tracker + 2 ranks x (model_optim_rng.pt, distrib_optim.pt)
    assert files == sorted(p.relative_to(tmp_path / "from_lazy") for p in (tmp_path / "from_lazy").rglob("*")
                           if p.is_file())
    for rel in files:
        if rel.name == "megatron-ucp.json":  # the tool's completion marker names its source and time
            continue
        assert (tmp_path / "from_lazy" / rel).read_bytes() == (tmp_path / "from_copy" / rel).read_bytes(), rel


def test_direct_resume_index_is_the_lazy_index_in_memory(tmp_path):
    """source_index (what rank 0 of a `--load CKPT --universal-checkpoint` resume makes): the entries of
    `to-universal --lazy`'s index, without checksums (none read: no second pass), nothing written into the source
    (hashes); opened by from_source_index its reads are the lazy checkpoint's, bitwise; a source file that is not
    what rank 0 indexed (another copy on another node, a change while the job started) is refused naming it."""
    import hashlib

    from megatron_ucp.convert import source_index

    src = tmp_path / "src"
    shutil.copytree(SOURCES["B"], src)
    hashes = lambda: {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(src.rglob("*")) if p.is_file()}
    before = hashes()
    index = source_index(src / "iter_0000004")
    lazy_path = to_universal(src, tmp_path / "lazy", iteration=4, lazy=True, progress=False)
    on_disk = json.loads((lazy_path / "metadata.json").read_text())
    assert index.document["parameters"] == on_disk["parameters"]
    assert index.document["lazy"]["source"] == on_disk["lazy"]["source"]
    files = index.document["lazy"]["files"]
    assert files and all(set(f) == {"size", "mtime_ns"} for f in files.values())
    direct, lazy = UniversalCheckpoint.from_source_index(index.document, index.rng), UniversalCheckpoint.open(lazy_path)
    assert direct.direct and direct.source_digests is None and direct.rng_states() == lazy.rng_states()
    for name, info in lazy.parameters.items():
        for key in info.tensors:
            assert torch.equal(direct.read_for_rank(name, 0, 1, key), lazy.read_for_rank(name, 0, 1, key)), name
    assert hashes() == before and sorted(p.name for p in src.iterdir()) == sorted(p.name for p in SOURCES["B"].iterdir())
    victim = src / "iter_0000004" / sorted(files)[0]
    os.utime(victim, ns=(0, 0))
    with pytest.raises(UniversalFormatError, match=f"{victim}: size .* rank 0 indexed .*changed while the run started"):
        UniversalCheckpoint.from_source_index(index.document, index.rng)
