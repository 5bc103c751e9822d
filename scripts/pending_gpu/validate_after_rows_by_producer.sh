#!/usr/bin/env bash
# What the session that turned the Hopper backward's producer-copied rows on left for a GPU
# (docs/evidence/2026-12-07-h100-session-17/), in one call: the score-function backward's suites
# with the producer's rows (validate_score_fn_backward.sh: then the exception in
# _dispatch.fa3_bwd_spec goes); the decoupled consumers under the causal mask, now beside the
# producer's rows (one meeting a step and dS^T two-deep, FlashAttention-3's causal d = 128
# arrangement; offline the step loop 515 -> 445 instructions at d = 128, 747 -> 684 at d = 64,
# no spill; predicted 0-5%, the non-causal 80-row steps measured no gain); the built-in ALiBi's
# forward against 1e59e7b (builtin_score_tiles.py under both trees; predicted 3-8%).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_after_rows_by_producer.sh [SECONDS]
#   carry: .whl .ab/1e59e7b
set -uo pipefail
END=${1:-540}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
bash scripts/pending_gpu/validate_score_fn_backward.sh $(( END * 35 / 100 )) "backward or autograd or learned"
budget=$(( ($(left) - 10) * 6 / 10 ))
[ "$budget" -gt 40 ] && timeout $budget python3 scripts/tune.py hopper-bwd --switch decoupled \
  --head-dims 128 64 --seqlens 4096 16384 --causal-only --json $OUT/tune_decoupled_causal.json > $OUT/tune_decoupled_causal.log 2>&1
echo "tune decoupled (causal) rc=$? at ${SECONDS}s"; grep '"head_dim"' $OUT/tune_decoupled_causal.log | cut -c1-300
for tree in .ab/1e59e7b .; do
  share=2; [ $tree = . ] && share=1  # (the tree before takes half of what is left)
  budget=$(( ($(left) - 5) / share ))
  [ "$budget" -gt 30 ] && PYTHONPATH=$tree:/tmp/site timeout $budget python3 scripts/pending_gpu/builtin_score_tiles.py \
    --rounds 2 > $OUT/builtin_$(basename $(realpath $tree)).log 2>&1
  echo "builtin score tiles ($tree) rc=$? at ${SECONDS}s"; cut -c1-240 $OUT/builtin_$(basename $(realpath $tree)).log | tail -6
done
