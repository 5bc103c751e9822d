#!/usr/bin/env bash
# Call 6: the FP8 tests with the empty-shape cases added, then the K / V stages A/B.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/array_api*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
S=docs/gpu_runs/2026-12-02-fp8-forward/scripts
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --tb=short tests/test_gpu_fp8_forward.py > $OUT/fp8_tests.log 2>&1
echo "fp8 tests rc=$?" >> $OUT/fp8_tests.log; tail -4 $OUT/fp8_tests.log | cut -c1-300
timeout 200 python3 $S/ab_stages.py > $OUT/ab_stages.log 2>&1
echo "ab rc=$?" >> $OUT/ab_stages.log; cut -c1-700 $OUT/ab_stages.log
