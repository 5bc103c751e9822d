#!/usr/bin/env bash
# The deterministic Hopper backward with d = 64's partial dQ summed in shared memory: its tests,
# the A/B against the default (one process, interleaved), bench-train's 24 shapes, sanitizers.
set -uo pipefail
source .ab/common.sh
L=$OUT
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $L/env.log 2>&1
timeout 200 python3 -m pytest -q -n 15 -p no:cacheprovider tests/test_gpu_backward.py tests/test_torch_ops.py \
  -k "deterministic or determin" > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed|Timeout" $L/tests.log | tail -25
MODES=default,det timeout 150 python3 .ab/det_bwd_ab.py $L/det_bwd_ab.json > $L/det_bwd_ab.log 2>&1; echo "rc=$?" >> $L/det_bwd_ab.log
cut -c1-300 $L/det_bwd_ab.log
timeout 230 python3 -m cupyflash bench-train --json $L/bench_train.json > $L/bench_train.log 2>&1; echo "rc=$?" >> $L/bench_train.log
cat $L/bench_train.log
{
  echo "== sanitize --only 'det=True'"
  timeout 100 python3 scripts/sanitize.py --out /tmp/san --only "det=True" --timeout 50; echo "rc=$?"
  grep -h "sanitize workload:" /tmp/san/*.out
} > $L/sanitize.log 2>&1
tail -12 $L/sanitize.log
