#!/usr/bin/env bash
# The packed paths on a GPU: attention_varlen's score functions (test_gpu_mods.py -k varlen:
# forward and gradients against the float64 host path, the packed Hopper backward at d = 64 / 128,
# the mma.sync one at d = 80, a learned table through autograd, torch.compile),
# attention_with_kvcache's mask_mod over the drafts (test_gpu_tree_mask.py -k mask_mod), and the
# packed launches' first step (kernels_cu/packed_fill.cu: the rows no sequence owns, in place of a
# fill of the whole output) under the NaN poison: rows after the last sequence, bad offsets, a
# sequence past max_seqlen_q, the packed backward on FA2 and Hopper; memcheck over its test; then
# the packed training step beside its padded twin on the tree before the packed fill (OLD_TREE)
# and on this one, one process each (bench_varlen_train.py --quick; the packed / padded ratio is
# measured within each process). Predicted: the packed step 4-7% faster (the fill wrote 4 bytes
# per element of O, dQ, dK and dV once more: ~90 us of a 1.2-1.5 ms step at 16k tokens), the
# padded twin unchanged.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_varlen_mods.sh [SECONDS] [OLD_TREE]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it); OLD_TREE (default ab_old, untracked:
#   git archive df2e18f cupyflash kernels_cu | tar -x -C ab_old) travels with the working tree
set -uo pipefail
END=${1:-300} OLD=${2:-ab_old}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
PYTHONPATH=$PWD:/tmp/site timeout -s INT 170 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -rf \
  --tb=short -W ignore tests/test_gpu_mods.py tests/test_gpu_tree_mask.py tests/test_varlen.py \
  tests/test_gpu_reliability.py tests/test_gpu_pipeline.py tests/test_gpu_backward.py \
  -k "varlen or mask_mod or cu_seqlens or seqused or understated or packed" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|^E  |passed|failed" $OUT/tests.log | cut -c1-250 | head -30
PYTHONPATH=$PWD:/tmp/site timeout 45 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -x \
  -p no:cacheprovider -p no:benchmark -W ignore tests/test_varlen.py -k "rows_outside and d64" > $OUT/memcheck.log 2>&1
echo "memcheck rc=$? at ${SECONDS}s"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.log | head -3
for tree in "$OLD" .; do
  [ -d "$tree/cupyflash" ] && [ "$(left)" -gt 40 ] || continue
  name=$([ "$tree" = . ] && echo new || echo old)
  PYTHONPATH=$PWD/$tree:/tmp/site timeout $(( $(left) / 2 + 10 )) python3 scripts/bench_varlen_train.py --quick \
    > $OUT/train_$name.jsonl 2> $OUT/train_$name.err
  echo "train ($name) rc=$? at ${SECONDS}s"; cut -c1-500 $OUT/train_$name.jsonl
done
