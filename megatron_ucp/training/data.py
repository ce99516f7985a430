"""Training data: tokenizers, megatron-core GPT datasets, and a layout-independent sampler.

Three sources, all through megatron-core's BlendedMegatronDatasetBuilder exactly as Megatron-LM's
pretrain_gpt.py drives it:
- `--mock-data`: megatron-core's MockGPTDataset (same samples as Megatron-LM's --mock-data);
- `--data-path PREFIX`: Megatron indexed datasets (`PREFIX.bin/.idx`, see tools/preprocess_data.py);
- neither: the embedded corpus (megatron_ucp/training/corpus/*.txt), byte-level tokenized and
  written once as an indexed dataset into the data cache.

The sampler orders samples by `consumed_samples` only: global batch b holds samples
[b*GBS, (b+1)*GBS); each micro-step takes MBS*DP consecutive samples and DP rank r takes the r-th
MBS of them (Megatron-LM's MegatronPretrainingSampler). The set of samples in a global batch never
depends on DP, so runs at different layouts train on the same data.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np
import torch

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"


class NullTokenizer(MegatronLegacyTokenizer):
    """Megatron-LM's NullTokenizer: ids are the text; vocab = --vocab-size + 1 (EOD = last id)."""

    def __init__(self, vocab_size: int):
        super().__init__(None, vocab_size=vocab_size)
        self._vocab_size_without_eod = int(vocab_size)

    def tokenize(self, text):
        return [int(x) for x in text.split(" ")]

    def detokenize(self, ids):
        return " ".join(str(x) for x in ids)

    @property
    def vocab_size(self):
        return self._vocab_size_without_eod + 1

    @property
    def vocab(self):
        raise NotImplementedError

    @property
    def inv_vocab(self):
        raise NotImplementedError

    @property
    def eod(self):
        return self._vocab_size_without_eod

    @property
    def pad(self):
        return -1


class ByteLevelTokenizer(MegatronLegacyTokenizer):
    """UTF-8 bytes as tokens 0..255, EOD = 256: vocab 257 (not a multiple of 128, so padded)."""

    def __init__(self):
        super().__init__(None)

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab_size(self):
        return 257

    @property
    def vocab(self):
        return {bytes([i]).decode("latin-1"): i for i in range(256)}

    @property
    def inv_vocab(self):
        return {i: bytes([i]).decode("latin-1") for i in range(256)}

    @property
    def eod(self):
        return 256

    @property
    def pad(self):
        return -1


def build_tokenizer(args):
    if args.tokenizer_type == "NullTokenizer":
        return NullTokenizer(args.vocab_size)
    return ByteLevelTokenizer()


def embedded_corpus_prefix(cache_dir: Path) -> str:
    """Write the embedded corpus as a Megatron indexed dataset (once) and return its prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    files = sorted(CORPUS_DIR.glob("*.txt"))
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
    prefix = cache_dir / f"embedded_corpus_{digest}"
    if Path(f"{prefix}.idx").exists() and Path(f"{prefix}.bin").exists():
        return str(prefix)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp_{os.getpid()}_embedded_corpus_{digest}"
    tokenizer = ByteLevelTokenizer()
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=np.uint16)
    for f in files:
        # One document per paragraph, each ending with EOD.
        for paragraph in f.read_text(encoding="utf-8").split("\n\n"):
            paragraph = paragraph.strip()
            if paragraph:
                builder.add_document(tokenizer.tokenize(paragraph) + [tokenizer.eod], [len(paragraph.encode()) + 1])
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")
    return str(prefix)


def default_cache_dir(args) -> Path:
    if args.data_cache_path:
        return Path(args.data_cache_path)
    return Path(os.environ.get("MEGATRON_UCP_CACHE", Path.home() / ".cache" / "megatron-ucp"))


def build_train_dataset(args, tokenizer, build_on_this_rank: bool):
    """Megatron-LM's train_valid_test_datasets_provider, train split only."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    blend = None
    split = args.split
    if not args.mock_data:
        prefixes = args.data_path or [embedded_corpus_prefix(default_cache_dir(args))]
        blend = (prefixes, None) if len(prefixes) == 1 or not _is_weighted(prefixes) else _parse_weighted(prefixes)
        # Embedded corpus: all train. Its ~140 documents leave "969, 30, 1"'s test split empty, and
        # megatron-core's GPTDataset loops forever on an empty split (_get_num_epochs).
        split = split or ("969, 30, 1" if args.data_path else "100, 0, 0")
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split=split,
        path_to_cache=str(default_cache_dir(args) / "index-cache") if not args.mock_data else None,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=0.005,
    )
    train_samples = args.train_iters * args.global_batch_size
    eval_samples = (args.train_iters // args.eval_interval + 1) * args.eval_iters * args.global_batch_size
    test_samples = args.eval_iters * args.global_batch_size
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(
        dataset_type, [train_samples, eval_samples, test_samples], lambda: build_on_this_rank, config
    ).build()
    return train


def _is_weighted(prefixes):
    try:
        float(prefixes[0])
        return True
    except ValueError:
        return False


def _parse_weighted(items):
    weights = [float(w) for w in items[0::2]]
    return [str(p) for p in items[1::2]], weights


class PretrainingSampler:
    """Yields this DP rank's micro-batches of sample indices, starting at consumed_samples."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left to consume: consumed {consumed_samples} of {total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.step = micro_batch_size * data_parallel_size

    def __iter__(self) -> Iterator[List[int]]:
        start = self.rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - self.step + 1, self.step):
            yield list(range(first + start, first + start + self.micro_batch_size))


def micro_batches(dataset, sampler: PretrainingSampler) -> Iterator[dict]:
    """Collate each micro-batch of samples into tensors (default_collate, like torch's DataLoader)."""
    from torch.utils.data import default_collate

    for indices in sampler:
        yield default_collate([dataset[i] for i in indices])


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
