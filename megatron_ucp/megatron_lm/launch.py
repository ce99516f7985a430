"""A torchrun of the GPT entry point (pretrain_scripts/pretrain_gpt.py) on this machine, and its printed losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Sequence

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINT = REPO / "pretrain_scripts" / "pretrain_gpt.py"
# One Megatron-LM training_log line: "iteration        5/       8 | ... | lm loss: 6.895343E+00 | ..."
_LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|")


def environment(extra: Dict[str, str] | None = None) -> Dict[str, str]:
    """This process's environment for a CPU torchrun: one thread per rank, unbuffered output."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
                **(extra or {}))


def torchrun(nproc: int, flags: Sequence[str], *, cwd: Path, timeout: float,
             env: Dict[str, str] | None = None, script: Path = ENTRY_POINT) -> subprocess.CompletedProcess:
    """torchrun `script` (the entry point unless told) with `flags` (Megatron-LM's own); output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(script), *flags]
    return subprocess.run(cmd, cwd=cwd, env=environment(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def printed_losses(log: str) -> Dict[int, str]:
    """{iteration: the lm loss exactly as Megatron-LM printed it}."""
    return {int(m.group(1)): m.group(2) for m in _LOG_LINE.finditer(log)}
