#!/usr/bin/env bash
# Nsight Compute of the Hopper forward beside cuDNN's at d = 64 (and d = 128, N = 1k), the shapes
# issue 20 has behind cuDNN: duration, tensor-pipe and issue-slot use, warp stall reasons.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
S=docs/gpu_runs/2026-12-02-fwd-d64-profile/scripts
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $OUT/env.log 2>&1
timeout 420 ncu --clock-control none --profile-from-start off -k "regex:fa3_fwd|cudnn|sm90|flash" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
  --section LaunchStats python3 $S/fwd_ncu.py > $OUT/ncu_fwd.log 2>&1; echo "ncu rc=$?" >> $OUT/ncu_fwd.log
# Stall reasons per issued instruction and the instruction mix, N = 1k pairs (ncu_stalls.log; run as
# a separate device call, the same command, with a copy of fwd_ncu.py holding these two shapes).
timeout 300 ncu --clock-control none --profile-from-start off -k "regex:fa3_fwd|cudnn" \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_xu.sum,sm__inst_executed_pipe_fma.sum,sm__inst_executed_pipe_alu.sum" \
  python3 $S/fwd_ncu.py n1k > $OUT/ncu_stalls.log 2>&1; echo "ncu rc=$?" >> $OUT/ncu_stalls.log
grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|rc=" $OUT/ncu_fwd.log | cut -c1-110
