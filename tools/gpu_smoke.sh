#!/usr/bin/env bash
# GPU smoke test: NCCL + TransformerEngine layer spec, TP1PP1 and TP2, then universal round trips
# (train at TP2 saving at 4 -> to-universal -> resume at TP1 to 8), the same in bf16, and a GPT-MoE run
# at EP2 resumed at EP1 through a universal checkpoint. Prints each run's loss lines and the differences.
# Run on a CUDA machine with >= 2 GPUs (TransformerEngine installed for the TE spec; otherwise the
# local spec is used and the script says so):   bash tools/gpu_smoke.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/megatron-ucp-gpu-smoke}
PY=${PYTHON:-python}
rm -rf "$OUT"; mkdir -p "$OUT"

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_smoke: CUDA is not available; nothing to do"; exit 2
fi
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
IMPL=local
if $PY -c "import transformer_engine" 2>/dev/null; then IMPL=transformer_engine; fi
echo "gpu_smoke: $NGPU GPU(s), --transformer-impl $IMPL, torch $($PY -c 'import torch; print(torch.__version__)')"

MODEL="--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4
 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
 --disable-bias-linear --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --lr 1e-3 --min-lr 1e-3
 --lr-decay-style constant --attention-dropout 0.0 --hidden-dropout 0.0 --mock-data --tokenizer-type NullTokenizer
 --vocab-size 1000 --log-interval 1 --use-distributed-optimizer --transformer-impl $IMPL --eval-iters 0
 --eval-interval 1000 --max-position-embeddings 128"

run() {  # nproc name extra...
  local n=$1 name=$2; shift 2
  echo "== $name (nproc $n)"
  timeout 600 $PY -m torch.distributed.run --standalone --nproc-per-node "$n" pretrain_scripts/pretrain_gpt.py \
    $MODEL --log-jsonl "$OUT/$name.jsonl" "$@" 2>&1 | tee "$OUT/$name.log" | grep -E " iteration |error|loaded" || true
  test -s "$OUT/$name.jsonl" || { echo "gpu_smoke: $name produced no losses; see $OUT/$name.log"; exit 1; }
}

run 1 tp1pp1 --train-iters 5
if [ "$NGPU" -ge 2 ]; then
  run 2 tp2 --tensor-model-parallel-size 2 --sequence-parallel --train-iters 8 --save "$OUT/ckpt" --save-interval 4
  $PY -m megatron_ucp.cli to-universal "$OUT/ckpt" "$OUT/ucp" --iteration 4
  run 1 tp1_from_ucp --train-iters 8 --load "$OUT/ucp" --universal-checkpoint
  run 2 tp2_bf16 --tensor-model-parallel-size 2 --sequence-parallel --bf16 --train-iters 8 --save "$OUT/ckpt_bf16" --save-interval 4
  $PY -m megatron_ucp.cli to-universal "$OUT/ckpt_bf16" "$OUT/ucp_bf16" --iteration 4
  run 1 tp1_bf16_from_ucp --bf16 --train-iters 8 --load "$OUT/ucp_bf16" --universal-checkpoint
  MOE="--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-layer-freq [0,1,0,1]
   --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall"
  run 2 moe_ep2 $MOE --expert-model-parallel-size 2 --train-iters 8 --save "$OUT/ckpt_moe" --save-interval 4
  $PY -m megatron_ucp.cli to-universal "$OUT/ckpt_moe" "$OUT/ucp_moe" --iteration 4
  run 1 moe_ep1_from_ucp $MOE --train-iters 8 --load "$OUT/ucp_moe" --universal-checkpoint
  $PY - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
read = lambda n: {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(f"{out}/{n}.jsonl"))}
diff = lambda x, y, its: max(abs(x[i] - y[i]) / y[i] for i in its)
a, b, c = read("tp1pp1"), read("tp2"), read("tp1_from_ucp")
print("layouts agree (it 1-5):", diff(a, b, range(1, 6)))
print("resume TP2 -> TP1 (it 5-8):", diff(c, b, range(5, 9)))
print("bf16 resume TP2 -> TP1 (it 5-8):", diff(read("tp1_bf16_from_ucp"), read("tp2_bf16"), range(5, 9)))
print("MoE resume EP2 -> EP1 (it 5-8):", diff(read("moe_ep1_from_ucp"), read("moe_ep2"), range(5, 9)))
EOF
fi
echo "gpu_smoke: done ($OUT)"
