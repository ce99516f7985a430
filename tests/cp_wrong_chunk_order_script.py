"""The entry point with a planted context-parallel bug, for tests/test_context_parallel.py's negative control: the
CPU core attention's all-gathered key/value chunks kept in rank order (rank 0's two chunks, then rank 1's, ...)
instead of sequence order, as a gather that forgot megatron-core's zig-zag split would leave them. Nothing else
differs from pretrain_scripts/pretrain_gpt.py.

    torchrun --nproc-per-node N tests/cp_wrong_chunk_order_script.py <the entry point's flags>
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ucp.megatron_lm import cpu_shims  # noqa: E402


def rank_order(cp: int) -> list:
    return [(rank, half) for rank in range(cp) for half in (0, 1)]


cpu_shims.cp_chunk_order = rank_order  # the gather looks it up at every call

from megatron_ucp.megatron_lm import pretrain_gpt  # noqa: E402

if __name__ == "__main__":
    pretrain_gpt.main()
