#!/usr/bin/env bash
# The Hopper backward with its consumers meeting once a step (Fa3BwdSpec.decoupled: dS^T in two
# buffers, dQ's parts handed to the writer warp per consumer; off by default,
# _dispatch.FA3_BWD_DECOUPLED): the backward's GPU tests (its new decoupled cases among them),
# racecheck and synccheck over the variant at d = 64 and 128, then scripts/tune.py hopper-bwd (both
# settings per training shape, each with cuDNN, and FA4 where staged, in its rounds). Predicted:
# the backward 5-10% faster at N >= 4k (Nsight Compute: SM throughput 61% against FA4's 77%, whose
# consumers meet once a step), dK and dV bit-identical run to run as before.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_bwd_decoupled.sh [SECONDS]
#   carry: .whl (and .peers/bin after FlashAttention-4's two parts, for it beside)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -d /tmp/fa4site/nvidia_cutlass_dsl ] && [ -d .peers/fa4w ] && source .peers/bin/fa4_env.sh
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT 150 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_backward.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -15
for tool in racecheck synccheck; do
  timeout 90 compute-sanitizer --tool $tool python3 scripts/pending_gpu/race_bwd.py FA3_BWD_LATE_EXP=0 FA3_BWD_DECOUPLED=1 > $OUT/$tool.log 2>&1
  echo "$tool rc=$? at ${SECONDS}s"; grep -E "SUMMARY|^(64|128) " $OUT/$tool.log | head -4
done
timeout $(( $(left) - 5 )) python3 scripts/tune.py hopper-bwd --switch decoupled --head-dims 128 64 --json $OUT/tune_hopper_bwd.json \
  > $OUT/tune_hopper_bwd.log 2>&1
echo "tune hopper-bwd rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning\|exe_args" $OUT/tune_hopper_bwd.log | cut -c1-400 | tail -12
