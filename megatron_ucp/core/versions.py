"""What differs between megatron-core releases, as data: one row per release that changed something a
checkpoint reader or writer must know. Readers detect the release that wrote a checkpoint from the
checkpoint itself (`detect`); writers take the row of the release the user resumes with (`release`).

Nothing else in megatron-ucp branches on a version number: code asks a row's fields.

How a release is recognised: Megatron-LM pickles its whole argument namespace into every checkpoint, and
each release adds arguments. `markers` are arguments only that release and the ones after it in the table
have: from 0.15 on, arguments it introduced that every later release still has; for 0.13-0.14, two arguments
they have and 0.15 removed (checked against Megatron-LM's tagged `megatron/training/arguments.py`, the wheels'
sources and the args of real checkpoints: tests/fixtures/megatron-core-0.14 (0.14.0, 0.15.3),
tests/fixtures/megatron-lm (0.16.1), tests/fixtures/megatron-core-0.19). The newest release whose markers are
all present wrote the checkpoint; args with no markers at all (saves of megatron-ucp's retired 0.16.1 training
loop, which stored its own namespace) are 0.16's (`FALLBACK`). 0.13 and 0.14 save alike and are one row.

The distributed optimizer's torch_dist layout is recorded in each checkpoint (content_metadata
'distrib_optim_sharding_type'); `OPTIMIZER_SHARDINGS` says what each recorded name means for a reader, and each
release row which of them that release writes by default and which it can load (what `from-universal` may
write for it).

Writes: what each release's own code parses, sets and can unpickle is data extracted from its wheel's sources by
tools/extract_release_facts.py into release_facts.json (package data beside this module, read once on first
use): per release its SAFE_GLOBALS (what its legacy `torch.load(weights_only)` accepts), its enums' members, the
distributed optimizer's sharding types, when its rerun state machine saves, and (0.17 on, whose wheels carry
megatron/training) every argument `parse_args` defines with its default and the names set at run time.
`args_for_release` turns a universal checkpoint's JSON args into what that release's save pickles; the rows'
`distrib_optim_loads` and `rerun_state_always` are checked against the same facts by the tests.

A leaf module: imports nothing of megatron-ucp.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class MegatronRelease:
    """What one megatron-core release (and Megatron-LM of the same tag) writes and means."""

    name: str  # "0.19": the release line; `label` says how sure the detection is
    label: str  # what `inspect` shows
    markers: tuple[str, ...]  # args this release introduced (present in it and every later one)
    # torch_dist: where the common state (args, iteration, scheduler, optimizer param groups) lives:
    # "common.pt" (a torch.save file beside the .distcp files) or "sharded" (the ShardedObject
    # 'common_state/shard_0_1' inside the .distcp files, megatron-core >= 0.19; 0.19 still reads common.pt)
    torch_dist_common: str
    # torch_dist: metadata.json as the release writes it
    torch_dist_metadata_json: Mapping[str, Any]
    # NullTokenizer (--tokenizer-type NullTokenizer --vocab-size N): True when the vocabulary is N with EOD
    # = N - 1 (or --null-tokenizer-eod-id); False when EOD is appended (vocabulary N + 1, EOD = N)
    null_tokenizer_eod_in_vocab: bool
    # torch_dist: .distcp files per rank (the save strategy's writer threads): 2 in 0.16; None from 0.17 on,
    # where Megatron-LM sets them from --dist-ckpt-workers (default 1)
    torch_dist_files_per_rank: Optional[int]
    # torch_dist: every save holds the rerun state machine ('rerun_state_machine' in the common state and
    # one ShardedObject 'rerun_state_machine_state' per rank) unless --rerun-mode disabled (0.18 on:
    # RerunStateMachine.state_dict skips only a disabled machine); up to 0.17 only while a rerun is pending
    rerun_state_always: bool
    # torch_dist with expert parallelism: RNG states sharded per (pp, tp, dp) rank (each DP rank's own
    # expert-parallel stream; Megatron-LM 0.16) or per (pp, tp) as without experts (0.17 on: get_rng_state)
    rng_per_dp_with_experts: bool
    # torch_dist with --use-distributed-optimizer: the sharding type Megatron-LM of this release saves by
    # default, and those its DistributedOptimizer.load_state_dict accepts (names of OPTIMIZER_SHARDINGS)
    # (fully_sharded_model_space: up to 0.15; from 0.16 ShardedTensor.validate_metadata_integrity refuses its
    # flattened ranges, "ShardedTensor.flattened_range is not supported.", on load as on save)
    distrib_optim_default: str = "dp_reshardable"
    distrib_optim_loads: tuple[str, ...] = ("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter")
    # the module name of a multi-token prediction layer's transformer layer in state dicts (legacy files):
    # "transformer_layer" up to 0.16, "mtp_model_layer" from 0.17 (torch_dist keys say transformer_layer in every
    # release: MultiTokenPredictionLayer.sharded_state_dict maps it back); MultiTokenPredictionLayer.__init__
    mtp_inner_module: str = "mtp_model_layer"
    # torch_dist sharding types this release's distributed optimizer saves shifted when a DDP buffer has several
    # buckets (--overlap-grad-reduce: formats/bucket_layout.shifted_save_runs): sharded_param_state_fully_reshardable
    # slices the compact gathered state with the buffer's padded offsets (core_v0.15.0 to core_v0.19.0 alike, and
    # the 0.19.2 wheel; fixed on Megatron-LM main by NVIDIA/Megatron-LM#5077, in no release yet). Its load of
    # fully_reshardable (load_parameter_state_from_fully_reshardable, the same in all of them) reads each
    # parameter's state by its own model key, correctly: what a writer must give it is the true layout.
    shifted_shardings: tuple[str, ...] = ("fully_reshardable",)


@dataclass(frozen=True)
class OptimizerSharding:
    """One value of content_metadata['distrib_optim_sharding_type']: how the distributed optimizer's Adam state
    is laid out in a torch_dist checkpoint."""

    name: str
    # "buckets": flat DDP buckets per model-parallel rank ('optimizer.distributed.dp_group_idx_<m>...');
    # "model": per parameter under 'optimizer.state.<what>.<model key>', chunked like the weight;
    # "model_flat": per parameter, each TP-local shard flattened and split in DP ranges: saved as a tensor of
    #   shape (*fragments per axis, shard numel) with chunks (*fragment index, range start) (megatron-core's
    #   nd_flattened reformulation, dist_checkpointing/strategies/torch.py);
    # "gathered": one object per model-parallel rank with its DDP buffers gathered over DP (legacy
    #   distrib_optim.pt's content: formats/coalesced.coalesced_buffers);
    # None: a layout megatron-ucp does not read (`refusal` says what to do)
    space: Optional[str]
    main_param: str = "param"  # the saved name of the fp32 main weight in model space
    refusal: str = ""


OPTIMIZER_SHARDINGS: Mapping[str, OptimizerSharding] = {
    # megatron-core >= 0.15 default (Megatron-LM 0.15/0.16: DistributedOptimizer.sharded_param_state_dp_reshardable)
    "dp_reshardable": OptimizerSharding("dp_reshardable", "buckets"),
    # --dist-ckpt-optim-fully-reshardable (0.15 on)
    "fully_reshardable": OptimizerSharding("fully_reshardable", "model"),
    # megatron-core 0.13/0.14 default (Megatron-LM --ckpt-fully-parallel-save, on by default; 0.15/0.16 with
    # --dist-ckpt-save-pre-mcore-014): tests/fixtures/megatron-core-0.14
    "fully_sharded_model_space": OptimizerSharding("fully_sharded_model_space", "model_flat", main_param="fp32_param"),
    # --no-ckpt-fully-parallel-save (0.13/0.14; 0.15/0.16 with --dist-ckpt-save-pre-mcore-014): each
    # model-parallel rank's buffers gathered on DP rank 0 into one object 'optimizer.distributed.dp_group_idx_<m>.
    # param_state' holding what distrib_optim.pt holds (tests/fixtures/megatron-core-0.14/C14*)
    "dp_zero_gather_scatter": OptimizerSharding("dp_zero_gather_scatter", "gathered"),
    # megatron-core <= 0.14, never Megatron-LM's choice; deprecated there
    "fully_sharded_bucket_space": OptimizerSharding(
        "fully_sharded_bucket_space", None,
        refusal="a deprecated layout Megatron-LM never chooses itself; load it with megatron-core 0.14 and save "
                "with Megatron-LM's default (fully_sharded_model_space), or with --ckpt-format torch"),
}


def optimizer_sharding(name: Any) -> Optional[OptimizerSharding]:
    """What a recorded distrib_optim_sharding_type means; None for a name no release writes."""
    return OPTIMIZER_SHARDINGS.get(name) if isinstance(name, str) else None


_METADATA_JSON_COMMON_PT = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                            "common_backend": "torch", "common_backend_version": 1}
_METADATA_JSON_SHARDED = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}

# Oldest first. Evidence for each field is in the comment of its row.
RELEASES: tuple[MegatronRelease, ...] = (
    # 0.14.0: tests/fixtures/megatron-core-0.14 (Megatron-LM core_v0.14.0 on CPU). As 0.16 but the distributed
    # optimizer saves fully_sharded_model_space (--no-ckpt-fully-parallel-save: dp_zero_gather_scatter) and
    # DistributedOptimizer.sharded_state_dict knows no dp_reshardable / fully_reshardable (NotImplementedError).
    # RNG with experts per (pp, tp) (the M14 fixture; get_rng_state shards by DP with EP only from 0.16).
    # 0.13.1's _build_sharded_state_dict_metadata is the same (core_v0.13.1 checkpointing.py).
    # Markers: in core_v0.13.0-core_v0.14.0's arguments.py and the 0.14.0 args, removed in 0.15.0
    MegatronRelease("0.14", "0.14 or older (0.13-0.14 save alike)",
                    ("load_model_opt_format", "inference_dynamic_batching_chunk_size"), "common.pt",
                    _METADATA_JSON_COMMON_PT, null_tokenizer_eod_in_vocab=False, torch_dist_files_per_rank=2,
                    rerun_state_always=False, rng_per_dp_with_experts=False,
                    distrib_optim_default="fully_sharded_model_space",
                    distrib_optim_loads=("fully_sharded_model_space", "dp_zero_gather_scatter"),
                    mtp_inner_module="transformer_layer", shifted_shardings=()),
    # 0.15.3: tests/fixtures/megatron-core-0.14/E15* (Megatron-LM core_v0.15.3): dp_reshardable by default
    # (fully_sharded_model_space with --dist-ckpt-save-pre-mcore-014), otherwise as 0.16.1 but for RNG states
    # with experts, per (pp, tp) as in 0.14 (core_v0.15.3 get_rng_state). Markers: the
    # arguments of that choice (in the args of 0.15.3, 0.16.1 and 0.19.2 checkpoints, not in 0.14.0's)
    # 0.15.3's ShardedTensor still takes flattened ranges: it loads fully_sharded_model_space (release_facts)
    MegatronRelease("0.15", "0.15", ("dist_ckpt_save_pre_mcore_014", "dist_ckpt_optim_fully_reshardable"),
                    "common.pt", _METADATA_JSON_COMMON_PT, null_tokenizer_eod_in_vocab=False,
                    torch_dist_files_per_rank=2, rerun_state_always=False, rng_per_dp_with_experts=False,
                    distrib_optim_loads=("dp_reshardable", "fully_reshardable", "fully_sharded_model_space",
                                         "dp_zero_gather_scatter"),
                    mtp_inner_module="transformer_layer"),
    # 0.16.1: tests/fixtures/megatron-lm (common.pt; Megatron-LM's legacy NullTokenizer appends EOD). Markers: in
    # the args of 0.16.1 and 0.19.2 checkpoints (and 0.17.0/0.18.0's megatron/training), not in 0.15.3's
    MegatronRelease("0.16", "0.16", ("apply_wd_to_qk_layernorm", "dump_param_to_param_group_map"),
                    "common.pt", _METADATA_JSON_COMMON_PT, null_tokenizer_eod_in_vocab=False,
                    torch_dist_files_per_rank=2, rerun_state_always=False, rng_per_dp_with_experts=True,
                    mtp_inner_module="transformer_layer"),
    # 0.17.0 wheel: dist_checkpointing.core still writes common_backend; core NullTokenizer has vocab N + 1
    # (files per rank: TorchDistSaveShardedStrategy thread_count = args.dist_ckpt_workers; rerun state as 0.16)
    MegatronRelease("0.17", "0.17", ("dist_ckpt_workers", "lion_beta1"), "common.pt",
                    _METADATA_JSON_COMMON_PT, null_tokenizer_eod_in_vocab=False, torch_dist_files_per_rank=None,
                    rerun_state_always=False, rng_per_dp_with_experts=False),
    # 0.18.0 wheel: NullTokenizer(vocab_size, eod_id=None) has vocab N, EOD N - 1 (--null-tokenizer-eod-id);
    # the rerun state in every save (rerun_state_machine_state/shard_<rank>_<world> and common
    # 'rerun_state_machine'; real 0.18.0 CPU saves hold them), as 0.19
    MegatronRelease("0.18", "0.18", ("fp4_param_gather", "use_layer_wise_param_layout"), "common.pt",
                    _METADATA_JSON_COMMON_PT, null_tokenizer_eod_in_vocab=True, torch_dist_files_per_rank=None,
                    rerun_state_always=True, rng_per_dp_with_experts=False),
    # 0.19.x: tests/fixtures/megatron-core-0.19 (no common.pt: ShardedObject common_state; metadata.json
    # without common_backend; one .distcp per rank; rerun_state_machine_state/shard_<rank>_<world> always)
    MegatronRelease("0.19", "0.19", ("override_ckpt_iteration", "freeze_all_layers"), "sharded",
                    _METADATA_JSON_SHARDED, null_tokenizer_eod_in_vocab=True, torch_dist_files_per_rank=None,
                    rerun_state_always=True, rng_per_dp_with_experts=False),
)
NEWEST = RELEASES[-1]
FALLBACK = next(r for r in RELEASES if r.name == "0.16")  # args without any marker (module docstring)
MEGATRON_FORMATS = ("torch", "torch_dist")  # checkpoint formats whose writing release is recorded
SUPPORTED = tuple(r.name for r in RELEASES)


def release(name: str) -> MegatronRelease:
    """The row of a release named by the user ("0.19", "0.19.2", "0.16.1"); ValueError naming the choices."""
    parts = str(name).strip().split(".")
    short = ".".join(parts[:2])
    for row in RELEASES:
        if row.name == short:
            return row
    raise ValueError(f"megatron-core {name}: not a release megatron-ucp knows; choose one of "
                     f"{', '.join(SUPPORTED)} (the newest supported is {NEWEST.name})")


def write_choice(source: Optional[Mapping[str, Any]], named: Optional[str]) -> tuple[MegatronRelease, str]:
    """The release a write is for and why, in words for the user: the one named (--megatron-core-version); else
    the one that wrote the universal checkpoint's source (the stack the user trains with); a source converted
    before megatron-ucp recorded it was a 0.16 checkpoint (all it read then); a checkpoint with no Megatron
    source (import-hf): the newest, the one megatron-ucp installs. ValueError for a name no row has."""
    if named:
        return release(named), "--megatron-core-version"
    if not source or source.get("format") not in MEGATRON_FORMATS:  # e.g. import-hf: no Megatron source
        return NEWEST, "no Megatron source: the release megatron-ucp installs"
    recorded = source.get("megatron_core")
    if recorded:
        return release(recorded), "the release that wrote the source checkpoint"
    return FALLBACK, "a source converted before megatron-ucp recorded its release (0.16's then)"


def source_release(source: Optional[Mapping[str, Any]], args: Mapping[str, Any]) -> Optional[MegatronRelease]:
    """The release whose run the universal checkpoint's args come from (its enums' numbering): the recorded
    one, else the one its args show; None without a Megatron source."""
    if not source or source.get("format") not in MEGATRON_FORMATS:
        return None
    recorded = source.get("megatron_core")
    try:
        return release(recorded) if recorded else detect(args)
    except ValueError:
        return detect(args)


def loading(sharding: str) -> tuple[MegatronRelease, ...]:
    """The releases whose distributed optimizer loads this torch_dist sharding type."""
    return tuple(row for row in RELEASES if sharding in row.distrib_optim_loads)


def load_refusal(row: MegatronRelease, sharding: str) -> Optional[str]:
    """Why megatron-core `row` cannot load the distributed optimizer's torch_dist `sharding` (one line naming
    the releases that can and its own default), or None when it can."""
    if sharding in row.distrib_optim_loads:
        return None
    others = [r.name for r in loading(sharding)]
    names = f"{', '.join(others[:-1])} or {others[-1]}" if len(others) > 1 else "".join(others)
    where = f"target a release that loads it, --megatron-core-version {names}" if others else "no release loads it"
    return (f"megatron-core {row.name} cannot load the distributed optimizer's {sharding} torch_dist state: "
            f"write --optimizer-format {row.distrib_optim_default} (its default) for {row.name}, or {where}")


def saves_rerun_state(row: MegatronRelease, args: Mapping[str, Any]) -> bool:
    """Whether a torch_dist save of this release with these args holds the rerun state machine."""
    return row.rerun_state_always and args.get("rerun_mode", "validate_results") != "disabled"


def torch_dist_files_per_rank(row: MegatronRelease, args: Mapping[str, Any]) -> int:
    """How many .distcp files each rank of a save writes under this release with these args."""
    if row.torch_dist_files_per_rank is not None:
        return row.torch_dist_files_per_rank
    workers = args.get("dist_ckpt_workers")
    return workers if isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1 else 1


def detect(args: Mapping[str, Any]) -> MegatronRelease:
    """The release that wrote a checkpoint with these args: the newest whose markers are all present."""
    found = FALLBACK
    for row in RELEASES:
        if all(m in args for m in row.markers):
            found = row
    return found


def true_vocab_size(args: Mapping[str, Any], row: Optional[MegatronRelease] = None) -> Optional[int]:
    """The vocabulary the run really trained (before padding), as its release means its tokenizer args."""
    row = row or detect(args)
    vocab = args.get("vocab_size")
    if args.get("tokenizer_type") == "NullTokenizer" and vocab is not None:
        return vocab if row.null_tokenizer_eod_in_vocab else vocab + 1
    return vocab


# --------------------------------------------------------------------------------------------------
# Args and classes as each release's save holds them (release_facts.json)

FACTS_FILE = Path(__file__).with_name("release_facts.json")


@functools.lru_cache(maxsize=None)
def _all_facts() -> Mapping[str, Any]:
    return json.loads(FACTS_FILE.read_text())["releases"]


def facts(row: Optional[MegatronRelease]) -> Mapping[str, Any]:
    """What tools/extract_release_facts.py read from this release's wheel ({} for None)."""
    return _all_facts().get(row.name, {}) if row is not None else {}


def known_args(row: MegatronRelease) -> Optional[frozenset]:
    """Every argument name a save of this release can hold (parse_args' and those set at run time), or None
    where its wheel carries no megatron/training (0.14-0.16: args are written as the source has them)."""
    found = facts(row)
    return frozenset(found["args"]) | frozenset(found["runtime_args"]) if "args" in found else None


@functools.lru_cache(maxsize=None)
def megatron_args() -> frozenset:
    """The argument names some release's megatron/training defines; others in a checkpoint's args are an entry
    point's own (megatron-ucp's --log-jsonl, --universal-checkpoint, ...), which the target run defines itself."""
    return frozenset().union(*(known_args(row) or () for row in RELEASES))


_UNSAVABLE = object()
_SIGNALS = "signal.Signals."


def _value_for(value: Any, target: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
    """A JSON arg value as `target` can unpickle it: an enum member renumbered by its name from the source
    release's numbering (or the same numbering when the source's is unknown), a signal only where the target
    allows signal.Signals; _UNSAVABLE where the target lacks the class or the member."""
    if isinstance(value, dict) and set(value) == {"enum", "value"}:
        qualname, number = value["enum"], value["value"]
        members = target.get("enums", {}).get(qualname)
        if members is None or qualname not in target.get("safe_globals", ()):
            return _UNSAVABLE
        names = {v: k for k, v in (source.get("enums", {}).get(qualname) or members).items()}
        name = names.get(number)
        return {"enum": qualname, "value": members[name]} if name in members else _UNSAVABLE
    if isinstance(value, list):
        items = [_value_for(v, target, source) for v in value]
        return _UNSAVABLE if any(v is _UNSAVABLE for v in items) else items
    if isinstance(value, str) and value.startswith(_SIGNALS) and target:
        return value if "signal.Signals" in target.get("safe_globals", ()) else _UNSAVABLE
    return value


def args_for_release(args: Mapping[str, Any], row: MegatronRelease,
                     source: Optional[MegatronRelease] = None) -> dict:
    """The JSON args `row`'s own save would hold for a run with these args (a universal checkpoint's, from a run
    of `source`): arguments of Megatron-LM that `row` neither parses nor sets are dropped (an entry point's own,
    which no release defines, are kept as they are); those it parses and the args lack get its
    parse_args default (a release's markers included, so `detect` names it); enum members are renumbered by name
    into its classes, and a value of a class (or member) it lacks becomes its default, or is dropped without
    one; a NullTokenizer's --vocab-size says the same vocabulary in `row`'s meaning (true_vocab_size). Values
    keep their JSON form (megatron_state.args_values makes the pickled ones)."""
    target, origin = facts(row), facts(source)
    known = known_args(row)
    defaults = target.get("args", {})
    out = {}
    for key, value in args.items():
        if known is not None and key not in known and key in megatron_args():
            continue
        value = _value_for(value, target, origin)
        if value is _UNSAVABLE and key in defaults:
            value = _value_for(defaults[key], target, target)
        if value is not _UNSAVABLE:
            out[key] = value
    for key, value in defaults.items():
        if key not in out and key not in args:
            value = _value_for(value, target, target)
            if value is not _UNSAVABLE:
                out[key] = value
    vocab = true_vocab_size(args, source) if source is not None else None
    if args.get("tokenizer_type") == "NullTokenizer" and isinstance(vocab, int):
        out["vocab_size"] = vocab if row.null_tokenizer_eod_in_vocab else vocab - 1
    return out
