#!/usr/bin/env bash
# Where the Hopper backward's time goes beside the peers' (issue 43: FlashAttention-4's backward
# 13-22% faster at N >= 4k, cuDNN's ahead at d = 128 N = 1k): Nsight Compute's detailed set over
# one backward of cupyflash, cuDNN and (where call1.sh / call2.sh staged it on this machine)
# FlashAttention-4, bf16, at d = 128 N = 16k and d = 64 N = 1k, then each report's table
# (scripts/ncu_backward.py --summary: time, throughput, tensor pipe, occupancy, registers, bank
# conflicts, top stalls per kernel). Reports stay under $OUT.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/ncu_backward.sh [SECONDS]
#   carry: .whl (and .peers/bin after call2.sh, for FlashAttention-4)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
backends="cupyflash cudnn"
if [ -f .peers/bin/fa4_env.sh ] && source .peers/bin/fa4_env.sh 2>/dev/null; then backends="$backends fa4"; fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
for shape in "128 16384" "64 1024"; do
  set -- $shape
  [ "$(left)" -gt 60 ] || break
  timeout $(( $(left) - 30 )) ncu --clock-control none --profile-from-start off --set detailed --section WarpStateStats -f -o $OUT/bwd_d$1_n$2 \
    python3 scripts/ncu_backward.py $1 $2 --backends $backends > $OUT/ncu_d$1_n$2.log 2>&1
  echo "ncu d=$1 N=$2 rc=$? at ${SECONDS}s"; grep -E "not profiled|ERR" $OUT/ncu_d$1_n$2.log | head -5
  python3 scripts/ncu_backward.py --summary $OUT/bwd_d$1_n$2.ncu-rep | tee $OUT/summary_d$1_n$2.md | cut -c1-250
done
