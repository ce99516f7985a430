"""GPT pretraining on Megatron-LM 0.19's own loop (megatron-core 0.19.2); see megatron_ucp/megatron_lm/pretrain_gpt.py.

    PYTHONPATH=.venv/megatron-core-0.19 torchrun --nproc-per-node 4 pretrain_scripts/pretrain_gpt_mcore019.py <Megatron-LM flags>
"""

from megatron_ucp.megatron_lm.pretrain_gpt import main

if __name__ == "__main__":
    main()
