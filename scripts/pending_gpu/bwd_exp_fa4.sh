#!/usr/bin/env bash
# Right after validate_bwd_exp.sh, on the same machine with FlashAttention-4's two parts staged:
# scripts/tune.py hopper-bwd --switch dq_first with FA4 in every setting's rounds (the backward
# with its exponentials under dP^T, and with dK issued after dQ as well, dQ staged under dK;
# predicted +3-8% more), Nsight Compute over
# one d = 128 backward of cupyflash and of FA4, then issue 41's small-batch cascade
# (cascade_small.py) with the time left. Without FA4 on the machine, validate_mods_schedule.sh.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/bwd_exp_fa4.sh [SECONDS]
#   carry: .whl .peers/bin (.peers/fa4x2 .peers/fa4w for FA4's second part)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
[ -d /tmp/fa4site/nvidia_cutlass_dsl ] && [ -d .peers/fa4w ] || exec bash scripts/pending_gpu/validate_mods_schedule.sh "$END"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
source .peers/bin/fa4_env.sh
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout $(( $(left) - 200 )) python3 scripts/tune.py hopper-bwd --switch dq_first --head-dims 128 64 \
  --seqlens 4096 16384 --json $OUT/tune_hopper_bwd_fa4.json > $OUT/tune_hopper_bwd_fa4.log 2>&1
echo "tune hopper-bwd rc=$? at ${SECONDS}s"
grep -v "^ *warn\|Warning\|exe_args" $OUT/tune_hopper_bwd_fa4.log | cut -c1-420 | tail -18
timeout 120 ncu --clock-control none --profile-from-start off --set detailed --section WarpStateStats \
  -f -o $OUT/bwd_d128_n4096_fa4 python3 scripts/ncu_attention.py 128 4096 --backends cupyflash fa4 > $OUT/ncu.log 2>&1
echo "ncu rc=$? at ${SECONDS}s"
python3 scripts/ncu_attention.py --summary $OUT/bwd_d128_n4096_fa4.ncu-rep | tee $OUT/summary_bwd_fa4.md | cut -c1-250
[ "$(left)" -gt 30 ] && timeout $(( $(left) - 5 )) python3 scripts/pending_gpu/cascade_small.py > $OUT/cascade_small.log 2>&1
echo "cascade_small rc=$? at ${SECONDS}s"; cat $OUT/cascade_small.log | cut -c1-400
