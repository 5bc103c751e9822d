#!/usr/bin/env bash
# d = 64 short forward tiles: tune.py fa3 --short (with the three-consumer 4-stage round-robin tile),
# ab.py prefill of HEAD (.ab/head), this tree (short non-causal d = 64 on three consumers, 4 stages)
# and .ab/long34 (the long calls on it too); then doc_mask_efficiency.py.
#   carry: .whl .ab/head .ab/long34
set -uo pipefail
source scripts/pending_gpu/gpu_env.sh
timeout 90 python3 scripts/tune.py fa3 --short --head-dims 64 --json $OUT/short64b.json > $OUT/short64b.log 2>&1; echo "tune rc=$? at ${SECONDS}s"
cut -c1-60,200-330 $OUT/short64b.log | grep -v Warn | tail -8
timeout 270 python3 scripts/ab.py prefill .ab/head . .ab/long34 --rounds 3 --shapes bf16-64-1024-0 fp16-64-1024-0 bf16-64-4096-0 bf16-64-16384-0 > $OUT/ab.log 2>&1; echo "ab rc=$? at ${SECONDS}s"
grep -v "Warn\|warn" $OUT/ab.log | tail -22 | cut -c1-250
timeout $((575 - SECONDS)) python3 scripts/pending_gpu/doc_mask_efficiency.py $OUT/doc.json > $OUT/doc.log 2>&1; echo "doc rc=$? at ${SECONDS}s"
grep '^{' $OUT/doc.log | cut -c1-600
