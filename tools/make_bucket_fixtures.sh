#!/usr/bin/env bash
# Trains the multi-bucket fixtures of tests/fixtures/megatron-core-0.19 (J19, K19) with Megatron-LM 0.19's own
# training loop through this project's entry point, on CPU: a smaller llama (2 layers, hidden 32, 4 heads, GQA 2
# groups, SwiGLU, RMSNorm, RoPE, untied, vocabulary 256: a checkpoint under 1 MB), TP1 DP2, the distributed optimizer with
# --overlap-grad-reduce and --ddp-bucket-size 3000 (several buckets in the one DDP buffer, each but the last
# with bucket-end padding), warmup + cosine decay, weight decay 0.1; 8 iterations, checkpoints at 4 and 8 (8 is
# removed), cmd.txt, train.log, losses.jsonl. J19 and K19 are the same deterministic run twice (their
# losses.jsonl are equal byte for byte, their saved model weights bit for bit: tests/test_bucket_shift.py checks
# both): J19 saves the optimizer state dp_reshardable (flat buckets: the truth), K19 fully_reshardable, which
# megatron-core 0.15-0.19 save shifted (docs/VERSIONS.md "Multi-bucket fully_reshardable").
#   tools/make_bucket_fixtures.sh OUT_DIR [J19 K19]
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?OUT_DIR}
shift
WHICH=${*:-J19 K19}
PY=${PYTHON:-$REPO/.venv/bin/python}

COMMON="--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 --lr-decay-style cosine
 --weight-decay 0.1 --train-iters 8 --save-interval 4 --seed 1234 --eval-iters 0 --eval-interval 1000
 --log-interval 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 256 --num-workers 0
 --attention-dropout 0.0 --hidden-dropout 0.0 --group-query-attention --num-query-groups 2 --swiglu
 --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear
 --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000
 --tensor-model-parallel-size 1 --ckpt-format torch_dist"

declare -A FLAGS NAME
FLAGS[J19]=""
FLAGS[K19]="--dist-ckpt-optim-fully-reshardable"
NAME[J19]=J19_llama_tp1dp2_buckets_distopt_torch_dist
NAME[K19]=K19_llama_tp1dp2_buckets_distopt_torch_dist_fullyresh

for f in $WHICH; do
  dir="$OUT/${NAME[$f]}"
  rm -rf "$dir" && mkdir -p "$dir"
  args="$(echo $COMMON ${FLAGS[$f]}) --save ckpt --log-jsonl losses.jsonl"
  echo "# this project's entry point (Megatron-LM 0.19's megatron.training.pretrain, megatron-core 0.19.2, CPU shims); cwd = this fixture dir" > "$dir/cmd.txt"
  echo "torchrun --nproc-per-node 2 pretrain_scripts/pretrain_gpt.py $args" >> "$dir/cmd.txt"
  (cd "$dir" && OMP_NUM_THREADS=1 nice "$PY" -m torch.distributed.run --nproc-per-node 2 \
     --master-port $((29500 + RANDOM % 1000)) "$REPO/pretrain_scripts/pretrain_gpt.py" $args > train.log 2>&1) \
     || { tail -30 "$dir/train.log"; exit 1; }
  rm -rf "$dir/ckpt/iter_0000008" && echo 4 > "$dir/ckpt/latest_checkpointed_iteration.txt"
  grep -o "iteration *[0-9]*/ *8 .*lm loss: [^|]*|" "$dir/train.log" | sed 's/consumed.*lm loss/lm loss/' | head -8
done
