#!/usr/bin/env bash
# Call 7: one exponential in 4 (or 8) on the FMA pipe in the FP8 forward (fp8_exp2_fma_every*.diff,
# trees by make_ab_tree.sh, carried as .ab) beside main under the three timings; the FP8 GPU tests
# on copies of the tree with each patch applied.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/array_api*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
D=docs/gpu_runs/2026-12-02-fp8-forward/scripts
timeout 150 python3 $D/ab_trees.py .ab/fma4 .ab/fma8 --seqlens 4096 16384 > $OUT/ab_fma.log 2>&1
echo "ab rc=$?" >> $OUT/ab_fma.log; cut -c1-800 $OUT/ab_fma.log
for k in 4 8; do
  rm -rf /tmp/cand$k && mkdir /tmp/cand$k && cp -r cupyflash kernels_cu tests pyproject.toml /tmp/cand$k/
  (cd /tmp/cand$k && patch -s -p1 < $OLDPWD/$D/fp8_exp2_fma_every$k.diff) || echo "patch $k failed"
  (cd /tmp/cand$k && PYTHONPATH=/tmp/cand$k:/tmp/site CUPY_CACHE_DIR=/tmp/cache$k timeout 70 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --tb=short tests/test_gpu_fp8_forward.py) > $OUT/fma${k}_tests.log 2>&1
  echo "tests $k rc=$?" >> $OUT/fma${k}_tests.log; tail -3 $OUT/fma${k}_tests.log
done
