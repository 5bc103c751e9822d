#!/bin/bash
# Session 9, call 7: block-table entries read a step ahead -- decode tests, paged and fp8 tables.
source .ab/common.sh
timeout 250 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_gpu_fp8_decode.py tests/test_gpu_decode.py \
  tests/test_gpu_cascade.py tests/test_gpu_paged_prefill.py tests/test_gpu_reliability.py > $L/tests.log 2>&1
echo "tests rc=$?" >> $L/tests.log; tail -2 $L/tests.log
timeout 150 python3 -m cupyflash bench-decode --page-sizes 1 2 16 256 --json $L/bench_paged.json > $L/bench_paged.log 2>&1
echo "rc=$?" >> $L/bench_paged.log; tail -22 $L/bench_paged.log
timeout 100 python3 -m cupyflash bench-decode --fp8 --json $L/bench_fp8.json > $L/bench_fp8.log 2>&1
echo "rc=$?" >> $L/bench_fp8.log; tail -14 $L/bench_fp8.log
cp $L/*.log $L/*.json $OUT/ 2>/dev/null
