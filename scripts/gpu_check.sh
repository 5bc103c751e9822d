#!/usr/bin/env bash
# The GPU check, in steps, on the GPU machine; each step logs to LOG_DIR/<step>.log.
#
#   usage: scripts/gpu_check.sh [LOG_DIR] [STEP ...]    (LOG_DIR defaults to $OUT, else gpu_logs;
#                                                        STEPS="..." works as well as arguments)
#   default steps, in this order:
#     warmup    compile every kernel variant (python -m cupyflash warmup), then list them with
#               their registers and local memory (variants.log)
#     tests     every test, the gpu ones included (TESTS: other pytest arguments, e.g. one file)
#     bench     prefill against PyTorch SDPA (python -m cupyflash bench)
#     decode    decode against PyTorch SDPA (bench-decode)
#     varlen    packed sequences against PyTorch (bench-varlen)
#     chunked   chunked prefill against a KV cache: the cache call, paged varlen, dense, SDPA
#               (bench-chunked)
#     mask      attn_mask against SDPA's efficient and cuDNN backends (bench-mask)
#     transformers  Llama-, Qwen2- and Gemma2-style models (random init, bf16) with cupyflash beside
#               SDPA and eager: 8k-token prefill time, logits, padded batches, greedy generation
#               with a DynamicCache and a StaticCache (bench-transformers; needs transformers)
#     serve     examples/serve.py (continuous batching over pages) beside the same loop on SDPA
#     host      host time per tiny call, torch and CuPy, beside SDPA (scripts/ab.py host .)
#     generate  examples/generate.py (a small GPT-style model with a paged cache)
#     sass      SASS evidence of the variants (scripts/sass_evidence.py; needs nvcc, cuobjdump)
#   on request only:
#     io        the IO study's runtime pass and its Nsight Compute pass (scripts/io_study.py;
#               IO_GROUPS: comma list of gpt2,tiles,head_dim,seqlen; docs/io_analysis.md)
#     tune      tile tuning (scripts/tune.py; TUNE: kernels, default "fa2"; any of fa2 fa3 decode)
#     sanitize  compute-sanitizer over every kernel family (scripts/sanitize.py;
#               SANITIZE_TOOLS: comma list, default memcheck,racecheck,synccheck,initcheck)
#     ab        A/B of source trees (scripts/ab.py; AB_TREES, default ". .ab/*"; AB_MODES,
#               default "prefill host"; AB_ROUNDS, default 3)
#     train     forward + backward against PyTorch SDPA (bench-train), then examples/train.py
#               (a 99M decoder trained with cupyflash and with SDPA; TRAIN_STEPS, default 500)
#     flashattn flash-attn's own test file against cupyflash.flash_attn (scripts/flash_attn_suite.sh;
#               FA_SUITE: the folder its `stage` made, default .peers/fa2tests; einops in .whl/)
#   STEP_TIMEOUT (seconds) bounds each step, so that one slow step still leaves the others' logs.
#
# The machine has no network: Python packages it lacks travel as wheels in .whl/ (see README).
# Exits 1 if any step failed.
set -uo pipefail
ALL_STEPS="warmup tests bench decode varlen chunked mask transformers serve host generate sass io tune sanitize ab train flashattn"
LOG_DIR=${OUT:-gpu_logs}
if [ $# -gt 0 ] && [[ " $ALL_STEPS " != *" $1 "* ]]; then  # the first argument is not a step
  LOG_DIR=$1
  shift
fi
STEPS=${*:-${STEPS:-warmup tests bench decode varlen chunked mask transformers serve host generate sass}}
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
cd "$(dirname "$0")/.."

# Wheels from .whl/, the checkout on PYTHONPATH, one kernel cache for the whole call.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupyflash_cache}

{
  date -u
  echo "commit: ${CUPYFLASH_COMMIT:-unknown (set CUPYFLASH_COMMIT=\$(git rev-parse HEAD))}"
  echo "steps: $STEPS"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.memory,power.limit,memory.total --format=csv
  python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)"
  python3 -m cupyflash info | head -5
} 2>&1 | tee "$LOG_DIR/env.log"

run() {  # run STEP COMMAND...: the command's output to STEP.log (appended), its status kept
  local step=$1
  shift
  ${STEP_TIMEOUT:+timeout "$STEP_TIMEOUT"} "$@" >>"$LOG_DIR/$step.log" 2>&1
}

step_warmup() {
  run warmup python3 -m cupyflash warmup --jobs 16 || return 1
  python3 -m cupyflash info >"$LOG_DIR/variants.log" 2>&1
}
step_tests() {
  # every kernel variant compiled (CUPYFLASH_COMPILE_ALL=1: 2,734 NVRTC builds, which CI's two
  # cores leave to this step) and the slow host checks in full
  # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
  CUPYFLASH_COMPILE_ALL=1 run tests python3 -m pytest -q -n 8 -p no:cacheprovider ${TESTS:-tests}
}
step_bench() { run bench python3 -m cupyflash bench --json "$LOG_DIR/bench.json"; }
step_decode() { run decode python3 -m cupyflash bench-decode --json "$LOG_DIR/bench_decode.json"; }
step_varlen() { run varlen python3 -m cupyflash bench-varlen --json "$LOG_DIR/bench_varlen.json"; }
step_chunked() { run chunked python3 -m cupyflash bench-chunked --json "$LOG_DIR/bench_chunked.json"; }
step_mask() { run mask python3 -m cupyflash bench-mask --json "$LOG_DIR/bench_mask.json"; }
step_transformers() { run transformers python3 -m cupyflash bench-transformers --json "$LOG_DIR/bench_transformers.json"; }
step_serve() { run serve python3 examples/serve.py --json "$LOG_DIR/serve.json"; }
step_host() { run host python3 scripts/ab.py host . --rounds 3; }
step_generate() { run generate python3 examples/generate.py; }
step_sass() {
  if ! command -v nvcc >/dev/null || ! command -v cuobjdump >/dev/null; then
    echo "sass: nvcc or cuobjdump missing, skipped" | tee "$LOG_DIR/sass.log"
    return 0
  fi
  run sass python3 scripts/sass_evidence.py
}
step_io() {
  local out="$LOG_DIR/io"
  mkdir -p "$out"
  # shellcheck disable=SC2086
  run io python3 scripts/io_study.py runtime --out "$out" ${IO_GROUPS:+--groups $IO_GROUPS} || return 1
  # Nsight Compute's DRAM bytes (cold L2 before each kernel, clocks untouched). ncu's CSV goes to
  # stdout (the target logs to stderr); the report keeps the quoted CSV lines.
  # shellcheck disable=SC2086
  ${STEP_TIMEOUT:+timeout "$STEP_TIMEOUT"} ncu --clock-control none --profile-from-start off \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum --csv --page raw \
    python3 scripts/io_study.py ncu-target --out "$out" ${IO_GROUPS:+--groups $IO_GROUPS} \
    >"$out/ncu.csv" 2>>"$LOG_DIR/io.log"
}
step_tune() {
  local kernel status=0
  for kernel in ${TUNE:-fa2}; do
    run tune python3 scripts/tune.py "$kernel" --json "$LOG_DIR/tune_$kernel.json" || status=1
  done
  return $status
}
step_sanitize() {
  run sanitize python3 scripts/sanitize.py --out "$LOG_DIR/sanitize" \
    ${SANITIZE_TOOLS:+--tools "$SANITIZE_TOOLS"}
}
step_train() {
  run train python3 -m cupyflash bench-train --json "$LOG_DIR/bench_train.json" || return 1
  run train python3 examples/train.py --steps "${TRAIN_STEPS:-500}" --json "$LOG_DIR/train_run.json"
}
step_flashattn() {
  run flashattn bash scripts/flash_attn_suite.sh run "${FA_SUITE:-.peers/fa2tests}" -n 12 -rfE
}
step_ab() {
  local mode status=0
  for mode in ${AB_MODES:-prefill host}; do
    # shellcheck disable=SC2086  # AB_TREES is a list of folders (a glob by default)
    run ab python3 scripts/ab.py "$mode" ${AB_TREES:-. .ab/*} --rounds "${AB_ROUNDS:-3}" || status=1
  done
  return $status
}

status=0
for step in $STEPS; do
  if ! declare -F "step_$step" >/dev/null; then
    echo "unknown step: $step (see the usage at the top of $0)" >&2
    status=1
    continue
  fi
  echo "== $step"
  if "step_$step"; then
    echo "== $step: ok"
  else
    echo "== $step: FAILED (see $LOG_DIR/$step.log)"
    status=1
  fi
  tail -n 5 "$LOG_DIR/$step.log" 2>/dev/null
done
exit $status
