#!/bin/bash
source .ab/common.sh
timeout 120 python3 .ab/host_fp8.py > $L/host_fp8.log 2>&1; echo "rc=$?" >> $L/host_fp8.log
cat $L/host_fp8.log | head -60
cp $L/*.log $OUT/
