"""Measuring a command for the benchmarks and performance tests: wall time, peak memory of its whole
process tree, the bytes it read and wrote, and when chosen lines of its output appeared.

- Bytes: deltas of this process's /proc/self/io around the run. Linux adds a reaped child's counters
  (and those its own children added) to its parent's, so after waiting for the command they cover
  the whole tree, including processes that came and went between samples (torchrun workers, the
  processes of a torchrun conversion). `read_bytes`/`write_bytes` are bytes the storage layer fetched or was
  sent (page-cache hits are not reads, so drop the cache first for a cold measurement; mmap faults
  count); `rchar`/`wchar` are bytes through read()/write() system calls, page cache or not (pipes
  included, mmap excluded).
- Memory: a sampling thread sums RSS and PSS over the root and its live descendants every
  `interval_s`; the peak of each sum is reported. RSS counts shared pages (libraries, mmapped
  files) once per process; PSS splits them, so it is the honest "machine memory used".
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

import psutil

IO_FIELDS = ("read_bytes", "write_bytes", "rchar", "wchar")


def self_io() -> Dict[str, int]:
    """This process's /proc/self/io counters (reaped descendants included)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return {k: out.get(k, 0) for k in IO_FIELDS}


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeMemorySampler(threading.Thread):
    """Samples the summed RSS and PSS of a process and its descendants until stop()."""

    def __init__(self, pid: int, interval_s: float = 0.1, pss: bool = True):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.pss = pss
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_procs = 0
        self._done = threading.Event()

    def sample(self) -> None:
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except psutil.Error:
            return
        rss = pss = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                continue
            if self.pss:
                pss += _pss_bytes(p.pid)
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_procs = max(self.peak_procs, len(procs))

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval_s)

    def stop(self) -> None:
        self._done.set()
        self.join()


@dataclass
class RunStats:
    """What one measured command cost. `marks`: seconds after start at which each named output line
    first appeared (None if it never did)."""

    name: str
    wall_s: float
    peak_rss_bytes: int
    peak_pss_bytes: int
    peak_processes: int
    read_bytes: int
    write_bytes: int
    rchar: int
    wchar: int
    returncode: int
    marks: Dict[str, Optional[float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class CommandFailed(RuntimeError):
    pass


def run_measured(name: str, cmd: Sequence[str], *, log_path: Path, cwd: Optional[Path] = None,
                 env: Optional[Mapping[str, str]] = None, marks: Optional[Mapping[str, str]] = None,
                 timeout_s: float = 3600, interval_s: float = 0.1, check: bool = True) -> RunStats:
    """Run `cmd`, streaming its merged stdout/stderr into `log_path`, and measure it (see module doc).

    `marks` maps a name to a regex; the time of the first output line matching it is recorded, e.g. the
    first training iteration's log line."""
    patterns = {k: re.compile(v) for k, v in (marks or {}).items()}
    found: Dict[str, Optional[float]] = {k: None for k in patterns}
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    io_before = self_io()
    start = time.perf_counter()
    # Its own process group: when the command exits (or times out), leftovers (e.g. a torchrun worker
    # orphaned by an OOM kill, which would hold the output pipe open) are killed with it.
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=dict(env) if env is not None else None,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)
    sampler = TreeMemorySampler(proc.pid, interval_s)
    sampler.start()

    def read_output():
        with open(log_path, "w") as log:
            for line in proc.stdout:
                now = time.perf_counter() - start
                log.write(line)
                for key, pattern in patterns.items():
                    if found[key] is None and pattern.search(line):
                        found[key] = round(now, 3)

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    try:
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = -9
    finally:
        _kill_group(proc.pid)
        proc.wait()
        reader.join(timeout=30)
        sampler.stop()
    wall = time.perf_counter() - start
    io_after = self_io()
    stats = RunStats(name=name, wall_s=round(wall, 3), peak_rss_bytes=sampler.peak_rss,
                     peak_pss_bytes=sampler.peak_pss, peak_processes=sampler.peak_procs,
                     returncode=returncode, marks=found,
                     **{k: io_after[k] - io_before[k] for k in IO_FIELDS})
    if check and returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise CommandFailed(f"{name}: {' '.join(cmd)} exited {returncode}; log {log_path}:\n{tail}")
    return stats


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def drop_page_cache() -> bool:
    """sync and drop the page cache (needs root and a writable /proc/sys/vm/drop_caches); False if not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dir_bytes(path: Path) -> int:
    """Bytes of all regular files under `path`."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
