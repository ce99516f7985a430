"""The GPT entry point's own parts (megatron_ucp/megatron_lm): the embedded corpus as a Megatron indexed
dataset, and the flags the entry point adds on CPU. (--log-jsonl is checked against Megatron-LM's printed
losses where the fixtures are reproduced: tests/test_megatron_lm_019.py.)"""

from __future__ import annotations

import pytest

from megatron_ucp.megatron_lm import cpu_shims

cpu_shims.install_import_patches()  # megatron-core 0.19.2 on Python 3.11 without triton

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer  # noqa: E402

from megatron_ucp.megatron_lm import corpus  # noqa: E402


def corpus_paragraphs():
    for f in sorted(corpus.TEXTS.glob("*.txt")):
        for paragraph in f.read_text(encoding="utf-8").split("\n\n"):
            if paragraph.strip():
                yield paragraph.strip()


def test_embedded_corpus_is_every_paragraph_as_bytes_then_eod(tmp_path):
    tokenizer = NullTokenizer(257)  # what --tokenizer-type NullTokenizer --vocab-size 257 builds: EOD 256
    prefix = corpus.indexed_dataset_prefix(tmp_path, tokenizer)
    dataset = IndexedDataset(prefix)
    paragraphs = list(corpus_paragraphs())
    assert len(dataset) == len(paragraphs) > 100
    for i in (0, len(paragraphs) // 2, len(paragraphs) - 1):
        tokens = dataset[i].tolist()
        assert tokens[-1] == 256 and max(tokens[:-1]) < 256
        assert bytes(tokens[:-1]).decode("utf-8") == paragraphs[i]
    # written once: a second call finds it and writes nothing
    stamp = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert corpus.indexed_dataset_prefix(tmp_path, tokenizer) == prefix
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]


@pytest.mark.parametrize("tokenizer", [NullTokenizer(256), NullTokenizer(300, eod_id=100)], ids=["eod255", "eod100"])
def test_embedded_corpus_refuses_an_eod_that_is_a_byte(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="--vocab-size 257"):
        corpus.indexed_dataset_prefix(tmp_path, tokenizer)
    assert not list(tmp_path.iterdir())


def test_cpu_flags_are_added_only_where_the_command_line_is_silent():
    argv = ["--transformer-impl", "transformer_engine", "--no-rope-fusion", "--distributed-backend=nccl"]
    out = cpu_shims.with_cpu_flags(argv)
    assert out[:len(argv)] == argv
    added = out[len(argv):]
    assert "--transformer-impl" not in added and "--no-rope-fusion" not in added
    assert "--distributed-backend" not in added
    for flag, value in cpu_shims.CPU_FLAGS:
        if flag not in ("--transformer-impl", "--no-rope-fusion", "--distributed-backend"):
            assert flag in added
            if value is not None:
                assert added[added.index(flag) + 1] == value
    assert cpu_shims.with_cpu_flags(out) == out  # idempotent
