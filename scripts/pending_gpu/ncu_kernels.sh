#!/usr/bin/env bash
# Where the Hopper kernels' time goes beside the peers' (issue 43: FlashAttention-4's backward
# 10-20% faster at N >= 4k, its d = 64 forward 8-20%): Nsight Compute's detailed set with the warp
# stall reasons over one forward or one backward of cupyflash, cuDNN and (where call1.sh /
# call2.sh staged it on this machine) FlashAttention-4, bf16, B x N = 16k, H x d = 2048, then each
# report's table (scripts/ncu_attention.py --summary: time, throughput, tensor pipe, occupancy,
# registers, bank conflicts, top stalls per kernel). Reports stay under $OUT.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/ncu_kernels.sh [SECONDS] [CASE ...]
#   a CASE is "PASS D N [causal]", PASS fwd or bwd; default: "fwd 64 16384" "fwd 64 16384 causal"
#   "bwd 128 16384" "bwd 64 4096"
#   carry: .whl (and .peers/bin after call2.sh, for FlashAttention-4)
set -uo pipefail
END=${1:-560}
shift || true
[ $# -gt 0 ] || set -- "fwd 64 16384" "fwd 64 16384 causal" "bwd 128 16384" "bwd 64 4096"
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
backends="cupyflash cudnn"
if [ -f .peers/bin/fa4_env.sh ] && source .peers/bin/fa4_env.sh 2>/dev/null; then backends="$backends fa4"; fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
for case in "$@"; do
  set -- $case
  [ "$(left)" -gt 60 ] || break
  pass=$1 d=$2 n=$3 causal=${4:-}
  name=${pass}_d${d}_n${n}${causal:+_causal}
  timeout $(( $(left) - 30 )) ncu --clock-control none --profile-from-start off --set detailed --section WarpStateStats \
    -f -o $OUT/$name python3 scripts/ncu_attention.py $d $n ${causal:+--causal} $([ "$pass" = fwd ] && echo --forward) \
    --backends $backends > $OUT/ncu_$name.log 2>&1
  echo "ncu $name rc=$? at ${SECONDS}s"; grep -E "not profiled|ERR" $OUT/ncu_$name.log | head -5
  python3 scripts/ncu_attention.py --summary $OUT/$name.ncu-rep | tee $OUT/summary_$name.md | cut -c1-250
done
