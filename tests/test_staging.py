"""megatron_ucp.io.staging: one writer per destination, atomic publication, nothing of the user's replaced,
leftovers of killed writers reported and cleaned, staging directories never read as checkpoints.

Writers run as real processes (`WRITER` below, started with the interpreter running the tests) where
the property is about processes: two writers racing for one destination, SIGKILL at chosen points. A
writer reports each point it reaches as a line on stdout and, when told to stop there, waits to be
killed, so every kill lands exactly at its point.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ucp.io import staging
from megatron_ucp.io.staging import (
    DestinationBusy, Staging, StagingError, TOOL_MARKER_FILENAME, check_not_staging, find_leftovers,
    is_staging_path, lock_path, tool_marker, written_by_tool)

REPO = Path(__file__).resolve().parents[1]

WRITER = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from megatron_ucp.io import staging
from megatron_ucp.io.staging import Staging, StagingError, tool_marker

dst, ident, nfiles, stop_at, hold, flags = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7]
if "no-renameat2" in flags:
    staging._RENAMEAT2 = None

def event(name):
    print(name, flush=True)
    if name == stop_at:
        time.sleep(120)  # killed here by the test

try:
    with Staging(dst, kind="megatron", overwrite="overwrite" in flags, clean_stale="clean" in flags,
                 on_phase=event, report=lambda m: print("report " + m, flush=True)) as stage:
        if hold != "-":
            while not os.path.exists(hold):
                time.sleep(0.005)
        for i in range(nfiles):
            (stage.path / f"part{i}.bin").write_bytes((f"{ident}:{i};" * 2000).encode())
            if i == nfiles // 2 - 1:
                event("half")
        stage.publish("megatron-ucp.json", tool_marker("megatron", writer=ident))
except StagingError as e:
    print(str(e), file=sys.stderr, flush=True)
    sys.exit(3)
'''


@pytest.fixture(scope="module")
def writer_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("writer") / "writer.py"
    path.write_text(WRITER)
    return path


def start_writer(script: Path, dst: Path, ident: str, *, nfiles: int = 6, stop_at: str = "-", hold: str = "-",
                 flags: str = "-") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), str(REPO), str(dst), ident, str(nfiles), stop_at, hold,
                             flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_line(proc: subprocess.Popen, wanted: str, timeout: float = 60) -> list[str]:
    """Lines of proc's stdout up to and including `wanted`."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"writer ended before {wanted!r}: {lines}, stderr {proc.stderr.read()}")
        lines.append(line.rstrip("\n"))
        if lines[-1] == wanted:
            return lines
    raise AssertionError(f"writer did not reach {wanted!r} in {timeout}s: {lines}")


def files_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def expected_output(ident: str, nfiles: int = 6) -> dict[str, bytes]:
    return {f"part{i}.bin": (f"{ident}:{i};" * 2000).encode() for i in range(nfiles)}


def publish_files(dst: Path, files: dict[str, bytes], kind: str = "megatron", **kw) -> list[str]:
    """One in-process write of `files` to dst; returns the reported lines."""
    reports = []
    with Staging(dst, kind=kind, report=reports.append, **kw) as stage:
        for name, data in files.items():
            (stage.path / name).parent.mkdir(parents=True, exist_ok=True)
            (stage.path / name).write_bytes(data)
        if kind == "universal":
            meta = stage.path / "metadata.json"
            digest = hashlib.sha256(meta.read_bytes()).hexdigest() if meta.is_file() else None
            stage.publish("COMPLETE", {"format": "megatron-ucp-universal", "version": 1, "metadata_sha256": digest})
        else:
            stage.publish(TOOL_MARKER_FILENAME, tool_marker(kind))
    return reports


def siblings(dst: Path) -> list[str]:
    return sorted(os.listdir(dst.parent))


# --------------------------------------------------------------------------------------------------
# Two writers, one destination


def test_concurrent_writers_one_wins_the_other_fails_at_once(tmp_path, writer_script):
    """20 times: two writers started together; the first to lock holds its staging directory open until
    the other has finished. Exactly one publishes; the other exits 3 at once with the one-line "being
    written" message naming the winner's pid and host; DST holds all of the winner's files only."""
    for rep in range(20):
        dst = tmp_path / f"out{rep}"
        release = tmp_path / f"release{rep}"
        procs = {ident: start_writer(writer_script, dst, ident, hold=str(release)) for ident in ("A", "B")}
        deadline = time.monotonic() + 60
        while sum(p.poll() is not None for p in procs.values()) < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        release.touch()
        results = {ident: (p.wait(60), p.stdout.read(), p.stderr.read()) for ident, p in procs.items()}
        winners = [i for i, (rc, _, _) in results.items() if rc == 0]
        losers = [i for i, (rc, _, _) in results.items() if rc == 3]
        assert len(winners) == 1 and len(losers) == 1, results
        winner, loser = winners[0], losers[0]
        message = results[loser][2].strip()
        assert "\n" not in message
        assert message.startswith(f"{dst}: is being written by another megatron-ucp process (pid "
                                  f"{procs[winner].pid} on host "), message
        assert message.endswith("; wait for it or choose another destination")
        got = files_of(dst)
        marker = json.loads(got.pop(TOOL_MARKER_FILENAME))
        assert marker["writer"] == winner and got == expected_output(winner)
        assert not find_leftovers(dst) and not lock_path(dst).exists()


def test_racing_writers_without_hold_never_both_succeed(tmp_path, writer_script):
    """10 free races (no hold): one publishes; the other fails with "being written" (it came while the
    winner wrote) or "already exists" (it came after), never overwriting."""
    for rep in range(10):
        dst = tmp_path / f"out{rep}"
        procs = {ident: start_writer(writer_script, dst, ident) for ident in ("A", "B")}
        results = {ident: (p.wait(60), p.stderr.read().strip()) for ident, p in procs.items()}
        codes = sorted(rc for rc, _ in results.values())
        assert codes == [0, 3], results
        winner = next(i for i, (rc, _) in results.items() if rc == 0)
        loser_message = next(m for rc, m in results.values() if rc == 3)
        assert ("is being written by another megatron-ucp process" in loser_message
                or loser_message.startswith(f"{dst}: already exists;")), loser_message
        got = files_of(dst)
        assert json.loads(got.pop(TOOL_MARKER_FILENAME))["writer"] == winner
        assert got == expected_output(winner)
        assert not find_leftovers(dst)


def test_lock_survives_the_unlink_recreate_race(tmp_path, monkeypatch):
    """A writer that opened the lock file just before its holder released (and unlinked) it locks an
    orphaned inode: it must notice the path names another file now and lock that one instead."""
    dst = tmp_path / "out"
    owner = staging._this_owner(dst, "test")
    first = staging.DestinationLock(dst, owner)
    first.acquire()
    stale_fd = os.open(first.path, os.O_RDWR)  # opened while `first` holds it
    first.release()  # unlinks
    third = staging.DestinationLock(dst, owner)
    third.acquire()  # a new inode at the same path
    # negative control: flock on the orphaned inode succeeds although `third` holds the path's lock,
    # so without the inode check a second writer would go ahead
    fcntl.flock(stale_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(stale_fd, fcntl.LOCK_UN)
    real_open, calls = os.open, []

    def open_stale_first(path, flags, mode=0o777):
        calls.append(path)
        return stale_fd if len(calls) == 1 else real_open(path, flags, mode)

    monkeypatch.setattr(staging.os, "open", open_stale_first)
    with pytest.raises(DestinationBusy):
        staging.DestinationLock(dst, owner).acquire()
    monkeypatch.setattr(staging.os, "open", real_open)
    assert len(calls) == 2  # locked the orphan, saw the path names another inode, retried on the live file
    third.release()
    assert not lock_path(dst).exists()


# --------------------------------------------------------------------------------------------------
# Overwrite: only what this tool wrote, of the same kind


def test_overwrite_refuses_folders_megatron_ucp_did_not_write(tmp_path):
    user = tmp_path / "mine"
    (user / "notes").mkdir(parents=True)
    (user / "metadata.json").write_text('{"mine": true}')
    (user / "notes" / "a.txt").write_text("keep me")
    megatron = tmp_path / "ckpt"
    (megatron / "iter_0000010").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("10")
    (megatron / "iter_0000010" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (megatron / "iter_0000010" / "__0_0.distcp").write_bytes(b"\0" * 100)
    iteration = megatron / "iter_0000010"
    before = {p: files_of(p) for p in (user, megatron)}
    for dst in (user, megatron, iteration):
        for kind in ("universal", "megatron", "hf"):
            with pytest.raises(StagingError) as e:
                publish_files(dst, {"x.bin": b"new"}, kind=kind, overwrite=True)
            message = str(e.value)
            assert message.startswith(f"{dst}: exists and was not written by megatron-ucp (no ")
            assert message.endswith("refusing to overwrite it, delete it yourself or choose another destination")
    assert {p: files_of(p) for p in (user, megatron)} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "mine"]  # no staging or lock left


def test_overwrite_replaces_an_output_of_the_same_kind_only(tmp_path):
    dst = tmp_path / "out"
    publish_files(dst, {"old.bin": b"old"}, kind="megatron")
    assert written_by_tool(dst) == "megatron"
    with pytest.raises(StagingError, match="already exists; choose another destination, or pass --overwrite"):
        publish_files(dst, {"new.bin": b"new"}, kind="megatron")
    with pytest.raises(StagingError, match="is a Megatron checkpoint written by megatron-ucp, not a universal"):
        publish_files(dst, {"new.bin": b"new"}, kind="universal", overwrite=True)
    assert set(files_of(dst)) == {"old.bin", TOOL_MARKER_FILENAME}
    publish_files(dst, {"new.bin": b"new"}, kind="megatron", overwrite=True)
    assert set(files_of(dst)) == {"new.bin", TOOL_MARKER_FILENAME}
    assert siblings(dst) == ["out"]  # old output removed, no staging, no lock
    # a universal checkpoint is recognised by its COMPLETE marker
    ucp = tmp_path / "ucp"
    publish_files(ucp, {"metadata.json": b"{}"}, kind="universal")
    assert written_by_tool(ucp) == "universal"
    publish_files(ucp, {"metadata.json": b"{\"v\": 2}"}, kind="universal", overwrite=True)
    assert files_of(ucp)["metadata.json"] == b"{\"v\": 2}"
    # an empty directory may be replaced with overwrite; a file never
    empty = tmp_path / "empty"
    empty.mkdir()
    publish_files(empty, {"a.bin": b"a"}, kind="hf", overwrite=True)
    assert written_by_tool(empty) == "hf"
    plain = tmp_path / "file"
    plain.write_text("x")
    with pytest.raises(StagingError, match="exists and is a file, not written by megatron-ucp"):
        publish_files(plain, {"a.bin": b"a"}, kind="hf", overwrite=True)


def test_replacement_without_renameat2_falls_back_and_still_replaces(tmp_path, monkeypatch):
    dst = tmp_path / "out"
    publish_files(dst, {"old.bin": b"old"})
    monkeypatch.setattr(staging, "_RENAMEAT2", None)
    publish_files(dst, {"new.bin": b"new"}, overwrite=True)
    assert set(files_of(dst)) == {"new.bin", TOOL_MARKER_FILENAME} and siblings(dst) == ["out"]
    with pytest.raises(StagingError, match="already exists"):
        publish_files(dst, {"x.bin": b"x"})


def test_a_destination_created_behind_the_lock_is_never_replaced(tmp_path):
    """Something that ignores the lock creates DST while the write runs: RENAME_NOREPLACE refuses."""
    dst = tmp_path / "out"
    with pytest.raises(StagingError, match="was created by another program while this write ran"):
        with Staging(dst, kind="hf", report=lambda m: None) as stage:
            (stage.path / "a.bin").write_bytes(b"new")
            dst.mkdir()
            (dst / "theirs.txt").write_text("theirs")
            stage.publish(TOOL_MARKER_FILENAME, tool_marker("hf"))
    assert files_of(dst) == {"theirs.txt": b"theirs"} and siblings(dst) == ["out"]


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "check-then-rename"])
def test_rename_noreplace_never_replaces(tmp_path, monkeypatch, native):
    if not native:
        monkeypatch.setattr(staging, "_RENAMEAT2", None)
    src, full, empty = tmp_path / "src", tmp_path / "full", tmp_path / "empty"
    for d in (src, full, empty):
        d.mkdir()
    (src / "new.bin").write_text("new")
    (full / "theirs.txt").write_text("theirs")
    for target in (full, empty):
        with pytest.raises(FileExistsError):
            staging.rename_noreplace(src, target)
    assert os.listdir(empty) == [] and os.listdir(full) == ["theirs.txt"] and (src / "new.bin").exists()
    staging.rename_noreplace(src, tmp_path / "absent")
    assert (tmp_path / "absent" / "new.bin").read_text() == "new"
    # negative control: a plain rename replaces an empty directory without a word
    os.rename(tmp_path / "absent", empty)
    assert (empty / "new.bin").exists()


# --------------------------------------------------------------------------------------------------
# Killed writers


@pytest.mark.parametrize("point", ["staged", "half", "fsynced", "marker-written", "renaming"])
def test_kill_before_publication_leaves_no_destination_and_the_rerun_reports_then_cleans(
        tmp_path, writer_script, point):
    dst = tmp_path / "out"
    proc = start_writer(writer_script, dst, "K", stop_at=point)
    wait_for_line(proc, point)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not dst.exists()
    [left] = find_leftovers(dst)
    assert left.kind == "staging" and is_staging_path(left.path)
    with pytest.raises(StagingError, match="is the staging directory of a megatron-ucp write"):
        check_not_staging(left.path)
    with pytest.raises(StagingError, match="is the staging directory"):
        check_not_staging(left.path / "part0.bin")
    if point in ("marker-written", "renaming"):  # complete and marked, still never a checkpoint
        assert (left.path / TOOL_MARKER_FILENAME).is_file() and written_by_tool(left.path) is None
    # rerun without --clean-stale: reported (name, size, flag), left alone, the write succeeds
    size = sum(len(b) for b in files_of(left.path).values())
    reports = publish_files(dst, expected_output("R"))
    [report] = reports
    assert report.startswith(f"{dst}: 1 leftover(s) of interrupted megatron-ucp writes hold ")
    assert left.path.name in report and report.endswith("; pass --clean-stale to remove them")
    assert staging._human(size) in report
    assert left.path.exists() and files_of(dst).keys() == set(expected_output("R")) | {TOOL_MARKER_FILENAME}
    # rerun with clean_stale: removed
    reports = publish_files(dst, expected_output("S"), overwrite=True, clean_stale=True)
    assert reports == [f"{dst}: removed 1 leftover(s) of interrupted megatron-ucp writes ({staging._human(size)}): "
                       f"{staging._describe_leftovers([left])}"]
    assert siblings(dst) == ["out"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_kill_during_replacement_is_undone_or_reported_by_the_next_run(tmp_path, writer_script, exchange):
    dst = tmp_path / "out"
    publish_files(dst, expected_output("OLD"))
    proc = start_writer(writer_script, dst, "NEW", stop_at="replaced",
                        flags="overwrite" if exchange else "overwrite,no-renameat2")
    wait_for_line(proc, "replaced")
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    if exchange:  # swapped in one step: DST is the new output, the old one waits under the staging name
        assert json.loads(files_of(dst)[TOOL_MARKER_FILENAME])["writer"] == "NEW"
        [left] = find_leftovers(dst)
        assert left.kind == "staging" and "part0.bin" in files_of(left.path)
    else:  # moved aside, not yet in: DST is missing, the old output is in DST.old-*
        assert not dst.exists()
        kinds = sorted(x.kind for x in find_leftovers(dst))
        assert kinds == ["old", "staging"]
    reports = []
    with Staging(dst, kind="megatron", report=reports.append, clean_stale=True, overwrite=True) as stage:
        if not exchange:  # the interrupted replacement was undone before anything else
            assert reports[0].startswith(f"{dst}: an earlier --overwrite was interrupted after moving the previous "
                                         f"output aside; restored it from {dst.name}.old-")
            assert files_of(dst)["part0.bin"] == expected_output("OLD")["part0.bin"]
        assert reports[-1].startswith(f"{dst}: removed 1 leftover(s)")
        stage.abort()
    assert siblings(dst) == ["out"]


def test_a_stale_directory_of_a_live_pid_on_another_host_is_still_stale(tmp_path):
    """Staleness comes from the lock, not from the pid: a leftover whose recorded pid is alive here (ours)
    but whose lock nobody holds is reported and cleaned."""
    dst = tmp_path / "out"
    left = tmp_path / "out.partial-otherhost-1-0123abcd"
    left.mkdir()
    owner = staging.Owner(os.getpid(), "otherhost", time.time() - 60, "x", str(dst))
    (left / staging.OWNER_FILENAME).write_text(json.dumps(owner.to_json()))
    (left / "big.bin").write_bytes(b"\0" * 3000)
    legacy = tmp_path / "out.partial-4242"  # megatron-ucp 0.1's name, no owner file
    legacy.mkdir()
    reports = publish_files(dst, {"a.bin": b"a"}, clean_stale=True)
    assert len(reports) == 1 and "removed 2 leftover(s)" in reports[0]
    assert f"pid {os.getpid()} on host otherhost" in reports[0]
    assert siblings(dst) == ["out"]


def test_a_live_writer_s_staging_directory_is_never_touched(tmp_path, writer_script):
    dst = tmp_path / "out"
    proc = start_writer(writer_script, dst, "LIVE", stop_at="half")
    wait_for_line(proc, "half")
    try:
        [live] = find_leftovers(dst)
        before = files_of(live.path)
        with pytest.raises(DestinationBusy):
            publish_files(dst, {"a.bin": b"a"}, clean_stale=True, overwrite=True)
        assert files_of(live.path) == before
    finally:
        proc.kill()
        proc.wait(30)


# --------------------------------------------------------------------------------------------------
# Failures inside the block


def test_exceptions_and_interrupts_remove_the_staging_directory_and_release_the_lock(tmp_path):
    dst = tmp_path / "out"
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with Staging(dst, kind="hf", report=lambda m: None) as stage:
                (stage.path / "a.bin").write_bytes(b"a" * 100)
                raise exc
        assert os.listdir(tmp_path) == []
    with Staging(dst, kind="hf") as stage:  # not published: nothing either
        (stage.path / "a.bin").write_bytes(b"a")
    assert os.listdir(tmp_path) == []


def test_an_interrupt_after_the_swap_keeps_the_new_output(tmp_path):
    """KeyboardInterrupt once DST already is the new output (right after RENAME_EXCHANGE): the new output
    stays, the lock is released, the old one waits under the staging name for the next run's report."""
    dst = tmp_path / "out"
    publish_files(dst, {"old.bin": b"old"})

    def interrupt(phase):
        if phase == "replaced":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with Staging(dst, kind="megatron", overwrite=True, on_phase=interrupt, report=lambda m: None) as stage:
            (stage.path / "new.bin").write_bytes(b"new")
            stage.publish(TOOL_MARKER_FILENAME, tool_marker("megatron"))
    assert set(files_of(dst)) == {"new.bin", TOOL_MARKER_FILENAME} and not lock_path(dst).exists()
    [left] = find_leftovers(dst)
    assert set(files_of(left.path)) == {"old.bin", TOOL_MARKER_FILENAME}
    reports = publish_files(dst, {"newer.bin": b"x"}, overwrite=True, clean_stale=True)
    assert "removed 1 leftover(s)" in reports[0] and siblings(dst) == ["out"]


def test_no_space_left_is_reported_in_one_line_and_leaves_nothing(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(StagingError) as e:
        with Staging(dst, kind="universal", report=lambda m: None) as stage:
            (stage.path / "tensors").mkdir()
            (stage.path / "tensors" / "a.safetensors").write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(stage.path / "tensors" / "b.safetensors"))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{dst}: no space left on device while writing ")
    assert "b.safetensors; the partial output was removed (" in message
    assert message.endswith("free now on its filesystem), free space or choose another destination")
    assert os.listdir(tmp_path) == []


@pytest.fixture()
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:  # the injected-ENOSPC test above covers the logic without root
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_disk_leaves_nothing_and_says_so(small_tmpfs):
    dst = small_tmpfs / "out"
    with pytest.raises(StagingError, match="no space left on device; the partial output was removed"):
        with Staging(dst, kind="hf", report=lambda m: None) as stage:
            with open(stage.path / "model.safetensors", "wb") as f:
                for _ in range(4):
                    f.write(b"\0" * (512 << 10))
                    f.flush()
    assert os.listdir(small_tmpfs) == []


# --------------------------------------------------------------------------------------------------
# Staging paths, other ranks


def test_staging_paths_are_recognised_and_ordinary_ones_are_not(tmp_path):
    assert is_staging_path(tmp_path / "ckpt.partial-node-1.cluster-1234-89abcdef")
    assert is_staging_path(tmp_path / "ckpt.partial-1234")  # megatron-ucp 0.1
    assert is_staging_path(tmp_path / "ckpt.partial-1234" / "iter_0000010")
    renamed = tmp_path / "salvaged"
    renamed.mkdir()
    (renamed / staging.OWNER_FILENAME).write_text("{}")
    assert is_staging_path(renamed)  # renamed by hand, still refused
    for name in ("ckpt", "ckpt.partial", "ckpt.partial-x", "partial-1234-ckpt", "ckpt.old-1234"):
        assert not is_staging_path(tmp_path / name), name
    check_not_staging(tmp_path / "ckpt")  # no error


def test_another_process_writes_into_the_owner_s_staging_directory(tmp_path):
    """The torchrun pattern: rank 0 owns lock and staging, passes str(stage.path); another process joins
    it, writes its files and fsyncs them; rank 0 publishes everything."""
    dst = tmp_path / "out"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from megatron_ucp.io.staging import join_staging, fsync_path; "
            "p = join_staging(sys.argv[2]); f = p / 'rank1.bin'; f.write_bytes(b'from rank 1'); fsync_path(f)")
    with Staging(dst, kind="universal", report=lambda m: None) as stage:
        (stage.path / "rank0.bin").write_bytes(b"from rank 0")
        subprocess.run([sys.executable, "-c", code, str(REPO), str(stage.path)], check=True)
        stage.publish("COMPLETE", {"format": "megatron-ucp-universal", "version": 1})
    assert files_of(dst) == {"COMPLETE": files_of(dst)["COMPLETE"], "rank0.bin": b"from rank 0",
                             "rank1.bin": b"from rank 1"}
    with pytest.raises(StagingError, match="not a megatron-ucp staging directory"):
        staging.join_staging(dst)
    with pytest.raises(StagingError, match="is not visible on host"):
        staging.join_staging(tmp_path / "elsewhere.partial-h-1-0123abcd")
