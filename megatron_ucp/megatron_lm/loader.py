"""Fill a live megatron-core GPT model and its optimizer from a universal checkpoint, at any layout.

`--load` is a universal checkpoint, or the run's own Megatron-LM checkpoint (a --save root or an iteration
folder, any format and release to-universal reads): then rank 0 indexes it (`convert.runner.source_index`: the
lazy universal checkpoint `to-universal --lazy` would write, in memory, without checksums) and shares the index
with every rank (`open_for_load`), so every rank reads its slices straight from the source files. Either way
every rank walks its own model chunks' parameters, maps each to its canonical name and UCP pattern
(adapters.gpt), and reads only what it holds:
- with the distributed optimizer, the fp32 master weight and Adam moments of the flat range its
  data-parallel rank owns (only the rows covering that range are read); the model weight is that
  range cast to the model dtype, and one all-gather of the DDP parameter buffers over the
  data-parallel group (megatron-core's own param sync) completes it, so DP ranks never read the same
  bytes twice;
- otherwise the whole tensor-parallel slice of the weight (pieces given by `pattern.slice_ranges`)
  and of each Adam moment.
Each parameter gets its own Adam `step`. Values Adam cannot hold (non-finite, a negative second moment: a damaged
checkpoint) are refused; a rank that cannot load stops every rank with its error before any collective
(`_agree`). Then the LR scheduler, iteration and consumed samples, and
the run state (restore_run_state): the fp16 loss scaler, the FLOP counter, and the RNG states, which
are restored only at the layout that drew them (elsewhere every rank re-seeds deterministically).

Mixture of experts, at any EP x ETP: a rank holds the routed experts of its EP rank (local index j is
global expert ep*E/EP + j) and reads their slices for its expert-TP rank; with experts in their own
optimizer the expert DistributedOptimizer owns a range of the expert buffers (sharded over the
expert-data-parallel group), read the same way, and the same param all-gather completes them. The
router's `expert_bias` (a persistent buffer, no optimizer state) is copied whole.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from megatron_ucp.adapters import gpt as rulebook
from megatron_ucp.core import optimizers
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.core.patterns import repadded_shard
from megatron_ucp.formats.common import layout_from_args
from megatron_ucp.megatron_lm.cpu_shims import device, init_adam_state_for_loading, leaf_optimizers

# Model-config fields that must match between the universal checkpoint and the run.
MUST_MATCH = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "vocab_size", "swiglu", "normalization", "position_embedding_type",
              "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
              "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
              "moe_layers", "moe_router_enable_expert_bias", "multi_latent_attention", "q_lora_rank", "kv_lora_rank",
              "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers")
FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels", "vocab_size": "--vocab-size / --tokenizer-type", "swiglu": "--swiglu",
    "normalization": "--normalization", "position_embedding_type": "--position-embedding-type",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "add_bias_linear": "--disable-bias-linear", "add_qkv_bias": "--add-qkv-bias", "qk_layernorm": "--qk-layernorm",
    "num_experts": "--num-experts", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_shared_expert_gate": "--moe-shared-expert-gate", "moe_layers": "--moe-layer-freq",
    "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
    "multi_latent_attention": "--multi-latent-attention", "q_lora_rank": "--q-lora-rank",
    "kv_lora_rank": "--kv-lora-rank", "qk_head_dim": "--qk-head-dim", "qk_pos_emb_head_dim": "--qk-pos-emb-head-dim",
    "v_head_dim": "--v-head-dim", "mtp_num_layers": "--mtp-num-layers",
}


class UniversalLoadError(RuntimeError):
    pass


class JobLoadError(UniversalLoadError):
    """A load error every rank of the job raises alike, after agreeing on it (`_agree`, `_from_rank0`): each rank
    may wait for the others before it exits (universal_plugin._stop_on_user_error), so every rank says it."""


# --- what --load is: a universal checkpoint, or the run's own Megatron-LM checkpoint (direct resume) -------------

def is_direct(args) -> bool:
    """Whether --load is a Megatron-LM checkpoint (a --save root or an iteration folder) rather than a universal
    checkpoint: then every rank reads it directly through an index of it (open_for_load)."""
    from megatron_ucp.formats import megatron_kind

    return bool(args.load) and megatron_kind(Path(args.load)) is not None


def _source_error(e: Exception) -> UniversalLoadError:
    """A Megatron-LM checkpoint the direct resume refuses (damaged, incomplete, of a format or model this tool
    does not read): one line naming it and the fix."""
    text = " ".join(str(e).split())
    return UniversalLoadError(f"{text} (--load of --universal-checkpoint, read directly; the checkpoint was not "
                              f"changed)")


_SOURCE_ERRORS = (ValueError, OSError)  # what the readers raise on a checkpoint (their errors are ValueErrors)


def checkpoint_config(args) -> GPTModelConfig:
    """The model config of the checkpoint at --load (universal, or a Megatron-LM checkpoint's args), at argument
    time: every rank opens it itself (as Megatron-LM's --use-checkpoint-args reads the args), so a checkpoint
    that cannot be opened is refused by every rank before the model is built."""
    return _at_argument_time(args, lambda ucp: ucp.config, lambda source: source.config)


def checkpoint_schedule(args) -> dict:
    """The learning-rate scheduler state of the checkpoint at --load (Megatron-LM's `opt_param_scheduler`; {}
    where none was saved), at argument time as checkpoint_config."""
    return _at_argument_time(args, lambda ucp: ucp.scheduler_state,
                             lambda source: source.common_state().get("opt_param_scheduler") or {})


def _at_argument_time(args, of_universal, of_source):
    """`of_universal(UniversalCheckpoint)` or `of_source(CheckpointReader)` of the checkpoint at --load; a Megatron-LM
    checkpoint the readers refuse is the user's error (_source_error)."""
    from megatron_ucp.formats import open_checkpoint
    from megatron_ucp.universal import UniversalCheckpoint, UniversalFormatError

    if not is_direct(args):
        return of_universal(UniversalCheckpoint.open(args.load))
    try:
        return of_source(open_checkpoint(args.load, getattr(args, "ckpt_step", None) or None,
                                         weights_only=not loads_optimizer_state(args)))
    except UniversalFormatError:
        raise
    except _SOURCE_ERRORS as e:
        raise _source_error(e) from None


def loads_optimizer_state(args) -> bool:
    """Whether this run takes the checkpoint's optimizer state and learning-rate schedule (not with Megatron-LM's
    --no-load-optim or --finetune)."""
    return not args.no_load_optim and not args.finetune


def open_for_load(args):
    """The checkpoint at --load as a UniversalCheckpoint: a universal checkpoint opened (validated) by every
    rank; a Megatron-LM checkpoint indexed once by rank 0 (source_index: every check that needs no second pass
    over the data) and shared with every rank, each of which validates it against the files it sees. A source
    rank 0 refuses is refused by every rank, with rank 0's message."""
    from megatron_ucp.universal import UniversalCheckpoint, UniversalFormatError

    if not is_direct(args):
        return UniversalCheckpoint.open(args.load)
    waited = time.perf_counter()
    payload = json.loads(_from_rank0(lambda: _indexed(args)))
    waited = time.perf_counter() - waited
    rng = None if payload["rng"] is None else base64.b64decode(payload["rng"])
    ucp, problem = None, None
    try:  # every rank checks the index against the files it sees (a node with another copy is refused)
        ucp = UniversalCheckpoint.from_source_index(payload["document"], rng)
    except UniversalFormatError as e:
        problem = str(e)
    _agree(problem)
    if torch.distributed.get_rank() == 0:
        layout = layout_from_args(vars(args))
        source = ucp.metadata["source"]
        same = ucp.source_layout == layout
        print(f" > --universal-checkpoint: {args.load} is a Megatron-LM checkpoint ({source['format']}, written by "
              f"megatron-core {source.get('megatron_core')}, iteration {ucp.iteration} at "
              f"{ucp.source_layout.describe()}): every rank reads its slices straight from its files at "
              f"{layout.describe()}"
              + (" (the layout it was saved at: read the same way as at any other, so every check and the run "
                 "state are handled alike, not by Megatron-LM's own load)" if same else "")
              + f"; rank 0 indexed {len(ucp.parameters)} parameters in {payload['seconds']:.2f} s "
                f"({payload['workers']} threads, begun while the model was built; the load waited {waited:.2f} s "
                f"for it and its broadcast), no byte of it written", flush=True)
        for notice in source.get("notices") or []:  # what the source's release saved wrongly, and what is done
            print(f" > --universal-checkpoint: notice: {notice}", flush=True)
    return ucp


# rank 0's index of a direct resume's --load, started at argument time (start_indexing): (load, step) -> the thread
# and its outcome
_INDEXING: Dict[tuple, tuple] = {}


def start_indexing(args) -> None:
    """On rank 0 of a direct resume, start indexing --load in a thread at argument time, so that the index is made
    while Megatron-LM builds the model and the optimizer (open_for_load takes it from there). Measured on
    benchmarks/bench_direct_load.py's 110M-parameter checkpoint: 0.3 s warm, 1.0-1.4 s cold among starting ranks."""
    import threading

    if not is_direct(args) or int(getattr(args, "rank", 0) or 0) != 0:
        return
    key = _index_key(args)
    if key in _INDEXING:
        return
    outcome: dict = {}

    def index():
        try:
            outcome["payload"] = _index_payload(*key)
        except BaseException as e:  # noqa: BLE001 - raised again where the index is used (_indexed)
            outcome["error"] = e

    thread = threading.Thread(target=index, name="megatron-ucp-index", daemon=True)  # never delays an exit
    _INDEXING[key] = (thread, outcome)
    thread.start()


def _indexed(args) -> bytes:
    """Rank 0's index payload: the one start_indexing began, else made now."""
    entry = _INDEXING.pop(_index_key(args), None)
    if entry is None:
        return _index_payload(*_index_key(args))
    thread, outcome = entry
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["payload"]


def _index_key(args) -> tuple:
    """(--load, the iteration Megatron-LM's --ckpt-step asks for or None: the tracker's, whether optimizer state the
    source's release saved nowhere is reset, whether the optimizer's state is left unread: --no-load-optim /
    --finetune, which is also how the weights of a Lion or Muon run move to another layout)."""
    return (str(args.load), getattr(args, "ckpt_step", None) or None,
            bool(getattr(args, "universal_reset_lost_optimizer_state", False)), not loads_optimizer_state(args))


def _index_payload(load, step, reset_lost_optimizer_state=False, weights_only=False) -> bytes:
    from megatron_ucp.convert import source_index

    try:
        index = source_index(load, step, reset_lost_optimizer_state=reset_lost_optimizer_state,
                             weights_only=weights_only)
    except _SOURCE_ERRORS as e:
        raise _source_error(e) from None
    return json.dumps({"document": index.document, "seconds": index.seconds, "workers": index.workers,
                       "rng": None if index.rng is None else base64.b64encode(index.rng).decode()},
                      allow_nan=False).encode()


def _from_rank0(build) -> bytes:
    """The bytes rank 0's `build()` returns, on every rank; when it raises, every rank raises: the user's
    error (UniversalLoadError, UniversalFormatError) with rank 0's message, anything else (a bug) as a
    RuntimeError naming it on the other ranks while rank 0 raises the original."""
    from megatron_ucp.universal import UniversalFormatError

    rank, failure = torch.distributed.get_rank(), None
    if rank == 0:
        try:
            payload = b"ok" + build()
        except (UniversalLoadError, UniversalFormatError) as e:
            failure, payload = JobLoadError(str(e)), b"ue" + str(e).encode()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks learnt of it
            failure, payload = e, b"ex" + f"{type(e).__name__}: {e}".encode()
    else:
        payload = b""
    raw = _broadcast_bytes(payload, 0)
    if failure is not None:
        raise failure
    if raw[:2] == b"ue":
        raise JobLoadError(raw[2:].decode())
    if raw[:2] == b"ex":
        raise RuntimeError(f"rank 0 failed to index --load ({raw[2:].decode()}); see rank 0's traceback")
    return raw[2:]


def _agree(problem: Optional[str]) -> None:
    """Collective: when any rank found a problem, every rank raises UniversalLoadError with the lowest such
    rank's message (so one damaged piece, read by one rank, stops the whole job before its first step)."""
    world = torch.distributed.get_world_size()
    first = torch.tensor([torch.distributed.get_rank() if problem else world], dtype=torch.int64, device=device())
    torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return
    raise JobLoadError(_broadcast_bytes((problem or "").encode(), src).decode())


def _broadcast_bytes(payload: bytes, src: int) -> bytes:
    """Rank `src`'s `payload` on every rank (its length first; a uint8 tensor on the process group's device)."""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device())
    torch.distributed.broadcast(size, src=src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device())
    if torch.distributed.get_rank() == src and payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    torch.distributed.broadcast(data, src=src)
    return bytes(data.cpu().numpy())


def _check_values(ucp, name: str, key: str, values: torch.Tensor, row=None) -> None:
    """Values the optimizer's state cannot hold (a NaN or an infinity, a negative second moment: `row`'s
    nonnegative states) mean a damaged checkpoint (a flipped sign or exponent bit): refused, since nothing but such a
    check sees them without checksums."""
    bad = ~torch.isfinite(values)
    nonnegative = row is not None and key in row.nonnegative
    if nonnegative:
        bad |= values < 0
    count = int(bad.sum())
    if count:
        what = "negative or non-finite" if nonnegative else "non-finite"
        raise UniversalLoadError(
            f"{ucp.path}: {name} [{key}] holds {count} {what} value(s) (first: {values.reshape(-1)[bad.reshape(-1)][0]}"
            f"), which training never writes: the checkpoint is damaged (a flipped bit?); restore it from a copy")


def open_for_run(args):
    """Open args.load as a universal checkpoint and fix the run's padded vocab size before the model is built."""
    from megatron_ucp.universal import UniversalCheckpoint

    ucp = UniversalCheckpoint.open(args.load)
    stored = ucp.config.padded_vocab_size
    target = rulebook.padded_vocab_at(ucp.config, args.tensor_model_parallel_size)
    if target != stored and torch.distributed.get_rank() == 0:
        print(f"WARNING: the universal checkpoint's padded vocabulary ({stored} rows) is not divisible by "
              f"TP={args.tensor_model_parallel_size}; re-padding to {target} rows. Padding rows enter the "
              "softmax, so the loss shifts slightly after this resume.", flush=True)
    args.padded_vocab_size = target
    return ucp


def check_compatible(ucp, args) -> None:
    ours = GPTModelConfig.from_megatron_args(args)
    try:
        rulebook.expected_parameters(ours)  # a model the rulebook cannot hold (e.g. --mla-down-proj-fusion)
    except (ValueError, NotImplementedError) as e:
        raise UniversalLoadError(f"this run's model: {e}") from None
    theirs = ucp.config
    problems = []
    for name in MUST_MATCH:
        a, b = getattr(theirs, name), getattr(ours, name)
        if a != b:
            problems.append(f"{name}: checkpoint {a!r}, this run {b!r} (set {FLAGS.get(name, name)})")
    if problems:
        raise UniversalLoadError(f"{ucp.path}: the model config differs from this run's: " + "; ".join(problems))
    ckpt_gbs = ucp.args.get("global_batch_size")
    if ckpt_gbs is not None and ckpt_gbs != args.global_batch_size and not args.universal_allow_batch_change:
        raise UniversalLoadError(
            f"{ucp.path}: trained with --global-batch-size {ckpt_gbs}, this run uses {args.global_batch_size}; "
            f"pass --global-batch-size {ckpt_gbs} to continue the same curve, or --universal-allow-batch-change")
    if ucp.iteration > args.train_iters:
        raise UniversalLoadError(f"{ucp.path}: checkpoint is at iteration {ucp.iteration} but --train-iters is "
                                 f"{args.train_iters}; raise --train-iters")
    check_optimizer(ucp, args)


def check_run_optimizer(args) -> None:
    """At argument time (universal_plugin's validate_args hook), before anything is built: an --optimizer whose
    state megatron-ucp does not map (core/optimizers.py: Lion, Muon, SOAP, adaptive Muon) when the run loads
    optimizer state, and SGD under --use-distributed-optimizer, which megatron-core 0.19 cannot build (its
    DistributedOptimizer asserts Adam or an init_state_fn; its SGD has none), each refused in one line."""
    ours = getattr(args, "optimizer", "adam")
    if ours == "sgd" and getattr(args, "use_distributed_optimizer", False):
        raise UniversalLoadError("--optimizer sgd with --use-distributed-optimizer: megatron-core 0.19 cannot build "
                                 "it (its DistributedOptimizer takes Adam or an optimizer with an init_state_fn, and "
                                 "SGD has none); drop --use-distributed-optimizer")
    why = optimizers.refusal(ours)
    if why is None and getattr(args, "use_layer_wise_distributed_optimizer", False):
        why = optimizers.layer_wise_refusal(ours, vars(args))
    if why is not None and loads_optimizer_state(args):
        raise UniversalLoadError(f"this run's {why}")


def check_optimizer(ucp, args) -> None:
    """This run's --optimizer against the optimizer whose state the checkpoint holds (universal, or the run's own
    Megatron-LM checkpoint indexed directly): another optimizer's state is never put into this one's (SGD would
    take Adam's keys and drop the momentum), and an optimizer whose state megatron-ucp does not map is refused
    (core/optimizers.py). Nothing to check with --no-load-optim / --finetune, or a checkpoint without state."""
    if not loads_optimizer_state(args) or not ucp.has_optimizer_state:
        return
    ours = getattr(args, "optimizer", "adam")
    why = optimizers.refusal(ours)
    if why is None and getattr(args, "use_layer_wise_distributed_optimizer", False):
        why = optimizers.layer_wise_refusal(ours, vars(args))
    if why is not None:
        raise UniversalLoadError(f"this run's {why}")
    theirs = ucp.optimizer_type
    if theirs != ours:
        raise UniversalLoadError(
            f"{ucp.path}: holds {theirs} optimizer state ({', '.join(ucp.optimizer_state_keys)}), but this run uses "
            f"--optimizer {ours}, which keeps {', '.join(optimizers.OPTIMIZERS[ours].states) or 'no state'}: pass "
            f"--optimizer {theirs} to continue with it, or --no-load-optim to start {ours} from zero (weights only)")
    saved, mine = optimizers.scalar_optimizer(theirs, ucp.args), optimizers.scalar_optimizer(ours, vars(args))
    if saved != mine:  # Muon's non-matrix parameters: another optimizer's state would be put into this one's
        raise UniversalLoadError(
            f"{ucp.path}: its {theirs} run gave the non-matrix parameters {saved}, this run gives them {mine}: pass "
            f"--muon-scalar-optimizer {saved} to continue with it, or --no-load-optim (weights only)")


def check_rotary_frequencies(ucp, args, model) -> None:
    """The checkpoint's llama3 RoPE scaling (--use-rope-scaling, --rope-scaling-factor) against this run's flags,
    then the built model's RoPE inverse frequencies (GPTModel.rotary_pos_emb.inv_freq, every chunk) against those
    megatron-core's RotaryEmbedding computes from the run's flags: a model that differs comes from a model builder
    that drops a flag. Megatron-LM 0.19's gpt_builders.py passes --use-rope-scaling to GPTModel but never
    --rope-scaling-factor (GPTModel's default 8 then), which makes a Llama 3.2 checkpoint (factor 32) another model.
    (--rotary-base may change at a resume: context extension.)"""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.utils import unwrap_model

    rotaries = [r for r in (getattr(unwrap_model(chunk), "rotary_pos_emb", None) for chunk in model)
                if isinstance(r, RotaryEmbedding)]  # none under MLA (its RoPE is inside the attention) or without RoPE
    if not rotaries:
        return
    scaled, factor = bool(ucp.args.get("use_rope_scaling")), float(ucp.args.get("rope_scaling_factor") or 8.0)
    if scaled != bool(args.use_rope_scaling) or (scaled and factor != float(args.rope_scaling_factor)):
        want = f"--use-rope-scaling --rope-scaling-factor {factor:g}" if scaled else "no --use-rope-scaling"
        raise UniversalLoadError(f"{ucp.path}: the checkpoint's RoPE is {'llama3 scaling' if scaled else 'unscaled'}"
                                 f" ({want}), this run's {'llama3 scaling' if args.use_rope_scaling else 'unscaled'}"
                                 f"; pass {want} as the checkpoint's model was trained")

    def frequencies(scaling_factor: float) -> torch.Tensor:
        return RotaryEmbedding(args.kv_channels, args.rotary_percent, rotary_base=args.rotary_base,
                               rope_scaling=args.use_rope_scaling, rope_scaling_factor=scaling_factor,
                               use_cpu_initialization=True).inv_freq.double()

    want = frequencies(float(args.rope_scaling_factor))
    for rotary in rotaries:
        built = rotary.inv_freq.detach().double().cpu()
        if built.shape == want.shape and torch.allclose(built, want, rtol=1e-6, atol=0):
            continue
        dropped = args.use_rope_scaling and built.shape == want.shape and \
            torch.allclose(built, frequencies(8.0), rtol=1e-6, atol=0)
        raise UniversalLoadError(
            f"{ucp.path}: the model this run built computes other RoPE frequencies than its flags say ("
            + (f"llama3 scaling with factor 8, GPTModel's default, for --rope-scaling-factor {factor:g}): its model "
               "builder does not pass the factor on (Megatron-LM 0.19's gpt_builders.py passes rope_scaling only); add "
               "`rope_scaling_factor=args.rope_scaling_factor,` to the GPTModel(...) call of the model provider, or "
               "train with megatron-ucp's pretrain_scripts/pretrain_gpt.py" if dropped else
               "megatron-core's RotaryEmbedding of --rotary-base, --rotary-percent, --use-rope-scaling and "
               "--rope-scaling-factor): its model builder does not pass them on to GPTModel"))


# --- reading slices ---------------------------------------------------------------------------

def _split_rank(name: str, layout, parallel_state) -> Tuple[int, int]:
    """(rank, size) of the tensor-parallel split a parameter has: expert-TP for routed experts, else TP."""
    if rulebook.rule_for(name).expert_tp:
        return parallel_state.get_expert_tensor_parallel_rank(), layout.expert_tp
    return parallel_state.get_tensor_model_parallel_rank(), layout.tp


def read_local_flat_range(ucp, name: str, key: str, tp_rank: int, tp: int, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of the flattened TP slice, reading only the rows of the slice that cover them
    (the stored pattern says where those rows are in the global tensor)."""
    info = ucp.parameters[name]
    local_shape = info.pattern.local_shape(info.shape, tp, name=name)
    row = math.prod(local_shape[1:])
    r0, r1 = start // row, -(-end // row)
    rows = ucp.read_local(name, key, tp_rank, tp, (slice(r0, r1),))
    return rows.reshape(-1)[start - r0 * row: end - r0 * row]


# --- optimizer plumbing -----------------------------------------------------------------------

@dataclass
class _MainParam:
    main: torch.Tensor  # the tensor the torch optimizer steps (a shard with the distributed optimizer)
    state: dict
    flat_range: Optional[Tuple[int, int]]  # range of the flattened model param it covers (None: whole)
    row: Any = None  # the core/optimizers.py row of the (sub-)optimizer stepping it


def _sub_optimizers(optimizer):
    return leaf_optimizers(optimizer)


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = _sub_optimizers(optimizer)
    return bool(subs) and all(isinstance(opt, DistributedOptimizer) for opt in subs)


def _main_params(optimizer, run: str = "adam") -> Dict[int, _MainParam]:
    """id(model param) -> the optimizer's main parameter for it on this rank, with the row of the optimizer whose
    param group holds it (`run`: this run's --optimizer; an emerging optimizer's scalar groups name theirs)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def row(group) -> Any:
        return optimizers.OPTIMIZERS[optimizers.group_optimizer(group, run)]

    found: Dict[int, _MainParam] = {}
    for opt in _sub_optimizers(optimizer):
        inner = opt.optimizer
        if isinstance(opt, DistributedOptimizer):
            for model_param, (gi, go) in opt.model_param_group_index_map.items():
                main = inner.param_groups[gi]["params"][go]
                r = opt._get_model_param_range_map(model_param)["param"]
                found[id(model_param)] = _MainParam(main, inner.state[main], (r.start, r.end), row(inner.param_groups[gi]))
        elif hasattr(opt, "float16_groups"):  # Float16OptimizerWithFloat16Params
            for gi, (model_group, main_group) in enumerate(zip(opt.float16_groups, opt.fp32_from_float16_groups)):
                for model_param, main in zip(model_group, main_group):
                    found[id(model_param)] = _MainParam(main, inner.state[main], None, row(inner.param_groups[gi]))
            for gi, group in enumerate(opt.fp32_from_fp32_groups):
                for p in group:
                    found[id(p)] = _MainParam(p, inner.state[p], None, row(inner.param_groups[gi]))
        else:  # FP32Optimizer: the model params are the optimizer's params
            for group in inner.param_groups:
                for p in group["params"]:
                    found[id(p)] = _MainParam(p, inner.state[p], None, row(group))
    return found


def _note_muon_tp(ucp, args, layout) -> None:
    """Muon with --muon-tp-mode blockwise orthogonalizes each TP shard of a matrix on its own: at another TP than
    the saved one the state loads exactly but the updates are not the old run's (nor are they at another TP
    under Megatron-LM's own load); said once, on rank 0."""
    saved_tp = ucp.source_layout.tp
    if (getattr(args, "optimizer", "") == "muon" and getattr(args, "muon_tp_mode", "blockwise") == "blockwise"
            and layout.tp != saved_tp and torch.distributed.get_rank() == 0):
        print(f"NOTE: Muon with --muon-tp-mode blockwise orthogonalizes each TP shard: at TP={layout.tp} (saved at "
              f"TP={saved_tp}) its momentum is the checkpoint's, exactly, but its updates differ from a continuation "
              f"at TP={saved_tp} (--muon-tp-mode duplicated orthogonalizes whole matrices at any TP)", flush=True)


# --- the load ---------------------------------------------------------------------------------

def _split_as_this_run(ucp, run_config: GPTModelConfig) -> None:
    """Read every parameter split as this run's model splits it: the rulebook's pattern for this run's config. It
    differs from the stored one only where megatron-core's specs differ (MLA's down projections: column-parallel in
    the local spec, duplicated in TransformerEngine's, e.g. a GPU run's checkpoint resumed on CPU), over the same
    global tensor."""
    for name, info in list(ucp.parameters.items()):
        pattern = rulebook.pattern_for(name, run_config)
        if pattern != info.pattern:
            ucp.parameters[name] = dataclasses.replace(info, pattern=pattern)


@torch.no_grad()
def load_universal_checkpoint(args, model, optimizer, scheduler, ucp=None) -> int:
    from megatron.core import parallel_state

    from megatron_ucp.core.layout import LayoutError
    from megatron_ucp.universal import UniversalFormatError

    if ucp is None:
        ucp = open_for_run(args)
    try:
        check_compatible(ucp, args)
        check_rotary_frequencies(ucp, args, model)
        problem = None
    except UniversalLoadError as e:
        problem = str(e)
    _agree(problem)
    _split_as_this_run(ucp, GPTModelConfig.from_megatron_args(args))
    config = ucp.config
    layout = layout_from_args(vars(args))
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank() if config.num_experts else 0
    target_padded = args.padded_vocab_size

    load_optim = loads_optimizer_state(args)
    if load_optim and not ucp.has_optimizer_state:
        if torch.distributed.get_rank() == 0:
            print("WARNING: the universal checkpoint holds no optimizer state; starting Adam from zero", flush=True)
        load_optim = False
    run = getattr(args, "optimizer", "adam")  # check_optimizer: the checkpoint's
    if load_optim:
        init_adam_state_for_loading(optimizer, run)
        _note_muon_tp(ucp, args, layout)
    mains = _main_params(optimizer, run) if load_optim else {}
    # With the distributed optimizer each DP rank reads only its own range; the param all-gather
    # below fills in the rest of every model weight.
    gather_params = load_optim and _is_distributed(optimizer)

    problem = None
    try:
        _load_tensors(ucp, model, layout, pp_rank, ep_rank, target_padded, mains, gather_params, parallel_state)
    except (UniversalLoadError, UniversalFormatError, LayoutError) as e:
        problem = " ".join(str(e).split())
    _return_freed_heap()
    _agree(problem)  # before the first collective below: a rank that cannot load stops them all

    if gather_params:
        for chunk in model:  # megatron-core DDP: all-gather each bucket's param shards over DP
            chunk.start_param_sync(force_sync=True)

    if load_optim:
        scheduler.load_state_dict(dict(ucp.scheduler_state))
    elif args.bf16 or args.fp16:
        optimizer.reload_model_params()  # fp32 main params start from the loaded weights
    args.iteration = ucp.iteration
    args.consumed_train_samples = ucp.consumed_train_samples
    restore_run_state(args, optimizer, ucp, layout, load_optim=load_optim)
    # Bytes read by all ranks together (benchmarks and tests check that no byte is read twice).
    bytes_read = torch.tensor([float(ucp.bytes_read)], dtype=torch.float64, device=device())
    torch.distributed.all_reduce(bytes_read)
    if torch.distributed.get_rank() == 0:
        what = "Megatron-LM checkpoint (directly)" if ucp.direct else "universal checkpoint"
        print(f" > loaded {what} {ucp.path} (iteration {ucp.iteration}, from "
              f"{ucp.source_layout.describe()}) at {layout.describe()}"
              + ("" if load_optim else " without optimizer state")
              + f"; all ranks read {int(bytes_read.item())} bytes of tensors", flush=True)
    return ucp.iteration


def _return_freed_heap() -> None:
    """Give the operating system back the heap the tensor reads freed. Their staging buffers (~100 MiB per rank
    at the 100m benchmark) are freed by the time the reads finish, but glibc keeps freed chunks in its arenas, so
    the rank trained on with them resident: that was the direct resume's +130 MiB per rank over Megatron-LM's
    own load (benchmarks/README.md, "Where the direct resume's memory went"). glibc's malloc_trim returns them;
    elsewhere (musl, macOS) there is nothing to call and nothing is done."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()  # tensors held only by reference cycles are freed first
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _load_tensors(ucp, model, layout, pp_rank: int, ep_rank: int, target_padded: int, mains: dict,
                  gather_params: bool, parallel_state) -> None:
    """This rank's slices of every parameter and buffer of its model chunks, into the model and the optimizer's
    main parameters and state, by name (each main parameter's row: the states of the optimizer stepping it; no
    main parameters without optimizer state) (no collective: the caller completes the weights with the param
    all-gather)."""
    from megatron.core.utils import unwrap_model

    config = ucp.config
    for vpp_chunk, chunk in enumerate(model):
        module = unwrap_model(chunk)  # the GPTModel inside DDP / Float16Module: checkpoints hold its names
        _load_buffers(ucp, module, layout, pp_rank, vpp_chunk, ep_rank, parallel_state, target_padded)
        for local, param in module.named_parameters():
            name = rulebook.canonical_name(local, layout, pp_rank, vpp_chunk if layout.vpp else None,
                                           config.num_layers, tied=config.tied, config=config, ep_rank=ep_rank)
            if name is None:
                continue
            if name not in ucp.parameters:
                raise UniversalLoadError(f"{ucp.path}: no tensor for parameter {name} (this rank's {local})")
            info = ucp.parameters[name]
            tp_rank, tp = _split_rank(name, layout, parallel_state)
            resize = rulebook.is_vocab_parameter(name) and info.shape[0] != target_padded
            main = mains.get(id(param))
            row = main.row if main is not None else None
            keys = ("fp32", *row.states) if row is not None else ("fp32",)
            if not set(keys) <= set(info.tensors):
                raise UniversalLoadError(
                    f"{ucp.path}: {name} holds {', '.join(info.tensors)}, but this run's {row.name} optimizer steps it "
                    f"and keeps {', '.join(row.states)}; the checkpoint's optimizer split is not this run's "
                    f"(--no-load-optim loads the weights alone)")

            if gather_params and not resize:
                local_shape = info.pattern.local_shape(info.shape, tp, name=name)
                if tuple(local_shape) != tuple(param.shape):
                    raise UniversalLoadError(f"{name}: universal slice for TP rank {tp_rank} has shape "
                                             f"{tuple(local_shape)}, the model expects {tuple(param.shape)}")
                if main is None:
                    continue  # no element of it in this DP rank's shard: the all-gather brings it
                start, end = main.flat_range
                for key in keys:
                    values = read_local_flat_range(ucp, name, key, tp_rank, tp, start, end)
                    _check_values(ucp, name, key, values, row)
                    if key == "fp32":
                        param.view(-1)[start:end].copy_(values.to(param.dtype))
                    target = main.main if key == "fp32" else main.state[key]
                    target.copy_(values.view_as(target).to(target.dtype))
                if row.step:
                    main.state["step"] = torch.tensor(float(info.step or 0), dtype=torch.float32)
                continue
            if resize:
                local_tensors = _resized_local(ucp, name, info, target_padded, config.vocab_size,
                                               tp_rank, tp, keys if main is not None else ("fp32",))
                weight = local_tensors["fp32"]
            else:
                weight = ucp.read_local(name, "fp32", tp_rank, tp)
            _check_values(ucp, name, "fp32", weight)
            if tuple(weight.shape) != tuple(param.shape):
                raise UniversalLoadError(f"{name}: universal slice for TP rank {tp_rank} has shape "
                                         f"{tuple(weight.shape)}, the model expects {tuple(param.shape)}")
            param.copy_(weight.to(param.dtype))

            if main is None:
                continue
            start, end = main.flat_range if main.flat_range else (0, param.numel())
            for key in keys:
                if resize:
                    values = local_tensors[key].reshape(-1)[start:end]
                elif key == "fp32":
                    values = weight.reshape(-1)[start:end]
                else:
                    values = read_local_flat_range(ucp, name, key, tp_rank, tp, start, end)
                if key != "fp32":  # the weight was checked above
                    _check_values(ucp, name, key, values, row)
                target = main.main if key == "fp32" else main.state[key]
                target.copy_(values.view_as(target).to(target.dtype))
            if row.step:
                main.state["step"] = torch.tensor(float(info.step or 0), dtype=torch.float32)


def _load_buffers(ucp, module, layout, pp_rank: int, vpp_chunk: int, ep_rank: int, parallel_state,
                  padded_vocab_size: int) -> None:
    """Persistent buffers the rulebook knows (the router's expert_bias): copied whole (replicated, no
    optimizer state). The rank's parameters are listed at the run's padded vocabulary (re-padded or not)."""
    config = dataclasses.replace(ucp.config, padded_vocab_size=padded_vocab_size)
    chunk = vpp_chunk if layout.vpp else None
    for local, shape, name in rulebook.parameters_for_rank(config, layout, pp_rank, chunk, ep_rank=ep_rank,
                                                           buffers=True):
        if not rulebook.is_buffer(name):
            continue
        if name not in ucp.parameters:
            raise UniversalLoadError(f"{ucp.path}: no tensor for buffer {name} (this rank's {local})")
        buffer = module.get_buffer(local)
        tp_rank, tp = _split_rank(name, layout, parallel_state)
        value = ucp.read_local(name, "fp32", tp_rank, tp)
        if tuple(value.shape) != tuple(buffer.shape):
            raise UniversalLoadError(f"{name}: universal tensor has shape {tuple(value.shape)}, the model's buffer "
                                     f"{local} has {tuple(buffer.shape)}")
        buffer.copy_(value.to(buffer.dtype))


def _resized_local(ucp, name, info, target_padded, true_vocab, tp_rank, tp, keys):
    """Vocab re-padding: read the global tensor, re-pad rows deterministically, take this rank's slice."""
    return {key: repadded_shard(ucp.read(name, key), info.pattern, target_padded, true_vocab, key, tp_rank, tp,
                                name=name) for key in keys}


# --- run state besides tensors: loss scaler, FLOP counter, RNG ------------------------------------

def rng_reseed(args, pp_rank: int, iteration: int) -> None:
    """Deterministic fresh RNG streams for a resume where the saved ones mean nothing (another layout,
    or none saved): Megatron's seeding with seed + 100 * pp_rank + 7919 * iteration, so a resume at a
    given layout is reproducible (and from-universal's legacy writer seeds the same way)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = args.seed + 100 * pp_rank + 7919 * iteration
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _restore_loss_scaler(optimizer, ucp, load_optim: bool) -> str:
    """Load the stored dynamic loss-scaler state into every sub-optimizer's scaler; returns what was done."""
    scalers = [opt.grad_scaler for opt in _sub_optimizers(optimizer)
               if getattr(opt, "grad_scaler", None) is not None and hasattr(opt.grad_scaler, "_hysteresis_tracker")]
    if not scalers:
        return "" if ucp.loss_scaler is None else "the checkpoint's fp16 loss scaler is not used (this run is not fp16)"
    if not load_optim:
        return "fp16 loss scaler starts from --initial-loss-scale (optimizer state not loaded)"
    if ucp.loss_scaler is None:
        return "fp16 loss scaler starts from --initial-loss-scale (the checkpoint holds none: it was not fp16)"
    for scaler in scalers:
        scaler.load_state_dict(ucp.loss_scaler.to_megatron())
    s = ucp.loss_scaler
    return f"fp16 loss scale {s.scale:g} (growth {s.growth_tracker}, hysteresis {s.hysteresis_tracker}) restored"


def _restore_rng(args, ucp, layout) -> str:
    """The saved RNG state of this rank when the run has the source's layout, else a deterministic re-seed.
    Returns why it re-seeded ('' when restored)."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_ucp.core.run_state import restore_rng, state_for_rank

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if args.no_load_rng or args.finetune:
        why = "--no-load-rng" if args.no_load_rng else "--finetune"
    else:
        why = ucp.rng_layout_problem(layout, args.micro_batch_size)
    state = None
    if not why:
        state = state_for_rank(ucp.rng_states(), pp_rank, parallel_state.get_tensor_model_parallel_rank(),
                               parallel_state.get_data_parallel_rank(),
                               dp_cp=parallel_state.get_data_parallel_rank(with_context_parallel=True),
                               dp_cp_size=parallel_state.get_data_parallel_world_size(with_context_parallel=True))
        live = tensor_parallel.get_cuda_rng_tracker().get_states()
        if state is None:
            why = "no RNG state was saved for this rank"
        elif {n: len(v) for n, v in state.tracker} != {n: v.numel() for n, v in live.items()}:
            why = "the RNG states were saved by another kind of generator (CPU vs CUDA)"
    # Every rank decides alike (same layout, same file), except the generator check: agree on it.
    ok = torch.tensor([0.0 if why else 1.0], device=device())
    torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    if ok.item() == 1.0:
        restore_rng(state)
        return ""
    rng_reseed(args, pp_rank, ucp.iteration)
    return why or "another rank could not restore its RNG state"


def restore_run_state(args, optimizer, ucp, layout, *, load_optim: bool) -> None:
    """After the tensors: the fp16 loss scaler, Megatron's FLOP counter and the RNG streams (restored at the
    source layout so dropout continues exactly; re-seeded deterministically elsewhere: docs/FORMAT.md
    "RNG states" says what cannot be equal and why)."""
    scaler = _restore_loss_scaler(optimizer, ucp, load_optim)
    if not args.finetune:
        args.num_floating_point_operations_so_far = ucp.num_floating_point_operations_so_far
    reseeded = _restore_rng(args, ucp, layout)
    if torch.distributed.get_rank() == 0:
        rng = "RNG states of the source ranks restored" if not reseeded else \
            f"RNG re-seeded from --seed and the iteration ({reseeded})"
        print(" > universal resume: " + "; ".join(x for x in (scaler, rng) if x), flush=True)
