"""Readers for Megatron-LM checkpoints (legacy `torch` and `torch_dist`): per-rank local shards
with model weights and exact optimizer state."""

from megatron_ucp.formats.common import (
    CheckpointFormatError, MegatronCheckpoint, PickledEnum, ShardRef, open_checkpoint)

__all__ = ["CheckpointFormatError", "MegatronCheckpoint", "PickledEnum", "ShardRef", "open_checkpoint"]
