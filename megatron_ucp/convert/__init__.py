"""Megatron-LM checkpoint -> universal checkpoint (the `to-universal` conversion), by concern:

- `tasks`: what to convert, one task per canonical parameter, decided before any tensor is read;
- `consolidate`: one parameter's shards -> its consolidated tensors (byte copies or tensors, one
  validation for both);
- `metadata`: the universal checkpoint's metadata.json content;
- `runner`: threads in one process, or the processes of a torchrun job; a direct resume's in-memory index
  (`source_index`); `cli`: the command line.

Only the bytes the universal checkpoint stores are read: with optimizer state the fp32 master weight
and moments, not the model weight.
"""

from megatron_ucp.convert.consolidate import (
    consolidate_parameter, convert_parameter, place_parameter, placement_for, source_keys)
from megatron_ucp.convert.metadata import build_metadata, json_safe
from megatron_ucp.convert.runner import (
    ConversionSummary, SourceIndex, convert, convert_distributed, default_workers, source_index, to_universal)
from megatron_ucp.convert.tasks import ConversionError, ParamTask, conversion_tasks

__all__ = ["ConversionError", "ConversionSummary", "ParamTask", "build_metadata",
           "consolidate_parameter", "conversion_tasks", "convert", "convert_distributed", "convert_parameter",
           "default_workers", "json_safe", "place_parameter", "placement_for", "source_index", "source_keys",
           "SourceIndex", "to_universal"]
