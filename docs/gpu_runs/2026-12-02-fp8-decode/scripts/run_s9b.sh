#!/bin/bash
# Session 9, call 2: fp8 tests, ncu of the decode kernels, the fp8 bench table.
source .ab/common.sh
timeout 200 python3 -m pytest -q -n 12 -p no:cacheprovider tests/test_gpu_fp8_decode.py tests/test_fp8_kvcache.py > $L/tests.log 2>&1
echo "tests rc=$?" >> $L/tests.log; tail -3 $L/tests.log
python3 .ab/fp8_prof.py  # compile outside ncu
timeout 200 ncu --clock-control none --kernel-name regex:cf_decode_bf16_d128 --section SpeedOfLight --section SchedulerStats \
  --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
  --section InstructionStats python3 .ab/fp8_prof.py > $L/ncu.log 2>&1
echo "ncu rc=$?" >> $L/ncu.log
grep -E "cf_decode|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Ipc|No Eligible|Stall|Warp Cycles Per Issued|Achieved Occupancy|Registers" $L/ncu.log | head -120
timeout 150 python3 -m cupyflash bench-decode --fp8 --json $L/bench_fp8.json > $L/bench_fp8.log 2>&1
echo "bench rc=$?" >> $L/bench_fp8.log; tail -16 $L/bench_fp8.log
cp $L/*.log $L/*.json $OUT/ 2>/dev/null
