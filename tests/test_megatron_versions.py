"""megatron-core releases: what each writes is read, and what the user resumes with is written.

Sources: tests/fixtures/megatron-core-0.19, real Megatron-LM core_v0.19.0 runs (megatron-core 0.19.2) on CPU
(cmd.txt, train.log, checkpoints at iterations 4 and 8): A19 torch_dist dp_reshardable, B19 fully_reshardable
and C19 legacy `torch` are one run (TP2 PP2 SP, the same losses) saved in three formats; D19 TP2 PP1 DP2;
E19 a GPT-MoE (4 experts, top-2, EP2 DP2 PP2, chained dense + expert optimizers). And
tests/fixtures/megatron-lm (0.16.1).

What is checked (core/versions.py holds every difference as data):
- the release is detected from the checkpoint itself and shown by `inspect`; the vocabulary is what that
  release trained for `--tokenizer-type NullTokenizer --vocab-size 1000` (0.19: 1000, 0.16.1: 1001);
- A19, B19 and C19 convert to universal checkpoints equal at atol 0 (three formats of one run), and every
  0.19 fixture converts, MoE included;
- written back at the fixture's own layout with `--megatron-core-version 0.19` (and by default, which is the
  source's release), each torch_dist fixture equals Megatron-LM's own save: `.metadata` structure, every
  chunk's bytes (dp_reshardable's alignment gaps aside: Megatron-LM leaves whatever its buffer held there,
  the writer zeros), every object (RNG states written from the source: bitwise), the common_state object
  with all 821 args, metadata.json; the legacy files (C19) equal tensor for tensor. Negative control: a
  0.16-style write of the same source differs exactly where the releases differ (common.pt, metadata.json,
  files per rank, rerun state);
- the restricted unpickler loads classes of a newer Megatron as inert records (a conversion does not stop),
  while a payload inside such an object still never runs.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain_runs import A19, B19, C19, D19, E19, F19, REPO
from torch_dist_checks import dcp_metadata, gap_chunks, load_item, structure

from megatron_ucp.formats.pickles import MEGATRON
from megatron_ucp.commands import from_universal as fu
from megatron_ucp.convert import to_universal
from megatron_ucp.serialization import safe_pickle as sp
from megatron_ucp.core import versions
from megatron_ucp.formats.common import load_archive_file
from megatron_ucp.commands.verify import verify

F16 = REPO / "tests" / "fixtures" / "megatron-lm"
ITER = "iter_0000004"


def cli(*argv, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.cli", *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def ucp19(tmp_path_factory) -> dict:
    """Universal checkpoints of the five 0.19 fixtures at iteration 4 (converted once)."""
    work = tmp_path_factory.mktemp("ucp19")
    return {name: to_universal(F19 / name / "ckpt", work / name[:3], iteration=4, progress=False)
            for name in (A19, B19, C19, D19, E19)}


# --------------------------------------------------------------------------------------------------
# Detection


def test_release_is_detected_and_inspect_shows_it():
    """inspect names the release that wrote each checkpoint and the vocabulary that run trained."""
    for name in (A19, B19, C19, D19, E19):
        info = json.loads(cli("inspect", F19 / name / "ckpt", "--iteration", "4", "--json").stdout)
        assert info["megatron_core"] == "0.19", name
        assert (info["model_config"]["vocab_size"], info["model_config"]["padded_vocab_size"]) == (1000, 1024), name
        assert info["iteration"] == 4 and info["consumed_train_samples"] == 32
    text = cli("inspect", F19 / A19 / "ckpt", "--iteration", "4").stdout
    assert "torch_dist, written by megatron-core 0.19" in text and "vocab 1000 padded to 1024" in text
    info = json.loads(cli("inspect", F16 / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt", "--json").stdout)
    assert info["megatron_core"] == "0.16"
    assert info["model_config"]["vocab_size"] == 1001  # 0.16.1's NullTokenizer appends EOD to --vocab-size 1000


def test_detection_needs_every_marker():
    """The newest release whose marker arguments are all present; one marker missing falls back a release
    (negative control: detection is not a constant)."""
    args19 = load_archive_file(F19 / C19 / "ckpt" / ITER / "mp_rank_00_000" / "model_optim_rng.pt",
                               what="args")["args"]
    args19 = vars(args19)
    assert versions.detect(args19).name == "0.19"
    without = {k: v for k, v in args19.items() if k != versions.release("0.19").markers[0]}
    assert versions.detect(without).name == "0.18"
    bare = {k: v for k, v in args19.items() if k not in sum((r.markers for r in versions.RELEASES), ())}
    assert versions.detect(bare).name == "0.16"
    # the vocabulary a NullTokenizer run trained, as its release means --vocab-size
    null = {"tokenizer_type": "NullTokenizer", "vocab_size": 1000}
    assert versions.true_vocab_size(null, versions.release("0.16")) == 1001
    assert versions.true_vocab_size(null, versions.release("0.17")) == 1001
    assert versions.true_vocab_size(null, versions.release("0.18")) == 1000
    assert versions.true_vocab_size(null, versions.release("0.19.2")) == 1000
    with pytest.raises(ValueError, match="newest supported is 0.19"):
        versions.release("0.12")


# --------------------------------------------------------------------------------------------------
# Reading


def test_three_formats_of_one_run_convert_alike(ucp19):
    """A19 (dp_reshardable), B19 (fully_reshardable) and C19 (legacy) hold one run's state: their universal
    checkpoints are equal at atol 0 (weights, both moments, step); each records the 0.19 source."""
    for other in (B19, C19):
        result = verify(ucp19[A19], ucp19[other], progress=False)
        assert result.equal and result.compared_keys == ("fp32", "exp_avg", "exp_avg_sq", "step"), other
    # negative control: D19 is another run (PP1 initialises the layers otherwise), verify sees it
    assert not verify(ucp19[A19], ucp19[D19], progress=False).equal
    for name, path in ucp19.items():
        meta = json.loads((path / "metadata.json").read_text())
        assert meta["source"]["megatron_core"] == "0.19" and meta["iteration"] == 4, name
        assert meta["model_config"]["vocab_size"] == 1000, name
    assert "converted from a megatron-core 0.19 checkpoint" in cli("inspect", ucp19[A19]).stdout
    moe = json.loads((ucp19[E19] / "metadata.json").read_text())
    assert moe["model_config"]["num_experts"] == 4
    assert cli("check", ucp19[E19]).returncode == 0


def test_verify_across_releases(ucp19):
    """verify reads checkpoints of two releases side by side: the 0.19 torch_dist and legacy saves of one run
    are equal; a 0.16.1 checkpoint of the same flags is another run (0.19's mock data differ) and differs."""
    same = cli("verify", F19 / A19 / "ckpt", F19 / C19 / "ckpt", "--iteration-a", "4", "--iteration-b", "4", check=False)
    assert same.returncode == 0 and "equal" in same.stdout, same.stdout + same.stderr
    other = cli("verify", F19 / C19 / "ckpt" / ITER, F16 / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt" / ITER,
                check=False)
    assert other.returncode == 1 and "differ" in other.stdout, other.stdout + other.stderr


# --------------------------------------------------------------------------------------------------
# Writing back what Megatron-LM 0.19 saved


def _plain(tree):
    """A parsed object tree with every tensor as (dtype, shape, bytes): comparable across files."""
    if isinstance(tree, sp.TensorRecord):
        return tree.dtype, tree.shape, bytes(sp.read_tensor_bytes(tree))
    if isinstance(tree, argparse.Namespace):
        return "Namespace", _plain(vars(tree))
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain(v) for v in tree)
    return tree


def differences_from_megatron(ours: Path, theirs: Path, skip: set = frozenset()) -> list:
    """Keys and chunks where two torch_dist iteration folders differ: objects (the common state, RNG, rerun
    state, optimizer objects) compared as parsed by the restricted unpickler, tensors by their bytes."""
    found = []
    mine, megatron = structure(ours), structure(theirs)
    if mine != megatron:
        return [("structure", sorted(set(mine) ^ set(megatron))[:5])]
    md_ours, md_theirs = sp.load_dcp_metadata(ours, MEGATRON), sp.load_dcp_metadata(theirs, MEGATRON)
    md_ours_dcp, md_theirs_dcp = dcp_metadata(ours), dcp_metadata(theirs)  # read once, not per chunk
    for key, entry in megatron.items():
        if entry == ("bytes",):
            a, b = (_plain(sp.load_dcp_item(md, sp.DcpIndex(key))) for md in (md_ours, md_theirs))
            if repr(a) != repr(b):
                found.append(key)
            continue
        for offsets, _ in entry[2]:
            if (key, offsets) in skip:
                continue
            a, b = load_item(ours, key, offsets, md_ours_dcp), load_item(theirs, key, offsets, md_theirs_dcp)
            if a.dtype != b.dtype or not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                found.append((key, offsets))
    if (ours / "metadata.json").read_text() != (theirs / "metadata.json").read_text():
        found.append("metadata.json")
    if sorted(p.name for p in ours.iterdir()) != sorted(p.name for p in theirs.iterdir()):
        found.append(("files", sorted(p.name for p in ours.iterdir())))
    return found


WRITE_BACK = {  # fixture: its layout and optimizer flags
    A19: dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True),
    B19: dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True,
              optimizer_format="fully_reshardable"),
    E19: dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, data_parallel_size=2,
              expert_model_parallel_size=2),
}


@pytest.mark.parametrize("name", list(WRITE_BACK), ids=["A19-dp_reshardable", "B19-fully_reshardable", "E19-moe-ep2"])
def test_written_back_equals_megatron_lms_own_save(ucp19, tmp_path, name):
    """from-universal at the fixture's layout, as megatron-core 0.19 saves it, equals Megatron-LM 0.19's save."""
    out = tmp_path / "out"
    summary = fu.from_universal(ucp19[name], out, ckpt_format="torch_dist", use_distributed_optimizer=True,
                                rng_state="source", progress=False, megatron_core_version="0.19", **WRITE_BACK[name])
    gaps = gap_chunks(summary, ucp19[name]) if "optimizer_format" not in WRITE_BACK[name] else set()
    assert differences_from_megatron(out / ITER, F19 / name / "ckpt" / ITER, gaps) == []
    assert not (out / ITER / "common.pt").exists()
    if name == A19:  # the default release is the source's: the same files
        default = tmp_path / "default"
        fu.from_universal(ucp19[name], default, ckpt_format="torch_dist", use_distributed_optimizer=True,
                          rng_state="source", progress=False, **WRITE_BACK[name])
        assert differences_from_megatron(default / ITER, F19 / name / "ckpt" / ITER, gaps) == []
        # negative control: as 0.16 saves it, the files differ where the releases differ
        old = tmp_path / "as016"
        fu.from_universal(ucp19[name], old, ckpt_format="torch_dist", use_distributed_optimizer=True,
                          rng_state="source", progress=False, megatron_core_version="0.16", **WRITE_BACK[name])
        assert (old / ITER / "common.pt").is_file() and len(list((old / ITER).glob("*.distcp"))) == 8
        assert json.loads((old / ITER / "metadata.json").read_text())["common_backend"] == "torch"
        found = differences_from_megatron(old / ITER, F19 / name / "ckpt" / ITER, gaps)
        assert found and found[0][0] == "structure"  # no common_state / rerun_state_machine_state items


def test_a_flipped_byte_is_seen(ucp19, tmp_path):
    """Negative control for the comparison above: one byte of one main-weight chunk flipped is named."""
    out = tmp_path / "out"
    fu.from_universal(ucp19[B19], out, ckpt_format="torch_dist", use_distributed_optimizer=True, rng_state="source",
                      progress=False, megatron_core_version="0.19", **WRITE_BACK[B19])
    md = sp.load_dcp_metadata(out / ITER, MEGATRON)
    key = next(k for k in md.state_dict_metadata if k.startswith("optimizer.state.param.decoder"))
    index = next(i for i in md.storage_data if i.fqn == key)
    record = sp.load_dcp_item(md, index)
    with open(record.path, "r+b") as f:
        f.seek(record.data_offset)
        byte = f.read(1)
        f.seek(record.data_offset)
        f.write(bytes([byte[0] ^ 0x40]))
    assert differences_from_megatron(out / ITER, F19 / B19 / "ckpt" / ITER) == [(key, index.offset)]


def test_legacy_written_back_equals_megatron_lms_own_save(ucp19, tmp_path):
    """C19 written back as legacy files at TP2 PP2 equals Megatron-LM 0.19's own files, every tensor (weights,
    flat distributed-optimizer buffers, RNG states from the source) and value. 0.16-0.19 save the same legacy
    layout, so --megatron-core-version only checks the name. Every args entry too, megatron-core 0.19's enums
    (inference_cuda_graph_scope) included: the streaming legacy writer pickles them by reference."""
    out = tmp_path / "out"
    fu.from_universal(ucp19[C19], out, ckpt_format="torch", tensor_model_parallel_size=2,
                      pipeline_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True,
                      rng_state="source", progress=False, megatron_core_version="0.19")
    theirs = F19 / C19 / "ckpt" / ITER
    files = sorted(p.relative_to(theirs) for p in theirs.glob("mp_rank_*/*.pt"))
    assert files == sorted(p.relative_to(out / ITER) for p in (out / ITER).glob("mp_rank_*/*.pt")) and len(files) == 8
    for rel in files:
        a = load_archive_file(out / ITER / rel, what=str(rel))
        b = load_archive_file(theirs / rel, what=str(rel))
        if "args" in b:
            args_a, args_b = vars(a.pop("args")), vars(b.pop("args"))
            assert set(args_a) == set(args_b) and "inference_cuda_graph_scope" in args_a
            assert {k: repr(v) for k, v in args_a.items()} == {k: repr(args_b[k]) for k in args_a}
        assert list(a) == list(b), rel
        assert repr(_plain(a)) == repr(_plain(b)), rel


def test_unknown_release_is_refused_in_one_line(ucp19, tmp_path):
    proc = cli("from-universal", ucp19[A19], tmp_path / "out", "-t", "2", "-p", "2", "--ckpt-format", "torch_dist",
               "--megatron-core-version", "0.12", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "megatron-core 0.12: not a release megatron-ucp knows" in proc.stderr and "0.19" in proc.stderr
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------
# The unpickler: a newer Megatron's classes are data


_FUTURE_MODULE = "megatron.core.transformer.future_release"  # a module no megatron-core has (yet)


class NewerScope:  # an enum-like member of a newer Megatron: pickles as NewerScope(value)
    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return NewerScope, (self.value,)


class NewerConfig:  # a dataclass-like object of a newer Megatron: NEWOBJ, then BUILD with its fields
    def __init__(self, **fields):
        self.__dict__.update(fields)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _as_megatron_classes(save, module: str = _FUTURE_MODULE):
    """Run `save()` with NewerScope / NewerConfig living in `module` (a stand-in module registered only while
    pickling), so the pickle names them as a newer Megatron's classes; the module is gone afterwards."""
    import types

    fake = types.ModuleType(module)
    originals = {}
    for cls in (NewerScope, NewerConfig):
        originals[cls] = (cls.__module__, cls.__qualname__)
        cls.__module__ = module
        setattr(fake, cls.__name__, cls)
    sys.modules[module] = fake
    try:
        return save()
    finally:
        del sys.modules[module]
        for cls, (mod, _) in originals.items():
            cls.__module__ = mod


def test_unknown_megatron_classes_load_as_inert_records(tmp_path):
    """Classes of a newer Megatron (an enum-like and a dataclass-like) load as InertRecords: never imported,
    their arguments and fields kept as data; a payload in their arguments is still refused (os.system is no
    Megatron class) and never runs; a class outside the Megatron family's packages is refused as before, and so is
    every Megatron class when the load is not given Megatron's PickleFamily (formats/pickles.py)."""
    obj = {"scope": NewerScope(3), "config": NewerConfig(a=1, b="x")}
    data = _as_megatron_classes(lambda: pickle.dumps(obj, protocol=2))
    loaded = sp._unpickle(data, "crafted", MEGATRON.archive_globals, family=MEGATRON)
    assert isinstance(loaded["scope"], sp.InertRecord) and loaded["scope"].qualname == f"{_FUTURE_MODULE}.NewerScope"
    assert loaded["scope"].enum_value == 3 and _FUTURE_MODULE not in sys.modules
    assert loaded["config"].qualname == f"{_FUTURE_MODULE}.NewerConfig"
    assert loaded["config"].state == {"a": 1, "b": "x"} and loaded["config"].enum_value is None
    marker = tmp_path / "marker"
    evil = _as_megatron_classes(lambda: pickle.dumps({"scope": NewerScope(_Payload(marker))}, protocol=2))
    with pytest.raises(sp.UnsafePickleError, match="system"):
        sp._unpickle(evil, "crafted", MEGATRON.archive_globals, family=MEGATRON)
    assert not marker.exists()
    outside = _as_megatron_classes(lambda: pickle.dumps(obj, protocol=2), module="mypackage_enums")
    with pytest.raises(sp.UnsafePickleError, match="mypackage_enums.NewerScope"):
        sp._unpickle(outside, "crafted", MEGATRON.archive_globals, family=MEGATRON)
    # the generic unpickler knows no Megatron: without Megatron's PickleFamily the same classes are refused
    with pytest.raises(sp.UnsafePickleError, match="outside the allow-list of what a torch checkpoint holds"):
        sp._unpickle(data, "crafted", sp.ARCHIVE_GLOBALS)


def test_unknown_class_in_args_does_not_stop_a_conversion(tmp_path):
    """A torch_dist checkpoint whose args hold classes no megatron-core release has yet converts to the same
    universal checkpoint as without them, and --debug names them; the enum-like one is kept in the args."""
    src = tmp_path / "ckpt"
    fixture = F16 / "B_llama_tp2pp2dp2_distopt_sp_torch_dist" / "ckpt"
    shutil.copytree(fixture / ITER, src / ITER)
    (src / "latest_checkpointed_iteration.txt").write_text("4")
    common = torch.load(src / ITER / "common.pt", weights_only=False)
    common["args"].newer_scope = NewerScope(2)
    common["args"].newer_config = NewerConfig(depth=3)
    _as_megatron_classes(lambda: torch.save(common, src / ITER / "common.pt"))
    assert _FUTURE_MODULE.encode() in (src / ITER / "common.pt").read_bytes()
    proc = cli("to-universal", src, tmp_path / "ucp", "--debug", "--quiet")
    assert f"{_FUTURE_MODULE}.NewerScope" in proc.stderr and "inert record" in proc.stderr
    meta = json.loads((tmp_path / "ucp" / "metadata.json").read_text())
    assert meta["args"]["newer_scope"] == {"enum": f"{_FUTURE_MODULE}.NewerScope", "value": 2}
    assert "newer_config" in meta["args_dropped"]
    plain = to_universal(fixture, tmp_path / "plain", iteration=4, progress=False)
    assert verify(tmp_path / "ucp", plain, progress=False).equal


@pytest.mark.parametrize("release", ["0.17", "0.18"])
def test_intermediate_releases_round_trip(ucp19, tmp_path, release):
    """0.17 and 0.18 (no real checkpoint of theirs here; their rows come from their sources): written as that
    release (common.pt and metadata.json with common_backend, one .distcp per rank, rerun state items in 0.18
    only), read back as that release's checkpoint (its args, core/versions.args_for_release), equal to the
    universal checkpoint it came from at atol 0."""
    out = tmp_path / "out"
    fu.from_universal(ucp19[A19], out, ckpt_format="torch_dist", use_distributed_optimizer=True, rng_state="source",
                      progress=False, megatron_core_version=release, **WRITE_BACK[A19])
    files = sorted(p.name for p in (out / ITER).iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "common.pt",
                     "metadata.json"]
    assert json.loads((out / ITER / "metadata.json").read_text()) == dict(
        versions.release(release).torch_dist_metadata_json)
    keys = structure(out / ITER)
    assert not any(k.startswith("common_state") for k in keys)
    assert sum(k.startswith("rerun_state_machine_state/") for k in keys) == (4 if release == "0.18" else 0)
    back = to_universal(out, tmp_path / "back", progress=False)
    meta = json.loads((back / "metadata.json").read_text())
    assert meta["source"]["megatron_core"] == release  # the args are that release's: detection reads args
    assert verify(back, ucp19[A19], progress=False).equal
