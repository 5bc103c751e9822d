#!/usr/bin/env bash
# Issue 41: the cascade's prefix by wgmma on Hopper, in order of need (a short device budget):
# the cascade's GPU tests (both prefix paths), the kernel times with the wgmma prefix on and off
# beside the flat call (cascade_wgmma.py), bench-cascade's three timings, compute-sanitizer
# memcheck and racecheck over a wgmma-prefix call, then the default decode variants of this tree
# against ab_old/ (the tree before, when carried untracked). Logs under $OUT.   carry: .whl
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout 120 python3 -m pytest -q -n 12 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_cascade.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed|^E " $OUT/tests.log | cut -c1-300 | head -30
timeout 90 python3 docs/evidence/2026-12-07-h100-session-9/scripts/cascade_wgmma.py 2>&1 | tee $OUT/wgmma.log
timeout 120 python3 -c 'import sys; from cupyflash import _dispatch, __main__; _dispatch.CASCADE_WGMMA_PREFIX = True; sys.exit(__main__.main(["bench-cascade", "--json", sys.argv[1]]))' $OUT/cascade.json > $OUT/bench.log 2>&1
echo "bench rc=$? at ${SECONDS}s"; tail -8 $OUT/bench.log
cat > /tmp/sanitize_cascade.py <<'PY'
import torch
from cupyflash import _dispatch, bench
_dispatch.CASCADE_WGMMA_MIN_ROWS = 64
_dispatch.CASCADE_WGMMA_PREFIX = True
calls = bench.cascade_calls(40, 1008, own=96, page_size=16)  # a wgmma block of 32 requests and one of 8
out = calls["cascade"](); out2 = calls["flat_paged"](); torch.cuda.synchronize()
print("max diff", float((out.float() - out2.float()).abs().max()))
PY
for tool in memcheck racecheck; do
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 python3 /tmp/sanitize_cascade.py > $OUT/san_$tool.log 2>&1
  echo "$tool rc=$? at ${SECONDS}s"; tail -2 $OUT/san_$tool.log
done
if [ -d ab_old/cupyflash ]; then
  for tree in old new; do
    dir=$PWD; [ $tree = old ] && dir=$PWD/ab_old
    PYTHONPATH=$dir:/tmp/site timeout 45 python3 docs/evidence/2026-12-07-h100-session-9/scripts/decode_ab.py $tree 2>&1 | tail -1 | tee -a $OUT/decode_ab.log
  done
fi
