"""The embedded corpus (corpus_texts/*.txt, public-domain prose and verse) as a Megatron indexed dataset.

Bytes are the tokens: UTF-8 byte values 0..255, one document per paragraph, each ended by the tokenizer's
EOD. With Megatron-LM's `--tokenizer-type NullTokenizer --vocab-size 257` the EOD is 256. Written once
per content digest into the data cache (write to a private name, then rename: a second writer or a kill
never leaves a half-written dataset under the final name).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

import numpy as np

TEXTS = Path(__file__).resolve().parent / "corpus_texts"
BYTE_VOCAB = 256


def cache_dir(data_cache_path: Optional[str]) -> Path:
    """--data-cache-path, else $MEGATRON_UCP_CACHE, else ~/.cache/megatron-ucp."""
    if data_cache_path:
        return Path(data_cache_path)
    return Path(os.environ.get("MEGATRON_UCP_CACHE", Path.home() / ".cache" / "megatron-ucp"))


def indexed_dataset_prefix(directory: Path, tokenizer) -> str:
    """Write the corpus under `directory` (once) and return the dataset's path prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    eod = int(tokenizer.eod)
    if tokenizer.vocab_size <= BYTE_VOCAB or not BYTE_VOCAB <= eod < tokenizer.vocab_size:
        raise ValueError(f"the embedded corpus stores bytes (ids 0..255) and needs an EOD id above them; the "
                         f"tokenizer has vocabulary {tokenizer.vocab_size}, EOD {eod}: pass --tokenizer-type "
                         "NullTokenizer --vocab-size 257, or --mock-data / --data-path")
    files = sorted(TEXTS.glob("*.txt"))
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files) + str(eod).encode()).hexdigest()[:16]
    prefix = directory / f"embedded_corpus_{digest}"
    if Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file():
        return str(prefix)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp_{os.getpid()}_embedded_corpus_{digest}"
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=np.uint16)
    for f in files:
        for paragraph in f.read_text(encoding="utf-8").split("\n\n"):
            paragraph = paragraph.strip()
            if paragraph:
                tokens = list(paragraph.encode("utf-8")) + [eod]
                builder.add_document(tokens, [len(tokens)])
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")  # .bin first: readers look for the .idx
    os.replace(f"{tmp}.idx", f"{prefix}.idx")
    return str(prefix)
