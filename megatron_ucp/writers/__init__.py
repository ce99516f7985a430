"""Writers of Megatron checkpoints from a universal checkpoint, at any layout (`from-universal`).

- `legacy`: Megatron-LM's `torch` format (model_optim_rng.pt [+ distrib_optim.pt] per (tp, pp) rank),
  written offline, one rank's shard in memory at a time;
- `torch_dist`: megatron-core `torch_dist`, written by launching the training harness at the target
  layout (it loads the universal checkpoint and saves exactly as Megatron-LM does).

Both write into a staging directory that `megatron_ucp.from_universal` moves into place.
"""
