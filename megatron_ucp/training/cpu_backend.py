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
    _moe_router_gemm_without_te()
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
    _alltoall_dispatcher_without_cuda_streams()
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


def _alltoall_dispatcher_without_cuda_streams() -> None:
    # MoEAlltoAllTokenDispatcher creates a CUDA stream in __init__ and, at its "DtoH point", copies
    # the token counts to the host on that stream (the a2a split sizes become numpy arrays), then
    # waits on a CUDA event at its "sync point". On CPU the counts are already on the host: the
    # stream is a placeholder, the copy is the same numpy conversion without a stream, and the sync
    # is a no-op. Everything else in the dispatcher (permutation, all_to_all_single with split sizes,
    # the ETP all-gather / reduce-scatter) runs unchanged on gloo.
    import numpy as np

    from megatron.core.transformer.moe import token_dispatcher

    cls = token_dispatcher.MoEAlltoAllTokenDispatcher
    cls.cuda_dtoh_stream = object()  # __init__ only creates a stream while this is None

    def as_host_array(value):
        return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if value is not None:
                    setattr(self, name, as_host_array(value))
        return tokens_per_expert

    cls._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize


# --- TransformerEngine absent (any device) ------------------------------------------------------

def _moe_router_gemm_without_te() -> None:
    # megatron-core 0.16.1's moe_utils imports te_general_gemm only inside its TransformerEngine
    # try-block, but the router's gating GEMM (RouterGatingLinearFunction) tests
    # `te_general_gemm is not None`: without TE that is a NameError on the first MoE forward.
    # Defining it as None selects the GEMM's own torch.mm path (what the code intends).
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# --- MoE fixes (any device) ----------------------------------------------------------------------
# megatron-core 0.16.1 decides "this expert parameter uses the expert process groups" (attribute
# `allreduce=False`: own DDP buffer over the expert-data-parallel group, own optimizer, duplicates
# filtered over ETP) from EP > 1 alone. Megatron-LM fixed both places later (commit cd4afffa64,
# "Fix gradient-norm undercounting when using EP and TP"); these apply the same rule to 0.16.1.

def uses_expert_process_groups(config) -> bool:
    """Whether expert parameters must be reduced over the expert-DP group (the fixed rule)."""
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    return bool(config.num_moe_experts) and (
        config.expert_model_parallel_size > 1 or etp != config.tensor_model_parallel_size)


def prepare_expert_linears(model_chunk, config) -> None:
    """Three fixes on the routed experts' linears of a freshly built GPTModel; call before the DDP wrap.

    1. Mark their parameters `allreduce=False` when ETP != TP at EP=1 too (the fixed rule above).
       Without it, e.g. at TP2 ETP1 EP1, the experts sit in the dense DDP buffer and their gradients
       are reduced over the dense DP group, which does not hold the other replicas of an expert (the
       expert-DP group does): the replicas get different updates and drift apart.
    2. Clear the `sequence_parallel` mark megatron-core puts on an expert fc2's bias under SP, when the
       experts use the expert groups: finalize_model_grads sums such gradients over the dense TP
       group, but an expert's replicas are its expert-DP group (which DDP already reduces over). At
       TP2 SP EP2 ETP1 the two TP ranks hold different experts and their fc2 biases' gradients were
       added together; at TP2 SP ETP1 EP1 they were reduced twice.
    3. Set `explicit_expert_comm` (the dispatcher does the expert-TP communication) also when the
       expert-TP group has one rank at EP=1, where it is False in 0.16.1. Both paths communicate
       nothing over a one-rank group, but the False path returns fc2's output through a one-rank
       all-reduce Function as-is, and the expert MLP then adds its bias in place into that view:
       autograd refuses ("a view ... is being modified inplace") and biased experts cannot train at
       EP=1 ETP=1.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    expert_groups = uses_expert_process_groups(config)
    for module in model_chunk.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.is_expert:
            module.explicit_expert_comm = True
            if expert_groups:
                for param in module.parameters(recurse=False):
                    param.allreduce = False
                    if getattr(param, "sequence_parallel", False):
                        param.sequence_parallel = False


def filter_expert_duplicates_over_etp(optimizer) -> None:
    """Make the expert optimizer count replicated expert tensors once per expert-TP group in the grad norm.

    megatron-core 0.16.1 filters duplicates of non-TP-sharded parameters (an expert's fc2 bias) with
    the dense TP group's rank; when EP spans the TP ranks (TP2 EP2 ETP1) the experts on TP rank 1 are
    different experts, not duplicates, and their biases drop out of the gradient norm (clipping
    differs from the same model at TP1). The expert optimizer holds only expert parameters, so its
    duplicate filter belongs to the expert-TP group."""
    from megatron.core import parallel_state

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        groups = getattr(getattr(opt, "optimizer", None), "param_groups", [])
        if groups and all(g.get("is_expert_parallel", False) for g in groups):
            opt.tp_group = parallel_state.get_expert_tensor_parallel_group()


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
