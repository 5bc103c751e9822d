#!/usr/bin/env bash
# The GPU tests of learnable sinks, score_mod / mask_mod's backward hook and tree-mask decoding
# (CUPYFLASH_GPU_MODS=1 lifts the gate the hooks are behind), then the kernels they touched
# (decode, FP8 decode, the backward), the tree-mask decode benchmark beside SDPA, score functions
# beside FlexAttention, and a cProfile of a d = 64 N = 1k training step's host time, as time allows.
#   usage (GPU machine, tree root, $OUT set): run.sh [SECONDS]      (.whl/ carried)
set -uo pipefail
END=${1:-570}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache CUPYFLASH_GPU_MODS=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv
  python3 -c "import cupyflash, torch, cupy; print(cupyflash.__file__, torch.__version__, cupy.__version__)"
} > $OUT/env.log 2>&1
cat $OUT/env.log
left() { echo $((END - SECONDS)); }
PYTEST="python3 -m pytest -q -n 15 -p no:cacheprovider -m gpu -rf"
timeout 200 $PYTEST tests/test_gpu_sinks.py tests/test_gpu_mods.py tests/test_gpu_tree_mask.py \
  tests/test_gpu_jax.py::test_jit_grad_with_sinks_runs_the_kernels > $OUT/tests_new.log 2>&1
echo "new tests rc=$? at ${SECONDS}s" >> $OUT/tests_new.log
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/tests_new.log | cut -c1-400 | tail -40
timeout $(( $(left) - 200 )) $PYTEST tests/test_gpu_decode.py tests/test_gpu_backward.py tests/test_gpu_fp8_decode.py \
  > $OUT/tests_touched.log 2>&1; echo "touched tests rc=$? at ${SECONDS}s" >> $OUT/tests_touched.log
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/tests_touched.log | cut -c1-400 | tail -30
timeout $(( $(left) - 110 )) python3 -m cupyflash bench-decode --tree --json $OUT/tree.json > $OUT/tree.log 2>&1
echo "tree bench rc=$? at ${SECONDS}s" | tee -a $OUT/tree.log; tail -24 $OUT/tree.log | cut -c1-300
timeout $(( $(left) - 40 )) python3 -m cupyflash bench-mods --head-dims 128 --functions document_causal softcap causal \
  --json $OUT/mods.json > $OUT/mods.log 2>&1; echo "mods bench rc=$? at ${SECONDS}s" | tee -a $OUT/mods.log
grep -v "^ *warn\|Warning" $OUT/mods.log | tail -12 | cut -c1-300
timeout $(left) python3 scripts/step_timeline.py --d 64 --n 1024 --host-profile 20 > $OUT/profile.log 2>&1
echo "profile rc=$? at ${SECONDS}s"; head -70 $OUT/profile.log | cut -c1-220
