#!/usr/bin/env bash
# Trains the optimizer fixtures of tests/fixtures/megatron-core-0.19 (SGA19-MUC19: optimizers other than Adam,
# issue 40) with Megatron-LM 0.19's own training loop through this project's entry point, on CPU, fp32 (MUB19 bf16). The small
# llama of tools/make_bucket_fixtures.sh (2 layers, hidden 32, 4 heads, GQA 2 groups, SwiGLU, RMSNorm, RoPE,
# untied, no bias, vocabulary 256: checkpoints under 1 MB), warmup + cosine decay, weight decay 0.1; 8 iterations,
# checkpoints at 4 and 8 (8 is removed: resumes start at 4 and are compared with iterations 5-8 of the run's own
# --log-jsonl), cmd.txt, train.log, losses.jsonl.
#   SGA19/SGB19: SGD momentum 0.9 (no distributed optimizer: megatron-core 0.19's DistributedOptimizer needs an
#                init_state_fn, SGD has none), TP2 PP2, torch_dist / legacy torch
#   LIA19:       Lion (emerging-optimizers) without the distributed optimizer, fp32, TP2 DP2, torch_dist
#   MUA19:       Muon (blockwise TP mode, the default; Adam for the non-matrix parameters) without the distributed
#                optimizer, fp32, TP2 DP2, torch_dist
#   MUB19:       MUA19's run under the layer-wise distributed optimizer (--use-distributed-optimizer turns into it
#                for every optimizer but adam/sgd), bf16 (megatron-core 0.19.2 cannot build it in fp32: its
#                LayerWiseDistributedOptimizer over raw torch optimizers has config None and the
#                ChainedOptimizer([LayerWise, DistOpt]) of the default layer-wise param layout asserts equal configs,
#                optimizer.py:1440), TP2 DP2, torch_dist
#   MUC19:       MUA19's run saved in legacy torch
#   MUD19:       MUB19's run (layer-wise distributed optimizer, bf16) at TP1 PP2 DP2
#   LIB19:       LIA19's run under the layer-wise distributed optimizer, bf16, TP2 DP2
#   MUE19:       MUA19's run with an MoE layer (layer 1: 4 experts top-2, a shared expert; EP1, so the experts share
#                the dense optimizers: with experts in their own, megatron-core chains four), TP1 DP2, torch_dist
# (MUB19's run with --muon-scalar-optimizer lion cannot be made: megatron-core 0.19.2's DistributedOptimizer save of
#  the Lion scalars reads Adam's per-parameter 'step', KeyError at the first save)
# cpu_shims stands in for emerging-optimizers' triton kernels on CPU.
#   tools/make_optim_fixtures.sh OUT_DIR [SGA19 SGB19 LIA19 MUA19 MUB19 MUC19 MUD19 LIB19 MUE19]
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?OUT_DIR}
shift
WHICH=${*:-SGA19 SGB19 LIA19 MUA19 MUB19 MUC19 MUD19 LIB19 MUE19}
PY=${PYTHON:-$REPO/.venv/bin/python}

COMMON="--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 --lr-decay-style cosine
 --weight-decay 0.1 --train-iters 8 --save-interval 4 --seed 1234 --eval-iters 0 --eval-interval 1000
 --log-interval 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 256 --num-workers 0
 --attention-dropout 0.0 --hidden-dropout 0.0 --group-query-attention --num-query-groups 2 --swiglu
 --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear"
SGD="--optimizer sgd --sgd-momentum 0.9 --lr 1e-2 --min-lr 1e-3"
MUON="--optimizer muon --muon-scalar-optimizer adam"

declare -A FLAGS NPROC NAME
FLAGS[SGA19]="$SGD --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --ckpt-format torch_dist"
FLAGS[SGB19]="$SGD --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --ckpt-format torch"
FLAGS[LIA19]="--optimizer lion --lr 1e-4 --min-lr 1e-5 --tensor-model-parallel-size 2 --ckpt-format torch_dist"
FLAGS[MUA19]="$MUON --tensor-model-parallel-size 2 --ckpt-format torch_dist"
FLAGS[MUC19]="$MUON --tensor-model-parallel-size 2 --ckpt-format torch"
FLAGS[MUB19]="$MUON --use-distributed-optimizer --bf16 --tensor-model-parallel-size 2 --ckpt-format torch_dist"
FLAGS[MUD19]="$MUON --use-distributed-optimizer --bf16 --pipeline-model-parallel-size 2 --ckpt-format torch_dist"
FLAGS[LIB19]="--optimizer lion --lr 1e-4 --min-lr 1e-5 --use-distributed-optimizer --bf16 --tensor-model-parallel-size 2 --ckpt-format torch_dist"
FLAGS[MUE19]="$MUON --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq [0,1] --moe-aux-loss-coeff 1e-2 --moe-shared-expert-intermediate-size 32 --moe-token-dispatcher-type alltoall --ckpt-format torch_dist"
NPROC[SGA19]=4; NPROC[MUD19]=4; NPROC[LIB19]=4; NPROC[MUE19]=2; NPROC[SGB19]=4; NPROC[LIA19]=4; NPROC[MUA19]=4; NPROC[MUB19]=4; NPROC[MUC19]=4
NAME[SGA19]=SGA19_llama_tp2pp2dp1_sgd_torch_dist
NAME[SGB19]=SGB19_llama_tp2pp2dp1_sgd_torch
NAME[LIA19]=LIA19_llama_tp2dp2_lion_torch_dist
NAME[MUA19]=MUA19_llama_tp2dp2_muon_torch_dist
NAME[MUB19]=MUB19_llama_tp2dp2_muon_layerwise_bf16_torch_dist
NAME[MUC19]=MUC19_llama_tp2dp2_muon_torch
NAME[MUD19]=MUD19_llama_tp1pp2dp2_muon_layerwise_bf16_torch_dist
NAME[LIB19]=LIB19_llama_tp2dp2_lion_layerwise_bf16_torch_dist
NAME[MUE19]=MUE19_moe_tp1dp2_muon_torch_dist

for f in $WHICH; do
  dir="$OUT/${NAME[$f]}"
  rm -rf "$dir" && mkdir -p "$dir"
  args="$(echo $COMMON ${FLAGS[$f]}) --save ckpt --log-jsonl losses.jsonl"
  echo "# this project's entry point (Megatron-LM 0.19's megatron.training.pretrain, megatron-core 0.19.2, emerging-optimizers 0.3.0, CPU shims); cwd = this fixture dir" > "$dir/cmd.txt"
  echo "torchrun --nproc-per-node ${NPROC[$f]} pretrain_scripts/pretrain_gpt.py $args" >> "$dir/cmd.txt"
  (cd "$dir" && OMP_NUM_THREADS=1 nice "$PY" -m torch.distributed.run --nproc-per-node "${NPROC[$f]}" \
     --master-port $((29500 + RANDOM % 1000)) "$REPO/pretrain_scripts/pretrain_gpt.py" $args > train.log 2>&1) \
     || { tail -30 "$dir/train.log"; exit 1; }
  rm -rf "$dir/ckpt/iter_0000008" && echo 4 > "$dir/ckpt/latest_checkpointed_iteration.txt"
  grep -o "iteration *[0-9]*/ *8 .*lm loss: [^|]*|" "$dir/train.log" | sed 's/consumed.*lm loss/lm loss/' | head -8
done
