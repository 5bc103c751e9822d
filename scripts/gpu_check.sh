#!/usr/bin/env bash
# One call on the GPU machine: install what it lacks, warm the kernel cache, run every test
# (the `gpu` ones included), benchmark prefill, decode and varlen against PyTorch, profile the host
# path, run the generation example, and log it all.
#   usage: scripts/gpu_check.sh [LOG_DIR] [--tune]     (LOG_DIR defaults to $OUT, else gpu_logs)
# The machine has no network: Python packages it lacks travel as wheels in .whl/ (see README).
set -uo pipefail
LOG_DIR=${1:-${OUT:-gpu_logs}}
TUNE=${2:-}
mkdir -p "$LOG_DIR"
cd "$(dirname "$0")/.."

source scripts/gpu_env.sh

status=0
{
  date -u
  echo "commit: ${CUPYFLASH_COMMIT:-unknown (set CUPYFLASH_COMMIT=\$(git rev-parse HEAD))}"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.memory,power.limit --format=csv
  python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)"
  python3 -m cupyflash info | head -5
} 2>&1 | tee "$LOG_DIR/env.log"

echo "== warmup (compile every variant)"
python3 -m cupyflash warmup --jobs 16 2>&1 | tee "$LOG_DIR/warmup.log" || status=1

echo "== tests"
python3 -m pytest -q -n 8 -p no:cacheprovider tests 2>&1 | tee "$LOG_DIR/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "$TUNE" = "--tune" ]; then
  echo "== tile tuning"
  python3 scripts/tune_fa2.py --json "$LOG_DIR/tune.json" 2>&1 | tee "$LOG_DIR/tune.log"
fi

echo "== benchmark"
python3 -m cupyflash bench --json "$LOG_DIR/bench.json" 2>&1 | tee "$LOG_DIR/bench.log" || status=1
echo "== decode benchmark, host profile"
python3 -m cupyflash bench-decode --json "$LOG_DIR/bench_decode.json" > "$LOG_DIR/bench_decode.log" 2>&1 || status=1
tail -21 "$LOG_DIR/bench_decode.log"
python3 -m cupyflash bench-varlen --json "$LOG_DIR/bench_varlen.json" > "$LOG_DIR/bench_varlen.log" 2>&1 || status=1
tail -5 "$LOG_DIR/bench_varlen.log"
python3 scripts/profile_host.py > "$LOG_DIR/host_profile.log" 2>&1 || status=1
python3 examples/generate.py > "$LOG_DIR/generate.log" 2>&1 || status=1
python3 -m cupyflash info > "$LOG_DIR/variants.log" 2>&1
if command -v nvcc >/dev/null && command -v cuobjdump >/dev/null; then
  echo "== SASS evidence (nvcc + cuobjdump)"
  python3 scripts/sass_evidence.py 2>&1 | tee "$LOG_DIR/sass.log"
fi
exit $status
