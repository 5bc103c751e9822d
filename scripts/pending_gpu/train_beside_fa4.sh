#!/usr/bin/env bash
# Forward + backward beside cuDNN and FlashAttention-4 (staged: .peers/bin/fa4_stage.sh's two
# runs) under the three timings: python -m cupyflash bench-train, bf16, d = 64 and 128, N = 1k,
# 4k and 16k (4k alone with quick), causal and not. Predicted with the producer's rows on by
# default: d = 128 without a mask at N >= 4k 0.88-0.99x FA4 -> 0.95-1.05x.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/train_beside_fa4.sh [SECONDS [quick]]
#   carry: .whl .peers/fa4w .peers/bin (and .peers/fa4x2 on the staging run)
set -uo pipefail
END=${1:-240}
QUICK=${2:+--quick}
source scripts/pending_gpu/gpu_env.sh
python3 -c "from flash_attn.cute import flash_attn_func" && echo "FlashAttention-4 imports"
timeout $(( END - 10 )) python3 -m cupyflash bench-train $QUICK --backends cupyflash cudnn fa4 \
  --json $OUT/train_fa4.json > $OUT/train_fa4.log 2>&1
echo "bench-train rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/train_fa4.log | tail -14 | cut -c1-260
