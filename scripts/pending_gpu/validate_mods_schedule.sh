#!/usr/bin/env bash
# The first call of the next session (any machine, no FlashAttention-4). c2a071b runs the Hopper
# forward with a score or mask function at d = 128 without a bound on the dynamic schedule (the
# static stride handed each CTA a band of half the sequence's query blocks: a document mask's
# forward 2.65-2.73 ms at N = 16k against FlashAttention-4's 1.64-1.79). So: the score-function
# and block-mask GPU tests (their d = 128 cases now on the dynamic tile), then scripts/tune.py mods
# (both d = 128 candidates beside FlexAttention, one process; predicted by
# scripts/schedule_model.py: the document forward 1.2-1.45x faster at N = 16k, up to 10% at 4k,
# ALiBi's even tiles within noise), then the gallery's forward + backward with the time left.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_mods_schedule.sh [SECONDS]
#   carry: .whl   (scripts/fetch_wheels.sh makes it)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT 180 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_mods.py tests/test_gpu_block_mask.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -20
timeout $(( $(left) * 2 / 3 )) python3 scripts/tune.py mods --head-dims 128 --seqlens 16384 4096 \
  --functions document alibi --json $OUT/tune_mods.json > $OUT/tune_mods.log 2>&1
echo "tune mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/tune_mods.log | cut -c1-300 | tail -10
[ "$(left)" -gt 60 ] && timeout $(( $(left) - 5 )) python3 -m cupyflash bench-mods --backward --head-dims 128 \
  --functions document document_causal sliding_window softcap --json $OUT/mods.json > $OUT/mods.log 2>&1
echo "bench-mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning\|exe_args" $OUT/mods.log | cut -c1-300 | tail -12
