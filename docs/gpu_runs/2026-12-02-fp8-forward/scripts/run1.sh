#!/usr/bin/env bash
# Call 3: the FP8 forward's first GPU run: its tests, then (if they pass) its benchmark beside
# the bf16 forward and cuDNN, then the forward tests of the 16-bit Hopper kernel it shares code with.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/array_api*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
R=docs/gpu_runs/2026-12-02-fp8-forward/scripts
timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --tb=short tests/test_gpu_fp8_forward.py > $OUT/fp8_tests.log 2>&1
rc=$?; echo "fp8 tests rc=$rc" >> $OUT/fp8_tests.log; tail -40 $OUT/fp8_tests.log | cut -c1-300
if [ $rc -eq 0 ]; then
  timeout 200 python3 scripts/bench_fp8_forward.py --json $OUT/fp8_bench.json > $OUT/fp8_bench.log 2>&1
  echo "bench rc=$?" >> $OUT/fp8_bench.log; cut -c1-700 $OUT/fp8_bench.log
fi
timeout 150 python3 -m pytest -q -n 15 -p no:cacheprovider -rfE --tb=line tests/test_gpu_fa2.py tests/test_gpu_pipeline.py > $OUT/hopper_fwd_tests.log 2>&1
echo "tests rc=$?" >> $OUT/hopper_fwd_tests.log; tail -5 $OUT/hopper_fwd_tests.log
