#!/usr/bin/env bash
# The GPU suites of the backward with score functions, block masks and attn_mask, and the
# reliability suite's autograd, in a copy of the tree where the Hopper backward's producer copies
# each step's -LSE log2 e and D for score functions too (_dispatch.fa3_bwd_spec keeps the
# consumers' copies for them until these have passed; the other backward suites passed with the
# producer's rows: docs/evidence/2026-12-07-h100-session-17/).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_score_fn_backward.sh [SECONDS [K]]
#   K: a pytest -k expression (e.g. "backward or autograd" for the backward's tests alone)
#   carry: .whl
set -uo pipefail
END=${1:-200}
K=${2:-}
source scripts/pending_gpu/gpu_env.sh
rm -rf /tmp/rowp_mods && mkdir -p /tmp/rowp_mods && cp -r cupyflash kernels_cu tests pyproject.toml /tmp/rowp_mods/
sed -i 's/^    rows_by_producer = FA3_BWD_ROWS_BY_PRODUCER and not mods_source$/    rows_by_producer = FA3_BWD_ROWS_BY_PRODUCER/' \
  /tmp/rowp_mods/cupyflash/_dispatch.py
grep -c "^    rows_by_producer = FA3_BWD_ROWS_BY_PRODUCER$" /tmp/rowp_mods/cupyflash/_dispatch.py
(cd /tmp/rowp_mods && PYTHONPATH=/tmp/rowp_mods:/tmp/site timeout -s INT $(( END - 10 )) python3 -m pytest -q -n 8 \
  -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore ${K:+-k "$K"} tests/test_gpu_mods.py tests/test_gpu_block_mask.py \
  tests/test_gpu_attn_mask.py tests/test_gpu_reliability.py > $OUT/tests_score_fn.log 2>&1)
echo "score-function / mask / reliability suites (producer's rows) rc=$? at ${SECONDS}s"
grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_score_fn.log | cut -c1-250 | tail -10
