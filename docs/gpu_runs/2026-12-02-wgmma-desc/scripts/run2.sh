#!/usr/bin/env bash
# Call 3: where the fixed-latency "wait" stall sits (PC sampling per SASS instruction, d = 64 and
# 128 at N = 1k, ours and cuDNN's), then asv over main's commits since the last measured one.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout 150 ncu --clock-control none --profile-from-start off -k "regex:fa3_fwd|cudnn" \
  --section SourceCounters --section WarpStateStats --import-source no --export $OUT/stall_src \
  python3 docs/gpu_runs/2026-12-02-fwd-d64-profile/scripts/fwd_ncu.py n1k > $OUT/ncu_src.log 2>&1; echo "ncu rc=$?" >> $OUT/ncu_src.log
ncu -i $OUT/stall_src.ncu-rep --page source --csv --print-source sass > $OUT/stall_sass.csv 2> $OUT/stall_sass.err
echo "page source rc=$? $(wc -c < $OUT/stall_sass.csv) bytes"; head -c 600 $OUT/stall_sass.csv; tail -3 $OUT/stall_sass.err
gzip -k $OUT/stall_sass.csv
ASV_BUDGET_S=${ASV_BUDGET_S:-380} bash scripts/asv_gpu.sh $OUT --since-measured > $OUT/asv_stdout.log 2>&1; echo "asv rc=$?" >> $OUT/asv_stdout.log
tail -25 $OUT/asv_stdout.log
