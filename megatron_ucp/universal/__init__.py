"""The universal checkpoint (docs/FORMAT.md), one module per concern:

- `format`: names, versions, a parameter's entry, the error type (a leaf);
- `tensorfile`: one parameter's safetensors file: header written and parsed once, the three write paths,
  the verified reader of its blocks;
- `writer`: `UniversalWriter` (locked, staged, marker last), a lazy index's source section;
- `reader`: `UniversalCheckpoint`, with the one validation every reader gets (`problems()`), reads at any
  layout through the stored pattern, lazy reads;
- `check`: the whole checkpoint checked against its digests and headers.

The names below are the package's public interface; callers import them from here.
"""

from megatron_ucp.universal.check import UNIVERSAL_CHECKS, check_universal
from megatron_ucp.universal.format import (
    COMPLETE_FILENAME, FORMAT_NAME, FORMAT_VERSION, METADATA_FILENAME, REQUIRED_METADATA, RNG_FILENAME, TENSORS_DIRNAME,
    TENSOR_KEYS, ParamInfo, SavedRngStates, UniversalFormatError, tensor_file)
from megatron_ucp.universal.reader import UniversalCheckpoint
from megatron_ucp.universal.tensorfile import (
    VerifiedTensorFile, lazy_entry, safetensors_header, write_tensor_file, write_tensor_file_placed,
    write_tensor_file_streamed)
from megatron_ucp.universal.writer import UniversalWriter, lazy_section, source_file_stats

__all__ = ["COMPLETE_FILENAME", "FORMAT_NAME", "FORMAT_VERSION", "METADATA_FILENAME", "REQUIRED_METADATA",
           "RNG_FILENAME", "TENSOR_KEYS", "TENSORS_DIRNAME", "UNIVERSAL_CHECKS", "ParamInfo", "SavedRngStates",
           "UniversalCheckpoint", "UniversalFormatError", "UniversalWriter", "VerifiedTensorFile", "check_universal",
           "lazy_entry", "lazy_section", "safetensors_header", "source_file_stats", "tensor_file", "write_tensor_file",
           "write_tensor_file_placed", "write_tensor_file_streamed"]
