"""The universal checkpoint (docs/FORMAT.md), one module per concern:

- `format`: names, versions, a parameter's entry, the error type (a leaf);
- `tensorfile`: one parameter's safetensors file: header written and parsed once, the three write paths,
  the verified reader of its blocks;
- `writer`: `UniversalWriter` (locked, staged, marker last), a lazy index's source section;
- `reader`: `UniversalCheckpoint`, with the one validation every reader gets (`problems()`), reads at any
  layout through the stored pattern, lazy reads;
- `check`: the whole checkpoint checked against its digests and headers.

The names below are the package's public interface (`from megatron_ucp.universal import UniversalCheckpoint`).
Each is imported from its module on first use, so importing one module of the package (e.g. `format`, which
io/staging.py and formats/ need for the marker's spelling) does not import the others.
"""

import importlib

_EXPORTS = {
    "format": ("COMPLETE_FILENAME", "FORMAT_NAME", "FORMAT_VERSION", "METADATA_FILENAME", "REQUIRED_METADATA",
               "RNG_FILENAME", "TENSOR_KEYS", "TENSORS_DIRNAME", "ParamInfo", "SavedRngStates", "UniversalFormatError",
               "tensor_file"),
    "reader": ("UniversalCheckpoint",),
    "tensorfile": ("VerifiedTensorFile", "lazy_entry", "safetensors_header", "write_tensor_file",
                   "write_tensor_file_placed", "write_tensor_file_streamed"),
    "writer": ("UniversalWriter", "lazy_section", "source_file_stats", "universal_document"),
    "check": ("UNIVERSAL_CHECKS", "check_universal"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return __all__
