#!/usr/bin/env bash
# An attn_mask's mixed tiles staged through shared memory in the FA2 forward: its tests (both
# paths), the sanitizers on the staged cases, the d = 128 tile A/B, bench-mask per head dim.
set -uo pipefail
source .ab/common.sh
L=$OUT
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $L/env.log 2>&1
timeout 150 python3 -m pytest -q -n 15 -p no:cacheprovider tests/test_gpu_attn_mask.py tests/test_transformers.py \
  tests/test_flash_attn.py > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed" $L/tests.log | tail -15
{
  echo "== sanitize --only staged"
  timeout 110 python3 scripts/sanitize.py --out /tmp/san --only "staged" --timeout 40; echo "rc=$?"
  grep -h "sanitize workload:" /tmp/san/*.out
} > $L/sanitize.log 2>&1
cat $L/sanitize.log
timeout 100 python3 .ab/mask_tile_ab.py > $L/mask_tile_ab.log 2>&1; echo "rc=$?" >> $L/mask_tile_ab.log
cat $L/mask_tile_ab.log
