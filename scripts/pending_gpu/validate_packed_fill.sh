#!/usr/bin/env bash
# Packed launches without the whole-output fill (kernels_cu/packed_fill.cu writes only the rows
# no sequence owns, first): the packed GPU tests under the NaN poison (rows after the last
# sequence, bad offsets, a sequence past max_seqlen_q, the packed backward on FA2 and Hopper, the
# score functions over packed sequences), compute-sanitizer over the new test, then the packed
# training step beside its padded twin on the tree before the change and on this one, one
# after the other (bench_varlen_train.py: the packed / padded ratio is measured in each process).
# Predicted: the packed step 4-7% faster (the fill wrote 4 bytes per element of O, dQ, dK and dV
# once more: ~90 us of a 1.2-1.5 ms step at 16k tokens), the padded twin unchanged.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_packed_fill.sh [SECONDS] [OLD_TREE]
#   carry: .whl .ab/df2e18f   (git archive df2e18f cupyflash kernels_cu | tar -x -C .ab/df2e18f)
set -uo pipefail
END=${1:-560} OLD=${2:-.ab/df2e18f}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
PYTHONPATH=$PWD:/tmp/site timeout -s INT 200 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu \
  -rf --tb=short -W ignore tests/test_varlen.py tests/test_gpu_reliability.py tests/test_gpu_pipeline.py \
  tests/test_gpu_backward.py tests/test_gpu_mods.py -k "varlen or cu_seqlens or seqused or understated or packed" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|^E  |passed|failed" $OUT/tests.log | cut -c1-250 | head -30
PYTHONPATH=$PWD:/tmp/site timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -x \
  -p no:cacheprovider -p no:benchmark -W ignore tests/test_varlen.py -k rows_outside > $OUT/memcheck.log 2>&1
echo "memcheck rc=$? at ${SECONDS}s"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.log | head -3
for tree in "$OLD" .; do
  [ "$(left)" -gt 60 ] || break
  PYTHONPATH=$PWD/$tree:/tmp/site timeout $(( ($(left) - 5) / 2 + 30 )) python3 scripts/bench_varlen_train.py --quick \
    > $OUT/train_$(basename $(realpath $tree)).jsonl 2> $OUT/train_err.log
  echo "train ($tree) rc=$? at ${SECONDS}s"; cut -c1-600 $OUT/train_$(basename $(realpath $tree)).jsonl
done
