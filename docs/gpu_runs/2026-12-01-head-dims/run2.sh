#!/usr/bin/env bash
# Head dims (2): the JAX route's gpu tests and timing, decode per head dim, the sanitizers over
# the head-dim cases, the forward/backward/varlen/decode gpu tests again (d = 96, 192 now on the
# Hopper kernel by default).
set -uo pipefail
source .ab/common.sh
L=$OUT
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 110 python3 -m cupyflash warmup --jobs 16 > $L/warmup.log 2>&1; echo "warmup rc=$?" >> $L/warmup.log; tail -c 200 $L/warmup.log
timeout 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_jax.py tests/test_jax.py > $L/jax_tests.log 2>&1; echo "rc=$?" >> $L/jax_tests.log
tail -25 $L/jax_tests.log
timeout 40 python3 scripts/jax_jit_bench.py --dtype bfloat16 --shapes small > $L/jax_bench.log 2>&1; echo "rc=$?" >> $L/jax_bench.log
tail -15 $L/jax_bench.log
timeout 150 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests/test_gpu_fa2.py tests/test_gpu_backward.py tests/test_varlen.py tests/test_gpu_decode.py tests/test_hopper_host.py > $L/tests.log 2>&1; echo "tests rc=$?" >> $L/tests.log
grep -E "FAILED|ERROR|passed|failed" $L/tests.log | tail -20
timeout 50 python3 .ab/decode_dims.py > $L/decode_dims.log 2>&1; echo "rc=$?" >> $L/decode_dims.log
cat $L/decode_dims.log | cut -c1-300
timeout 140 python3 scripts/sanitize.py --out $L/sanitize --only headdim --timeout 60 > $L/sanitize.log 2>&1; echo "sanitize rc=$?" >> $L/sanitize.log
tail -8 $L/sanitize.log
rm -f $L/sanitize/*.out
