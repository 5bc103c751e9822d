#!/usr/bin/env bash
# Score and mask functions at d = 64 on the Hopper forward's three consumers in round robin (issue
# 40: ALiBi as a score_mod 1937 us on the two-consumer tile against the built-in ALiBi's 1526 on
# three and FlexAttention's 1408, H100, N = 4k; a document mask 3313 against FlexAttention's
# 2485 at 16k): the tile's GPU tests (every function of tests/test_gpu_mods.py and the block
# masks, whose 192-row tiles span two 128-row range blocks), then scripts/tune.py mods over d = 64's
# candidates beside FlexAttention (each candidate's rows report its builds' spill, offline:
# ALiBi none (functions reading nothing by row or key run unguarded past the sequence there),
# softcap 12-20 bytes, a document mask 4-12, a gathered bias 284). Predicted: ALiBi 15-20% faster
# than on two consumers (as the built-in ALiBi's 1526 us against 1937), softcap 5-15%, the
# document mask 5-15%.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_mods_three.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout -s INT 180 python3 -m pytest -q -n 4 -p no:cacheprovider -p no:benchmark -m gpu -rf --tb=short -W ignore \
  tests/test_gpu_mods.py tests/test_gpu_block_mask.py -k three_consumers > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
timeout $(( $(left) - 5 )) python3 scripts/tune.py mods --head-dims 64 --seqlens 4096 16384 \
  --functions alibi softcap document document_causal causal --json $OUT/tune_mods.json > $OUT/tune_mods.log 2>&1
echo "tune mods rc=$? at ${SECONDS}s"
grep "^{" $OUT/tune_mods.log | cut -c1-400 | tail -30
