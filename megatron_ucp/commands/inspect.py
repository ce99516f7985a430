"""`megatron-ucp inspect`: what a checkpoint holds, from metadata only (no tensor is read).

Any checkpoint `commands/common.open_any` opens (universal, Megatron-LM `torch` or `torch_dist`, a root or
an iteration folder). For Megatron checkpoints the
global shapes come from the GPT adapter (model config + layout), not from tensors. For a universal
checkpoint it also reports, from stat() and metadata alone, tensor files missing or of the wrong size and
parameters the model lacks or has with another shape (`universal_problems`); inspect then exits 1.
`megatron-ucp check` reads every byte. With experts (MoE) it shows the MoE config (experts, MoE layers,
experts per EP rank, shared experts, expert bias), EP and ETP of the layout, and which parameters are
routed experts (split over ETP, one per global expert) or persistent buffers (no optimizer state).
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_ucp.commands.common import (
    UNIVERSAL, checkpoint_format, human_bytes, is_universal, open_any, text_table, universal_problems)
from megatron_ucp.core.dtypes import ITEMSIZE


def disk_bytes(path: Path) -> int:
    """Bytes of all files under `path` (what the checkpoint occupies)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += (Path(root) / f).stat().st_size
            except OSError:
                pass
    return total


def pattern_label(pattern_json: dict) -> str:
    """'grouped_qkv(groups=2, heads/group=2, head_dim=12)' and the like, for tables."""
    kind = pattern_json["kind"]
    if kind == "sharded":
        return f"sharded(dim={pattern_json['dim']})"
    if kind == "fused_sub_params":
        return f"fused(dim={pattern_json['dim']}, parts={list(pattern_json['parts'])})"
    if kind == "grouped_qkv":
        return (f"grouped_qkv(groups={pattern_json['num_query_groups']}, "
                f"heads/group={pattern_json['heads_per_group']}, head_dim={pattern_json['head_dim']})")
    return kind


@dataclass(frozen=True)
class ParameterRow:
    name: str
    shape: tuple[int, ...]
    dtype: str  # the model parameter's dtype during training
    pattern: dict
    tensors: tuple[str, ...]  # consolidated fp32 tensors it has: fp32 [, its optimizer's states by name]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def kind(self) -> str:
        """'expert' (a routed expert's parameter: split over ETP), 'buffer' (no optimizer state) or 'dense'."""
        from megatron_ucp.adapters.gpt import is_buffer, is_expert

        return "expert" if is_expert(self.name) else "buffer" if is_buffer(self.name) else "dense"

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "pattern": self.pattern,
                "tensors": list(self.tensors), "numel": self.numel, "kind": self.kind}


def parameter_rows(ckpt) -> list[ParameterRow]:
    """The canonical parameters with global shape, model dtype and pattern, from metadata only."""
    if is_universal(ckpt):
        return [ParameterRow(p.name, p.shape, p.model_dtype, p.pattern.to_json(), p.tensors)
                for p in ckpt.parameters.values()]
    from megatron_ucp.adapters.gpt import canonical_name, expected_parameters, is_buffer, pattern_for
    from megatron_ucp.core.dtypes import dtype_name
    from megatron_ucp.core.layout import LayoutError
    from megatron_ucp.formats.common import CheckpointFormatError

    config, layout = ckpt.config, ckpt.layout
    try:
        expected = expected_parameters(config, layout)
    except (LayoutError, NotImplementedError, ValueError) as e:
        raise CheckpointFormatError(f"{ckpt.path}: {e}") from e
    dtypes, tensors = {}, {}
    for ref in ckpt.shards():  # shard metadata only (names, shapes, dtypes)
        name = canonical_name(ref.local_name, layout, ref.pp_rank, ref.vpp_chunk, config.num_layers,
                              tied=config.tied, config=config, ep_rank=ref.ep_rank)
        if name is not None:
            dtypes.setdefault(name, dtype_name(ref.dtype))
            # the optimizer's states by name (core/optimizers.py), the row of the optimizer stepping it
            tensors.setdefault(name, ("fp32",) if ckpt.optimizer_kind == "none" else (
                "fp32", *ckpt.parameter_row(ref.local_name, ref.shape).states))
    missing = [n for n, _ in expected if n not in dtypes]
    if missing:
        raise CheckpointFormatError(f"{ckpt.path}: missing parameters {missing[:5]}; the checkpoint is incomplete "
                                    f"or does not match its args")
    return [ParameterRow(n, tuple(s), dtypes[n], pattern_for(n, config).to_json(),
                         ("fp32",) if is_buffer(n) else tensors[n]) for n, s in expected]


def moe_summary(config, layout: Optional[dict] = None) -> Optional[dict]:
    """The mixture-of-experts part of a model config (None for a dense model), with experts per EP rank at
    `layout` when given."""
    if not config.num_experts:
        return None
    layers = [i for i, moe in enumerate(config.moe_layers) if moe]
    out = {"num_experts": config.num_experts, "moe_layers": layers, "dense_layers": config.num_layers - len(layers),
           "moe_ffn_hidden_size": config.moe_ffn_hidden_size,
           "shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
           "shared_expert_gate": config.moe_shared_expert_gate,
           "router_expert_bias": config.moe_router_enable_expert_bias}
    if layout is not None:
        ep = layout.get("ep") or 1
        out["experts_per_ep_rank"] = config.num_experts // ep if config.num_experts % ep == 0 else None
    return out


# how the source's optimizer kept its state (CheckpointReader.optimizer_kind), in the table's words
_KIND_WORDS = {"adam": "fp32 torch optimizer", "mixed_precision": "Float16 optimizer, fp32 main weights",
               "distributed": "distributed optimizer"}


def _optimizer_layout(kind: Optional[str], args) -> Optional[str]:
    """How the source's optimizer kept its state, in the table's words (megatron-core 0.19 runs Lion / Muon with
    --use-distributed-optimizer as its layer-wise distributed optimizer)."""
    if kind == "distributed" and (args or {}).get("use_layer_wise_distributed_optimizer"):
        return "layer-wise distributed optimizer"
    return _KIND_WORDS.get(kind, kind)


def describe(ckpt) -> dict:
    """Everything `inspect` reports, as a JSON-safe dict."""
    rows = parameter_rows(ckpt)
    universal = is_universal(ckpt)
    problems: list[str] = []
    if universal:
        meta = ckpt.metadata
        layout = ckpt.source_layout.to_dict()
        consumed = ckpt.consumed_train_samples
        optimizer_kind = (meta.get("source") or {}).get("optimizer_kind")
        extra = {"format_version": meta.get("version"), "source": meta.get("source"),
                 "megatron_core": (meta.get("source") or {}).get("megatron_core"),
                 "optimizer_type": (meta.get("optimizer") or {}).get("type"),
                 "lazy_source": (meta.get("lazy") or {}).get("source"),
                 "checksums": ckpt.version >= 2}
        problems = universal_problems(ckpt)
        notices = list((meta.get("source") or {}).get("notices") or [])
    else:
        common = ckpt.common_state()
        layout = ckpt.layout.to_dict()
        consumed = int(common.get("consumed_train_samples") or 0)
        optimizer_kind = ckpt.optimizer_kind
        extra = {"checkpoint_version": _json_scalar(common.get("checkpoint_version")),
                 "megatron_core": ckpt.release.label, "optimizer_type": ckpt.optimizer_name}
        notices = ckpt.notices()
    numel = sum(r.numel for r in rows)
    return {
        "path": str(Path(ckpt.path).resolve()),
        "format": checkpoint_format(ckpt),
        **extra,
        "iteration": int(ckpt.iteration),
        "consumed_train_samples": int(consumed),
        "layout": layout,  # for a universal checkpoint: the layout it was trained with (informational)
        "model_config": ckpt.config.to_dict(),
        "moe": moe_summary(ckpt.config, layout),
        "optimizer_kind": optimizer_kind,
        "optimizer_layout": _optimizer_layout(optimizer_kind, getattr(ckpt, "args", None)),
        "has_optimizer_state": bool(rows) and all(len(r.tensors) > 1 for r in rows if r.kind != "buffer"),
        # each set of states parameters hold (one; an emerging optimizer's and its scalar optimizer's: two), with
        # how many parameters hold it
        "optimizer_states": [{"states": list(states), "parameters": count} for states, count in Counter(
            r.tensors[1:] for r in rows if len(r.tensors) > 1).items()],
        "num_parameters": len(rows),
        "num_elements": numel,
        "model_bytes": sum(r.numel * ITEMSIZE.get(r.dtype, 4) for r in rows),
        "consolidated_bytes": sum(r.numel * 4 * len(r.tensors) for r in rows),
        "total_bytes": disk_bytes(Path(ckpt.path)),
        "parameters": [r.to_dict() for r in rows],
        "problems": problems,
        # what the (source's) release saved wrongly and how it is read (universal: what the conversion did)
        "notices": notices,
    }


def _json_scalar(value):
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _layout_text(layout: dict) -> str:
    parts = [f"TP={layout['tp']}", f"PP={layout['pp']}", f"CP={layout.get('cp', 1)}", f"DP={layout['dp']}",
             f"VPP={layout.get('vpp') or '-'}", f"SP={'on' if layout.get('sp') else 'off'}",
             f"EP={layout.get('ep', 1)}"]
    if layout.get("etp") is not None:
        parts.append(f"ETP={layout['etp']}")
    world = layout["tp"] * layout["pp"] * layout.get("cp", 1) * layout["dp"]
    return " ".join(parts) + f"   ({world} ranks)"


def _attention_text(c: dict) -> str:
    if c.get("multi_latent_attention"):
        q = f"q-LoRA {c['q_lora_rank']}" if c.get("q_lora_rank") else "no q-LoRA"
        return (f"{c['num_attention_heads']} heads multi-latent attention ({q}, kv-LoRA {c['kv_lora_rank']}, "
                f"qk head {c['qk_head_dim']} + rope {c['qk_pos_emb_head_dim']}, v head {c['v_head_dim']}, "
                f"{c.get('transformer_impl', 'local')} spec)")
    return (f"{c['num_attention_heads']} heads / {c['num_query_groups']} query groups (head dim "
            f"{c['kv_channels']})")


def format_report(info: dict) -> str:
    c = info["model_config"]
    lines = [
        f"{info['path']}",
        f"  format        {info['format']}"
        + (f" (version {info['format_version']})" if "format_version" in info else "")
        + ((f", converted from a megatron-core {info['megatron_core']} checkpoint" if info["format"] == UNIVERSAL
            else f", written by megatron-core {info['megatron_core']}") if info.get("megatron_core") else ""),
        f"  iteration     {info['iteration']}   consumed samples {info['consumed_train_samples']}",
        f"  layout        {_layout_text(info['layout'])}" + ("   (as trained)" if info["format"] == UNIVERSAL else ""),
        f"  model         {c['num_layers']} layers, hidden {c['hidden_size']}, ffn {c['ffn_hidden_size']}, "
        f"{_attention_text(c)}, vocab {c['vocab_size']} padded to {c['padded_vocab_size']}",
        f"                {c['normalization']}, {'SwiGLU' if c['swiglu'] else 'GELU'}, {c['position_embedding_type']}, "
        f"{'untied' if c['untie_embeddings_and_output_weights'] else 'tied'} embeddings, "
        f"{'biases' if c['add_bias_linear'] else 'no biases'}{', QKV bias' if c['add_qkv_bias'] else ''}"
        + (f", {c['mtp_num_layers']} multi-token prediction layer{'s' if c['mtp_num_layers'] > 1 else ''} (MTP)"
           if c.get("mtp_num_layers") else ""),
        f"  optimizer     {info.get('optimizer_type') or 'none'}"
        + (f" ({info['optimizer_layout']})" if info.get("optimizer_type") else "")
        + (": " + "; ".join(f"{', '.join(o['states'])} on {o['parameters']} parameter{'s' * (o['parameters'] > 1)}"
                            for o in info["optimizer_states"]) if info["has_optimizer_state"]
           else " (no optimizer state)"),
    ]
    moe = info.get("moe")
    if moe:
        shared = (f", shared expert {moe['shared_expert_intermediate_size']}"
                  + (" (gated)" if moe["shared_expert_gate"] else "")) if moe["shared_expert_intermediate_size"] else ""
        per_rank = (f", {moe['experts_per_ep_rank']} per EP rank"
                    if moe.get("experts_per_ep_rank") is not None else "")
        lines.insert(-1, f"  experts       {moe['num_experts']} routed experts (ffn {moe['moe_ffn_hidden_size']}){per_rank}"
                         f" in MoE layers {moe['moe_layers']} ({moe['dense_layers']} dense){shared}"
                         + (", router expert bias (a buffer)" if moe["router_expert_bias"] else ""))
    lines += [f"  notice        {n}" for n in info.get("notices") or []]
    if info.get("lazy_source"):
        lines.append(f"  lazy          an index into {info['lazy_source']} (tensors are read from there; keep it "
                     f"in place and unchanged)")
    lines += [
        "",
    ]
    split = {"expert": " over ETP", "buffer": " (buffer)"}
    rows = [(p["name"], "x".join(map(str, p["shape"])), p["dtype"],
             pattern_label(p["pattern"]) + split.get(p.get("kind"), "")) for p in info["parameters"]]
    header = ("parameter", "global shape", "dtype", "pattern")
    lines += text_table(header, rows)
    lines += ["", f"{info['num_parameters']} parameters, {info['num_elements']:,} elements; "
                  f"weights {human_bytes(info['model_bytes'])}, consolidated fp32 state "
                  f"{human_bytes(info['consolidated_bytes'])}, on disk {human_bytes(info['total_bytes'])}"]
    if info.get("format") == UNIVERSAL and not info.get("checksums"):
        lines.append(f"no block checksums (format version {info.get('format_version')}): reads are not verified; "
                     f"convert again with this megatron-ucp to get them")
    problems = info.get("problems") or []
    if problems:
        shown = 20
        lines += ["", f"{len(problems)} problem(s) found from metadata and file sizes (nothing loads this "
                      f"checkpoint as it is):"]
        lines += [f"  problem: {p}" for p in problems[:shown]]
        if len(problems) > shown:
            lines.append(f"  ... {len(problems) - shown} more (--json lists all)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# CLI


def add_cli_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "inspect", parents=[common], help="show what a checkpoint holds (format, layout, config, parameters)",
        description="Describe a universal, legacy torch or torch_dist checkpoint from its metadata: format, "
                    "layout, iteration, consumed samples, model config, optimizer, and every parameter's global "
                    "shape, dtype and pattern. No tensor is read.")
    p.add_argument("path", help="universal checkpoint, Megatron-LM checkpoint root or iter_XXXXXXX folder")
    p.add_argument("--iteration", type=int, default=None,
                   help="iteration of a Megatron-LM root (default: the tracker's)")
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> dict:
    info = describe(open_any(args.path, args.iteration, validate=False))  # lists every problem
    info["message"] = format_report(info)
    if info["problems"]:
        info["exit_code"] = 1
    return info
