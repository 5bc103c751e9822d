#!/usr/bin/env bash
# The default path's changes since the last GPU run, validated in one call (a session with device
# time for one): the row max in four partial chains (softmax.cuh), the consumers' waits for K and V
# ahead of their ping-pong turn, the built-in ALiBi's distances in floats (variants.cuh), and
# prep's -inf / 0 in the Hopper backward's padding rows. So: the forward's GPU tests that cover
# them, the backward's (not the producer's or the decoupled variants': validate_bwd_producer_and_
# decoupled.sh), then scripts/ab.py prefill against the tree before them (.ab/1e59e7b) and the
# built-in ALiBi's tiles under both trees (cuDNN in each round as the yardstick). Predicted: the
# forward 0-3% faster at d = 64 and 128 (the row max's dependent FMNMX chain 37 -> 12 over two key
# blocks; a turn 128 -> 94 instructions at d = 128, 98 -> 50 at d = 64 causal; offline), the
# built-in ALiBi's forward 3-8% (its loop 2664 -> 2535 instructions at d = 64). With them, _dispatch.FA3_FWD_SINGLE_TILE (the forward without a mask on
# one CTA per tile): its GPU tests, and a copy of this tree with it on as a third tree of the A/B
# (its non-causal shapes; predicted -3% to +3%).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_default_path.sh [SECONDS]
#   carry: .whl .ab/1e59e7b
set -uo pipefail
END=${1:-500}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
PYTEST=(python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore)
timeout -s INT $(( END * 3 / 10 )) "${PYTEST[@]}" tests/test_softmax_verbs.py tests/test_alibi.py tests/test_gpu_pipeline.py \
  tests/test_varlen.py "tests/test_gpu_fa2.py::test_single_tile_schedule" > $OUT/tests_fwd.log 2>&1
echo "forward tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_fwd.log | cut -c1-250 | tail -8
timeout -s INT $(( END / 4 )) "${PYTEST[@]}" tests/test_gpu_backward.py tests/test_gpu_sinks.py -k "not producer and not decoupled" \
  > $OUT/tests_bwd.log 2>&1
echo "backward tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_bwd.log | cut -c1-250 | tail -8
rm -rf /tmp/single_tile && mkdir -p /tmp/single_tile && cp -r cupyflash kernels_cu /tmp/single_tile/
sed -i 's/^FA3_FWD_SINGLE_TILE = False$/FA3_FWD_SINGLE_TILE = True/' /tmp/single_tile/cupyflash/_dispatch.py
grep -c "^FA3_FWD_SINGLE_TILE = True" /tmp/single_tile/cupyflash/_dispatch.py
ab_share=$(( END >= 450 ? $(left) - 110 : $(left) - 10 ))  # (the built-in ALiBi timings only in a long call)
shapes=(bf16-64-16384-0 bf16-128-16384-0 bf16-64-4096-0 bf16-64-1024-1 bf16-128-4096-1)
[ "$END" -lt 450 ] && shapes=(bf16-64-16384-0 bf16-128-16384-0 bf16-64-4096-0)  # (each round prints as it ends)
timeout $ab_share python3 scripts/ab.py prefill .ab/1e59e7b . /tmp/single_tile --rounds 3 --shapes "${shapes[@]}" \
  > $OUT/ab.log 2>&1
echo "ab rc=$? at ${SECONDS}s"; tail -16 $OUT/ab.log | cut -c1-300
for tree in .ab/1e59e7b .; do
  budget=$(( $(left) - 5 )); [ $tree = .ab/1e59e7b ] && budget=$(( budget / 2 ))
  [ "$budget" -gt 60 ] && PYTHONPATH=$tree:/tmp/site timeout $budget python3 scripts/pending_gpu/builtin_score_tiles.py \
    --rounds 2 > $OUT/builtin_$(basename $tree).log 2>&1
  echo "builtin score tiles ($tree) rc=$? at ${SECONDS}s"; cut -c1-300 $OUT/builtin_$(basename $tree).log | tail -6
done
