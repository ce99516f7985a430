"""Where megatron-core 0.19 is installed, and a torchrun of the Megatron-LM 0.19 entry point with it first.

`make install` puts megatron-core 0.19.2 in <venv>/megatron-core-0.19, beside the venv's 0.16.1, which the
rest of the project (the 0.16.1 harness, the converters' tests) keeps using. MEGATRON_CORE_019_PATH
overrides the folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Sequence

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINT = REPO / "pretrain_scripts" / "pretrain_gpt_mcore019.py"
# One Megatron-LM training_log line: "iteration        5/       8 | ... | lm loss: 6.895343E+00 | ..."
_LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|")


def mcore019_path() -> Path:
    path = Path(os.environ.get("MEGATRON_CORE_019_PATH", Path(sys.prefix) / "megatron-core-0.19"))
    if not (path / "megatron" / "training").is_dir():
        raise FileNotFoundError(f"megatron-core 0.19 not found at {path}: run `make install` (it installs "
                                "megatron-core==0.19.2 there) or set MEGATRON_CORE_019_PATH")
    return path


def environment() -> Dict[str, str]:
    """This process's environment with megatron-core 0.19 first on PYTHONPATH."""
    path = [str(mcore019_path()), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                CUDA_DEVICE_MAX_CONNECTIONS="1")


def torchrun(nproc: int, flags: Sequence[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """torchrun the 0.19 entry point on this machine with `flags` (Megatron-LM's own); output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ENTRY_POINT), *flags]
    return subprocess.run(cmd, cwd=cwd, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def printed_losses(log: str) -> Dict[int, str]:
    """{iteration: the lm loss exactly as Megatron-LM printed it}."""
    return {int(m.group(1)): m.group(2) for m in _LOG_LINE.finditer(log)}
