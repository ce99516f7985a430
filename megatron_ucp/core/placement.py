"""Which transformer layers each pipeline model chunk holds, for even and uneven pipelines.

megatron-core 0.16.1 places decoder layers with two functions: transformer_block.get_num_layers_to_build
(how many layers a (pp_rank, vp_stage) chunk builds) and transformer_layer.get_transformer_layer_offset
(the global index of its first layer). Both read four settings besides num_layers, PP and VPP
(Megatron-LM flags in brackets):
- num_layers_in_first_pipeline_stage [--decoder-first-pipeline-num-layers]: layers of PP rank 0, all
  its VPP chunks together; the other stages split the rest evenly;
- num_layers_in_last_pipeline_stage [--decoder-last-pipeline-num-layers]: the same for the last rank;
- account_for_embedding_in_pipeline_split [--account-for-embedding-in-pipeline-split]: the embedding
  counts as one layer of the even split, so the first chunk builds one transformer layer less;
- account_for_loss_in_pipeline_split [--account-for-loss-in-pipeline-split]: the output layer and
  loss count as one layer; the last chunk builds one transformer layer less.
The embedding always lives on (pp_rank 0, vpp_chunk 0), the final norm, output layer and loss on
(pp_rank PP-1, vpp_chunk VPP-1). Chunk (p, v) runs as virtual stage v * PP + p.

`validate` refuses what megatron-core's TransformerConfig and Megatron-LM's validate_args refuse, and
also what megatron-core 0.16.1 accepts but then places wrongly (it would build overlapping or missing
layers, or divide by zero); tests/test_layer_placement.py compares every chunk's range with
megatron-core's own functions over an exhaustive grid of small configurations.

Pure: no torch, no megatron import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


class PlacementError(ValueError):
    """A pipeline split megatron-core or Megatron-LM refuses, or would build wrongly."""


@dataclass(frozen=True)
class PipelineSplit:
    """How Megatron splits the decoder over pipeline stages (Megatron-LM's flags, resolved)."""

    num_layers: int
    pp: int = 1
    vpp: Optional[int] = None  # virtual stages per pipeline rank; None (or 1) without interleaving
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    account_for_embedding: bool = False
    account_for_loss: bool = False

    @property
    def num_chunks(self) -> int:
        return self.vpp if self.vpp and self.vpp > 1 else 1

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def describe(self) -> str:
        parts = [f"num_layers={self.num_layers}", f"PP={self.pp}"]
        if self.num_chunks > 1:
            parts.append(f"VPP={self.num_chunks}")
        if self.first_stage_layers is not None:
            parts.append(f"first stage {self.first_stage_layers} layers")
        if self.last_stage_layers is not None:
            parts.append(f"last stage {self.last_stage_layers} layers")
        if self.account_for_embedding:
            parts.append("embedding counted")
        if self.account_for_loss:
            parts.append("loss counted")
        return ", ".join(parts)


@dataclass(frozen=True)
class ChunkPlacement:
    pp_rank: int
    vpp_chunk: int
    layers: range  # global layer indices, in local order (local layer i is layers[i])
    has_embedding: bool
    has_loss: bool


def _vpp(split: PipelineSplit) -> Optional[int]:
    """The VPP size megatron-core's formulas see (None without interleaving)."""
    return split.vpp if split.vpp and split.vpp > 1 else None


def _check_config(split: PipelineSplit) -> None:
    """megatron-core 0.16.1 TransformerConfig.__post_init__ and Megatron-LM validate_args (core_v0.16.1)."""
    L, P, V = split.num_layers, split.pp, _vpp(split)
    name = split.describe()
    if L < 1 or P < 1:
        raise PlacementError(f"{name}: num_layers and PP must be positive")
    if split.vpp is not None and split.vpp < 1:
        raise PlacementError(f"{name}: VPP must be >= 1")
    if V is not None and P == 1:
        raise PlacementError(f"{name}: an interleaved pipeline needs PP > 1 (Megatron-LM asserts it)")
    if split.uneven and (split.account_for_embedding or split.account_for_loss):
        raise PlacementError(f"{name}: --decoder-first/last-pipeline-num-layers cannot be combined with "
                             "--account-for-embedding/loss-in-pipeline-split (megatron-core refuses it); pick one")
    if split.uneven and P == 1:
        raise PlacementError(f"{name}: --decoder-first/last-pipeline-num-layers need PP > 1")
    if split.uneven:
        middle_layers, middle_stages = L, P
        for flag, n in (("--decoder-first-pipeline-num-layers", split.first_stage_layers),
                        ("--decoder-last-pipeline-num-layers", split.last_stage_layers)):
            if n is None:
                continue
            if n <= 0:
                raise PlacementError(f"{name}: {flag} {n} must be larger than 0")
            if V is not None and n % V:
                raise PlacementError(f"{name}: {flag} {n} is not divisible by VPP={V}; each virtual "
                                     "stage of that rank gets the same number of layers")
            middle_layers -= n
            middle_stages -= 1
        if bool(middle_layers) != bool(middle_stages):
            raise PlacementError(f"{name}: {middle_layers} layers left for {middle_stages} middle stages; "
                                 "change the first/last stage layer counts so the middle stages get layers "
                                 "(or none of either)")
        if middle_stages and middle_layers % middle_stages:
            raise PlacementError(f"{name}: the {middle_layers} middle layers are not divisible by the "
                                 f"{middle_stages} middle stages")
        if middle_stages and V is not None and (middle_layers // middle_stages) % V:
            raise PlacementError(f"{name}: {middle_layers // middle_stages} layers per middle stage are not "
                                 f"divisible by VPP={V}")
        if middle_layers < 0:  # megatron-core accepts it, then builds a negative number of layers
            raise PlacementError(f"{name}: the first and last stages hold more than num_layers={L} layers")
        return
    counted = L + split.account_for_embedding + split.account_for_loss
    if counted % P:
        what = "num_layers" + (" + embedding" if split.account_for_embedding else "") + \
            (" + loss" if split.account_for_loss else "")
        raise PlacementError(f"{name}: {what} = {counted} is not divisible by PP={P}")
    if V is not None and (counted // P) % V:
        raise PlacementError(f"{name}: {counted // P} layers per pipeline stage are not divisible by VPP={V}")


def _chunk_size_and_offset(split: PipelineSplit, pp_rank: int, vpp_chunk: int) -> Tuple[int, int]:
    """(layers built, global offset) exactly as megatron-core 0.16.1 computes them."""
    L, P, V = split.num_layers, split.pp, _vpp(split)
    first, last = pp_rank == 0, pp_rank == P - 1
    vp_first, vp_last = vpp_chunk == 0, vpp_chunk == split.num_chunks - 1
    f, l = split.first_stage_layers, split.last_stage_layers
    if split.uneven:
        middle_stages = P - (f is not None) - (l is not None)
        middle_layers = L - (f or 0) - (l or 0)
        middle_per_rank = middle_layers // middle_stages if middle_stages > 0 else 0
        per_rank = middle_per_rank
        if first and f is not None:
            per_rank = f
        if last and l is not None:
            per_rank = l
    else:
        per_rank = (L + split.account_for_embedding + split.account_for_loss) // P
    size = per_rank // V if V is not None else per_rank
    if split.account_for_embedding and vp_first and first:
        size -= 1
    if split.account_for_loss and vp_last and last:
        size -= 1

    if P == 1:
        return size, 0
    if split.uneven:
        middle_rank = pp_rank if f is None else pp_rank - 1
        if V is not None:
            first_v = (f or 0) // V
            middle_v = middle_layers // V
            total_v = first_v + middle_v + (l or 0) // V
            if pp_rank == 0:
                return size, vpp_chunk * total_v
            if middle_stages == 0:
                raise PlacementError(f"{split.describe()}: megatron-core 0.16.1 divides by the number of "
                                     "middle stages (0 here) when placing interleaved chunks of uneven "
                                     "first and last stages; use PP > 2 or drop VPP")
            return size, vpp_chunk * total_v + first_v + middle_rank * (middle_v // middle_stages)
        return size, (0 if pp_rank == 0 else middle_rank * middle_per_rank + (f or 0))
    counted = L + split.account_for_embedding + split.account_for_loss
    per_rank = counted // P
    if V is not None:
        offset = vpp_chunk * (counted // V) + pp_rank * (per_rank // V)
    else:
        offset = pp_rank * per_rank
    if split.account_for_embedding and not (vp_first and first):
        offset -= 1
    return size, offset


def _raw_placements(split: PipelineSplit) -> Tuple[ChunkPlacement, ...]:
    out = []
    for vpp_chunk in range(split.num_chunks):
        for pp_rank in range(split.pp):
            size, offset = _chunk_size_and_offset(split, pp_rank, vpp_chunk)
            if size < 0:
                raise PlacementError(f"{split.describe()}: chunk (pp_rank={pp_rank}, vpp_chunk={vpp_chunk}) would "
                                     "build a negative number of layers (megatron-core asserts: not enough "
                                     "layers for the embedding/loss); use more layers or fewer stages")
            out.append(ChunkPlacement(pp_rank, vpp_chunk, range(offset, offset + size),
                                      has_embedding=pp_rank == 0 and vpp_chunk == 0,
                                      has_loss=pp_rank == split.pp - 1 and vpp_chunk == split.num_chunks - 1))
    return tuple(out)


def placements(split: PipelineSplit) -> Tuple[ChunkPlacement, ...]:
    """Every chunk's placement, in virtual-stage order (vpp_chunk-major, then pp_rank). Raises
    PlacementError for splits megatron-core / Megatron-LM refuse or would build wrongly."""
    _check_config(split)
    chunks = _raw_placements(split)
    built = [layer for c in chunks for layer in c.layers]
    if built != list(range(split.num_layers)):
        raise PlacementError(f"{split.describe()}: megatron-core 0.16.1 would build layers {built} "
                             f"instead of 0..{split.num_layers - 1} once each, in pipeline order; "
                             "choose another split")
    return chunks


def validate(split: PipelineSplit) -> None:
    placements(split)


def chunk_placement(split: PipelineSplit, pp_rank: int, vpp_chunk: int = 0) -> ChunkPlacement:
    if not 0 <= pp_rank < split.pp or not 0 <= vpp_chunk < split.num_chunks:
        raise PlacementError(f"{split.describe()}: no chunk (pp_rank={pp_rank}, vpp_chunk={vpp_chunk}); "
                             f"use 0 <= pp_rank < {split.pp} and 0 <= vpp_chunk < {split.num_chunks}")
    return placements(split)[vpp_chunk * split.pp + pp_rank]


def layer_location(split: PipelineSplit, global_layer: int) -> Tuple[int, int, int]:
    """(pp_rank, vpp_chunk, local_layer) holding `global_layer`."""
    for chunk in placements(split):
        if global_layer in chunk.layers:
            return chunk.pp_rank, chunk.vpp_chunk, global_layer - chunk.layers.start
    raise PlacementError(f"{split.describe()}: layer {global_layer} does not exist "
                         f"(layers 0..{split.num_layers - 1})")


def describe_placements(split: PipelineSplit) -> str:
    """One line: `pp0/v0: embedding + layers 0-1 | pp1/v0: layers 2-3 + loss`."""
    def one(c: ChunkPlacement) -> str:
        layers = (f"layers {c.layers.start}-{c.layers.stop - 1}" if len(c.layers) > 1
                  else f"layer {c.layers.start}" if c.layers else "no layers")
        return (f"pp{c.pp_rank}/v{c.vpp_chunk}: " + ("embedding + " if c.has_embedding else "") + layers
                + (" + loss" if c.has_loss else ""))
    return " | ".join(one(c) for c in placements(split))


def split_from_args(args) -> PipelineSplit:
    """The split of a Megatron-LM args namespace / dict."""
    get = args.get if isinstance(args, dict) else (lambda k, d=None: getattr(args, k, d))
    return PipelineSplit(
        num_layers=get("num_layers"),
        pp=get("pipeline_model_parallel_size") or 1,
        vpp=get("virtual_pipeline_model_parallel_size"),
        first_stage_layers=get("decoder_first_pipeline_num_layers"),
        last_stage_layers=get("decoder_last_pipeline_num_layers"),
        account_for_embedding=bool(get("account_for_embedding_in_pipeline_split")),
        account_for_loss=bool(get("account_for_loss_in_pipeline_split")),
    )


# --------------------------------------------------------------------------------------------------
# Megatron-LM's pipeline-split flags on megatron-ucp's own commands (from-universal, plan)

SPLIT_FLAGS = (("first_stage_layers", "--decoder-first-pipeline-num-layers"),
               ("last_stage_layers", "--decoder-last-pipeline-num-layers"),
               ("embedding_in_split", "--account-for-embedding-in-pipeline-split"),
               ("loss_in_split", "--account-for-loss-in-pipeline-split"))


def add_split_arguments(parser) -> None:
    """The uneven-split flags, spelled as Megatron-LM spells them (an argparse parser or group)."""
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                        help="layers of the first pipeline stage (uneven split; the other stages split the rest)")
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                        help="layers of the last pipeline stage (uneven split)")
    parser.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                        help="the embedding counts as one layer of the even split")
    parser.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                        help="the output layer and loss count as one layer of the even split")
    parser.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                        help="virtual pipeline stages per rank (the VPP size; needed instead of "
                             "--num-layers-per-virtual-pipeline-stage with an uneven split)")


def split_options(args) -> dict:
    """ParallelLayout's split fields (and `virtual_stages`) from add_split_arguments' parsed flags."""
    return {"first_stage_layers": args.decoder_first_pipeline_num_layers,
            "last_stage_layers": args.decoder_last_pipeline_num_layers,
            "embedding_in_split": bool(args.account_for_embedding_in_pipeline_split),
            "loss_in_split": bool(args.account_for_loss_in_pipeline_split),
            "virtual_stages": args.num_virtual_stages_per_pipeline_rank}


def resolve_vpp(num_layers: int, pp: int, *, layers_per_virtual_stage: Optional[int] = None,
                virtual_stages: Optional[int] = None, first_stage_layers: Optional[int] = None,
                last_stage_layers: Optional[int] = None, embedding_in_split: bool = False,
                loss_in_split: bool = False) -> Optional[int]:
    """The VPP size Megatron-LM's validate_args derives from these flags (None: not interleaved), then the
    whole split validated; PlacementError naming the flag otherwise."""
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if layers_per_virtual_stage is not None and virtual_stages is not None:
        raise PlacementError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                             "are exclusive; pass one")
    vpp = virtual_stages
    if layers_per_virtual_stage is not None:
        if uneven:
            raise PlacementError("with --decoder-first/last-pipeline-num-layers give the virtual pipeline size as "
                                 "--num-virtual-stages-per-pipeline-rank (Megatron-LM's rule)")
        counted = num_layers + embedding_in_split + loss_in_split
        if pp < 1 or counted % pp or layers_per_virtual_stage < 1 or (counted // pp) % layers_per_virtual_stage:
            raise PlacementError(f"{counted} layers (embedding/loss counted as asked) over PP={pp} cannot be split "
                                 f"into virtual stages of --num-layers-per-virtual-pipeline-stage "
                                 f"{layers_per_virtual_stage} layers")
        vpp = counted // pp // layers_per_virtual_stage
    vpp = vpp if vpp and vpp > 1 else None
    validate(PipelineSplit(num_layers, pp, vpp, first_stage_layers, last_stage_layers, embedding_in_split,
                           loss_in_split))
    return vpp
