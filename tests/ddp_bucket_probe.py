"""Under torchrun: build the model at Megatron-LM 0.19's flags the way Megatron-LM does (its arguments,
initialize_megatron and get_model, which wraps each chunk in megatron-core's DDP) and write, per rank, the live
DDP buffer layout next to what megatron_ucp/formats/bucket_layout.py predicts from args alone.

    torchrun --nproc-per-node N tests/ddp_bucket_probe.py OUT_DIR <Megatron-LM flags>

OUT_DIR/rank{R}.json = {"pp_rank", "tp_rank", "chunks": [{"live": [buffer...], "predicted": [buffer...]}]},
buffer = {"dtypes", "params": [[name, start, end, bucket]...], "buckets": [[start, end, numel_unpadded]...]}.
The prediction uses what a converter knows: args, and each chunk's parameter names, shapes and
dtypes in registration order (the checkpoint's state dict); nothing from the live buffers.
The model provider is tests/mcore_gpt.build_gpt (the entry point's GPTModel); CPU flags are added here.
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))

from megatron_ucp.megatron_lm import cpu_shims  # noqa: E402

cpu_shims.install_import_patches()  # Python 3.11 and no triton: before megatron is imported

import torch  # noqa: E402

from megatron_ucp.formats.bucket_layout import (BufferParam, DDPBucketConfig, build_chunk_buffers,  # noqa: E402
                                                shared_embedding_names)
from megatron_ucp.formats.common import layout_from_args  # noqa: E402


def live_buffers(chunk, names):
    out = []
    for buffer in chunk.buffers:
        params = sorted(([names[p], *buffer.param_index_map[p]] for p in buffer.params), key=lambda r: r[1])
        buckets = [[*buffer.bucket_indices[b.bucket_id], b.numel_unpadded] for b in buffer.buckets]
        out.append({"dtypes": [str(buffer.param_dtype), str(buffer.grad_dtype)], "params": params,
                    "buckets": buckets})
    return out


def predicted_buffers(args, pp_rank, vpp_chunk, params, rank_num_parameters):
    layout = layout_from_args(vars(args))
    config = DDPBucketConfig.from_megatron_args(vars(args), layout, pp_rank=pp_rank, vpp_chunk=vpp_chunk,
                                                rank_num_parameters=rank_num_parameters)
    shared = shared_embedding_names(vars(args), layout, pp_rank=pp_rank, vpp_chunk=vpp_chunk,
                                    names=[n for n, _ in params])
    buffer_params = [BufferParam(n, tuple(p.shape), p.dtype, shared_embedding=n in shared) for n, p in params]
    return [{"dtypes": [str(b.param_dtype), str(b.grad_dtype)],
             "params": [[s.name, s.start, s.end, s.bucket] for s in b.params],
             "buckets": [[k.start, k.end, k.numel_unpadded] for k in b.buckets]}
            for b in build_chunk_buffers(buffer_params, config)]


def main():
    from megatron.core import mpu
    from megatron.core.enums import ModelType
    from megatron.core.utils import unwrap_model
    from megatron.training import get_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model

    from mcore_gpt import CPU_FLAGS, build_gpt
    from megatron_ucp.megatron_lm import universal_plugin

    out_dir = Path(sys.argv[1])
    sys.argv = [sys.argv[0], *sys.argv[2:], *CPU_FLAGS, "--distributed-backend", "gloo"]
    cpu_shims.install()  # before the arguments: validate_args asks for the GPU architecture
    parse_and_validate_args(extra_args_provider=universal_plugin.add_arguments)
    initialize_megatron()
    args = get_args()
    model = get_model(lambda *a, **k: build_gpt(args, *a, **k), ModelType.encoder_or_decoder)
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    chunk_params = [[(n, p) for n, p in unwrap_model(c).named_parameters() if p.requires_grad] for c in model]
    rank_num_parameters = sum(p.numel() for params in chunk_params for _, p in params)
    report = {"pp_rank": pp_rank, "tp_rank": mpu.get_tensor_model_parallel_rank(), "chunks": []}
    for vpp_chunk, (chunk, params) in enumerate(zip(model, chunk_params)):
        names = {p: n for n, p in params}
        report["chunks"].append({"live": live_buffers(chunk, names),
                                 "predicted": predicted_buffers(args, pp_rank, vpp_chunk, params,
                                                                rank_num_parameters)})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
