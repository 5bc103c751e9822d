#!/usr/bin/env bash
# The causal d = 64 forward past the short calls on three consumers in round robin (dynamic
# schedule; it was the two-consumer ping-pong tile): the Hopper forward's GPU tests (long
# sequences with causal, windows and softcap, many tiles per CTA, longest-first sections, packed
# sequences), racecheck over one such call, then the tree before (.ab/a51cd17) and this one, each
# in its own process beside cuDNN in rotating rounds: the forward (predicted +5-12% at N = 16k
# causal, +3-5% at 4k, N = 1k unchanged: the short-call tile) and a training step.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_fwd64_causal.sh [SECONDS]
#   carry: .whl .ab/a51cd17
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT 200 python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_fa2.py tests/test_varlen.py tests/test_gpu_batch_invariant.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
timeout 60 compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_fwd64.py > $OUT/racecheck_fwd64.log 2>&1
echo "racecheck rc=$? at ${SECONDS}s"; grep -E "SUMMARY|^finite" $OUT/racecheck_fwd64.log | head -3
timeout $(( $(left) * 3 / 5 )) python3 scripts/ab.py prefill .ab/a51cd17 . --rounds 3 \
  --shapes bf16-64-1024-1 bf16-64-4096-1 bf16-64-16384-1 fp16-64-16384-1 > $OUT/ab_prefill.log 2>&1
echo "ab prefill rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/ab_prefill.log | tail -12 | cut -c1-300
[ "$(left)" -gt 60 ] && timeout $(( $(left) - 5 )) python3 scripts/ab.py train .ab/a51cd17 . --rounds 3 \
  --shapes bf16-64-4096-1 bf16-64-16384-1 > $OUT/ab_train.log 2>&1
echo "ab train rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/ab_train.log | tail -10 | cut -c1-300
