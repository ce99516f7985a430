"""`megatron-ucp verify`: are two checkpoints the same training state, whatever their formats and layouts?

Both sides are reduced to consolidated tensors (the TP1 global tensor of each canonical parameter, with
its fp32 master weight and optimizer state by name when present) and compared one parameter at a time, so
memory stays bounded by two parameters. A universal checkpoint is read as stored; a Megatron-LM one is
consolidated with the converter's own `conversion_tasks` / `consolidate_parameter`.

Vocabulary rows: two layouts may pad the vocabulary differently; the first min(rows) rows are compared
and the difference in padding is reported.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from megatron_ucp.commands.common import checkpoint_format, is_universal, open_any, text_table
from megatron_ucp.core.patterns import VocabSharded
from megatron_ucp.io.byteio import FileHandles, read_box

KEY_LABELS = {"fp32": "weight"}  # every other key (an optimizer state's torch name, 'step') as itself


class ConsolidatedSource:
    """One checkpoint's consolidated tensors, one parameter at a time (nothing is read up front)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.format = checkpoint_format(ckpt)
        self.config = ckpt.config
        if is_universal(ckpt):
            self.shapes = {n: p.shape for n, p in ckpt.parameters.items()}
            self.patterns = {n: p.pattern for n, p in ckpt.parameters.items()}
            self.keys = {n: tuple(p.tensors) for n, p in ckpt.parameters.items()}
            self._tasks = None
        else:
            from megatron_ucp.convert import conversion_tasks

            self._tasks = {t.name: t for t in conversion_tasks(ckpt)}  # checks completeness, reads no tensor
            self.shapes = {n: t.shape for n, t in self._tasks.items()}
            self.patterns = {n: t.pattern for n, t in self._tasks.items()}
            # each parameter's own optimizer's states (an emerging optimizer's or its scalar optimizer's)
            self.keys = {n: ("fp32",) if t.buffer or ckpt.optimizer_kind == "none" else (
                "fp32", *ckpt.parameter_row(t.places[0][0].local_name, t.places[0][0].shape).states)
                for n, t in self._tasks.items()}
        self._files: Optional[FileHandles] = None
        self._current = None  # the parameter open_parameter prepared: ("placed", placements) or ("tensors", ...)

    @property
    def names(self) -> list[str]:
        return list(self.shapes)

    @property
    def has_moments(self) -> bool:
        """Optimizer state for every parameter (persistent buffers, the router's expert_bias, have none)."""
        from megatron_ucp.adapters.gpt import is_buffer

        stateful = [len(k) > 1 for n, k in self.keys.items() if not is_buffer(n)]
        return bool(stateful) and all(stateful)

    @property
    def optimizer(self) -> Optional[str]:
        """The optimizer whose state it holds (core/optimizers.py's name), None without any."""
        if not self.has_moments:
            return None
        return self.ckpt.optimizer_type if self._tasks is None else self.ckpt.optimizer_name

    def read(self, name: str, keys) -> tuple[dict[str, torch.Tensor], Optional[int]]:
        """({key: global fp32 tensor}, Adam step or None) of one parameter."""
        if self._tasks is None:
            info = self.ckpt.parameters[name]
            return {k: self.ckpt.read(name, k) for k in keys}, info.step
        from megatron_ucp.convert import consolidate_parameter

        tensors, info = consolidate_parameter(self.ckpt, self._tasks[name])
        return {k: tensors[k] for k in keys if k in tensors}, info["step"]

    def open_parameter(self, name: str) -> Optional[int]:
        """Prepare read_rows of one parameter; returns its Adam step (or None). A Megatron-LM checkpoint's
        parameter is located as to-universal locates it (place_parameter: where each consolidated tensor's
        bytes are, replicas compared byte for byte), so its rows are read band by band; only when the reader
        cannot say where the bytes are is it consolidated in memory (consolidate_parameter, whose errors
        name what is wrong)."""
        self._current = None
        if self._tasks is None:
            return self.ckpt.parameters[name].step
        from megatron_ucp.convert import consolidate_parameter
        from megatron_ucp.convert.consolidate import place_parameter

        if self._files is None:
            self._files = FileHandles()
        placed = place_parameter(self.ckpt, self._tasks[name], self._files)
        if placed is not None:
            self._current = ("placed", placed[0])
            return placed[1]["step"]
        tensors, info = consolidate_parameter(self.ckpt, self._tasks[name])
        self._current = ("tensors", tensors)
        return info["step"]

    def read_rows(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) (dim 0) of the parameter open_parameter prepared, as a float32 tensor."""
        if self._tasks is None:
            return self.ckpt.read(name, key, (slice(start, stop),))
        kind, value = self._current
        if kind == "placed":
            return read_box(self._files, value[key], (slice(start, stop),))
        return value[key][start:stop]

    def close(self) -> None:
        self._current = None
        if self._files is not None:
            self._files.close()
            self._files = None

    def describe(self) -> dict:
        return {"path": str(Path(self.ckpt.path).resolve()), "format": self.format,
                "iteration": int(self.ckpt.iteration), "optimizer_state": self.has_moments,
                "optimizer": self.optimizer}


@dataclass
class TensorDiff:
    name: str
    key: str  # fp32 | exp_avg | exp_avg_sq | step | shape | missing
    equal: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    num_differing: int = 0
    numel: int = 0
    note: str = ""

    def to_dict(self) -> dict:
        def safe(x: float):
            return x if math.isfinite(x) else str(x)

        return {"name": self.name, "key": self.key, "equal": self.equal, "max_abs_diff": safe(self.max_abs),
                "max_rel_diff": safe(self.max_rel), "num_differing": self.num_differing, "numel": self.numel,
                "note": self.note}


_COMPARE_BAND = 1 << 22  # elements compared at a time: float64 temporaries stay ~100 MiB whatever the tensor


def compare_tensors(name: str, key: str, a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> TensorDiff:
    """Elementwise |a - b| <= atol + rtol * |b| (NaN equals NaN); max abs and relative (to |b|) differences.
    Equal tensors (the usual verify) are recognised without temporaries; others are compared in bands of
    _COMPARE_BAND elements, so memory does not grow with the tensor (one float64 copy of a 1.3B model's
    embedding was 0.8 GiB, and the comparison made five)."""
    numel = a.numel()
    if a.shape == b.shape and torch.equal(a, b):  # every diff 0: nothing differs (atol, rtol >= 0)
        return TensorDiff(name, key, equal=True, max_abs=0.0, max_rel=0.0, num_differing=0, numel=numel)
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    max_abs = max_rel = 0.0
    differing = 0
    for start in range(0, numel, _COMPARE_BAND):
        a64 = flat_a[start:start + _COMPARE_BAND].to(torch.float64)
        b64 = flat_b[start:start + _COMPARE_BAND].to(torch.float64)
        diff = (a64 - b64).abs()
        both_nan = a64.isnan() & b64.isnan()
        diff = torch.where(both_nan, torch.zeros_like(diff), diff.nan_to_num(nan=math.inf))
        b_abs = b64.abs().nan_to_num(nan=0.0)
        bad = diff > atol + rtol * b_abs
        rel = torch.where(diff == 0, torch.zeros_like(diff), diff / b_abs)
        max_abs, max_rel = max(max_abs, float(diff.max())), max(max_rel, float(rel.max()))
        differing += int(bad.sum())
        del a64, b64, diff, both_nan, b_abs, bad, rel
    return TensorDiff(name, key, equal=differing == 0, max_abs=max_abs, max_rel=max_rel, num_differing=differing,
                      numel=numel)


def _compare_steps(name: str, step_a: Optional[int], step_b: Optional[int]) -> TensorDiff:
    same = step_a == step_b
    if same or step_a is None or step_b is None:
        gap = 0.0 if same else math.inf
        return TensorDiff(name, "step", same, gap, gap, int(not same), 1, "" if same else f"step {step_a} vs {step_b}")
    gap = float(abs(step_a - step_b))
    return TensorDiff(name, "step", False, gap, gap / abs(step_b) if step_b else math.inf, 1, 1,
                      f"step {step_a} vs {step_b}")


@dataclass
class VerifyResult:
    a: dict
    b: dict
    atol: float
    rtol: float
    diffs: list[TensorDiff] = field(default_factory=list)
    compared_keys: tuple[str, ...] = ()
    vocab_padding: Optional[dict] = None
    config_differences: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(d.equal for d in self.diffs)

    def worst(self, top: int) -> list[TensorDiff]:
        """Differing tensors first, tensors before steps, then by max |diff|."""
        return sorted(self.diffs, key=lambda d: (d.equal, d.key == "step", -d.max_abs, -d.max_rel))[:top]


def verify(path_a, path_b, *, atol: float = 0.0, rtol: float = 0.0, iteration_a: Optional[int] = None,
           iteration_b: Optional[int] = None, progress: bool = True) -> VerifyResult:
    """Compare two checkpoints (any supported formats and layouts) by their consolidated tensors."""
    if atol < 0 or rtol < 0:
        raise ValueError(f"--atol {atol} / --rtol {rtol}: tolerances must be >= 0")
    a, b = ConsolidatedSource(open_any(path_a, iteration_a)), ConsolidatedSource(open_any(path_b, iteration_b))
    from megatron_ucp.core.optimizers import OPTIMIZERS, run_optimizers, run_states

    # the optimizer states by name when both hold the same optimizer's (core/optimizers.py: every row the run gives
    # parameters), else the weights
    same = a.optimizer is not None and a.optimizer == b.optimizer
    opt_rows = [OPTIMIZERS[r] for r in run_optimizers(a.optimizer, a.ckpt.args)] if same else []
    keys = ("fp32", *run_states(a.optimizer, a.ckpt.args)) if same else ("fp32",)
    stepped = any(r.step for r in opt_rows)
    result = VerifyResult(a.describe(), b.describe(), atol, rtol,
                          compared_keys=keys + (("step",) if stepped else ()))
    ca, cb = a.config.to_dict(), b.config.to_dict()
    padding_only = ("padded_vocab_size", "make_vocab_size_divisible_by")
    result.config_differences = [f"{k}: {ca[k]!r} vs {cb[k]!r}" for k in ca
                                 if ca[k] != cb.get(k) and k not in padding_only]
    for name in a.names:
        if name not in b.shapes:
            result.diffs.append(TensorDiff(name, "missing", False, math.inf, math.inf, note="only in A"))
    for name in b.names:
        if name not in a.shapes:
            result.diffs.append(TensorDiff(name, "missing", False, math.inf, math.inf, note="only in B"))
    common = [n for n in a.names if n in b.shapes]

    def cost(n: str) -> int:  # bytes read from both sides for parameter n
        return (math.prod(a.shapes[n]) + math.prod(b.shapes[n])) * 4 * len(keys)

    total = sum(cost(n) for n in common)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for name in common:
            shape_a, shape_b = a.shapes[name], b.shapes[name]
            rows = None
            if shape_a != shape_b:
                vocab = isinstance(a.patterns[name], VocabSharded) and shape_a[1:] == shape_b[1:]
                if not vocab:
                    result.diffs.append(TensorDiff(name, "shape", False, math.inf, math.inf,
                                                   note=f"shape {list(shape_a)} vs {list(shape_b)}"))
                    bar.update(cost(name))
                    continue
                rows = min(shape_a[0], shape_b[0])
                result.vocab_padding = {"a_rows": shape_a[0], "b_rows": shape_b[0], "compared_rows": rows,
                                        "true_vocab_size": a.config.vocab_size}
            name_keys = tuple(k for k in keys if k in a.keys[name] and k in b.keys[name])  # buffers: fp32 only
            if same and set(a.keys[name]) != set(b.keys[name]):
                result.diffs.append(TensorDiff(name, "state", False, math.inf, math.inf,
                                               note=f"{list(a.keys[name])} vs {list(b.keys[name])}"))
            step_a, step_b = a.open_parameter(name), b.open_parameter(name)
            for key in name_keys:
                result.diffs.append(_compare_rows(a, b, name, key, shape_a, rows, atol, rtol))
            if stepped and len(name_keys) > 1 and (step_a is not None or step_b is not None):
                result.diffs.append(_compare_steps(name, step_a, step_b))
            bar.update(cost(name))
    finally:
        bar.close()
        a.close()
        b.close()
    return result


def _compare_rows(a: ConsolidatedSource, b: ConsolidatedSource, name: str, key: str, shape: tuple, rows: Optional[int],
                  atol: float, rtol: float) -> TensorDiff:
    """compare_tensors of one parameter's tensor (its first `rows` rows, or all), read from both sides in bands
    of about _COMPARE_BAND elements: memory is a few bands, not the tensor (a 1.3B model's embedding and its
    moments, both sides, were 2.5 GiB)."""
    if not shape:  # a 0-d tensor: whole
        ta, tb = a.read(name, (key,))[0][key], b.read(name, (key,))[0][key]
        return compare_tensors(name, key, ta, tb, atol, rtol)
    total = shape[0] if rows is None else rows
    band = max(1, _COMPARE_BAND // max(1, math.prod(shape[1:])))
    parts = [compare_tensors(name, key, a.read_rows(name, key, r, min(total, r + band)),
                             b.read_rows(name, key, r, min(total, r + band)), atol, rtol)
             for r in range(0, total, band)]
    return TensorDiff(name, key, equal=all(p.equal for p in parts),
                      max_abs=max((p.max_abs for p in parts), default=0.0),
                      max_rel=max((p.max_rel for p in parts), default=0.0),
                      num_differing=sum(p.num_differing for p in parts), numel=sum(p.numel for p in parts))


# --------------------------------------------------------------------------------------------------
# Report


def _fmt(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def format_report(result: VerifyResult, top: int) -> str:
    a, b = result.a, result.b
    lines = [f"A: {a['path']} ({a['format']}, iteration {a['iteration']})",
             f"B: {b['path']} ({b['format']}, iteration {b['iteration']})",
             f"compared: {', '.join(KEY_LABELS.get(k, k) for k in result.compared_keys)}"
             + ("" if len(result.compared_keys) > 1 else
                " (optimizer state not compared: " + ("neither has it" if not (a["optimizer_state"] or
                                                                              b["optimizer_state"])
                                                      else f"A holds {a['optimizer']}'s, B {b['optimizer']}'s"
                                                      if a["optimizer_state"] and b["optimizer_state"]
                                                      else ("B" if a["optimizer_state"] else "A") + " has none") + ")")]
    if result.config_differences:
        lines.append("model config differs: " + "; ".join(result.config_differences))
    if result.vocab_padding:
        vp = result.vocab_padding
        lines.append(f"vocabulary padding differs: A has {vp['a_rows']} rows, B has {vp['b_rows']} (true vocabulary "
                     f"{vp['true_vocab_size']}); compared the first {vp['compared_rows']} rows")
    worst = [d for d in result.worst(top) if not d.equal] or [d for d in result.worst(min(top, 5)) if d.max_abs > 0]
    steps = sorted({d.note for d in result.diffs if d.key == "step" and not d.equal})
    if steps:
        lines.append(f"Adam steps differ: {', '.join(steps[:3])}{' ...' if len(steps) > 3 else ''}")
    if worst:
        rows = [(f"{d.name} [{KEY_LABELS.get(d.key, d.key)}]", _fmt(d.max_abs), _fmt(d.max_rel),
                 f"{d.num_differing}/{d.numel}" if d.numel else "-", d.note) for d in worst]
        header = ("tensor", "max|diff|", "max rel", "differing", "")
        lines += ["", ("worst tensors:" if not result.equal else "largest differences:"), *text_table(header, rows)]
        lines.append("")
    bad = [d for d in result.diffs if not d.equal]
    tol = f"atol={result.atol:g} rtol={result.rtol:g}"
    if bad:
        w = result.worst(1)[0]
        lines.append(f"differ: {len(bad)} of {len(result.diffs)} tensors differ beyond {tol}; worst "
                     f"{w.name} [{KEY_LABELS.get(w.key, w.key)}] max |diff| = {_fmt(w.max_abs)}")
    else:
        params = len({d.name for d in result.diffs})
        lines.append(f"equal: {len(result.diffs)} tensors of {params} parameters agree within {tol}")
    return "\n".join(lines)


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "verify", parents=[common], help="compare two checkpoints of any formats and layouts",
        description="Compare two checkpoints (universal, legacy torch or torch_dist, any TP/PP/DP) by their "
                    "consolidated tensors: weights, and the optimizer state by name (Adam exp_avg / exp_avg_sq / "
                    "step, SGD momentum_buffer) when both hold the same optimizer's. "
                    "Exit status 0 when equal within tolerance, 1 when they differ.")
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bitwise equal values)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, times |B| (default 0)")
    p.add_argument("--iteration-a", type=int, default=None, help="iteration of A when it is a Megatron-LM root")
    p.add_argument("--iteration-b", type=int, default=None, help="iteration of B when it is a Megatron-LM root")
    p.add_argument("--top", type=int, default=10, help="how many of the worst tensors to list (default 10)")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    result = verify(args.a, args.b, atol=args.atol, rtol=args.rtol, iteration_a=args.iteration_a,
                    iteration_b=args.iteration_b, progress=not args.quiet)
    differing = [d for d in result.diffs if not d.equal]
    return {
        "equal": result.equal,
        "exit_code": 0 if result.equal else 1,
        "a": result.a,
        "b": result.b,
        "atol": result.atol,
        "rtol": result.rtol,
        "compared": list(result.compared_keys),
        "num_tensors": len(result.diffs),
        "num_differing": len(differing),
        "vocab_padding": result.vocab_padding,
        "config_differences": result.config_differences,
        "worst": [d.to_dict() for d in result.worst(args.top)],
        "message": format_report(result, args.top),
    }
