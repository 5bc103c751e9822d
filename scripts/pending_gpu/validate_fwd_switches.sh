#!/usr/bin/env bash
# The Hopper forward's two switches, off until this runs: its causal tiles longest first in
# sections of (batch, head) pairs (TileScheduler, _dispatch.FA3_FWD_LPT; predicted 3-6% at causal
# N = 2k-8k by a list-scheduling model) and its consumer index broadcast from lane 0
# (Fa3FwdTraits::Uniform_consumer, FA3_FWD_UNIFORM_CONSUMER: 15-91 fewer instructions in a
# tile's main loop; predicted 0-2%). Their GPU tests (the float64 reference over persistent CTAs
# of several tiles, bit-identical on later calls) with the forward's suite, then
# tune.py hopper-bwd --switch fwd_lpt (causal) and --switch fwd_uniform: both settings one after
# the other, cuDNN and FA4 where staged in each one's rounds; the step's column moves.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_fwd_switches.sh [SECONDS]
#   carry: .whl (and .peers/bin .peers/fa4w after FlashAttention-4's two parts, for it beside)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT $(( $(left) / 3 )) python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf \
  --tb=short -W ignore tests/test_gpu_fa2.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
timeout $(( $(left) / 2 )) python3 scripts/tune.py hopper-bwd --switch fwd_lpt --causal-only --head-dims 128 64 \
  --seqlens 2048 4096 8192 --json $OUT/tune_fwd_lpt.json > $OUT/tune_fwd_lpt.log 2>&1
echo "tune fwd_lpt rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning\|exe_args" $OUT/tune_fwd_lpt.log | cut -c1-420 | tail -8
timeout $(( $(left) - 3 )) python3 scripts/tune.py hopper-bwd --switch fwd_uniform --head-dims 128 64 \
  --seqlens 1024 4096 --json $OUT/tune_fwd_uniform.json > $OUT/tune_fwd_uniform.log 2>&1
echo "tune fwd_uniform rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning\|exe_args" $OUT/tune_fwd_uniform.log | cut -c1-420 | tail -10
