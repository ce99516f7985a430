"""Run an older Megatron-LM's own pretrain_gpt.py (core_v0.14.0 / core_v0.15.3) on CPU with gloo, to make the
tests/fixtures/megatron-core-0.14 checkpoints. Not part of the package: a fixture-making launcher.

    MLM_ROOT=/tmp/mlm014   # `git archive core_v0.14.0` of NVIDIA/Megatron-LM (megatron/core + megatron/training)
    PYTHONPATH=$MLM_ROOT:. torchrun --nproc-per-node 4 tools/run_pretrain_mcore_old_cpu.py <Megatron-LM flags>

The CPU patches are megatron_ucp/megatron_lm/cpu_shims.py's (written for 0.19.2), each applied here only where
that older release has the patched name; none changes a number. Differences to 0.19 (why a patch is not used):
- no `typing.override`, no triton-only module at import in 0.14 (nothing to stub);
- megatron.training.utils is a module, not a package: the device-arch answer goes to arguments alone;
- `six` (imported by 0.14's BERT tokenizer module, reached from `import megatron.training`) is not in the venv:
  `pip install --target /tmp/py_six six` and put that folder on PYTHONPATH (the torch_dist save spawns a
  process that re-imports megatron.training); an empty stand-in module covers this process only;
- GPT-MoE: two patches of their own (below; 0.19.2 needs neither): the router GEMM (TE name undefined without TE)
  and the alltoall dispatcher's CUDA DtoH stream; use ETP1 (gloo refuses the expert-TP
  all-gather of uneven token counts);
- `megatron.legacy.fused_kernels.load` (0.14's initialize builds Megatron's CUDA softmax kernels with nvcc,
  unused with --no-masked-softmax-fusion; 0.19 dropped the call): skipped on CPU;
- numpy 2 (this venv) removed `np.product`, which 0.14's dist_checkpointing exchange_utils calls (0.14 pins
  numpy<2): `np.product = np.prod`, the same function under its old name;
- the dataset helper: 0.14's source tree has helpers.cpp and a Makefile needing pybind11; the prebuilt
  helpers_cpp of megatron-core 0.19.2 (same build_sample_idx / build_blending_indices) is copied beside it.
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _prebuilt_helpers(mlm_root: Path) -> None:
    target = mlm_root / "megatron" / "core" / "datasets"
    if any(target.glob("helpers_cpp*.so")):
        return
    import sysconfig  # the venv's megatron-core 0.19.2 (make install); MLM_ROOT's megatron shadows it on sys.path

    built = sorted((Path(sysconfig.get_paths()["purelib"]) / "megatron" / "core" / "datasets").glob("helpers_cpp*.so"))
    if not built:
        raise FileNotFoundError("no prebuilt helpers_cpp: run `make install` (megatron-core 0.19.2 ships one)")
    shutil.copy(built[0], target / built[0].name)


def _numpy_product() -> None:
    import numpy as np

    if not hasattr(np, "product"):
        np.product = np.prod


def _stub_six() -> None:
    import importlib.util
    import types

    if importlib.util.find_spec("six") is None:
        sys.modules["six"] = types.ModuleType("six")


def install_shims() -> None:
    os.environ.setdefault("MEGATRON_UCP_ALLOW_UNTESTED_MCORE", "1")
    import torch

    from megatron_ucp.megatron_lm import cpu_shims as s

    s._torch_adam_state_before_load()
    s._distopt_set_states_under_no_grad_keeping_step()
    s._distopt_unshare_step_after_load()
    if torch.cuda.is_available():
        return
    s._cuda_device_to_cpu()
    s._cuda_calls_on_cpu()
    s._cuda_streams_and_events()
    s._cuda_available_for_initialize()
    s._cuda_rng_on_cpu_generator()
    s._tensor_type_cuda_names()
    s._dataset_helpers_prebuilt()
    s._torch_norm_under_sequence_parallel()
    from megatron.training import arguments

    _moe_router_gemm_without_te()
    _alltoall_dispatcher_without_cuda_streams()
    from megatron.legacy import fused_kernels

    fused_kernels.load = lambda args: None
    if hasattr(arguments, "get_device_arch_version"):
        arguments.get_device_arch_version = lambda: 9



# --- GPT-MoE on 0.14 / 0.15 (megatron-core 0.16.1 had the same two; 0.19.2 needs neither) ----------------

def _moe_router_gemm_without_te() -> None:
    # moe_utils imports te_general_gemm only inside its TransformerEngine try-block, but the router's gating
    # GEMM tests `te_general_gemm is not None`: without TE that is a NameError on the first MoE forward.
    # Defining it as None selects the GEMM's own torch.mm path (what the code intends).
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _alltoall_dispatcher_without_cuda_streams() -> None:
    # MoEAlltoAllTokenDispatcher creates a CUDA stream in __init__ and copies the token counts to the host on
    # it at its "DtoH point", then waits on a CUDA event. On CPU the counts are already on the host: the
    # stream is a placeholder, the copy the same numpy conversion without a stream, the sync a no-op.
    import numpy as np
    import torch

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


def main() -> None:
    mlm_root = Path(os.environ["MLM_ROOT"]).resolve()
    _prebuilt_helpers(mlm_root)
    sys.path.insert(0, str(mlm_root))
    _stub_six()
    _numpy_product()
    install_shims()
    sys.argv = [str(mlm_root / "pretrain_gpt.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
