"""NaN/Inf in a universal checkpoint (issue 33, item 11): `check` names every tensor holding them (exit 1), and
`from-universal` refuses them in one line naming the parameter and the state, leaving nothing at the
destination and the input unchanged, unless --allow-non-finite. Both find them where the bytes already pass
(check: each block right after it is hashed; writers: each checked mapping or copied step), no extra read.

Crafted, payload-free checkpoints: a tiny model whose values are all finite but one planted NaN or Inf, on
each write path: a stored run copied file to file (fp32, TP1), a cast band (a bf16 model's weight) and a
row-parallel weight's TP slices read together (TP2). Negative controls: the same checkpoint without the
planted value checks ok and writes.

The universal writers refuse them too, found while the tensor files' bytes are hashed: `to-universal` of Megatron-LM
0.16.1's fixtures A (legacy) and B (torch_dist) with one NaN planted in a sharded exp_avg, on the copied and the
tensor (--average-replicas) path; export-hf of a weight holding -inf; import-hf's case is in test_hf_import's bad inputs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ucp.adapters.gpt import expected_parameters, pattern_for
from megatron_ucp.commands.check import check
from megatron_ucp.commands.from_universal import FromUniversalError, from_universal
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.io.integrity import BlockHasher, FileCheck, check_files
from megatron_ucp.universal import UniversalWriter
from writer_cli import assert_one_line_error, cli

CONFIG = GPTModelConfig(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, num_query_groups=2,
                        kv_channels=8, vocab_size=64, padded_vocab_size=64, swiglu=True, normalization="RMSNorm",
                        position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                        add_bias_linear=False)
ARGS = {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2, "kv_channels": 8,
        "vocab_size": 64, "padded_vocab_size": 64, "seq_length": 32, "normalization": "RMSNorm", "swiglu": True,
        "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True, "add_bias_linear": False,
        "micro_batch_size": 1, "global_batch_size": 2}
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
PROJ = "decoder.layers.0.self_attention.linear_proj.weight"  # row-parallel: TP slices share rows


def write_ucp(dst: Path, plant: dict = None, model_dtype: str = "float32") -> Path:
    """`plant`: {(parameter, key): (flat index, value)}. A bf16 model is written weights only (its bf16 weights are
    then the only copies of the values: cast bands)."""
    plant = plant or {}
    with UniversalWriter(dst) as writer:
        for seed, (name, shape) in enumerate(expected_parameters(CONFIG)):
            g = torch.Generator().manual_seed(seed)
            keys = ("fp32",) if model_dtype == "bfloat16" else ("fp32", "exp_avg", "exp_avg_sq")
            tensors = {k: torch.rand(shape, generator=g) for k in keys}
            for (param, key), (index, value) in plant.items():
                if param == name:
                    tensors[key].view(-1)[index] = value
            writer.write_parameter(name, tensors, {"pattern": pattern_for(name, CONFIG), "step": 3, "param_group": {},
                                                   "model_dtype": model_dtype})
        groups = [{"lr": 1e-3, "weight_decay": wd, "wd_mult": wd * 10, "lr_mult": 1.0, "is_decoupled_lr": False}
                  for wd in (0.1, 0.0)]
        return writer.finish({"iteration": 3, "consumed_train_samples": 6,
                              "source": {"format": "torch", "path": "/x", "layout": ParallelLayout().to_dict(),
                                         "megatron_core": "0.19"},
                              "model_config": CONFIG.to_dict(), "args": dict(ARGS, bf16=model_dtype == "bfloat16"),
                              "optimizer": {"type": "adam", "param_groups": groups}, "scheduler": {}},
                             expected_parameters(CONFIG))


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + (p.read_bytes() if p.is_file() else b""))
    return h.hexdigest()


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    return write_ucp(tmp_path_factory.mktemp("nf") / "ucp", {(FC1, "exp_avg_sq"): (17, math.nan),
                                                            (FC1, "exp_avg"): (5, math.inf),
                                                            (PROJ, "fp32"): (200, -math.inf)})


def test_check_names_every_tensor_holding_nan_or_inf(planted, tmp_path):
    before = digest(planted)
    result = check(planted, workers=2)
    problems = [p for p in result["problems"] if "non-finite" in p]
    assert not result["ok"] and len(problems) == len(result["problems"]) == 3, result["problems"]
    assert any(f"{FC1} exp_avg_sq holds 1 non-finite value(s) (NaN/Inf), the first at element 17" in p
               for p in problems)
    assert any(f"{FC1} exp_avg holds 1 " in p for p in problems)
    assert any(f"{PROJ} weight holds 1 non-finite value(s) (NaN/Inf), the first at element 200" in p
               for p in problems)
    proc = cli("check", planted, "--json", "--quiet")
    assert proc.returncode == 1 and json.loads(proc.stdout)["problems"] == result["problems"]
    assert digest(planted) == before
    clean = write_ucp(tmp_path / "clean")  # negative control
    assert check(clean, workers=2)["ok"]


@pytest.mark.parametrize("ckpt_format,tp,model_dtype,param,key", [
    ("torch_dist", 1, "float32", FC1, "exp_avg_sq"),  # a stored run, copied file to file
    ("torch", 1, "bfloat16", PROJ, "fp32"),  # the bf16 weight (weights only): a cast band
    ("torch_dist", 2, "float32", PROJ, "fp32"),  # a row-parallel weight's TP slices, read band by band together
])
def test_from_universal_refuses_nan_and_inf_leaving_nothing(tmp_path, ckpt_format, tp, model_dtype, param, key):
    ucp = write_ucp(tmp_path / "in" / "ucp", {(param, key): (3, math.nan)}, model_dtype)
    before = digest(ucp)
    dst = tmp_path / "out"
    dst.mkdir()
    options = dict(ckpt_format=ckpt_format, tensor_model_parallel_size=tp, use_distributed_optimizer=True,
                   progress=False, warn=lambda m: None)
    word = "weight" if key == "fp32" else key
    with pytest.raises(FromUniversalError, match=f"{param} {word} holds non-finite values .*--allow-non-finite"):
        from_universal(ucp, dst / "ckpt", **options)
    assert os.listdir(dst) == [] and digest(ucp) == before
    from_universal(ucp, dst / "ckpt", allow_non_finite=True, **options)  # allowed: written as it is
    assert (dst / "ckpt" / "latest_checkpointed_iteration.txt").exists()
    clean = write_ucp(tmp_path / "clean", model_dtype=model_dtype)  # negative control
    from_universal(clean, dst / "clean", **options)


def test_the_refusal_is_one_line(planted, tmp_path):
    line = assert_one_line_error(cli("from-universal", planted, tmp_path / "out", "--ckpt-format", "torch",
                                     "--quiet"))
    assert "holds non-finite values (NaN/Inf)" in line and "megatron-ucp check" in line
    assert not (tmp_path / "out").exists()


def test_values_cut_by_a_block_boundary_are_found(tmp_path):
    """Tensor data that is not 4-byte aligned (a crafted header): an element a block boundary cuts is read whole."""
    values = torch.rand(40)
    values[0], values[15] = math.nan, math.inf  # element 15: bytes 62..65, across the 64-byte block boundary
    data = b"\0\0" + values.numpy().tobytes()
    path = tmp_path / "t.bin"
    path.write_bytes(data)
    hasher = BlockHasher(len(data), 64)
    hasher.update(0, data)
    entry = FileCheck(str(path), hasher.record(), "t", floats=(("t weight", 2, len(data)),))
    report = check_files([entry], workers=2)
    assert [f.problem for f in report.failures] == ["non-finite"]
    assert "t weight holds 2 non-finite value(s) (NaN/Inf), the first at element 0" in report.failures[0].message
    values[0] = values[15] = 0.5
    path.write_bytes(b"\0\0" + values.numpy().tobytes())
    hasher = BlockHasher(len(data), 64)
    hasher.update(0, path.read_bytes())
    assert check_files([FileCheck(str(path), hasher.record(), "t", floats=entry.floats)]).ok


# --------------------------------------------------------------------------------------------------
# to-universal: a Megatron-LM checkpoint holding NaN/Inf (fixtures A legacy and B torch_dist of Megatron-LM 0.16.1)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron-lm"
NAN = b"\x00\x00\xc0\x7f"  # float32 NaN, little-endian


def plant_in_source(root: Path, local_name: str, key: str, element: int) -> None:
    """Overwrite one float32 element of TP rank 0's shard of `local_name` [key] with NaN, where the reader's
    own map of the files says its bytes are."""
    from megatron_ucp.formats import open_checkpoint

    ckpt = open_checkpoint(root)
    ref = next(r for r in ckpt.shards() if r.local_name == local_name and r.tp_rank == 0)
    region = ckpt.locate(ref)[key].regions[0]
    with open(region.path, "r+b") as f:
        f.seek(region.offset + 4 * element)
        f.write(NAN)


@pytest.mark.parametrize("fixture,extra", [("A_llama_tp2pp2dp2_distopt_sp_torch", ()),
                                           ("B_llama_tp2pp2dp2_distopt_sp_torch_dist", ()),
                                           ("B_llama_tp2pp2dp2_distopt_sp_torch_dist", ("--average-replicas",))],
                         ids=["legacy-copied", "torch_dist-copied", "torch_dist-tensors"])
def test_to_universal_refuses_nan_in_the_source_leaving_nothing(fixture, extra, tmp_path):
    """Each write path of a tensor file (bytes copied file to file; tensors: --average-replicas) finds the NaN
    while it hashes the bytes: one line naming the parameter and the state, nothing at DST, the source unchanged;
    --allow-non-finite converts it and `check` names it. Negative control: the same fixture unplanted converts
    (test_fixture_continuation and others)."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture / "ckpt" / "iter_0000004", src / "iter_0000004")
    plant_in_source(src / "iter_0000004", "decoder.layers.0.mlp.linear_fc2.weight", "exp_avg", 11)
    before = digest(src)
    line = assert_one_line_error(cli("to-universal", src / "iter_0000004", tmp_path / "ucp", "--quiet", *extra))
    assert "decoder.layers.0.mlp.linear_fc2.weight: exp_avg (1) hold(s) non-finite values" in line, line
    assert "--allow-non-finite" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"] and digest(src) == before
    proc = cli("to-universal", src / "iter_0000004", tmp_path / "ucp", "--quiet", "--allow-non-finite", *extra)
    assert proc.returncode == 0, proc.stderr
    result = check(tmp_path / "ucp", workers=2)
    assert not result["ok"] and [p for p in result["problems"] if "non-finite" in p], result["problems"]
    assert "decoder.layers.0.mlp.linear_fc2.weight exp_avg holds 1 non-finite" in " ".join(result["problems"])


def test_export_hf_refuses_a_nan_weight(planted, tmp_path):
    """export-hf searches each weight it has just read and checked: the planted -inf in PROJ's weight is refused in
    one line naming it, nothing at DST, input unchanged; --allow-non-finite exports it; moments are not exported
    (FC1's planted exp_avg/exp_avg_sq do not matter). Negative control: the clean checkpoint exports."""
    before = digest(planted)
    line = assert_one_line_error(cli("export-hf", planted, tmp_path / "hf", "--model-type", "llama", "--quiet"))
    assert f"{PROJ} holds 1 non-finite value(s) (NaN/Inf; the first at element 200)" in line, line
    assert "--allow-non-finite" in line and sorted(p.name for p in tmp_path.iterdir()) == []
    assert digest(planted) == before
    proc = cli("export-hf", planted, tmp_path / "hf", "--model-type", "llama", "--quiet", "--allow-non-finite")
    assert proc.returncode == 0, proc.stderr
    clean = write_ucp(tmp_path / "clean")
    assert cli("export-hf", clean, tmp_path / "hf_clean", "--model-type", "llama", "--quiet").returncode == 0
