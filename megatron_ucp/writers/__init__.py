"""Writers of Megatron checkpoints from a universal checkpoint, at any layout (`from-universal`), behind
one declared interface (`base.CheckpointWriter`):

- `torch`: Megatron-LM's legacy format (model_optim_rng.pt [+ distrib_optim.pt] per (tp, pp) rank),
  written offline, one rank's shard in memory at a time (writers/legacy.py);
- `torch_dist`: megatron-core `torch_dist`, written by launching the training harness at the target
  layout (it loads the universal checkpoint and saves exactly as Megatron-LM does; writers/torch_dist.py).
"""

from __future__ import annotations

import importlib

from megatron_ucp.writers.base import CheckpointWriter, PlannedFile, WriteError, WriteTarget


_WRITERS = {"torch": ("megatron_ucp.writers.legacy", "LegacyWriter"),
            "torch_dist": ("megatron_ucp.writers.torch_dist", "HarnessTorchDistWriter")}


def make_writer(ckpt_format: str, **options) -> CheckpointWriter:
    """The writer of `ckpt_format`; it takes the `options` it declares (`OPTIONS`) and ignores the rest (e.g.
    timeout_s applies to a writer that runs processes)."""
    if ckpt_format not in _WRITERS:
        raise WriteError(f"--ckpt-format {ckpt_format!r}: choose one of {', '.join(CKPT_FORMATS)}")
    module, cls = _WRITERS[ckpt_format]
    writer = getattr(importlib.import_module(module), cls)
    return writer(**{k: v for k, v in options.items() if k in writer.OPTIONS})


CKPT_FORMATS = ("torch_dist", "torch")

__all__ = ["CKPT_FORMATS", "CheckpointWriter", "PlannedFile", "WriteError", "WriteTarget", "make_writer"]
