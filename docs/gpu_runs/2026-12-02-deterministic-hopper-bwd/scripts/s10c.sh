#!/usr/bin/env bash
# Sanitizers on the deterministic d = 64 summed-dQ path (many key blocks), then Nsight Compute of
# the Hopper backward beside cuDNN's backward on four bf16 shapes.
set -uo pipefail
source .ab/common.sh
L=$OUT
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $L/env.log 2>&1
{
  echo "== sanitize --only 'many key blocks'"
  timeout 120 python3 scripts/sanitize.py --out /tmp/san --only "many key blocks" --timeout 60; echo "rc=$?"
  grep -h "sanitize workload:" /tmp/san/*.out
} > $L/sanitize.log 2>&1
cat $L/sanitize.log
timeout 330 ncu --clock-control none --profile-from-start off -k "regex:fa3_bwd|cudnn|sm90|bwd|dq|prep" \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
  python3 .ab/bwd_ncu.py > $L/ncu.log 2>&1; echo "ncu rc=$?" >> $L/ncu.log
grep -E "^  [a-z_A-Z].*\(|Duration|Compute \(SM\) Throughput|DRAM Throughput|Issue Slots Busy|Registers Per|Block Size|Grid Size|Warp Cycles Per Issued|No Eligible|Achieved Occupancy|Executed Ipc A|Dynamic Shared|done|rc=" $L/ncu.log | head -150
