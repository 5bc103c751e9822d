#!/usr/bin/env bash
# What no GPU has run since the packed Hopper backward (b4b788e, measured in
# docs/evidence/2026-12-06-h100-session-5/ on its packed tests only): the padded-batch backward
# through the per-row kernels' new row placement (fa2_bwd.cu's bwd_row_place: the same rows as
# before for padded batches and the mma.sync packed path, by reading), the deterministic packed
# writer's waits (5908119: turns counted over the key blocks launched; a count past a turn goes on),
# and bad offsets through the packed Hopper backward. So: the backward, sinks and varlen GPU tests,
# the bad-offset reliability tests, compute-sanitizer over the backward cases.
# Then attention_varlen's score_mod / mask_mod (the Hopper forward's packed variant with the hook,
# FA2's; the packed Hopper backward and the mma.sync one, with the rows past a sequence hidden):
# their GPU tests, the padded mma.sync backward with the hook (d = 80), and compute-sanitizer over
# their workload cases.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_bwd_rows.sh [SECONDS]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it)
set -uo pipefail
END=${1:-400}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT 230 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short -W ignore \
  tests/test_gpu_backward.py tests/test_gpu_sinks.py tests/test_varlen.py tests/test_gpu_reliability.py \
  tests/test_gpu_mods.py -k "not test_gpu_mods or varlen or (backward_matches and 80)" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -20
timeout $(( $(left) - 70 )) python3 scripts/sanitize.py --out /tmp/sanitize_bwd --only backward \
  --tools memcheck,racecheck --lib torch --timeout $(( ($(left) - 80) / 2 )) > $OUT/sanitize.log 2>&1
echo "sanitize rc=$? at ${SECONDS}s"; tail -4 $OUT/sanitize.log | cut -c1-250
timeout $(( $(left) - 5 )) python3 scripts/sanitize.py --out /tmp/sanitize_mods --only "mods varlen" \
  --tools memcheck,racecheck --lib torch --timeout $(( ($(left) - 10) / 2 )) > $OUT/sanitize_mods.log 2>&1
echo "sanitize (mods varlen) rc=$? at ${SECONDS}s"; tail -4 $OUT/sanitize_mods.log | cut -c1-250
