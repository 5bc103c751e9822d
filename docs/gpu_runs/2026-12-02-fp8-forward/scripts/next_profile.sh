#!/usr/bin/env bash
# Prepared, not yet run (metric names as regexes: Hopper's tensor-pipe metric is not checked here): Nsight Compute of the FP8 forward beside the bf16 one (stall reasons per
# instruction, pipe utilisation, issue rate), the profile docs/fp8_forward.md names as the next
# step. Then, per instruction, the source counters for scripts/stall_ledger.py of
# docs/gpu_runs/2026-12-02-wgmma-desc/ (export the CSV as that folder's README says).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
D=docs/gpu_runs/2026-12-02-fp8-forward/scripts
timeout 240 ncu --clock-control none --profile-from-start off -k "regex:fa3_fwd|fp8_vt" \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,gpu__time_duration.sum,smsp__issue_active.avg.per_cycle_active,regex:sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_(xu|fma|alu)\.avg\.pct_of_peak_sustained_active" \
  python3 $D/fp8_ncu.py > $OUT/fp8_ncu.log 2>&1
echo "ncu rc=$?" >> $OUT/fp8_ncu.log
grep -E "fa3_fwd|fp8_vt|duration|inst_executed|issue_active|pct_of_peak|stalled_(wait|barrier|long_scoreboard|math|mio|dispatch|short|selected)" $OUT/fp8_ncu.log | cut -c1-120
