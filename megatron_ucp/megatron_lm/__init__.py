"""Megatron-LM 0.19 as the host: a GPT entry point on its own `megatron.training.pretrain` and the CPU
patches that megatron-core 0.19 needs (`cpu_shims`). megatron-core 0.19.2 is installed beside the
project's 0.16.1 (`make install`: .venv/megatron-core-0.19); `launch.pythonpath()` puts it first."""
