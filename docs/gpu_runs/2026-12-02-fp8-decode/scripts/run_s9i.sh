#!/bin/bash
source .ab/common.sh
timeout 150 python3 .ab/fp8_splits.py > $L/splits.log 2>&1; echo "rc=$?" >> $L/splits.log; cat $L/splits.log
cp $L/*.log $OUT/
