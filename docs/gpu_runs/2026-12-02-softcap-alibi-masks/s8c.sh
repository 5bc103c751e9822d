#!/usr/bin/env bash
# The rest of the gpu suite (every gpu test outside the files run s8b ran, on the same tree).
set -uo pipefail
source .ab/common.sh
L=$OUT
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $L/env.log 2>&1
timeout 520 python3 -m pytest -q -n 15 -m gpu -p no:cacheprovider tests \
  --ignore=tests/test_gpu_backward.py --ignore=tests/test_torch_ops.py --ignore=tests/test_alibi.py \
  --ignore=tests/test_gpu_attn_mask.py --ignore=tests/test_gpu_paged_prefill.py --ignore=tests/test_gpu_decode.py \
  --ignore=tests/test_gpu_reliability.py --ignore=tests/test_flash_attn.py > $L/tests_rest.log 2>&1
echo "tests rc=$?" >> $L/tests_rest.log
grep -E "FAILED|ERROR|passed|failed" $L/tests_rest.log | tail -25
