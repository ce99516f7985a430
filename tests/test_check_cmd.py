"""`megatron-ucp check` and the checksums of universal format version 2, end to end: a flipped bit anywhere
in a universal checkpoint's tensor files or in a lazy checkpoint's source is reported by `check` (naming the
file, the parameter and the block) and stops every read (the loader's slice reads, and a real torchrun
resume); `inspect` and `plan` report missing or resized files and parameters that do not fit the model from
metadata and stat() alone; a version-1 checkpoint (no checksums) is still read and checked for what it has.

Checkpoints: a synthetic one written by UniversalWriter whose embedding spans 6 checksum blocks (1 MiB
each), and Megatron-LM's fixture C (legacy torch, gpt2-like) converted, copied and lazily indexed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ucp.adapters.gpt import expected_parameters, pattern_for
from megatron_ucp.convert import to_universal
from megatron_ucp.io.integrity import BLOCK_SIZE
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.universal import UniversalCheckpoint, UniversalFormatError, UniversalWriter
from pretrain_runs import FAMILIES, MOCK_DATA_016, Layout, run_pretrain
from writer_cli import C_FIXTURE, assert_ok, cli, flip_bit

# vocabulary 8192 x hidden 64 x 3 tensors x 4 bytes = 6 MiB: blocks 0..5 of the embedding's file
CONFIG = GPTModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                        num_query_groups=4, kv_channels=16, vocab_size=8000, padded_vocab_size=8192, swiglu=True,
                        normalization="RMSNorm", position_embedding_type="rope",
                        untie_embeddings_and_output_weights=True, add_bias_linear=False)
EMBEDDING = "embedding.word_embeddings.weight"
PARAM = "decoder.layers.1.mlp.linear_fc1.weight"  # fixture C


def write_synthetic(dst: Path) -> Path:
    with UniversalWriter(dst) as writer:
        for seed, (name, shape) in enumerate(expected_parameters(CONFIG)):
            g = torch.Generator().manual_seed(seed)
            writer.write_parameter(name, {k: torch.randn(shape, generator=g) for k in ("fp32", "exp_avg", "exp_avg_sq")},
                                   {"pattern": pattern_for(name, CONFIG), "step": 3, "param_group": {"index": 0}})
        return writer.finish({"iteration": 3, "consumed_train_samples": 24,
                              "source": {"format": "torch", "path": "/x", "layout": ParallelLayout().to_dict()},
                              "model_config": CONFIG.to_dict(), "args": {},
                              "optimizer": {"type": "adam", "param_groups": [{"lr": 1e-3, "weight_decay": 0.1}]},
                              "scheduler": {}}, expected_parameters(CONFIG))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("check") / "ucp")


@pytest.fixture(scope="module")
def fixture_ucp(tmp_path_factory) -> Path:
    return to_universal(C_FIXTURE, tmp_path_factory.mktemp("check_c") / "ucp", iteration=4, progress=False)


def copy_of(path: Path, tmp_path: Path) -> Path:
    shutil.copytree(path, tmp_path / "ucp")
    return tmp_path / "ucp"


def check_json(path: Path, expect: int) -> dict:
    proc = cli("check", path, "--json", "--quiet", "--workers", "2")
    assert proc.returncode == expect, (proc.stdout[-2000:], proc.stderr[-2000:])
    return json.loads(proc.stdout)


def reseal(ucp_dir: Path, edit) -> None:
    meta = json.loads((ucp_dir / "metadata.json").read_text())
    edit(meta)
    (ucp_dir / "metadata.json").write_text(json.dumps(meta, indent=1))
    marker = json.loads((ucp_dir / "COMPLETE").read_text())
    marker["metadata_sha256"] = hashlib.sha256((ucp_dir / "metadata.json").read_bytes()).hexdigest()
    (ucp_dir / "COMPLETE").write_text(json.dumps(marker))


# --------------------------------------------------------------------------------------------------
# check


def test_a_clean_checkpoint_checks_ok(synthetic):
    proc = cli("check", synthetic)
    assert_ok(proc)
    files = sorted((synthetic / "tensors").iterdir())
    size = sum(f.stat().st_size for f in files)
    assert f"{len(files)} tensor files, {size / 2 ** 20:.1f} MiB in" in proc.stdout and "ok: every block" in proc.stdout
    result = check_json(synthetic, 0)
    assert (result["files"], result["bytes"], result["problems"]) == (len(files), size, [])
    assert result["blocks"] == sum(-(-f.stat().st_size // BLOCK_SIZE) for f in files)


def test_check_names_every_damaged_file_parameter_and_block(synthetic, tmp_path):
    ucp = copy_of(synthetic, tmp_path)
    embedding = ucp / "tensors" / f"{EMBEDDING}.safetensors"
    assert embedding.stat().st_size > 5 * BLOCK_SIZE
    flip_bit(embedding, 3 * BLOCK_SIZE + 12345, bit=7)  # a data byte in block 3
    norm = ucp / "tensors" / "decoder.final_layernorm.weight.safetensors"
    flip_bit(norm, 30)  # its header
    result = check_json(ucp, 1)
    assert [(f["path"], f["problem"], f.get("block")) for f in result["failures"]] == [
        (str(embedding), "checksum", 3), (str(norm), "checksum", 0)]
    assert result["failures"][0]["start"] == 3 * BLOCK_SIZE and result["failures"][0]["stop"] == 4 * BLOCK_SIZE
    text = cli("check", ucp)
    assert text.returncode == 1 and "Traceback" not in text.stderr
    assert (f"{embedding}: block 3 (bytes {3 * BLOCK_SIZE}..{4 * BLOCK_SIZE - 1}) of {EMBEDDING}'s tensor file fails "
            f"its checksum: the file was damaged after it was written; restore it from a copy or reconvert") in text.stdout
    assert "2 problem(s):" in text.stdout
    # the reader refuses the damaged block and reads the others
    reader = UniversalCheckpoint.open(ucp)
    rows = BLOCK_SIZE // (64 * 4)  # rows per block of one tensor
    key_start = (3 * BLOCK_SIZE + 12345 - 8 - 1024) // (8192 * 64 * 4)  # which tensor (after a header <= 1 KiB)
    with pytest.raises(UniversalFormatError, match=f"block 3 .* of {EMBEDDING}'s tensor file fails its checksum"):
        reader.read(EMBEDDING, ("exp_avg", "exp_avg_sq", "fp32")[key_start])
    assert reader.read(EMBEDDING, "fp32", (slice(0, rows),)).shape == (rows, 64)  # fp32 starts in block 4


def test_check_reports_resized_and_missing_files_and_inspect_and_plan_fail_from_metadata(synthetic, tmp_path):
    ucp = copy_of(synthetic, tmp_path)
    resized = ucp / "tensors" / f"{EMBEDDING}.safetensors"
    size = resized.stat().st_size
    os.truncate(resized, size - 1)
    missing = ucp / "tensors" / "output_layer.weight.safetensors"
    missing.unlink()
    result = check_json(ucp, 1)
    assert [(f["path"], f["problem"]) for f in result["failures"]] == [(str(resized), "size"), (str(missing), "missing")]
    for command in (("inspect", ucp), ("plan", ucp, "-t", "1")):
        proc = cli(*command, "--json", "--quiet")
        assert proc.returncode == 1, proc.stderr
        problems = json.loads(proc.stdout)["problems"]
        assert problems == [f"{resized}: {size - 1} bytes, {EMBEDDING}'s tensor file was written with {size}; restore it "
                            f"from a copy or reconvert",
                            f"{missing}: missing (output_layer.weight's tensor file); restore it from a copy or reconvert"]
    assert "2 problem(s) found from metadata and file sizes" in cli("inspect", ucp).stdout


def test_parameters_that_do_not_fit_the_model_are_reported(synthetic, tmp_path):
    """metadata.json edited and resealed: a parameter dropped, another reshaped (same bytes): what from-universal
    and a resume would refuse, said by inspect, plan and check."""
    ucp = copy_of(synthetic, tmp_path)
    norm = "decoder.final_layernorm.weight"

    def edit(meta):
        del meta["parameters"]["output_layer.weight"]
        meta["parameters"][norm]["shape"] = [32, 2]

    reseal(ucp, edit)
    want = [f"{ucp}: parameters ['output_layer.weight'] of the model (1 in all) are missing; the checkpoint is "
            f"incomplete, reconvert",
            f"{ucp}: {norm} has shape [32, 2], the model config gives [64]; metadata.json was edited, reconvert"]
    assert json.loads(cli("inspect", ucp, "--json", "--quiet").stdout)["problems"] == want
    plan = cli("plan", ucp, "-t", "1", "--json", "--quiet")
    assert plan.returncode == 1 and json.loads(plan.stdout)["problems"] == want
    result = check_json(ucp, 1)
    assert want[0] in result["problems"] and any(norm in p for p in result["problems"])


def test_a_version_1_checkpoint_is_read_and_checked_for_what_it_has(synthetic, tmp_path):
    ucp = copy_of(synthetic, tmp_path)

    def to_version_1(meta):
        meta["version"] = 1
        for entry in meta["parameters"].values():
            entry.pop("checksum")

    reseal(ucp, to_version_1)
    result = check_json(ucp, 0)
    assert result["format_version"] == 1 and result["blocks"] == 0
    assert "have no checksums" in result["notes"][0]
    reader = UniversalCheckpoint.open(ucp)
    assert torch.equal(reader.read(EMBEDDING, "fp32"), UniversalCheckpoint.open(synthetic).read(EMBEDDING, "fp32"))
    flip_bit(ucp / "tensors" / f"{EMBEDDING}.safetensors", 3 * BLOCK_SIZE)  # undetectable without checksums...
    assert check_json(ucp, 0)["problems"] == []
    os.truncate(ucp / "tensors" / f"{EMBEDDING}.safetensors", 4 * BLOCK_SIZE)  # ...but a cut file is found
    result = check_json(ucp, 1)
    assert result["failures"][0]["problem"] == "header" and EMBEDDING in result["failures"][0]["path"]


def test_check_of_a_lazy_checkpoint_finds_a_flipped_bit_in_its_source(tmp_path):
    """The source's mtime is restored, so the size/mtime check on open passes: only the checksums see it.
    `check` names the source file and block; the loader's read (read_local, as a TP-2 rank) refuses it."""
    shutil.copytree(C_FIXTURE / "iter_0000004", tmp_path / "src" / "iter_0000004")
    lazy = to_universal(tmp_path / "src" / "iter_0000004", tmp_path / "lazy", lazy=True, progress=False)
    assert_ok(cli("check", lazy))
    region = UniversalCheckpoint.open(lazy).parameters[PARAM].placements["exp_avg_sq"].shards[1].regions[0]
    flip_bit(Path(region.path), region.offset + 7, keep_mtime=True)
    result = check_json(lazy, 1)
    [failure] = result["failures"]
    assert failure["path"] == region.path and failure["problem"] == "checksum"
    assert "the source checkpoint was damaged after the lazy conversion" in failure["message"]
    reader = UniversalCheckpoint.open(lazy)
    assert reader.read_local(PARAM, "exp_avg_sq", 0, 2).shape == (96, 48)  # rank 0's rows: other bytes
    with pytest.raises(UniversalFormatError, match="fails its checksum: the source checkpoint was damaged"):
        reader.read_local(PARAM, "exp_avg_sq", 1, 2)


# --------------------------------------------------------------------------------------------------
# A resume


@pytest.mark.torchrun
def test_a_resume_from_a_damaged_checkpoint_stops_with_one_line(fixture_ucp, tmp_path):
    """pretrain_gpt.py --load UCP --universal-checkpoint (TP1, one process; fixture C's vocabulary: MOCK_DATA_016)
    on a copy with one flipped bit: the loader's verified read stops the run with the checksum error, one line,
    before any step."""
    ucp = copy_of(fixture_ucp, tmp_path)
    victim = ucp / "tensors" / f"{PARAM}.safetensors"
    flip_bit(victim, victim.stat().st_size - 5)
    proc = run_pretrain(Layout(), [*FAMILIES["gpt2"], *MOCK_DATA_016, "--train-iters", "8", "--use-distributed-optimizer",
                                   "--load", str(ucp), "--universal-checkpoint"], tmp_path, "resume",
                        expect_failure=True)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {victim}: block 0 (bytes 0..{victim.stat().st_size - 1}) of {PARAM}'s tensor file fails "
                      f"its checksum: the file was damaged after it was written; restore it from a copy or reconvert"]
    assert "Traceback" not in proc.stdout.split(errors[0])[0]  # the rank printed its line, no traceback
    assert "] iteration" not in proc.stdout  # stopped before any step


def test_the_write_side_modules_import_no_torch():
    """universal, byteio, integrity, staging and the check / inspect commands import torch only where they
    make tensors, so a checkpoint's bytes and metadata are handled without it (the remaining import of torch
    on `check` / `inspect` comes from the pattern language, megatron_ucp.core.patterns, when metadata is parsed)."""
    import subprocess
    import sys

    code = ("import sys; import megatron_ucp.universal, megatron_ucp.io.byteio, megatron_ucp.io.integrity, "
            "megatron_ucp.io.staging, megatron_ucp.commands.check, megatron_ucp.commands.inspect; "
            "print(sorted(m for m in ('torch', 'safetensors.torch', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1], env=dict(os.environ, PYTHONPATH=str(
                              Path(__file__).resolve().parents[1])))
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)


def test_the_tensor_path_and_the_byte_path_write_the_same_file_and_digests(tmp_path):
    """write_tensor_file (tensors in memory, integrity.write_file_hashed) and write_tensor_file_placed (bytes
    copied from shards, hashed while copied) give byte-identical files and equal checksum records, equal to
    a second pass over the file; safetensors reads them."""
    from safetensors import safe_open

    from megatron_ucp.io.byteio import FileHandles, FileRegion, StoredTensor
    from megatron_ucp.convert import placement_for
    from megatron_ucp.io.integrity import DigestRecord, hash_file
    from megatron_ucp.core.patterns import Sharded
    from megatron_ucp.universal import write_tensor_file, write_tensor_file_placed

    name, shape = "decoder.layers.0.self_attention.linear_proj.weight", (512, 768)  # 4.5 MiB: 5 blocks
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(shape, generator=g) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    placements = {}
    for key, tensor in full.items():  # row-parallel: two TP shards of the columns, the banded path
        shards = []
        for rank, part in enumerate(tensor.chunk(2, dim=1)):
            path = tmp_path / f"{key}{rank}.bin"
            path.write_bytes(b"\0" * 100 + part.contiguous().numpy().tobytes())
            shards.append(StoredTensor(tuple(part.shape), "float32", (FileRegion(str(path), 100, part.numel() * 4),)))
        placements[key] = placement_for(Sharded(1), shape, shards)
    info = {"pattern": Sharded(1), "step": 2, "param_group": {"index": 0}}
    tensor_entry = write_tensor_file(tmp_path / "a", name, full, info)
    with FileHandles() as files:
        placed_entry = write_tensor_file_placed(tmp_path / "b", name, placements, info, files)
    a, b = tmp_path / "a" / tensor_entry["file"], tmp_path / "b" / placed_entry["file"]
    assert a.read_bytes() == b.read_bytes() and tensor_entry == placed_entry
    assert DigestRecord.from_json(tensor_entry["checksum"]) == hash_file(a)
    assert len(tensor_entry["checksum"]["blocks"]) == 5
    with safe_open(str(b), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), t) for k, t in full.items())
