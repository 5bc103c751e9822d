#!/bin/bash
# Session 9, call 1: the float8 decode in registers -- its tests, then the A/B.
source .ab/common.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $L/env.log 2>&1
timeout 330 python3 -m pytest -q -x -n 12 -p no:cacheprovider tests/test_gpu_fp8_decode.py tests/test_fp8_kvcache.py > $L/tests.log 2>&1
echo "tests rc=$?" >> $L/tests.log
tail -3 $L/tests.log
timeout 230 python3 .ab/fp8_ab.py $L/ab.json > $L/ab.log 2>&1
echo "ab rc=$?" >> $L/ab.log
cat $L/ab.log | tail -40
cp $L/*.log $L/*.json $OUT/ 2>/dev/null
