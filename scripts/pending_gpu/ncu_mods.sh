#!/usr/bin/env bash
# Where a score function's forward spends its time beside FlexAttention's (issue 40: the document
# mask's forward at d = 64 0.75-0.86x FlexAttention, ALiBi as a score_mod 0.74-0.80x the built-in
# ALiBi): Nsight Compute's detailed set with the warp stall reasons over one forward of each
# (scripts/ncu_attention.py --mods), then each report's table. Reports stay under $OUT.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/ncu_mods.sh [SECONDS] [CASE ...]
#   a CASE is "FUNCTION D N"; default: "document 64 4096" "document 64 16384" "alibi 64 4096"
#   carry: .whl
set -uo pipefail
END=${1:-560}
shift || true
[ $# -gt 0 ] || set -- "document 64 4096" "document 64 16384" "alibi 64 4096"
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
for case in "$@"; do
  set -- $case
  [ "$(left)" -gt 40 ] || break
  name=mods_$1_d$2_n$3
  timeout $(( $(left) - 20 )) ncu --clock-control none --profile-from-start off --set detailed --section WarpStateStats \
    -f -o $OUT/$name python3 scripts/ncu_attention.py $2 $3 --mods $1 > $OUT/ncu_$name.log 2>&1
  echo "ncu $name rc=$? at ${SECONDS}s"; grep -E "not profiled|Error|ERR" $OUT/ncu_$name.log | head -5
  [ -f $OUT/$name.ncu-rep ] && python3 scripts/ncu_attention.py --summary $OUT/$name.ncu-rep | cut -c1-400
done
