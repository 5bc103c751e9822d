#!/usr/bin/env bash
# The per-row backward kernels with several rows per warp (prep) and row pairs read whole from the
# Hopper tiles (dq): the GPU tests of every backward path, their kernel times (ncu), bench-train,
# memcheck/initcheck on the backward cases.
set -uo pipefail
source .ab/common.sh
L=$OUT
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $L/env.log 2>&1
timeout 250 python3 -m pytest -q -n 15 -p no:cacheprovider tests/test_gpu_backward.py tests/test_torch_ops.py \
  tests/test_dropout.py tests/test_alibi.py tests/test_varlen.py tests/test_gpu_reliability.py \
  > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed|Timeout" $L/tests.log | tail -25
timeout 80 ncu --clock-control none --profile-from-start off -k "regex:fa2_bwd_prep|fa2_bwd_dq|fa3_bwd" --section SpeedOfLight \
  python3 .ab/bwd_rows_ncu.py > $L/ncu_rows.log 2>&1; echo "ncu rc=$?" >> $L/ncu_rows.log
grep -E "^  [a-z_A-Z].*\(|Duration|DRAM Throughput|rc=" $L/ncu_rows.log | cut -c1-90
timeout 150 python3 -m cupyflash bench-train --json $L/bench_train.json > $L/bench_train.log 2>&1; echo "rc=$?" >> $L/bench_train.log
tail -26 $L/bench_train.log
{
  timeout 80 python3 scripts/sanitize.py --out /tmp/san --tools memcheck,initcheck --only "backward" --timeout 35; echo "rc=$?"
  grep -h "sanitize workload:" /tmp/san/*.out
} > $L/sanitize.log 2>&1
tail -6 $L/sanitize.log
