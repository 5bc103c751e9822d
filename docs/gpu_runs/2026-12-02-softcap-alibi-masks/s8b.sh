#!/usr/bin/env bash
# Softcap on the Hopper backward; the tests of run s8a again (their log came back this time) with
# the training-side files; sanitizers on the backward's softcap cases; softcap backward speed.
set -uo pipefail
source .ab/common.sh
L=$OUT
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $L/env.log 2>&1
timeout 300 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_gpu_backward.py tests/test_torch_ops.py \
  tests/test_alibi.py tests/test_gpu_attn_mask.py tests/test_gpu_paged_prefill.py tests/test_gpu_decode.py \
  tests/test_gpu_reliability.py tests/test_flash_attn.py > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed" $L/tests.log | tail -25
{
  for only in "'softcap': 4.0" "alibi-softcap"; do
    echo "== sanitize --only \"$only\""
    timeout 100 python3 scripts/sanitize.py --out /tmp/san --only "$only" --timeout 45; echo "rc=$?"
    grep -h "sanitize workload:" /tmp/san/*.out
  done
} > $L/sanitize.log 2>&1
cat $L/sanitize.log
timeout 120 python3 .ab/softcap_bwd_bench.py > $L/bench_softcap_bwd.log 2>&1; echo "rc=$?" >> $L/bench_softcap_bwd.log
cat $L/bench_softcap_bwd.log
