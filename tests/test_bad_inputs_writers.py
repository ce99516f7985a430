"""Bad inputs and abuse of the writers (to-universal, from-universal, export-hf), each through the real CLI in
a subprocess. Every refused case asserts: exit code 1, one `error:` line naming the cause and the fix, no
traceback, the input's bytes unchanged (sha256 of every file), and nothing valid-looking left (no DST, or
the earlier DST unchanged; no DST.partial-*, DST.old-*, lock file).

Inputs: Megatron-LM's fixture C (legacy torch, TP2 PP2, gpt2-like, 2 MB) converted once per module into a
universal checkpoint (version 2, checksummed) and a lazy one (an index into a copy of C); each test damages
its own copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ucp.convert import to_universal
from megatron_ucp.universal import UniversalCheckpoint
from writer_cli import (B_FIXTURE, C_FIXTURE, REPO, Paused, assert_nothing_left, assert_ok, assert_one_line_error,
                        cli, command, copy_of, edit_metadata, env, flip_bit, tree_digest)

FROM = ("--ckpt-format", "torch", "--rng-state", "cpu", "--quiet")  # from-universal at TP1 PP1 DP1
HF = ("--model-type", "gpt2", "--quiet")
PARAM = "decoder.layers.1.mlp.linear_fc1.weight"  # [192, 48]: fp32, exp_avg, exp_avg_sq


@pytest.fixture(scope="module")
def ucp(tmp_path_factory) -> Path:
    return to_universal(C_FIXTURE, tmp_path_factory.mktemp("bad") / "ucp", iteration=4, progress=False)


@pytest.fixture(scope="module")
def lazy_parts(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lazy")
    shutil.copytree(C_FIXTURE / "iter_0000004", root / "src" / "iter_0000004")
    return root / "src", to_universal(root / "src" / "iter_0000004", root / "lazy", lazy=True, progress=False)


def refused(proc, inputs: dict, dst: Path, *needles: str, existed=None) -> str:
    """The common assertions of a refused write (see the module docstring)."""
    message = assert_one_line_error(proc, *needles)
    for path, digest in inputs.items():
        assert tree_digest(path) == digest, f"{path} was modified"
    assert_nothing_left(dst, existed=existed)
    return message


# --------------------------------------------------------------------------------------------------
# Destinations: nothing of the user's is replaced or written into


@pytest.mark.parametrize("kind", ["user folder", "Megatron iteration folder", "folder with a metadata.json"])
def test_overwrite_never_replaces_what_the_tool_did_not_write(kind, tmp_path):
    dst = tmp_path / "dst"
    if kind == "user folder":
        dst.mkdir()
        (dst / "notes.txt").write_text("mine")
    elif kind == "Megatron iteration folder":  # torch_dist: it holds a metadata.json of its own
        shutil.copytree(B_FIXTURE / "iter_0000004", dst)
    else:
        dst.mkdir()
        (dst / "metadata.json").write_text(json.dumps({"format": "my-own", "parameters": {}}))
    before = tree_digest(dst)
    proc = cli("to-universal", C_FIXTURE, dst, "--iteration", "4", "--overwrite", "--quiet")
    refused(proc, {C_FIXTURE: tree_digest(C_FIXTURE)}, dst, "was not written by megatron-ucp",
            "refusing to overwrite it, delete it yourself or choose another destination", existed=before)


def test_from_universal_overwrite_of_megatron_lm_s_own_checkpoint_is_refused(ucp, tmp_path):
    dst = copy_of(C_FIXTURE, tmp_path, "megatron_lm_ckpt")  # written by Megatron-LM: no megatron-ucp.json
    before = tree_digest(dst)
    proc = cli("from-universal", ucp, dst, *FROM, "--overwrite")
    refused(proc, {ucp: tree_digest(ucp)}, dst, "no megatron-ucp.json marker of a Megatron checkpoint",
            "refusing to overwrite", existed=before)


def test_export_overwrite_of_another_kind_of_output_is_refused(ucp, tmp_path):
    dst = copy_of(ucp, tmp_path, "other_ucp")
    before = tree_digest(dst)
    proc = cli("export-hf", ucp, dst, *HF, "--overwrite")
    refused(proc, {ucp: tree_digest(ucp)}, dst, "is a universal checkpoint written by megatron-ucp, not a Hugging "
            "Face export", "choose another destination", existed=before)


@pytest.mark.parametrize("command", ["to-universal", "from-universal", "export-hf"])
def test_an_existing_destination_needs_overwrite(command, ucp, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()  # even an empty folder: nothing is moved aside without --overwrite
    args = {"to-universal": (C_FIXTURE, dst, "--iteration", "4", "--quiet"), "from-universal": (ucp, dst, *FROM),
            "export-hf": (ucp, dst, *HF)}[command]
    proc = cli(command, *args)
    refused(proc, {ucp: tree_digest(ucp)}, dst, "already exists; choose another destination, or pass --overwrite",
            existed={})


@pytest.mark.parametrize("command", ["to-universal", "from-universal", "export-hf"])
def test_a_destination_inside_the_input_is_refused_before_anything_is_created(command, ucp, tmp_path):
    if command == "to-universal":
        src = copy_of(C_FIXTURE, tmp_path, "megatron")
        dst, args = src / "iter_0000004" / "ucp", (src, src / "iter_0000004" / "ucp", "--quiet")
    else:
        src = copy_of(ucp, tmp_path, "ucp")
        dst = src / "out"
        args = (src, dst, *(FROM if command == "from-universal" else HF))
    before = tree_digest(src)
    proc = cli(command, *args)
    refused(proc, {src: before}, dst, "overlaps", "the input is never modified")  # no lock or staging file in it


# --------------------------------------------------------------------------------------------------
# Damaged inputs: every flipped bit is caught, every declared size checked before allocation


def test_flipped_bit_in_tensor_data_stops_from_universal(ucp, tmp_path):
    src = copy_of(ucp, tmp_path)
    victim = src / "tensors" / f"{PARAM}.safetensors"
    flip_bit(victim, victim.stat().st_size - 100, bit=3)
    before, dst = tree_digest(src), tmp_path / "out"
    message = refused(cli("from-universal", src, dst, *FROM), {src: before}, dst, str(victim), "block 0",
                      f"of {PARAM}'s tensor file fails its checksum", "restore it from a copy or reconvert")
    assert "delete" not in message


def test_flipped_bit_in_tensor_header_stops_export(ucp, tmp_path):
    src = copy_of(ucp, tmp_path)
    victim = src / "tensors" / "embedding.word_embeddings.weight.safetensors"
    flip_bit(victim, 20)  # inside the JSON header
    before, dst = tree_digest(src), tmp_path / "hf"
    refused(cli("export-hf", src, dst, *HF), {src: before}, dst, str(victim), "block 0 (bytes 0..",
            "fails its checksum")


def test_flipped_bit_in_a_lazy_source_with_its_mtime_restored_stops_from_universal(lazy_parts, tmp_path):
    src_root, lazy = lazy_parts
    ucp = UniversalCheckpoint.open(lazy)
    region = ucp.parameters[PARAM].placements["exp_avg"].shards[1].regions[0]
    original = Path(region.path).read_bytes()
    flip_bit(Path(region.path), region.offset + region.nbytes // 2, keep_mtime=True)
    try:
        inputs = {src_root: tree_digest(src_root), lazy: tree_digest(lazy)}
        dst = tmp_path / "out"
        refused(cli("from-universal", lazy, dst, *FROM), inputs, dst, region.path, "fails its checksum",
                "the source checkpoint was damaged after the lazy conversion", "restore it from a copy")
    finally:
        st = os.stat(region.path)
        Path(region.path).write_bytes(original)
        os.utime(region.path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_truncated_tensor_file_stops_from_universal(ucp, tmp_path):
    src = copy_of(ucp, tmp_path)
    victim = src / "tensors" / f"{PARAM}.safetensors"
    size = victim.stat().st_size
    os.truncate(victim, size - 4096)
    dst = tmp_path / "out"
    refused(cli("from-universal", src, dst, *FROM), {src: tree_digest(src)}, dst, str(victim),
            f"{size - 4096} bytes, {PARAM}'s tensor file was written with {size}", "restore it from a copy")


def test_missing_tensor_file_stops_export(ucp, tmp_path):
    src = copy_of(ucp, tmp_path)
    victim = src / "tensors" / "decoder.final_layernorm.weight.safetensors"
    victim.unlink()
    dst = tmp_path / "hf"
    refused(cli("export-hf", src, dst, *HF), {src: tree_digest(src)}, dst, str(victim), "missing",
            "restore it from a copy or reconvert")


def test_a_tensor_file_replaced_by_a_link_out_of_the_checkpoint_is_refused(ucp, tmp_path):
    src = copy_of(ucp, tmp_path)
    outside = tmp_path / "secret.safetensors"
    victim = src / "tensors" / f"{PARAM}.safetensors"
    shutil.copy(victim, outside)  # same bytes: only where it lives is wrong
    victim.unlink()
    victim.symlink_to(outside)
    dst = tmp_path / "out"
    refused(cli("from-universal", src, dst, *FROM), {src: tree_digest(src)}, dst, str(victim),
            "is not a regular file inside", "restore it from a copy")


@pytest.mark.parametrize("version", [2, 1])
def test_a_shape_bomb_fails_fast_before_anything_is_allocated(version, ucp, tmp_path):
    """metadata.json edited (and resealed) to declare a 16 GiB tensor, its file made a sparse file that
    large: refused in seconds with one line, nothing allocated (version 2: the checksum record cannot back
    the shape; version 1: the shape is not the model's, checked when the checkpoint is opened)."""
    src = copy_of(ucp, tmp_path)
    name = "decoder.final_layernorm.weight"
    bomb = [65536, 65536]

    def edit(meta):
        meta["parameters"][name]["shape"] = bomb
        if version == 1:
            meta["version"] = 1
            for entry in meta["parameters"].values():
                entry.pop("checksum")

    edit_metadata(src, edit)
    victim = src / "tensors" / f"{name}.safetensors"
    os.truncate(victim, 3 * 65536 * 65536 * 4 + victim.stat().st_size)  # sparse: no disk used
    st = victim.stat()
    victim.rename(tmp_path / "bomb")  # hashed apart: its 48 GiB are not read for the digest
    before = tree_digest(src)
    (tmp_path / "bomb").rename(victim)
    dst = tmp_path / "out"
    start = time.perf_counter()
    proc = cli("from-universal", src, dst, *FROM)
    seconds = time.perf_counter() - start
    needles = ((str(src / "metadata.json"), name, "needs 51539607552 bytes of data", "reconvert") if version == 2
               else (f"{src}: {name} has shape {bomb}", "the model config gives [48]", "reconvert"))
    assert_one_line_error(proc, *needles)
    assert_nothing_left(dst)
    assert seconds < 60, seconds  # fails at open / at the header, not after allocating 48 GiB
    now = victim.stat()
    assert (now.st_size, now.st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    victim.unlink()
    assert tree_digest(src) == before


def test_edited_metadata_is_refused(ucp, tmp_path):
    src = copy_of(ucp, tmp_path)
    meta = json.loads((src / "metadata.json").read_text())
    meta["iteration"] = 40  # not resealed
    (src / "metadata.json").write_text(json.dumps(meta))
    dst = tmp_path / "hf"
    refused(cli("export-hf", src, dst, *HF), {src: tree_digest(src)}, dst, "its sha256 differs",
            "edited or damaged after conversion, reconvert it")


def test_a_lazy_index_pointing_out_of_its_source_is_refused(lazy_parts, tmp_path):
    _, lazy = lazy_parts
    src = copy_of(lazy, tmp_path)

    def edit(meta):
        region = meta["parameters"][PARAM]["source_bytes"]["fp32"]["shards"][0]["regions"][0]
        region[0] = "../../../../etc/passwd"

    edit_metadata(src, edit)
    dst = tmp_path / "out"
    refused(cli("from-universal", src, dst, *FROM), {src: tree_digest(src)}, dst, PARAM,
            "is not a plain relative path inside the source checkpoint", "reconvert")


@pytest.mark.parametrize("command", ["from-universal", "export-hf", "inspect", "check"])
def test_a_staging_directory_is_never_an_input_whatever_it_holds(command, ucp, tmp_path):
    """A killed writer's staging directory that even holds COMPLETE and metadata.json."""
    staging = copy_of(ucp, tmp_path, "ucp.partial-node1-4242-0badcafe")
    dst = tmp_path / "out"
    args = {"from-universal": (staging, dst, *FROM), "export-hf": (staging, dst, *HF), "inspect": (staging,),
            "check": (staging,)}[command]
    refused(cli(command, *args), {staging: tree_digest(staging)}, dst, "is the staging directory of a megatron-ucp "
            "write", "not a checkpoint, whatever it holds", "--clean-stale")


@pytest.mark.parametrize("which", ["root", "iteration folder"])
def test_from_universal_of_a_megatron_checkpoint_says_how_to_convert_it(which, tmp_path):
    src = C_FIXTURE if which == "root" else C_FIXTURE / "iter_0000004"
    dst = tmp_path / "out"
    message = refused(cli("from-universal", src, dst, *FROM), {C_FIXTURE: tree_digest(C_FIXTURE)}, dst,
                      f"{src}: is a Megatron-LM checkpoint", "not a universal checkpoint",
                      f"megatron-ucp to-universal {src} UCP_DIR")
    assert "delete" not in message and "incomplete" not in message


# --------------------------------------------------------------------------------------------------
# Two writers, a full disk


def test_two_writers_at_once_exactly_one_wins(ucp, tmp_path):
    """The first to-universal holds DST (paused right after taking its lock); a second one into the same
    DST (from another source) fails at once naming the holder; the first then finishes, and DST is its."""
    dst = tmp_path / "ucp"
    first = Paused(tmp_path, "staged", "to-universal", C_FIXTURE, dst, "--iteration", "4", "--quiet")
    pid = first.wait()
    second = cli("to-universal", B_FIXTURE, dst, "--iteration", "4", "--quiet", "--overwrite")
    message = assert_one_line_error(second, f"{dst}: is being written by another megatron-ucp process (pid {pid} ",
                                    "wait for it or choose another destination")
    assert "Traceback" not in message
    assert_ok(first.resume())
    done = UniversalCheckpoint.open(dst)
    assert done.metadata["source"]["path"] == str((C_FIXTURE / "iter_0000004").resolve())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("ucp", ".ucp"))) == ["ucp"]


ON_SMALL_DISK = (  # in a private mount namespace (unshare -rm: no root needed), a 512 KiB tmpfs at $1, then the
    # command; what is left on the tmpfs is listed next to it before the namespace (and the tmpfs) goes away
    'disk="$1"; shift; mount -t tmpfs -o size=512k tmpfs "$disk" || exit 97; "$@"; rc=$?; '
    'ls -A "$disk" > "$disk.left"; exit $rc')

ENOSPC_AFTER_512K = (  # the CLI with writes failing once 512 KiB went out (where no tmpfs can be mounted)
    "import errno, os, sys\n"
    "left = [512 << 10]\n"
    "def guard(real):\n"
    "    def write(fd, data, *a):\n"
    "        left[0] -= len(data)\n"
    "        if left[0] < 0: raise OSError(errno.ENOSPC, 'No space left on device')\n"
    "        return real(fd, data, *a)\n"
    "    return write\n"
    "os.pwrite, os.write = guard(os.pwrite), guard(os.write)\n"
    "os.copy_file_range = lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, 'No space left on device'))\n"
    "from megatron_ucp import cli\n"
    "sys.exit(cli.main(sys.argv[1:]))\n")


def run_on_small_disk(disk: Path, args: tuple) -> tuple[subprocess.CompletedProcess, list]:
    """`megatron-ucp ARGS` writing onto a 512 KiB tmpfs mounted at `disk` (a private mount namespace, or a
    plain mount where namespaces are off and this process may mount); what it left there."""
    disk.mkdir()
    cmd = command(*args)
    if shutil.which("unshare"):
        proc = subprocess.run(["unshare", "-rm", "sh", "-c", ON_SMALL_DISK, "sh", str(disk), *cmd], cwd=REPO,
                              env=env(), capture_output=True, text=True, timeout=300)
        if proc.returncode != 97:
            return proc, Path(f"{disk}.left").read_text().split()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)],
                      capture_output=True).returncode:
        pytest.skip("no mount namespace and no permission to mount a tmpfs here")
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
        return proc, os.listdir(disk)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("command_name", ["to-universal", "from-universal", "export-hf"])
def test_a_full_disk_gives_one_line_and_leaves_nothing(command_name, ucp, tmp_path):
    """Outputs of 2.0 MB (universal; legacy torch.save files) and 0.7 MB (HF) onto a 512 KiB tmpfs: copies
    fail with ENOSPC, torch.save words it "file write failed", safetensors "os error 28"; each becomes the
    same one line, and nothing is left on the disk (no staging directory, no lock file)."""
    disk = tmp_path / "disk"
    dst = disk / "out"
    args = {"to-universal": (C_FIXTURE, dst, "--iteration", "4", "--quiet"), "from-universal": (ucp, dst, *FROM),
            "export-hf": (ucp, dst, "--model-type", "gpt2", "--dtype", "float32", "--quiet")}[command_name]
    before = tree_digest(ucp)
    proc, left = run_on_small_disk(disk, (command_name, *args))
    assert_one_line_error(proc, "no space left on ", "free space or choose ")
    assert left == [] and tree_digest(ucp) == before


def test_a_full_disk_without_any_tmpfs_is_simulated(tmp_path):
    """The same one line where no tmpfs can be had at all: ENOSPC injected into the writes of to-universal."""
    dst = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", ENOSPC_AFTER_512K, "to-universal", str(C_FIXTURE), str(dst),
                           "--iteration", "4", "--quiet"], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env())
    assert_one_line_error(proc, "no space left on the device while writing", "free space or choose ")
    assert_nothing_left(dst)


# --------------------------------------------------------------------------------------------------
# What works: the tool's own outputs are replaced, Megatron's short flags are accepted


def test_overwrite_replaces_the_tools_own_output_and_short_flags_work(ucp, tmp_path):
    dst = tmp_path / "megatron"
    assert_ok(cli("from-universal", ucp, dst, "-t", "2", "-p", "2", "-d", "1", *FROM))
    assert sorted(p.name for p in (dst / "iter_0000004").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    marker = json.loads((dst / "megatron-ucp.json").read_text())
    assert marker["kind"] == "megatron" and marker["layout"]["tp"] == 2 and marker["layout"]["pp"] == 2
    assert_ok(cli("from-universal", ucp, dst, "-t", "1", *FROM, "--overwrite"))  # replaced: it wrote it
    assert sorted(p.name for p in (dst / "iter_0000004").iterdir()) == ["mp_rank_00"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["megatron"]
    plan = cli("plan", ucp, "-t", "2", "-p", "2", "-d", "1", "--json", "--quiet")
    assert_ok(plan)
    assert json.loads(plan.stdout)["target"]["layout"]["pp"] == 2


# --------------------------------------------------------------------------------------------------
# Failures from outside the tool, as the libraries word them


def test_allocator_and_zip_writer_failures_become_one_line(tmp_path):
    """torch's allocator text becomes "out of memory" with the size; torch.save's zip-writer text is a full
    disk only when the disk is (nearly) full, else it is raised as it is; both leave nothing behind."""
    from megatron_ucp.io.staging import Staging, StagingError, write_failure

    oom = RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you "
                       "tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")
    assert write_failure(oom) == ("memory", "68719476736")
    zip_error = RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                             "data/3: file write failed")
    assert write_failure(zip_error) == ("write", None)
    assert write_failure(ValueError("something else")) == (None, None)
    dst = tmp_path / "out"
    with pytest.raises(StagingError) as caught:
        with Staging(dst, kind="megatron", report=lambda m: None) as stage:
            (stage.path / "x").write_bytes(b"1")
            raise oom
    assert str(caught.value) == (f"{dst}: out of memory while writing (an allocation of 64.0 GiB failed); the partial "
                                 f"output was removed, free memory (other jobs) or run on a machine with more")
    assert_nothing_left(dst)
    with pytest.raises(RuntimeError, match="file write failed"):  # this disk has room: not a full disk
        with Staging(dst, kind="megatron", report=lambda m: None):
            raise zip_error
    assert_nothing_left(dst)
