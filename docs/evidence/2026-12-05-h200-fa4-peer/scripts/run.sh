#!/usr/bin/env bash
# cupyflash beside cuDNN, PyTorch flash and FlashAttention-4 in one process, under the three timings
# of DESIGN.md, on one GPU machine in one call: the training step (bench-train) and the forward
# (bench) on the bf16 prefill shapes, and where a lone training step's time goes at N = 1k
# (scripts/step_timeline.py). FA4 staged beforehand (flash_attn.cute importable).
#   usage (GPU machine, tree root, $OUT set, after ../../../performance.md's FA4 install): run.sh [SECONDS]
set -uo pipefail
END=${1:-570}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
{ date -u; git rev-parse HEAD; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv
  python3 -c "import cupyflash, torch, cupy, flash_attn.cute as c; print(cupyflash.__file__, torch.__version__, cupy.__version__, c.__file__)"
} > $OUT/env.log 2>&1
cat $OUT/env.log
left() { echo $((END - SECONDS)); }
timeout $(left) python3 -m cupyflash bench-train --dtype bfloat16 --backends cupyflash flash cudnn fa4 \
  --json $OUT/train.json > $OUT/train.log 2>&1; echo "train rc=$? at ${SECONDS}s" | tee -a $OUT/train.log
tail -16 $OUT/train.log | cut -c1-400
for causal in "" --causal; do
  timeout $(( $(left) / 2 )) python3 scripts/step_timeline.py --d 64 --n 1024 $causal > $OUT/timeline$causal.log 2>&1
  echo "timeline$causal rc=$? at ${SECONDS}s"; grep -v "^    " $OUT/timeline$causal.log | cut -c1-300
done
timeout $(left) python3 -m cupyflash bench --dtype bfloat16 --backends cupyflash flash cudnn fa4 \
  --json $OUT/fwd.json > $OUT/fwd.log 2>&1; echo "fwd rc=$? at ${SECONDS}s" | tee -a $OUT/fwd.log
tail -16 $OUT/fwd.log | cut -c1-400
