"""Run megatron-core on CPU (gloo), and fix the two megatron-core traps on the torch-Adam path.

megatron-core assumes CUDA in a handful of places. When CUDA is absent, `apply()` installs small,
individually documented patches so the same training code runs on CPU across processes with gloo.
Each patch names the megatron-core version it was written against; `tests/test_cpu_backend.py`
fails loudly when megatron-core changes under a patch.

The torch-Adam fixes (`fix_shared_adam_step`) apply on every device: they correct megatron-core
behaviour, not a missing CUDA.
"""

from __future__ import annotations

import functools
import os

import torch

# The megatron-core releases these patches were written and tested against.
TESTED_MCORE_VERSIONS = ("0.16.1",)

_applied = False
_adam_fix_applied = False


class UntestedMegatronCoreError(RuntimeError):
    pass


def mcore_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_mcore_version() -> None:
    version = mcore_version()
    if version not in TESTED_MCORE_VERSIONS and not os.environ.get("MEGATRON_UCP_ALLOW_UNTESTED_MCORE"):
        raise UntestedMegatronCoreError(
            f"megatron-core {version} is installed but megatron-ucp's CPU backend and Adam fixes were "
            f"tested on {', '.join(TESTED_MCORE_VERSIONS)}; install megatron-core=={TESTED_MCORE_VERSIONS[-1]} "
            "or set MEGATRON_UCP_ALLOW_UNTESTED_MCORE=1 and run tests/test_cpu_backend.py first")


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply() -> bool:
    """Install the CPU patches if CUDA is absent. Returns True when running on CPU."""
    global _applied
    if not cuda_available():
        _import_mcore_without_torch_compile()
    check_mcore_version()
    fix_shared_adam_step()
    if cuda_available():
        return False
    if _applied:
        return True
    _map_cuda_device_to_cpu()
    _noop_cuda_synchronize()
    _cuda_type_names()
    _cpu_rng_tracker()
    _torch_norm_under_sequence_parallel()
    _fork_checkpoint_results_queue()
    _applied = True
    return True


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")


# --- CUDA absent ------------------------------------------------------------------------------

def import_megatron_core() -> None:
    """Import megatron-core; on CPU without its torch.compile'd kernels. Call before any megatron import."""
    if not cuda_available():
        _import_mcore_without_torch_compile()


def _import_mcore_without_torch_compile() -> None:
    # megatron-core wraps its fused kernels in torch.compile at import time (megatron.core.jit),
    # which imports TorchDynamo: ~10 s per process. The fused paths are off on CPU (as with
    # Megatron-LM's --disable-jit-fuser), so import megatron-core with a no-op decorator.
    import sys
    import warnings

    # Expected on CPU (no TransformerEngine/Apex): megatron-core warns once per process and module.
    for message in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                    "Transformer Engine is not installed"):
        warnings.filterwarnings("ignore", message=f".*{message}.*")
    if "megatron.core" in sys.modules:
        return
    original = torch.compile

    def no_compile(model=None, **kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = no_compile
    try:
        import megatron.core  # noqa: F401
        from megatron.core import jit

        jit.disable_jit_fuser()
    finally:
        torch.compile = original


def _fork_checkpoint_results_queue() -> None:
    # dist_checkpointing's writer reports through a multiprocessing Manager started with "spawn",
    # which re-imports the training script in a fresh interpreter: ~6 s on the first save of every
    # process. "spawn" guards against forking a CUDA context; without CUDA a fork is safe and instant.
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CUDAToCPUMode(torch.overrides.TorchFunctionMode):
    """Rewrites device='cuda' (and .to('cuda')) to the CPU for every torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


_cuda_to_cpu_mode = None


def _map_cuda_device_to_cpu() -> None:
    # megatron-core allocates with device='cuda' / torch.cuda.current_device() and moves modules
    # with .cuda(); on CPU all of these must mean "cpu".
    global _cuda_to_cpu_mode
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    _cuda_to_cpu_mode = _CUDAToCPUMode()
    _cuda_to_cpu_mode.__enter__()  # for the life of the process


def _noop_cuda_synchronize() -> None:
    # Timers and checkpoint writers call torch.cuda.synchronize(); CPU ops are already synchronous.
    torch.cuda.synchronize = lambda *args, **kwargs: None


def _cuda_type_names() -> None:
    # The optimizers pick their code path with `param.type() == 'torch.cuda.FloatTensor'` (e.g.
    # megatron/core/optimizer/distrib_optimizer.py); report CPU tensors under the CUDA type names.
    original = torch.Tensor.type
    names = {
        "torch.FloatTensor": "torch.cuda.FloatTensor",
        "torch.HalfTensor": "torch.cuda.HalfTensor",
        "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    }

    @functools.wraps(original)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return names.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


class CPURNGStatesTracker:
    """megatron-core's CudaRNGStatesTracker with the CPU generator in place of the CUDA one.

    Tensor-parallel weight init and dropout fork named RNG streams ('model-parallel-rng', ...);
    on CPU those streams must drive the CPU generator, seeded exactly as Megatron seeds CUDA's.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    def fork(self, name="model-parallel-rng"):
        import contextlib

        @contextlib.contextmanager
        def _fork():
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

        return _fork()


def _cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # initialize_rng_tracker() would replace the tracker with a CUDA one; keep ours.
    mcore_random.initialize_rng_tracker = lambda *args, **kwargs: None
    # Megatron's get_all_rng_states / checkpointing read "CUDA" RNG state: use the CPU generator's.
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _torch_norm_under_sequence_parallel() -> None:
    # The local (non-TE) layer spec builds its norms with WrappedTorchNorm, which refuses
    # sequence parallelism. Torch norms are per token, so they are correct on sequence shards;
    # what SP needs is the `sequence_parallel` mark on their parameters so finalize_model_grads
    # all-reduces their gradients across the TP group.
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sp = config.sequence_parallel
        if sp:
            config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for param in norm.parameters():
            setattr(param, "sequence_parallel", sp)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__


# --- torch Adam fixes (any device) ------------------------------------------------------------

def fix_shared_adam_step() -> None:
    """Give every parameter its own, correct Adam `step` after a distributed-optimizer load.

    megatron-core 0.16.1's DistributedOptimizer.load_state_dict (torch-Adam path, no Apex/TE):
    - puts ONE `step` tensor into every parameter's state; torch's Adam increments `step` in
      place per parameter, so after a resume the shared counter advances N times per iteration
      and the bias correction is wrong;
    - then, for the `dp_reshardable` format, copies the *template's* `step` (whatever the fresh
      optimizer held) over it, losing the restored value.
    The checkpoint's step is in the param groups; we restore it per parameter after the load.
    - asserts in state_dict() before the first successful Adam step (no `step` anywhere yet).
    """
    global _adam_fix_applied
    if _adam_fix_applied:
        return
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        restore_adam_steps_from_param_groups(self.optimizer)
        return result

    DistributedOptimizer.load_state_dict = load_state_dict

    # The legacy distrib_optim.pt holds no `step` (it lives in the param groups), but
    # _set_main_param_and_optimizer_states copies every key of the torch-Adam state from it.
    original_set = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original_set)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = dict(tensors, step=step)
        return original_set(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states

    # Before torch Adam's first successful step its state is empty and state_dict() asserts on the
    # missing `step` (fp16: every step so far skipped by the loss scaler, then a checkpoint save).
    # Allocate what that first step would create (zeros, step 0); the step then proceeds unchanged.
    original_state_dict = DistributedOptimizer.state_dict

    @functools.wraps(original_state_dict)
    def state_dict(self):
        inner = self.optimizer
        if (not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, torch.optim.Optimizer) and not inner.state
                and any(g["params"] for g in inner.param_groups)):
            init_adam_state_for_loading(self)
        return original_state_dict(self)

    DistributedOptimizer.state_dict = state_dict
    _adam_fix_applied = True


def restore_adam_steps_from_param_groups(torch_optimizer) -> None:
    if not isinstance(torch_optimizer, torch.optim.Optimizer):
        return
    for group in torch_optimizer.param_groups:
        if "step" not in group:
            continue
        for param in group["params"]:
            state = torch_optimizer.state.get(param)
            if state is not None and "step" in state:
                state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def init_adam_state_for_loading(optimizer) -> None:
    """Create empty torch-Adam state (own `step` per parameter) before a distributed-optimizer load.

    megatron-core 0.16.1's DistributedOptimizer.sharded_state_dict(is_loading=True) reads `step`
    from the inner optimizer's state, which a fresh torch Adam does not have yet (it asserts).
    Megatron's own dummy-step initialisation would run an AdamW step (weight decay moves the
    parameters); here the state is only allocated: zeros, step 0, to be overwritten by the load.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
