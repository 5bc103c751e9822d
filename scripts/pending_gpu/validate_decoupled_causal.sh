#!/usr/bin/env bash
# The Hopper backward's decoupled consumers (Fa3BwdSpec.decoupled: they meet once a step, dS^T
# in two buffers) under the causal mask at d = 128, beside the producer's rows, in one call:
# their ratio to cuDNN went 0.989 -> 1.032 at 4k and 1.027 -> 1.055 at 16k, while d = 64's fell
# 1.107 -> 1.092 and 1.186 -> 1.144 (docs/evidence/2026-12-07-h100-session-18/), one pass each.
# So: the backward's suites (padded, packed, sinks, score functions) in a copy of the tree where
# the dispatcher picks them for every causal d = 128 call; racecheck on them; then tune.py
# hopper-bwd --switch decoupled at d = 128 causal over 1k, 4k and 16k, three passes in bf16 and
# one in fp16. Predicted: 2-4% on the causal d = 128 backward.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_decoupled_causal.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-480}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
rm -rf /tmp/dec_causal && mkdir -p /tmp/dec_causal && cp -r cupyflash kernels_cu tests scripts pyproject.toml /tmp/dec_causal/
sed -i 's/decoupled=FA3_BWD_DECOUPLED and not deterministic/decoupled=(FA3_BWD_DECOUPLED or (flags.causal and head_dim == 128)) and not deterministic/' \
  /tmp/dec_causal/cupyflash/_dispatch.py
grep -c "flags.causal and head_dim == 128)) and not deterministic" /tmp/dec_causal/cupyflash/_dispatch.py
(cd /tmp/dec_causal && PYTHONPATH=/tmp/dec_causal:/tmp/site timeout -s INT $(( END * 45 / 100 )) python3 -m pytest -q -n 8 \
  -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore tests/test_gpu_backward.py tests/test_varlen.py \
  tests/test_gpu_sinks.py tests/test_gpu_mods.py -k "not mods or backward or autograd or learned" > $OUT/tests_dec_causal.log 2>&1)
echo "backward suites (decoupled at causal d = 128) rc=$? at ${SECONDS}s"
grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_dec_causal.log | cut -c1-250 | tail -10
timeout 60 compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_bwd.py FA3_BWD_DECOUPLED=1 \
  > $OUT/racecheck_dec_causal.log 2>&1
echo "racecheck rc=$? at ${SECONDS}s"; grep -E "^(64|128) |SUMMARY" $OUT/racecheck_dec_causal.log
grep -E "Race reported|Write Thread|Read Thread|at 0x" $OUT/racecheck_dec_causal.log | sort | uniq -c | head -12 | cut -c1-200
for pass in 1 2 3 4; do
  dtype=bfloat16; [ $pass = 4 ] && dtype=float16
  budget=$(( ($(left) - 5) / (5 - pass) ))
  [ "$budget" -gt 30 ] && timeout $budget python3 scripts/tune.py hopper-bwd --switch decoupled --head-dims 128 \
    --seqlens 1024 4096 16384 --causal-only --dtype $dtype --json $OUT/tune_dec_causal$pass.json > $OUT/tune_dec_causal$pass.log 2>&1
  echo "tune decoupled causal d = 128 $dtype pass $pass rc=$? at ${SECONDS}s"
  grep '"head_dim"' $OUT/tune_dec_causal$pass.log | cut -c1-60,130-330
done
