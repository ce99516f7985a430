#!/usr/bin/env python
"""Tokenize text into a Megatron indexed dataset (PREFIX_<key>_document.bin/.idx).

Megatron-LM's tools/preprocess_data.py for this repository's tokenizers, with the same flag names
and output naming, so `--data-path PREFIX_text_document` works in both:

    # JSON lines: one object per line, text under --json-keys (default: text)
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my \\
        --tokenizer-type ByteLevelTokenizer --append-eod --workers 4
    # -> data/my_text_document.bin, data/my_text_document.idx

    # Plain text: documents are separated by blank lines
    python tools/preprocess_data.py --input book.txt --text-format --output-prefix data/book \\
        --append-eod

    # Pre-tokenized ids: NullTokenizer reads space-separated integers (EOD = --vocab-size - 1, as Megatron-LM 0.19)
    python tools/preprocess_data.py --input ids.jsonl --output-prefix data/ids \\
        --tokenizer-type NullTokenizer --vocab-size 1000 --append-eod

Tokens are stored as uint16 when the vocabulary has fewer than 65500 entries, else int32
(megatron-core's DType.optimal_dtype, as in Megatron-LM). Empty documents are skipped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import re
import sys
import time
import warnings
from typing import Iterable, Iterator, List, Optional, Tuple

# Run from a checkout: make `megatron_ucp` importable without installing it.
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.path.pardir))
sys.path.insert(0, REPO_ROOT)

TOKENIZER_TYPES = ("ByteLevelTokenizer", "NullTokenizer")
# Importing megatron.core on a machine without Transformer Engine/Apex warns about fallbacks that
# tokenization never uses: keep the output short.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


class InputError(Exception):
    """A problem with the input data; reported as `error: ...` with exit status 1."""


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="preprocess_data.py",
        description="Tokenize JSON-lines or plain text into a Megatron indexed dataset (.bin/.idx).",
        allow_abbrev=False,
    )
    g = p.add_argument_group("input data")
    g.add_argument("--input", type=str, required=True,
                   help="JSON-lines file (one object per line; .gz allowed), or a text file with --text-format")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each JSON object; one dataset per key (default: text)")
    g.add_argument("--text-format", action="store_true",
                   help="--input is plain UTF-8 text; documents are separated by blank lines "
                        "(the output is named after the single --json-keys entry, default 'text')")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteLevelTokenizer")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: number of ids, EOD included (EOD is id vocab-size - 1, as Megatron-LM 0.19's "
                        "--vocab-size)")
    g.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", type=str, required=True,
                   help="path prefix of the outputs, without the _<key>_document suffix")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer worker processes (default 1)")
    g.add_argument("--log-interval", type=int, default=10000, help="report progress every N documents")
    args = p.parse_args(argv)

    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            p.error("--tokenizer-type NullTokenizer needs --vocab-size")
        if args.vocab_size < 2:
            p.error("--vocab-size must be at least 2 (one id and the EOD)")
    elif args.vocab_size is not None:
        p.error(f"--vocab-size only applies to NullTokenizer ({args.tokenizer_type} has a fixed vocabulary)")
    if len(set(args.json_keys)) != len(args.json_keys):
        p.error(f"--json-keys has duplicates: {args.json_keys}")
    if args.text_format and len(args.json_keys) != 1:
        p.error("--text-format produces one dataset: pass at most one --json-keys name")
    return args


class NullTokenizer:
    """Megatron-LM 0.19's NullTokenizer: ids are the text; vocabulary vocab_size, EOD its last id (vocab_size - 1).
    (Megatron-LM 0.16 and older appended the EOD: vocabulary vocab_size + 1.)"""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split(" ")]

    def detokenize(self, ids) -> str:
        return " ".join(str(x) for x in ids)


class ByteLevelTokenizer:
    """UTF-8 bytes as tokens 0..255, EOD = 256: vocab 257."""

    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def build_tokenizer(tokenizer_type: str, vocab_size: Optional[int]):
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    return ByteLevelTokenizer()


def split_text_documents(text: str) -> List[str]:
    """Documents of a plain-text file: blank-line separated paragraphs, stripped, empties dropped."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return [d.strip() for d in _BLANK_LINE.split(text) if d.strip()]


# ---- encoding (runs in worker processes) ----

class Encoder:
    """Per-process tokenizer holder (Megatron-LM's Encoder pattern)."""

    def __init__(self, args: argparse.Namespace):
        self.tokenizer_type = args.tokenizer_type
        self.vocab_size = args.vocab_size
        self.json_keys = list(args.json_keys)
        self.text_format = args.text_format
        self.append_eod = args.append_eod
        self.source = args.input

    def initializer(self) -> None:
        Encoder.tokenizer = build_tokenizer(self.tokenizer_type, self.vocab_size)

    def _tokenize(self, text, where: str) -> List[int]:
        if not isinstance(text, str):
            raise InputError(f"{where}: expected a string, got {type(text).__name__}")
        tokenizer = Encoder.tokenizer
        if self.tokenizer_type == "NullTokenizer":
            try:
                ids = [int(x) for x in text.split()]  # NullTokenizer.tokenize, tolerant of extra spaces
            except ValueError:
                raise InputError(f"{where}: NullTokenizer expects space-separated integer ids") from None
            bad = [i for i in ids if not 0 <= i < tokenizer.eod]
            if bad:
                raise InputError(f"{where}: token id {bad[0]} is outside [0, {tokenizer.eod}) "
                                 f"for --vocab-size {self.vocab_size}")
        else:
            ids = tokenizer.tokenize(text)
        if ids and self.append_eod:
            ids = ids + [tokenizer.eod]
        return ids

    def encode(self, item: Tuple[int, str]) -> Tuple[dict, int]:
        """(number, raw record) -> ({key: token ids}, bytes processed)."""
        number, raw = item
        if self.text_format:
            return {self.json_keys[0]: self._tokenize(raw, f"{self.source}: document {number}")}, len(raw)
        where = f"{self.source} line {number}"
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(data, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(data).__name__}")
        out = {}
        for key in self.json_keys:
            if key not in data:
                raise InputError(f"{where}: key '{key}' not found (keys present: {sorted(data)}); "
                                 f"choose one with --json-keys")
            out[key] = self._tokenize(data[key], f"{where}, key '{key}'")
        return out, len(raw)


def read_records(args: argparse.Namespace) -> Iterator[Tuple[int, str]]:
    """(number, record) pairs: non-blank lines of a JSON-lines file, or text-format documents."""
    opener = gzip.open if args.input.endswith(".gz") else open
    try:
        with opener(args.input, "rt", encoding="utf-8") as f:
            if args.text_format:
                for number, doc in enumerate(split_text_documents(f.read()), start=1):
                    yield number, doc
                return
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield number, line
    except UnicodeDecodeError as e:
        raise InputError(f"{args.input}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def output_paths(output_prefix: str, key: str) -> Tuple[str, str]:
    base = f"{output_prefix}_{key}_document"
    return f"{base}.bin", f"{base}.idx"


def encoded_documents(args, encoder: Encoder, records: Iterable[Tuple[int, str]]):
    if args.workers == 1:
        encoder.initializer()
        for record in records:
            yield encoder.encode(record)
        return
    with multiprocessing.Pool(args.workers, initializer=encoder.initializer) as pool:
        # imap keeps input order, so the dataset is the same for any --workers.
        yield from pool.imap(encoder.encode, records, 32)


def preprocess(args: argparse.Namespace) -> dict:
    """Write the datasets; returns {key: (documents, tokens)}."""
    from megatron_ucp.megatron_lm import cpu_shims

    cpu_shims.install_import_patches()  # megatron-core 0.19 without triton: before megatron is imported
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if not os.path.isfile(args.input):
        raise InputError(f"input file not found: {args.input}")
    if os.path.isdir(args.output_prefix) or args.output_prefix.endswith(os.sep):
        raise InputError(f"--output-prefix must name a file prefix, not a directory: {args.output_prefix}")
    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    encoder = Encoder(args)
    # Write to temporary names and rename at the end, so a failed run leaves no half dataset behind.
    tmp = {key: tuple(f"{p}.tmp{os.getpid()}" for p in output_paths(args.output_prefix, key))
           for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(tmp[key][0], dtype=dtype) for key in args.json_keys}
    stats = {key: [0, 0] for key in args.json_keys}
    skipped = 0
    start = time.time()
    total_bytes = 0
    try:
        for count, (doc, nbytes) in enumerate(encoded_documents(args, encoder, read_records(args)), start=1):
            total_bytes += nbytes
            for key, ids in doc.items():
                if not ids:
                    skipped += 1
                    continue
                builders[key].add_document(ids, [len(ids)])
                stats[key][0] += 1
                stats[key][1] += len(ids)
            if count % args.log_interval == 0:
                elapsed = max(time.time() - start, 1e-9)
                print(f"Processed {count} documents ({count / elapsed:.1f} docs/s, "
                      f"{total_bytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr)
        for key, builder in builders.items():
            builder.finalize(tmp[key][1])
    except BaseException:
        for key, builder in builders.items():
            builder.data_file.close()
            for path in tmp[key]:
                if os.path.exists(path):
                    os.remove(path)
        raise
    for key in args.json_keys:
        bin_path, idx_path = output_paths(args.output_prefix, key)
        os.replace(tmp[key][0], bin_path)
        os.replace(tmp[key][1], idx_path)
    if skipped:
        print(f"Skipped {skipped} empty document(s).", file=sys.stderr)
    return {key: tuple(v) for key, v in stats.items()}


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        if not os.path.isfile(args.input):  # before the (slow) megatron.core import
            raise InputError(f"input file not found: {args.input}")
        stats = preprocess(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for key, (docs, tokens) in stats.items():
        bin_path, idx_path = output_paths(args.output_prefix, key)
        print(f"Wrote {docs} documents, {tokens} tokens: {bin_path}, {idx_path}")
        print(f"  use with: --data-path {bin_path[:-len('.bin')]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
