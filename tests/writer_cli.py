"""Running the `megatron-ucp` writers as a user does (a subprocess per command), and what every failed
write must leave behind: the tests of bad inputs, crashes and `check` share these.

- `cli(...)`: the command, its exit code, stdout and stderr;
- `assert_one_line_error(proc, *needles)`: exit 1, stderr one `error:` line (warnings before it allowed)
  holding every needle, no traceback;
- `tree_digest(path)`: sha256 of every file under `path` (inputs must not change);
- `assert_nothing_left(dst)`: no DST, no `DST.partial-*` / `DST.old-*`, no lock file;
- `Paused`: a command stopped at a named phase (staging.PAUSE_ENV), to be killed or let go on.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
C_FIXTURE = REPO / "tests" / "fixtures" / "megatron-lm" / "C_gpt2_tp2pp2dp1_adam_torch" / "ckpt"
B_FIXTURE = REPO / "tests" / "fixtures" / "megatron-lm" / "B_llama_tp2pp2dp2_distopt_sp_torch_dist" / "ckpt"
PAUSE_ENV = "MEGATRON_UCP_PAUSE_AT"  # megatron_ucp.io.staging.PAUSE_ENV


def env(**extra: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)


def command(*args) -> list[str]:
    return [sys.executable, "-m", "megatron_ucp.cli", *map(str, args)]


def cli(*args, timeout: float = 300, extra_env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), cwd=REPO, env=env(**(extra_env or {})), capture_output=True, text=True,
                          timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str, code: int = 1) -> str:
    """The error line (without "error: "), after checking the exit code, the one line, no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    others = [line for line in lines if not line.startswith(("error: ", "warning: "))]
    assert len(errors) == 1 and not others, proc.stderr
    message = errors[0][len("error: "):]
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def tree_digest(path: Path) -> dict:
    """{relative path: sha256} of every file (symlinks by their target) under `path`, or of `path` itself."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() or p.is_symlink())
    out = {}
    for f in files:
        rel = "." if f == path else str(f.relative_to(path))
        out[rel] = ("link:" + os.readlink(f)) if f.is_symlink() else hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def leftovers(dst: Path) -> list[str]:
    """Names next to DST a write may create: its staging and replaced-output directories, its lock file."""
    dst = Path(dst)
    if not dst.parent.exists():
        return []
    return sorted(p.name for p in dst.parent.iterdir()
                  if p.name.startswith(dst.name + ".partial-") or p.name.startswith(dst.name + ".old-")
                  or p.name == f".{dst.name}.lock")


def assert_nothing_left(dst: Path, *, existed: Optional[dict] = None) -> None:
    """No output (or the earlier one, unchanged: `existed` is its tree_digest) and no leftovers."""
    dst = Path(dst)
    if existed is None:
        assert not os.path.lexists(dst), f"{dst} was created"
    else:
        assert tree_digest(dst) == existed, f"{dst} was changed"
    assert leftovers(dst) == [], leftovers(dst)


def flip_bit(path: Path, offset: int, bit: int = 0, keep_mtime: bool = False) -> None:
    """Flip one bit of a file in place (keep_mtime: restore its timestamps, as a silent corruption would)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


class Paused:
    """`megatron-ucp ARGS` started with PAUSE_ENV = "PHASE:FIFO": `wait()` returns once the command reached
    PHASE (it then waits), after which the test kills it (`kill()`, SIGKILL) or lets it go on (`resume()`)."""

    def __init__(self, tmp: Path, phase: str, *args, extra_env: Optional[dict] = None):
        self.fifo = Path(tmp) / f"pause-{phase}-{time.monotonic_ns()}"
        os.mkfifo(self.fifo)
        self._fd = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)  # before the writer opens it: no blocking
        self.phase = phase
        self.proc = subprocess.Popen(command(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env(**{PAUSE_ENV: f"{phase}:{self.fifo}"}, **(extra_env or {})))

    def wait(self, timeout: float = 240) -> int:
        """Block until the command announces the phase; its pid."""
        deadline, data = time.monotonic() + timeout, b""
        try:
            while time.monotonic() < deadline:
                select.select([self._fd], [], [], 0.1)
                try:
                    chunk = os.read(self._fd, 4096)
                except BlockingIOError:
                    chunk = b""
                data += chunk
                if data.endswith(b"\n"):
                    phase, pid = data.decode().split()
                    assert phase == self.phase
                    return int(pid)
                if not chunk and self.proc.poll() is not None:
                    out, err = self.proc.communicate()
                    raise AssertionError(f"exited {self.proc.returncode} before phase {self.phase}: {err[-2000:]}")
                if not chunk:
                    time.sleep(0.05)
            raise AssertionError(f"phase {self.phase} not reached in {timeout} s")
        finally:
            os.close(self._fd)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=60)
        assert self.proc.returncode == -signal.SIGKILL

    def resume(self, timeout: float = 300) -> subprocess.CompletedProcess:
        Path(f"{self.fifo}.go").touch()
        out, err = self.proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)


def copy_of(path: Path, tmp_path: Path, name: str = "input") -> Path:
    shutil.copytree(path, tmp_path / name, symlinks=True)
    return tmp_path / name


def reseal(ucp_dir: Path) -> None:
    """Recompute COMPLETE's metadata_sha256 after an edit of metadata.json (what a deliberate edit does)."""
    marker = json.loads((ucp_dir / "COMPLETE").read_text())
    marker["metadata_sha256"] = hashlib.sha256((ucp_dir / "metadata.json").read_bytes()).hexdigest()
    (ucp_dir / "COMPLETE").write_text(json.dumps(marker))


def edit_metadata(ucp_dir: Path, edit) -> None:
    """Edit a universal checkpoint's metadata.json in place and reseal it."""
    meta = json.loads((ucp_dir / "metadata.json").read_text())
    edit(meta)
    (ucp_dir / "metadata.json").write_text(json.dumps(meta, indent=1))
    reseal(ucp_dir)
