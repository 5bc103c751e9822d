#!/usr/bin/env bash
# The Hopper forward's d = 64 tile of three consumers (192 query rows), as FlashAttention-3 and -4
# run it: the softmax of S_j under P_{j-1} V_{j-1} (before, ptxas put its 64 exponentials after
# the wait for that wgmma), a tile's epilogue under the next tile's first Q K^T, and (candidates)
# the consumers' turns in round robin. First FlashAttention-4's first part (when carried), then
# the forward's GPU tests (the d = 64 tiles past 2048 keys are this tile), racecheck over it, and
# scripts/tune.py fa3 at d = 64 with cuDNN (and FA4 once staged) in the same process.
#   usage (GPU machine, tree root, $OUT set): docs/evidence/2026-12-07-h100-session-8/scripts/validate_fwd_d64.sh [SECONDS]
#   carry: .whl (and .peers/fa4x1 .peers/bin for FlashAttention-4's first part)
set -uo pipefail
END=${1:-580}
left() { echo $((END - SECONDS)); }
[ -d .peers/fa4x1 ] && bash .peers/bin/fa4_stage.sh > $OUT/stage.log 2>&1 && tail -1 $OUT/stage.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f /tmp/fa4site/flash_attn/cute/__init__.py ] && [ -d .peers/fa4w ] && source .peers/bin/fa4_env.sh
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT 200 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_fuzz.py tests/test_gpu_reliability.py tests/test_gpu_launch_template.py tests/test_gpu_pipeline.py \
  tests/test_varlen.py tests/test_gpu_sinks.py tests/test_alibi.py tests/test_gpu_batch_invariant.py \
  tests/test_gpu_mods.py tests/test_gpu_block_mask.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -20
# racecheck over the three-consumer tile (non-causal d = 64 past 2048 keys), static and round robin
cat > /tmp/race_d64.py <<'PY'
import sys, cupy as cp, numpy as np, cupyflash
from cupyflash import _dispatch, _plan
from cupyflash._specs import Fa3Tile
q, k, v = (cp.asarray(np.random.default_rng(i).standard_normal((1, 2100, 2, 64)), dtype=cp.float16) for i in range(3))
for tile in (Fa3Tile(128, 3, 2), Fa3Tile(128, 3, 2, pingpong=True, dynamic=True)):
    _dispatch.FA3_FWD_TILES[64, False] = tile; _plan.clear_caches()
    o = cupyflash.attention(q, k, v, algorithm="fa3"); cp.cuda.runtime.deviceSynchronize()
    print(tile, bool(cp.isfinite(o.astype(cp.float32)).all()), flush=True)
PY
for tool in racecheck synccheck; do
  timeout 70 compute-sanitizer --tool $tool python3 /tmp/race_d64.py > $OUT/$tool.log 2>&1
  echo "$tool rc=$? at ${SECONDS}s"; grep -E "SUMMARY|Fa3Tile" $OUT/$tool.log | head -4
done
timeout $(( $(left) - 5 )) python3 scripts/tune.py fa3 --head-dims 64 --json $OUT/tune_fa3.json > $OUT/tune_fa3.log 2>&1
echo "tune fa3 rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/tune_fa3.log | cut -c1-400 | tail -12
