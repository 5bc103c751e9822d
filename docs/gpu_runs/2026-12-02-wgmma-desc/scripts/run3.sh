#!/usr/bin/env bash
# Call 4: wgmma descriptors advanced by one add per k-step (forward and backward) against the
# commit before (.ab/base as in run.sh): forward and training-step A/B beside cuDNN, the stall
# profile at N = 1k, the Hopper GPU tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/array_api*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
S=docs/gpu_runs/2026-12-02-wgmma-desc/scripts
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $OUT/env.log 2>&1
timeout 170 python3 $S/ab3.py fwd .ab/base --json $OUT/desc_fwd_ab3.json > $OUT/desc_fwd_ab3.log 2>&1; echo "rc=$?" >> $OUT/desc_fwd_ab3.log
cut -c1-400 $OUT/desc_fwd_ab3.log
timeout 150 python3 $S/ab3.py train .ab/base --json $OUT/desc_bwd_ab3.json > $OUT/desc_bwd_ab3.log 2>&1; echo "rc=$?" >> $OUT/desc_bwd_ab3.log
cut -c1-400 $OUT/desc_bwd_ab3.log
timeout 60 ncu --clock-control none --profile-from-start off -k "regex:fa3_fwd" \
  --metrics "regex:smsp__average_warps_issue_stalled_(wait|barrier|long_scoreboard|mio_throttle)_per_issue_active\.ratio,smsp__inst_executed.sum,gpu__time_duration.sum,smsp__issue_active.avg.per_cycle_active" \
  python3 docs/gpu_runs/2026-12-02-fwd-d64-profile/scripts/fwd_ncu.py n1k > $OUT/desc_ncu.log 2>&1; echo "ncu rc=$?" >> $OUT/desc_ncu.log
grep -E "fa3_fwd|duration|inst_executed|issue_active|stalled" $OUT/desc_ncu.log | cut -c1-110
timeout 200 python3 -m pytest -q -n 15 -p no:cacheprovider -rfE --tb=line tests/test_gpu_fa2.py tests/test_gpu_backward.py \
  tests/test_gpu_reliability.py tests/test_gpu_pipeline.py tests/test_varlen.py tests/test_flash_attn.py tests/test_dropout.py > $OUT/desc_tests.log 2>&1
echo "tests rc=$?" >> $OUT/desc_tests.log; tail -6 $OUT/desc_tests.log
