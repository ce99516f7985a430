"""Mixture-of-experts rules that need no training run: expert rank coordinates against megatron-core's own
rank generator, the expert DDP buffers' selection and data-parallel group, the optimizer each parameter
belongs to (against the mark megatron-core's expert linears set), the legacy folder names, and the refusal
of what Megatron-LM 0.16.1's legacy format cannot hold (one line naming the flag). Runtime ~2 s.
"""

import itertools

import pytest

from megatron_ucp.adapters import gpt
from megatron_ucp.formats.bucket_layout import BufferParam, DDPBucketConfig, build_chunk_buffers
from megatron_ucp.formats.legacy.reader import rank_dir_name
from megatron_ucp.core.layout import LayoutError, ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.formats.legacy.writer import LegacyWriteError, check_layout
from megatron_ucp.megatron_lm import cpu_shims

cpu_shims.install_import_patches()  # megatron-core 0.19 without triton: before megatron is imported

MOE = GPTModelConfig(num_layers=4, hidden_size=48, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                     kv_channels=12, vocab_size=1001, padded_vocab_size=1024, swiglu=True, normalization="RMSNorm",
                     position_embedding_type="rope", untie_embeddings_and_output_weights=True, add_bias_linear=False,
                     num_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                     moe_layer_freq=(0, 1, 0, 1))

LAYOUTS = [ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)
           for tp, pp, dp, ep, etp in itertools.product((1, 2), (1, 2), (1, 2, 4), (1, 2, 4), (None, 1, 2))
           if (tp * dp) % ((etp or tp) * ep) == 0]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[l.describe() for l in LAYOUTS])
def test_expert_coordinates_are_megatron_cores(layout):
    """(etp, ep, expert-dp, pp) of every global rank and the expert optimizer's dp_group_idx follow megatron-core's
    expert RankGenerator (order tp-cp-ep-dp-pp), the dense dp_group_idx its dense one."""
    from megatron.core.parallel_state import RankGenerator

    experts = RankGenerator(tp=layout.expert_tp, ep=layout.ep, dp=layout.expert_dp, pp=layout.pp, cp=1,
                            order="tp-cp-ep-dp-pp")
    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp")

    def position(generator, token):
        return {rank: group.index(rank) for group in generator.get_ranks(token) for rank in group}

    etp, ep, edp, pp = (position(experts, t) for t in ("tp", "ep", "dp", "pp"))
    tp, mp = position(dense, "tp"), position(dense, "tp-pp")
    expert_mp = position(experts, "tp-ep-pp")
    for rank in range(layout.world_size):
        assert layout.expert_coordinates(rank) == (etp[rank], ep[rank], edp[rank], pp[rank])
        assert layout.expert_mp_rank(etp[rank], ep[rank], pp[rank]) == expert_mp[rank]
        assert layout.dense_mp_rank(tp[rank], pp[rank]) == mp[rank]


def test_expert_buffers_hold_the_expert_optimizers_parameters_over_the_expert_dp_group():
    """At TP1 DP4 EP2 (expert-DP 2) routed experts leave the dense buffer for their own, padded over the expert-DP
    group (lcm(2, 128)), in reverse registration order; at EP1 with ETP = TP they stay dense (no expert optimizer)."""
    args = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "world_size": 4,
            "data_parallel_size": 4, "expert_model_parallel_size": 2, "use_distributed_optimizer": True}
    layout = ParallelLayout(dp=4, ep=2)
    entries = gpt.parameters_for_rank(MOE, layout, 0, ep_rank=1)
    params = [BufferParam(local, shape, "float32", expert=gpt.in_expert_optimizer(canonical, MOE, layout))
              for local, shape, canonical in entries]
    dense_cfg = DDPBucketConfig.from_megatron_args(args, layout, pp_rank=0, vpp_chunk=0, rank_num_parameters=0)
    expert_cfg = DDPBucketConfig.from_megatron_args(args, layout, pp_rank=0, vpp_chunk=0, rank_num_parameters=0, experts=True)
    assert (dense_cfg.dp_size, expert_cfg.dp_size) == (4, 2)
    (dense,) = build_chunk_buffers(params, dense_cfg)
    (expert,) = build_chunk_buffers(params, expert_cfg, experts=True)
    assert not any("local_experts" in s.name for s in dense.params)
    assert [s.name for s in expert.params] == [p.name for p in reversed(params) if p.expert]
    assert expert.params[0].name == "decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight"
    assert expert.numel_unpadded == 2 * 2 * (64 * 48 + 48 * 32) and expert.numel % 128 == 0
    # negative control: at EP1 (ETP = TP) megatron-core keeps the experts in the dense optimizer
    assert not gpt.in_expert_optimizer("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", MOE,
                                       ParallelLayout(dp=4))
    assert gpt.in_expert_optimizer("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", MOE,
                                   ParallelLayout(tp=2, dp=2, etp=1))
    assert not gpt.in_expert_optimizer("decoder.layers.1.mlp.router.weight", MOE, layout)


def test_legacy_folder_names_follow_get_checkpoint_name():
    """PP1 EP2 spells EP rank 1 like PP rank 1 of a PP2 run; the args tell them apart."""
    assert rank_dir_name(0, 0, 1, 1, 2) == "mp_rank_00_001" == rank_dir_name(0, 1, 2)
    assert rank_dir_name(1, 1, 2, 3, 4) == "mp_rank_01_001_003"
    assert rank_dir_name(1, 0, 1) == "mp_rank_01"


def test_legacy_format_refuses_etp_other_than_tp():
    with pytest.raises(LegacyWriteError, match=r"--expert-tensor-parallel-size 1 != --tensor-model-parallel-size 2"):
        check_layout(MOE, ParallelLayout(tp=2, dp=2, etp=1, ep=2))
    check_layout(MOE, ParallelLayout(tp=2, dp=2, ep=2))  # ETP = TP: what Megatron-LM writes consistently


def test_ep_not_dividing_the_experts_is_refused_with_the_choices():
    with pytest.raises(LayoutError, match=r"num_experts=4 is not divisible by EP=3 .*in \[1, 2, 4\]"):
        gpt.experts_per_ep_rank(MOE, 3)
    assert gpt.experts_per_ep_rank(MOE, 4) == 1


EXPERT_MARK_GRID = [(tp, etp, ep) for tp in (1, 2, 4) for etp in (1, 2, 4) for ep in (1, 2, 4)]


def test_expert_optimizer_rule_is_megatron_cores_expert_mark():
    """gpt.experts_in_own_optimizer is the rule megatron-core's own expert linears apply: a routed expert's
    Column/RowParallelLinear marks its weight `allreduce=False` (expert DDP buffer over the expert-DP group, expert
    optimizer) exactly when the tool says so, for every TP x ETP x EP in the grid; dense linears never. Read from
    the modules megatron-core builds (no process group: the rule reads only the config), on the megatron-core
    first on the path (0.19.2: the fixed rule, ETP != TP at EP1 included)."""
    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    seen = set()
    for tp, etp, ep in EXPERT_MARK_GRID:
        config = TransformerConfig(num_layers=4, hidden_size=48, num_attention_heads=4, num_moe_experts=4,
                                   tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp,
                                   expert_model_parallel_size=ep, perform_initialization=False,
                                   use_cpu_initialization=True, add_bias_linear=False)
        layout = ParallelLayout(tp=tp, dp=4 * etp * ep, etp=etp, ep=ep)
        expected = gpt.experts_in_own_optimizer(MOE, layout)
        seen.add(expected)
        for cls, extra in ((ColumnParallelLinear, dict(gather_output=False)),
                           (RowParallelLinear, dict(input_is_parallel=True, skip_bias_add=True))):
            for is_expert in (True, False):
                linear = cls(48, 32, config=config, init_method=torch.nn.init.zeros_, bias=False,
                             is_expert=is_expert, **extra)
                in_expert_buffers = not getattr(linear.weight, "allreduce", True)
                assert in_expert_buffers == (is_expert and expected), (cls.__name__, is_expert, tp, etp, ep)
    assert seen == {True, False}  # both sides of the rule reached
