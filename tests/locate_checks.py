"""Shared check: a reader's locate() agrees with its read()."""

import torch

from megatron_ucp.byteio import FileHandles, StoredTensor, read_stored


def assert_locate_equals_read(ckpt, where: str) -> int:
    """Every shard: locate() covers read()'s keys and its StoredTensors read back bitwise equal."""
    n = 0
    with FileHandles() as files:
        for ref in ckpt.shards():
            full = ckpt.read(ref)
            located = ckpt.locate(ref)
            assert located is not None, f"{where} {ref}: not locatable"
            assert set(located) == set(full), (ref, sorted(located), sorted(full))
            for key, value in located.items():
                got = value if key == "step" else read_stored(files, value)
                if key != "step":
                    assert isinstance(value, StoredTensor)
                assert got.dtype == full[key].dtype and got.shape == full[key].shape, (where, ref, key)
                assert torch.equal(got, full[key]), f"{where} {ref.local_name} tp={ref.tp_rank} pp={ref.pp_rank}: {key}"
                n += 1
    return n
