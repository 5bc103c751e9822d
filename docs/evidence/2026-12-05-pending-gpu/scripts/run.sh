#!/usr/bin/env bash
# The GPU tests written while no GPU could be had, in one call: score_mod / mask_mod compiled into
# the FA2 and Hopper forwards (CUPYFLASH_GPU_MODS=1 lifts the gate they are behind), batch_invariant
# decode, the JAX route, the decode / FP8 decode / paged prefill tests (the cache route moved), and
# the torch ops' eager autograd; then batch_invariant's cost (bench-decode --batch-invariant) and
# where a d = 64 N = 1k training step's host time goes (step_timeline --parts), as time allows.
#   usage (GPU machine, tree root, $OUT set): run.sh [SECONDS]      (.whl/ carried)
set -uo pipefail
END=${1:-570}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache CUPYFLASH_GPU_MODS=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv
  python3 -c "import cupyflash, torch, cupy, jax; print(cupyflash.__file__, torch.__version__, cupy.__version__, jax.__version__)"
} > $OUT/env.log 2>&1
cat $OUT/env.log
left() { echo $((END - SECONDS)); }
timeout 330 python3 -m pytest -q -n 15 -p no:cacheprovider -m gpu tests/test_gpu_mods.py \
  tests/test_gpu_batch_invariant.py tests/test_gpu_jax.py tests/test_gpu_decode.py tests/test_gpu_fp8_decode.py \
  tests/test_gpu_paged_prefill.py tests/test_torch_ops.py > $OUT/tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s" >> $OUT/tests.log
grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/tests.log | cut -c1-300 | tail -40
timeout $(( $(left) * 2 / 3 )) python3 -m cupyflash bench-decode --batch-invariant --json $OUT/inv.json > $OUT/inv.log 2>&1
echo "inv rc=$? at ${SECONDS}s" | tee -a $OUT/inv.log; tail -30 $OUT/inv.log | cut -c1-300
timeout $(left) python3 scripts/step_timeline.py --d 64 --n 1024 --parts > $OUT/parts.log 2>&1
echo "parts rc=$? at ${SECONDS}s"; grep -v "^    " $OUT/parts.log | cut -c1-300 | tail -50
