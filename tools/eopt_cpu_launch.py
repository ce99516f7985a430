"""Runs a script (this project's pretrain_scripts/pretrain_gpt.py) after standing in for
emerging_optimizers.triton_kernels when triton is not installed (CPU machines).

emerging-optimizers 0.3.0 imports its triton kernels at module level (orthogonalized_optimizers/muon_utils.py
-> triton_kernels/syrk.py -> `import triton`); megatron-core 0.19 catches the ImportError and then refuses
`--optimizer lion/muon` ("emerging-optimizers package is required"). The kernels are used only with
use_syrk (bf16 on SM 8.0-10.3 GPUs); the stand-in says HAS_TRITON_340 = False, which emerging-optimizers
itself answers with use_syrk = False, and its kernels refuse to launch. Numerics are untouched.
Until megatron_ucp's cpu_shims carries this stand-in, tools/make_optim_fixtures.sh launches through here.
  python tools/eopt_cpu_launch.py SCRIPT [ARGS...]
"""

import importlib.util
import runpy
import sys
import types

if importlib.util.find_spec("triton") is None:
    def _refuse(*args, **kwargs):
        raise RuntimeError("emerging-optimizers' triton kernels (use_syrk) need triton, a GPU package")

    stub = types.ModuleType("emerging_optimizers.triton_kernels")
    stub.HAS_TRITON_340 = False
    stub.tsyrk_ex = stub.tsyrk_ex_small_matrix = _refuse
    stub.__all__ = ["tsyrk_ex", "tsyrk_ex_small_matrix", "HAS_TRITON_340"]
    sys.modules[stub.__name__] = stub

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
