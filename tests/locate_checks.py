"""Shared check: a reader's locate() agrees with its read()."""

import torch

from megatron_ucp.io.byteio import FileHandles, StoredTensor, read_stored


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
                if key == "step":  # locate() gives the number, read() a 0-d float32 tensor
                    assert isinstance(value, float) and value == float(full[key]), (where, ref, value, full[key])
                    n += 1
                    continue
                assert isinstance(value, StoredTensor)
                got = read_stored(files, value)
                assert got.dtype == full[key].dtype and got.shape == full[key].shape, (where, ref, key)
                assert torch.equal(got, full[key]), f"{where} {ref.local_name} tp={ref.tp_rank} pp={ref.pp_rank}: {key}"
                n += 1
    return n
