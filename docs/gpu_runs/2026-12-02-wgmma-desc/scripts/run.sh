#!/usr/bin/env bash
# Issue 20: the softmax max and row sum as trees (scripts/softmax_tree.diff applied to the tree) against the commit
# before. BASE=.ab/base holds `git archive HEAD~ cupyflash kernels_cu` with the package copied to
# cfbase/ (torch op namespace cfbase).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
S=docs/gpu_runs/2026-12-02-wgmma-desc/scripts
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $OUT/env.log 2>&1
timeout 240 python3 $S/ab3.py fwd .ab/base --json $OUT/fwd_ab3.json > $OUT/fwd_ab3.log 2>&1; echo "ab rc=$?" >> $OUT/fwd_ab3.log
cat $OUT/fwd_ab3.log
timeout 150 ncu --clock-control none --profile-from-start off -k "regex:fa3_fwd|cudnn" \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,gpu__time_duration.sum,smsp__issue_active.avg.per_cycle_active" \
  python3 docs/gpu_runs/2026-12-02-fwd-d64-profile/scripts/fwd_ncu.py n1k > $OUT/ncu_stalls.log 2>&1; echo "ncu rc=$?" >> $OUT/ncu_stalls.log
grep -E "fa3_fwd|cudnn|sm90|duration|inst_executed.sum|issue_active|stalled_(wait|barrier|math|mio_throttle|short|long|dispatch|not_sel|selected|no_inst)" $OUT/ncu_stalls.log | cut -c1-120
timeout 420 python3 -m pytest -q -n 15 -p no:cacheprovider tests > $OUT/tests.log 2>&1; echo "tests rc=$?" >> $OUT/tests.log
tail -15 $OUT/tests.log
