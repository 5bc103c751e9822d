#!/usr/bin/env bash
# The Hopper forward's tile with a score or mask function (issue 40): a document mask's rows see
# only their own document's keys, so its tiles are uneven, and at d = 128 without a causal term the
# call ran persistent CTAs on a static stride, which hands CTA c the query blocks c, c + 4, ... of
# each head: a band of half the sequence (2.65-2.73 ms at N = 16k against FlashAttention-4's
# 1.64-1.79, docs/evidence/2026-12-06-h100-session-7/). c2a071b gives these calls the dynamic
# schedule (d = 64's mods tile had it already). Predicted (scripts/schedule_model.py): the
# document forward 1.2-1.45x faster at N = 16k, up to 10% at 4k; ALiBi's even tiles within noise.
# scripts/tune.py mods times both d = 128 candidates beside FlexAttention in one process.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/tune_mods.sh [SECONDS]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it)
set -uo pipefail
END=${1:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout $((END - SECONDS - 10)) python3 scripts/tune.py mods --head-dims 128 --seqlens 16384 4096 \
  --functions document document_causal alibi --json $OUT/tune_mods.json > $OUT/tune_mods.log 2>&1
echo "tune mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/tune_mods.log | cut -c1-300 | tail -24
