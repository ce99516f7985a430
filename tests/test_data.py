"""tools/preprocess_data.py: text to a Megatron indexed dataset, and megatron-core's GPT dataset reading it.

Fast and single-process (no torchrun); the CLI runs as a subprocess where its exit status matters. megatron-core
is the one first on the path (imported through cpu_shims' import patches: 0.19 without triton).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_ucp.megatron_lm import cpu_shims

cpu_shims.install_import_patches()  # megatron-core 0.19 without triton: before megatron is imported

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "preprocess_data.py"
_spec = importlib.util.spec_from_file_location("preprocess_data_under_test", TOOL)
_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tool)
ByteLevel = _tool.ByteLevelTokenizer  # the tokenizer the tool writes with

SEQ_LENGTH = 32


def _indexed(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


def _documents(prefix):
    ds = _indexed(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds


@pytest.fixture(scope="module")
def tool():
    return _tool


def _start_tool(*argv, cwd):
    # The tool must find the repo itself; the rest of PYTHONPATH (which megatron-core comes first) is kept.
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.Popen([sys.executable, str(TOOL), *map(str, argv)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


JSONL_RECORDS = [
    {"text": "Four score and seven years ago", "title": "Gettysburg"},
    {"text": "Caf\u00e9 \u2018quoted\u2019\nsecond line", "title": "Unicode", "extra": 1},
    {"text": "", "title": "empty text is skipped"},
    {"text": "last", "title": "Last"},
]
# Plain text: paragraphs on blank lines, multi-byte UTF-8 among them.
TEXT = ("It was the best of times, it was the worst of times.\n"
        "A second line of the first paragraph.\n\n"
        "Caf\u00e9 \u2018Briar Rose\u2019 \u2014 na\u00efve r\u00e9sum\u00e9.\n\n"
        + "\n\n".join(f"Paragraph {i}: " + "words " * (1 + i % 5) for i in range(40)) + "\n")


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """The CLI as a user runs it, from outside the repo; the runs start together (each imports megatron.core)."""
    tmp = tmp_path_factory.mktemp("cli")
    src = tmp / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in JSONL_RECORDS[:2]) + "\n\n" +
                   "\n".join(json.dumps(r) for r in JSONL_RECORDS[2:]) + "\n", encoding="utf-8")
    text_source = tmp / "book.txt"
    text_source.write_text(TEXT, encoding="utf-8")
    procs = {
        "jsonl": _start_tool("--input", src, "--json-keys", "text", "title", "--output-prefix", tmp / "out" / "corpus",
                             "--append-eod", "--workers", "2", cwd=tmp),
        "txt": _start_tool("--input", text_source, "--text-format", "--output-prefix", tmp / "book",
                           "--append-eod", cwd=tmp),
        "missing": _start_tool("--input", tmp / "nope.jsonl", "--output-prefix", tmp / "x", cwd=tmp),
    }
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return tmp, results


# ---------------------------------------------------------------- (a) the tool's tokenizers

def test_tokenizers(tool):
    tok = tool.ByteLevelTokenizer()
    text = "Caf\u00e9 \u2018Briar Rose\u2019 \u2014 ok"
    assert tok.tokenize(text) == list(text.encode("utf-8"))
    assert tok.detokenize(tok.tokenize(text) + [tok.eod]) == text
    assert (tok.vocab_size, tok.eod) == (257, 256)
    null = tool.NullTokenizer(1000)
    assert (null.vocab_size, null.eod) == (1000, 999)  # Megatron-LM 0.19's --vocab-size 1000
    assert null.tokenize("5 6 7") == [5, 6, 7] and null.detokenize([5, 6, 7]) == "5 6 7"


# ---------------------------------------------------------------- (b) tools/preprocess_data.py

def test_preprocess_jsonl_round_trip(cli_runs):
    tmp, results = cli_runs
    res = results["jsonl"]
    assert res.returncode == 0, res.stderr
    assert "Skipped 1 empty document" in res.stderr
    tok = ByteLevel()
    for key in ("text", "title"):
        prefix = tmp / "out" / f"corpus_{key}_document"
        assert prefix.with_suffix(".bin").exists() and prefix.with_suffix(".idx").exists()
        docs, ds = _documents(prefix)
        expected = [r[key] for r in JSONL_RECORDS if r[key]]
        assert [tok.detokenize(d) for d in docs] == expected
        assert all(d[-1] == tok.eod for d in docs)
        assert ds.index.dtype == np.uint16
        assert list(ds.sequence_lengths) == [len(e.encode()) + 1 for e in expected]
    assert not list((tmp / "out").glob("*.tmp*"))


def test_preprocess_text_format_round_trip(cli_runs):
    # Documents on blank lines, each tokenized with EOD appended.
    tmp, results = cli_runs
    res = results["txt"]
    assert res.returncode == 0, res.stderr
    assert "--data-path" in res.stdout
    docs, _ = _documents(tmp / "book_text_document")
    paragraphs = [p.strip() for p in TEXT.split("\n\n") if p.strip()]
    assert len(paragraphs) == 42
    tok = ByteLevel()
    assert [tok.detokenize(d) for d in docs] == paragraphs
    assert docs == [tok.tokenize(p) + [tok.eod] for p in paragraphs]
    assert any(max(d[:-1]) >= 128 for d in docs), "the text should exercise multi-byte UTF-8"


def test_preprocess_in_process_variants(tool, tmp_path, capsys):
    # Text format: blank lines (also whitespace-only and CRLF ones) separate documents; no EOD unless asked.
    src = tmp_path / "doc.txt"
    src.write_bytes(b"First doc\nline two\n\n\n  \nSecond doc\r\n\r\nThird\n")
    assert tool.main(["--input", str(src), "--text-format", "--output-prefix", str(tmp_path / "t")]) == 0
    docs, _ = _documents(tmp_path / "t_text_document")
    assert [ByteLevel().detokenize(d) for d in docs] == ["First doc\nline two", "Second doc", "Third"]
    assert all(256 not in d for d in docs)

    # NullTokenizer: ids are the text; EOD = vocab size - 1; int32 storage once vocab >= 65500.
    src = tmp_path / "ids.jsonl"
    src.write_text('{"text": "1 2 3"}\n{"text": "69999  0"}\n', encoding="utf-8")
    for vocab, dtype in ((70001, np.int32), (65500, None)):
        argv = ["--input", str(src), "--output-prefix", str(tmp_path / f"n{vocab}"),
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--append-eod"]
        if dtype is None:  # 69999 does not fit a vocabulary of 65500 (ids 0..65498, EOD 65499)
            assert tool.main(argv) == 1
            assert "token id 69999 is outside [0, 65499)" in capsys.readouterr().err
            assert not list(tmp_path.glob(f"n{vocab}*"))
            continue
        assert tool.main(argv) == 0
        docs, ds = _documents(tmp_path / f"n{vocab}_text_document")
        assert docs == [[1, 2, 3, vocab - 1], [69999, 0, vocab - 1]]
        assert ds.index.dtype == dtype


def test_preprocess_errors(tool, tmp_path, capsys):
    def fails(argv, message, code=1):
        if code == 1:
            assert tool.main(argv) == 1
        else:
            with pytest.raises(SystemExit) as e:
                tool.main(argv)
            assert e.value.code == code
        err = capsys.readouterr().err
        assert message in err, err

    out = ["--output-prefix", str(tmp_path / "o")]
    fails(["--input", str(tmp_path / "missing.jsonl"), *out], f"input file not found: {tmp_path / 'missing.jsonl'}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": "broken"\n', encoding="utf-8")
    fails(["--input", str(bad), *out], "bad.jsonl line 3: invalid JSON")
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "ok"}\n{"body": "no text key"}\n', encoding="utf-8")
    fails(["--input", str(good), *out], "good.jsonl line 2: key 'text' not found (keys present: ['body'])")
    fails(["--input", str(good), "--json-keys", "title", *out], "line 1: key 'title' not found")
    notobj = tmp_path / "list.jsonl"
    notobj.write_text('["text"]\n', encoding="utf-8")
    fails(["--input", str(notobj), *out], "list.jsonl line 1: expected a JSON object")
    nonstr = tmp_path / "num.jsonl"
    nonstr.write_text('{"text": 5}\n', encoding="utf-8")
    fails(["--input", str(nonstr), *out], "num.jsonl line 1, key 'text': expected a string")
    words = tmp_path / "words.jsonl"
    words.write_text('{"text": "1 two 3"}\n', encoding="utf-8")
    fails(["--input", str(words), *out, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
          "space-separated integer ids")
    fails(["--input", str(good), *out, "--tokenizer-type", "NullTokenizer"], "needs --vocab-size", code=2)
    fails(["--input", str(good), *out, "--vocab-size", "10"], "only applies to NullTokenizer", code=2)
    fails(["--input", str(good), *out, "--tokenizer-type", "GPT2BPETokenizer"], "invalid choice", code=2)
    fails(["--input", str(good)], "--output-prefix", code=2)
    assert not list(tmp_path.glob("o_*"))  # failed runs leave no partial dataset


def test_preprocess_cli_error_exit_status(cli_runs):
    _, results = cli_runs
    res = results["missing"]
    assert res.returncode == 1
    assert "error: input file not found" in res.stderr and "Traceback" not in res.stderr


# ---------------------------------------------------------------- (c) megatron-core's GPT dataset on the output

def _samples(ds, indices):
    return [{k: v.clone() for k, v in ds[int(i)].items()} for i in indices]


def _check_gpt_sample(s, seq_length):
    tokens, labels = s["tokens"], s["labels"]
    assert tokens.shape == labels.shape == (seq_length,)
    assert tokens[1:].equal(labels[:-1])
    return tokens.tolist() + [int(labels[-1])]


def gpt_train_dataset(prefix, tokenizer, cache, num_samples=32, seed=1234):
    """megatron-core's GPTDataset over --data-path PREFIX, train split, as Megatron-LM's pretrain_gpt.py builds it
    (BlendedMegatronDatasetBuilder, GPTDatasetConfig, split 969,30,1)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=seed, sequence_length=SEQ_LENGTH, blend=([str(prefix)], None),
                              split="969, 30, 1", path_to_cache=str(cache), tokenizer=tokenizer,
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 8, 8], lambda: True, config).build()
    return train


def test_gpt_dataset_reads_preprocessed_data_path(tool, tmp_path):
    # tools/preprocess_data.py output feeds --data-path directly.
    src = tmp_path / "many.jsonl"
    texts = [f"document number {i}. " * (1 + i % 7) for i in range(600)]  # enough for a non-empty test split
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    assert tool.main(["--input", str(src), "--output-prefix", str(tmp_path / "many"), "--append-eod"]) == 0
    tok = ByteLevel()
    # Megatron-LM 0.19 trains on byte-level data with its NullTokenizer of 257 ids: EOD is its last id, 256.
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron_lm_args import megatron_lm_args

    mlm = build_tokenizer(megatron_lm_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                                            "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings",
                                            str(SEQ_LENGTH), "--micro-batch-size", "2", "--train-iters", "4",
                                            "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                            str(tok.vocab_size)]))
    assert (mlm.vocab_size, mlm.eod) == (tok.vocab_size, tok.eod) == (257, 256)
    ds = gpt_train_dataset(tmp_path / "many_text_document", mlm, tmp_path / "cache")
    assert len(ds) >= 32
    for s in _samples(ds, range(32)):
        seq = _check_gpt_sample(s, SEQ_LENGTH)
        pieces = tok.detokenize([t if t != tok.eod else 0 for t in seq]).split("\0")
        assert all(p in texts for p in pieces[1:-1])
        assert all(any(p in t for t in texts) for p in (pieces[0], pieces[-1]))
