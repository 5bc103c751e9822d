#!/usr/bin/env bash
# d = 64 short forward tiles, then the document mask's efficiency: ab.py prefill of this tree,
# .ab/short34 (this tree with the short non-causal d = 64 calls on three consumers over 4
# stages: FA3_SHORT_FWD_TILES) and .ab/long34 (the long non-causal ones on that tile too), each in
# its own process; .ab/short34's d = 64 forward beside cuDNN under the three timings;
# doc_mask_efficiency.py; tune.py fa3 --short (the three-consumer 4-stage round robin among the
# candidates) with the time left.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/short64_ab_doc.sh [SECONDS [ROUNDS]]
#   carry: .whl .ab/short34 .ab/long34 (made from this tree: cupyflash and kernels_cu, the
#   tile changed in _dispatch.FA3_SHORT_FWD_TILES, and for long34 in FA3_FWD_TILES too)
set -uo pipefail
END=${1:-560} ROUNDS=${2:-3}
source scripts/pending_gpu/gpu_env.sh
timeout $(( END * 3 / 5 )) python3 scripts/ab.py prefill . .ab/short34 .ab/long34 --rounds $ROUNDS \
  --shapes bf16-64-1024-0 fp16-64-1024-0 bf16-64-4096-0 bf16-64-16384-0 > $OUT/ab.log 2>&1
echo "ab rc=$? at ${SECONDS}s"; grep -v "Warn\|warn" $OUT/ab.log | tail -22 | cut -c1-250
if [ $(( END - SECONDS )) -gt 60 ]; then  # (python -m puts the working directory, short34, first)
  (cd .ab/short34 && timeout $(( END - SECONDS )) python3 -m cupyflash bench --head-dims 64 --dtype bfloat16 \
    --backends cupyflash cudnn --json $OUT/bench64.json > $OUT/bench64.log 2>&1)
  echo "bench rc=$? at ${SECONDS}s"; grep -v "Warn\|warn" $OUT/bench64.log | tail -9 | cut -c1-200
fi
timeout $(( (END - SECONDS) * 2 / 3 )) python3 scripts/pending_gpu/doc_mask_efficiency.py $OUT/doc.json > $OUT/doc.log 2>&1
echo "doc rc=$? at ${SECONDS}s"; grep '^{' $OUT/doc.log | cut -c1-700
timeout $(( END - SECONDS )) python3 scripts/tune.py fa3 --short --head-dims 64 --json $OUT/short64b.json > $OUT/short64b.log 2>&1
echo "tune rc=$? at ${SECONDS}s"; grep '^{' $OUT/short64b.log | cut -c1-60,200-330
