#!/usr/bin/env bash
# The IO study's GPU call: compile the FA1 / naive variants, run their `gpu` tests and an FA2
# smoke test, then the study's runtime pass and its Nsight Compute pass, logging to a folder.
#   usage: scripts/gpu_check_io.sh [LOG_DIR] [STEPS] [GROUPS]
#     LOG_DIR defaults to $OUT; STEPS is a comma list of tests,runtime,ncu (default: all);
#     GROUPS limits the ncu pass to some study groups (gpt2,tiles,head_dim,seqlen; default all).
# Each step has its own time limit so that one slow step still leaves the others' logs.
set -uo pipefail
LOG_DIR=${1:-${OUT:-gpu_logs}}
STEPS=${2:-tests,runtime,ncu}
GROUPS_ARG=${3:+--groups $3}
mkdir -p "$LOG_DIR"
cd "$(dirname "$0")/.."

source scripts/gpu_env.sh
status=0
has() { [[ ",$STEPS," == *",$1,"* ]]; }

{
  date -u
  echo "commit: ${CUPYFLASH_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.memory,memory.total --format=csv
  python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
  ncu --version | tail -1
  echo "== warmup: FA1 (this device's tiles, the tile study), naive softmax, FA2 of the study"
  timeout 90 python3 - <<'PY'
import time, cupy
from cupyflash import _kernels
from cupyflash._dispatch import all_fa1_fwd_specs, all_naive_softmax_specs, fa2_fwd_spec, MaskFlags
smem = cupy.cuda.Device(0).attributes["MaxSharedMemoryPerBlockOptin"]
specs = all_fa1_fwd_specs(smem) + all_naive_softmax_specs()
specs += [fa2_fwd_spec("float16", d, MaskFlags(c, False, False), smem) for d in (64, 128, 256) for c in (False, True)]
start = time.perf_counter()
done = _kernels.warmup(specs, 0, workers=16)
print(f"{len(done)} variants in {time.perf_counter() - start:.1f} s; max smem/block {smem}")
for k in done:
    if k.local_bytes:
        print("SPILL", k.spec.name, k.local_bytes)
PY
} 2>&1 | tee "$LOG_DIR/env.log"

if has tests; then
  echo "== tests: baselines (all), FA2 smoke"
  timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gpu_baselines.py \
    "tests/test_gpu_fa2.py::test_fa2_matches_reference" -k "not test_fa2 or square" 2>&1 | tee "$LOG_DIR/tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has runtime; then
  echo "== study: runtimes, peak memory, naive's out-of-memory N, FA2 at N = 1,048,576"
  timeout ${RUNTIME_TIMEOUT:-150} python3 scripts/io_study.py runtime --out "$LOG_DIR" $GROUPS_ARG 2>&1 | tee "$LOG_DIR/study.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has ncu; then
  echo "== study: Nsight Compute DRAM bytes (cold L2 before each kernel, clocks untouched)"
  # ncu's CSV goes to stdout (the target logs to stderr); the parser keeps the quoted CSV lines.
  timeout ${NCU_TIMEOUT:-200} ncu --clock-control none --profile-from-start off \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum --csv --page raw \
    python3 scripts/io_study.py ncu-target --out "$LOG_DIR" $GROUPS_ARG >"$LOG_DIR/ncu.csv" 2>"$LOG_DIR/ncu_target.log"
  rc=$?
  tail -5 "$LOG_DIR/ncu_target.log"; grep -c '^"' "$LOG_DIR/ncu.csv"; head -3 "$LOG_DIR/ncu.csv" | cut -c1-400
  [ $rc -eq 0 ] || status=1
fi
exit $status
