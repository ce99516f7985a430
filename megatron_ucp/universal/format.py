"""The universal checkpoint format's names and records, as docs/FORMAT.md specifies them: file names,
versions, the metadata keys every checkpoint has, a parameter's entry (`ParamInfo`), the error every
reader and writer raises. A leaf of the universal package: the tensor file, the writer, the reader and
the check import it."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from megatron_ucp.core import optimizers
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.io import integrity
from megatron_ucp.io.integrity import DigestRecord

if TYPE_CHECKING:

    from megatron_ucp.core.patterns import Pattern

FORMAT_NAME = "megatron-ucp-universal"
FORMAT_VERSION = 2
# a lazy checkpoint with `zeroed` entries (elements read as zero whatever their source bytes hold: optimizer state
# its source's release saved nowhere, reset) is version 3, so that a version-2 reader refuses it instead of
# reading those source bytes; everything else is written as version 2
ZEROED_VERSION = 3
# a checkpoint holding another optimizer's state than Adam's (optimizer.type other than "adam", its per-parameter
# state by name in optimizer.states: docs/FORMAT.md "Optimizer state by name") is version 4, so that older readers,
# which know Adam's keys only, refuse it; an Adam checkpoint is written exactly as before (version 2 or 3)
OPTIMIZER_STATES_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)  # version 1: no checksums (read, with sizes and headers checked instead)

METADATA_FILENAME = "metadata.json"
COMPLETE_FILENAME = "COMPLETE"
TENSORS_DIRNAME = "tensors"
TENSOR_KEYS = ("fp32", "exp_avg", "exp_avg_sq")  # an Adam checkpoint's tensors, file order; `fp32` is always present
REQUIRED_METADATA = ("iteration", "consumed_train_samples", "source", "model_config", "args", "optimizer",
                     "scheduler")
MAX_HEADER = integrity.MAX_HEADER  # bytes a tensor file's safetensors header may take

# Canonical names are dotted module paths; anything else could escape tensors/ or clash on disk.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")

PathLike = Union[str, os.PathLike]


class UniversalFormatError(Exception):
    """A universal checkpoint that cannot be written or read; the message names the path and the fix."""


@dataclass(frozen=True)
class ParamInfo:
    """One parameter's entry in metadata.json (see docs/FORMAT.md, "parameters")."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # stored dtype, always "float32"
    model_dtype: str  # dtype of the model parameter during training ("float32", "bfloat16", "float16")
    pattern: "Pattern"
    file: Optional[str]  # relative to the checkpoint directory (None in a lazy checkpoint)
    tensors: tuple[str, ...]
    step: Optional[int]  # the optimizer's per-parameter step (Adam's); None without one
    param_group: dict
    placements: Optional[dict] = None  # lazy checkpoints: key -> Placement (bytes in the source checkpoint)
    # lazy checkpoints: key -> ((start, length), ...) element runs (flat) that read as zero whatever their source
    # bytes hold (optimizer state the source's release saved nowhere, reset: docs/FORMAT.md "zeroed")
    zeroed: Optional[dict] = None
    checksum: Optional[DigestRecord] = None  # block digests of the tensor file (version 2)

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data the parameter's file holds (every key, float32)."""
        return math.prod(self.shape) * 4 * len(self.tensors)


def tensor_keys(optimizer_type: Optional[str]) -> tuple[str, ...]:
    """A parameter's tensors with its optimizer's state, in file order: 'fp32', then the optimizer's state names
    (core/optimizers.py's table; none for None: no optimizer state)."""
    if optimizer_type is None:
        return ("fp32",)
    try:
        return ("fp32",) + optimizers.optimizer_states(optimizer_type).states
    except optimizers.OptimizerNotSupported as e:
        raise UniversalFormatError(str(e)) from None


def ordered_keys(keys) -> tuple[str, ...]:
    """A parameter's tensor keys in file order ('fp32' first, then core/optimizers.py's STATE_ORDER); every key
    checked (a checkpoint's state names are data) and the set one an optimizer has: 'fp32' alone (a buffer, a
    weights-only checkpoint) or 'fp32' with all of one optimizer's states."""
    keys = set(keys)
    try:
        states = sorted((optimizers.check_state_name(k) for k in keys - {"fp32"}), key=optimizers.STATE_ORDER.index)
    except ValueError as e:
        raise UniversalFormatError(str(e)) from None
    if "fp32" not in keys:
        raise UniversalFormatError(f"tensors {sorted(keys)}: a parameter needs 'fp32'")
    if states and not any(set(states) == set(row.states) for row in optimizers.OPTIMIZERS.values()):
        raise UniversalFormatError(
            f"tensors {sorted(keys)}: no optimizer keeps exactly the states {states} ("
            + "; ".join(f"{row.name}: {', '.join(row.states)}" for row in optimizers.OPTIMIZERS.values()) + ")")
    return ("fp32", *states)


def optimizer_section(optimizer_type: Optional[str], param_groups: list, args: Optional[dict] = None) -> dict:
    """metadata.json's `optimizer`: the type (core/optimizers.py's name, None without optimizer state), the param
    groups' hyper-parameters as saved and, for any type but Adam's (whose checkpoints stay as versions 1-3 wrote
    them), the per-parameter states by name of every optimizer the run gives parameters (an emerging optimizer's
    and its scalar optimizer's: `args`) with their patterns (all elementwise: sharded as their parameter)."""
    doc: dict = {"type": optimizer_type, "param_groups": param_groups}
    if optimizer_type not in (None, "adam"):
        try:
            states = optimizers.run_states(optimizer_type, args or {})
        except optimizers.OptimizerNotSupported as e:
            raise UniversalFormatError(str(e)) from None
        doc["states"] = {key: "elementwise" for key in states}
    return doc


def document_version(doc: dict) -> int:
    """The version a metadata.json document is written as: FORMAT_VERSION, ZEROED_VERSION with lazy 'zeroed'
    entries, OPTIMIZER_STATES_VERSION with another optimizer's state than Adam's."""
    version = FORMAT_VERSION
    if any(entry.get("zeroed") for entry in doc.get("parameters", {}).values()):
        version = ZEROED_VERSION
    optimizer = doc.get("optimizer")
    if isinstance(optimizer, dict) and optimizer.get("type") not in (None, "adam"):
        version = OPTIMIZER_STATES_VERSION
    return version


def tensor_file(name: str) -> str:
    """Relative path of a parameter's safetensors file."""
    return f"{TENSORS_DIRNAME}/{name}.safetensors"


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UniversalFormatError(f"parameter name {name!r} is not a dotted canonical name "
                                   "(letters, digits, '_' and '.'); it cannot name a file under tensors/")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, doc: Any) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


RNG_FILENAME = "rng_states.json"
MAX_RNG_FILE = 1 << 30  # bytes; ~50 KB per rank on CPU runs, far less with CUDA generator states


@dataclass(frozen=True)
class SavedRngStates:
    """What the writer stores about the source's RNG: every rank's state, the layout and micro-batch size
    they were drawn at (a resume restores them only there)."""

    states: tuple  # run_state.RankRngState
    layout: ParallelLayout
    micro_batch_size: Optional[int]

