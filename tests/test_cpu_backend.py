"""The CPU backend's patches and the torch-Adam fixes, each checked against the megatron-core it patches.

If megatron-core changes under a patch, the matching test here fails and names what to re-check.
"""

import inspect

import pytest
import torch

from megatron_ucp.training import cpu_backend


def test_megatron_core_version_is_the_tested_one():
    assert cpu_backend.mcore_version() in cpu_backend.TESTED_MCORE_VERSIONS, (
        "megatron-core changed: re-check every patch in megatron_ucp/training/cpu_backend.py, then add the version "
        "to TESTED_MCORE_VERSIONS")


def test_untested_version_is_refused(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "99.0.0")
    monkeypatch.delenv("MEGATRON_UCP_ALLOW_UNTESTED_MCORE", raising=False)
    with pytest.raises(cpu_backend.UntestedMegatronCoreError, match="99.0.0"):
        cpu_backend.check_mcore_version()
    monkeypatch.setenv("MEGATRON_UCP_ALLOW_UNTESTED_MCORE", "1")
    cpu_backend.check_mcore_version()


def test_patched_targets_still_need_patching():
    """Each patch exists because megatron-core 0.16.1 does this; if it stops, drop the patch."""
    from megatron.core.optimizer import distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import torch_norm

    # Tensor.type() names decide the optimizer's param path.
    assert "'torch.cuda.FloatTensor'" in inspect.getsource(distrib_optimizer.DistributedOptimizer)
    # Hard-coded CUDA allocations.
    assert "device='cuda'" in inspect.getsource(optimizer.FP32Optimizer.__init__)
    # The RNG tracker reads CUDA generator state.
    assert "torch.cuda" in inspect.getsource(mcore_random._get_cuda_rng_state)
    # Torch norms refuse sequence parallelism.
    assert "sequence parallel not supported" in inspect.getsource(torch_norm.WrappedTorchNorm)
    # The torch-Adam path shares one `step` tensor after a load (the bug fix_shared_adam_step corrects).
    source = inspect.getsource(distrib_optimizer.DistributedOptimizer)
    assert 's["step"] = step' in source
    # ...and sharded_state_dict(is_loading=True) needs an existing Adam state (init_adam_state_for_loading).
    assert "assert len(steps) == 1" in source


def test_cpu_rng_tracker_forks_and_restores():
    tracker = cpu_backend.CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b), "the tracked stream must advance across forks"
    expected = torch.Generator().manual_seed(123)
    assert torch.equal(a, torch.rand(4, generator=expected))
    with pytest.raises(Exception, match="already exists"):
        tracker.add("other", 123)


def test_restore_adam_steps_gives_each_parameter_its_own_step():
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    shared = torch.tensor(0.0)
    for p in params:
        opt.state[p] = {"step": shared, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    opt.param_groups[0]["step"] = 4
    cpu_backend.restore_adam_steps_from_param_groups(opt)
    steps = [opt.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == 3
    assert all(float(s) == 4.0 for s in steps)
    for p in params:
        p.grad = torch.ones(3)
    opt.step()
    assert all(float(opt.state[p]["step"]) == 5.0 for p in params), "each step advances once per iteration"


def test_moe_patch_targets_still_need_patching():
    """The MoE patches and fixes exist because megatron-core 0.16.1 does this; if it stops, drop them."""
    import re

    import importlib
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # (the package re-exports a function of the same name as the module)
    finalize_module = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    # The a2a dispatcher makes a CUDA stream and moves token counts to the host on it.
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    assert "torch.cuda.Stream()" in inspect.getsource(dispatcher.__init__)
    # (read from the file: the CPU backend replaces the method on the class once applied)
    source = open(inspect.getsourcefile(token_dispatcher)).read()
    dtoh = source[source.index("    def _maybe_dtoh_and_synchronize("):]
    assert "with torch.cuda.stream(self.cuda_dtoh_stream):" in dtoh.split("\n\n\n")[0]
    # The router GEMM tests a name that only TransformerEngine's import block binds.
    assert "te_general_gemm is not None" in inspect.getsource(moe_utils.RouterGatingLinearFunction.forward)
    assert not re.search(r"^te_general_gemm\s*=", inspect.getsource(moe_utils), re.M)
    # Expert linears use the expert groups only at EP > 1 (not when ETP != TP), ...
    column = inspect.getsource(layers.ColumnParallelLinear.__init__)
    assert 'setattr(self.weight, "allreduce", not (self.is_expert and self.expert_parallel))' in column
    row = inspect.getsource(layers.RowParallelLinear.__init__)
    assert "self.explicit_expert_comm = self.is_expert and (world_size > 1 or self.expert_parallel)" in row
    # ... an expert fc2 bias is marked for the TP all-reduce under SP, which does not skip experts, ...
    assert 'setattr(self.bias, "sequence_parallel", self.sequence_parallel)' in row
    assert not re.search(r"""["']allreduce["']""",
                         inspect.getsource(finalize_module._allreduce_non_tensor_model_parallel_grads))
    # ... and grad-norm duplicates are filtered over the dense TP group only.
    assert "expert_tp_group" not in inspect.signature(layers.param_is_not_tensor_parallel_duplicate).parameters


def test_uses_expert_process_groups_is_upstreams_fixed_rule():
    from types import SimpleNamespace as C

    rule = cpu_backend.uses_expert_process_groups
    base = dict(num_moe_experts=4, tensor_model_parallel_size=2, expert_model_parallel_size=1,
                expert_tensor_parallel_size=2)
    assert not rule(C(**base))                                    # EP1, ETP == TP: dense buffers
    assert rule(C(**dict(base, expert_model_parallel_size=2)))    # EP > 1
    assert rule(C(**dict(base, expert_tensor_parallel_size=1)))   # ETP != TP at EP1 (the fix)
    assert not rule(C(**dict(base, num_moe_experts=None, expert_model_parallel_size=2)))
