"""Bad inputs on the READ side, each through the real CLI in a subprocess (`to-universal`, `inspect`,
`verify`) on a copy of a Megatron-LM fixture (A: legacy + distributed optimizer, B: torch_dist, C: legacy +
fp32 Adam, iteration 4).

Every case damages the copy (a pickle that would run code in each pickled file kind, truncated / zeroed /
size-lying files, paths and links out of the checkpoint, wrong iterations, swapped rank files, MoE or
unknown keys, wrong dtypes, corrupt args) and asserts, for each command it runs:
- exit status 1 and stderr = exactly one line `error: <the file>: <cause> ... <fix>`: the words of the
  cause and of the fix are named per case; no traceback, never a hint to disable the check;
- the input's bytes unchanged (every file and link of the copy hashed before and after);
- nothing valid-looking at DST (no DST, no DST.partial-*: to-universal fails before it writes);
- for crafted pickles: the marker file the payload would create never exists. Negative controls show
  each crafted file is live: an unrestricted unpickler runs its payload and creates the marker.

The commands of a case run in one subprocess (`python -c` running the CLI module as `-m` does, once per
command, each with its own stdout/stderr): ~33 subprocesses, ~1.5 s of CPU each while universal/reader.py imports
torch at start (the readers no longer do).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest

from megatron_ucp.formats.pickles import MEGATRON
from megatron_ucp.serialization import safe_pickle as sp

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "megatron-lm"
SOURCES = {"A": FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt",
           "B": FIXTURES / "B_llama_tp2pp2dp2_distopt_sp_torch_dist" / "ckpt",
           "C": FIXTURES / "C_gpt2_tp2pp2dp1_adam_torch" / "ckpt"}
ITER = "iter_0000004"
BUCKET0 = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.param"
RUN_CODE = ("tried to run code", "NOT loaded", "Re-copy the checkpoint from a trusted source")


# --------------------------------------------------------------------------------------------------
# Crafting


class Call:
    """Pickles as a call of `func(*args)` (REDUCE)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def payload(marker: Path) -> Call:
    return Call(os.system, f"touch {marker}")


def spliced(pickled: bytes, marker: Path) -> bytes:
    """`pickled` with a payload unpickled (and dropped) before its first object: what any unrestricted
    unpickler runs. The payload's opcodes keep no memo entries, so the original's memo indices still hold."""
    ops = pickletools.optimize(pickle.dumps(payload(marker), protocol=2))
    assert ops[:2] == b"\x80\x02" and ops[-1:] == b"." and pickled[:1] == b"\x80"
    return pickled[:2] + ops[2:-1] + b"0" + pickled[2:]  # PROTO, payload, POP, the original


def rewrite_archive(path: Path, edit: Callable[[bytes], bytes]) -> None:
    """Rewrite a torch.save archive with its data.pkl edited (the other records copied as they are)."""
    with zipfile.ZipFile(path) as z:
        records = [(info.filename, z.read(info)) for info in z.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in records:
            z.writestr(name, edit(data) if name.endswith("/data.pkl") else data)
    path.write_bytes(buf.getvalue())


def payload_archive(marker: Path, length: int) -> bytes:
    """A torch.save-like archive of exactly `length` bytes whose data.pkl is a payload (padded by a record)."""
    def build(pad: int) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", pickle.dumps(payload(marker), protocol=2))
            z.writestr("archive/byteorder", b"little")
            z.writestr("archive/pad", b"\0" * pad)
        return buf.getvalue()

    data = build(length - len(build(0)))
    assert len(data) == length
    return data


def dcp_item(root: Path, fqn: str, offset=None) -> sp.DcpStorageItem:
    md = sp.load_dcp_metadata(root / ITER, MEGATRON)
    return md.storage_data[sp.DcpIndex(fqn, offset)]


def overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def replace_bytes(path: Path, old: bytes, new: bytes) -> None:
    """A same-length byte replacement (keeps every offset and pickle frame of the file)."""
    assert len(old) == len(new)
    data = path.read_bytes()
    assert data.count(old) >= 1, old
    path.write_bytes(data.replace(old, new))


def resave(path: Path, change: Callable[[dict], None]) -> None:
    """Load a rank file with torch (materialised), change it, torch.save it back (a well-formed file)."""
    import torch

    state = dict(sp.materialize(sp.load_archive(path, what="test", family=MEGATRON), mmap=False))
    change(state)
    torch.save(state, path)


def central_size(data: bytes, suffix: str, size: int) -> bytes:
    """The archive with the zip directory entry of the record ending in `suffix` claiming `size` bytes."""
    at = data.index(b"PK\x01\x02")
    while True:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + name_len].endswith(suffix.encode()):
            return data[:at + 20] + struct.pack("<LL", size, size) + data[at + 28:]
        at = data.index(b"PK\x01\x02", at + 4)


# --------------------------------------------------------------------------------------------------
# Damages: each takes the copy's root (and a folder outside it) and returns nothing


def crafted_model_file(root, outside, marker):
    rewrite_archive(root / ITER / "mp_rank_01_000" / "model_optim_rng.pt", lambda p: spliced(p, marker))


def crafted_distrib_optim(root, outside, marker):
    rewrite_archive(root / ITER / "mp_rank_00_001" / "distrib_optim.pt", lambda p: spliced(p, marker))


def crafted_common(root, outside, marker):
    rewrite_archive(root / ITER / "common.pt", lambda p: spliced(p, marker))


def crafted_dcp_metadata(root, outside, marker):
    meta = root / ITER / ".metadata"
    meta.write_bytes(spliced(meta.read_bytes(), marker))


def crafted_bytes_item(root, outside, marker):
    item = dcp_item(root, "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1")
    overwrite(Path(item.path), item.offset, payload_archive(marker, item.length))


def crafted_tensor_item(root, outside, marker):
    item = dcp_item(root, BUCKET0, (0,))
    overwrite(Path(item.path), item.offset, payload_archive(marker, item.length))


def truncated(rel):
    def damage(root, outside, marker):
        f = root / ITER / rel
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return damage


def zeroed(rel):
    def damage(root, outside, marker):
        f = root / ITER / rel
        f.write_bytes(b"\0" * f.stat().st_size)
    return damage


def record_size_lie(root, outside, marker):
    """A tensor's storage record whose zip directory entry claims ~4 GiB in a 600 KB file."""
    f = root / ITER / "mp_rank_00_000" / "distrib_optim.pt"
    f.write_bytes(central_size(f.read_bytes(), "/data/0", 0xFFFFFFF0))


def item_size_lie(root, outside, marker):
    """A .distcp tensor item whose zip directory claims ~4 GiB for its storage record."""
    item = dcp_item(root, BUCKET0, (0,))
    with open(item.path, "rb") as fh:
        fh.seek(item.offset)
        data = fh.read(item.length)
    overwrite(Path(item.path), item.offset, central_size(data, "/data/0", 0xFFFFFFF0))


def item_other_dtype(root, outside, marker):
    """The first chunk of a float32 optimizer bucket re-declared as int16 storage inside its .distcp item."""
    item = dcp_item(root, BUCKET0, (0,))
    with open(item.path, "rb") as fh:
        fh.seek(item.offset)
        data = fh.read(item.length)
    overwrite(Path(item.path), item.offset, data.replace(b"FloatStorage", b"ShortStorage"))


def dcp_path_out(root, outside, marker):
    shutil.copy(root / ITER / "__0_0.distcp", root / "outsidexx")  # next to the iteration folder: outside it
    replace_bytes(root / ITER / ".metadata", b"__0_0.distcp", b"../outsidexx")


def dcp_absolute_path(root, outside, marker):
    replace_bytes(root / ITER / ".metadata", b"__0_0.distcp", b"/etc/passwd0")


def link_out(rel):
    def damage(root, outside, marker):
        target = outside / Path(rel).name
        src = root / ITER / rel
        shutil.move(src, target)
        src.symlink_to(target, target_is_directory=target.is_dir())
    return damage


def missing_iteration(root, outside, marker):
    (root / "latest_checkpointed_iteration.txt").write_text("12")


def garbage_tracker(root, outside, marker):
    (root / "latest_checkpointed_iteration.txt").write_text("latest\n")


def rank_of_iteration_8(root, outside, marker):
    target = root / ITER / "mp_rank_01_000"
    shutil.rmtree(target)
    shutil.copytree(SOURCES["A"] / "iter_0000008" / "mp_rank_01_000", target)


def common_of_iteration_8(root, outside, marker):
    shutil.copy(SOURCES["B"] / "iter_0000008" / "common.pt", root / ITER / "common.pt")


def swapped(a, b):
    def damage(root, outside, marker):
        fa, fb = root / ITER / a, root / ITER / b
        tmp = fa.with_name("swap.tmp")
        fa.rename(tmp)
        fb.rename(fa)
        tmp.rename(fb)
    return damage


def missing_rank_folder(root, outside, marker):
    shutil.rmtree(root / ITER / "mp_rank_01_001")


def moe_args(root, outside, marker):
    def change(state):
        state["args"].num_experts = 8
    resave(root / ITER / "common.pt", change)


def unknown_parameter(root, outside, marker):
    """An expert weight in a dense model's rank file (as a MoE layer would add)."""
    def change(state):
        model = dict(state["model"])
        model["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"] = model[
            "decoder.layers.1.mlp.linear_fc1.weight"].clone()
        state["model"] = model
    for t in (0, 1):
        resave(root / ITER / f"mp_rank_0{t}_000" / "model_optim_rng.pt", change)


def unknown_name(root, outside, marker):
    """A parameter name the rulebook has no row for."""
    def change(state):
        model = dict(state["model"])
        model["decoder.layers.1.mlp.linear_fc3.weight"] = model["decoder.layers.1.mlp.linear_fc1.weight"].clone()
        state["model"] = model
    for t in (0, 1):
        resave(root / ITER / f"mp_rank_0{t}_000" / "model_optim_rng.pt", change)


def int8_weight(root, outside, marker):
    import torch

    def change(state):
        model = dict(state["model"])
        name = "decoder.layers.0.self_attention.linear_proj.weight"
        model[name] = model[name].to(torch.int8)
        state["model"] = model
    resave(root / ITER / "mp_rank_00_000" / "model_optim_rng.pt", change)


def corrupt_args(root, outside, marker):
    def change(state):
        state["args"].hidden_size = None
    resave(root / ITER / "mp_rank_00_000" / "model_optim_rng.pt", change)


def bad_metadata_json(root, outside, marker):
    (root / ITER / "metadata.json").write_text('{"sharded_backend": "torch_dist", ')


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    damage: Callable
    words: tuple  # the cause and the fix, each in the one error line
    where: str  # the file (path suffix) the error line names
    commands: tuple = ("to-universal",)
    iteration: Optional[int] = None  # --iteration for to-universal / inspect

    def __str__(self):
        return self.name


ALL = ("to-universal", "inspect", "verify")
TENSORS = ("to-universal", "verify")  # inspect reads no tensor item: it succeeds on those cases

CASES = [
    # pickles that would run code, in every pickled file kind
    Case("crafted model_optim_rng.pt", "A", crafted_model_file, RUN_CODE + ("posix.system",),
         "mp_rank_01_000/model_optim_rng.pt", ALL),
    Case("crafted distrib_optim.pt", "A", crafted_distrib_optim, RUN_CODE + ("posix.system",),
         "mp_rank_00_001/distrib_optim.pt", ALL),
    Case("crafted common.pt", "B", crafted_common, RUN_CODE + ("posix.system",), "common.pt", ALL),
    Case("crafted .metadata", "B", crafted_dcp_metadata, RUN_CODE + ("posix.system",), ".metadata", ALL),
    Case("crafted .distcp bytes item", "B", crafted_bytes_item, RUN_CODE + ("posix.system", "shard_0_1"),
         "__0_0.distcp", ALL),
    Case("crafted .distcp tensor item", "B", crafted_tensor_item, RUN_CODE + ("posix.system", "bucket_idx_0"),
         "__0_0.distcp", TENSORS),
    # truncated, zeroed, size-lying
    Case("truncated distrib_optim.pt", "A", truncated("mp_rank_01_001/distrib_optim.pt"),
         ("truncated", "re-copy"), "mp_rank_01_001/distrib_optim.pt", ("to-universal", "inspect")),
    Case("zeroed model_optim_rng.pt", "C", zeroed("mp_rank_00_001/model_optim_rng.pt"),
         ("not a torch.save zip archive", "re-copy"), "mp_rank_00_001/model_optim_rng.pt"),
    Case("truncated .distcp", "B", truncated("__4_1.distcp"), ("spans bytes", "truncated", "re-copy"),
         "__4_1.distcp"),
    Case("zeroed .metadata", "B", zeroed(".metadata"), ("not a valid pickle", "re-copy"), ".metadata"),
    Case("record claims 4 GiB", "A", record_size_lie, (f"declares {0xFFFFFFF0} bytes", "re-copy"),
         "mp_rank_00_000/distrib_optim.pt"),
    Case(".distcp item claims 4 GiB", "B", item_size_lie, (f"declares {0xFFFFFFF0} bytes", "re-copy"),
         "__0_0.distcp", TENSORS),
    Case(".distcp item of another dtype", "B", item_other_dtype,
         ("holds int16 data of shape (3072,)", "declares float32 data", "re-copy"), "__0_0.distcp", TENSORS),
    # paths out of the checkpoint
    Case(".metadata names ../", "B", dcp_path_out, ("'../outsidexx'", "NOT read", "re-copy"), ".metadata",
         ("to-universal", "inspect")),
    Case(".metadata names an absolute path", "B", dcp_absolute_path, ("'/etc/passwd0'", "NOT read", "re-copy"),
         ".metadata"),
    Case("rank folder links out", "A", link_out("mp_rank_01_001"), ("outside the checkpoint folder", "NOT read",
         "Replace the link"), "mp_rank_01_001/model_optim_rng.pt", ("to-universal", "inspect")),
    Case(".distcp links out", "B", link_out("__5_1.distcp"), ("symbolic link", "NOT read", "re-copy"),
         "__5_1.distcp"),
    Case("common.pt links out", "B", link_out("common.pt"), ("outside the checkpoint folder", "NOT read",
         "Replace the link"), "common.pt"),
    # iterations
    Case("tracker names a missing iteration", "C", missing_iteration, ("missing", "pass --iteration N",
         "iter_0000004"), "iter_0000012", ("to-universal", "inspect")),
    Case("tracker holds garbage", "C", garbage_tracker, ("expected an iteration number", "--iteration N"),
         "latest_checkpointed_iteration.txt"),
    Case("--iteration of no saved folder", "A", lambda *a: None, ("missing", "pass --iteration N"),
         "iter_0000005", iteration=5),
    Case("rank folder of iteration 8", "A", rank_of_iteration_8, ("holds iteration 8", "Re-copy this rank folder"),
         "mp_rank_01_000/model_optim_rng.pt"),
    Case("common.pt of iteration 8", "B", common_of_iteration_8, ("holds iteration 8", "Re-copy the iteration"),
         "common.pt"),
    # swapped and missing rank files
    Case("distrib_optim.pt swapped between stages", "A",
         swapped("mp_rank_00_000/distrib_optim.pt", "mp_rank_00_001/distrib_optim.pt"),
         ("64-element alignment", "does not belong to this model"), "distrib_optim.pt"),
    Case("model files swapped between stages", "C",
         swapped("mp_rank_01_000/model_optim_rng.pt", "mp_rank_01_001/model_optim_rng.pt"),
         ("another pipeline layout", "re-copy the iteration folder"), "mp_rank_01_000/model_optim_rng.pt"),
    Case(".distcp files swapped between stages", "B", swapped("__1_0.distcp", "__1_1.distcp"),
         ("re-copy",), ".distcp"),
    Case("missing rank folder", "A", missing_rank_folder, ("missing rank folder", "re-copy"), "mp_rank_01_001"),
    # keys, dtypes, args the model does not have
    Case("MoE args", "B", moe_args, ("mlp.router.weight is missing", "does not match its args", "num_experts=8"),
         ".metadata", ("to-universal", "inspect")),
    Case("an expert weight in a dense model", "C", unknown_parameter, ("belongs to an MoE layer", "layer 1 is dense",
         "args disagree"), "mp_rank_00_000/model_optim_rng.pt"),
    Case("a parameter no rule knows", "C", unknown_name, ("no rule in the megatron-core GPT rulebook", "add a row"),
         "mp_rank_00_000/model_optim_rng.pt"),
    Case("int8 weight", "C", int8_weight, ("is int8, expected float32 or bfloat16 or float16", "re-copy"),
         "mp_rank_00_000/model_optim_rng.pt", ("to-universal", "inspect")),
    Case("args without hidden_size", "C", corrupt_args, ("args.hidden_size=None", "re-copy"),
         "mp_rank_00_000/model_optim_rng.pt", ("to-universal", "inspect")),
    Case("metadata.json not JSON", "B", bad_metadata_json, ("not valid JSON", "re-copy"), "metadata.json"),
]


# --------------------------------------------------------------------------------------------------
# Running


def tree_state(root: Path) -> dict:
    """Every file's sha256 and every link's target under root (links are not followed)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# Runs `python -m megatron_ucp.cli ARGS --quiet` once per argv given (JSON lists), in this one process, each
# with its own stdout/stderr; prints [exit status, stdout, stderr] per run as JSON. An exception escaping the
# CLI is not caught: its traceback reaches the real stderr and fails the case.
_DRIVER = r"""
import contextlib, io, json, runpy, sys
results = []
for argv in map(json.loads, sys.argv[1:]):
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = ["megatron-ucp", *argv, "--quiet"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("megatron_ucp.cli", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


def run_cli(commands: list[list[str]], cwd: Path) -> list[Run]:
    """The CLI run once per argv, in one subprocess (interpreter and imports paid once per case)."""
    proc = subprocess.run([sys.executable, "-c", _DRIVER, *map(json.dumps, commands)], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=dict(os.environ, PYTHONPATH=str(REPO),
                                                                    OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return [Run(*r) for r in json.loads(proc.stdout)]


def assert_one_error_line(run: Run, case: Case, command: str) -> str:
    label = f"{case.name} / {command}"
    assert "Traceback" not in run.stderr + run.stdout, (label, run.stderr)
    assert run.returncode == 1, (label, run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (label, run.stderr)
    message = lines[0][len("error: "):]
    for word in case.words:
        assert word in message, (label, word, message)
    assert case.where in message, (label, case.where, message)
    assert "weights_only" not in message and "disable" not in message.replace("never disables", ""), message
    return message


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_is_refused_in_one_line(case: Case, tmp_path):
    root = tmp_path / "src"
    shutil.copytree(SOURCES[case.source] / ITER, root / ITER)
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = tmp_path / "marker"
    case.damage(root, outside, marker)
    before = tree_state(tmp_path)
    dst = tmp_path / "dst"
    iteration = [] if case.iteration is None else ["--iteration", str(case.iteration)]
    argv = {"to-universal": ["to-universal", str(root), str(dst), *iteration],
            "inspect": ["inspect", str(root), *iteration],
            "verify": ["verify", str(root), str(SOURCES[case.source]), "--iteration-b", "4"]}
    runs = run_cli([argv[c] for c in case.commands], cwd=tmp_path)
    for command, run in zip(case.commands, runs):
        assert_one_error_line(run, case, command)
    assert not marker.exists(), f"{case.name}: the payload ran"
    assert tree_state(tmp_path) == before  # the input (and the folder outside it) byte for byte
    assert not dst.exists() and not list(tmp_path.glob("dst*"))


# --------------------------------------------------------------------------------------------------
# Negative controls


class _AnyClass:
    """Stands in for torch / DCP globals so that an unrestricted unpickler gets as far as the payload."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _Unrestricted(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith(("torch", "megatron", "collections", "argparse", "numpy")):
            return _AnyClass
        return super().find_class(module, name)

    def persistent_load(self, pid):
        return None


def _pickles_of(case: Case, root: Path) -> list[bytes]:
    """The pickle bytes the crafted file holds where its reader will unpickle them."""
    if case.damage is crafted_dcp_metadata:
        return [(root / ITER / ".metadata").read_bytes()]
    if case.damage in (crafted_bytes_item, crafted_tensor_item):
        fqn, offset = ("optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1", None) \
            if case.damage is crafted_bytes_item else (BUCKET0, (0,))
        item = dcp_item(root, fqn, offset)
        with open(item.path, "rb") as f:
            f.seek(item.offset)
            window = io.BytesIO(f.read(item.length))
        with zipfile.ZipFile(window) as z:
            return [z.read("archive/data.pkl")]
    out = []
    for f in (root / ITER).rglob("*.pt"):
        with zipfile.ZipFile(f) as z:
            out += [z.read(n) for n in z.namelist() if n.endswith("/data.pkl")]
    return out


@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("crafted")], ids=str)
def test_crafted_files_are_live(case: Case, tmp_path):
    """Each crafted file runs its payload under an unrestricted unpickler: the refusals above test something."""
    root = tmp_path / "src"
    shutil.copytree(SOURCES[case.source] / ITER, root / ITER)
    marker = tmp_path / "marker"
    case.damage(root, tmp_path, marker)
    for data in _pickles_of(case, root):
        try:
            _Unrestricted(io.BytesIO(data)).load()
        except Exception:
            pass  # the stand-ins may not rebuild the rest; the payload comes first
        if marker.exists():
            break
    assert marker.exists()


def test_the_undamaged_copy_converts(tmp_path):
    """Positive control for the copies and the CLI invocation used above: an untouched copy of A converts."""
    root = tmp_path / "src"
    shutil.copytree(SOURCES["A"] / ITER, root / ITER)
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    before = tree_state(root)
    run, = run_cli([["to-universal", str(root), str(tmp_path / "dst")]], cwd=tmp_path)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert (tmp_path / "dst" / "metadata.json").is_file() and tree_state(root) == before
