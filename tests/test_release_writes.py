"""Writes for a named megatron-core release hold only what that release's own code reads (issue 33, items 1-4).

The facts come from each release's own wheel (tools/extract_release_facts.py -> core/release_facts.json):
its parse_args arguments and defaults, the names it sets at run time, its SAFE_GLOBALS (what its legacy
`torch.load(weights_only=True)` accepts), its enums' numbering, its distributed optimizer's sharding types
and whether its ShardedTensor refuses flattened ranges, and when its rerun state machine saves.

- the extraction itself, against a real save: a megatron-core 0.19.2 checkpoint's args (fixture A19) are
  exactly parse_args' dests (less those validate_args always deletes) plus names set at run time;
- the release rows (loadable optimizer shardings, rerun state) agree with those facts;
- a crafted, payload-free universal checkpoint with a 0.19 run's args (InferenceCudaGraphScope, an argument
  0.17 lacks, an entry point's own argument) written for 0.17/0.18/0.19 in both formats: the pickled args are
  that release's argument set (and the entry point's),
  name it (`detect`), and load with `torch.load(weights_only=True)` allowing exactly that release's
  SAFE_GLOBALS (megatron's classes as stand-ins: nothing of megatron-core is imported); the 0.17 write holds
  no InferenceCudaGraphScope; negative control: the same args pickled without translation fail that load;
- fully_sharded_model_space for 0.16-0.19 refused in one line naming 0.14 and 0.15, before anything is
  written (input unchanged, nothing at the destination), from the flags and from the source's release;
- 0.18 torch_dist writes carry the rerun state (common state and one object per rank), 0.17's do not,
  nor any with --rerun-mode disabled;
- a universal checkpoint without a Megatron source (import-hf) is written for 0.19 and says so.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import signal
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ucp.adapters.gpt import expected_parameters, pattern_for
from megatron_ucp.commands.from_universal import FromUniversalError, from_universal
from megatron_ucp.core import versions
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.formats import open_checkpoint
from megatron_ucp.universal import UniversalWriter
from torch_dist_checks import structure
from writer_cli import assert_one_line_error, cli

CONFIG = GPTModelConfig(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, num_query_groups=2,
                        kv_channels=8, vocab_size=64, padded_vocab_size=64, swiglu=True, normalization="RMSNorm",
                        position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                        add_bias_linear=False)
ITER = "iter_0000003"
SCOPE = "megatron.core.transformer.enums.InferenceCudaGraphScope"
A19 = Path(__file__).parent / "fixtures" / "megatron-core-0.19" / "A19_llama_tp2pp2dp1_distopt_sp_torch_dist" / "ckpt"


def source_args() -> dict:
    """A 0.19 run's args as a universal checkpoint keeps them (JSON), with what 0.17 cannot hold."""
    args = {k: v for k, v in versions.facts(versions.release("0.19"))["args"].items()}
    args.update(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, num_query_groups=2,
                kv_channels=8, vocab_size=64, padded_vocab_size=64, seq_length=32, max_position_embeddings=32,
                micro_batch_size=1, global_batch_size=2, params_dtype="torch.float32", normalization="RMSNorm",
                swiglu=True, position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                add_bias_linear=False, add_qkv_bias=False, group_query_attention=False,
                inference_cuda_graph_scope={"enum": SCOPE, "value": 3},  # block
                attention_backend={"enum": "megatron.core.transformer.enums.AttnBackend", "value": 5},
                exit_signal="signal.Signals.SIGTERM", iteration=3,
                log_jsonl="/runs/loss.jsonl")  # an entry point's own argument: no release defines it, kept
    assert "freeze_all_layers" in args and "freeze_all_layers" not in versions.known_args(versions.release("0.17"))
    return args


def write_universal(dst: Path, *, source: dict, args: dict) -> Path:
    with UniversalWriter(dst) as writer:
        for seed, (name, shape) in enumerate(expected_parameters(CONFIG)):
            g = torch.Generator().manual_seed(seed)
            writer.write_parameter(name, {k: torch.randn(shape, generator=g) for k in ("fp32", "exp_avg", "exp_avg_sq")},
                                   {"pattern": pattern_for(name, CONFIG), "step": 3, "param_group": {}})
        groups = [{"lr": 1e-3, "weight_decay": wd, "wd_mult": wd * 10, "lr_mult": 1.0, "is_decoupled_lr": False}
                  for wd in (0.1, 0.0)]  # Megatron's rule: no weight decay on norms
        return writer.finish({"iteration": 3, "consumed_train_samples": 6, "source": source,
                              "model_config": CONFIG.to_dict(), "args": args,
                              "optimizer": {"type": "adam", "param_groups": groups}, "scheduler": {}},
                             expected_parameters(CONFIG))


@pytest.fixture(scope="module")
def ucp19(tmp_path_factory) -> Path:
    return write_universal(tmp_path_factory.mktemp("rel") / "ucp",
                           source={"format": "torch_dist", "path": "/x", "layout": ParallelLayout().to_dict(),
                                   "megatron_core": "0.19"}, args=source_args())


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def args_pickle(out: Path, ckpt_format: str) -> bytes:
    """The torch.save archive holding the written args (legacy rank file, or torch_dist's common.pt)."""
    return (out / ITER / ("mp_rank_00/model_optim_rng.pt" if ckpt_format == "torch" else "common.pt")).read_bytes()


class _StandIn:
    """A class of the target release's SAFE_GLOBALS, without importing megatron-core: records what it got."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state


def load_as_release(data: bytes, row: versions.MegatronRelease):
    """torch.load(weights_only=True), as Megatron-LM of `row` loads a legacy checkpoint: torch's own allow-list
    plus exactly `row`'s SAFE_GLOBALS (real classes where importable without megatron, stand-ins otherwise)."""
    real = {"argparse.Namespace": argparse.Namespace, "signal.Signals": signal.Signals, "io.BytesIO": io.BytesIO,
            "numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype, "torch._C.Generator": torch._C.Generator,
            "numpy.core.multiarray._reconstruct": np._core.multiarray._reconstruct,
            "numpy.dtypes.UInt32DType": np.dtypes.UInt32DType,
            "types.SimpleNamespace": __import__("types").SimpleNamespace,
            "pathlib.PosixPath": __import__("pathlib").PosixPath}
    allowed = []
    for qualname in versions.facts(row)["safe_globals"]:
        if qualname in real:
            allowed.append(real[qualname])
        elif qualname.startswith("megatron."):
            allowed.append((type(qualname.rsplit(".", 1)[1], (_StandIn,), {}), qualname))
    registered = torch.serialization.get_safe_globals()  # megatron-core's register_safe_globals adds its own
    torch.serialization.clear_safe_globals()
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    finally:
        torch.serialization.add_safe_globals(registered)


# --------------------------------------------------------------------------------------------------
# The facts and the rows


def test_extracted_args_are_what_a_real_0_19_save_holds():
    """A19 (Megatron-LM core_v0.19.0, megatron-core 0.19.2): every parse_args dest (less validate_args'
    unconditional deletes) is in its args, and every arg it holds is one the extraction knows."""
    saved = set(open_checkpoint(A19).args)
    facts = versions.facts(versions.release("0.19"))
    assert set(facts["args"]) <= saved <= versions.known_args(versions.release("0.19"))
    assert not set(facts["deleted_args"]) & saved and {"iteration", "params_dtype"} <= set(facts["runtime_args"])
    assert SCOPE in facts["safe_globals"] and SCOPE not in versions.facts(versions.release("0.17"))["safe_globals"]


def test_release_rows_agree_with_their_sources():
    """distrib_optim_loads: the sharding types each release's DistributedOptimizer dispatches on, less
    fully_sharded_model_space where its ShardedTensor refuses flattened ranges (0.16 on); rerun_state_always:
    its RerunStateMachine saves between reruns (0.18 on skips only a disabled machine)."""
    writable = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space", "dp_zero_gather_scatter")
    for row in versions.RELEASES:
        facts = versions.facts(row)
        types = set(facts["distrib_optim"]["sharding_types"])
        if facts["distrib_optim"]["refuses_flattened_range"]:
            types.discard("fully_sharded_model_space")
        assert {s for s in writable if s in types} == set(row.distrib_optim_loads), row.name
        pending_only = "self.state == RerunState.NOT_RUNNING_YET" in facts["rerun_state_skipped_when"]
        assert row.rerun_state_always == (not pending_only), row.name
    assert [r.name for r in versions.loading("fully_sharded_model_space")] == ["0.14", "0.15"]


def test_enum_members_go_by_name_and_are_dropped_where_the_target_lacks_them():
    """Members are matched by name between the source's and the target's numbering (the same numbers in every
    class two of these releases share); a member or class the target lacks is never pickled."""
    row16, row17, row19 = (versions.release(n) for n in ("0.16", "0.17", "0.19"))
    scope = "megatron.core.transformer.enums.CudaGraphScope"
    attn, inference = {"enum": scope, "value": 2}, {"enum": scope, "value": 8}  # 0.17: attn, full_iteration_inference
    assert versions.args_for_release({"cuda_graph_scope": [attn]}, row16, row17) == {"cuda_graph_scope": [attn]}
    assert versions.args_for_release({"cuda_graph_scope": [attn, inference]}, row16, row17) == {}  # 0.16 lacks 8
    out = versions.args_for_release({"inference_cuda_graph_scope": {"enum": SCOPE, "value": 3}}, row17, row19)
    assert "inference_cuda_graph_scope" not in out  # 0.17 has neither the argument nor the class
    assert "freeze_all_layers" not in versions.args_for_release({"freeze_all_layers": True}, row17, row19)
    assert versions.args_for_release({"exit_signal": "signal.Signals.SIGTERM"}, versions.release("0.14"), row19) == {}


# --------------------------------------------------------------------------------------------------
# Writes


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
@pytest.mark.parametrize("release", ["0.17", "0.18", "0.19"])
def test_args_written_for_a_release_are_its_own(ucp19, tmp_path, release, ckpt_format):
    row = versions.release(release)
    out = tmp_path / "out"
    summary = from_universal(ucp19, out, ckpt_format=ckpt_format, use_distributed_optimizer=True, progress=False,
                             megatron_core_version=release, warn=lambda m: None)
    assert summary.to_dict()["megatron_core"] == release
    args = open_checkpoint(out).args
    facts = versions.facts(row)
    assert set(facts["args"]) <= set(args) - {"log_jsonl"} <= versions.known_args(row)
    assert versions.detect(args).name == release and args["log_jsonl"] == "/runs/loss.jsonl"
    assert (SCOPE in repr(args.get("inference_cuda_graph_scope"))) == (release != "0.17")
    if ckpt_format == "torch" or release != "0.19":  # 0.19 keeps torch_dist's args inside a .distcp item
        state = load_as_release(args_pickle(out, ckpt_format), row)
        assert vars(state["args"])["iteration"] == 3


def test_untranslated_args_fail_0_17_s_own_load(ucp19, tmp_path):
    """Negative control: the 0.19 args pickled as they are (no translation) fail the 0.17 load above, also in
    a process where megatron-core 0.19's register_safe_globals ran (it allows its classes process-wide)."""
    from megatron.core.safe_globals import register_safe_globals
    register_safe_globals()  # as Megatron-LM does in an earlier test of the suite
    out = tmp_path / "out"
    from_universal(ucp19, out, ckpt_format="torch", progress=False, megatron_core_version="0.19",
                   warn=lambda m: None)
    with pytest.raises(Exception, match="InferenceCudaGraphScope|Unsupported global"):
        load_as_release(args_pickle(out, "torch"), versions.release("0.17"))


def test_fully_sharded_model_space_for_0_17_is_refused_before_writing(ucp19, tmp_path):
    before = tree_digest(ucp19)
    line = assert_one_line_error(cli("from-universal", ucp19, tmp_path / "out", "--ckpt-format", "torch_dist",
                                     "--use-distributed-optimizer", "--optimizer-format", "fully_sharded_model_space",
                                     "--megatron-core-version", "0.17", "--quiet"))
    assert "megatron-core 0.17 cannot load" in line and "--megatron-core-version 0.14 or 0.15" in line
    # the release from the source (0.19): refused by the plan, before any file is written
    with pytest.raises(FromUniversalError, match="megatron-core 0.19 cannot load .*0.14 or 0.15"):
        from_universal(ucp19, tmp_path / "out2", ckpt_format="torch_dist", use_distributed_optimizer=True,
                       optimizer_format="fully_sharded_model_space", progress=False, warn=lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [] and tree_digest(ucp19) == before


@pytest.mark.parametrize("release,rerun_mode,objects", [("0.17", None, 0), ("0.18", None, 1),
                                                        ("0.18", "disabled", 0)])
def test_rerun_state_as_each_release_saves_it(tmp_path, release, rerun_mode, objects):
    args = source_args()
    if rerun_mode:
        args["rerun_mode"] = rerun_mode
    ucp = write_universal(tmp_path / "ucp", source={"format": "torch_dist", "path": "/x", "megatron_core": "0.19",
                                                    "layout": ParallelLayout().to_dict()}, args=args)
    from_universal(ucp, tmp_path / "out", ckpt_format="torch_dist", progress=False, megatron_core_version=release,
                   warn=lambda m: None)
    keys = structure(tmp_path / "out" / ITER)
    assert sorted(k for k in keys if k.startswith("rerun_state_machine")) == \
        ["rerun_state_machine_state/shard_0_1"] * objects
    common = load_as_release(args_pickle(tmp_path / "out", "torch_dist"), versions.release(release))
    assert ("rerun_state_machine" in common) == bool(objects)


def test_a_checkpoint_without_megatron_source_is_written_for_the_installed_release(tmp_path):
    """import-hf's universal checkpoints (source format huggingface, a few args): written for 0.19, said so,
    and recognised as 0.19's (its markers come with its defaults)."""
    model = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "vocab_size", "padded_vocab_size", "seq_length", "normalization", "swiglu", "position_embedding_type",
             "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias")
    args = {k: v for k, v in source_args().items() if k in model}  # what import-hf records
    ucp = write_universal(tmp_path / "ucp", source={"format": "huggingface", "path": "/hf",
                                                    "layout": ParallelLayout().to_dict()}, args=args)
    for ckpt_format in ("torch", "torch_dist"):
        summary = from_universal(ucp, tmp_path / ckpt_format, ckpt_format=ckpt_format, progress=False,
                                 warn=lambda m: None).to_dict()
        assert (summary["megatron_core"], summary["megatron_core_reason"]) == (
            "0.19", "no Megatron source: the release megatron-ucp installs")
        assert open_checkpoint(tmp_path / ckpt_format).release.name == "0.19"
