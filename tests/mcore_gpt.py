"""A megatron-core 0.19 GPT model in one process (TP1 PP1 EP1, gloo, CPU), built from Megatron-LM flags as
Megatron-LM builds it: its parser and validate_args (tests/megatron_lm_args.py), its
core_transformer_config_from_args, and the GPTModel of the entry point's model provider (local spec: dense
layers, or the decoder block spec with experts; multi-latent attention; the MTP block spec with --mtp-num-layers).
For the HF tests' reference logits (`fill_from_universal` and
`causal_logits`; `universal_logits` for several checkpoints in one child process: `python tests/mcore_gpt.py
JOBS.pt OUT.pt`), and as the model provider of tests/ddp_bucket_probe.py.

`single_process()` installs cpu_shims' patches (process-wide: call it in a child process, not in pytest's).
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Sequence

import torch

from megatron_lm_args import megatron_lm_args

# Fused kernels need CUDA (and Apex/TE); Megatron-LM's CPU fixtures ran with them off too
# (tests/fixtures/megatron-core-0.19/*/cmd.txt).
CPU_FLAGS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
             "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
             "--no-persist-layer-norm", "--disable-jit-fuser"]


@contextlib.contextmanager
def single_process():
    """cpu_shims installed, a one-rank gloo group and megatron-core's parallel state at TP1 PP1."""
    from megatron_ucp.megatron_lm import cpu_shims

    cpu_shims.install()
    from megatron.core import parallel_state

    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


def gpt_args(flags: Sequence[str], padded_vocab_size: int):
    """Megatron-LM's args for `flags` (+ CPU_FLAGS), with the padded vocabulary its tokenizer would set."""
    args = megatron_lm_args([*flags, *CPU_FLAGS])
    args.padded_vocab_size = padded_vocab_size
    return args


def build_gpt(args, pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None,
              megatron_lm_builder=False):
    """The GPTModel the entry point's model provider builds for `args` (by default the whole model); with
    `megatron_lm_builder` as Megatron-LM 0.19's own gpt_builders.py builds it: without --rope-scaling-factor
    (GPTModel's default llama3 factor, 8)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs,
                                                          get_gpt_layer_local_spec, get_gpt_mtp_block_spec)
    from megatron.training.argument_utils import core_transformer_config_from_args

    config = config or core_transformer_config_from_args(args)
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                        args.multi_latent_attention, normalization=args.normalization)
    mtp_spec = None
    if args.mtp_num_layers is not None:  # as the entry point's provider: MTP layers built like the last layer
        last = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=args.normalization,
                                           qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)[-1]
        mtp_spec = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp_stage)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, vp_stage=vp_stage, pg_collection=pg_collection,
                    parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, mtp_block_spec=mtp_spec,
                    **({} if megatron_lm_builder else {"rope_scaling_factor": args.rope_scaling_factor}))


def fill_from_universal(model, ucp) -> None:
    """A TP1 PP1 model's parameters and persistent buffers (the router's expert bias) from a universal checkpoint
    (its tensors are the TP1 tensors); every one the checkpoint holds must be filled."""
    from megatron_ucp.adapters.gpt import canonical_name, parameters_for_rank
    from megatron_ucp.core.layout import ParallelLayout

    layout = ParallelLayout()
    buffers = {local for local, _, _ in parameters_for_rank(ucp.config, layout, 0, buffers=True)}
    filled = set()
    with torch.no_grad():
        state = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in buffers)]
        for local, tensor in state:
            name = canonical_name(local, layout, 0, None, ucp.config.num_layers, tied=ucp.config.tied,
                                  config=ucp.config)
            tensor.copy_(ucp.read(name))
            filled.add(name)
    assert filled == set(ucp.parameters), set(ucp.parameters) ^ filled


def causal_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits [b, s, padded vocabulary] for token ids [b, s]: positions from 0, causal mask."""
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    causal_mask = torch.ones(seq, seq, dtype=torch.bool).triu(1).view(1, 1, seq, seq)  # True = masked
    model.eval()
    with torch.no_grad():
        return model(tokens, positions, causal_mask)


def universal_logits(jobs: Sequence[dict]) -> list:
    """Each job {"ucp": dir, "flags": Megatron-LM flags, "tokens": [b, s]}: the GPTModel Megatron-LM builds from the
    flags (the run's check_compatible accepting the checkpoint), filled from the universal checkpoint, and its
    logits on the tokens. Call it in a child process (single_process patches the process).
    Optional keys: "builder": "entry_point" (the entry point's own model_provider, global args set as Megatron-LM
    sets them) or "megatron_lm" (as Megatron-LM 0.19's gpt_builders.py: no --rope-scaling-factor) instead of
    build_gpt; "rope_check": the loader's check_rotary_frequencies first, its refusal (a string) the job's result
    when it refuses; "mtp": the result is (logits, the MTP layers' logits [b, s, padded vocabulary] each)."""
    from megatron_ucp.megatron_lm.loader import UniversalLoadError, check_compatible, check_rotary_frequencies
    from megatron_ucp.universal import UniversalCheckpoint

    results = []
    with single_process():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.training.global_vars import set_args

        for job in jobs:
            ucp = UniversalCheckpoint.open(job["ucp"])
            model_parallel_cuda_manual_seed(1)
            args = gpt_args([*job["flags"], "--seq-length", str(job["tokens"].shape[1]), "--micro-batch-size", "1",
                             "--train-iters", "1", "--lr", "1e-4", "--mock-data"], ucp.config.padded_vocab_size)
            check_compatible(ucp, args)
            builder = job.get("builder")
            if builder == "entry_point":
                from megatron_ucp.megatron_lm import pretrain_gpt

                set_args(args)
                model = pretrain_gpt.model_provider()
            else:
                model = build_gpt(args, megatron_lm_builder=builder == "megatron_lm")
            if job.get("rope_check"):
                try:
                    check_rotary_frequencies(ucp, args, [model])
                except UniversalLoadError as e:
                    results.append(str(e))
                    continue
            fill_from_universal(model, ucp)
            if not job.get("mtp"):
                results.append(causal_logits(model, job["tokens"]))
                continue
            captured = []
            hook = model.mtp.register_forward_hook(lambda module, inputs, output: captured.append(output))
            logits = causal_logits(model, job["tokens"])
            hook.remove()
            output_weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
                else None
            with torch.no_grad():  # the MTP block returns [decoder; MTP layer 1; ...] hidden states on dim 0
                chunks = torch.chunk(captured[0], 1 + args.mtp_num_layers, dim=0)[1:]
                mtp = [model.output_layer(h, weight=output_weight)[0].transpose(0, 1) for h in chunks]
            results.append((logits, mtp))
    return results


if __name__ == "__main__":  # python tests/mcore_gpt.py JOBS.pt OUT.pt: universal_logits in a child process
    import sys

    torch.save(universal_logits(torch.load(sys.argv[1])), sys.argv[2])
