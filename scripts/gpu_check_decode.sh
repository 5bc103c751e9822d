#!/usr/bin/env bash
# One call on the GPU machine for FlashDecoding: compile every decode variant (registers and
# local memory logged), run the decode GPU tests with a quick FA2 smoke, the tile tuning, the
# decode benchmark against PyTorch SDPA and examples/generate.py, logging to LOG_DIR.
#   usage: scripts/gpu_check_decode.sh [LOG_DIR] [--tune]     (LOG_DIR defaults to $OUT, else gpu_logs)
set -uo pipefail
LOG_DIR=${1:-${OUT:-gpu_logs}}
TUNE=${2:-}
mkdir -p "$LOG_DIR"
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh

status=0
{
  date -u
  echo "commit: ${CUPYFLASH_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.memory,power.limit --format=csv
  python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
  echo "== compile the decode variants (and the FA2 ones the tests use)"
  python3 - <<'PY'
import cupy
from cupyflash import _kernels
from cupyflash._dispatch import MaskFlags, all_decode_specs, fa2_fwd_spec
smem = cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
specs = all_decode_specs() + [fa2_fwd_spec(t, d, MaskFlags(c, False, False), smem)
                              for t in ("float16", "bfloat16") for d in (64, 128, 256) for c in (False, True)]
for k in _kernels.warmup(specs, 0, workers=16):
    print(f"{k.spec.name:55} regs {k.num_regs:3} local {k.local_bytes} B  {k.compile_seconds:5.1f} s")
PY
} > "$LOG_DIR/env_compile.log" 2>&1 || status=1

echo "== tests" | tee "$LOG_DIR/tests.log"
python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gpu_decode.py tests/test_decode_xp.py \
  tests/test_gpu_fa2.py::test_long_sequence tests/test_gpu_fa2.py::test_cupy_arrays_in_cupy_out \
  >> "$LOG_DIR/tests.log" 2>&1 || status=1
tail -3 "$LOG_DIR/tests.log"

python3 -m cupyflash bench-decode --json "$LOG_DIR/bench_decode.json" > "$LOG_DIR/bench_decode.log" 2>&1 || status=1
python3 examples/generate.py > "$LOG_DIR/generate.log" 2>&1 || status=1
if [ "$TUNE" = "--tune" ]; then
  python3 scripts/tune_decode.py --json "$LOG_DIR/tune.json" > "$LOG_DIR/tune.log" 2>&1 || status=1
fi
exit $status
