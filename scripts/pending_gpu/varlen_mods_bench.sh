#!/usr/bin/env bash
# attention_varlen with a score function (ALiBi's bias as a score_mod) in a packed training step,
# beside its padded twin through attention and FlexAttention's packed documents (one sequence, a
# document mask, the same function), compiled: scripts/bench_varlen_train.py --quick --score-mod.
# Rows print as they finish (each FlexAttention shape compiles first, ~20-40 s).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/varlen_mods_bench.sh [SECONDS]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it)
set -uo pipefail
END=${1:-300}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT $(( END - SECONDS - 5 )) python3 scripts/bench_varlen_train.py --quick --score-mod \
  > $OUT/varlen_mods.jsonl 2> $OUT/varlen_mods.err
echo "bench rc=$? at ${SECONDS}s"; cut -c1-600 $OUT/varlen_mods.jsonl; tail -3 $OUT/varlen_mods.err | cut -c1-300
