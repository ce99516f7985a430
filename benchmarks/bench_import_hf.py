"""Memory and time of `megatron-ucp import-hf` on a ~1B-parameter Llama-3-shaped model (bf16, sharded safetensors +
index), against `cp -r` of the same folder.

Writes a model in Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 heads in 8 query groups, SwiGLU 8192,
vocabulary 128256, tied embeddings, Llama 3.1's RoPE scaling (llama3, factor 8: the one megatron-core computes):
1.24 B parameters, 2.47 GB in bf16) as safetensors shards and an index, one tensor at a time (random values; no
transformers needed) in a child process, then times `cp -r` of the folder and runs the CLI as a user does, reporting
its wall time and peak RSS (that child's own ru_maxrss from wait4: resident memory at its peak; this parent imports
no torch and holds no tensors, so the fork before exec adds nothing). Both read the folder just written (page cache
warm for both); import-hf publishes its output fsynced, so `cp -r` is timed also with its copy fsynced. The
output is fp32 (twice the bf16 input): writing and fsyncing that many random bytes on the same file system is
timed too (`write_floor_s`, the disk's floor), and the import's CPU time (user + sys) reported.

    .venv/bin/python benchmarks/bench_import_hf.py [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, LAYERS, HEADS, GROUPS, FFN, VOCAB = 2048, 16, 32, 8, 8192, 128256
REPO = Path(__file__).resolve().parents[1]


def llama_tensors():
    """(name, shape) of every tensor of the model, in HF's names."""
    head_dim = HIDDEN // HEADS
    yield "model.embed_tokens.weight", (VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (HIDDEN,)
        yield p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)
        yield p + "self_attn.k_proj.weight", (GROUPS * head_dim, HIDDEN)
        yield p + "self_attn.v_proj.weight", (GROUPS * head_dim, HIDDEN)
        yield p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)
        yield p + "post_attention_layernorm.weight", (HIDDEN,)
        yield p + "mlp.gate_proj.weight", (FFN, HIDDEN)
        yield p + "mlp.up_proj.weight", (FFN, HIDDEN)
        yield p + "mlp.down_proj.weight", (HIDDEN, FFN)
    yield "model.norm.weight", (HIDDEN,)  # tied: no lm_head.weight


def write_model(hf: Path, shard_bytes: int = 450 << 20) -> int:
    import torch
    from safetensors.torch import save_file

    hf.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shards, current, size, total = [], {}, 0, 0
    for name, shape in llama_tensors():
        current[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += current[name].numel() * 2
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
            save_file(shards[-1], str(hf / f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            total += sum(t.numel() * 2 for t in shards[-1].values())
            shards[-1] = list(shards[-1])  # keep names only
    if current:
        shards.append(current)
        save_file(current, str(hf / f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in current.values())
        shards[-1] = list(current)
    weight_map = {name: f"model-{i + 1:05d}.safetensors" for i, names in enumerate(shards) for name in names}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                 "weight_map": weight_map}))
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    return total


def write_floor(path: Path, nbytes: int) -> float:
    """Seconds to write and fsync `nbytes` of random data to `path` (the output's size on the same file system:
    the disk's share of the import's time), in 64 MiB writes."""
    block = os.urandom(64 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for done in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - done)])
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--write-model", help=argparse.SUPPRESS)  # the child that writes the model
    args = parser.parse_args()
    if args.write_model:
        print(write_model(Path(args.write_model)))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_import_hf_"))
    try:
        total = int(subprocess.run([sys.executable, __file__, "--write-model", str(work / "hf")], check=True,
                                   capture_output=True, text=True).stdout)
        start = time.perf_counter()
        subprocess.run(["cp", "-r", str(work / "hf"), str(work / "hf_copy")], check=True)
        cp_wall = time.perf_counter() - start
        for f in (work / "hf_copy").iterdir():  # import-hf publishes fsynced: the copy's bytes on disk too
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        cp_sync_wall = time.perf_counter() - start
        shutil.rmtree(work / "hf_copy")
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "megatron_ucp.cli", "import-hf", str(work / "hf"),
                                 str(work / "ucp"), "--quiet", "--json"], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        stdout, stderr = proc.stdout.read(), proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if status:
            sys.exit(stderr)
        peak = usage.ru_maxrss * 1024
        out = sum(f.stat().st_size for f in (work / "ucp").rglob("*") if f.is_file())
        floor = write_floor(work / "floor.bin", out)
        result = {"hf_bytes": total, "ucp_bytes": out, "wall_s": round(wall, 2), "cp_r_wall_s": round(cp_wall, 2),
                  "cp_r_fsync_wall_s": round(cp_sync_wall, 2), "wall_vs_cp_r_fsync": round(wall / cp_sync_wall, 2),
                  "write_floor_s": round(floor, 2), "wall_vs_write_floor": round(wall / floor, 2),
                  "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "peak_rss_bytes": peak,
                  "peak_rss_gib": round(peak / 2 ** 30, 3), "elements": json.loads(stdout)["elements"]}
        print(json.dumps(result, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
