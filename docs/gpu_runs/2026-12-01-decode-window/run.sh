#!/usr/bin/env bash
# The decode kernel's window and softcap: its gpu tests (and the others of the decode,
# pipeline, fa2-refusal, transformers and flash_attn files), memcheck and racecheck over the
# kvcache cases, and the contiguous decode timing against HEAD~1 (the plain variants' code).
set -uo pipefail
source .ab/common.sh
L=$OUT
timeout 170 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests/test_gpu_decode.py tests/test_gpu_pipeline.py tests/test_gpu_fa2.py tests/test_transformers.py tests/test_flash_attn.py tests/test_gpu_reliability.py > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed" $L/tests.log | tail -20
timeout 100 python3 scripts/sanitize.py --out $L/sanitize --only kvcache --tools memcheck,racecheck --timeout 45 > $L/sanitize.log 2>&1; echo "sanitize rc=$?" >> $L/sanitize.log
tail -4 $L/sanitize.log
rm -f $L/sanitize/*.out
