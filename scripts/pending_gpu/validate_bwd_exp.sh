#!/usr/bin/env bash
# The Hopper backward's exponentials under dP^T (fa3_bwd.cu's Exp_under_dp): P^T formed as soon as
# S^T is complete and dV += P^T dO issued before the wait for dP^T = V dO^T, as FlashAttention-3
# and FA4 order a step; before, every exponential of a step waited for dP^T and ran with no wgmma
# of either consumer in flight (32 a thread at d = 128, 64 at d = 64: 512-1024 MUFU clocks a step
# beside ~2,600 of wgmma). Predicted: the backward 8-15% faster at N >= 4k, d = 128 and 64. Run
# after FlashAttention-4's two parts on this machine (then it is timed beside): the backward's
# GPU tests, scripts/tune.py hopper-bwd --switch late_exp (both orders per training shape, cuDNN
# and FA4 in each one's rounds, one process), racecheck over both head dims, then the same tuning
# with --switch dq_first (dK after dQ too) with the time left, after issue 41's cascade_small.py.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_bwd_exp.sh [SECONDS]
#   carry: .whl (and .peers/bin .peers/fa4w after FlashAttention-4's two parts, for it beside)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
backends="cupyflash cudnn"
if [ -d /tmp/fa4site/nvidia_cutlass_dsl ] && [ -d .peers/fa4w ] && [ -d .peers/bin ] && source .peers/bin/fa4_env.sh; then
  backends="$backends fa4"
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
git log -1 --format=%h 2>/dev/null | tee -a $OUT/env.log
# the tests on the new order (_dispatch.FA3_BWD_LATE_EXP off: a plugin every worker loads)
mkdir -p /tmp/cfplugin && echo "from cupyflash import _dispatch; _dispatch.FA3_BWD_LATE_EXP = False" \
  > /tmp/cfplugin/new_bwd_order.py
PYTHONPATH=/tmp/cfplugin:$PYTHONPATH timeout -s INT 170 python3 -m pytest -p new_bwd_order -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_backward.py tests/test_gpu_mods.py -k "not torch_compile and not cuda_graph" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -15
timeout $(( $(left) * 5 / 9 )) python3 scripts/tune.py hopper-bwd --switch late_exp --head-dims 128 64 \
  --seqlens 4096 16384 --json $OUT/tune_hopper_bwd.json > $OUT/tune_hopper_bwd.log 2>&1
echo "tune hopper-bwd rc=$? at ${SECONDS}s"
grep -v "^ *warn\|Warning\|exe_args" $OUT/tune_hopper_bwd.log | cut -c1-420 | tail -18
[ "$(left)" -gt 50 ] && timeout 45 compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_bwd.py FA3_BWD_LATE_EXP=0 > $OUT/racecheck.log 2>&1
echo "racecheck rc=$? at ${SECONDS}s"; grep -E "SUMMARY|^(64|128) " $OUT/racecheck.log | head -4
# issue 41's small-batch cascade: prefix split counts against the flat call's (kernel time)
timeout 70 python3 scripts/pending_gpu/cascade_small.py > $OUT/cascade_small.log 2>&1
echo "cascade_small rc=$? at ${SECONDS}s"; cut -c1-600 $OUT/cascade_small.log | tail -8
# dK after dQ as well (dq_first), dQ staged under dK: predicted +3-8% more
[ "$(left)" -gt 60 ] && timeout $(( $(left) - 5 )) python3 scripts/tune.py hopper-bwd --switch dq_first \
  --head-dims 128 --seqlens 4096 16384 --json $OUT/tune_dq_first.json > $OUT/tune_dq_first.log 2>&1
echo "tune dq_first rc=$? at ${SECONDS}s"
grep -v "^ *warn\|Warning\|exe_args" $OUT/tune_dq_first.log | cut -c1-420 | tail -18
