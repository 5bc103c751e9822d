#!/usr/bin/env bash
# Every gpu test after the launch hot-path merge and cache_batch_idx / cache_leftpad; host time
# per tiny call against d47cd8b and 42889b2 (same processes' host); decode A/B against 42889b2
# (the decode kernel's CacheSpan); where the jitted JAX call's time goes.
set -uo pipefail
source .ab/common.sh
L=$OUT
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 110 python3 -m cupyflash warmup --jobs 16 > $L/warmup.log 2>&1; echo "warmup rc=$?" >> $L/warmup.log; tail -c 150 $L/warmup.log
timeout 230 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed" $L/tests.log | tail -25
timeout 100 python3 scripts/ab.py host .ab/base .ab/t42889 . --rounds 3 --calls 2000 > $L/ab_host.log 2>&1; echo "rc=$?" >> $L/ab_host.log
tail -25 $L/ab_host.log
timeout 80 python3 scripts/ab.py decode .ab/t42889 . --rounds 3 > $L/ab_decode.log 2>&1; echo "rc=$?" >> $L/ab_decode.log
tail -15 $L/ab_decode.log
timeout 45 python3 .ab/jax_overhead.py > $L/jax_overhead.log 2>&1; echo "rc=$?" >> $L/jax_overhead.log
head -60 $L/jax_overhead.log | cut -c1-200
