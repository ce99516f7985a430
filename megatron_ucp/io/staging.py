"""Staging and publication of every directory megatron-ucp writes (universal checkpoints, Megatron
checkpoints written by from-universal, Hugging Face exports): one writer per destination, nothing
half-written ever under the destination's name, nothing of the user's ever replaced.

A write to DST goes through `Staging`:

1. Lock. An exclusive `fcntl.flock` on the sibling file `.DST.lock`, held for the whole write. A second
   writer fails at once (`DestinationBusy`, naming the holder's pid, host and start time); it never
   waits and never also succeeds. The holder unlinks the lock file when it is done, so a writer that
   opened the old file re-checks after locking that the path still names the inode it locked.
2. Leftovers. Under the lock, sibling `DST.partial-*` (staging) and `DST.old-*` (replaced outputs)
   directories are leftovers of killed writes: a live writer would hold the lock (pids alone would be
   wrong: pid reuse, other hosts on a shared filesystem). They are reported in one line with their size
   and removed only when asked (`clean_stale=True`, the CLI's `--clean-stale`). A replacement that was
   killed between moving the old output aside and moving the new one in (only possible where the
   kernel lacks RENAME_EXCHANGE) is undone: the old output is renamed back to DST, and reported.
3. Staging. The writer fills `DST.partial-<host>-<pid>-<random>` (its `.megatron-ucp-staging.json`
   names the owner). Other processes (torchrun ranks, Megatron-LM saving for --via-megatron-lm) write into the same
   directory; `join_staging` checks they can see it.
4. Publication (`publish`): every file and directory of the staging tree is fsynced, the owner file
   removed, the writer's completion marker written and fsynced LAST, then the directory is renamed to
   DST with `renameat2(RENAME_NOREPLACE)`: an existing DST is never replaced by accident, whatever
   appeared there meanwhile. With `overwrite`, only an earlier output of the same kind written by this
   tool is replaced (recognised by its marker: a universal checkpoint's `COMPLETE` JSON, otherwise the
   `megatron-ucp.json` file this module writes): `renameat2(RENAME_EXCHANGE)` swaps old and new in one
   step, the old one is renamed to `DST.old-*` and removed. The parent directory is fsynced after each
   rename.
5. Any exception, KeyboardInterrupt included, inside the with-block removes the staging directory and
   releases the lock; a SIGKILL leaves the staging directory, which the next write to DST reports.

Readers call `check_not_staging(path)` before opening anything: a staging directory is never a
checkpoint, whatever it holds (even a killed writer's completion marker).

Write failures whose cause lies outside the tool become one line with the cause and the fix
(`write_failure`): a full disk however the writing library words it (ENOSPC, torch.save's "file write
failed"), and failed allocations. Crash tests stop a writer at a named phase with PAUSE_ENV
(`pause_if_asked`).

Fallbacks (documented, not silent): where renameat2 is missing or refused (non-Linux, NFS answers
EINVAL), publication checks DST under the lock and uses os.rename, and a replacement moves the old
output aside first (a crash in that window is undone by the next run, see 2). flock must work across
the hosts that write to DST: local filesystems and NFS (v4, or v3 with lockd) do; Lustre needs its
`flock` mount option. Where flock is refused the write stops with a message saying so.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

# a universal checkpoint's own marker and entries (docs/FORMAT.md): an output this tool may replace
from megatron_ucp.universal.format import COMPLETE_FILENAME as UNIVERSAL_MARKER_FILENAME
from megatron_ucp.universal.format import FORMAT_NAME as UNIVERSAL_FORMAT
from megatron_ucp.universal.format import METADATA_FILENAME, RNG_FILENAME, TENSORS_DIRNAME

PathLike = Union[str, os.PathLike]

OWNER_FILENAME = ".megatron-ucp-staging.json"  # inside a staging directory, removed before publication
TOOL_MARKER_FILENAME = "megatron-ucp.json"  # completion marker of Megatron checkpoints and HF exports
TOOL_NAME = "megatron-ucp"

# What a write produces; the marker says which, so --overwrite replaces only an output of the same kind.
KINDS = {"universal": "universal checkpoint", "megatron": "Megatron checkpoint", "hf": "Hugging Face export"}

# `DST.partial-<host>-<pid>-<8 hex>`, and `DST.partial-<pid>` of megatron-ucp 0.1 (no lock, no owner file).
_STAGING_SUFFIX = re.compile(r"\.partial-(?:[A-Za-z0-9_.-]+-\d+-[0-9a-f]{8}|\d+)$")
_OLD_SUFFIX = re.compile(r"\.old-(?:[A-Za-z0-9_.-]+-\d+-[0-9a-f]{8}|\d+)$")

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}


class StagingError(Exception):
    """A destination that cannot be written as asked; the message names it, the cause and the fix."""


class DestinationBusy(StagingError):
    """Another megatron-ucp process holds the destination's lock."""


# --------------------------------------------------------------------------------------------------
# Owners and markers


@dataclass(frozen=True)
class Owner:
    """Who writes (or wrote) a destination: kept in the lock file and in the staging directory."""

    pid: int
    host: str
    started: float  # time.time() when the write began
    command: str
    dst: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host} since {when}"

    def to_json(self) -> dict:
        return {"tool": TOOL_NAME, "pid": self.pid, "host": self.host, "started": self.started,
                "command": self.command, "dst": self.dst}

    @staticmethod
    def from_json(data: bytes) -> Optional["Owner"]:
        try:
            d = json.loads(data)
            return Owner(int(d["pid"]), str(d["host"]), float(d["started"]), str(d.get("command", "")),
                         str(d.get("dst", "")))
        except (ValueError, KeyError, TypeError):
            return None


def _this_owner(dst: Path, command: Optional[str]) -> Owner:
    return Owner(os.getpid(), socket.gethostname(), time.time(),
                 command if command is not None else " ".join(sys.argv), str(dst))


def tool_marker(kind: str, **fields) -> bytes:
    """The `megatron-ucp.json` completion marker of a Megatron checkpoint ("megatron") or an HF export
    ("hf"): {"tool": "megatron-ucp", "kind", "version", "written"} plus `fields` (JSON values)."""
    from megatron_ucp import __version__

    if kind not in KINDS or kind == "universal":
        raise ValueError(f"kind {kind!r}: a tool marker is for 'megatron' or 'hf' outputs (universal "
                         f"checkpoints have COMPLETE)")
    doc = {"tool": TOOL_NAME, "kind": kind, "version": __version__,
           "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **fields}
    return (json.dumps(doc, indent=1) + "\n").encode()


# Top-level entries of a universal checkpoint (docs/FORMAT.md); anything else in a folder is not ours.
_UNIVERSAL_ENTRIES = {UNIVERSAL_MARKER_FILENAME, METADATA_FILENAME, TENSORS_DIRNAME, RNG_FILENAME}


def written_by_tool(path: PathLike) -> Optional[str]:
    """The kind ("universal", "megatron", "hf") of a directory that is a complete output of this tool, as
    written; None for anything else (a user's folder, a Megatron-LM checkpoint, a staging directory, a
    folder holding a copied marker). A universal checkpoint: its COMPLETE names this format and the sha256
    of the metadata.json beside it, and it holds nothing the format does not write; a Megatron checkpoint or
    HF export: its marker lists exactly the entries the folder holds."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink() or is_staging_path(path):
        return None
    try:
        entries = set(os.listdir(path))
    except OSError:
        return None
    complete = _json_object(path / UNIVERSAL_MARKER_FILENAME)
    if complete is not None and complete.get("format") == UNIVERSAL_FORMAT:
        if entries <= _UNIVERSAL_ENTRIES and complete.get("metadata_sha256") == _file_sha256(path / "metadata.json"):
            return "universal"
        return None
    marker = _json_object(path / TOOL_MARKER_FILENAME)
    if (marker is not None and marker.get("tool") == TOOL_NAME and marker.get("kind") in KINDS
            and marker.get("entries") == sorted(entries - {TOOL_MARKER_FILENAME})):
        return marker["kind"]
    return None


def _json_object(path: Path, limit: int = 1 << 20) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(limit))
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _file_sha256(path: Path) -> Optional[str]:
    import hashlib

    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# Staging directories are never checkpoints


def is_staging_path(path: PathLike) -> bool:
    """Whether `path` is (or lies inside) a staging directory of an unfinished or killed write: by its
    name `*.partial-<host>-<pid>-<random>` (or 0.1's `*.partial-<pid>`) or by its owner file."""
    path = Path(os.path.abspath(path))
    if any(_STAGING_SUFFIX.search(p.name) for p in (path, *path.parents)):
        return True
    return (path / OWNER_FILENAME).exists()


def check_not_staging(path: PathLike, error: type = StagingError) -> None:
    """Raise `error` (one line) when `path` is a staging directory: readers call this first, so a killed
    writer's directory is refused whatever it holds."""
    path = Path(path)
    if not is_staging_path(path):
        return
    root = next((p for p in (path, *path.absolute().parents) if _STAGING_SUFFIX.search(p.name)), path)
    owner = None
    try:
        owner = Owner.from_json((root / OWNER_FILENAME).read_bytes())
    except OSError:
        pass
    who = f" by {owner.describe()}" if owner else ""
    dst = _STAGING_SUFFIX.sub("", root.name)
    raise error(f"{path}: is the staging directory of a megatron-ucp write{who} to {root.parent / dst} that "
                f"has not finished (or was killed), not a checkpoint, whatever it holds; use "
                f"{root.parent / dst} once the write has finished, or remove it (--clean-stale on the next "
                f"write to {dst})")


# --------------------------------------------------------------------------------------------------
# Renames that never replace by accident


def _renameat2_function():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        return fn
    number = _SYS_RENAMEAT2.get(os.uname().machine)
    if number is None or not hasattr(libc, "syscall"):
        return None
    return lambda a, s, b, d, flags: libc.syscall(number, a, s, b, d, flags)


try:
    _RENAMEAT2 = _renameat2_function() if sys.platform.startswith("linux") else None
except OSError:  # no libc to load
    _RENAMEAT2 = None


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(src, dst, flags); False when the kernel or filesystem does not support the flags (the
    caller falls back), OSError for real failures (EEXIST, ENOENT, ...)."""
    if _RENAMEAT2 is None:
        return False
    rc = _RENAMEAT2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def rename_noreplace(src: PathLike, dst: PathLike) -> None:
    """Rename `src` to `dst`, failing with FileExistsError if `dst` exists (atomically with
    RENAME_NOREPLACE; where unsupported, by a check before os.rename, which the caller's lock makes
    safe against other megatron-ucp writers)."""
    src, dst = Path(src), Path(dst)
    if _renameat2(src, dst, RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def rename_exchange(a: PathLike, b: PathLike) -> bool:
    """Swap two existing paths atomically (RENAME_EXCHANGE); False where unsupported."""
    return _renameat2(Path(a), Path(b), RENAME_EXCHANGE)


# --------------------------------------------------------------------------------------------------
# fsync


def fsync_path(path: PathLike) -> None:
    """fsync one file or directory by path (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EROFS):  # directories on some filesystems refuse fsync
            raise
    finally:
        os.close(fd)


def fsync_tree(root: PathLike, workers: int = 8) -> int:
    """fsync every file under `root` (in parallel: fsync releases the GIL and the filesystem batches the
    journal commits), then every directory bottom-up; returns the number of files."""
    files, dirs = [], []
    for here, subdirs, names in os.walk(root):
        dirs.append(here)
        files.extend(os.path.join(here, n) for n in names)
    if files:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(files)))) as pool:
            list(pool.map(fsync_path, files))
    for d in reversed(dirs):
        fsync_path(d)
    return len(files)


def _write_durable(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# The destination lock


def lock_path(dst: PathLike) -> Path:
    """The sibling lock file of `dst`: `.NAME.lock` in its parent."""
    dst = _normalise(dst)
    return dst.parent / f".{dst.name}.lock"


def _normalise(dst: PathLike) -> Path:
    """DST with its parent resolved, so every spelling of one destination names one lock."""
    dst = Path(os.path.abspath(dst))
    parent = dst.parent.resolve() if dst.parent.exists() else dst.parent
    return parent / dst.name


def _read_holder(fd: int) -> Optional[Owner]:
    for _ in range(20):  # the holder writes its name right after locking: wait for it briefly
        owner = Owner.from_json(os.pread(fd, 1 << 16, 0))
        if owner is not None:
            return owner
        time.sleep(0.01)
    return None


class DestinationLock:
    """The exclusive lock of one destination (flock on `.DST.lock`); the file holds the owner's JSON."""

    def __init__(self, dst: PathLike, owner: Owner):
        self.dst = _normalise(dst)
        self.path = lock_path(self.dst)
        self.owner = owner
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                who = holder.describe() if holder else "holder unknown"
                raise DestinationBusy(
                    f"{self.dst}: is being written by another megatron-ucp process ({who}); wait for it or "
                    f"choose another destination") from None
            except OSError as e:
                os.close(fd)
                raise StagingError(
                    f"{self.dst}: cannot lock {self.path} ({e.strerror}): the filesystem does not support "
                    f"flock (Lustre: mount with -o flock); write to a filesystem that does") from None
            st = os.fstat(fd)
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(self.owner.to_json()).encode(), 0)
                self._fd = fd
                return
            os.close(fd)  # the previous holder unlinked it after we opened it: lock the new file
        raise StagingError(f"{self.path}: the lock file keeps being replaced; is another program deleting it?")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: a waiter that opened it re-checks the inode
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


# --------------------------------------------------------------------------------------------------
# Leftovers of killed writes


@dataclass(frozen=True)
class Leftover:
    """A sibling directory left by an interrupted write to DST."""

    path: Path
    kind: str  # "staging" (unfinished output) or "old" (a replaced output not yet removed)
    nbytes: int
    owner: Optional[Owner]


def _tree_bytes(path: Path) -> int:
    total = 0
    for here, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(here, n)).st_size
            except OSError:
                pass
    return total


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024
    return f"{nbytes} B"


def find_leftovers(dst: PathLike) -> list[Leftover]:
    """Staging and replaced-output directories of DST's earlier writes, by name. Only meaningful to the
    holder of DST's lock (then no live writer owns any of them)."""
    dst = _normalise(dst)
    out = []
    try:
        names = sorted(os.listdir(dst.parent))
    except FileNotFoundError:
        return out
    for name in names:
        if not name.startswith(dst.name + "."):
            continue
        rest = name[len(dst.name):]
        kind = "staging" if _STAGING_SUFFIX.fullmatch(rest) else "old" if _OLD_SUFFIX.fullmatch(rest) else None
        path = dst.parent / name
        if kind is None or not path.is_dir() or path.is_symlink():
            continue
        try:
            owner = Owner.from_json((path / OWNER_FILENAME).read_bytes())
        except OSError:
            owner = None
        out.append(Leftover(path, kind, _tree_bytes(path), owner))
    return out


def _describe_leftovers(leftovers: list[Leftover]) -> str:
    parts = []
    for left in leftovers:
        what = "unfinished output" if left.kind == "staging" else "replaced output"
        who = f" of {left.owner.describe()}" if left.owner else ""
        parts.append(f"{left.path.name} ({what}{who}, {_human(left.nbytes)})")
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------------
# The staged write


def check_destination(dst: PathLike, kind: str, overwrite: bool = False) -> None:
    """Raise StagingError unless `dst` may be written as `kind`: absent, or with overwrite an empty
    directory or an earlier output of the same kind written by this tool. Staging applies it under the
    lock; writers may call it early (no lock) to fail before long work."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {sorted(KINDS)}")
    dst = Path(dst)
    if not os.path.lexists(dst):
        return
    if not overwrite:
        raise StagingError(f"{dst}: already exists; choose another destination, or pass --overwrite to "
                           f"replace an earlier {KINDS[kind]} written by megatron-ucp")
    if dst.is_symlink() or not dst.is_dir():
        raise StagingError(f"{dst}: exists and is {'a symbolic link' if dst.is_symlink() else 'a file'}, not "
                           f"written by megatron-ucp; refusing to overwrite it, delete it yourself or choose "
                           f"another destination")
    found = written_by_tool(dst)
    if found == kind or not any(dst.iterdir()):
        return
    if found is not None:
        raise StagingError(f"{dst}: is a {KINDS[found]} written by megatron-ucp, not a {KINDS[kind]}; refusing "
                           f"to overwrite it with another kind of output, delete it yourself or choose another "
                           f"destination")
    marker = UNIVERSAL_MARKER_FILENAME if kind == "universal" else TOOL_MARKER_FILENAME
    if (dst / UNIVERSAL_MARKER_FILENAME).exists() or (dst / TOOL_MARKER_FILENAME).exists():
        raise StagingError(f"{dst}: exists and is not a complete output of megatron-ucp as it was written (a marker "
                           f"without the files it seals, or with files megatron-ucp did not write); refusing to "
                           f"overwrite it, delete it yourself or choose another destination")
    raise StagingError(f"{dst}: exists and was not written by megatron-ucp (no {marker} marker of a "
                       f"{KINDS[kind]}); refusing to overwrite it, delete it yourself or choose another "
                       f"destination")


def _stderr_report(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class Staging:
    """One locked, staged write of the directory `dst`; see the module docstring.

        with Staging(dst, kind="universal", overwrite=False, clean_stale=False) as stage:
            ... write files under stage.path (other processes too: pass them str(stage.path)) ...
            stage.publish("COMPLETE", marker_bytes)        # fsync, marker last, atomic rename

    Leaving the block without publish() (an exception, KeyboardInterrupt, or simply not publishing)
    removes the staging directory. `report` receives the one-line notes about leftovers (default:
    stderr); `on_phase` is called with "staged", "fsynced", "marker-written", "renaming", "replaced",
    "published" as publication proceeds, and with the writer's own points (`phase()`, e.g. "half-written"):
    progress display, and the points crash tests stop the writer at (PAUSE_ENV).
    """

    def __init__(self, dst: PathLike, *, kind: str, overwrite: bool = False, clean_stale: bool = False,
                 report: Optional[Callable[[str], None]] = None, command: Optional[str] = None,
                 on_phase: Optional[Callable[[str], None]] = None, fsync_workers: int = 8):
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: one of {sorted(KINDS)}")
        self.dst = _normalise(dst)
        self.kind = kind
        self.overwrite = overwrite
        self.clean_stale = clean_stale
        self.report = report or _stderr_report
        self.on_phase = on_phase or (lambda phase: None)
        self.fsync_workers = fsync_workers
        self.owner = _this_owner(self.dst, command)
        token = f"{_host_token()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = self.dst.parent / f"{self.dst.name}.partial-{token}"
        self._old = self.dst.parent / f"{self.dst.name}.old-{token}"
        self._lock = DestinationLock(self.dst, self.owner)
        self.leftovers: tuple[Leftover, ...] = ()
        self.published = False
        self._dst_existed = False

    def phase(self, name: str) -> None:
        """A point of the write was reached: tell on_phase, and pause here when PAUSE_ENV asks to."""
        self.on_phase(name)
        pause_if_asked(name)

    # -- entry ------------------------------------------------------------------------------------

    def __enter__(self) -> "Staging":
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        try:
            self._handle_leftovers()
            check_destination(self.dst, self.kind, self.overwrite)
            self._dst_existed = os.path.lexists(self.dst)
            self.path.mkdir()
            _write_durable(self.path / OWNER_FILENAME, json.dumps(self.owner.to_json()).encode())
            fsync_path(self.dst.parent)
        except BaseException as e:
            failure = self._explain(e)
            self._discard()
            if failure is not None:
                raise failure.finish() from e
            raise
        self.phase("staged")
        return self

    def _handle_leftovers(self) -> None:
        leftovers = find_leftovers(self.dst)
        dst_exists = os.path.lexists(self.dst)
        olds = [x for x in leftovers if x.kind == "old"]
        if not dst_exists and len(olds) == 1:
            # Killed between moving the old output aside and moving the new one in: undo.
            rename_noreplace(olds[0].path, self.dst)
            fsync_path(self.dst.parent)
            self.report(f"{self.dst}: an earlier --overwrite was interrupted after moving the previous output "
                        f"aside; restored it from {olds[0].path.name}")
            leftovers = [x for x in leftovers if x is not olds[0]]
        self.leftovers = tuple(leftovers)
        if not leftovers:
            return
        total = _human(sum(x.nbytes for x in leftovers))
        listed = _describe_leftovers(leftovers)
        if not self.clean_stale:
            self.report(f"{self.dst}: {len(leftovers)} leftover(s) of interrupted megatron-ucp writes hold "
                        f"{total}: {listed}; pass --clean-stale to remove them")
            return
        for left in leftovers:
            shutil.rmtree(left.path)
        fsync_path(self.dst.parent)
        self.report(f"{self.dst}: removed {len(leftovers)} leftover(s) of interrupted megatron-ucp writes "
                    f"({total}): {listed}")

    # -- publication ------------------------------------------------------------------------------

    def publish(self, marker_name: str, marker: Union[bytes, str, dict]) -> Path:
        """Make the staged output DST: fsync every file and directory, write `marker_name` (the writer's
        completion marker) last, rename into place without replacing anything but (with overwrite) an
        earlier output of this kind. Returns DST. On failure the staging directory is removed."""
        if self.published or not self._lock.held:
            raise StagingError(f"{self.dst}: publish() outside an open Staging block, or twice")
        if isinstance(marker, dict):
            marker = json.dumps(marker, indent=1) + "\n"
        if isinstance(marker, str):
            marker = marker.encode()
        if os.sep in marker_name or marker_name in (OWNER_FILENAME, "", ".", ".."):
            raise ValueError(f"marker name {marker_name!r}: a plain file name")
        try:
            fsync_tree(self.path, self.fsync_workers)
            self.phase("fsynced")
            os.unlink(self.path / OWNER_FILENAME)
            if marker_name == TOOL_MARKER_FILENAME:  # what --overwrite may replace later: exactly these
                doc = json.loads(marker)
                doc["entries"] = sorted(set(os.listdir(self.path)) - {marker_name})
                marker = (json.dumps(doc, indent=1) + "\n").encode()
            _write_durable(self.path / marker_name, marker)
            fsync_path(self.path)
            self.phase("marker-written")
            self._rename_into_place()
        except BaseException as e:
            if self.published:  # DST is already the new output: leave what remains to the next run's report
                self._lock.release()
                raise
            failure = self._explain(e)
            self._discard()
            if failure is not None:
                raise failure.finish() from e
            raise
        try:
            self._remove_old()
        finally:
            self._lock.release()
        self.phase("published")
        return self.dst

    def _remove_old(self) -> None:
        """Remove the replaced output (DST is already the new one: a failure here is reported, not raised)."""
        if not os.path.lexists(self._old):
            return
        shutil.rmtree(self._old, ignore_errors=True)
        if os.path.lexists(self._old):
            self.report(f"{self.dst}: written, but the replaced output {self._old} could not be removed entirely; "
                        f"delete it yourself (or pass --clean-stale next time)")

    def _rename_into_place(self) -> None:
        self.phase("renaming")
        if not os.path.lexists(self.dst):
            try:
                rename_noreplace(self.path, self.dst)
            except FileExistsError:
                raise StagingError(f"{self.dst}: was created by another program while this write ran (it "
                                   f"does not take megatron-ucp's lock); refusing to replace it, the new output "
                                   f"was removed; choose another destination") from None
            self.published = True
            fsync_path(self.dst.parent)
            return
        if not self._dst_existed:
            raise StagingError(f"{self.dst}: was created by another program while this write ran (it does not "
                               f"take megatron-ucp's lock); refusing to replace it, the new output was removed; "
                               f"choose another destination")
        check_destination(self.dst, self.kind, self.overwrite)  # again: it may have changed meanwhile
        if rename_exchange(self.path, self.dst):
            self.published = True
            fsync_path(self.dst.parent)
            self.phase("replaced")
            os.rename(self.path, self._old)  # the staging name now holds the old output
        else:  # no RENAME_EXCHANGE: move aside, then in (a crash between is undone by the next run)
            os.rename(self.dst, self._old)
            fsync_path(self.dst.parent)
            self.phase("replaced")
            try:
                rename_noreplace(self.path, self.dst)
            except BaseException:
                os.rename(self._old, self.dst)  # put the old output back before giving up
                raise
            self.published = True
        fsync_path(self.dst.parent)

    # -- exit -------------------------------------------------------------------------------------

    def _discard(self) -> None:
        try:
            shutil.rmtree(self.path, ignore_errors=True)
            if self.path.exists():  # e.g. files written read-only by another program: one more try, loudly
                shutil.rmtree(self.path)
        finally:
            self._lock.release()

    def _explain(self, e: BaseException) -> Optional[StagingError]:
        """One line for a write that failed for a reason outside the tool (a full disk, however the writing
        library words it; memory), with the cause and the fix; None for any other error (raised as is).
        Called before the staging directory is removed, so a full disk is recognised as full."""
        kind, detail = write_failure(e)
        if kind is None:
            return None
        try:
            free_before = shutil.disk_usage(self.dst.parent).free
        except OSError:
            free_before = None
        if kind == "write" and free_before is not None and free_before >= _NEARLY_FULL:
            return None  # torch.save failed with room to spare: not ours to explain, raise it as it is
        return _Explained(self.dst, kind, detail)

    def abort(self) -> None:
        """Remove the staging directory and release the lock (DST is untouched)."""
        if not self.published:
            self._discard()

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.published:
            return
        failure = self._explain(exc) if exc is not None else None
        self._discard()
        if isinstance(failure, _Explained):
            raise failure.finish() from exc


_NEARLY_FULL = 64 << 20  # free bytes under which a failed torch.save write is taken for a full disk
_ALLOCATION = re.compile(r"(?:tried to allocate|allocate memory:?[^0-9]*)\s*([0-9]+) bytes")


def write_failure(e: Optional[BaseException]) -> tuple[Optional[str], Optional[str]]:
    """Why a write failed when the cause lies outside the tool: ("space", file or None) for ENOSPC/EDQUOT
    anywhere in the exception's chain (or its text, as safetensors reports it), ("write", None) for
    torch.save's zip writer failing (it words a full
    disk as "file write failed" / "inline_container.cc ... unexpected pos"), ("memory", bytes or None) for
    an allocation that failed (MemoryError, torch's "DefaultCPUAllocator: can't allocate memory"); else
    (None, None)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return "space", e.filename
        if isinstance(e, MemoryError):
            return "memory", None
        text = str(e)
        if "No space left on device" in text or "os error 28" in text or "StorageFull" in text:
            return "space", None  # libraries that wrap the OSError in their own type (safetensors)
        if isinstance(e, RuntimeError):
            if "can't allocate memory" in text or "not enough memory" in text or "DefaultCPUAllocator" in text:
                m = _ALLOCATION.search(text)
                return "memory", m.group(1) if m else None
            if "file write failed" in text or "inline_container" in text or "PytorchStreamWriter" in text:
                return "write", None
        e = e.__cause__ or e.__context__
    return None, None


class _Explained(StagingError):
    """A write failure explained in one line (see write_failure); the free space is measured once the
    partial output is gone (finish())."""

    def __init__(self, dst: Path, kind: str, detail: Optional[str]):
        super().__init__(f"{dst}: {kind}")
        self.dst, self.kind, self.detail = dst, kind, detail

    def finish(self) -> StagingError:
        try:
            free = _human(shutil.disk_usage(self.dst.parent).free)
        except OSError:
            free = "unknown"
        if self.kind == "memory":
            need = f" (an allocation of {_human(int(self.detail))} failed)" if self.detail else ""
            return StagingError(f"{self.dst}: out of memory while writing{need}; the partial output was removed, "
                                f"free memory (other jobs) or run on a machine with more")
        where = f" while writing {self.detail}" if self.kind == "space" and self.detail else ""
        via = " (torch.save could not write its zip file)" if self.kind == "write" else ""
        return StagingError(f"{self.dst}: no space left on device{where}{via}; the partial output was removed "
                            f"({free} free now on its filesystem), free space or choose another destination")


# --------------------------------------------------------------------------------------------------
# Pausing at a phase (crash tests)

PAUSE_ENV = "MEGATRON_UCP_PAUSE_AT"  # "PHASE:FIFO": at PHASE, write "PHASE PID" to FIFO, then wait
PAUSE_SECONDS = 600.0


def pause_if_asked(phase: str) -> None:
    """Fault injection for crash and concurrency tests: when PAUSE_ENV is "PHASE:FIFO" and `phase` is
    PHASE, announce "PHASE PID" on the fifo (blocks until the test reads it), then wait until the file
    FIFO.go exists (the test lets the write go on) or PAUSE_SECONDS pass; meanwhile the test may kill
    the process at exactly this point (kill -9). Without the variable (always, outside tests) this does
    nothing."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    want, _, fifo = spec.partition(":")
    if phase != want or not fifo:
        return
    with open(fifo, "w") as f:
        f.write(f"{phase} {os.getpid()}\n")
    deadline = time.monotonic() + PAUSE_SECONDS
    while not os.path.exists(fifo + ".go") and time.monotonic() < deadline:
        time.sleep(0.02)


def _host_token() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def join_staging(path: PathLike) -> Path:
    """For processes that write into a staging directory another process owns (torchrun ranks > 0, the
    Megatron-LM saving for --via-megatron-lm): check it is one and is visible here, and return it."""
    path = Path(path)
    if not _STAGING_SUFFIX.search(path.name):
        raise StagingError(f"{path}: not a megatron-ucp staging directory; pass Staging.path of the owning process")
    if not (path / OWNER_FILENAME).is_file():
        raise StagingError(f"{path}: the staging directory is not visible on host {socket.gethostname()}; every "
                           f"process of the job must see DST's parent directory (a shared filesystem)")
    return path
