"""A fork server for the suite's multi-process runs: Python, torch and Megatron-LM imported once per test
session, each rank of each run a fork of that one process (the idea of multiprocessing's forkserver).

Why: a Megatron-LM 0.19 run of the suite (4 ranks, 8 iterations) took ~25 s under torchrun, ~16 s of it
five interpreters (torchrun and four ranks) importing torch and megatron on 2 cores; the suite launches
~100 runs. A fork starts a rank with everything imported.

What a rank sees is what torchrun gives it: its environment (the caller's, plus RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK), its working directory, sys.argv and
`sys.path[0]` as `python SCRIPT ARGS...` sets them, the script run as `__main__`, stdout and stderr into the
run's log; when one rank fails the others are stopped, as torchrun does. The server itself never touches
torch's thread pools, a process group or CUDA (it imports, and compiles Megatron-LM's fused kernels in one
thread: _prewarm_fused_kernels), so a fork inherits no threads and no state; it is started with the caller's
environment, and a run whose environment differs from it in a variable read at start or import time
(IMPORT_TIME_PREFIXES: e.g. another ATEN_CPU_CAPABILITY) is torchrun's. Set MEGATRON_UCP_TEST_TORCHRUN=1 to launch
every run with torchrun instead.

Protocol: one JSON request per line on the server's stdin, one JSON reply per line on its stdout.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
# Imported by the server before it forks: what pretrain_scripts/pretrain_gpt.py imports, and the heaviest of
# what a run imports later (measured: a saving run's rank 0 imported 366 more modules): torch.compile's
# compiler (Megatron-LM warms its fused kernels up with it), the tokenizers (which import transformers),
# the dataset helpers and the checkpoint reader. Optional ones may be absent.
PRELOAD = ("megatron_ucp.megatron_lm.pretrain_gpt",)
PRELOAD_OPTIONAL = ("torch._inductor.compile_fx", "torch._dynamo.backends.inductor", "torch.export",
                    "megatron.core.tokenizers.text", "megatron.core.datasets.helpers",
                    "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
                    "megatron_ucp.universal.reader")
TIMEOUT_RC = 124  # a run stopped at its time limit (as timeout(1) exits)


# --- client (the test process) ---------------------------------------------------------------------------------

class _Client:
    def __init__(self, env: Dict[str, str]):
        self.env = dict(env)
        # the server's own output (import warnings; a failure to start) goes to a file of its own: inherited,
        # it would land in whichever test's captured output started it
        self.log = Path(tempfile.mkstemp(prefix="megatron-ucp-fork-server-", suffix=".log")[1])
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, __file__], cwd=REPO, env=self.env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
        ready = self.proc.stdout.readline()
        if json.loads(ready or "{}").get("ready") is not True:
            raise RuntimeError(f"the test fork server did not start (it said {ready!r}; its log: {self.log}); "
                               "MEGATRON_UCP_TEST_TORCHRUN=1 launches runs with torchrun instead")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, script: Path, nproc: int, args: Sequence[str], log: Path, env: Dict[str, str],
            timeout_s: float) -> int:
        request = {"script": str(script), "nproc": nproc, "args": list(map(str, args)), "log": str(log),
                   "cwd": str(REPO), "env": dict(env), "timeout_s": timeout_s}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the test fork server died during a run (exit {self.proc.wait()}); log: {log}")
        return json.loads(reply)["rc"]


_client: Optional[_Client] = None


def launch(script: Path, nproc: int, args: Sequence[str], log: Path, env: Dict[str, str],
           timeout_s: float) -> Optional[int]:
    """Run `script ARGS` on `nproc` forked ranks, output to `log`. Returns the exit status (0 when every rank
    exited 0; TIMEOUT_RC at the time limit), or None when this run is torchrun's (another environment than
    the server's, or MEGATRON_UCP_TEST_TORCHRUN set)."""
    global _client
    if os.environ.get("MEGATRON_UCP_TEST_TORCHRUN") or not hasattr(os, "fork"):
        return None
    if _client is None or not _client.alive():
        _client = _Client(env)
    elif _import_time_differences(env, _client.env):
        return None
    return _client.run(script, nproc, args, log, env, timeout_s)


# Environment variables read when the interpreter starts or a library is imported (threads, kernels, paths,
# allocator, compiler caches): a run that sets one differently from the server is torchrun's. Others (e.g.
# pytest's PYTEST_CURRENT_TEST, which changes with every test) are the ranks' environment as given.
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "ATEN_", "TORCH",
                        "PYTORCH_", "CUDA_", "NVTE_", "NCCL_", "TRITON_", "MALLOC_", "GLIBC_")


def _import_time_differences(env: Dict[str, str], server_env: Dict[str, str]) -> List[str]:
    keys = set(env) | set(server_env)
    return sorted(k for k in keys if k.startswith(IMPORT_TIME_PREFIXES) and env.get(k) != server_env.get(k))


# --- server ----------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(request: dict, rank: int, port: int, log_fd: int) -> None:
    """In the forked rank: become `python SCRIPT ARGS` under torchrun, run, exit. Never returns."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.chdir(request["cwd"])
        n = request["nproc"]
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _stop(pgid: int) -> None:
    """Stop a run's process group: SIGTERM, then SIGKILL after 5 s (as torchrun stops the other ranks)."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def _run(request: dict) -> int:
    port = _free_port()
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    pids: List[int] = []
    pgid = 0
    try:
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, pgid)
                _rank_main(request, rank, port, log_fd)
            try:
                os.setpgid(pid, pgid or pid)  # also here: no race with the child's own call
            except (PermissionError, ProcessLookupError):
                pass
            pgid = pgid or pid
            pids.append(pid)
    finally:
        os.close(log_fd)
    deadline = time.monotonic() + request["timeout_s"]
    running, rc = set(pids), 0
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                _stop(pgid)
                rc = TIMEOUT_RC
            time.sleep(0.02)
            continue
        if pid not in running:
            continue
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and rc == 0:
            rc = code if code > 0 else 128 - code
            _stop(pgid)  # the other ranks would wait for the failed one in their next collective
    try:
        os.killpg(pgid, signal.SIGKILL)  # helper processes a rank left behind
    except ProcessLookupError:
        pass
    return rc


def _native_threads() -> List[str]:
    """Names of this process's threads (Linux; [] elsewhere)."""
    names = []
    if os.path.isdir("/proc/self/task"):
        for tid in os.listdir("/proc/self/task"):
            try:
                names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
            except OSError:
                pass
    return names


# Megatron-LM 0.19's warm-up of its torch.compile'd fused kernels (set_jit_fusion_options ->
# initialize._warmup_jit_function), compiled once in the server for the precisions the suite trains in, both
# activations (SwiGLU, GeLU), every dimension dynamic: what every rank would otherwise compile itself.
# The sizes: none 0 or 1 (dynamo specializes those) and no two alike (it would guard on their equality).
PREWARM_PRECISIONS = ((False, False), (True, False), (False, True))  # (bf16, fp16): fp32, bf16, fp16
PREWARM_SIZES = dict(seq_length=24, micro_batch_size=3, hidden_size=40, ffn_hidden_size=56)


def _prewarm_fused_kernels() -> None:
    """Compile Megatron-LM's fused bias-SwiGLU / bias-GeLU / bias-dropout-add kernels here, so that a rank's
    warm-up finds them compiled instead of compiling them (measured: 2-14 s a rank, 0.01 s prewarmed).

    A rank's CPU generator, which initializes the MoE router and experts next, is drawn as a fresh compile
    draws it (measured with torch 2.13, in one process and in forked ranks, at every size and precision the
    suite uses): the warm-up draws its dummy inputs with torch.rand, then each call of the compiled dropout
    draws its seeds (inductor_seeds: one randint over int64), whether the graph is fresh or cached, static or
    dynamic. Only dynamo's fallback to eager past its recompile limit draws otherwise (eager dropout's own
    draws: 49280 32-bit words where the compiled one draws 8340), which is why a rank's warm-up runs with
    the limit raised by the graphs compiled here (_warmup_past_the_servers_graphs).

    Compiled under an instance of cpu_shims' CUDA-to-CPU mode, which each rank's warm-up runs under: dynamo
    guards on the types of the active torch function modes (and the warm-up's torch.rand(device="cuda") needs
    it). Done only with one intra-op thread (OMP_NUM_THREADS=1, as the suite's runs set it): more would start
    torch's OpenMP pool, which a fork must not copy; the ranks then compile as before. The server's generator,
    Megatron-LM's global args and inductor's compile_threads are left as they were."""
    if os.environ.get("OMP_NUM_THREADS") != "1":
        return
    import torch
    from megatron.training import global_vars, initialize

    from megatron_ucp.megatron_lm import cpu_shims

    rng = torch.get_rng_state()
    threads = torch._inductor.config.compile_threads
    torch._inductor.config.compile_threads = 1  # compiled in this process: no pool of compile workers
    try:
        with cpu_shims._CUDAToCPUMode(), torch._dynamo.config.patch(assume_static_by_default=False):
            for bf16, fp16 in PREWARM_PRECISIONS:
                for swiglu in (True, False):
                    global_vars.set_args(SimpleNamespace(
                        bf16=bf16, fp16=fp16, swiglu=swiglu, tensor_model_parallel_size=1,
                        context_parallel_size=1, sequence_parallel=False, **PREWARM_SIZES))
                    initialize._warmup_jit_function(tp_size=1)
    finally:
        global_vars.set_args(None)  # a rank's set_global_variables asserts that none are set
        torch._inductor.config.compile_threads = threads
        torch.set_rng_state(rng)
    initialize._warmup_jit_function = _warmup_past_the_servers_graphs(initialize._warmup_jit_function)


def _warmup_past_the_servers_graphs(warmup):
    """Megatron-LM's warm-up with dynamo's recompile limit raised by the graphs the server compiled for each
    kernel (two per precision: the warm-up calls each kernel with and without input gradients). A rank whose
    warm-up misses them (e.g. a micro-batch of 1) compiles its own as a fresh warm-up does, never past the
    limit into eager dropout."""
    import torch

    @functools.wraps(warmup)
    def _warmup_jit_function(*args, **kwargs):
        limit = torch._dynamo.config.recompile_limit + 2 * len(PREWARM_PRECISIONS)
        with torch._dynamo.config.patch(recompile_limit=limit):
            return warmup(*args, **kwargs)

    return _warmup_jit_function


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    for name in PRELOAD_OPTIONAL:
        try:
            __import__(name)
        except ImportError:
            pass
    try:  # torch.compile on CPU probes the vector ISA by building and loading six programs (~1.5 s per
        # process, cached in the process): probed once here, inherited by every fork
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.valid_vec_isa_list()
        # and builds its pattern tables on first use (~1 s per process): built once here
        from torch._inductor.fx_passes import joint_graph, post_grad

        joint_graph.lazy_init()
        post_grad.lazy_init()
    except ImportError:
        pass
    _prewarm_fused_kernels()
    from tqdm import tqdm  # the pattern tables show a progress bar, whose monitor thread a fork must not copy

    if tqdm.monitor is not None:
        tqdm.monitor.exit()
        tqdm.monitor = None
    # A fork copies one thread: the preparation must have started none, Python's or native (torch starts
    # its thread pools on first use).
    deadline = time.monotonic() + 2.0  # a joined thread's OS thread ends a moment after join() returns
    while len(_native_threads()) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    threads = sorted(_native_threads())
    assert len(threads) <= 1 and threading.active_count() == 1, \
        f"threads started before forking: {threading.enumerate()}, native: {threads}"
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        rc = _run(json.loads(line))
        out.write(json.dumps({"rc": rc}) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
