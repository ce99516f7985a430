#!/usr/bin/env python
"""GPT pretraining on Megatron-LM's own training loop (megatron-core 0.19.2), plus --universal-checkpoint.

    torchrun --nproc-per-node 4 pretrain_scripts/pretrain_gpt.py <Megatron-LM flags> \
        --load UNIVERSAL_CKPT --universal-checkpoint

The providers (model, forward step, datasets) are in megatron_ucp/megatron_lm/pretrain_gpt.py; on CPU its
cpu_shims patch megatron-core and add the CPU flags (gloo, local layers, no fused CUDA kernels).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ucp.megatron_lm.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    main()
