"""CPU support for Megatron-LM 0.19's training loop (megatron-core 0.19.2): every patch, in one place.

megatron-core 0.19 and megatron.training assume CUDA, TransformerEngine/Apex and Python 3.12 in a few
places. `install()` applies the patches below, each written against megatron-core 0.19.2 and saying why.
The list is the one the fixtures' own Megatron-LM core_v0.19.0 runs on CPU needed (each checked there by
turning it off; tests/fixtures/megatron-core-0.19/*/train.log), less the MoE router's TransformerEngine GEMM
patch of 0.16.1, which 0.19 no longer needs. None changes a number: with them, Megatron-LM 0.19 on CPU
reproduces the fixtures' losses to every printed digit (tests/test_megatron_lm_019.py). Added since, for what the
local spec lacks on CPU: multi-latent attention's head sizes and context parallelism in the local core attention,
the rotary embedding's CP slice without CUDA, and a fused-kernel warm-up whose CPU-generator draws do not depend on
CP (tests/test_mla_mtp.py, tests/test_context_parallel.py: a CP2 run trains as the CP1 run).

Two kinds:
- before `import megatron` (`install_import_patches`): Python 3.11, triton absent (megatron-core's paged stash,
  emerging-optimizers' kernels);
- after (`install`): CUDA absent, and megatron-core's torch-Adam distributed-optimizer resume bugs.
The CUDA patches are installed only when CUDA is absent; the torch-Adam ones act only on torch Adam's
per-parameter `step` (no TransformerEngine/Apex), and are inert otherwise. Other megatron-core versions are refused
unless MEGATRON_UCP_ALLOW_UNTESTED_MCORE=1.

`device()` and `init_adam_state_for_loading()` are for megatron_ucp.megatron_lm.loader and in-process tests.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import types
import typing

import torch

TESTED_MCORE_VERSIONS = ("0.19.2",)

_installed = False


class UntestedMegatronCoreError(RuntimeError):
    pass


class CheckpointRNGStateError(RuntimeError):
    """A checkpoint's RNG state this CPU run cannot restore: a CUDA generator's (the user's error: see its text)."""


# --- before `import megatron` -------------------------------------------------------------------

def install_import_patches() -> None:
    """Patches megatron must see at import time; call before any megatron import."""
    _typing_override_on_py311()
    _stub_triton_only_modules()
    # Deliberately not skipped, though slow on CPU: Megatron-LM's warm-up of its torch.compile'd fused
    # kernels (set_jit_fusion_options, even with --disable-jit-fuser). Inductor's compiled dropout draws its
    # seeds from the CPU generator unlike eager dropout, and the MoE router's weight is initialized from
    # that generator next: without the compile, GPT-MoE runs start from other weights than Megatron-LM's.


def _typing_override_on_py311() -> None:
    # megatron/training/models/gpt.py and hybrid.py import typing.override (new in Python 3.12, PEP 698),
    # reached from `import megatron.training`. The decorator only sets __override__ = True.
    if not hasattr(typing, "override"):
        def override(method):
            method.__override__ = True
            return method

        typing.override = override


def _stub_triton_only_modules() -> None:
    # `import megatron.core` reaches moe/ops/paged_stash.py (core -> finalize_model_grads -> schedules ->
    # moe.paged_stash), which imports triton at module level for kernels used only by --moe-paged-stash.
    # triton is a GPU package; without it, stand-in kernels that refuse to launch.
    if importlib.util.find_spec("triton") is not None:
        return
    name = "megatron.core.transformer.moe.ops.paged_stash"

    def refuse(*args, **kwargs):
        raise RuntimeError("--moe-paged-stash needs triton (a GPU package); not available on CPU")

    class Kernel:
        def __getitem__(self, grid):
            return refuse

    stub = types.ModuleType(name)
    stub.GLOBAL_BLOCK_SIZE = 1024  # megatron-core 0.19.2's value, kept for its importers
    stub.paged_stash_copy_kernel = Kernel()
    stub.paged_stash_pop_kernel = Kernel()
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[name] = stub
    _stub_emerging_optimizers_triton_kernels()


def _stub_emerging_optimizers_triton_kernels() -> None:
    # emerging-optimizers 0.3.0 (megatron-core 0.19's Lion, Muon, SOAP) imports its triton kernels at module
    # level (orthogonalized_optimizers/muon_utils.py -> triton_kernels/syrk.py -> `import triton`); megatron-core
    # catches the ImportError and refuses `--optimizer lion/muon` ("emerging-optimizers package is required").
    # The kernels serve only use_syrk (bf16 Newton-Schulz on SM 8.0-10.3 GPUs). The stand-in answers
    # HAS_TRITON_340 = False, which emerging-optimizers itself answers with use_syrk = False; its kernels refuse
    # to launch. Installed only when triton is absent and emerging-optimizers is present; numerics untouched.
    name = "emerging_optimizers.triton_kernels"
    if importlib.util.find_spec("triton") is not None or importlib.util.find_spec("emerging_optimizers") is None:
        return

    def refuse(*args, **kwargs):
        raise RuntimeError("emerging-optimizers' triton kernels (use_syrk) need triton, a GPU package")

    stub = types.ModuleType(name)
    stub.HAS_TRITON_340 = False
    stub.tsyrk_ex = stub.tsyrk_ex_small_matrix = refuse
    stub.__all__ = ["tsyrk_ex", "tsyrk_ex_small_matrix", "HAS_TRITON_340"]
    sys.modules[name] = stub


# --- after `import megatron` ---------------------------------------------------------------------

def mcore_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_mcore_version() -> None:
    version = mcore_version().split("+")[0]  # 0.19's package_info appends the cwd's git hash ("0.19.2+abc1234")
    if version not in TESTED_MCORE_VERSIONS and not os.environ.get("MEGATRON_UCP_ALLOW_UNTESTED_MCORE"):
        raise UntestedMegatronCoreError(
            f"megatron-core {version} is first on the path, but megatron_ucp.megatron_lm.cpu_shims was written "
            f"for {', '.join(TESTED_MCORE_VERSIONS)}; put .venv/megatron-core-0.19 first on PYTHONPATH "
            "(make install puts megatron-core 0.19.2 there) or set MEGATRON_UCP_ALLOW_UNTESTED_MCORE=1")


def install() -> bool:
    """Install every patch (CUDA ones only without CUDA). Returns True when running on CPU."""
    global _installed
    install_import_patches()
    check_mcore_version()
    on_cpu = not torch.cuda.is_available()
    if _installed:
        return on_cpu
    _torch_adam_state_before_load()
    _distopt_set_states_under_no_grad_keeping_step()
    _distopt_unshare_step_after_load()
    if on_cpu:
        _cuda_device_to_cpu()
        _cuda_calls_on_cpu()
        _cuda_streams_and_events()
        _cuda_available_for_initialize()
        _cuda_device_properties()
        _cuda_rng_on_cpu_generator()
        _data_loader_seed_off_the_default_generator()
        _tensor_type_cuda_names()
        _moe_alltoall_splits_as_numpy()
        _dataset_helpers_prebuilt()
        _torch_norm_under_sequence_parallel()
        _local_core_attention_with_mla_head_dims_and_cp()
        _rotary_embedding_cp_slice_on_cpu()
        _jit_warmup_draws_independent_of_cp()
    _installed = True
    return on_cpu


# --- CUDA absent ---------------------------------------------------------------------------------

def device() -> torch.device:
    """The device megatron-core's tensors live on in this process: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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


def _cuda_device_to_cpu() -> None:
    # megatron allocates with device='cuda' / torch.cuda.current_device() and calls .cuda() / .to('cuda')
    # (DDP buffers, p2p buffers, loss dicts, iteration tensors, batch broadcast): all mean the CPU here.
    global _cuda_to_cpu_mode
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    _cuda_to_cpu_mode = _CUDAToCPUMode()
    _cuda_to_cpu_mode.__enter__()  # for the life of the process


def _cuda_calls_on_cpu() -> None:
    # initialize.py calls torch.cuda.set_device(local_rank); timers, p2p and DDP call synchronize();
    # training calls empty_cache(). CPU ops are synchronous and there is one device.
    # one function object per name: TorchDynamo refuses one object registered under two torch names
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None


class _Event:
    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        # 0.19's alltoall dispatcher records an event on its DtoH stream, then calls event.synchronize()
        return event or _Event()

    def synchronize(self):
        pass


def _cuda_streams_and_events() -> None:
    # training.get_model builds DDP inside torch.cuda.stream(torch.cuda.Stream()); DDP and the MoE
    # alltoall dispatcher use current_stream()/Event. On CPU: placeholders and a null context.
    torch.cuda.Stream = _Stream
    torch.cuda.Event = lambda *args, **kwargs: _Event()
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()


class _CudaAsSeenByInitialize:
    """torch.cuda for megatron.training.initialize only: one device, available."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1


class _TorchAsSeenByInitialize:
    def __getattr__(self, name):
        return _CudaAsSeenByInitialize() if name == "cuda" else getattr(torch, name)


def _cuda_available_for_initialize() -> None:
    # initialize.py asserts torch.cuda.is_available() and sets up the model-parallel groups and the RNG
    # tracker only when torch.cuda.device_count() > 0. Answer "one device" to that module alone, so the
    # rest of megatron-core keeps its CPU paths.
    from megatron.training import initialize

    initialize.torch = _TorchAsSeenByInitialize()


def _cuda_device_properties() -> None:
    # arguments.validate_args asks get_device_arch_version() (torch.cuda.get_device_properties) with TP > 1;
    # report a Hopper (sm_90) so the usual CUDA_DEVICE_MAX_CONNECTIONS=1 path is taken.
    from megatron.training import arguments
    from megatron.training.utils import common_utils

    hopper = lambda: 9  # noqa: E731
    common_utils.get_device_arch_version = hopper
    arguments.get_device_arch_version = hopper


def _cuda_rng_on_cpu_generator() -> None:
    # checkpointing.py saves/restores 'cuda_rng_state' with torch.cuda.get/set_rng_state, and
    # tensor_parallel.random's tracker seeds and forks CUDA generators. On CPU the only generator is the
    # CPU one: the tracker keeps CPU generator states (seeded as Megatron seeds CUDA's), and the
    # checkpoint's "cuda" RNG state is the CPU generator's.
    from megatron.core.tensor_parallel import random as mcore_random

    class CPURNGStatesTracker(mcore_random.CudaRNGStatesTracker):
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

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    original_initialize = mcore_random.initialize_rng_tracker

    @functools.wraps(original_initialize)
    def initialize_rng_tracker(*args, force_reset=False, **kwargs):
        if mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED and not force_reset:
            return
        mcore_random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mcore_random.initialize_rng_tracker = initialize_rng_tracker
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = _restore_checkpoint_cuda_rng_state
    torch.cuda.manual_seed = lambda seed: None  # the tracker seeds its own CPU generators


def _restore_checkpoint_cuda_rng_state(state, *args, **kwargs) -> None:
    # torch.cuda.set_rng_state on CPU, which Megatron-LM's load calls with the checkpoint's "cuda_rng_state": a CPU
    # run saved the CPU generator's state there (above), but a GPU run's checkpoint, or one from-universal wrote
    # with its default --rng-state cuda, holds a CUDA generator's, of another size, which the CPU generator
    # refuses with a bare size error deep in the load.
    expected = torch.get_rng_state().numel()
    if state.numel() != expected:
        from megatron.training import get_args

        raise CheckpointRNGStateError(
            f"--load {get_args().load}: its RNG state is a CUDA generator's ({state.numel()} bytes; this CPU run's "
            f"generator takes {expected}): write the checkpoint for CPU with `megatron-ucp from-universal "
            "--rng-state cpu`, or resume with --no-load-rng")
    torch.set_rng_state(state)


def _data_loader_seed_off_the_default_generator() -> None:
    # Every DataLoader iterator draws its base seed from torch's default generator, on the ranks that
    # build data (TP rank 0 of the first and last stage). On a GPU that is the CPU generator, which dropout
    # never uses; here it is also the one dropout draws from (the "CUDA" default generator), so TP rank 0
    # would run one draw ahead of the others and drop other elements of activations that must stay equal
    # on every TP rank (embedding and hidden dropout outside the tracker's fork): replicated parameters
    # then drift apart. A loader generator of its own (its base seed seeds workers only) keeps them equal.
    from megatron.training import training
    from megatron.training.datasets import data_samplers

    original = data_samplers.build_pretraining_data_loader

    @functools.wraps(original)
    def build_pretraining_data_loader(*args, **kwargs):
        loader = original(*args, **kwargs)
        if loader is not None and getattr(loader, "generator", None) is None:
            loader.generator = torch.Generator()
        return loader

    data_samplers.build_pretraining_data_loader = build_pretraining_data_loader
    training.build_pretraining_data_loader = build_pretraining_data_loader  # imported there by name


def _tensor_type_cuda_names() -> None:
    # optimizer / distrib_optimizer / clip_grads require param.type() == 'torch.cuda.FloatTensor' (and pick
    # their fp16/bf16 path by the CUDA type name); report CPU tensors under the CUDA type names.
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


def _moe_alltoall_splits_as_numpy() -> None:
    # MoEAlltoAllTokenDispatcher turns its all-to-all split sizes into numpy with
    # moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True), which converts CUDA tensors only; on CPU the
    # splits stay tensors and gloo's all_to_all_single rejects them. Convert CPU tensors too (same values).
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu  # imported by name there


def _dataset_helpers_prebuilt() -> None:
    # initialize._compile_dependencies runs compile_helpers() = `make -C megatron/core/datasets`; the
    # 0.19.2 wheel ships the prebuilt helpers_cpp extension but not the Makefile, so make fails and
    # compile_helpers exits. Skip the build when the extension imports.
    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers

    @functools.wraps(original)
    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()

    dataset_utils.compile_helpers = compile_helpers


def _torch_norm_under_sequence_parallel() -> None:
    # The local spec's WrappedTorchNorm (torch LayerNorm/RMSNorm) refuses sequence parallelism (Apex's
    # fused norm is the intended SP norm). Torch norms are per token, so they are right on sequence
    # shards; mark their parameters `sequence_parallel` so finalize_model_grads all-reduces their grads.
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


def cp_chunk_order(cp: int) -> list[tuple[int, int]]:
    """Where each of a sequence's 2*CP chunks lives under context parallelism: chunk c (in sequence order) is
    (CP rank, half) -- rank r holds chunks r and 2*CP-1-r, in that order (megatron-core's zig-zag split,
    `get_batch_on_this_cp_rank`; the rotary embedding is sliced alike)."""
    return [(c, 0) if c < cp else (2 * cp - 1 - c, 1) for c in range(2 * cp)]


def cp_positions(cp: int, cp_rank: int, seq_length: int) -> torch.Tensor:
    """The global sequence positions of a CP rank's tokens, in the order it holds them."""
    chunk = seq_length // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk)
                      for c, (rank, _) in enumerate(cp_chunk_order(cp)) if rank == cp_rank])


class _GatherSequenceChunks(torch.autograd.Function):
    """[s/CP, ...] on each CP rank -> [s, ...] in sequence order on every rank (all-gather, then the chunks put
    where cp_chunk_order says). Backward: the gradient of the whole sequence summed over the CP ranks (every
    rank's queries read every key), and each rank keeps its own two chunks' rows."""

    @staticmethod
    def forward(ctx, x, group):
        cp = torch.distributed.get_world_size(group)
        ctx.group, ctx.cp, ctx.rank = group, cp, torch.distributed.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(cp)]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([halves[rank][half] for rank, half in cp_chunk_order(cp)], dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        chunks = grad.chunk(2 * ctx.cp, dim=0)
        mine = [chunks[c] for c, (rank, _) in enumerate(cp_chunk_order(ctx.cp)) if rank == ctx.rank]
        return torch.cat(mine, dim=0), None


def _local_core_attention_with_mla_head_dims_and_cp() -> None:
    # The local spec's core attention (megatron-core's DotProductAttention), widened in two ways that only
    # TransformerEngine's DotProductAttention offers, for CPU runs (GPU runs use TE and are untouched: this
    # class replaces the local spec's core attention only when cpu_shims.install() finds no CUDA).
    # 1. Multi-latent attention (MLASelfAttention) builds its core attention with separate query/key and value
    #    head sizes (k_channels = qk_head_dim + qk_pos_emb_head_dim, v_channels = v_head_dim) and its own softmax
    #    scale; megatron-core's local one raises TypeError. The local class's math (baddbmm with the scale,
    #    FusedScaleMaskSoftmax, dropout in the tracker's fork, bmm with the values) never assumes equal head
    #    sizes except in the output's width; this subclass takes both sizes and sets that width to heads x
    #    v_channels.
    # 2. Context parallelism: the local class asserts CP = 1 ("only supported by TEDotProductAttention"). Each CP
    #    rank holds chunks r and 2*CP-1-r of the sequence (queries, keys, values, the rotary embedding, the
    #    dataloader's mask rows). Here the keys and values are all-gathered over the CP group and put in sequence
    #    order (_GatherSequenceChunks, whose backward sums the keys' and values' gradients over the CP ranks and
    #    returns each rank its own chunks), and the local class's unchanged math runs on this rank's queries
    #    against the whole sequence, with the causal mask by global positions: the dataloader's mask rows (already
    #    this rank's, in global key order), else one made from cp_positions. The same attention as TE's ring
    #    (p2p), all_gather or a2a exchanges compute, whatever --cp-comm-type says (they differ in communication
    #    only); packed sequences (THD) are refused, as by the local class.
    # Without k/v channels and at CP = 1 it is the local class unchanged.
    import copy

    from megatron.core import parallel_state
    from megatron.core.models import backends
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class LocalCoreAttention(DotProductAttention):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
            cp_size = config.context_parallel_size
            if cp_size > 1:  # the parent refuses CP > 1 by config: show it CP = 1, keep the real config
                seen = copy.copy(config)
                seen.context_parallel_size = 1
            super().__init__(seen if cp_size > 1 else config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            self.config = config
            self.cp_group = None
            if cp_size > 1:
                self.cp_group = getattr(self.pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
            if k_channels is not None:
                self.hidden_size_per_attention_head = k_channels
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * divide(config.num_attention_heads,
                                                                     self.pg_collection.tp.size())

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if self.cp_group is None or self.cp_group.size() == 1:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            if packed_seq_params is not None:
                raise NotImplementedError("packed sequences (THD) with context parallelism need TransformerEngine")
            cp, rank = self.cp_group.size(), self.cp_group.rank()
            key = _GatherSequenceChunks.apply(key, self.cp_group)
            value = _GatherSequenceChunks.apply(value, self.cp_group)
            seq = key.size(0)
            if attention_mask is None or attention_mask.size(-1) != seq:  # no dataloader mask: causal by position
                rows = cp_positions(cp, rank, seq).to(query.device)
                attention_mask = (torch.arange(seq, device=query.device)[None, :] > rows[:, None])[None, None]
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=None)

    backends.LocalSpecProvider.core_attention = lambda self: LocalCoreAttention


def _jit_warmup_draws_independent_of_cp() -> None:
    # Megatron-LM's warm-up of its fused kernels (initialize._warmup_jit_function, before the model is built)
    # draws its dummy inputs with torch.rand(..., device="cuda"), sized seq_length / CP. On GPUs those draws come
    # from the CUDA generator; on CPU from the CPU generator, which then initializes the parameters megatron-core
    # initializes from it (learned position embeddings, the MoE router): a CPU run at CP2 would start from other
    # weights than the same run at CP1, which no GPU run does. The warm-up runs here with the CP = 1 sizes (its
    # inputs are dummies; only the kernels' compilation matters), so the CPU generator is drawn alike at every CP
    # and every CP starts from the CP1 weights. At CP = 1 nothing changes (the fixtures' runs).
    from megatron.training import get_args, initialize

    original = initialize._warmup_jit_function

    @functools.wraps(original)
    def _warmup_jit_function(*args, **kwargs):
        run_args = get_args()
        cp = run_args.context_parallel_size
        run_args.context_parallel_size = 1
        try:
            return original(*args, **kwargs)
        finally:
            run_args.context_parallel_size = cp

    initialize._warmup_jit_function = _warmup_jit_function


def _rotary_embedding_cp_slice_on_cpu() -> None:
    # rope_utils.get_pos_emb_on_this_cp_rank builds its chunk index as a pinned CPU tensor moved to CUDA
    # (.cuda()); on CPU it selects the same two chunks (r and 2*CP-1-r, as cp_chunk_order) on the embedding's own
    # device. Patched where the rotary embeddings imported it by name.
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp, rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[(seq_dim + 1):])
        pos_emb = pos_emb.index_select(seq_dim, index)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2):])

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


# --- torch Adam without TE/Apex (any device) -------------------------------------------------------

def _torch_adam_state_before_load() -> None:
    # Without TE/Apex megatron-core uses torch Adam, whose per-parameter state (with `step`) appears at
    # the first step; DistributedOptimizer.state_dict() asserts one `step`, so building the load
    # template (sharded_state_dict(is_loading=True)) before any step fails. Allocate that state first:
    # zeros, step 0, all overwritten by the load.
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls.state_dict

    @functools.wraps(original)
    def state_dict(self):
        inner = self.optimizer
        if (not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, torch.optim.Optimizer)
                and not inner.state and any(g["params"] for g in inner.param_groups)):
            init_adam_state_for_loading(self)
        return original(self)

    cls.state_dict = state_dict


def _distopt_set_states_under_no_grad_keeping_step() -> None:
    # DistributedOptimizer._set_main_param_and_optimizer_states (loading distrib_optim.pt and the
    # torch_dist dp_reshardable state):
    # (a) is reached without torch.no_grad() from load_parameter_state_from_dp_zero; with fp32 params the
    #     main param is a view of the model param and the in-place copy is refused by autograd;
    # (b) copies every torch-Adam state key, `step` included: distrib_optim.pt has none (KeyError) and the
    #     dp_reshardable template's is stale (Adam's step would restart at 0). Keep the step that
    #     load_state_dict restored from the param groups.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = dict(tensors, step=step)  # copying a tensor onto itself: unchanged
        with torch.no_grad():
            return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _distopt_unshare_step_after_load() -> None:
    # DistributedOptimizer.load_state_dict() (no TE/Apex) puts ONE `step` tensor into every parameter's
    # torch-Adam state; torch Adam increments it in place per parameter, so after a resume it advances
    # by #params per iteration and the bias correction is wrong (the loss diverges from the 2nd step
    # after the resume). Give each parameter its own copy.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        if isinstance(self.optimizer, torch.optim.Optimizer):
            for state in self.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].detach().clone()
        return result

    DistributedOptimizer.load_state_dict = load_state_dict


def leaf_optimizers(optimizer) -> list:
    """The megatron optimizers that each wrap one torch optimizer, in chain order: a ChainedOptimizer's, recursively
    (megatron-core 0.19's layer-wise distributed optimizer chains [LayerWiseDistributedOptimizer([its emerging
    optimizer]), the scalar parameters' DistributedOptimizer], and LayerWiseDistributedOptimizer is itself a
    ChainedOptimizer)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    return [leaf for opt in chained for leaf in leaf_optimizers(opt)]


def init_adam_state_for_loading(optimizer, run: str = "adam") -> None:
    """Allocate each torch optimizer's per-parameter state (zeros, Adam's own `step` 0) where it is still empty:
    the states of its param group's row in core/optimizers.py (`run`: the run's --optimizer; an emerging
    optimizer's scalar groups name theirs: Lion's exp_avg, Muon's momentum_buffer, SGD's, Adam's).

    For a load into a fresh optimizer: DistributedOptimizer's state_dict() / sharded_state_dict(is_loading=True)
    read `step` from that state, which torch Adam creates only at its first step. Megatron-LM's own
    dummy-step initialisation would run an AdamW step (weight decay moves the parameters); here the state is
    only allocated, and the load overwrites it. `optimizer`: a megatron optimizer or a ChainedOptimizer.
    """
    from megatron_ucp.core import optimizers

    for opt in leaf_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for group in inner.param_groups:
            row = optimizers.OPTIMIZERS[optimizers.group_optimizer(group, run)]
            for param in group["params"]:
                state = inner.state[param]
                if len(state) == 0:
                    if row.step:
                        state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for key in row.states:
                        state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)


# --- the command line on CPU -------------------------------------------------------------------------

# What Megatron-LM 0.19 needs told on CPU (the flags of tests/fixtures/megatron-core-0.19/*/cmd.txt): the
# local (non-TransformerEngine) layers, gloo, and none of the CUDA-only fused kernels. Each is added only
# when the command line does not already name it (or its opposite).
CPU_FLAGS = (
    ("--transformer-impl", "local"),
    ("--distributed-backend", "gloo"),
    ("--no-gradient-accumulation-fusion", None),
    ("--no-masked-softmax-fusion", None),
    ("--no-bias-gelu-fusion", None),
    ("--no-bias-dropout-fusion", None),
    ("--no-bias-swiglu-fusion", None),
    ("--disable-jit-fuser", None),
    ("--no-rope-fusion", None),
    ("--no-persist-layer-norm", None),
)


def with_cpu_flags(argv):
    """`argv` plus each CPU flag it does not already give. Also sets CUDA_DEVICE_MAX_CONNECTIONS=1, which
    validate_args demands with tensor parallelism (a CUDA stream setting; on CPU it means nothing)."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    argv = list(argv)
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    for flag, value in CPU_FLAGS:
        if flag not in given:
            argv += [flag] if value is None else [flag, value]
    return argv
