#!/usr/bin/env bash
# Trains the multi-latent attention / multi-token prediction fixtures of tests/fixtures/megatron-core-0.19
# (F19, G19, H19, I19) with Megatron-LM 0.19's own training loop through this project's entry point, on CPU.
# Hidden size 64: megatron-core 0.19.2's dp_reshardable save fails when a bucket's shared-embedding parameter (the
# MTP stage's copy of the word embeddings) follows a parameter that does not end on a 64-element boundary
# (DistributedOptimizer._compute_per_buffer_param_layout closes the bucket at the padded start); with every
# parameter a multiple of 64 elements the save works (hidden 48 at TP2 PP2 fails: docs/VERSIONS.md).
# Warmup + cosine decay and weight decay 0.1 (on Megatron's decay group only): a wrong scheduler position or
# param-group mapping after a resume moves the loss. Each run: 8 iterations, checkpoints at 4 and 8 (iteration 8 is removed: resumes start at 4 and are compared
# with iterations 5-8 of the run's own --log-jsonl), cmd.txt, train.log, losses.jsonl.
#   tools/make_mla_mtp_fixtures.sh OUT_DIR [F19 G19 H19 I19]
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?OUT_DIR}
shift
WHICH=${*:-F19 G19 H19 I19}
PY=${PYTHON:-$REPO/.venv/bin/python}

COMMON="--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 --lr-decay-style cosine
 --weight-decay 0.1 --train-iters 8
 --save-interval 4 --seed 1234 --eval-iters 0 --eval-interval 1000 --log-interval 1 --mock-data
 --tokenizer-type NullTokenizer --vocab-size 1000 --num-workers 0 --attention-dropout 0.0 --hidden-dropout 0.0
 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --use-distributed-optimizer
 --multi-latent-attention --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
 --mtp-num-layers 1"
# DeepSeek-V3-shaped MoE: the first layer dense, 4 routed experts top-2 with a sigmoid router and its expert bias,
# one shared expert
MOE="--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq [0,1,1,1]
 --moe-shared-expert-intermediate-size 32 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
 --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2"
TP2PP2EP2="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2
 --expert-tensor-parallel-size 1 --sequence-parallel --untie-embeddings-and-output-weights --q-lora-rank 32
 --qk-layernorm"

declare -A FLAGS NPROC
FLAGS[F19]="$MOE $TP2PP2EP2 --ckpt-format torch_dist"
FLAGS[G19]="$MOE $TP2PP2EP2 --ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable"
# legacy at ETP = TP (megatron-ucp's legacy reader refuses ETP != TP: Megatron-LM's legacy save loses ranks' files
# there), hence DP2: 8 processes; the allgather dispatcher (gloo's all-gather of the alltoall dispatcher's uneven
# expert-TP splits fails at ETP2)
FLAGS[H19]="${MOE/alltoall/allgather} ${TP2PP2EP2/--expert-tensor-parallel-size 1/--expert-tensor-parallel-size 2}
 --ckpt-format torch"
# dense, no query compression (linear_q_proj), tied embeddings (MTP and tied embeddings train at PP1 only); no
# --qk-layernorm: megatron-core's local spec has no query norm without --q-lora-rank and refuses the flag
FLAGS[I19]="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel --ckpt-format torch_dist"
NPROC[F19]=4; NPROC[G19]=4; NPROC[H19]=8; NPROC[I19]=4
declare -A NAME
NAME[F19]=F19_mla_moe_mtp_tp2pp2ep2_distopt_sp_torch_dist
NAME[G19]=G19_mla_moe_mtp_tp2pp2ep2_distopt_sp_torch_dist_fullyresh
NAME[H19]=H19_mla_moe_mtp_tp2pp2dp2ep2etp2_distopt_sp_torch
NAME[I19]=I19_mla_noqlora_mtp_tied_tp2pp1dp2_distopt_sp_torch_dist

for f in $WHICH; do
  dir="$OUT/${NAME[$f]}"
  rm -rf "$dir" && mkdir -p "$dir"
  args="$(echo $COMMON ${FLAGS[$f]}) --save ckpt --log-jsonl losses.jsonl"
  echo "# this project's entry point (Megatron-LM 0.19's megatron.training.pretrain, megatron-core 0.19.2, CPU shims); cwd = this fixture dir" > "$dir/cmd.txt"
  echo "torchrun --nproc-per-node ${NPROC[$f]} pretrain_scripts/pretrain_gpt.py $args" >> "$dir/cmd.txt"
  (cd "$dir" && "$PY" -m torch.distributed.run --nproc-per-node "${NPROC[$f]}" --master-port $((29500 + RANDOM % 1000)) \
     "$REPO/pretrain_scripts/pretrain_gpt.py" $args > train.log 2>&1) || { tail -30 "$dir/train.log"; exit 1; }
  rm -rf "$dir/ckpt/iter_0000008" && echo 4 > "$dir/ckpt/latest_checkpointed_iteration.txt"
  grep -o "iteration *[0-9]*/ *8 .*lm loss: [^|]*|[^|]*|[^|]*|" "$dir/train.log" | cut -c1-20,100- | head -8
done
