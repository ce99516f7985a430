"""Commands that need no tensors start without importing torch (seconds: `import torch` ~3 s, its
distributed checkpoint module ~5 s here).

Each check runs in a fresh interpreter (subprocess) with every executed import statement recorded
(importer module -> imported module; `builtins.__import__` wrapped, so imports inside functions and
already-loaded modules count too):
- `megatron-ucp --help` and a subcommand's --help: torch is not loaded at all; only that subcommand's
  module is imported.
- the readers on the three Megatron-LM fixtures (open, shards, common state) and every module of
  formats/, patterns, adapters/gpt, the CLI parser: torch (and numpy) not loaded at all.
- `inspect A`, `inspect B`, `plan B --tensor-model-parallel-size 1`, to-universal, and from-universal
  --ckpt-format torch_dist (the direct writer, three optimizer/RNG variants): no module of formats/, patterns,
  adapters/, layout, model_config or cli imports torch, or a module that does (universal, byteio, the
  converter); torch is imported only by the modules in WRITE_SIDE_PENDING (owned by the write-side work,
  which makes their torch imports lazy). When that work lands, empty WRITE_SIDE_PENDING: the same test
  then asserts that these commands do not load torch at all.
Runtime: ~8 interpreter starts, ~10-20 s on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "megatron-lm"
A = FIXTURES / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt"
B = FIXTURES / "B_llama_tp2pp2dp2_distopt_sp_torch_dist" / "ckpt"
C = FIXTURES / "C_gpt2_tp2pp2dp1_adam_torch" / "ckpt"

# The read side: none of these may import torch (or anything that does) on a path that reads no tensor.
OWNED_PREFIXES = ("megatron_ucp.formats", "megatron_ucp.core.patterns", "megatron_ucp.adapters", "megatron_ucp.core.layout",
                  "megatron_ucp.core.model_config", "megatron_ucp.cli")
# Modules that still import torch when imported (the write side makes them lazy; see the module docstring).
WRITE_SIDE_PENDING: set = set()  # every module on these paths now imports torch lazily

_TRACER = r"""
import builtins, json, sys
edges = set()
_real = builtins.__import__

def _traced(name, globals=None, locals=None, fromlist=(), level=0):
    module = _real(name, globals, locals, fromlist, level)
    importer = (globals or {}).get("__name__", "?")
    target = module.__name__ if (fromlist or level) else name
    edges.add((importer, target))
    for item in fromlist or ():
        if f"{module.__name__}.{item}" in sys.modules:
            edges.add((importer, f"{module.__name__}.{item}"))
    return module

out, code = sys.argv[1], sys.argv[2]
sys.argv = ["check", *sys.argv[3:]]
builtins.__import__ = _traced
try:
    exec(compile(code, "<check>", "exec"), {"__name__": "__check__"})
except SystemExit:
    pass
finally:
    builtins.__import__ = _real
    with open(out, "w") as f:
        json.dump({"edges": sorted(edges), "modules": sorted(sys.modules)}, f)
"""


def traced(tmp_path: Path, code: str, *args: str) -> dict:
    """Run `code` (sys.argv[1:] = args) in a fresh interpreter; its import edges and loaded modules."""
    out = tmp_path / "imports.json"
    run = subprocess.run([sys.executable, "-c", _TRACER, str(out), code, *args], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    found = json.loads(out.read_text())
    found["stdout"], found["stderr"] = run.stdout, run.stderr
    return found


def cli(*args: str) -> str:
    """Code that runs `megatron-ucp ARGS` as `python -m megatron_ucp.cli` does."""
    return (f"import runpy, sys; sys.argv = ['megatron-ucp', *{list(args)!r}]\n"
            f"runpy.run_module('megatron_ucp.cli', run_name='__main__', alter_sys=True)")


def _is_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.") or module == "safetensors.torch"


def _owned(module: str) -> bool:
    return module.startswith(OWNED_PREFIXES)


def test_help_imports_no_subcommand_module(tmp_path):
    found = traced(tmp_path, cli("--help"))
    assert "COMMAND" in found["stdout"] and "to-universal" in found["stdout"] and "plot-loss" in found["stdout"]
    assert "torch" not in found["modules"]
    assert not [m for m in found["modules"] if m.startswith("megatron_ucp.") and m not in (
        "megatron_ucp.cli",)], [m for m in found["modules"] if m.startswith("megatron_ucp.")]
    # one subcommand's help imports that subcommand's module only
    found = traced(tmp_path, cli("inspect", "--help"))
    assert "--iteration" in found["stdout"] and "torch" not in found["modules"]
    assert "megatron_ucp.commands.inspect" in found["modules"] and "megatron_ucp.convert" not in found["modules"]
    # negative control: the tracer sees torch when a module imports it
    found = traced(tmp_path, "import megatron_ucp.core.patterns as p, torch\np.bitwise_equal(torch.ones(1), torch.ones(1))")
    assert "torch" in found["modules"] and ("megatron_ucp.core.patterns", "torch") in map(tuple, found["edges"])


READERS = r"""
import sys
from megatron_ucp.formats import open_checkpoint
import megatron_ucp.serialization.records, megatron_ucp.formats.bucket_layout, megatron_ucp.formats.legacy.reader
import megatron_ucp.serialization.safe_pickle, megatron_ucp.formats.torch_dist.reader, megatron_ucp.adapters.gpt
import megatron_ucp.core.patterns, megatron_ucp.cli
megatron_ucp.cli.build_parser(["inspect", "x"])
for root in sys.argv[1:]:
    for iteration in (4, 8):
        ckpt = open_checkpoint(root, iteration)
        refs = ckpt.shards()
        assert refs and all(str(r.dtype) == "torch.float32" for r in refs), root
        state = ckpt.common_state()
        assert state["iteration"] == iteration and state["param_groups"], root
        print(ckpt.format, len(refs))
"""


def test_readers_open_without_torch_or_numpy(tmp_path):
    """Opening A, B and C (both iterations), their shards and common state, and importing every read-side
    module load neither torch nor numpy."""
    found = traced(tmp_path, READERS, str(A), str(B), str(C))
    assert found["stdout"].split() == ["torch", "54", "torch", "54", "torch_dist", "54", "torch_dist", "54",
                                       "torch", "106", "torch", "106"], found["stdout"]  # shards: 2 TP x 2 PP
    loaded = [m for m in found["modules"] if _is_torch(m) or m == "numpy" or m.startswith("numpy.")]
    assert not loaded, loaded


@pytest.mark.parametrize("args", [("inspect", str(A)), ("inspect", str(B)),
                                  ("plan", str(B), "--tensor-model-parallel-size", "1"),
                                  ("to-universal", str(A), "{tmp}/ucp_a"), ("to-universal", str(B), "{tmp}/ucp_b"),
                                  ("to-universal", str(C), "{tmp}/ucp_c"), ("inspect", "{tmp}/ucp_c"),
                                  ("check", "{tmp}/ucp_c"),
                                  ("plan", "{tmp}/ucp_a", "-t", "2", "-d", "2", "--use-distributed-optimizer"),
                                  ("from-universal", "{tmp}/ucp_a", "{tmp}/td_a", "--ckpt-format", "torch_dist", "-t",
                                   "2", "-d", "2", "--use-distributed-optimizer", "--sequence-parallel"),
                                  ("from-universal", "{tmp}/ucp_a", "{tmp}/td_a_full", "--ckpt-format", "torch_dist",
                                   "-p", "2", "--use-distributed-optimizer", "--optimizer-format",
                                   "fully_reshardable", "--rng-state", "cpu"),
                                  ("from-universal", "{tmp}/ucp_c", "{tmp}/td_c", "--ckpt-format", "torch_dist",
                                   "-t", "2", "-p", "2", "--rng-state", "source")],
                         ids=["inspect A", "inspect B", "plan B", "to-universal A", "to-universal B", "to-universal C",
                              "inspect universal", "check universal", "plan universal distributed optimizer",
                              "torch_dist write dp_reshardable",
                              "torch_dist write fully_reshardable", "torch_dist write plain Adam"])
def test_metadata_commands_import_torch_only_through_the_write_side(tmp_path_factory, args):
    """Commands that need no tensor values load no torch: metadata commands, to-universal, which copies,
    compares and checksums bytes (all three fixtures take the byte path), and the direct torch_dist writer,
    which writes torch.save's format itself (serialization/torch_save.py): every optimizer format, RNG states
    fresh (CUDA, CPU generator) and stored; the files it writes are checked by test_torch_dist_direct.py."""
    tmp = tmp_path_factory.getbasetemp() / "torch_free"
    tmp.mkdir(exist_ok=True)
    for name, source in (("ucp_a", A), ("ucp_c", C)):
        if f"{{tmp}}/{name}" in args and args[0] != "to-universal" and not (tmp / name).exists():
            from megatron_ucp.convert import to_universal
            to_universal(source, tmp / name, progress=False)
    args = tuple(a.replace("{tmp}", str(tmp)) for a in args)
    found = traced(tmp, cli(*args, "--quiet"))
    edges = [tuple(e) for e in found["edges"]]
    assert any(a.startswith("megatron_ucp.") for a, _ in edges)  # the command did run
    # the read side imports neither torch nor a module that imports it
    bad = sorted((a, b) for a, b in edges if _owned(a) and (_is_torch(b) or b in WRITE_SIDE_PENDING))
    assert not bad, bad
    # torch comes in only through the write side's modules (empty WRITE_SIDE_PENDING once they are lazy)
    importers = {a for a, b in edges if _is_torch(b) and not _is_torch(a) and a != "importlib._bootstrap"}
    assert importers <= WRITE_SIDE_PENDING, importers - WRITE_SIDE_PENDING
    if not WRITE_SIDE_PENDING:
        assert "torch" not in found["modules"]
    if args[0] == "from-universal":  # it did write the checkpoint
        assert (Path(args[2]) / "latest_checkpointed_iteration.txt").read_text() == "8"
