#!/usr/bin/env bash
# Issue 41: the one-launch cascade's kernel time by part (own keys 512 / 16) and by tile (16 or 32
# packed rows), beside the flat paged call, then Nsight Compute over both kernels at B = 64 over
# a 32k prefix. Logs under $OUT.   carry: .whl
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout 240 python3 docs/evidence/2026-12-07-h100-session-9/scripts/cascade_profile.py 2>&1 | tee $OUT/profile.log | tail -20
timeout 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
  --section SchedulerStats python3 docs/evidence/2026-12-07-h100-session-9/scripts/cascade_ncu.py 64 32768 > $OUT/ncu.txt 2>&1
echo "ncu rc=$?"
grep -E "decode_partial|Duration|Throughput|Pipe|Warp Cycles Per Issued|Achieved Occ|Theoretical Occ|Registers Per|Eligible Warps|Issued Warp|No Eligible|Block Limit" $OUT/ncu.txt | head -80
