#!/usr/bin/env bash
# Call 5: the FP8 forward with the faster V transpose (words, not bytes, from bank-rotated rows)
# and the straight host path: its tests, compute-sanitizer (memcheck, racecheck), the benchmark.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/array_api*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
S=docs/gpu_runs/2026-12-02-fp8-forward/scripts
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --tb=short tests/test_gpu_fp8_forward.py > $OUT/fp8_tests.log 2>&1
echo "fp8 tests rc=$?" >> $OUT/fp8_tests.log; tail -4 $OUT/fp8_tests.log | cut -c1-300
for tool in memcheck racecheck; do
  timeout 90 compute-sanitizer --tool $tool --error-exitcode 3 python3 $S/sanitize.py > $OUT/sanitizer_$tool.log 2>&1
  echo "$tool rc=$?" >> $OUT/sanitizer_$tool.log; tail -3 $OUT/sanitizer_$tool.log
done
timeout 240 python3 scripts/bench_fp8_forward.py --json $OUT/fp8_bench.json > $OUT/fp8_bench.log 2>&1
echo "bench rc=$?" >> $OUT/fp8_bench.log; cut -c1-1000 $OUT/fp8_bench.log
