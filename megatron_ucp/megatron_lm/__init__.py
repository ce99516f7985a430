"""Megatron-LM as the host: a GPT entry point on its own `megatron.training.pretrain` (megatron-core 0.19.2),
the `--universal-checkpoint` plugin and its loader, `--log-jsonl`, and the CPU patches (`cpu_shims`)."""
