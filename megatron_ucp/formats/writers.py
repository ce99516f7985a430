"""Writers of Megatron checkpoints from a universal checkpoint, at any layout (`from-universal`), behind
one declared interface (`base.CheckpointWriter`):

- `torch`: Megatron-LM's legacy format (model_optim_rng.pt [+ distrib_optim.pt] per (tp, pp) rank),
  written offline, one rank's shard in memory at a time (formats/legacy/writer.py);
- `torch_dist`: megatron-core `torch_dist`, written offline and streaming: megatron-core's keys and
  chunks, bytes copied file to file, the files split over torchrun processes (formats/torch_dist/writer.py);
- `torch_dist` `via_megatron_lm` (`--via-megatron-lm`): the same format saved by Megatron-LM itself, its own
  training loop launched at the target layout (formats/torch_dist/megatron_lm_writer.py): the reference the direct
  writer is tested against.
"""

from __future__ import annotations

import importlib

from megatron_ucp.formats.writer_base import CheckpointWriter, PlannedFile, WriteError, WriteTarget


_WRITERS = {"torch": ("megatron_ucp.formats.legacy.writer", "LegacyWriter"),
            "torch_dist": ("megatron_ucp.formats.torch_dist.writer", "DirectTorchDistWriter")}
_MEGATRON_LM_WRITERS = {"torch_dist": ("megatron_ucp.formats.torch_dist.megatron_lm_writer", "MegatronLMTorchDistWriter")}


def make_writer(ckpt_format: str, *, via_megatron_lm: bool = False, **options) -> CheckpointWriter:
    """The writer of `ckpt_format` (with `via_megatron_lm`, the one that runs Megatron-LM's training loop); it takes the
    `options` it declares (`OPTIONS`) and ignores the rest (e.g. timeout_s applies to a writer that runs
    processes); the caller refuses options the user gave that the writer does not declare."""
    table = _MEGATRON_LM_WRITERS if via_megatron_lm else _WRITERS
    if ckpt_format not in table:
        if via_megatron_lm:
            raise WriteError(f"--via-megatron-lm writes {', '.join(_MEGATRON_LM_WRITERS)} through Megatron-LM's training loop; "
                             f"drop it for --ckpt-format {ckpt_format}")
        raise WriteError(f"--ckpt-format {ckpt_format!r}: choose one of {', '.join(CKPT_FORMATS)}")
    module, cls = table[ckpt_format]
    writer = getattr(importlib.import_module(module), cls)
    return writer(**{k: v for k, v in options.items() if k in writer.OPTIONS})


CKPT_FORMATS = ("torch_dist", "torch")

__all__ = ["CKPT_FORMATS", "CheckpointWriter", "PlannedFile", "WriteError", "WriteTarget", "make_writer"]
