#!/usr/bin/env bash
# Paged decode: the block table read once per slice (one lane per key, pages by shuffle)
# against HEAD's read per row; then the decode / reliability gpu tests and the sanitizers on
# the kvcache cases of the new kernel.
set -uo pipefail
source .ab/common.sh
L=$OUT
for tree in .ab/tHEAD .; do
  PYTHONPATH=$tree:/tmp/site timeout 75 python3 .ab/paged_ab.py $PWD > $L/paged_$(basename $tree).log 2>&1
  echo "rc=$?" >> $L/paged_$(basename $tree).log; cut -c1-600 $L/paged_$(basename $tree).log
done
timeout 120 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests/test_gpu_decode.py tests/test_gpu_reliability.py tests/test_gpu_pipeline.py tests/test_transformers.py tests/test_flash_attn.py > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed" $L/tests.log | tail -20
timeout 110 python3 scripts/sanitize.py --out $L/sanitize --only kvcache --tools memcheck,racecheck --timeout 50 > $L/sanitize.log 2>&1; echo "sanitize rc=$?" >> $L/sanitize.log
tail -4 $L/sanitize.log
rm -f $L/sanitize/*.out
