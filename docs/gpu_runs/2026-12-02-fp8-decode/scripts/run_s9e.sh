#!/bin/bash
# Session 9, call 5: host profile of the decode call; ncu of the small decode and the fp8 kernel's stall sources.
source .ab/common.sh
timeout 120 python3 .ab/host_prof.py > $L/host_prof.log 2>&1; echo "rc=$?" >> $L/host_prof.log
grep -E "us per call|tottime|cupyflash|torch|\{" $L/host_prof.log | head -70
python3 .ab/fp8_small.py
timeout 120 ncu --clock-control none --kernel-name regex:cf_decode_bf16_d128 --launch-skip 2 --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section WarpStateStats --section SchedulerStats python3 .ab/fp8_small.py > $L/ncu_small.log 2>&1
echo "rc=$?" >> $L/ncu_small.log
grep -E "cf_decode|Duration|DRAM Throughput|Grid Size|Waves Per SM|Achieved Occupancy|Issue Slots|Eligible Warps|Cycles Per Issued" $L/ncu_small.log
python3 .ab/fp8_prof.py
timeout 150 ncu --clock-control none --kernel-name regex:cf_decode_bf16_d128_m16_k16_w8_s3 --launch-count 1 --section SourceCounters \
  --section WarpStateStats python3 .ab/fp8_prof.py > $L/ncu_source.log 2>&1
echo "rc=$?" >> $L/ncu_source.log
sed -n '/Warp Stall Sampling/,$p' $L/ncu_source.log | head -60
cp $L/*.log $OUT/ 2>/dev/null
