#!/usr/bin/env bash
# Two pending checks in one call. (1) The backward and score-function GPU suites with dK issued
# after dQ at d = 128 (_dispatch.FA3_BWD_DQ_FIRST on through a pytest plugin every worker loads;
# the new order of the exponentials is main's default): dq_first was timed +1-3% in 10 of 12
# (shape, run) pairs and is off until these pass. (2) Issue 41's cascade prefix splits at the
# batches where the wgmma prefix runs (cascade_small.py, 32k prefix, forced counts beside the
# dispatcher's): at B <= 4 one wave of prefix CTAs (16 splits) beat the two waves the dispatcher
# asks for (33) by 8-13%; does B = 8..64 agree? Then Nsight Compute over the default backward.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_dq_first_cascade_splits.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-480}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
git log -1 --format=%h 2>/dev/null | tee -a $OUT/env.log
mkdir -p /tmp/cfplugin && echo "from cupyflash import _dispatch; _dispatch.FA3_BWD_DQ_FIRST = True" > /tmp/cfplugin/dq_first.py
PYTHONPATH=/tmp/cfplugin:$PYTHONPATH timeout -s INT 260 python3 -m pytest -p dq_first -q -n 15 -p no:cacheprovider \
  -p no:benchmark -m gpu -rf --tb=short -W ignore tests/test_gpu_backward.py tests/test_gpu_mods.py \
  -k "not torch_compile and not cuda_graph" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -15
timeout $(( $(left) - 60 )) python3 scripts/pending_gpu/cascade_small.py --batches 64 8 16 2 --prefixes 32768 \
  --counts 4 8 12 16 24 33 --owns 0 --flat-counts > $OUT/cascade_splits.log 2>&1
echo "cascade splits rc=$? at ${SECONDS}s"; cut -c1-600 $OUT/cascade_splits.log | tail -6
[ "$(left)" -gt 40 ] && timeout $(( $(left) - 10 )) ncu --clock-control none --profile-from-start off --set detailed \
  --section WarpStateStats -f -o $OUT/bwd_d128_n4096 python3 scripts/ncu_attention.py 128 4096 --backends cupyflash cudnn \
  > $OUT/ncu.log 2>&1
echo "ncu rc=$? at ${SECONDS}s"
[ -f $OUT/bwd_d128_n4096.ncu-rep ] && python3 scripts/ncu_attention.py --summary $OUT/bwd_d128_n4096.ncu-rep | cut -c1-250
