#!/usr/bin/env bash
# The mask forward's d = 128 tile moved to 128 x 64 (Q in registers): the mask tests again.
set -uo pipefail
source .ab/common.sh
L=$OUT
timeout 150 python3 -m pytest -q -n 15 -p no:cacheprovider tests/test_gpu_attn_mask.py tests/test_transformers.py > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed" $L/tests.log | tail -15
