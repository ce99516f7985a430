"""megatron-ucp: Universal Checkpointing for megatron-core GPT training."""

__version__ = "0.1.0"
