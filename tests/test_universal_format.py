"""The universal format itself (docs/FORMAT.md), on a small synthetic GPT: the writer stages and
publishes atomically, the reader refuses incomplete, edited or newer checkpoints, and slices are
read lazily (bytes_read counts only what was asked for). No Megatron checkpoint needed.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_ucp.adapters.gpt import expected_parameters, pattern_for
from megatron_ucp.io.integrity import hash_file
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.core.patterns import bitwise_equal
from megatron_ucp.universal import (
    COMPLETE_FILENAME, FORMAT_NAME, FORMAT_VERSION, METADATA_FILENAME, ParamInfo, UniversalCheckpoint,
    UniversalFormatError, UniversalWriter, write_tensor_file)

CONFIG = GPTModelConfig(num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=4,
                        num_query_groups=2, kv_channels=4, vocab_size=100, padded_vocab_size=128, swiglu=True,
                        normalization="RMSNorm", position_embedding_type="rope",
                        untie_embeddings_and_output_weights=True, add_bias_linear=False)


def metadata() -> dict:
    return {
        "iteration": 7, "consumed_train_samples": 56,
        "source": {"format": "torch", "path": "/nowhere", "layout": ParallelLayout(tp=2, pp=2, dp=2).to_dict(),
                   "optimizer_kind": "distributed"},
        "model_config": CONFIG.to_dict(), "args": {"hidden_size": 16, "lr": 1e-3},
        "optimizer": {"type": "adam", "param_groups": [{"wd_mult": 1.0, "lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.999]},
                                                       {"wd_mult": 0.0, "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999]}]},
        "scheduler": {"num_steps": 56, "max_lr": 1e-3},
    }


def tensors_for(name, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return {"fp32": torch.randn(shape, generator=g), "exp_avg": torch.randn(shape, generator=g),
            "exp_avg_sq": torch.rand(shape, generator=g)}


def write_all(dst, skip=(), **kw):
    written = {}
    with UniversalWriter(dst, **kw) as writer:
        for seed, (name, shape) in enumerate(expected_parameters(CONFIG)):
            if name in skip:
                continue
            written[name] = tensors_for(name, shape, seed)
            writer.write_parameter(name, written[name], {
                "model_dtype": torch.bfloat16, "pattern": pattern_for(name, CONFIG), "step": 7,
                "param_group": {"index": int(len(shape) == 1), "wd_mult": 0.0 if len(shape) == 1 else 1.0}})
        path = writer.finish(metadata(), expected_parameters(CONFIG))
    return path, written


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("fmt") / "ucp")


def test_round_trip(written):
    path, tensors = written
    uc = UniversalCheckpoint.open(path)
    assert (uc.iteration, uc.consumed_train_samples) == (7, 56)
    assert uc.config == CONFIG and uc.source_layout == ParallelLayout(tp=2, pp=2, dp=2)
    assert uc.scheduler_state == {"num_steps": 56, "max_lr": 1e-3} and len(uc.param_groups) == 2
    assert list(uc.parameters) == [n for n, _ in expected_parameters(CONFIG)]
    for name, shape in expected_parameters(CONFIG):
        info = uc.parameters[name]
        assert info == ParamInfo(name=name, shape=tuple(shape), dtype="float32", model_dtype="bfloat16",
                                 pattern=pattern_for(name, CONFIG), file=f"tensors/{name}.safetensors",
                                 tensors=("fp32", "exp_avg", "exp_avg_sq"), step=7, param_group=info.param_group,
                                 checksum=hash_file(path / info.file))  # digests taken while writing = a re-read
        for key in info.tensors:
            assert bitwise_equal(uc.read(name, key), tensors[name][key])


def test_files_on_disk_match_the_spec(written):
    path, _ = written
    assert sorted(p.name for p in path.iterdir()) == [COMPLETE_FILENAME, METADATA_FILENAME, "tensors"]
    marker = json.loads((path / COMPLETE_FILENAME).read_text())
    assert marker == {"format": FORMAT_NAME, "version": FORMAT_VERSION,
                      "metadata_sha256": hashlib.sha256((path / METADATA_FILENAME).read_bytes()).hexdigest()}
    meta = json.loads((path / METADATA_FILENAME).read_text())
    assert meta["format"] == FORMAT_NAME and meta["version"] == FORMAT_VERSION == 2
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    entry = meta["parameters"][name]
    file_size = (path / entry["file"]).stat().st_size
    assert entry["checksum"]["algorithm"] == "xxh3-128" and entry["checksum"]["size"] == file_size
    assert len(entry["checksum"]["blocks"]) == -(-file_size // entry["checksum"]["block_size"])
    assert entry["pattern"] == {"kind": "grouped_qkv", "num_query_groups": 2, "heads_per_group": 2, "head_dim": 4}
    assert entry["shape"] == [32, 16] and entry["tensors"] == ["fp32", "exp_avg", "exp_avg_sq"]
    with safe_open(str(path / entry["file"]), framework="pt") as f:
        assert sorted(f.keys()) == ["exp_avg", "exp_avg_sq", "fp32"]
        assert f.metadata()["name"] == name and f.metadata()["format"] == FORMAT_NAME
        assert f.get_tensor("fp32").dtype == torch.float32


def test_slice_reads_count_only_slice_bytes(written):
    path, tensors = written
    uc = UniversalCheckpoint.open(path)
    name = "embedding.word_embeddings.weight"  # (128, 16)
    part = uc.read(name, "exp_avg_sq", (slice(96, 128),))
    assert bitwise_equal(part, tensors[name]["exp_avg_sq"][96:128])
    assert uc.bytes_read == 32 * 16 * 4
    shard = uc.read_for_rank("decoder.layers.0.mlp.linear_fc1.weight", 1, 2)  # (64, 16) -> 2 x 16 rows
    full = tensors["decoder.layers.0.mlp.linear_fc1.weight"]["fp32"]
    assert bitwise_equal(shard, torch.cat([full[16:32], full[48:64]]))
    assert uc.bytes_read == 32 * 16 * 4 + 32 * 16 * 4
    with pytest.raises(UniversalFormatError, match="step-1 slices"):
        uc.read(name, "fp32", (slice(0, 8, 2),))
    with pytest.raises(UniversalFormatError, match="no parameter"):
        uc.read("output_layer.bias")


def test_existing_destination_is_refused(tmp_path):
    dst = tmp_path / "ucp"
    dst.mkdir()
    with pytest.raises(UniversalFormatError, match="already exists"):
        UniversalWriter(dst)
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(UniversalFormatError, match="was not written by megatron-ucp .*refusing to overwrite"):
        UniversalWriter(dst, overwrite=True)
    assert (dst / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ucp"]


def test_overwrite_replaces_a_universal_checkpoint(written, tmp_path):
    dst = tmp_path / "ucp"
    shutil.copytree(written[0], dst)
    write_all(dst, overwrite=True)
    UniversalCheckpoint.open(dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ucp"]


def test_exception_removes_staging_dir(tmp_path):
    dst = tmp_path / "ucp"
    with pytest.raises(RuntimeError):
        with UniversalWriter(dst) as writer:
            writer.write_parameter("decoder.final_layernorm.weight", tensors_for("x", (16,), 0),
                                   {"pattern": {"kind": "replicated"}, "step": 1})
            assert writer.staging_dir.name.startswith("ucp.partial-") and f"-{os.getpid()}-" in writer.staging_dir.name
            assert writer.staging_dir.is_dir()
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_missing_parameter_is_refused_at_finish(tmp_path):
    dst = tmp_path / "ucp"
    with pytest.raises(UniversalFormatError, match="missing .*decoder.layers.1.mlp.linear_fc2.weight"):
        write_all(dst, skip={"decoder.layers.1.mlp.linear_fc2.weight"})
    assert list(tmp_path.iterdir()) == []


def test_bad_tensors_are_refused(tmp_path):
    with pytest.raises(UniversalFormatError, match="float32"):
        write_tensor_file(tmp_path, "decoder.final_layernorm.weight", {"fp32": torch.zeros(4, dtype=torch.bfloat16)},
                          {"pattern": {"kind": "replicated"}})
    with pytest.raises(UniversalFormatError, match="needs 'fp32'"):
        write_tensor_file(tmp_path, "decoder.final_layernorm.weight", {"exp_avg": torch.zeros(4)},
                          {"pattern": {"kind": "replicated"}})
    with pytest.raises(UniversalFormatError, match="dotted canonical name"):
        write_tensor_file(tmp_path, "../evil", {"fp32": torch.zeros(4)}, {"pattern": {"kind": "replicated"}})


def test_directory_without_marker_is_incomplete(written, tmp_path):
    broken = tmp_path / "ucp"
    shutil.copytree(written[0], broken)
    (broken / COMPLETE_FILENAME).unlink()
    with pytest.raises(UniversalFormatError, match="incomplete universal checkpoint: no COMPLETE marker .*convert "
                                                   "again into a new directory"):
        UniversalCheckpoint.open(broken)


def test_edited_metadata_or_newer_version_is_refused(written, tmp_path):
    edited = tmp_path / "edited"
    shutil.copytree(written[0], edited)
    meta = json.loads((edited / METADATA_FILENAME).read_text())
    meta["iteration"] = 8
    (edited / METADATA_FILENAME).write_text(json.dumps(meta))
    with pytest.raises(UniversalFormatError, match="sha256"):
        UniversalCheckpoint.open(edited)

    newer = tmp_path / "newer"
    shutil.copytree(written[0], newer)
    meta = json.loads((newer / METADATA_FILENAME).read_text())
    meta["version"] = FORMAT_VERSION + 3  # 3: lazy 'zeroed' runs, 4: optimizer state by name (FORMAT.md); 5 is unknown
    (newer / METADATA_FILENAME).write_text(json.dumps(meta))
    marker = json.loads((newer / COMPLETE_FILENAME).read_text())
    marker["metadata_sha256"] = hashlib.sha256((newer / METADATA_FILENAME).read_bytes()).hexdigest()
    (newer / COMPLETE_FILENAME).write_text(json.dumps(marker))
    with pytest.raises(UniversalFormatError, match="version 5, this megatron-ucp reads versions 1, 2, 3, 4; upgrade"):
        UniversalCheckpoint.open(newer)


def test_open_on_a_non_directory(tmp_path):
    with pytest.raises(UniversalFormatError, match="no such universal checkpoint"):
        UniversalCheckpoint.open(tmp_path / "nope")


def test_disk_full_gives_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """ENOSPC in the middle of a conversion: one actionable line, no DST, no DST.partial-*."""
    import errno as errno_

    from megatron_ucp import cli

    from megatron_ucp.universal import tensorfile as universal

    calls = {"n": 0}
    real_write = universal.write_placement  # the converter's byte copies into the output files

    def write_placement(files, fd, offset, placement, hasher=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno_.ENOSPC, "No space left on device")
        return real_write(files, fd, offset, placement, hasher)

    monkeypatch.setattr(universal, "write_placement", write_placement)
    fixture = Path(__file__).resolve().parent / "fixtures" / "megatron-lm"
    dst = tmp_path / "ucp"
    code = cli.main(["to-universal", str(fixture / "C_gpt2_tp2pp2dp1_adam_torch" / "ckpt"), str(dst),
                     "--iteration", "4", "--workers", "1", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith("error: no space left on the device while writing"), err
    assert not dst.exists() and not list(tmp_path.glob("ucp.partial-*"))


def test_tensor_file_header_parser_refuses_what_does_not_describe_the_bytes():
    """universal/tensorfile.parse_header, the one parser of a tensor file's header (verified reads and `check`):
    a header nested past the JSON parser's stack, a gap between tensors and a short file are each a HeaderError
    (one line), never another exception; a header the writer made parses to its tensors."""
    import struct

    from megatron_ucp.universal.tensorfile import HeaderError, parse_header, safetensors_header

    def parse(data: bytes):
        return parse_header(lambda offset, n: data[offset:offset + n], len(data))

    prefix, offsets = safetensors_header({"fp32": (2, 3), "exp_avg": (2, 3)}, {"name": "x"})
    good = prefix + bytes(2 * 24)
    assert {k: v[:2] for k, v in parse(good).items()} == {"exp_avg": ("F32", (2, 3)), "fp32": ("F32", (2, 3))}
    assert {k: v[2] for k, v in parse(good).items()} == offsets
    deep = b"[" * 200_000 + b"]" * 200_000
    bad = {"deep": struct.pack("<Q", len(deep)) + deep, "gap": good + bytes(4), "short": good[:-1], "tiny": b"\0" * 7}
    for what, data in bad.items():
        with pytest.raises(HeaderError):
            parse(data)
