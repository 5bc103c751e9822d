#!/usr/bin/env bash
# Head dims below a tile width: warmup, every gpu test, the FA2 / Hopper / peers timing per head
# dim, the decode timing per head dim.
set -uo pipefail
source .ab/common.sh
L=$OUT
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $L/env.log 2>&1
timeout 170 python3 -m cupyflash warmup --jobs 16 > $L/warmup.log 2>&1; echo "warmup rc=$?" >> $L/warmup.log; tail -c 300 $L/warmup.log
timeout 265 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed" $L/tests.log | tail -40
timeout 130 python3 scripts/tune.py head-dims --json $L/head_dims.json > $L/head_dims.log 2>&1; echo "rc=$?" >> $L/head_dims.log
tail -30 $L/head_dims.log | cut -c1-400
