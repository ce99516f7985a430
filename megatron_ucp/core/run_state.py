"""The run state a resume needs besides parameters and Adam moments: the fp16 loss scaler and the
per-rank RNG states, in the JSON forms docs/FORMAT.md specifies ("Loss scaler", "RNG states").

- `LossScalerState`: megatron-core's DynamicGradScaler state ({scale: float32 tensor [1], growth_tracker,
  hysteresis_tracker}), which every rank holds identically (overflow is checked over all ranks), so it
  means the same at any layout.
- `RankRngState`: one rank's `get_rng_state()` as Megatron-LM saves it (python `random`, numpy, torch CPU
  and CUDA generators, megatron-core's tracker streams). Meaningful only at the layout that drew it:
  which dropout masks a rank draws depends on its shard shapes, layers and micro-batches.

Both are built from the objects a Megatron checkpoint's pickles hold, as serialization/safe_pickle.py parses
them (TensorRecord, NumpyArray: no torch needed, nothing unpickled for real), or from live values (torch
tensors, numpy arrays, for tests and the plugin), and are turned back into what megatron-core's
load_state_dict / Megatron-LM's set-rng code take (torch imported on use). Bytes of generator states
are stored as base64 so the file stays plain JSON.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

RNG_FILE_FORMAT = "megatron-ucp-rng-states"
RNG_FILE_VERSION = 1
MT_WORDS = 624  # Mersenne-Twister state words (python random, numpy MT19937)


class RunStateError(ValueError):
    """A loss-scaler or RNG state that cannot be read; the message names where it came from."""


def _bytes_of(value: Any, where: str) -> bytes:
    """A uint8 tensor's bytes: a parsed TensorRecord (read from its file) or a live torch tensor."""
    from megatron_ucp.serialization.safe_pickle import SafeLoadError, TensorRecord, read_tensor_bytes

    if isinstance(value, TensorRecord):
        if value.dtype != "uint8" or len(value.shape) != 1:
            raise RunStateError(f"{where}: a {value.dtype} tensor of shape {value.shape}, expected a 1-D uint8 "
                                f"generator state")
        try:
            return bytes(read_tensor_bytes(value))
        except SafeLoadError as e:
            raise RunStateError(f"{where}: {e}") from None
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        if str(value.dtype) != "torch.uint8" or value.dim() != 1:
            raise RunStateError(f"{where}: a {value.dtype} tensor of shape {tuple(value.shape)}, expected a 1-D "
                                f"uint8 generator state")
        return bytes(value.contiguous().numpy().tobytes())
    raise RunStateError(f"{where}: {type(value).__name__} where a generator state (uint8 tensor) is expected")


def _number(value: Any, where: str) -> float:
    from megatron_ucp.serialization.safe_pickle import SafeLoadError, TensorRecord, read_scalar

    if isinstance(value, TensorRecord):
        try:
            return float(read_scalar(value))
        except SafeLoadError as e:
            raise RunStateError(f"{where}: {e}") from None
    if hasattr(value, "numel") and value.numel() == 1:  # a live torch tensor
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RunStateError(f"{where}: {type(value).__name__} where a number is expected")
    return float(value)


def _int(value: Any, where: str) -> int:
    number = _number(value, where)
    if number != int(number):
        raise RunStateError(f"{where}: {number} is not an integer")
    return int(number)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, where: str) -> bytes:
    if not isinstance(text, str):
        raise RunStateError(f"{where}: {type(text).__name__}, expected a base64 string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise RunStateError(f"{where}: not base64 ({e})") from None


# --------------------------------------------------------------------------------------------------
# Loss scaler


@dataclass(frozen=True)
class LossScalerState:
    """megatron-core's DynamicGradScaler state: the current scale, steps since the last overflow
    (growth tracker) and overflows still tolerated before the next back-off (hysteresis tracker)."""

    scale: float
    growth_tracker: int
    hysteresis_tracker: int

    @classmethod
    def from_saved(cls, state: Any, where: str) -> Optional["LossScalerState"]:
        """From an optimizer's saved `grad_scaler` entry; None for a scaler without state (megatron-core's
        ConstantGradScaler saves an empty dict: its scale comes from --loss-scale)."""
        if state is None or (isinstance(state, dict) and not state):
            return None
        if not isinstance(state, dict) or not {"scale", "growth_tracker", "hysteresis_tracker"} <= set(state):
            keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise RunStateError(f"{where}: grad_scaler holds {keys}, expected scale, growth_tracker and "
                                f"hysteresis_tracker (megatron-core's DynamicGradScaler)")
        scaler = cls(scale=_number(state["scale"], f"{where} scale"),
                     growth_tracker=_int(state["growth_tracker"], f"{where} growth_tracker"),
                     hysteresis_tracker=_int(state["hysteresis_tracker"], f"{where} hysteresis_tracker"))
        if not scaler.scale > 0 or scaler.scale == float("inf"):
            raise RunStateError(f"{where}: loss scale {scaler.scale} is not a positive finite number")
        return scaler

    def to_json(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Optional["LossScalerState"]:
        if doc is None:
            return None
        if not isinstance(doc, dict):
            raise RunStateError(f"{where}: loss_scaler is a {type(doc).__name__}, expected an object or null")
        return cls.from_saved(doc, where)

    def to_megatron(self, tensor: Optional["TensorMaker"] = None) -> dict:
        """What DynamicGradScaler.load_state_dict takes (the scale as a float32 tensor of one element), tensors
        made by `tensor` (default torch_tensor)."""
        tensor = tensor or torch_tensor
        return {"scale": tensor(struct.pack("<f", self.scale), "float32", (1,)), "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}


# --------------------------------------------------------------------------------------------------
# RNG states


@dataclass(frozen=True)
class RankRngState:
    """One rank's RNG state, as Megatron-LM's get_rng_state() collects it. `dp` is None when the state is
    shared by the data-parallel ranks of a (pp, tp) rank (Megatron-LM's default); set with expert
    parallelism or --data-parallel-random-init, where DP ranks hold different streams."""

    pp: int
    tp: int
    dp: Optional[int]
    python: tuple  # random.getstate(): (version, 625 ints, gauss_next)
    numpy: tuple  # np.random.get_state(): ('MT19937', 624 uint32 words, pos, has_gauss, cached_gaussian)
    torch_cpu: bytes  # torch.get_rng_state()
    cuda: bytes  # torch.cuda.get_rng_state() (the CPU generator's on CPU runs)
    tracker: tuple  # megatron-core's tracker streams: ((name, state bytes), ...), in the saved order

    @property
    def key(self) -> tuple:
        return (self.pp, self.tp, self.dp)

    @classmethod
    def from_saved(cls, state: Any, *, pp: int, tp: int, dp: Optional[int], where: str) -> "RankRngState":
        """From one element of a checkpoint's `rng_state` list (parsed or live values)."""
        need = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states")
        if not isinstance(state, dict) or not set(need) <= set(state):
            keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise RunStateError(f"{where}: rng_state holds {keys}, expected {', '.join(need)}")
        tracker = state["rng_tracker_states"]
        if not isinstance(tracker, dict) or not all(isinstance(k, str) for k in tracker):
            raise RunStateError(f"{where}: rng_tracker_states is {type(tracker).__name__}, expected a dict of "
                                f"named generator states")
        return cls(pp=pp, tp=tp, dp=dp,
                   python=_python_state(state["random_rng_state"], f"{where} random_rng_state"),
                   numpy=_numpy_state(state["np_rng_state"], f"{where} np_rng_state"),
                   torch_cpu=_bytes_of(state["torch_rng_state"], f"{where} torch_rng_state"),
                   cuda=_bytes_of(state["cuda_rng_state"], f"{where} cuda_rng_state"),
                   tracker=tuple((name, _bytes_of(value, f"{where} rng_tracker_states[{name!r}]"))
                                 for name, value in tracker.items()))

    def to_json(self) -> dict:
        version, internal, gauss = self.python
        algorithm, words, pos, has_gauss, cached = self.numpy
        return {"pp": self.pp, "tp": self.tp, "dp": self.dp,
                "python": {"version": version, "state": list(internal), "gauss_next": gauss},
                "numpy": {"algorithm": algorithm, "key": list(words), "pos": pos, "has_gauss": has_gauss,
                          "cached_gaussian": cached},
                "torch_cpu": _b64(self.torch_cpu), "cuda": _b64(self.cuda),
                "tracker": {name: _b64(data) for name, data in self.tracker}}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> "RankRngState":
        try:
            python, numpy = doc["python"], doc["numpy"]
            dp = doc.get("dp")
            rank = f"{where} (pp={doc['pp']}, tp={doc['tp']}" + (f", dp={dp})" if dp is not None else ")")
            return cls(pp=int(doc["pp"]), tp=int(doc["tp"]), dp=None if dp is None else int(dp),
                       python=_python_state((python["version"], python["state"], python["gauss_next"]), rank),
                       numpy=_numpy_state((numpy["algorithm"], numpy["key"], numpy["pos"], numpy["has_gauss"],
                                           numpy["cached_gaussian"]), rank),
                       torch_cpu=_unb64(doc["torch_cpu"], f"{rank} torch_cpu"),
                       cuda=_unb64(doc["cuda"], f"{rank} cuda"),
                       tracker=tuple((str(n), _unb64(v, f"{rank} tracker {n}"))
                                     for n, v in dict(doc["tracker"]).items()))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, RunStateError):
                raise
            raise RunStateError(f"{where}: malformed RNG state entry ({type(e).__name__}: {e})") from None

    def to_megatron(self, tensor: Optional["TensorMaker"] = None) -> dict:
        """The dict Megatron-LM's get_rng_state() returns (numpy imported here), generator states made by
        `tensor` (default torch_tensor)."""
        import numpy as np

        tensor = tensor or torch_tensor

        def state(data: bytes):
            return tensor(data, "uint8", (len(data),))

        version, internal, gauss = self.python
        algorithm, words, pos, has_gauss, cached = self.numpy
        return {"random_rng_state": (version, tuple(internal), gauss),
                "np_rng_state": (algorithm, np.array(words, dtype=np.uint32), pos, has_gauss, cached),
                "torch_rng_state": state(self.torch_cpu), "cuda_rng_state": state(self.cuda),
                "rng_tracker_states": {name: state(data) for name, data in self.tracker}}


# A maker of the tensors a Megatron state holds: (C-order little-endian bytes, dtype name, shape) -> tensor.
# torch_tensor makes torch tensors; writers that frame torch.save's format themselves (serialization/torch_save.py)
# pass SavedTensor, and need no torch.
TensorMaker = Callable[[bytes, str, tuple], Any]


def torch_tensor(data: bytes, dtype: str, shape: tuple):
    """A new torch tensor of the bytes (imports torch)."""
    import torch

    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).view(shape).clone()


_MT_MASK = 0xFFFFFFFF


def cpu_generator_state(seed: int) -> bytes:
    """torch.Generator().manual_seed(seed).get_state() without torch: CPUGeneratorImplState (5056 bytes, little
    endian): the initial seed (u64), left = 1 and seeded = 1 (i32 each), next = 0 (u64), the 624 words of
    mt19937 seeded with the seed's low 32 bits (as u64), the cached double normal (3 doubles and a flag,
    unset) and the cached float normal (a float and a flag, unset), with C struct padding.
    tests/test_torch_save.py compares it with torch's."""
    words = [seed & _MT_MASK]
    for j in range(1, MT_WORDS):
        prev = words[-1]
        words.append((1812433253 * (prev ^ (prev >> 30)) + j) & _MT_MASK)
    return (struct.pack("<QiiQ", seed & 0xFFFFFFFFFFFFFFFF, 1, 1, 0) + struct.pack(f"<{MT_WORDS}Q", *words)
            + struct.pack("<dddi4x", 0.0, 0.0, 0.0, 0) + struct.pack("<f?3x", 0.0, False))


def _python_state(value: Any, where: str) -> tuple:
    """random.getstate(): (3, 624 words + position, gauss_next)."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise RunStateError(f"{where}: {type(value).__name__}, expected python random's (version, state, gauss_next)")
    version, internal, gauss = value
    if version != 3 or not isinstance(internal, (tuple, list)) or len(internal) != MT_WORDS + 1 or not all(
            isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 2 ** 32 for w in internal[:MT_WORDS]):
        raise RunStateError(f"{where}: not a version-3 Mersenne-Twister state of {MT_WORDS} 32-bit words and a "
                            f"position")
    if not isinstance(internal[-1], int) or not 0 <= internal[-1] <= MT_WORDS:
        raise RunStateError(f"{where}: position {internal[-1]!r} outside 0..{MT_WORDS}")
    if gauss is not None and not isinstance(gauss, float):
        raise RunStateError(f"{where}: gauss_next {gauss!r} is neither None nor a float")
    return (3, tuple(internal), gauss)


def _numpy_state(value: Any, where: str) -> tuple:
    """np.random.get_state(): ('MT19937', 624 uint32 words, pos, has_gauss, cached_gaussian)."""
    from megatron_ucp.serialization.safe_pickle import NumpyArray

    if not isinstance(value, (tuple, list)) or len(value) != 5 or value[0] != "MT19937":
        raise RunStateError(f"{where}: expected numpy's ('MT19937', key, pos, has_gauss, cached_gaussian)")
    _, key, pos, has_gauss, cached = value
    if isinstance(key, NumpyArray):
        if key.shape != (MT_WORDS,) or key.dtype.str not in ("<u4", "|u4", "=u4"):
            raise RunStateError(f"{where}: key is a {key.dtype.str} array of shape {key.shape}, expected {MT_WORDS} "
                                f"uint32 words")
        key = struct.unpack(f"<{MT_WORDS}I", key.data)
    elif type(key).__module__ == "numpy":
        key = tuple(int(w) for w in key.reshape(-1))
    if not isinstance(key, (tuple, list)) or len(key) != MT_WORDS or not all(
            isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 2 ** 32 for w in key):
        raise RunStateError(f"{where}: key is not {MT_WORDS} uint32 words")
    pos, has_gauss = _int(pos, f"{where} pos"), _int(has_gauss, f"{where} has_gauss")
    if not 0 <= pos <= MT_WORDS or has_gauss not in (0, 1):
        raise RunStateError(f"{where}: pos {pos} / has_gauss {has_gauss} out of range")
    return ("MT19937", tuple(int(w) for w in key), pos, has_gauss, _number(cached, f"{where} cached_gaussian"))


def rng_file(states: list, layout: Mapping[str, Any], micro_batch_size: Optional[int]) -> dict:
    """The content of a universal checkpoint's RNG-state file (docs/FORMAT.md, "RNG states")."""
    return {"format": RNG_FILE_FORMAT, "version": RNG_FILE_VERSION, "layout": dict(layout),
            "micro_batch_size": micro_batch_size,
            "states": [s.to_json() for s in sorted(states, key=lambda s: (s.pp, s.tp, -1 if s.dp is None else s.dp))]}


def parse_rng_file(doc: Any, where: str) -> list:
    if not isinstance(doc, dict) or doc.get("format") != RNG_FILE_FORMAT:
        raise RunStateError(f"{where}: not a {RNG_FILE_FORMAT} file")
    if doc.get("version") != RNG_FILE_VERSION:
        raise RunStateError(f"{where}: RNG file version {doc.get('version')!r}, this megatron-ucp reads "
                            f"{RNG_FILE_VERSION}; upgrade megatron-ucp")
    if not isinstance(doc.get("states"), list):
        raise RunStateError(f"{where}: 'states' is not a list")
    states = [RankRngState.from_json(entry, where) for entry in doc["states"]]
    keys = [s.key for s in states]
    if len(set(keys)) != len(keys):
        raise RunStateError(f"{where}: a rank's RNG state appears twice")
    return states


def state_for_rank(states: list, pp: int, tp: int, dp: int, *, dp_cp: Optional[int] = None,
                   dp_cp_size: Optional[int] = None) -> Optional[RankRngState]:
    """The state rank (pp, tp) with DP rank `dp` restores: its own, or its (pp, tp) rank's shared one. Per-rank
    states are a list over the DP ranks (--data-parallel-random-init: the CP ranks of a DP rank share its state) or,
    in megatron-core 0.16's torch_dist saves with experts, one per DP x CP rank (`dp_cp` of `dp_cp_size`): told
    apart by their count (alike at CP = 1)."""
    by_key = {s.key: s for s in states}
    per_rank = sum(1 for s in states if (s.pp, s.tp) == (pp, tp) and s.dp is not None)
    own = dp_cp if dp_cp is not None and dp_cp_size and per_rank == dp_cp_size else dp
    return by_key.get((pp, tp, own)) or by_key.get((pp, tp, None))


def restore_rng(state: RankRngState) -> None:
    """Set this process's generators as Megatron-LM's load_checkpoint does (and the CUDA one when present)."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    live = state.to_megatron()
    random.setstate(live["random_rng_state"])
    np.random.set_state(live["np_rng_state"])
    torch.set_rng_state(live["torch_rng_state"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(live["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(live["rng_tracker_states"])
