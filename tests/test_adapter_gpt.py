"""Spec of the megatron-core GPT adapter: names, layer offsets, shapes and order, checked against
megatron-core 0.16.1 itself and against real Megatron-LM checkpoints' manifests."""

import ast
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_ucp.adapters import gpt
from megatron_ucp.core.layout import LayoutError, ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.core.patterns import FusedSubParams, GroupedQKV, PatternError, Replicated, Sharded, VocabSharded
from megatron_ucp.megatron_lm import cpu_shims

cpu_shims.install_import_patches()  # megatron-core 0.19 without triton: before megatron is imported

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron-lm"

LLAMA = GPTModelConfig(num_layers=8, hidden_size=48, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       kv_channels=12, vocab_size=1001, padded_vocab_size=1024, max_position_embeddings=32,
                       swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                       untie_embeddings_and_output_weights=True, add_bias_linear=False)
GPT2 = GPTModelConfig(num_layers=8, hidden_size=48, ffn_hidden_size=192, num_attention_heads=4, num_query_groups=4,
                      kv_channels=12, vocab_size=1001, padded_vocab_size=1024, max_position_embeddings=32,
                      add_bias_linear=True, add_qkv_bias=True)
# GPT-MoE like the harness's llama_moe family: layers 1 and 3 MoE, shared expert with its gate, expert bias.
MOE = GPTModelConfig(**{**LLAMA.to_dict(), "num_layers": 4, "num_experts": 4, "moe_ffn_hidden_size": 32,
                        "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True,
                        "moe_layer_freq": [0, 1, 0, 1], "moe_router_enable_expert_bias": True})
LAYOUTS = [ParallelLayout(tp=tp, pp=pp, vpp=vpp) for tp in (1, 2) for pp in (1, 2, 4) for vpp in (None, 2)
           if not (pp == 1 and vpp)]  # VPP needs PP > 1
# Uneven pipelines (8 layers): first stage 3 of 8; embedding and loss each counted as a layer (4 + 4);
# PP3 x VPP2 with 2 layers on the first and on the last stage.
LAYOUTS += [ParallelLayout(tp=2, pp=2, first_stage_layers=3), ParallelLayout(pp=2, embedding_in_split=True,
            loss_in_split=True), ParallelLayout(pp=3, vpp=2, first_stage_layers=2, last_stage_layers=2)]


def _chunks(layout):
    return [(p, v) for p in range(layout.pp) for v in range(layout.num_chunks)]


# ------------------------------------------------------------------------------------------------
# Layer placement


def _mcore_config(num_layers, pp, vpp):
    # Exactly the fields get_transformer_layer_offset / get_num_layers_to_build read for an even split.
    return SimpleNamespace(num_layers=num_layers, pipeline_model_parallel_size=pp,
                           virtual_pipeline_model_parallel_size=vpp, pipeline_model_parallel_layout=None,
                           num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                           account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False)


def test_layer_offset_matches_megatron_core():
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    checked = 0
    for num_layers in range(1, 25):
        for pp in (1, 2, 3, 4, 6, 8):
            for vpp in (None, 1, 2, 3, 4):
                layout = ParallelLayout(pp=pp, vpp=vpp)
                if pp == 1 and (vpp or 1) > 1:
                    with pytest.raises(LayoutError, match="needs PP > 1"):
                        gpt.layers_per_chunk(num_layers, layout)
                    continue
                if num_layers % (pp * (vpp or 1)):
                    with pytest.raises(LayoutError, match=f"num_layers={num_layers} is not divisible"):
                        gpt.layers_per_chunk(num_layers, layout)
                    continue
                config = _mcore_config(num_layers, pp, vpp)
                seen = []
                for pp_rank, chunk in _chunks(layout):
                    vp_stage = chunk if vpp is not None else None
                    offset = gpt.layer_offset(num_layers, layout, pp_rank, vp_stage)
                    assert offset == get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
                    per_chunk = gpt.layers_per_chunk(num_layers, layout)
                    assert per_chunk == get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
                    for local in range(per_chunk):
                        assert gpt.layer_location(offset + local, num_layers, layout) == (pp_rank, chunk, local)
                    seen += range(offset, offset + per_chunk)
                    checked += 1
                assert sorted(seen) == list(range(num_layers))
    assert checked > 200


def test_layout_errors_name_cause_and_fix():
    with pytest.raises(LayoutError, match=r"num_layers=6 is not divisible by PP x VPP = 2 x 2.*choose e\.g\."):
        gpt.layers_per_chunk(6, ParallelLayout(pp=2, vpp=2))
    with pytest.raises(LayoutError, match="pp_rank=2"):
        gpt.layer_offset(8, ParallelLayout(pp=2), 2)
    with pytest.raises(LayoutError, match="num_query_groups=2 not divisible by TP=4"):
        gpt.expected_parameters(LLAMA, ParallelLayout(tp=4))
    with pytest.raises(LayoutError, match="padded vocabulary of 1024 rows is not divisible by TP=3"):
        gpt.expected_parameters(GPT2.__class__(**{**GPT2.to_dict(), "num_attention_heads": 6, "num_query_groups": 6,
                                                  "kv_channels": 8}), ParallelLayout(tp=3))


# ------------------------------------------------------------------------------------------------
# Names


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
def test_names_round_trip_and_cover_the_model(config, layout):
    placed = {}
    for pp_rank, chunk in _chunks(layout):
        vpp_chunk = chunk if layout.vpp else None
        for local, local_shape, canonical in gpt.parameters_for_rank(config, layout, pp_rank, vpp_chunk):
            assert gpt.canonical_name(local, layout, pp_rank, vpp_chunk, config.num_layers, tied=config.tied) == canonical
            placed.setdefault(canonical, []).append((pp_rank, chunk, local))
            # TE-spec spelling of the same parameter maps to the same canonical name
            assert gpt.canonical_name(gpt.te_name(local), layout, pp_rank, vpp_chunk, config.num_layers,
                                      tied=config.tied) == canonical
    expected = gpt.expected_parameters(config, layout)
    assert sorted(placed) == sorted(name for name, _ in expected)
    for canonical, _ in expected:
        assert gpt.local_name(canonical, layout, config.num_layers, tied=config.tied) == placed[canonical]
    tied_places = placed[gpt.WORD_EMBEDDINGS]
    if config.tied and (layout.pp, layout.num_chunks) != (1, 1):
        assert tied_places == [(0, 0, gpt.WORD_EMBEDDINGS), (layout.pp - 1, layout.num_chunks - 1, gpt.OUTPUT_LAYER)]
    else:
        assert len(tied_places) == 1


def test_te_names_and_ignorable_entries():
    layout = ParallelLayout(pp=2)
    assert gpt.canonical_name("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", layout, 1, None, 8) == \
        "decoder.layers.5.input_layernorm.weight"
    assert gpt.canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_bias", layout, 0, None, 8) == \
        "decoder.layers.0.pre_mlp_layernorm.bias"
    assert gpt.te_name("decoder.layers.3.pre_mlp_layernorm.weight") == "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"
    for name in ("decoder.layers.0.self_attention.linear_qkv._extra_state", "output_layer._extra_state",
                 "decoder.layers.mlp.linear_fc1._extra_state/shard_0_4"):
        assert gpt.is_ignorable(name)
        assert gpt.canonical_name(name, layout, 1, None, 8) is None
    assert not gpt.is_ignorable("decoder.layers.0.mlp.linear_fc1.weight")
    assert not gpt.is_ignorable("decoder.layers.0.mlp.linear_fc1._extra_state_x")


def test_unknown_and_misplaced_names_raise():
    layout = ParallelLayout(pp=2)
    with pytest.raises(gpt.UnknownParameterError, match="linear_qkv.gamma"):
        gpt.canonical_name("decoder.layers.0.self_attention.linear_qkv.gamma", layout, 0, None, 8)
    # q/k layernorms have rows; a model without --qk-layernorm does not have them
    assert gpt.canonical_name("decoder.layers.0.self_attention.q_layernorm.weight", layout, 1, None, 8) == \
        "decoder.layers.4.self_attention.q_layernorm.weight"
    with pytest.raises(gpt.UnknownParameterError, match="not a parameter of this model"):
        gpt.pattern_for("decoder.layers.0.self_attention.k_layernorm.weight", LLAMA)
    qk = GPTModelConfig(**{**LLAMA.to_dict(), "qk_layernorm": True})
    assert gpt.pattern_for("decoder.layers.0.self_attention.k_layernorm.weight", qk) == Replicated()
    assert dict(gpt.expected_parameters(qk))["decoder.layers.7.self_attention.q_layernorm.weight"] == (12,)
    with pytest.raises(gpt.UnknownParameterError, match="unwrap DDP"):
        gpt.canonical_name("module.embedding.word_embeddings.weight", layout, 0, None, 8)
    with pytest.raises(gpt.UnknownParameterError, match="decoder.layers.0.mlp.linear_fc9.weight"):
        gpt.pattern_for("decoder.layers.0.mlp.linear_fc9.weight", LLAMA)
    with pytest.raises(gpt.UnknownParameterError, match="add_bias_linear=False"):
        gpt.pattern_for("decoder.layers.0.mlp.linear_fc2.bias", LLAMA)  # the rule exists; this model has no bias
    with pytest.raises(gpt.UnknownParameterError, match="not a parameter of this model"):
        gpt.pattern_for("decoder.layers.8.mlp.linear_fc2.weight", LLAMA)
    with pytest.raises(LayoutError, match="only pp_rank=0 vpp_chunk=0 holds the embedding"):
        gpt.canonical_name(gpt.WORD_EMBEDDINGS, layout, 1, None, 8)
    with pytest.raises(LayoutError, match="only the last chunk"):
        gpt.canonical_name(gpt.OUTPUT_LAYER, layout, 0, None, 8)
    with pytest.raises(LayoutError, match="local layer 4"):
        gpt.canonical_name("decoder.layers.4.input_layernorm.weight", layout, 0, None, 8)
    with pytest.raises(gpt.UnknownParameterError, match="not canonical in a tied model"):
        gpt.local_name(gpt.OUTPUT_LAYER, layout, 8, tied=True)


def test_torch_dist_keys():
    assert gpt.torch_dist_key("decoder.layers.3.input_layernorm.weight") == \
        ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (3,))
    assert gpt.torch_dist_key(gpt.WORD_EMBEDDINGS) == (gpt.WORD_EMBEDDINGS, ())
    assert gpt.torch_dist_key("decoder.layers.1.mlp.linear_fc1.weight", LLAMA) == ("decoder.layers.mlp.linear_fc1.weight", (1,))
    # MoE with --moe-layer-freq as a list: every layer under its own key, the expert on a leading axis
    assert gpt.torch_dist_keys("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight", MOE) == [
        ("decoder.layers.1.mlp.experts.experts.linear_fc2.weight", (3,))]
    assert gpt.torch_dist_keys("decoder.layers.1.pre_mlp_layernorm.weight", MOE) == [
        ("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", ()), ("decoder.layers.1.pre_mlp_layernorm.weight", ())]
    every_layer = GPTModelConfig(**{**MOE.to_dict(), "moe_layer_freq": 1})
    assert gpt.torch_dist_stacked(every_layer) and not gpt.torch_dist_stacked(MOE)
    assert gpt.torch_dist_key("decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight", every_layer) == \
        ("decoder.layers.mlp.experts.experts.linear_fc1.weight", (2, 1))
    with pytest.raises(gpt.UnknownParameterError):
        gpt.torch_dist_key("decoder.layers.0.mlp.router.gamma")


def test_patterns_per_parameter():
    assert gpt.pattern_for("decoder.layers.2.self_attention.linear_qkv.weight", LLAMA) == GroupedQKV(2, 2, 12)
    assert gpt.pattern_for("decoder.layers.2.self_attention.linear_qkv.bias", GPT2) == GroupedQKV(4, 1, 12)
    assert gpt.pattern_for("decoder.layers.2.self_attention.linear_proj.weight", LLAMA) == Sharded(1)
    assert gpt.pattern_for("decoder.layers.2.self_attention.linear_proj.bias", GPT2) == Replicated()
    assert gpt.pattern_for("decoder.layers.2.mlp.linear_fc1.weight", LLAMA) == FusedSubParams(0, (1, 1))
    assert gpt.pattern_for("decoder.layers.2.mlp.linear_fc1.bias", GPT2) == Sharded(0)
    assert gpt.pattern_for("decoder.layers.2.mlp.linear_fc2.weight", GPT2) == Sharded(1)
    assert gpt.pattern_for("decoder.layers.2.mlp.linear_fc2.bias", GPT2) == Replicated()
    assert gpt.pattern_for("decoder.layers.2.input_layernorm.bias", GPT2) == Replicated()
    assert gpt.pattern_for("decoder.final_layernorm.weight", LLAMA) == Replicated()
    assert gpt.pattern_for(gpt.WORD_EMBEDDINGS, LLAMA) == VocabSharded()
    assert gpt.pattern_for(gpt.OUTPUT_LAYER, LLAMA) == VocabSharded()
    assert gpt.pattern_for(gpt.OUTPUT_LAYER, GPT2) == VocabSharded()  # the tied copy's local name
    assert gpt.pattern_for(gpt.POSITION_EMBEDDINGS, GPT2) == Replicated()
    with pytest.raises(gpt.UnknownParameterError):
        gpt.pattern_for(gpt.POSITION_EMBEDDINGS, LLAMA)  # rope: no position embedding table


def test_check_tied_copies():
    emb = torch.randn(8, 4)
    gpt.check_tied_copies(emb, emb.clone())
    other = emb.clone()
    other[0, 0] = 0.5
    with pytest.raises(PatternError, match="output_layer"):
        gpt.check_tied_copies(emb, other)


# ------------------------------------------------------------------------------------------------
# Real Megatron-LM checkpoints (manifests of the fixtures)


def _manifest(folder):
    path = FIXTURES / folder / "manifest.txt"
    return path.read_text()


def _parse_args(text):
    args = {}
    block = text.split("[args]:", 1)[1].split("\n[", 1)[0]
    for key, value in re.findall(r"^    (\w+) = (.+)$", block, flags=re.M):
        try:
            args[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            args[key] = value
    return args


def _parse_legacy_models(text):
    """{(tp, pp): [(name, shape or None)]} from the iteration-4 section of a legacy manifest."""
    models = {}
    for tp, pp, body in re.findall(r"^---- ckpt/iter_0000004/mp_rank_(\d\d)_(\d\d\d) ----\n(.*?)(?=^\[args\])",
                                   text, flags=re.M | re.S):
        entries = re.findall(r"^  ([\w.]+): (\(.*?\)|NoneType)", body.split("state_dict", 1)[1], flags=re.M)
        models[(int(tp), int(pp))] = [(n, None if s == "NoneType" else tuple(ast.literal_eval(s)))
                                      for n, s in entries]
    return models


@pytest.mark.parametrize("folder", ["A_llama_tp2pp2dp2_distopt_sp_torch", "C_gpt2_tp2pp2dp1_adam_torch"])
def test_shapes_and_order_match_legacy_fixture(folder):
    text = _manifest(folder)
    args = _parse_args(text)
    config = GPTModelConfig.from_megatron_args(args)
    assert (config.vocab_size, config.padded_vocab_size, config.num_layers) == (1001, 1024, 4)
    layout = ParallelLayout(tp=args["tensor_model_parallel_size"], pp=args["pipeline_model_parallel_size"])
    models = _parse_legacy_models(text)
    assert len(models) == 4
    for (tp_rank, pp_rank), entries in models.items():
        params = [(n, s) for n, s in entries if not gpt.is_ignorable(n)]
        ours = gpt.parameters_for_rank(config, layout, pp_rank)
        assert [(n, s) for n, s, _ in ours] == params
        for name, _ in entries:  # every non-parameter entry is an explicit ignorable one
            assert gpt.is_ignorable(name) or name in dict(params)


def test_global_shapes_and_fused_chunks_match_torch_dist_fixture():
    text = _manifest("B_llama_tp2pp2dp2_distopt_sp_torch_dist")
    config = GPTModelConfig.from_megatron_args(_parse_args(_manifest("A_llama_tp2pp2dp2_distopt_sp_torch")))
    block = text.split(".metadata:", 1)[1].split("\n\n", 1)[0]
    saved = {key: (ast.literal_eval(shape), ast.literal_eval(chunks)) for key, shape, chunks in
             re.findall(r"^  (\S+): global (\(.*?\)) \S+ chunks\(offsets,sizes\)=(.*)$", block, re.M)
             if not key.startswith("optimizer.")}
    used = set()
    for name, global_shape in gpt.expected_parameters(config):
        key, lead = gpt.torch_dist_key(name, config)
        shape, chunks = saved[key]
        assert shape[len(lead):] == global_shape and shape[:len(lead)] == (config.num_layers,) * len(lead), key
        used.add(key)
        # The saved TP chunks of this parameter are exactly our blocks for TP=2.
        pattern = gpt.pattern_for(name, config)
        ours = sorted((lead + tuple(r.start for r in b.dst), (1,) * len(lead) + tuple(r.stop - r.start for r in b.dst))
                      for tp_rank in range(2) for b in pattern.rank_blocks(global_shape, tp_rank, 2))
        theirs = sorted((tuple(o), tuple(s)) for o, s in chunks if tuple(o[:len(lead)]) == lead)
        if not isinstance(pattern, Replicated):
            assert ours == theirs, key
    assert used == {k for k in saved if not gpt.is_ignorable(k)}


# ------------------------------------------------------------------------------------------------
# A real megatron-core GPTModel built on CPU


@pytest.fixture(scope="module")
def mcore():
    import torch.distributed as dist
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield
    if created:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _build(config: GPTModelConfig, layout: ParallelLayout, pre_process=True, post_process=True, vp_stage=None):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tc = TransformerConfig(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
        kv_channels=config.kv_channels, gated_linear_unit=config.swiglu,
        activation_func=F.silu if config.swiglu else F.gelu, normalization=config.normalization,
        add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias, qk_layernorm=config.qk_layernorm,
        use_cpu_initialization=True, perform_initialization=True,
        pipeline_model_parallel_size=layout.pp, virtual_pipeline_model_parallel_size=layout.vpp,
        pipeline_dtype=torch.float32 if layout.pp > 1 else None)
    spec = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm)
    return GPTModel(config=tc, transformer_layer_spec=spec,
                    vocab_size=config.padded_vocab_size, max_sequence_length=config.max_position_embeddings,
                    position_embedding_type=config.position_embedding_type,
                    share_embeddings_and_output_weights=config.tied,
                    pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


@pytest.mark.parametrize("config", [LLAMA, GPT2, GPTModelConfig(**{**LLAMA.to_dict(), "qk_layernorm": True}),
                                    GPTModelConfig(**{**GPT2.to_dict(), "qk_layernorm": True})],
                         ids=["llama", "gpt2", "llama_qk_layernorm", "gpt2_qk_layernorm"])
def test_order_and_shapes_match_real_gpt_model_tp1pp1(mcore, config):
    config = GPTModelConfig(**{**config.to_dict(), "num_layers": 2})
    model = _build(config, ParallelLayout())
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    ours = gpt.parameters_for_rank(config, ParallelLayout(), 0)
    assert [(n, s) for n, s, _ in ours] == real
    assert [(n, s) for n, s in gpt.expected_parameters(config)] == real
    assert all(gpt.is_ignorable(k) for k in model.state_dict() if k not in dict(real))
    # the local spec saves `_extra_state` exactly for the rulebook's linear modules
    extra = {k.rsplit(".", 1)[0] for k in model.state_dict() if k.endswith("._extra_state")}
    linear = {n.rsplit(".", 1)[0] for n, _ in real if gpt.rule_for(n).linear}
    assert extra == linear | {"output_layer"}  # a tied output layer keeps its _extra_state without a weight


def test_stage_local_layer_names_match_real_vpp_chunks(mcore, monkeypatch):
    """PP2 x VPP2, 8 layers, tied: build each chunk as megatron-core does on that pipeline rank."""
    import megatron.core.transformer.transformer_block as transformer_block
    import megatron.core.transformer.transformer_layer as transformer_layer
    from megatron.core.models.common.language_module.language_module import LanguageModule

    # The tied-copy all-reduce needs a real embedding group (and CUDA); names and shapes do not.
    monkeypatch.setattr(LanguageModule, "_is_in_embd_group", lambda self: False)
    layout = ParallelLayout(pp=2, vpp=2)
    for pp_rank, vp_stage in _chunks(layout):
        # World size 1 cannot hold PP=2: pretend to be pipeline rank pp_rank where megatron-core asks.
        monkeypatch.setattr(transformer_block, "get_pg_rank", lambda group, r=pp_rank: r)
        monkeypatch.setattr(transformer_layer, "get_pg_rank", lambda group, r=pp_rank: r)
        model = _build(GPT2, layout, pre_process=layout.is_first_chunk(pp_rank, vp_stage),
                       post_process=layout.is_last_chunk(pp_rank, vp_stage), vp_stage=vp_stage)
        real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        ours = gpt.parameters_for_rank(GPT2, layout, pp_rank, vp_stage)
        assert [(n, s) for n, s, _ in ours] == real
        # megatron-core's own global layer numbers (1-based) agree with our canonical names
        offset = gpt.layer_offset(GPT2.num_layers, layout, pp_rank, vp_stage)
        assert [layer.layer_number - 1 for layer in model.decoder.layers] == [offset, offset + 1]


def test_padded_vocab_rules():
    """Resume keeps the stored padded rows when TP divides them, else Megatron-LM's rule; Megatron-LM
    itself always recomputes ceil(vocab / (divisible_by * TP)) * divisible_by * TP."""
    def config(padded, vocab=1001):
        return GPTModelConfig(**{**GPT2.to_dict(), "padded_vocab_size": padded, "vocab_size": vocab})

    assert gpt.padded_vocab_at(config(1024), 2) == 1024
    assert gpt.padded_vocab_at(config(1024), 8) == 1024
    assert gpt.padded_vocab_at(config(1024), 3) == 1152  # ceil(1001/384) * 384
    assert gpt.padded_vocab_at(config(1024), 16) == 1024  # kept: 16 divides it
    assert gpt.padded_vocab_at(config(50304, 50257), 5) == 50560
    assert gpt.megatron_padded_vocab(config(1024), 16) == 2048  # Megatron-LM re-pads where we would keep
    with pytest.raises(PatternError, match="smaller than the true vocabulary"):
        gpt.padded_vocab_at(config(1000), 1)
    assert gpt.is_vocab_parameter(gpt.OUTPUT_LAYER) and gpt.is_vocab_parameter(gpt.WORD_EMBEDDINGS)
    assert not gpt.is_vocab_parameter(gpt.POSITION_EMBEDDINGS)


def test_pad_vocab_size_is_megatron_lms_rule():
    """core.model_config.pad_vocab_size (the converters' padding) equals Megatron-LM's own
    calculate_padded_vocab_size for every vocabulary 1..1100, divisor 1/64/128 and TP 1..8."""
    from megatron_ucp.core.model_config import pad_vocab_size

    from megatron.training.vocab_utils import calculate_padded_vocab_size

    for vocab in range(1, 1101):
        for divisible in (1, 64, 128):
            for tp in range(1, 9):
                assert pad_vocab_size(vocab, divisible, tp) == \
                    calculate_padded_vocab_size(vocab, divisible, tp, logging_enabled=False), (vocab, divisible, tp)
    assert pad_vocab_size(257, 128, 2) == 512 and pad_vocab_size(1001, 128, 1) == 1024


def test_param_group_rule_from_rows():
    """Megatron's rule (no weight decay for biases and 1-D params; decoupled LR for the embedding on the
    first chunk and the output weight on the last), keyed on any spelling of the name."""
    args = {"decoupled_lr": 0.1}
    assert gpt.group_override("decoder.layers.0.mlp.linear_fc1.weight", (8, 4), args, first_chunk=True,
                              last_chunk=True) is None
    assert gpt.group_override("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", (4,), args,
                              first_chunk=True, last_chunk=True) == (("wd_mult", 0.0),)
    assert gpt.group_override(gpt.WORD_EMBEDDINGS, (8, 4), args, first_chunk=True, last_chunk=False) == \
        (("max_lr", 0.1),)
    # a tied model's last-stage copy is the output weight there
    assert gpt.group_override(gpt.OUTPUT_LAYER, (8, 4), args, first_chunk=False, last_chunk=True) == \
        (("max_lr", 0.1),)
    assert gpt.group_override(gpt.OUTPUT_LAYER, (8, 4), {}, first_chunk=False, last_chunk=True) is None
    qk = "decoder.layers.0.self_attention.q_layernorm.weight"
    assert gpt.group_override(qk, (4,), {"apply_wd_to_qk_layernorm": True}, first_chunk=True, last_chunk=True) is None
    assert gpt.group_identity((("max_lr", 0.1), ("wd_mult", 0.0))) == {
        "wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": True}


# ------------------------------------------------------------------------------------------------
# Mixture of experts: the MoE rows against a real megatron-core MoE model (local spec, sequential experts)


def _build_moe(config: GPTModelConfig, monkeypatch):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig

    # The router's buffers are allocated on torch.cuda.current_device(): the CPU here, for this test only
    # (cpu_backend.apply() would patch the process for every later test).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    tc = TransformerConfig(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
        kv_channels=config.kv_channels, gated_linear_unit=config.swiglu,
        activation_func=F.silu if config.swiglu else F.gelu, normalization=config.normalization,
        add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias, use_cpu_initialization=True,
        num_moe_experts=config.num_experts, moe_ffn_hidden_size=config.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=config.moe_shared_expert_gate, moe_router_topk=2,
        moe_layer_freq=list(config.moe_layer_freq) if isinstance(config.moe_layer_freq, tuple) else config.moe_layer_freq,
        moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
        moe_router_score_function="sigmoid" if config.moe_router_enable_expert_bias else "softmax")
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization=config.normalization)
    return GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=config.padded_vocab_size,
                    max_sequence_length=config.max_position_embeddings,
                    position_embedding_type=config.position_embedding_type,
                    share_embeddings_and_output_weights=config.tied)


MOE_GELU_BIAS = GPTModelConfig(**{**GPT2.to_dict(), "num_layers": 3, "num_experts": 2, "moe_ffn_hidden_size": 16,
                                  "moe_layer_freq": 2})


@pytest.mark.parametrize("config", [MOE, MOE_GELU_BIAS], ids=["swiglu_shared_gate_expert_bias", "gelu_biases_freq2"])
def test_moe_rows_match_a_real_megatron_core_moe_model(mcore, monkeypatch, config):
    """Order, names and shapes of parameters AND buffers (the state dict), which layers are MoE, and the
    torch_dist keys with their leading (layer, expert) offsets as megatron-core's sharded_state_dict gives
    them, for a mixed dense/MoE model at TP1 EP1."""
    model = _build_moe(config, monkeypatch)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    ours = gpt.parameters_for_rank(config, ParallelLayout(), 0)
    assert [(n, s) for n, s, _ in ours] == real
    state = [(k, tuple(v.shape)) for k, v in model.state_dict().items() if not gpt.is_ignorable(k)]
    with_buffers = gpt.parameters_for_rank(config, ParallelLayout(), 0, buffers=True)
    assert [(n, s) for n, s, _ in with_buffers] == state
    assert [(n, s) for n, s in gpt.expected_parameters(config)] == state
    assert config.moe_router_enable_expert_bias == any(gpt.is_buffer(n) for n, _ in state)
    assert [any(".mlp.router." in n and f"layers.{i}." in n for n, _ in real) for i in range(config.num_layers)] == \
        list(config.moe_layers)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded_sd = model.sharded_state_dict()
    apply_factories(sharded_sd)  # SwiGLU fc1: two ShardedTensors (gate, up) per weight
    by_key: dict = {}
    for sh in nested_values(sharded_sd):
        if isinstance(sh, ShardedTensor):
            by_key.setdefault(sh.key, []).append(sh)
    used = set()
    for name, shape in state:
        key, lead = gpt.torch_dist_key(name, config)
        pieces = [sh for sh in by_key[key] if tuple(sh.global_offset[:len(lead)]) == lead]
        assert pieces and all(tuple(sh.global_shape[len(lead):]) == shape for sh in pieces), name
        used.add(key)
    assert used == {k for k in by_key if not gpt.is_ignorable(k)}


def test_moe_names_and_placement_over_ep_and_etp():
    """Local expert j on EP rank r is global expert r*E/EP + j; routed experts split over ETP, shared
    experts over TP; canonical and local names round-trip at every (pp, ep) rank."""
    layout = ParallelLayout(tp=2, dp=2, pp=2, ep=2, etp=1)
    placed = {}
    for pp_rank in range(2):
        for ep_rank in range(2):
            for local, shape, canonical in gpt.parameters_for_rank(MOE, layout, pp_rank, ep_rank=ep_rank):
                back = gpt.canonical_name(local, layout, pp_rank, None, MOE.num_layers, tied=MOE.tied, config=MOE,
                                          ep_rank=ep_rank)
                assert back == canonical
                assert gpt.canonical_name(gpt.te_name(local), layout, pp_rank, None, MOE.num_layers, config=MOE,
                                          ep_rank=ep_rank) == canonical
                if gpt.is_expert(canonical):
                    assert gpt.local_name(canonical, layout, MOE.num_layers, config=MOE) == [(pp_rank, 0, local)]
                    assert gpt.expert_location(int(canonical.split(".")[6]), MOE, layout)[0] == ep_rank
                placed.setdefault(canonical, set()).add((pp_rank, ep_rank, shape))
    fc1 = "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"
    assert placed[fc1] == {(1, 1, (64, 48))}  # ETP1: the whole expert, on EP rank 1 only
    assert placed["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"] == {(1, 0, (32, 48)), (1, 1, (32, 48))}
    assert gpt.te_name("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight") == \
        "decoder.layers.1.mlp.experts.linear_fc2.weight0"
    assert {n for n, _ in gpt.expected_parameters(MOE)} == set(placed) | {
        n for n, _ in gpt.expected_parameters(MOE) if gpt.is_buffer(n)}
    with pytest.raises(LayoutError, match=r"num_experts=4 is not divisible by EP=3.*choose --expert-model-parallel-size in \[1, 2, 4\]"):
        gpt.expected_parameters(MOE, ParallelLayout(dp=3, ep=3))
    with pytest.raises(LayoutError, match="local expert 2 but each EP rank holds 2"):
        gpt.canonical_name("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", ParallelLayout(dp=2, ep=2),
                           0, None, 4, config=MOE)
    with pytest.raises(LayoutError, match="belongs to an MoE layer but global layer 0 is dense"):
        gpt.canonical_name("decoder.layers.0.mlp.router.weight", ParallelLayout(), 0, None, 4, config=MOE)
    with pytest.raises(LayoutError, match="cannot be split into ETP x EP"):
        ParallelLayout(tp=2, dp=1, ep=2, etp=2)


def test_uneven_pipelines_place_layers_as_megatron_core():
    """The rulebook's placement of uneven pipelines is megatron-core's (layer_placement, itself checked
    exhaustively against megatron-core in tests/test_layer_placement.py)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for layout in LAYOUTS[-3:]:
        config = SimpleNamespace(**{**vars(_mcore_config(8, layout.pp, layout.vpp)),
                                    "num_layers_in_first_pipeline_stage": layout.first_stage_layers,
                                    "num_layers_in_last_pipeline_stage": layout.last_stage_layers,
                                    "account_for_embedding_in_pipeline_split": layout.embedding_in_split,
                                    "account_for_loss_in_pipeline_split": layout.loss_in_split})
        seen = []
        for pp_rank, chunk in _chunks(layout):
            vp_stage = chunk if layout.vpp else None
            layers = gpt.chunk_layers(8, layout, pp_rank, vp_stage)
            assert layers.start == get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
            assert len(layers) == get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
            seen += layers
        assert sorted(seen) == list(range(8)), layout.describe()
    assert [len(gpt.chunk_layers(8, LAYOUTS[-3], p)) for p in range(2)] == [3, 5]
    with pytest.raises(LayoutError, match="not divisible by PP=3"):
        gpt.expected_parameters(GPT2, ParallelLayout(pp=3, embedding_in_split=True, loss_in_split=True))
