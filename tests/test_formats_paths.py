"""Every file a reader opens resolves inside the iteration folder, and reads rely on the sizes checked
against the files (in-process, on copies of the Megatron-LM fixtures A (legacy) and B (torch_dist)).

- A link out of the folder (a rank folder, a rank file, common.pt, metadata.json, .metadata, a .distcp
  file), or a .metadata data-file name with `..` or an absolute path: open_checkpoint refuses it in one
  line naming the file, before reading it. Positive controls: the same files as links to files INSIDE
  the folder are read, and give bitwise the same tensors.
- A file truncated after the reader opened it: read() raises one CheckpointFormatError line naming it
  (the size is checked before anything is allocated), never a crash or a short tensor.
Runtime: ~3 s.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_ucp.formats import CheckpointFormatError, open_checkpoint

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "megatron-lm"
A = FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt" / "iter_0000004"
B = FIXTURES / "B_llama_tp2pp2dp2_distopt_sp_torch_dist" / "ckpt" / "iter_0000004"


def _copy(src: Path, tmp_path: Path) -> Path:
    it = tmp_path / "ckpt" / src.name
    shutil.copytree(src, it)
    return it


def _link(it: Path, rel: str, target_dir: Path) -> Path:
    """Move iteration-folder entry `rel` to target_dir and leave a symbolic link in its place."""
    src = it / rel
    target = target_dir / src.name
    target_dir.mkdir(parents=True, exist_ok=True)
    shutil.move(src, target)
    src.symlink_to(target, target_is_directory=target.is_dir())
    return target


def _refused(it: Path, *words: str) -> str:
    with pytest.raises(CheckpointFormatError) as e:
        open_checkpoint(it)
    text = str(e.value)
    assert "\n" not in text and all(w in text for w in words), text
    return text


def _all_tensors(ckpt) -> list:
    return [(ref, ckpt.read(ref)) for ref in ckpt.shards()]


@pytest.mark.parametrize("source,rel", [(A, "mp_rank_01_001"), (A, "mp_rank_00_000/model_optim_rng.pt"),
                                        (A, "mp_rank_01_000/distrib_optim.pt"), (B, "common.pt"),
                                        (B, "metadata.json"), (B, ".metadata"), (B, "__3_1.distcp")],
                         ids=lambda x: x if isinstance(x, str) else x.parents[1].name[0])
def test_links_out_of_the_folder_are_refused(tmp_path, source, rel):
    it = _copy(source, tmp_path)
    outside = _link(it, rel, tmp_path / "outside")
    text = _refused(it, "NOT read", str(it / rel) if "/" in rel or rel.endswith((".pt", ".json", ".metadata"))
                    else rel)
    assert str(outside.parent) in text  # where the link points is named
    # positive control: the same file as a link to a copy INSIDE the folder is read, bitwise the same
    (it / rel).unlink()
    inside = it / "kept" / Path(rel).name
    inside.parent.mkdir()
    shutil.move(outside, inside)
    if rel == "__3_1.distcp":  # DCP data files must sit in the folder itself (a plain name)
        shutil.move(inside, it / "__3_1.real")
        inside = it / "__3_1.real"
    (it / rel).symlink_to(inside, target_is_directory=inside.is_dir())
    got, want = _all_tensors(open_checkpoint(it)), _all_tensors(open_checkpoint(source))
    assert [r for r, _ in got] == [r for r, _ in want]
    for (ref, a), (_, b) in zip(got, want):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), ref


@pytest.mark.parametrize("name", [b"../outsidexx", b"/etc/passwd0"])
def test_dcp_names_out_of_the_folder_are_refused(tmp_path, name):
    it = _copy(B, tmp_path)
    shutil.copy(it / "__0_0.distcp", it.parent / "outsidexx")
    meta = it / ".metadata"
    data = meta.read_bytes()
    assert data.count(b"__0_0.distcp") == 1  # one memoised name for every item of that file
    meta.write_bytes(data.replace(b"__0_0.distcp", name))  # same length: every pickle frame stays intact
    _refused(it, str(meta), repr(name.decode()), "NOT read")


@pytest.mark.parametrize("source,rel", [(A, "mp_rank_01_001/distrib_optim.pt"), (A, "mp_rank_00_000/model_optim_rng.pt"),
                                        (B, "__6_1.distcp")], ids=["A distrib_optim.pt", "A model_optim_rng.pt", "B"])
def test_file_truncated_after_open_fails_the_read_in_one_line(tmp_path, source, rel):
    it = _copy(source, tmp_path)
    ckpt = open_checkpoint(it)
    f = it / rel
    data = f.read_bytes()
    f.write_bytes(data[:4096])  # the zip directory and the pickle gone, the first records kept
    failed = []
    for ref in ckpt.shards():
        try:
            ckpt.read(ref)
        except CheckpointFormatError as e:
            failed.append(str(e))
    assert failed, "no read touched the truncated file"
    assert all(str(f) in m and "\n" not in m and "re-copy" in m for m in failed), failed[:2]
