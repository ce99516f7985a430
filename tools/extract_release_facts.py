"""Extract what each megatron-core release's own code says a checkpoint may hold, from its wheel's sources, into
megatron_ucp/core/release_facts.json (read by core/versions.py; checked by tests/test_release_writes.py).

    pip download megatron-core==0.19.2 --no-deps --ignore-requires-python --only-binary=:all: -d /tmp/wheels
    mkdir /tmp/mcore-0.19.2 && cd /tmp/mcore-0.19.2 && unzip -q /tmp/wheels/megatron_core-0.19.2-*.whl
    python tools/extract_release_facts.py /tmp/mcore-0.14.0 /tmp/mcore-0.15.3 /tmp/mcore-0.16.1 \
        /tmp/mcore-0.17.0 /tmp/mcore-0.18.0 /tmp/mcore-0.19.2

Never installed: each wheel is unzipped into a folder of its own (the cp311 wheels run on this venv's Python 3.11
although they declare >= 3.12). Per release (the row name: "0.19" for 0.19.2):

- `safe_globals`: megatron/core/safe_globals.py's SAFE_GLOBALS as qualified names: what Megatron-LM's legacy
  `torch.load` (weights_only) accepts besides torch's own allow-list; every class a write pickles must be there.
- `enums`: each enum of those, {member: value} (values are what pickles hold; numbering differs between releases).
- `distrib_optim`: the sharding types DistributedOptimizer.sharded_state_dict dispatches on, and whether the
  release's ShardedTensor refuses `flattened_range` (then fully_sharded_model_space cannot load).
- `rerun_state_skipped_when`: the conditions under which RerunStateMachine.state_dict returns None on save.
- wheels that carry megatron/training (0.17 on) also: `args`, {dest: default} of `parse_args` run with no
  flags (JSON values as a universal checkpoint stores them), and `runtime_args` / `deleted_args`: names
  megatron/training sets on `args` (`args.x = ...`, `setattr(args, 'x', ...)`) outside argparse (and dests
  whose default has no JSON form) or deletes (`del args.x`). A save pickles (args - deleted) | runtime.

parse_args runs in a subprocess per wheel (PYTHONPATH = the wheel folder; megatron modules that import triton, a GPU package, stubbed).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "megatron_ucp" / "core" / "release_facts.json"

_PARSE_ARGS = r"""
import json, signal, sys, types, importlib.machinery

class _Anything(types.ModuleType):  # stand-in for megatron modules that import triton (a GPU package)
    __path__ = []
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name)
    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Anything("call")
    def __getitem__(self, key):
        return _Anything("item")
STUBBED = set(json.loads(sys.argv[1]))
class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name in STUBBED:
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        return _Anything(spec.name)
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, _Finder())
import typing
if not hasattr(typing, "override"):
    typing.override = lambda f: f
import enum, warnings
warnings.simplefilter("ignore")
from megatron.training.arguments import parse_args
sys.argv = ["pretrain_gpt.py"]
ns = parse_args(ignore_unknown_args=True)

def encode(v):
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, signal.Signals):
        return f"signal.Signals.{v.name}"
    if isinstance(v, enum.Enum):
        inner = encode(v.value)
        return {"enum": f"{type(v).__module__}.{type(v).__qualname__}", "value": inner}
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else str(v)
    if type(v).__module__ == "torch" and type(v).__name__ == "dtype":
        return str(v)
    if isinstance(v, (list, tuple)):
        return [encode(x) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: encode(x) for k, x in v.items()}
    raise TypeError(type(v).__name__)

out, other = {}, []
for k, v in sorted(vars(ns).items()):
    try:
        out[k] = encode(v)
    except TypeError:
        other.append(k)
print("FACTS" + json.dumps({"defaults": out, "other": other}))
"""


def version_of(root: Path) -> str:
    for meta in root.glob("megatron_core-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    raise SystemExit(f"{root}: no megatron_core-*.dist-info/METADATA (unzip the wheel there)")


def _module_file(root: Path, module: str) -> Path:
    base = root / Path(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def safe_globals(root: Path) -> list[str]:
    """SAFE_GLOBALS of megatron/core/safe_globals.py as qualified names (imports resolved)."""
    tree = ast.parse(_module_file(root, "megatron.core.safe_globals").read_text())
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name] = alias.name
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SAFE_GLOBALS"
                                                for t in node.targets):
            out = []
            for element in node.value.elts:
                text = ast.unparse(element)
                head, _, rest = text.partition(".")
                out.append(names.get(head, head) + (f".{rest}" if rest else ""))
            return out
    raise SystemExit(f"{root}: megatron/core/safe_globals.py has no SAFE_GLOBALS list")


def enum_members(root: Path, qualname: str) -> dict | None:
    """{member: value} of an enum class defined with constant values; None when it is no such enum."""
    module, _, cls = qualname.rpartition(".")
    path = _module_file(root, module)
    if not path.exists():
        return None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            if not any("Enum" in ast.unparse(b) for b in node.bases):
                return None
            return {t.id: stmt.value.value for stmt in node.body if isinstance(stmt, ast.Assign)
                    for t in stmt.targets if isinstance(t, ast.Name) and isinstance(stmt.value, ast.Constant)}
    return None


def distrib_optim(root: Path) -> dict:
    """Sharding types DistributedOptimizer.sharded_state_dict compares `sharding_type` with, and whether
    ShardedTensor refuses flattened ranges (fully_sharded_model_space's form)."""
    tree = ast.parse(_module_file(root, "megatron.core.optimizer.distrib_optimizer").read_text())
    types = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "sharded_state_dict":
            for cmp in ast.walk(node):
                if isinstance(cmp, ast.Compare) and ast.unparse(cmp.left) == "sharding_type":
                    for c in cmp.comparators:
                        for const in ast.walk(c):
                            if isinstance(const, ast.Constant) and isinstance(const.value, str):
                                types.add(const.value)
    mapping = _module_file(root, "megatron.core.dist_checkpointing.mapping").read_text()
    return {"sharding_types": sorted(types),
            "refuses_flattened_range": "ShardedTensor.flattened_range is not supported" in mapping}


def rerun_state_skipped_when(root: Path) -> list[str]:
    """The conditions of `if not force: ... if <cond>: return None` in RerunStateMachine.state_dict."""
    tree = ast.parse(_module_file(root, "megatron.core.rerun_state_machine").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "state_dict" and any(
                a.arg == "force" for a in node.args.args):
            out = []
            for branch in ast.walk(node):
                if isinstance(branch, ast.If) and ast.unparse(branch.test) == "not force":
                    for inner in ast.walk(branch):
                        if isinstance(inner, ast.If) and inner is not branch and any(
                                isinstance(s, ast.Return) and isinstance(s.value, ast.Constant) and s.value.value
                                is None for s in inner.body):
                            out.append(ast.unparse(inner.test))
            return out
    raise SystemExit(f"{root}: RerunStateMachine.state_dict(..., force) not found")


def _args_names(root: Path) -> tuple[set, set]:
    """Names megatron/training sets on `args` outside argparse, and names it always deletes (`del args.x` not
    under an `if`: a conditional delete leaves the name in some saves)."""
    set_names, deleted = set(), set()

    def visit(node, conditional: bool) -> None:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "args":
                    set_names.add(t.attr)
        if isinstance(node, ast.Delete) and not conditional:
            deleted.update(t.attr for t in node.targets if isinstance(t, ast.Attribute)
                           and isinstance(t.value, ast.Name) and t.value.id == "args")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) >= 2 and ast.unparse(node.args[0]) == "args" \
                and isinstance(node.args[1], ast.Constant):
            set_names.add(node.args[1].value)
        for child in ast.iter_child_nodes(node):
            visit(child, conditional or isinstance(node, (ast.If, ast.Try, ast.For, ast.While, ast.With)))

    for path in (root / "megatron" / "training").rglob("*.py"):
        visit(ast.parse(path.read_text()), False)
    return set_names, deleted


def _triton_modules(root: Path) -> list[str]:
    """megatron modules importing triton at module level (stubbed: triton is a GPU package, not installed)."""
    out = []
    for path in (root / "megatron").rglob("*.py"):
        text = path.read_text()
        if "triton" in text and any(isinstance(n, (ast.Import, ast.ImportFrom)) and "triton" in ast.unparse(n)
                                    for n in ast.parse(text).body):
            out.append(".".join(path.relative_to(root).with_suffix("").parts))
    return out


def parsed_args(root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", _PARSE_ARGS, json.dumps(_triton_modules(root))], env=env,
                          capture_output=True, text=True, cwd=root, timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("FACTS")), None)
    if done.returncode or line is None:
        raise SystemExit(f"{root}: parse_args failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("FACTS"):])


def facts(root: Path) -> tuple[str, dict]:
    version = version_of(root)
    out: dict = {"wheel": f"megatron-core {version}"}
    out["safe_globals"] = safe_globals(root)
    out["enums"] = {q: m for q in out["safe_globals"] if (m := enum_members(root, q)) is not None}
    out["distrib_optim"] = distrib_optim(root)
    out["rerun_state_skipped_when"] = rerun_state_skipped_when(root)
    if (root / "megatron" / "training" / "arguments.py").exists():
        parsed = parsed_args(root)
        args, other = parsed["defaults"], set(parsed["other"])
        runtime, deleted = _args_names(root)
        out["args"] = {k: v for k, v in args.items() if k not in deleted}
        out["runtime_args"] = sorted((runtime | other) - set(args) - deleted)
        out["deleted_args"] = sorted(deleted)
    return ".".join(version.split(".")[:2]), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheels", nargs="+", type=Path, help="folders of unzipped megatron-core wheels")
    p.add_argument("--out", type=Path, default=OUT)
    opts = p.parse_args()
    releases = {}
    for root in opts.wheels:
        name, found = facts(root.resolve())
        releases[name] = found
        print(f"{name}: {found['wheel']}, {len(found.get('args', {}))} args "
              f"(+{len(found.get('runtime_args', []))} set at run time), {len(found['safe_globals'])} safe globals")
    doc = {"generated_by": "tools/extract_release_facts.py (from the wheels' own sources; do not edit)",
           "releases": dict(sorted(releases.items(), key=lambda kv: [int(x) for x in re.findall(r"\d+", kv[0])]))}
    opts.out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    print(f"wrote {opts.out} ({opts.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
