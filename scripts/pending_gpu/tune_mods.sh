#!/usr/bin/env bash
# The Hopper forward's tile with a score or mask function (issue 40): a document mask's rows see
# only their own document's keys, so its tiles are uneven, and at d = 128 without a causal term
# the call runs persistent CTAs on a static stride (FA3_FWD_TILES[128, False]). The prediction:
# the dynamic schedule (tiles drawn from a counter) balances them, the document mask's forward
# 5-15% faster (0.92-0.99x FlexAttention on ce575bb); the functions with even tiles (softcap,
# ALiBi) within noise. scripts/tune.py mods times each candidate beside FlexAttention.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/tune_mods.sh [SECONDS]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it)
set -uo pipefail
END=${1:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout $((END - SECONDS - 10)) python3 scripts/tune.py mods --head-dims 128 64 --seqlens 4096 16384 \
  --functions document document_causal alibi --json $OUT/tune_mods.json > $OUT/tune_mods.log 2>&1
echo "tune mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/tune_mods.log | cut -c1-300 | tail -24
