"""The UCP language: how one parameter is laid out across tensor-parallel ranks, as one value.

Each pattern is a small frozen dataclass with exact-inverse `consolidate` (TP shards -> the global
tensor) and `slice_for_rank` (global tensor -> one rank's shard), plus `slice_ranges`, which says
which index ranges of the global tensor make up a rank's shard. `rank_blocks` turns those ranges into
`Block`s (a region of the global tensor = a region of the rank's shard), and every shard geometry in
the project comes from them: the converter's byte placements, the torch_dist reader's chunk requests,
the loader's and lazy checkpoints' slice reads (`local_reads`), `plan`'s byte counts. Patterns
round-trip through JSON because the universal format stores each parameter's pattern in its metadata.

Pure: tensors in, tensors out; no file I/O, no torch.distributed. torch is imported inside the functions
that take or return tensors, so the pattern language (and the rulebook, the readers' open, inspect and
plan) loads without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple, Type

from megatron_ucp.core.layout import LayoutError

Shape = Tuple[int, ...]
Ranges = Tuple[slice, ...]


class PatternError(ValueError):
    """Tensors that do not fit their pattern (wrong shape, disagreeing replicas, bad JSON)."""


def _label(name: Optional[str]) -> str:
    return f"{name}: " if name else ""


def _divisors(n: int, upto: int = 64) -> List[int]:
    return [d for d in range(1, min(n, upto) + 1) if n % d == 0]


def _check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank={tp_rank} is not a rank of TP={tp_size}; use 0 <= tp_rank < tp_size")


def _whole(global_shape: Shape) -> Ranges:
    return tuple(slice(0, n) for n in global_shape)


def _along(global_shape: Shape, dim: int, start: int, stop: int) -> Ranges:
    ranges = list(_whole(global_shape))
    ranges[dim] = slice(start, stop)
    return tuple(ranges)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaNs with equal bits compare equal; -0.0 != 0.0)."""
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def check_copies_agree(copies: Sequence[torch.Tensor], *, name: Optional[str] = None,
                       labels: Optional[Sequence[str]] = None) -> None:
    """Raise PatternError unless all copies are bitwise equal; the message names the first mismatch.
    `labels` name the copies in messages (default "TP rank i")."""
    import torch
    if not copies:
        raise PatternError(f"{_label(name)}no copies given")
    labels = list(labels) if labels is not None else [f"TP rank {i}" for i in range(len(copies))]
    first = copies[0]
    for i, other in enumerate(copies[1:], start=1):
        if bitwise_equal(first, other):
            continue
        if first.shape != other.shape or first.dtype != other.dtype:
            detail = f"{tuple(first.shape)} {first.dtype} vs {tuple(other.shape)} {other.dtype}"
        else:
            diff = first.to(torch.float64) - other.to(torch.float64)
            differing = (diff != 0) | diff.isnan()
            detail = (f"{int(differing.sum())} of {diff.numel()} elements differ, "
                      f"max |diff| = {float(diff.abs().nan_to_num(float('inf')).max()):.3g}")
        raise PatternError(
            f"{_label(name)}the copy on {labels[i]} differs from the one on {labels[0]} ({detail}); the "
            "checkpoint is inconsistent: consolidate with average=True to take the mean, or check how it "
            "was written")


@dataclass(frozen=True)
class Block:
    """Region `dst` of the global tensor (one slice per dim) is region `src` of shard `shard` (the TP
    rank's local tensor); both regions have the same lengths."""

    shard: int
    dst: Ranges
    src: Ranges


def _intersect(a: Ranges, b: Ranges) -> Optional[Ranges]:
    out = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
    return out if all(s.start < s.stop for s in out) else None


class Pattern:
    """Base of all patterns. Subclasses are frozen dataclasses; behaviour is defined by `kind`."""

    kind: ClassVar[str] = ""
    dim: Optional[int]  # the dimension shards are concatenated along; None when replicated

    def validate(self, global_shape: Sequence[int], tp_size: int, *, name: Optional[str] = None) -> None:
        """Raise LayoutError (cause + fix) when a tensor of `global_shape` cannot be split over `tp_size`."""
        raise NotImplementedError

    def slice_ranges(self, global_shape: Sequence[int], tp_rank: int, tp_size: int, *,
                     name: Optional[str] = None) -> List[Ranges]:
        """Index tuples into the global tensor; their pieces, concatenated along `dim`, are the rank's shard."""
        raise NotImplementedError

    def rank_blocks(self, global_shape: Sequence[int], tp_rank: int, tp_size: int, *,
                    name: Optional[str] = None) -> List[Block]:
        """The rank's shard as blocks: each `slice_ranges` piece of the global tensor and where it sits in
        the shard (pieces are concatenated along `dim`, so each takes the next run of that dim)."""
        global_shape = tuple(global_shape)
        ranges = self.slice_ranges(global_shape, tp_rank, tp_size, name=name)
        if self.dim is None:
            return [Block(tp_rank, r, _whole(global_shape)) for r in ranges]
        local = self.local_shape(global_shape, tp_size, name=name)
        blocks, offset = [], 0
        for r in ranges:
            n = r[self.dim].stop - r[self.dim].start
            blocks.append(Block(tp_rank, r, _along(local, self.dim, offset, offset + n)))
            offset += n
        return blocks

    def local_reads(self, global_shape: Sequence[int], tp_rank: int, tp_size: int,
                    local_box: Optional[Sequence[slice]] = None, *, name: Optional[str] = None
                    ) -> List[Tuple[Ranges, Ranges]]:
        """What to read to fill the region `local_box` of the rank's shard (default: all of it): pairs of
        (region of the global tensor, where it goes relative to local_box's start). Leading dims may be
        given; the rest are whole."""
        local = self.local_shape(global_shape, tp_size, name=name)
        box = tuple(slice(*s.indices(n)[:2]) for s, n in zip(local_box or (), local))
        box += _whole(local)[len(box):]
        reads = []
        for b in self.rank_blocks(global_shape, tp_rank, tp_size, name=name):
            part = _intersect(box, b.src)
            if part is None:
                continue
            src = tuple(slice(d.start + p.start - s.start, d.start + p.stop - s.start)
                        for p, s, d in zip(part, b.src, b.dst))
            reads.append((src, tuple(slice(p.start - x.start, p.stop - x.start) for p, x in zip(part, box))))
        return reads

    def local_shape(self, global_shape: Sequence[int], tp_size: int, *, name: Optional[str] = None) -> Shape:
        global_shape = tuple(global_shape)
        self.validate(global_shape, tp_size, name=name)
        if self.dim is None:
            return global_shape
        shape = list(global_shape)
        shape[self.dim] //= tp_size
        return tuple(shape)

    def slice_for_rank(self, full: torch.Tensor, tp_rank: int, tp_size: int, *,
                       name: Optional[str] = None) -> torch.Tensor:
        """The rank's shard as a new tensor (a view would make torch.save write the whole global tensor)."""
        import torch
        pieces = [full[r] for r in self.slice_ranges(tuple(full.shape), tp_rank, tp_size, name=name)]
        if len(pieces) == 1:
            return pieces[0].clone(memory_format=torch.contiguous_format)
        return torch.cat(pieces, dim=self.dim)

    def consolidate(self, shards: Sequence[torch.Tensor], *, name: Optional[str] = None) -> torch.Tensor:
        raise NotImplementedError

    def to_json(self) -> dict:
        raise NotImplementedError

    def _check_shards(self, shards: Sequence[torch.Tensor], name: Optional[str]) -> None:
        if not shards:
            raise PatternError(f"{_label(name)}no shards given")
        first = shards[0]
        for i, s in enumerate(shards):
            if s.shape != first.shape or s.dtype != first.dtype:
                raise PatternError(
                    f"{_label(name)}TP shard {i} is {tuple(s.shape)} {s.dtype} but shard 0 is "
                    f"{tuple(first.shape)} {first.dtype}; all TP shards of a {self.kind} parameter must match")
            if self.dim is not None and s.dim() <= self.dim:
                raise PatternError(f"{_label(name)}TP shard {i} has {s.dim()} dims; pattern {self.to_json()} "
                                   f"splits dim {self.dim}")


@dataclass(frozen=True)
class Replicated(Pattern):
    """The same tensor on every TP rank (norms, row-parallel biases, position embeddings)."""

    kind: ClassVar[str] = "replicated"
    dim: ClassVar[Optional[int]] = None

    def validate(self, global_shape, tp_size, *, name=None):
        if tp_size < 1:
            raise LayoutError(f"{_label(name)}TP={tp_size} must be >= 1")

    def slice_ranges(self, global_shape, tp_rank, tp_size, *, name=None):
        _check_tp(tp_rank, tp_size)
        return [_whole(tuple(global_shape))]

    def consolidate(self, shards, *, name=None, check: bool = True, average: bool = False):
        """One copy; with check (default) all copies must be bitwise equal; with average, their mean."""
        import torch
        self._check_shards(shards, name)
        if average:
            if not shards[0].is_floating_point():
                raise PatternError(f"{_label(name)}cannot average {shards[0].dtype} replicas; use check=True")
            mean = torch.stack([s.to(torch.float64) for s in shards]).mean(dim=0)
            return mean.to(shards[0].dtype)
        if check:
            check_copies_agree(shards, name=name)
        return shards[0].clone()

    def to_json(self):
        return {"kind": self.kind}


@dataclass(frozen=True)
class Sharded(Pattern):
    """Split evenly along `dim`: 0 = column-parallel (output features), 1 = row-parallel (input features)."""

    dim: int
    kind: ClassVar[str] = "sharded"

    def __post_init__(self):
        if not isinstance(self.dim, int) or self.dim < 0:
            raise PatternError(f"Sharded dim must be a non-negative int, got {self.dim!r}")

    def validate(self, global_shape, tp_size, *, name=None):
        global_shape = tuple(global_shape)
        if tp_size < 1:
            raise LayoutError(f"{_label(name)}TP={tp_size} must be >= 1")
        if len(global_shape) <= self.dim:
            raise PatternError(f"{_label(name)}shape {global_shape} has no dim {self.dim} to shard")
        size = global_shape[self.dim]
        if size % tp_size:
            raise LayoutError(self._not_divisible(name, size, tp_size))

    def _not_divisible(self, name, size, tp_size) -> str:
        return (f"{_label(name)}dim {self.dim} has size {size}, not divisible by TP={tp_size}; "
                f"choose TP in {_divisors(size)}")

    def slice_ranges(self, global_shape, tp_rank, tp_size, *, name=None):
        global_shape = tuple(global_shape)
        _check_tp(tp_rank, tp_size)
        self.validate(global_shape, tp_size, name=name)
        block = global_shape[self.dim] // tp_size
        return [_along(global_shape, self.dim, tp_rank * block, (tp_rank + 1) * block)]

    def consolidate(self, shards, *, name=None):
        import torch
        self._check_shards(shards, name)
        return torch.cat(list(shards), dim=self.dim)

    def to_json(self):
        return {"kind": self.kind, "dim": self.dim}


@dataclass(frozen=True)
class VocabSharded(Sharded):
    """Embedding / output-layer rows split over TP. The global tensor keeps every padded row: Megatron
    trains the padding rows and they enter the softmax, so dropping or adding rows changes the loss."""

    dim: int = 0
    kind: ClassVar[str] = "vocab_sharded"

    def __post_init__(self):
        if self.dim != 0:
            raise PatternError(f"VocabSharded always splits dim 0 (vocabulary rows), got {self.dim}")

    def _not_divisible(self, name, size, tp_size) -> str:
        return (f"{_label(name)}padded vocabulary of {size} rows is not divisible by TP={tp_size}; re-pad "
                f"with resize_vocab (adapters.gpt.padded_vocab_at gives the size), or choose TP in {_divisors(size)}")

    def to_json(self):
        return {"kind": self.kind}


@dataclass(frozen=True)
class FusedSubParams(Pattern):
    """Sub-parameters concatenated along `dim`, each sharded along `dim` on its own.

    Global layout: [part_0; part_1; ...]. Per TP rank: [part_0 shard r; part_1 shard r; ...]
    (SwiGLU fc1: global [gate; up], rank r holds [gate_r; up_r]). `parts` are relative sizes.
    """

    dim: int
    parts: Tuple[int, ...]
    kind: ClassVar[str] = "fused_sub_params"

    def __post_init__(self):
        object.__setattr__(self, "parts", tuple(int(p) for p in self.parts))
        if not isinstance(self.dim, int) or self.dim < 0:
            raise PatternError(f"FusedSubParams dim must be a non-negative int, got {self.dim!r}")
        if not self.parts or any(p < 1 for p in self.parts):
            raise PatternError(f"FusedSubParams parts must be positive relative sizes, got {self.parts}")

    def part_sizes(self, total: int, *, name: Optional[str] = None) -> List[int]:
        """Global size of each sub-parameter along `dim`."""
        unit, rem = divmod(total, sum(self.parts))
        if rem:
            raise PatternError(f"{_label(name)}dim {self.dim} of size {total} cannot be split in parts "
                               f"{self.parts}")
        return [p * unit for p in self.parts]

    def validate(self, global_shape, tp_size, *, name=None):
        global_shape = tuple(global_shape)
        if tp_size < 1:
            raise LayoutError(f"{_label(name)}TP={tp_size} must be >= 1")
        if len(global_shape) <= self.dim:
            raise PatternError(f"{_label(name)}shape {global_shape} has no dim {self.dim} to shard")
        sizes = self.part_sizes(global_shape[self.dim], name=name)
        if any(size % tp_size for size in sizes):
            ok = _divisors(math.gcd(*sizes))
            raise LayoutError(f"{_label(name)}sub-parameters of sizes {sizes} along dim {self.dim} are not "
                              f"each divisible by TP={tp_size}; choose TP in {ok}")

    def slice_ranges(self, global_shape, tp_rank, tp_size, *, name=None):
        global_shape = tuple(global_shape)
        _check_tp(tp_rank, tp_size)
        self.validate(global_shape, tp_size, name=name)
        ranges, start = [], 0
        for size in self.part_sizes(global_shape[self.dim]):
            block = size // tp_size
            ranges.append(_along(global_shape, self.dim, start + tp_rank * block, start + (tp_rank + 1) * block))
            start += size
        return ranges

    def consolidate(self, shards, *, name=None):
        import torch
        self._check_shards(shards, name)
        local_sizes = self.part_sizes(shards[0].shape[self.dim], name=name)
        split = [s.split(local_sizes, dim=self.dim) for s in shards]
        per_part = [torch.cat([pieces[i] for pieces in split], dim=self.dim) for i in range(len(self.parts))]
        return torch.cat(per_part, dim=self.dim)

    def to_json(self):
        return {"kind": self.kind, "dim": self.dim, "parts": list(self.parts)}


@dataclass(frozen=True)
class GroupedQKV(Pattern):
    """Megatron's fused QKV (weight or bias), rows grouped per query group g:
    [q heads of g (heads_per_group x head_dim rows), k_g (head_dim), v_g (head_dim)].

    Each TP rank holds whole consecutive groups, so this is dim-0 sharding of the global grouped layout,
    valid only when TP divides num_query_groups. MHA: heads_per_group=1; MQA: num_query_groups=1.
    """

    num_query_groups: int
    heads_per_group: int
    head_dim: int
    kind: ClassVar[str] = "grouped_qkv"
    dim: ClassVar[int] = 0

    def __post_init__(self):
        for field in ("num_query_groups", "heads_per_group", "head_dim"):
            if int(getattr(self, field)) < 1:
                raise PatternError(f"GroupedQKV {field} must be >= 1, got {getattr(self, field)}")

    @property
    def rows_per_group(self) -> int:
        return (self.heads_per_group + 2) * self.head_dim

    @property
    def rows(self) -> int:
        return self.num_query_groups * self.rows_per_group

    def validate(self, global_shape, tp_size, *, name=None):
        global_shape = tuple(global_shape)
        if tp_size < 1:
            raise LayoutError(f"{_label(name)}TP={tp_size} must be >= 1")
        if not global_shape or global_shape[0] != self.rows:
            raise PatternError(
                f"{_label(name)}QKV of shape {global_shape} does not have {self.rows} rows = "
                f"num_query_groups={self.num_query_groups} x (heads_per_group={self.heads_per_group} + 2) x "
                f"head_dim={self.head_dim}; the model config does not match the checkpoint")
        if self.num_query_groups % tp_size:
            raise LayoutError(f"{_label(name)}num_query_groups={self.num_query_groups} not divisible by "
                              f"TP={tp_size}; choose TP in {_divisors(self.num_query_groups)}")

    def slice_ranges(self, global_shape, tp_rank, tp_size, *, name=None):
        global_shape = tuple(global_shape)
        _check_tp(tp_rank, tp_size)
        self.validate(global_shape, tp_size, name=name)
        block = global_shape[0] // tp_size
        return [_along(global_shape, 0, tp_rank * block, (tp_rank + 1) * block)]

    def consolidate(self, shards, *, name=None):
        import torch
        self._check_shards(shards, name)
        full = torch.cat(list(shards), dim=0)
        self.validate(tuple(full.shape), len(shards), name=name)
        return full

    def split_qkv(self, full: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global grouped QKV -> (q, k, v) with q heads in order h = g * heads_per_group + j (HF order)."""
        self.validate(tuple(full.shape), 1)
        rest = tuple(full.shape[1:])
        grouped = full.reshape(self.num_query_groups, self.heads_per_group + 2, self.head_dim, *rest)
        q = grouped[:, : self.heads_per_group].reshape(-1, *rest)
        k = grouped[:, self.heads_per_group].reshape(-1, *rest)
        v = grouped[:, self.heads_per_group + 1].reshape(-1, *rest)
        return q.clone(), k.clone(), v.clone()

    def merge_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Inverse of split_qkv."""
        import torch
        groups, hpg, hd = self.num_query_groups, self.heads_per_group, self.head_dim
        rest = tuple(q.shape[1:])
        want = {"q": groups * hpg * hd, "k": groups * hd, "v": groups * hd}
        for label, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[0] != want[label] or tuple(t.shape[1:]) != rest:
                raise PatternError(f"merge_qkv: {label} has shape {tuple(t.shape)}, expected "
                                   f"({want[label]}, {', '.join(map(str, rest))})")
        grouped = torch.cat([q.reshape(groups, hpg, hd, *rest), k.reshape(groups, 1, hd, *rest),
                             v.reshape(groups, 1, hd, *rest)], dim=1)
        return grouped.reshape(self.rows, *rest)

    def to_json(self):
        return {"kind": self.kind, "num_query_groups": self.num_query_groups,
                "heads_per_group": self.heads_per_group, "head_dim": self.head_dim}


_KINDS: Dict[str, Type[Pattern]] = {
    cls.kind: cls for cls in (Replicated, Sharded, VocabSharded, FusedSubParams, GroupedQKV)}


def pattern_from_json(d: dict) -> Pattern:
    """Inverse of Pattern.to_json; unknown kinds or fields raise PatternError."""
    if not isinstance(d, dict) or d.get("kind") not in _KINDS:
        raise PatternError(f"unknown pattern {d!r}; known kinds: {sorted(_KINDS)}")
    fields = {k: v for k, v in d.items() if k != "kind"}
    kind = d["kind"]
    try:
        if kind in ("replicated", "vocab_sharded"):
            if fields:
                raise TypeError(f"unexpected fields {sorted(fields)}")
            return _KINDS[kind]()
        if kind == "sharded":
            dim = fields.pop("dim")
            if fields:
                raise TypeError(f"unexpected fields {sorted(fields)}")
            return Sharded(int(dim))
        if kind == "fused_sub_params":
            dim, parts = fields.pop("dim"), fields.pop("parts")
            if fields:
                raise TypeError(f"unexpected fields {sorted(fields)}")
            return FusedSubParams(int(dim), tuple(parts))
        return GroupedQKV(**{k: int(v) for k, v in fields.items()})
    except (KeyError, TypeError) as e:
        raise PatternError(f"malformed {kind} pattern {d!r}: {e}") from None


# ---------------------------------------------------------------------------------------------------
# Vocabulary padding


def resize_vocab(full: torch.Tensor, new_padded_rows: int, true_vocab_size: int, *,
                 fill: str = "mean_padding") -> Tuple[torch.Tensor, Optional[str]]:
    """Change the number of padded vocabulary rows (dim 0) of a consolidated tensor.

    Rows beyond `new_padded_rows` are dropped (never rows of the true vocabulary); new rows are appended:
    - fill="zeros": zeros. Use for optimizer moments (a fresh row has no history).
    - fill="mean_padding" (weights): the mean of the existing padding rows, or of all rows when there
      are none. Padding rows are never targets, so training drives their logits down; a logit is linear
      in the row, so the mean row's logit is the mean of theirs and, by Jensen, adds at most their
      average softmax mass — unlike a zero row, whose logit 0 can outweigh trained padding rows.
    Returns (tensor, warning); warning is None when the size is unchanged, else says the loss shifts.
    """
    import torch
    stored = full.shape[0]
    if new_padded_rows < true_vocab_size:
        raise PatternError(f"cannot resize vocabulary to {new_padded_rows} rows: the true vocabulary has "
                           f"{true_vocab_size} tokens; choose at least {true_vocab_size}")
    if stored < true_vocab_size:
        raise PatternError(f"tensor has {stored} rows, fewer than the true vocabulary {true_vocab_size}")
    if fill not in ("zeros", "mean_padding"):
        raise PatternError(f"unknown fill {fill!r}; use 'zeros' (optimizer moments) or 'mean_padding' (weights)")
    if new_padded_rows == stored:
        return full, None
    if new_padded_rows < stored:
        resized = full[:new_padded_rows].clone()
        change = f"dropped padding rows {new_padded_rows}..{stored - 1}"
    else:
        extra_shape = (new_padded_rows - stored, *full.shape[1:])
        if fill == "zeros":
            extra = torch.zeros(extra_shape, dtype=full.dtype)
        else:
            source = full[true_vocab_size:] if stored > true_vocab_size else full
            extra = source.to(torch.float64).mean(dim=0, keepdim=True).to(full.dtype).expand(extra_shape)
        resized = torch.cat([full, extra.to(full.device)], dim=0)
        change = f"appended padding rows {stored}..{new_padded_rows - 1} ({fill})"
    warning = (f"padded vocabulary changed from {stored} to {new_padded_rows} rows ({change}); padding rows "
               "enter Megatron's softmax, so the loss will shift slightly from the source run")
    return resized, warning


def repadded_shard(full: torch.Tensor, pattern: Pattern, new_padded_rows: int, true_vocab_size: int, key: str,
                   tp_rank: int, tp_size: int, *, name: Optional[str] = None) -> torch.Tensor:
    """TP rank's shard of a vocabulary tensor re-padded to `new_padded_rows` (resize_vocab, weights filled
    with the mean padding row, the optimizer's states (Adam's moments, SGD's momentum: any key but 'fp32') with
    zeros)."""
    fill = "mean_padding" if key == "fp32" else "zeros"
    resized, _ = resize_vocab(full, new_padded_rows, true_vocab_size, fill=fill)
    return pattern.slice_for_rank(resized, tp_rank, tp_size, name=name)
