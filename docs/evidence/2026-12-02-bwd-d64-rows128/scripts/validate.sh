#!/usr/bin/env bash
# The 128-row d = 64 Hopper backward with its spill fixes, on the GPU, in one call: the backward's
# GPU tests (and the FP8 forward's), memcheck / racecheck on the d = 64 and d = 128 backward cases
# (those whose label holds "d=64 det" / "d=128 det": the window and softcap variants, causal rows
# that see no key, varlen, many key blocks into one dQ tile), then a training step beside cuDNN and
# the tree before (8f608e0, BASE, made by ../../2026-12-02-wgmma-desc/scripts/make_ab_tree.sh) under
# the three timings, then the flag variants beside BASE (variants_ab.py) if time is left.
#   usage (on the GPU machine, in the tree's root): validate.sh BASE [SECONDS]   (.whl/ here or in ../..)
# The A/B's shapes go in order of interest: it prints each as it goes, and stops at SECONDS.
set -uo pipefail
BASE=${1:?usage: validate.sh BASE [SECONDS]}
END=${2:-570}  # the A/B and the variants stop by then (seconds since the start)
WHL=$(ls -d .whl ../../.whl 2>/dev/null | head -1)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
S=docs/evidence/2026-12-02-bwd-d64-rows128/scripts
AB=docs/gpu_runs/2026-12-02-wgmma-desc/scripts/ab3.py
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; uname -r
  python3 -c "import cupyflash, torch, cupy; print(cupyflash.__file__, torch.__version__, cupy.__version__)"; } > $OUT/env.log 2>&1
cat $OUT/env.log
timeout 230 python3 -m pytest -q -n 15 -p no:cacheprovider tests/test_gpu_backward.py tests/test_gpu_fp8_forward.py \
  tests/test_torch_ops.py > $OUT/tests.log 2>&1; echo "tests rc=$?" >> $OUT/tests.log
grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/tests.log | tail -25
{
  for dim in 64 128; do
    timeout 90 python3 scripts/sanitize.py --out /tmp/san$dim --tools memcheck,racecheck --only "d=$dim det" --timeout 50
    echo "d=$dim rc=$?"; grep -h "sanitize workload:" /tmp/san$dim/*.out
  done
} > $OUT/sanitize.log 2>&1
cat $OUT/sanitize.log; echo "elapsed ${SECONDS}s"
LEFT=$((END - SECONDS))
if [ $LEFT -gt 30 ]; then
  timeout $LEFT python3 $AB train $BASE --shapes 64-4096-0 64-16384-1 64-4096-1 128-4096-0 64-1024-0 \
    64-16384-0 64-1024-1 --json $OUT/ab_train.json > $OUT/ab_train.log 2>&1; echo "rc=$?" >> $OUT/ab_train.log
  cut -c1-560 $OUT/ab_train.log; echo "elapsed ${SECONDS}s"
fi
LEFT=$((END - SECONDS))
if [ $LEFT -gt 60 ]; then
  timeout $LEFT python3 $S/variants_ab.py $BASE --json $OUT/variants_ab.json > $OUT/variants_ab.log 2>&1
  echo "rc=$?" >> $OUT/variants_ab.log; cut -c1-420 $OUT/variants_ab.log
fi
echo "elapsed ${SECONDS}s"
