#!/usr/bin/env bash
# The causal Hopper backward's CTAs longest first in sections of (batch, KV head) pairs
# (tile_scheduler.cuh's fa3_bwd_tile, _dispatch.FA3_BWD_LPT), off until this runs. Predicted by a
# list-scheduling model: the main kernel 2-5% shorter at causal N = 1k-8k, the same at 16k. The
# backward and score-function GPU suites (the backward in pieces since b22591c, and the order's
# own test: sections of 4 and 3 pairs against float64, dK and dV bit-identical over three
# runs), racecheck with the order on, then tune.py hopper-bwd --switch lpt over the causal
# shapes (both settings one after the other, cuDNN and FA4 where staged in each one's rounds).
# The forward's switches: validate_fwd_switches.sh.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_bwd_lpt.sh [SECONDS]
#   carry: .whl (and .peers/bin .peers/fa4w after FlashAttention-4's two parts, for it beside)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
# the backward and score-function suites (the restructured kernel, b22591c, and the order's test)
timeout -s INT $(( $(left) * 2 / 3 )) python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf \
  --tb=short -W ignore tests/test_gpu_backward.py tests/test_gpu_mods.py -k "not torch_compile and not cuda_graph" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
[ "$(left)" -gt 80 ] && timeout 45 compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_bwd.py FA3_BWD_LPT=1 \
  > $OUT/racecheck.log 2>&1
echo "racecheck rc=$? at ${SECONDS}s"; grep -E "SUMMARY|^(64|128) " $OUT/racecheck.log | head -4
timeout $(( $(left) - 3 )) python3 scripts/tune.py hopper-bwd --switch lpt --causal-only --head-dims 128 64 \
  --seqlens 1024 4096 8192 16384 --json $OUT/tune_lpt.json > $OUT/tune_lpt.log 2>&1
echo "tune lpt rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning\|exe_args" $OUT/tune_lpt.log | cut -c1-420 | tail -18
