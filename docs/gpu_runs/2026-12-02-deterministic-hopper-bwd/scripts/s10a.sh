#!/usr/bin/env bash
# The deterministic Hopper backward and the float8 q scale over finite elements: their GPU tests,
# the backward A/B (.ab/det_bwd_ab.py), the sanitizers on the many-key-block backward cases.
set -uo pipefail
source .ab/common.sh
L=$OUT
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $L/env.log 2>&1
timeout 250 python3 -m pytest -q -n 15 -p no:cacheprovider tests/test_gpu_backward.py tests/test_gpu_fp8_decode.py \
  "tests/test_torch_ops.py" -k "not benchmark" > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed|Timeout" $L/tests.log | tail -25
timeout 200 python3 .ab/det_bwd_ab.py $L/det_bwd_ab.json > $L/det_bwd_ab.log 2>&1; echo "rc=$?" >> $L/det_bwd_ab.log
cat $L/det_bwd_ab.log | cut -c1-400
{
  echo "== sanitize --only 'many key blocks'"
  timeout 120 python3 scripts/sanitize.py --out /tmp/san --only "many key blocks" --timeout 60; echo "rc=$?"
  grep -h "sanitize workload:" /tmp/san/*.out
} > $L/sanitize.log 2>&1
tail -12 $L/sanitize.log
