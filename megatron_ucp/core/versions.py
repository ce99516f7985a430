"""What differs between megatron-core releases, as data: one row per release that changed something a
checkpoint reader or writer must know. Readers detect the release that wrote a checkpoint from the
checkpoint itself (`detect`); writers take the row of the release the user resumes with (`release`).

Nothing else in megatron-ucp branches on a version number: code asks a row's fields.

How a release is recognised: Megatron-LM pickles its whole argument namespace into every checkpoint, and
each release adds arguments. `markers` are arguments a release introduced that every later release still
has (checked against the wheels' `megatron/training` sources and against the args of real checkpoints:
tests/fixtures/megatron-lm (0.16.1) has none of them, tests/fixtures/megatron-core-0.19 has all). The
newest release whose markers are all present wrote the checkpoint. Releases before 0.17 add no marker
checked here, so 0.13-0.16 checkpoints are reported as "0.16 or older"; their formats are read by the
same rules (the optimizer's layout is recorded per checkpoint, in `content_metadata`).

A leaf module: imports nothing of megatron-ucp.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    # one ShardedObject 'rerun_state_machine_state' per rank); 0.16.1 saves it only while a rerun is pending
    rerun_state_always: bool
    # torch_dist with expert parallelism: RNG states sharded per (pp, tp, dp) rank (each DP rank's own
    # expert-parallel stream; Megatron-LM 0.16) or per (pp, tp) as without experts (0.17 on: get_rng_state)
    rng_per_dp_with_experts: bool


_METADATA_JSON_COMMON_PT = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                            "common_backend": "torch", "common_backend_version": 1}
_METADATA_JSON_SHARDED = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}

# Oldest first. Evidence for each field is in the comment of its row.
RELEASES: tuple[MegatronRelease, ...] = (
    # 0.16.1: tests/fixtures/megatron-lm (common.pt; Megatron-LM's legacy NullTokenizer appends EOD)
    MegatronRelease("0.16", "0.16 or older (0.13-0.16 add no marker argument)", (), "common.pt",
                    _METADATA_JSON_COMMON_PT, null_tokenizer_eod_in_vocab=False, torch_dist_files_per_rank=2,
                    rerun_state_always=False, rng_per_dp_with_experts=True),
    # 0.17.0 wheel: dist_checkpointing.core still writes common_backend; core NullTokenizer has vocab N + 1
    # (files per rank: TorchDistSaveShardedStrategy thread_count = args.dist_ckpt_workers; rerun state as 0.16)
    MegatronRelease("0.17", "0.17", ("dist_ckpt_workers", "lion_beta1"), "common.pt",
                    _METADATA_JSON_COMMON_PT, null_tokenizer_eod_in_vocab=False, torch_dist_files_per_rank=None,
                    rerun_state_always=False, rng_per_dp_with_experts=False),
    # 0.18.0 wheel: NullTokenizer(vocab_size, eod_id=None) has vocab N, EOD N - 1 (--null-tokenizer-eod-id)
    MegatronRelease("0.18", "0.18", ("fp4_param_gather", "use_layer_wise_param_layout"), "common.pt",
                    _METADATA_JSON_COMMON_PT, null_tokenizer_eod_in_vocab=True, torch_dist_files_per_rank=None,
                    rerun_state_always=False, rng_per_dp_with_experts=False),
    # 0.19.x: tests/fixtures/megatron-core-0.19 (no common.pt: ShardedObject common_state; metadata.json
    # without common_backend; one .distcp per rank; rerun_state_machine_state/shard_<rank>_<world> always)
    MegatronRelease("0.19", "0.19", ("override_ckpt_iteration", "freeze_all_layers"), "sharded",
                    _METADATA_JSON_SHARDED, null_tokenizer_eod_in_vocab=True, torch_dist_files_per_rank=None,
                    rerun_state_always=True, rng_per_dp_with_experts=False),
)
NEWEST = RELEASES[-1]
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


def write_default(source: Optional[Mapping[str, Any]]) -> MegatronRelease:
    """The release `from-universal` writes for when the user names none: the one that wrote the universal
    checkpoint's source (the stack the user trains with); a source converted before megatron-ucp recorded it
    was a 0.16 checkpoint (all it read then); a checkpoint with no Megatron source: the newest."""
    if not source or source.get("format") not in MEGATRON_FORMATS:  # e.g. import-hf: no Megatron source
        return NEWEST
    recorded = source.get("megatron_core")
    return release(recorded) if recorded else RELEASES[0]


def torch_dist_files_per_rank(row: MegatronRelease, args: Mapping[str, Any]) -> int:
    """How many .distcp files each rank of a save writes under this release with these args."""
    if row.torch_dist_files_per_rank is not None:
        return row.torch_dist_files_per_rank
    workers = args.get("dist_ckpt_workers")
    return workers if isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1 else 1


def detect(args: Mapping[str, Any]) -> MegatronRelease:
    """The release that wrote a checkpoint with these args: the newest whose markers are all present."""
    found = RELEASES[0]
    for row in RELEASES[1:]:
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
