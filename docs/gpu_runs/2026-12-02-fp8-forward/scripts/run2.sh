#!/usr/bin/env bash
# Call 4: the FP8 forward's tests again (the LSE bound now allows for the tensor cores' FP8
# accumulation), then its benchmark beside the bf16 forward, cuDNN and flash.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/array_api*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --tb=short tests/test_gpu_fp8_forward.py > $OUT/fp8_tests.log 2>&1
echo "fp8 tests rc=$?" >> $OUT/fp8_tests.log; tail -25 $OUT/fp8_tests.log | cut -c1-300
timeout 300 python3 scripts/bench_fp8_forward.py --json $OUT/fp8_bench.json > $OUT/fp8_bench.log 2>&1
echo "bench rc=$?" >> $OUT/fp8_bench.log; cut -c1-900 $OUT/fp8_bench.log
