"""Random seeds as Megatron-LM sets them, and its start-up draws from the default generator.

Megatron-LM's initialize_megatron seeds python, numpy, torch and megatron-core's RNG tracker with
`seed + 100 * pp_rank` (_set_random_seed). pretrain() then warms up its fused kernels
(initialize._warmup_jit_function) on random inputs *before* building the model. Those inputs come
from the default torch generator, so they move it: parameters that megatron-core initialises from
the default generator (the learned position embeddings: they are not tensor-parallel, so no tracker
fork) start from a different stream than they would without the warm-up, and the generator state
saved in every checkpoint's rng_state differs too.

After the model (and a resume's load) it builds the train/valid/test DataLoader iterators where
the datasets live (TP rank 0 of the first and last pipeline stages: pretrain_gpt's
is_dataset_built_on_rank), and each draws a base seed from the default generator
(torch.utils.data's _BaseDataLoaderIter).

The harness does not run the warm-up (its kernels are fused with torch.compile, ~40 s per process
on CPU) and has no DataLoader; `advance_like_megatron_lm_warmup` and
`advance_like_megatron_lm_data_loaders` move the default generator as far. Checked against
Megatron-LM's own checkpoints (tests/fixtures/megatron-lm, core_v0.16.1, torch.compile'd fusions on
CPU): their saved generator states are the seed advanced by exactly these draws (3653 on fixture
A's TP-rank-0 ranks, 6229 on C's last stage), and the harness's checkpoints of their runs are
bitwise equal to theirs (tests/test_harness_legacy_save.py), GPT-2's learned position embeddings
included.

Two deliberate differences, both for the RNG streams the training itself uses:
- The data-loader draws happen on every TP rank of the first and last stages, not only on TP rank 0.
  On GPUs they move the CPU generator while dropout draws from the CUDA one; on CPU both are the
  same generator, and hidden dropout without SP must draw the same masks on every TP rank (its
  activations are replicated across TP). With Megatron-LM's TP-rank-0-only draws the TP ranks'
  masks differ and their copies of replicated weights (norms, biases, position embeddings) drift
  apart. So on fixture A/C's TP-rank-1 ranks the harness's saved generator state is 3 draws ahead
  of Megatron-LM's (3653 instead of 3650).
- Megatron-LM builds its data iterators *after* restoring the RNG state, so its resumed runs draw 3
  more times than the uninterrupted run did at that point and their dropout masks differ. The
  harness draws before a load, so a same-layout resume continues the uninterrupted streams exactly.
"""

from __future__ import annotations

import random

import numpy as np
import torch

# torch.compile'd bias-dropout-add: inductor draws one seed per call (torch._inductor.inductor_prims
# `inductor_seeds`); Megatron-LM's warm-up calls it 10 times (2 requires_grad settings x 5).
COMPILED_DROPOUT_CALLS = 10
# Megatron-LM's train, valid and test DataLoader iterators: one base-seed draw each.
DATA_LOADER_ITERATORS = 3


def stage_seed(seed: int, pp_rank: int) -> int:
    """Megatron-LM's _set_random_seed: a different seed per pipeline stage."""
    return seed + 100 * pp_rank


def seed_everything(seed: int, pp_rank: int) -> None:
    """python, numpy, torch and megatron-core's tracker streams, as Megatron-LM's _set_random_seed."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = stage_seed(seed, pp_rank)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def warmup_input_shapes(args, tp_size: int) -> list:
    """Shapes of the torch.rand inputs of Megatron-LM's _warmup_jit_function, in draw order."""
    ffn = args.ffn_hidden_size // tp_size
    seq = args.seq_length // tp_size if args.sequence_parallel else args.seq_length
    return [
        (ffn,),                                              # bias of bias_gelu / bias_swiglu
        (args.seq_length, args.micro_batch_size, ffn),       # its input
        (seq, args.micro_batch_size, args.hidden_size),      # bias-dropout-add input
        (seq, args.micro_batch_size, args.hidden_size),      # residual
        (args.hidden_size,),                                 # bias
    ]


def advance_like_megatron_lm_warmup(args, tp_size: int) -> None:
    """Draw from the default generator what Megatron-LM's start-up warm-up draws (see module doc)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    # On GPUs the warm-up draws from the CUDA generator (its inputs live there), on CPU from the
    # default one; only the CPU counts are measured against Megatron-LM.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for shape in warmup_input_shapes(args, tp_size):
        torch.rand(shape, dtype=dtype, device=device)
    for _ in range(COMPILED_DROPOUT_CALLS):
        torch.randint(2 ** 63 - 1, (1,), device=device)


def advance_like_megatron_lm_data_loaders(first_or_last_stage: bool) -> None:
    """Draw the base seeds of Megatron-LM's three DataLoader iterators on the stages that build them
    (every TP rank: see the module doc)."""
    if not first_or_last_stage:
        return
    for _ in range(DATA_LOADER_ITERATORS):
        torch.empty((), dtype=torch.int64).random_()
