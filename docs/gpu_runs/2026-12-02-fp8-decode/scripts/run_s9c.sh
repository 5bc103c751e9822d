#!/bin/bash
# Session 9, call 3: float8 decode tiles (occupancy) A/B.
source .ab/common.sh
timeout 400 python3 .ab/fp8_tiles.py $L/tiles.json > $L/tiles.log 2>&1
echo "rc=$?" >> $L/tiles.log; cat $L/tiles.log | tail -30
cp $L/*.log $L/*.json $OUT/ 2>/dev/null
