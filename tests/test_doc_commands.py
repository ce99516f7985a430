"""Every command block of README.md and docs/*.md runs as written (docs/TESTING.md, "The documented commands").

What runs: every ```bash block, pasted verbatim into one bash session with `set -euo pipefail` (a failing
command or an unset variable fails the test), so the shell variables a block sets serve the blocks after it:
the walkthrough's `M="..."` (a tiny model on the embedded corpus) is what the later journeys train. Order:
docs/USAGE.md first, whose walkthrough trains `ckpt/`, the Megatron checkpoint every journey starts from; then
README.md, docs/TRAINING.md and the other pages by name. The blocks under one heading share a directory; each
heading starts a fresh one holding a copy of the walkthrough's `ckpt/` and links to the checkout's
`pretrain_scripts/`, `tools/` and `tests/` (the commands are written from the checkout's root).

What does not: a block whose first line is `# not run by the docs test: <why>` (GPUs, several nodes, a model
to download, the suite itself). How many blocks of each kind there are is pinned (RUN, MARKED), so a block
that stops being found or is newly marked fails the test until the count is changed with it.

`torchrun` in the session is the suite's launcher, not torchrun's 10 s of imports per rank: a shell function
that hands its arguments, directory and environment to this process, which forks each rank from the suite's
fork server (tests/zygote.py) with the environment torchrun gives, in the directory the command was typed in
(tests/doc_torchrun_rank.py). With MEGATRON_UCP_TEST_TORCHRUN=1 it is torchrun itself.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import pytest

import zygote
from pretrain_runs import TORCHRUN_TIMEOUT_S

REPO = Path(__file__).resolve().parents[1]
FIRST_DOCS = ("docs/USAGE.md", "README.md", "docs/TRAINING.md")  # then every other docs/*.md by name
MARKER = "# not run by the docs test: "
SEED = "ckpt"  # the walkthrough's Megatron checkpoint: every later heading's directory starts with a copy
LINKED = ("pretrain_scripts", "tools", "tests")
RUN, MARKED = 14, 5  # blocks run, blocks marked
# A command in a fence the test does not run (```sh, ```console, no language): a block it would silently miss.
COMMAND_LINE = re.compile(r"^\s*(megatron-ucp|torchrun|python|make)\s", re.M)
BEGIN, END = "@@docs-test begin ", "@@docs-test end "
SESSION_TIMEOUT_S = 1200

# The session's torchrun: arguments, directory and environment to the launcher thread, its exit status and the
# path of the run's log back; the log printed as torchrun would print the ranks' output.
TORCHRUN_FUNCTION = """\
torchrun() {
    { printf '%s\\0' "$PWD" "$#" "$@"; env -0; } > "$DOCS_TORCHRUN_REQUEST"
    local rc log
    read -r rc log < "$DOCS_TORCHRUN_REPLY"
    cat "$log"
    return "$rc"
}
"""


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence
    heading: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def skip_reason(self) -> Optional[str]:
        first = self.text.splitlines()[0] if self.text.strip() else ""
        return first[len(MARKER):].strip() if first.startswith(MARKER) else None


def doc_paths() -> List[str]:
    others = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
    return [*FIRST_DOCS, *(p for p in others if p not in FIRST_DOCS)]


def fences(doc: str) -> Iterator[Tuple[str, int, str, str]]:
    """(language, line of the opening fence, the heading above it, text) of every fenced block of `doc`."""
    heading, language, start, body = "", None, 0, []
    for n, line in enumerate((REPO / doc).read_text(encoding="utf-8").splitlines(), 1):
        if language is None:
            if line.lstrip().startswith("```"):
                language, start, body = line.lstrip()[3:].strip(), n, []
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
        elif line.lstrip().startswith("```"):
            yield language, start, heading, "\n".join(body) + "\n"
            language = None
        else:
            body.append(line)
    assert language is None, f"{doc}:{start}: a fence that is never closed"


def command_blocks() -> List[Block]:
    blocks = []
    for doc in doc_paths():
        for language, line, heading, text in fences(doc):
            if language == "bash":
                blocks.append(Block(doc, line, heading, text))
            else:
                assert not COMMAND_LINE.search(text), \
                    f"{doc}:{line}: commands in a ```{language} block, which this test does not run: make it ```bash"
    return blocks


# --- the session's torchrun -----------------------------------------------------------------------------------

class LaunchError(ValueError):
    pass


def torchrun_command(argv: Sequence[str]) -> Tuple[int, str, List[str]]:
    """(processes, script, its arguments) of `torchrun ARGV`: one node, a script (what the docs run here)."""
    nproc, i = 1, 0
    while i < len(argv) and argv[i].startswith("-"):
        option, _, value = argv[i].partition("=")
        if option in ("--nproc-per-node", "--nproc_per_node"):
            if not value:
                i += 1
                value = argv[i]
            nproc = int(value)
        elif option != "--standalone":
            raise LaunchError(f"torchrun {argv[i]}: the docs test launches one-node runs of a script only; mark "
                              f"the block '{MARKER}<why>'")
        i += 1
    if i == len(argv):
        raise LaunchError("torchrun without a script")
    return nproc, argv[i], list(argv[i + 1:])


class Launcher(threading.Thread):
    """Serves the session's `torchrun` (TORCHRUN_FUNCTION) through two named pipes."""

    def __init__(self, work: Path):
        super().__init__(daemon=True)
        self.request, self.reply, self.logs = work / "torchrun.request", work / "torchrun.reply", work / "runs"
        os.mkfifo(self.request)
        os.mkfifo(self.reply)
        self.logs.mkdir()

    def env(self) -> dict:
        return {"DOCS_TORCHRUN_REQUEST": str(self.request), "DOCS_TORCHRUN_REPLY": str(self.reply)}

    def run(self) -> None:
        for n in itertools.count(1):
            with open(self.request, "rb") as f:
                request = f.read()
            if not request:  # stop()
                return
            log = self.logs / f"torchrun{n:03d}.log"
            try:
                rc = self.launch(request, log)
            except Exception as e:  # noqa: BLE001 - the session waits for a reply: the failure goes to the log
                log.write_text(f"docs test: {type(e).__name__}: {e}\n")
                rc = 1
            with open(self.reply, "w") as f:
                f.write(f"{rc} {log}\n")

    def launch(self, request: bytes, log: Path) -> int:
        cwd, argc, *rest = request.split(b"\0")[:-1]
        argv = [a.decode() for a in rest[:int(argc)]]
        env = dict(e.decode().split("=", 1) for e in rest[int(argc):])
        nproc, script, args = torchrun_command(argv)
        rc = zygote.launch(REPO / "tests" / "doc_torchrun_rank.py", nproc, [cwd.decode(), script, *args], log, env,
                           TORCHRUN_TIMEOUT_S)
        if rc is not None:
            return rc
        with open(log, "w") as out:  # MEGATRON_UCP_TEST_TORCHRUN=1: torchrun itself
            return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   str(nproc), script, *args], cwd=cwd.decode(), env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=TORCHRUN_TIMEOUT_S).returncode

    def stop(self) -> None:
        try:  # wakes run() with an empty request; no reader: it has ended already
            os.close(os.open(self.request, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            return
        self.join(timeout=10)


# --- the session ----------------------------------------------------------------------------------------------

def session_script(blocks: Sequence[Block], work: Path) -> str:
    """The blocks in one bash script: each heading's blocks in a directory of their own (see the module doc),
    each block between markers naming it."""
    lines = ["set -euo pipefail", TORCHRUN_FUNCTION]
    heading, first, sections = None, None, 0
    for block in blocks:
        if (block.doc, block.heading) != heading:
            heading, sections = (block.doc, block.heading), sections + 1
            here = work / f"{sections:02d}-{re.sub(r'[^A-Za-z0-9]+', '-', block.heading)[:40].strip('-')}"
            lines.append(f"mkdir {shlex.quote(str(here))}")
            lines += [f"ln -s {shlex.quote(str(REPO / name))} {shlex.quote(str(here / name))}" for name in LINKED]
            if first is not None:
                seed = shlex.quote(str(first / SEED))
                lines.append(f"test -d {seed} || {{ echo 'docs test: the walkthrough made no {SEED}/'; exit 1; }}")
                lines.append(f"cp -r {seed} {shlex.quote(str(here / SEED))}")
            lines.append(f"cd {shlex.quote(str(here))}")
            first = first or here
        lines += [f"echo {shlex.quote(BEGIN + block.where)}", block.text, f"echo {shlex.quote(END + block.where)}"]
    return "\n".join(lines) + "\n"


def test_the_command_blocks_are_found_and_marked_ones_say_why():
    """Runs nothing: every ```bash block is run or marked with a reason, and the counts are the pinned ones (a
    block that stops being found, or a newly marked one, fails here first)."""
    blocks = command_blocks()
    marked = [b for b in blocks if b.skip_reason is not None]
    assert all(b.skip_reason for b in marked), [b.where for b in marked if not b.skip_reason]
    assert not [b.where for b in blocks if MARKER.strip() in b.text and b.skip_reason is None], \
        f"a marker that is not the block's first line does not skip it: {MARKER!r}"
    assert (len(blocks) - len(marked), len(marked)) == (RUN, MARKED), \
        [(b.where, b.skip_reason or "runs") for b in blocks]
    assert blocks[0].doc == "docs/USAGE.md" and f"--save {SEED}" in blocks[0].text, \
        f"the first block run must be USAGE.md's walkthrough, which trains {SEED}/ for the others"


@dataclass(frozen=True)
class Session:
    returncode: int
    log: Path
    text: str

    def markers(self, prefix: str) -> List[str]:
        return [line[len(prefix):] for line in self.text.splitlines() if line.startswith(prefix)]

    def failure(self) -> str:
        began = self.markers(BEGIN)
        tail = "\n".join(self.text.splitlines()[-60:])
        return f"the block at {began[-1] if began else '(none)'} failed (exit {self.returncode}); log {self.log}:\n{tail}"


def run_session(blocks: Sequence[Block], work: Path) -> Session:
    """The blocks in one bash session (session_script) with the session's torchrun (Launcher)."""
    work.mkdir(parents=True, exist_ok=True)
    launcher = Launcher(work)
    launcher.start()
    env = {**os.environ, **launcher.env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # the environment the suite's other runs fork with (zygote)
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # megatron-ucp, python
           "MEGATRON_UCP_CACHE": str(work / "cache")}  # the embedded corpus' dataset: not the user's cache
    script, log = work / "session.sh", work / "session.log"
    script.write_text(session_script(blocks, work))
    try:
        with open(log, "w") as out:
            proc = subprocess.run(["bash", str(script)], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=SESSION_TIMEOUT_S)
    finally:
        launcher.stop()
    return Session(proc.returncode, log, log.read_text(errors="replace"))


def test_the_session_stops_at_the_first_failure(tmp_path):
    """Negative controls of the session itself (no training): a failing command ends it inside its block (the
    blocks after it never run), so do an unset variable and a torchrun the launcher cannot start; a variable a
    block sets serves the next block."""
    def block(line: int, text: str) -> Block:
        return Block("control.md", line, "one heading", text)

    failing = run_session([block(1, "X=set-here\n"), block(2, "test \"$X\" = set-here\nfalse\necho after\n"),
                           block(3, "echo never\n")], tmp_path / "failing")
    assert failing.returncode == 1 and failing.markers(END) == ["control.md:1"], failing.failure()
    assert "after" not in failing.text and "never" not in failing.text
    unset = run_session([block(1, "echo $NOT_SET_BY_ANY_BLOCK\n")], tmp_path / "unset")
    assert unset.returncode != 0 and "NOT_SET_BY_ANY_BLOCK: unbound variable" in unset.text, unset.failure()
    nodes = run_session([block(1, "torchrun --nnodes 2 --nproc-per-node 1 x.py\n")], tmp_path / "nodes")
    assert nodes.returncode == 1 and "torchrun --nnodes: the docs test launches one-node runs" in nodes.text, \
        nodes.failure()


@pytest.mark.torchrun
def test_every_documented_command_runs_as_written(tmp_path):
    """The runnable blocks in one session (see the module docstring); passes when every command exits 0 and
    exactly RUN blocks ran to their end."""
    blocks = [b for b in command_blocks() if b.skip_reason is None]
    assert len(blocks) == RUN
    session = run_session(blocks, tmp_path)
    assert session.returncode == 0, session.failure()
    assert session.markers(END) == [b.where for b in blocks], session.failure()
