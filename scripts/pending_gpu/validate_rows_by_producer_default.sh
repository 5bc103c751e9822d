#!/usr/bin/env bash
# Before the Hopper backward's producer copies each step's -LSE log2 e and D by default
# (_dispatch.FA3_BWD_ROWS_BY_PRODUCER): racecheck's 4 hazards on it (a bulk copy's write and the
# consumers' ld.shared, ordered by the ring's mbarriers) set beside a control kernel with the same
# protocol (race_bulk_control.py); the backward's suites with it on (a copy of the tree); then
# tune.py hopper-bwd at d = 64 and 128, 1k-16k, with and without the causal mask, and the
# three timings at four shapes. Predicted (after d = 128 non-causal's +8-9% in the interleaved
# timing): d = 128 causal and d = 64 0-4%.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_rows_by_producer_default.sh [SECONDS]
#   carry: .whl
set -uo pipefail
END=${1:-480}
left() { echo $((END - SECONDS)); }
source scripts/pending_gpu/gpu_env.sh
timeout 60 compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_bulk_control.py > $OUT/race_control.log 2>&1
echo "racecheck control rc=$? at ${SECONDS}s"; grep -E "^(bulk|store) |SUMMARY|Error" $OUT/race_control.log | head -8
rm -rf /tmp/rowp && mkdir -p /tmp/rowp && cp -r cupyflash kernels_cu tests pyproject.toml /tmp/rowp/
sed -i 's/^FA3_BWD_ROWS_BY_PRODUCER = False$/FA3_BWD_ROWS_BY_PRODUCER = True/' /tmp/rowp/cupyflash/_dispatch.py
grep -c "^FA3_BWD_ROWS_BY_PRODUCER = True" /tmp/rowp/cupyflash/_dispatch.py
(cd /tmp/rowp && PYTHONPATH=/tmp/rowp:/tmp/site timeout -s INT 170 python3 -m pytest -q -n 8 -p no:cacheprovider \
  -p no:benchmark -m gpu -rf --tb=short -W ignore tests/test_gpu_backward.py tests/test_varlen.py tests/test_gpu_sinks.py \
  > $OUT/tests_rowp_on.log 2>&1)
echo "backward suites (rows by producer on) rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_rowp_on.log | cut -c1-250 | tail -8
budget=$(( ($(left) - 10) * 5 / 9 ))
[ "$budget" -gt 40 ] && timeout $budget python3 scripts/tune.py hopper-bwd --switch rows_by_producer --head-dims 64 128 \
  --seqlens 1024 4096 16384 --json $OUT/tune_rowp.json > $OUT/tune_rowp.log 2>&1
echo "tune rc=$? at ${SECONDS}s"; grep '"head_dim"' $OUT/tune_rowp.log | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r['head_dim'], r['seqlen'], int(r['causal']), int(r['rows_by_producer']), 'bwd/cudnn', r.get('bwd/cudnn'), 'step/cudnn', r.get('step/cudnn'))"
budget=$(( $(left) - 5 ))
[ "$budget" -gt 30 ] && timeout $budget python3 scripts/pending_gpu/switch_three_timings.py FA3_BWD_ROWS_BY_PRODUCER \
  > $OUT/three_timings.log 2>&1
echo "three timings rc=$? at ${SECONDS}s"; grep '^{' $OUT/three_timings.log | cut -c1-400
