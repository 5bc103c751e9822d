#!/bin/bash
source .ab/common.sh
timeout 120 python3 .ab/host_diag.py > $L/host_diag.log 2>&1; echo "rc=$?" >> $L/host_diag.log; cat $L/host_diag.log
cp $L/*.log $OUT/
