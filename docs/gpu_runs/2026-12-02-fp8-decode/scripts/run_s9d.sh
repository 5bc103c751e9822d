#!/bin/bash
# Session 9, call 4: decode GPU tests, sanitizers on the float8 cases, the decode benchmarks.
source .ab/common.sh
timeout 260 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_gpu_fp8_decode.py tests/test_gpu_decode.py \
  tests/test_gpu_cascade.py tests/test_gpu_paged_prefill.py tests/test_gpu_reliability.py tests/test_fp8_kvcache.py > $L/tests.log 2>&1
echo "tests rc=$?" >> $L/tests.log; tail -3 $L/tests.log
timeout 280 python3 scripts/sanitize.py --out $L/sanitize --only "fp8" --timeout 65 > $L/sanitize.log 2>&1
echo "sanitize rc=$?" >> $L/sanitize.log; tail -5 $L/sanitize.log; cp $L/sanitize/summary.txt $L/sanitize_summary.log 2>/dev/null
timeout 100 python3 -m cupyflash bench-decode --fp8 --json $L/bench_fp8.json > $L/bench_fp8.log 2>&1
echo "rc=$?" >> $L/bench_fp8.log; tail -15 $L/bench_fp8.log
timeout 120 python3 -m cupyflash bench-decode --json $L/bench_decode.json > $L/bench_decode.log 2>&1
echo "rc=$?" >> $L/bench_decode.log; tail -16 $L/bench_decode.log
cp $L/*.log $L/*.json $OUT/ 2>/dev/null
