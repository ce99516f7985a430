"""Multi-latent attention (MLA) and multi-token prediction (MTP) in the GPT rulebook (adapters/gpt.py), checked
against megatron-core 0.19.2's own models.

tests/mla_mtp_probe.py builds, in one child process, the GPTModel Megatron-LM's loop builds for four sets of
flags (DeepSeek-V3-shaped MLA + MoE + MTP; its last pipeline stage at PP2; MLA without q-LoRA, LayerNorm, tied,
two MTP layers; GQA attention with MTP) and reports its parameters, state dict and sharded state dict. Every
name, shape and registration order, every persistent buffer and `_extra_state`, and every torch_dist key with its
leading (layer, expert) offsets must be the rulebook's. End-to-end continuation and Megatron-LM's own loads of
what from-universal writes: tests/test_mla_mtp_resume.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron_ucp.adapters import gpt
from megatron_ucp.core.layout import LayoutError, ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.core.patterns import Replicated, Sharded
from megatron_ucp.formats.bucket_layout import BufferParam, DDPBucketConfig, build_buffer_layout, shared_embedding_names

from pretrain_runs import REPO

LAYOUTS = {"deepseek_pp2_last_stage": (ParallelLayout(pp=2), 1)}  # case -> (layout, pp rank); default TP1 PP1


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("mla_mtp") / "probe.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "mla_mtp_probe.py"), str(out)], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return json.loads(out.read_text())


def _config(args: dict) -> GPTModelConfig:
    return GPTModelConfig.from_megatron_args({**args, "padded_vocab_size": 1024})


CASES = ["deepseek", "deepseek_pp2_last_stage", "mla_noqlora_layernorm_tied_mtp2", "gqa_qk_layernorm_mtp"]


@pytest.mark.parametrize("case", CASES)
def test_rows_match_megatron_cores_model(probed, case):
    real = probed[case]
    config = _config(real["args"])
    layout, pp_rank = LAYOUTS.get(case, (ParallelLayout(), 0))
    ours = gpt.parameters_for_rank(config, layout, pp_rank)
    assert [[n, list(s)] for n, s, _ in ours] == real["params"]
    with_buffers = gpt.parameters_for_rank(config, layout, pp_rank, buffers=True)
    assert [[n, list(s)] for n, s, _ in with_buffers] == real["state"]  # the legacy files' names
    linear = {n.rsplit(".", 1)[0] for n, _, _ in ours if gpt.rule_for(n).linear}
    assert set(real["extra"]) == linear | {"output_layer"}
    # every local name maps to its canonical one and back
    for local, _, canonical in with_buffers:
        assert gpt.canonical_name(local, layout, pp_rank, None, config.num_layers, tied=config.tied, config=config) \
            == canonical
        places = gpt.local_name(canonical, layout, config.num_layers, tied=config.tied, config=config)
        assert (pp_rank, 0, local) in places


@pytest.mark.parametrize("case", CASES)
def test_torch_dist_keys_and_offsets_are_megatron_cores(probed, case):
    real = probed[case]
    config = _config(real["args"])
    layout, pp_rank = LAYOUTS.get(case, (ParallelLayout(), 0))
    by_key: dict = {}
    for key, shape, offset in real["sharded"]:
        by_key.setdefault(key, []).append((shape, offset))
    used = set()
    for _, shape, canonical in gpt.parameters_for_rank(config, layout, pp_rank, buffers=True):
        key, lead = gpt.torch_dist_key(canonical, config)
        lead_shape = gpt.torch_dist_lead_shape(canonical, config)
        assert len(lead_shape) == len(lead), canonical
        pieces = [(s, o) for s, o in by_key.get(key, []) if tuple(o[:len(lead)]) == lead]
        assert pieces, (canonical, key, lead)
        assert all(tuple(s[:len(lead)]) == lead_shape and tuple(s[len(lead):]) == tuple(shape) for s, _ in pieces), \
            (canonical, pieces)
        used.add(key)
    assert used == set(by_key)


def test_mla_patterns_follow_the_spec():
    """megatron-core's local spec splits MLA's down projections over TP (column-parallel, gathered after); the
    TransformerEngine spec duplicates them; the up projections and the MTP projection are column-parallel, the
    latent norms replicated, in both."""
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
                kv_channels=16, vocab_size=1000, padded_vocab_size=1024, swiglu=True, normalization="RMSNorm",
                position_embedding_type="rope", add_bias_linear=False, multi_latent_attention=True, q_lora_rank=32,
                kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, qk_layernorm=True,
                mtp_num_layers=1, untie_embeddings_and_output_weights=True)
    local = GPTModelConfig(**base, transformer_impl="local")
    te = GPTModelConfig(**base, transformer_impl="transformer_engine")
    attn = "decoder.layers.1.self_attention."
    for down in ("linear_q_down_proj.weight", "linear_kv_down_proj.weight"):
        assert gpt.pattern_for(attn + down, local) == Sharded(0)
        assert gpt.pattern_for(attn + down, te) == Replicated()
    for config in (local, te):
        for up in ("linear_q_up_proj.weight", "linear_kv_up_proj.weight"):
            assert gpt.pattern_for(attn + up, config) == Sharded(0)
        assert gpt.pattern_for("mtp.layers.0.eh_proj.weight", config) == Sharded(0)
        assert gpt.pattern_for("mtp.layers.0.mtp_model_layer.self_attention.kv_layernorm.weight", config) == Replicated()
    # TE fuses the latent norms into the up projections: another torch_dist key, the same canonical parameter
    assert gpt.torch_dist_key(attn + "q_layernorm.weight", te)[0] == "decoder.layers.self_attention.linear_q_up_proj." \
                                                                    "layer_norm_weight"
    assert gpt.torch_dist_key(attn + "q_layernorm.weight", local)[0] == "decoder.layers.self_attention.q_layernorm.weight"
    assert gpt.canonical_name("decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight", ParallelLayout(),
                              0, None, 2, config=te) == "decoder.layers.0.self_attention.kv_layernorm.weight"
    # older releases' legacy files (<= 0.16) and every torch_dist save spell the MTP layer's transformer layer so
    inner = "mtp.layers.0.mtp_model_layer.self_attention.linear_proj.weight"
    assert gpt.canonical_name("mtp.layers.0.transformer_layer.self_attention.linear_proj.weight", ParallelLayout(),
                              0, None, 2, config=local) == inner
    assert gpt.mtp_inner_spelling(inner, gpt.MTP_INNER_SAVED) == \
        "mtp.layers.0.transformer_layer.self_attention.linear_proj.weight"


def test_mtp_placement_and_refusals():
    base = GPTModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                          num_query_groups=4, kv_channels=16, vocab_size=1000, padded_vocab_size=1024,
                          position_embedding_type="rope", mtp_num_layers=1, untie_embeddings_and_output_weights=True,
                          transformer_impl="local")
    pp4 = ParallelLayout(pp=4)
    # the MTP layers and the embedding's copy live on the last stage; the first stage keeps the embedding
    assert gpt.local_name("mtp.layers.0.enorm.weight", pp4, 4, config=base) == [(3, 0, "mtp.layers.0.enorm.weight")]
    assert gpt.local_name(gpt.WORD_EMBEDDINGS, pp4, 4, config=base) == [(0, 0, gpt.WORD_EMBEDDINGS),
                                                                          (3, 0, gpt.WORD_EMBEDDINGS)]
    assert gpt.parameters_for_rank(base, pp4, 3)[0][0] == gpt.WORD_EMBEDDINGS
    assert gpt.WORD_EMBEDDINGS not in [n for n, _, _ in gpt.parameters_for_rank(base, pp4, 1)]
    with pytest.raises(LayoutError, match="MTP layers on the last"):
        gpt.canonical_name("mtp.layers.0.enorm.weight", pp4, 2, None, 4, config=base)
    with pytest.raises(LayoutError, match="mtp_num_layers=1"):
        gpt.canonical_name("mtp.layers.1.enorm.weight", pp4, 3, None, 4, config=base)
    # megatron-core 0.19 gives a tied MTP model at PP > 1 an untrainable second output weight: refused with the fix
    tied = GPTModelConfig(**{**base.to_dict(), "untie_embeddings_and_output_weights": False})
    gpt.expected_parameters(tied, ParallelLayout())
    with pytest.raises(LayoutError, match="tied embeddings at PP > 1"):
        gpt.expected_parameters(tied, ParallelLayout(pp=2))
    with pytest.raises(ValueError, match="learned absolute"):
        gpt.expected_parameters(GPTModelConfig(**{**base.to_dict(), "position_embedding_type": "learned_absolute"}))
    # TransformerEngine's fused q/kv down projection: one parameter and Adam state for two canonical ones
    fused = GPTModelConfig(**{**base.to_dict(), "multi_latent_attention": True, "q_lora_rank": 32,
                              "mla_down_proj_fusion": True})
    with pytest.raises(ValueError, match="--mla-down-proj-fusion .* not supported"):
        gpt.expected_parameters(fused)
    # the optimizer groups megatron-core builds: the MTP stage's embedding copy takes the decoupled LR too
    args = {"decoupled_lr": 5e-4, "mtp_num_layers": 1}
    assert gpt.group_override(gpt.WORD_EMBEDDINGS, (1024, 64), args, first_chunk=False, last_chunk=True) == \
        (("max_lr", 5e-4),)
    assert gpt.group_override(gpt.WORD_EMBEDDINGS, (1024, 64), {**args, "mtp_num_layers": None}, first_chunk=False,
                              last_chunk=True) is None


def test_shared_embedding_buckets_with_mtp_and_megatron_cores_unsaveable_bucket():
    """With MTP at PP > 1 both stages' word embeddings are `shared_embedding` (a DDP bucket of their own), untied
    too. megatron-core closes the bucket before such a parameter at the parameter's 64-aligned start: when the
    previous parameter does not end there, its dp_reshardable save (and load) fails (torch's planner: a chunk past
    the declared tensor; seen with hidden 48, TP2 PP2, MLA + MTP: 'invalid fill tensor-volume: 71488 chunks-volume:
    71552'). The writer must refuse exactly then."""
    layout = ParallelLayout(pp=2)
    args = {"untie_embeddings_and_output_weights": True, "mtp_num_layers": 1}
    names = [gpt.WORD_EMBEDDINGS, "decoder.layers.0.input_layernorm.weight", gpt.OUTPUT_LAYER]
    assert shared_embedding_names(args, layout, pp_rank=1, vpp_chunk=0, names=names) == {gpt.WORD_EMBEDDINGS}
    assert shared_embedding_names(args, layout, pp_rank=0, vpp_chunk=0, names=names) == {gpt.WORD_EMBEDDINGS}
    assert shared_embedding_names({**args, "mtp_num_layers": None}, layout, pp_rank=1, vpp_chunk=0, names=names) \
        == set()
    config = DDPBucketConfig(dp_size=1, use_distributed_optimizer=True)

    def last_stage(norm: int):
        f32 = torch.float32
        return build_buffer_layout([BufferParam(gpt.WORD_EMBEDDINGS, (1024, 48), f32, shared_embedding=True),
                                    BufferParam("norm", (norm,), f32), BufferParam(gpt.OUTPUT_LAYER, (1024, 48), f32)],
                                   config)

    unaligned, aligned = last_stage(48), last_stage(64)
    assert unaligned.buckets[0].numel_unpadded == 1024 * 48 + 64  # the embedding's padded start, not 49200
    assert unaligned.dp_reshardable_overrun(1) == 0
    assert aligned.dp_reshardable_overrun(1) is None


def test_a_run_of_the_other_spec_reads_mla_down_projections_as_it_splits_them(tmp_path):
    """F19 was trained on megatron-core's local spec (down projections split over TP); a TransformerEngine run
    (duplicated down projections) resuming it must read each whole on every TP rank, and a local run half each.
    The loader reads every parameter with the rulebook's pattern for the run's own config (same global tensor)."""
    import dataclasses

    from megatron_ucp.convert import to_universal
    from megatron_ucp.megatron_lm.loader import _split_as_this_run
    from megatron_ucp.universal import UniversalCheckpoint

    ucp_path = to_universal(REPO / "tests" / "fixtures" / "megatron-core-0.19" /
                            "F19_mla_moe_mtp_tp2pp2ep2_distopt_sp_torch_dist" / "ckpt", tmp_path / "ucp",
                            iteration=4, progress=False)
    name = "decoder.layers.1.self_attention.linear_kv_down_proj.weight"
    local, te = UniversalCheckpoint.open(ucp_path), UniversalCheckpoint.open(ucp_path)
    assert local.parameters[name].pattern == Sharded(0)  # as trained
    _split_as_this_run(local, local.config)
    _split_as_this_run(te, dataclasses.replace(te.config, transformer_impl="transformer_engine"))
    whole = local.read(name, "exp_avg")
    assert torch.equal(local.read_local(name, "exp_avg", 1, 2), whole.chunk(2)[1])
    assert torch.equal(te.read_local(name, "exp_avg", 1, 2), whole)
    assert te.parameters[name].pattern == Replicated()
    # nothing else changes between the two specs' patterns
    changed = [n for n in local.parameters if local.parameters[n].pattern != te.parameters[n].pattern]
    assert changed and all(n.endswith(("q_down_proj.weight", "kv_down_proj.weight")) for n in changed)
