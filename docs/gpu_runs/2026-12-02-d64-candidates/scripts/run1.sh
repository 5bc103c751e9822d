#!/usr/bin/env bash
# Call 1: the three d = 64 candidates of docs/gpu_runs/2026-12-02-wgmma-desc/scripts/next_run.sh
# (trees made by its make_ab_tree.sh, carried as .ab) timed beside main and cuDNN under the three
# timings, then the forward GPU tests on a copy of the tree with both candidates applied.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
S=docs/gpu_runs/2026-12-02-wgmma-desc/scripts
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $OUT/env.log 2>&1
timeout 330 python3 $S/ab3.py fwd .ab/cfbase .ab/cf_after_pv .ab/cf_exp2_fma .ab/cf_both \
  --shapes 64-1024-0 64-1024-1 64-4096-0 64-4096-1 64-16384-0 --json $OUT/d64_fwd_ab3.json > $OUT/d64_fwd_ab3.log 2>&1
echo "rc=$?" >> $OUT/d64_fwd_ab3.log; cut -c1-600 $OUT/d64_fwd_ab3.log | tail -60
# the forward tests with both patches (every code path either candidate touches)
rm -rf /tmp/cand && mkdir /tmp/cand && cp -r cupyflash kernels_cu tests pyproject.toml /tmp/cand/
(cd /tmp/cand && patch -s -p1 < $OLDPWD/$S/next_after_pv_and_exp2_fma_d64.diff) || echo "patch failed"
(cd /tmp/cand && PYTHONPATH=/tmp/cand:/tmp/site CUPY_CACHE_DIR=/tmp/cupyflash_cache_cand timeout 230 python3 -m pytest -q -n 15 -p no:cacheprovider -rfE --tb=line \
  tests/test_gpu_fa2.py tests/test_gpu_pipeline.py tests/test_varlen.py tests/test_gpu_reliability.py) > $OUT/cf_both_tests.log 2>&1
echo "tests rc=$?" >> $OUT/cf_both_tests.log; tail -8 $OUT/cf_both_tests.log
