#!/usr/bin/env bash
# Call 3 of 3 (any machine): the kernels changed since their last GPU run (the FA2 forward and
# backward, the decode kernel) through their GPU tests, compute-sanitizer over the sinks / score
# function / tree / cascade variants, and host time per tiny call against 8f608e0 (before the
# front-door redesign) beside SDPA, two processes per tree (.ab/host_ab.py; .ab/t8f = `git archive
# 8f608e0 cupyflash kernels_cu`).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/call3.sh [SECONDS]
#   carry: .whl .ab/t8f .ab/host_ab.py   (scripts/pending_gpu/stage.sh makes them)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name --format=csv,noheader
for tree in $PWD .ab/t8f $PWD .ab/t8f; do
  PYTHONPATH=$tree:/tmp/site timeout 60 python3 .ab/host_ab.py 2>&1 | tail -6
done | tee $OUT/host_ab.log
timeout 280 python3 -m pytest -q -n 14 -p no:cacheprovider -m gpu -rf tests/test_gpu_fa2.py tests/test_gpu_backward.py \
  tests/test_gpu_decode.py tests/test_gpu_sinks.py tests/test_gpu_tree_mask.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-300 | tail -15
for only in variant "shared prefix"; do
  tag=${only// /_}
  timeout $(( $(left) / 2 )) python3 scripts/sanitize.py --out $OUT/sanitize_$tag \
    --only "$only" --tools memcheck,racecheck --timeout 90 > $OUT/sanitize_$tag.log 2>&1
  echo "sanitize $only rc=$? at ${SECONDS}s"; tail -3 $OUT/sanitize_$tag.log
done
