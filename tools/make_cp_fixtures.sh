#!/usr/bin/env bash
# Trains the context-parallel fixtures of tests/fixtures/megatron-core-0.19 (CPA19-CPD19) with Megatron-LM 0.19's
# own training loop through this project's entry point, on CPU (cpu_shims' local core attention for CP: keys and
# values all-gathered over the CP group; GPU numerics untouched). The llama family of tests/pretrain_runs.py (4
# layers, hidden 48, GQA 2 groups, SwiGLU, RMSNorm, RoPE, untied) and its MoE variant (MoE layers 1 and 3, 4
# experts top-2, a shared expert); sequence 32, divisible by 2*CP for CP 1, 2 and 4 (the resumes' targets).
# Warmup + cosine decay and weight decay 0.1; 8 iterations, checkpoints at 4 and 8 (iteration 8 is removed: resumes
# start at 4 and are compared with iterations 5-8 of the run's own --log-jsonl), cmd.txt, train.log, losses.jsonl.
#   tools/make_cp_fixtures.sh OUT_DIR [CPA19 CPB19 CPC19 CPD19]
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?OUT_DIR}
shift
WHICH=${*:-CPA19 CPB19 CPC19 CPD19}
PY=${PYTHON:-$REPO/.venv/bin/python}

COMMON="--num-layers 4 --hidden-size 48 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 --lr-decay-style cosine
 --weight-decay 0.1 --train-iters 8 --save-interval 4 --seed 1234 --eval-iters 0 --eval-interval 1000
 --log-interval 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --num-workers 0
 --attention-dropout 0.0 --hidden-dropout 0.0 --group-query-attention --num-query-groups 2 --swiglu
 --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear
 --use-distributed-optimizer"
MOE="--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq [0,1,0,1]
 --moe-aux-loss-coeff 1e-2 --moe-shared-expert-intermediate-size 32 --moe-token-dispatcher-type alltoall"

declare -A FLAGS NPROC NAME
FLAGS[CPA19]="--tensor-model-parallel-size 1 --context-parallel-size 2 --ckpt-format torch_dist"
FLAGS[CPB19]="--tensor-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel --ckpt-format torch"
FLAGS[CPC19]="$MOE --context-parallel-size 2 --expert-model-parallel-size 2 --ckpt-format torch_dist"
# EP carved out of the CP ranks alone (DP1): the expert parallel group spans the two CP ranks
FLAGS[CPD19]="$MOE --context-parallel-size 2 --expert-model-parallel-size 2 --ckpt-format torch_dist
 --dist-ckpt-optim-fully-reshardable"
NPROC[CPA19]=4; NPROC[CPB19]=4; NPROC[CPC19]=4; NPROC[CPD19]=2
NAME[CPA19]=CPA19_llama_tp1cp2dp2_distopt_torch_dist
NAME[CPB19]=CPB19_llama_tp2cp2dp1_distopt_sp_torch
NAME[CPC19]=CPC19_moe_tp1cp2dp2ep2_distopt_torch_dist
NAME[CPD19]=CPD19_moe_tp1cp2dp1ep2_distopt_torch_dist_fullyresh

for f in $WHICH; do
  dir="$OUT/${NAME[$f]}"
  rm -rf "$dir" && mkdir -p "$dir"
  args="$(echo $COMMON ${FLAGS[$f]}) --save ckpt --log-jsonl losses.jsonl"
  echo "# this project's entry point (Megatron-LM 0.19's megatron.training.pretrain, megatron-core 0.19.2, CPU shims); cwd = this fixture dir" > "$dir/cmd.txt"
  echo "torchrun --nproc-per-node ${NPROC[$f]} pretrain_scripts/pretrain_gpt.py $args" >> "$dir/cmd.txt"
  (cd "$dir" && OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --nproc-per-node "${NPROC[$f]}" \
     --master-port $((29500 + RANDOM % 1000)) "$REPO/pretrain_scripts/pretrain_gpt.py" $args > train.log 2>&1) \
     || { tail -30 "$dir/train.log"; exit 1; }
  rm -rf "$dir/ckpt/iter_0000008" && echo 4 > "$dir/ckpt/latest_checkpointed_iteration.txt"
  grep -o "iteration *[0-9]*/ *8 .*lm loss: [^|]*|" "$dir/train.log" | sed 's/consumed.*lm loss/lm loss/' | head -8
done
