"""Training data: embedded corpus, tools/preprocess_data.py, the sampler and the GPT datasets.

Fast and single-process (no torchrun); the CLI runs as a subprocess where its exit status matters.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from megatron_ucp.training import data
from megatron_ucp.training.arguments import padded_vocab_size, parse_args
from megatron_ucp.training.data import (
    CORPUS_DIR,
    ByteLevelTokenizer,
    NullTokenizer,
    PretrainingSampler,
    build_tokenizer,
    build_train_dataset,
    embedded_corpus_prefix,
)

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "preprocess_data.py"

SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
               "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3"]


def _indexed(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


def _documents(prefix):
    ds = _indexed(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds


def _corpus_paragraphs():
    paragraphs = []
    for f in sorted(CORPUS_DIR.glob("*.txt")):
        paragraphs += [p.strip() for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    return paragraphs


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_under_test", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start_tool(*argv, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tool must find the repo itself
    return subprocess.Popen([sys.executable, str(TOOL), *map(str, argv)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


JSONL_RECORDS = [
    {"text": "Four score and seven years ago", "title": "Gettysburg"},
    {"text": "Caf\u00e9 \u2018quoted\u2019\nsecond line", "title": "Unicode", "extra": 1},
    {"text": "", "title": "empty text is skipped"},
    {"text": "last", "title": "Last"},
]
TEXT_SOURCE = sorted(CORPUS_DIR.glob("*.txt"))[0]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """The CLI as a user runs it, from outside the repo; the runs start together (each imports megatron.core)."""
    tmp = tmp_path_factory.mktemp("cli")
    src = tmp / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in JSONL_RECORDS[:2]) + "\n\n" +
                   "\n".join(json.dumps(r) for r in JSONL_RECORDS[2:]) + "\n", encoding="utf-8")
    procs = {
        "jsonl": _start_tool("--input", src, "--json-keys", "text", "title", "--output-prefix", tmp / "out" / "corpus",
                             "--append-eod", "--workers", "2", cwd=tmp),
        "txt": _start_tool("--input", TEXT_SOURCE, "--text-format", "--output-prefix", tmp / "book",
                           "--append-eod", cwd=tmp),
        "missing": _start_tool("--input", tmp / "nope.jsonl", "--output-prefix", tmp / "x", cwd=tmp),
    }
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return tmp, results


# ---------------------------------------------------------------- (a) embedded corpus, tokenizer, vocab

def test_corpus_files_are_real_text_with_provenance():
    files = sorted(CORPUS_DIR.glob("*.txt"))
    assert len(files) >= 3
    total = sum(f.stat().st_size for f in files)
    assert 40_000 <= total <= 80_000, total
    readme = (CORPUS_DIR / "README.md").read_text(encoding="utf-8")
    for f in files:
        assert f.name in readme, f"{f.name} has no source/licence entry in corpus/README.md"
        text = f.read_text(encoding="utf-8")
        assert "\r" not in text and "\n\n\n" not in text and "Gutenberg" not in text
    assert "public domain" in readme.lower()
    assert len(_corpus_paragraphs()) > 100


def test_embedded_corpus_round_trips(tmp_path):
    tok = ByteLevelTokenizer()
    prefix = embedded_corpus_prefix(tmp_path / "cache")
    assert Path(prefix).parent == tmp_path / "cache"
    docs, ds = _documents(prefix)
    paragraphs = _corpus_paragraphs()
    assert len(docs) == len(paragraphs)
    assert ds.index.dtype == np.uint16
    for ids, paragraph, length in zip(docs, paragraphs, ds.sequence_lengths):
        assert ids[-1] == tok.eod == 256 and tok.eod not in ids[:-1]
        assert max(ids[:-1]) < 256 and length == len(ids)
        assert tok.detokenize(ids) == paragraph
    assert any(max(ids[:-1]) >= 128 for ids in docs), "corpus should exercise multi-byte UTF-8"

    # Written once: a second call reuses the files; the cache env var picks the same directory.
    mtime = os.stat(prefix + ".bin").st_mtime_ns
    assert embedded_corpus_prefix(tmp_path / "cache") == prefix
    assert os.stat(prefix + ".bin").st_mtime_ns == mtime
    assert not list((tmp_path / "cache").glob(".tmp_*"))


def test_default_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_UCP_CACHE", str(tmp_path / "env"))
    assert data.default_cache_dir(Namespace(data_cache_path=None)) == tmp_path / "env"
    assert data.default_cache_dir(Namespace(data_cache_path=str(tmp_path / "arg"))) == tmp_path / "arg"


def test_tokenizers_and_padded_vocab():
    tok = ByteLevelTokenizer()
    text = "Caf\u00e9 \u2018Briar Rose\u2019 \u2014 ok"
    assert tok.tokenize(text) == list(text.encode("utf-8"))
    assert tok.detokenize(tok.tokenize(text) + [tok.eod]) == text
    assert (tok.vocab_size, tok.eod) == (257, 256)
    null = NullTokenizer(1000)
    assert (null.vocab_size, null.eod) == (1001, 1000)
    assert null.tokenize("5 6 7") == [5, 6, 7] and null.detokenize([5, 6, 7]) == "5 6 7"

    def padded(vocab, tp):
        return padded_vocab_size(vocab, Namespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp))

    assert padded(257, 1) == 384
    assert padded(257, 2) == 512
    assert padded(257, 4) == 512
    assert padded(1001, 1) == 1024
    assert padded(384, 1) == 384


# ---------------------------------------------------------------- (b) tools/preprocess_data.py

def test_preprocess_jsonl_round_trip(cli_runs):
    tmp, results = cli_runs
    res = results["jsonl"]
    assert res.returncode == 0, res.stderr
    assert "Skipped 1 empty document" in res.stderr
    tok = ByteLevelTokenizer()
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


def test_preprocess_text_format_matches_embedded_corpus(cli_runs):
    # The embedded corpus is what the CLI makes of the same text (documents on blank lines + EOD).
    tmp, results = cli_runs
    res = results["txt"]
    assert res.returncode == 0, res.stderr
    assert "--data-path" in res.stdout
    docs, _ = _documents(tmp / "book_text_document")
    paragraphs = [p.strip() for p in TEXT_SOURCE.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    tok = ByteLevelTokenizer()
    assert [tok.detokenize(d) for d in docs] == paragraphs
    assert docs == [tok.tokenize(p) + [tok.eod] for p in paragraphs]


def test_preprocess_in_process_variants(tool, tmp_path, capsys):
    # Text format: blank lines (also whitespace-only and CRLF ones) separate documents; no EOD unless asked.
    src = tmp_path / "doc.txt"
    src.write_bytes(b"First doc\nline two\n\n\n  \nSecond doc\r\n\r\nThird\n")
    assert tool.main(["--input", str(src), "--text-format", "--output-prefix", str(tmp_path / "t")]) == 0
    docs, _ = _documents(tmp_path / "t_text_document")
    assert [ByteLevelTokenizer().detokenize(d) for d in docs] == ["First doc\nline two", "Second doc", "Third"]
    assert all(256 not in d for d in docs)

    # NullTokenizer: ids are the text; EOD = vocab size; int32 storage once vocab >= 65500.
    src = tmp_path / "ids.jsonl"
    src.write_text('{"text": "1 2 3"}\n{"text": "69999  0"}\n', encoding="utf-8")
    for vocab, dtype in ((70000, np.int32), (65499, None)):
        argv = ["--input", str(src), "--output-prefix", str(tmp_path / f"n{vocab}"),
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--append-eod"]
        if dtype is None:  # 69999 does not fit a vocabulary of 65499
            assert tool.main(argv) == 1
            assert "token id 69999 is outside [0, 65499)" in capsys.readouterr().err
            assert not list(tmp_path.glob(f"n{vocab}*"))
            continue
        assert tool.main(argv) == 0
        docs, ds = _documents(tmp_path / f"n{vocab}_text_document")
        assert docs == [[1, 2, 3, vocab], [69999, 0, vocab]]
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


# ---------------------------------------------------------------- (c) sampler

def _global_batches(dp, gbs=8, mbs=2, total=64, consumed=0):
    """Per global batch: the list of sample indices each DP rank consumed (micro-steps in order)."""
    steps_per_batch = gbs // (mbs * dp)
    per_rank = [list(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    assert len({len(p) for p in per_rank}) == 1
    n_batches = len(per_rank[0]) // steps_per_batch
    assert n_batches * steps_per_batch == len(per_rank[0])
    batches = []
    for b in range(n_batches):
        ranks = [[i for mb in per_rank[r][b * steps_per_batch:(b + 1) * steps_per_batch] for i in mb]
                 for r in range(dp)]
        batches.append(ranks)
    return batches


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sampler_global_batches_independent_of_dp(dp):
    batches = _global_batches(dp)
    assert len(batches) == 8
    for b, ranks in enumerate(batches):
        flat = [i for r in ranks for i in r]
        assert len(flat) == len(set(flat)) == 8  # every sample once
        assert sorted(flat) == list(range(b * 8, (b + 1) * 8))
        assert all(len(r) == 8 // dp for r in ranks)
    # Megatron-LM's order: micro-step s, rank r takes [s*MBS*DP + r*MBS, ... + MBS).
    for r in range(dp):
        first = list(PretrainingSampler(64, 0, 2, r, dp))[:2]
        assert first == [[r * 2, r * 2 + 1], [2 * dp + r * 2, 2 * dp + r * 2 + 1]]


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_sampler_resume_continues_exactly(dp, k):
    uninterrupted = _global_batches(dp)
    resumed = _global_batches(dp, consumed=k * 8)
    assert resumed == uninterrupted[k:]
    for r in range(dp):
        full = list(PretrainingSampler(64, 0, 2, r, dp))
        assert list(PretrainingSampler(64, k * 8, 2, r, dp)) == full[k * 8 // (2 * dp):]


def test_sampler_resume_at_other_dp_sees_same_batches():
    # A run at DP 4 stopped after 3 global batches and resumed at DP 1 trains on the same samples.
    before = [sorted(i for r in ranks for i in r) for ranks in _global_batches(4)[:3]]
    after = [sorted(i for r in ranks for i in r) for ranks in _global_batches(1, consumed=24)]
    assert before + after == [list(range(b * 8, (b + 1) * 8)) for b in range(8)]


def test_sampler_rejects_exhausted_data():
    with pytest.raises(ValueError, match="no samples left"):
        PretrainingSampler(64, 64, 2, 0, 1)


# ---------------------------------------------------------------- (d) megatron-core GPT datasets

def _args(monkeypatch, *extra):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return parse_args(SMALL_MODEL + list(extra))


def _samples(ds, indices):
    return [{k: v.clone() for k, v in ds[int(i)].items()} for i in indices]


def _indices(n):
    return list(range(32)) + list(np.linspace(32, n - 1, 16).astype(int))


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].equal(y[k]), k


def _check_gpt_sample(s, seq_length):
    tokens, labels = s["tokens"], s["labels"]
    assert tokens.shape == labels.shape == (seq_length,)
    assert tokens[1:].equal(labels[:-1])
    return tokens.tolist() + [int(labels[-1])]


def test_build_train_dataset_mock_data(monkeypatch):
    args = _args(monkeypatch, "--mock-data", "--vocab-size", "1000")
    tok = build_tokenizer(args)
    assert isinstance(tok, NullTokenizer) and (tok.vocab_size, tok.eod) == (1001, 1000)
    ds = build_train_dataset(args, tok, True)
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    assert isinstance(ds, MockGPTDataset) and len(ds) >= args.train_iters * args.global_batch_size
    idx = _indices(len(ds))
    samples = _samples(ds, idx)
    vocab, eod = tok.vocab_size, tok.eod
    for s in samples:
        seq = _check_gpt_sample(s, args.seq_length)
        assert all(0 <= t < vocab for t in seq)
        # MockGPTLowLevelDataset: document = (1, 2, ..., L-1) mod vocab, then EOD; documents concatenated.
        for prev, nxt in zip(seq, seq[1:]):
            assert nxt in ((prev + 1) % vocab, eod) or (prev == eod and nxt == 1), (prev, nxt)
    _assert_same(samples, _samples(build_train_dataset(args, tok, True), idx))


def test_build_train_dataset_embedded_corpus(monkeypatch, tmp_path):
    args = _args(monkeypatch, "--data-cache-path", str(tmp_path / "a"))
    tok = build_tokenizer(args)
    assert isinstance(tok, ByteLevelTokenizer)
    ds = build_train_dataset(args, tok, True)
    assert len(ds) >= args.train_iters * args.global_batch_size
    idx = _indices(len(ds))
    samples = _samples(ds, idx)
    paragraphs = [p.encode() for p in _corpus_paragraphs()]
    for s in samples:
        seq = _check_gpt_sample(s, args.seq_length)
        assert all(0 <= t < 257 for t in seq)
        pieces = bytes(t if t != 256 else 0 for t in seq).split(b"\0")
        for j, piece in enumerate(pieces):
            if 0 < j < len(pieces) - 1:  # between two EODs: a whole paragraph
                assert piece in paragraphs
            elif piece:  # cut by the sample boundary: part of a paragraph
                assert any(piece in p for p in paragraphs)
    # Same samples from a fresh cache (rebuilt corpus and index files) and from the warm cache.
    _assert_same(samples, _samples(build_train_dataset(args, tok, True), idx))
    args_b = _args(monkeypatch, "--data-cache-path", str(tmp_path / "b"))
    _assert_same(samples, _samples(build_train_dataset(args_b, build_tokenizer(args_b), True), idx))


def test_build_train_dataset_from_preprocessed_data_path(tool, monkeypatch, tmp_path):
    # tools/preprocess_data.py output feeds --data-path directly.
    src = tmp_path / "many.jsonl"
    texts = [f"document number {i}. " * (1 + i % 7) for i in range(600)]  # enough for a non-empty test split
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    assert tool.main(["--input", str(src), "--output-prefix", str(tmp_path / "many"), "--append-eod"]) == 0
    args = _args(monkeypatch, "--data-path", str(tmp_path / "many_text_document"),
                 "--data-cache-path", str(tmp_path / "cache"))
    tok = build_tokenizer(args)
    ds = build_train_dataset(args, tok, True)
    for s in _samples(ds, range(32)):
        seq = _check_gpt_sample(s, args.seq_length)
        pieces = tok.detokenize([t if t != tok.eod else 0 for t in seq]).split("\0")
        assert all(p in texts for p in pieces[1:-1])
        assert all(any(p in t for t in texts) for p in (pieces[0], pieces[-1]))
