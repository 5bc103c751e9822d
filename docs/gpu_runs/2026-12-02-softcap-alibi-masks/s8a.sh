#!/usr/bin/env bash
# Issue 17 (softcap with ALiBi, masks at every head dim, an entry two appending sequences name)
# and 5b30e3e's NaN rule: warmup, the GPU tests of those paths, sanitizers on the new cases, speed.
set -uo pipefail
source .ab/common.sh
L=$OUT
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $L/env.log 2>&1
timeout 170 python3 -m cupyflash warmup --jobs 16 > $L/warmup.log 2>&1; echo "warmup rc=$?" >> $L/warmup.log; tail -c 300 $L/warmup.log
timeout 230 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_alibi.py tests/test_gpu_attn_mask.py \
  tests/test_gpu_paged_prefill.py tests/test_gpu_decode.py tests/test_gpu_reliability.py tests/test_gpu_backward.py \
  tests/test_flash_attn.py > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed" $L/tests.log | tail -30
for only in alibi-softcap batch_idx "bfloat16 mask" "'alibi': True, 'window'" ; do
  tag=$(echo "$only" | tr -c 'a-z0-9' '_')
  timeout 60 python3 scripts/sanitize.py --out $L/sanitize_$tag --only "$only" --timeout 50 > $L/sanitize_$tag.log 2>&1; echo "rc=$?" >> $L/sanitize_$tag.log
  tail -5 $L/sanitize_$tag.log
done
rm -f $L/sanitize_*/*.out
timeout 60 python3 .ab/alibi_softcap_bench.py > $L/bench_alibi_softcap.log 2>&1; echo "rc=$?" >> $L/bench_alibi_softcap.log
cat $L/bench_alibi_softcap.log
timeout 90 python3 -m cupyflash bench-mask --head-dims 128 192 256 --json $L/bench_mask.json > $L/bench_mask.log 2>&1; echo "rc=$?" >> $L/bench_mask.log
tail -c 3000 $L/bench_mask.log
