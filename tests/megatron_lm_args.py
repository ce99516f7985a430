"""Megatron-LM 0.19's own arguments for in-process tests: its parser (plus the --universal-checkpoint plugin's
flags) and its validate_args, without initializing anything.

`megatron_lm_args(flags, world_size=N)` is what `pretrain()` would see on a rank of an N-process run: the
derived fields (ffn_hidden_size, kv_channels, num_query_groups, data_parallel_size, ...) filled by Megatron-LM
itself. With TP > 1 validate_args asks the GPU architecture and CUDA_DEVICE_MAX_CONNECTIONS=1; both are answered
as a run gets them (cpu_shims: Hopper; launch.environment: 1) for the call only, so the test process's torch
and environment stay as they were.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Sequence
from unittest import mock

from megatron_ucp.megatron_lm import cpu_shims

cpu_shims.install_import_patches()  # Python 3.11 and no triton: before megatron is imported


def megatron_lm_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from megatron_ucp.megatron_lm import universal_plugin

    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    return universal_plugin.add_arguments(add_megatron_arguments(parser))


def megatron_lm_args(flags: Sequence[str], *, world_size: int = 1, rank: int = 0) -> argparse.Namespace:
    from megatron.training import arguments

    args = megatron_lm_parser().parse_args([str(f) for f in flags])
    args._is_global_batch_size_explicitly_specified = args.global_batch_size is not None  # as parse_args sets it
    args.rank, args.world_size = rank, world_size
    with contextlib.redirect_stdout(None), mock.patch.object(arguments, "get_device_arch_version", lambda: 9), \
            mock.patch.dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1"):
        arguments.validate_args(args)  # prints every argument on rank 0: kept out of the test output
    return args
