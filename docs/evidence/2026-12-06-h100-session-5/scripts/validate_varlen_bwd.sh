#!/usr/bin/env bash
# The Hopper backward over packed sequences (Fa3BwdTraits::Varlen), which no GPU has run: the
# packed tests (each sequence's gradients against float64 under every option the kernel takes,
# a NaN-holding neighbour, empty and one-token sequences, deterministic, a sequence longer than
# max_seqlen_k reported), compute-sanitizer over the packed backward cases, then a training step
# over packed sequences (scripts/bench_varlen_train.py) on this tree and, with BEFORE_TREE (the
# commit before, where packed sequences took the mma.sync backward), on that one in a second
# process. The prediction: 16 x 1k packed within 5% of its padded twin on cupyflash; 1.5-2x the
# mma.sync backward's step.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_varlen_bwd.sh [SECONDS] [BEFORE_TREE]
#   carry: .whl (scripts/pending_gpu/stage.sh makes it) and BEFORE_TREE (git archive of that commit)
set -uo pipefail
END=${1:-560}
BEFORE=${2:-}
ROOT=$PWD
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
git_commit=$(cat COMMIT 2>/dev/null || echo "working tree"); echo "tree: $git_commit" | tee -a $OUT/env.log
timeout -s INT 230 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short -W ignore \
  tests/test_gpu_backward.py tests/test_varlen.py tests/test_alibi.py tests/test_flash_attn_lowlevel.py \
  tests/test_gpu_sinks.py tests/test_dq_tiles_c_twin.py -k "varlen or packed or seqused or twin" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -20
timeout 110 python3 scripts/sanitize.py --out /tmp/sanitize_varlen --only "varlen backward" --tools memcheck,racecheck \
  --lib torch --timeout 50 > $OUT/sanitize.log 2>&1
echo "sanitize rc=$? at ${SECONDS}s"; tail -4 $OUT/sanitize.log | cut -c1-250
summary() {
  python3 -c "import json, sys
for r in json.load(open(sys.argv[1])):
    t = r['tflops']; names = sorted(t['interleaved'])
    print(r['shape'], r['head_dim'], 'causal' if r['causal'] else 'plain', {n: [t[k].get(n) for k in t] for n in names},
          'dgrad', r.get('max_grad_diff_vs_torch_varlen'))" "$1"
}
timeout $(( $(left) > 150 ? 140 : $(left) - 10 )) python3 scripts/bench_varlen_train.py --quick --json $OUT/after.json \
  > $OUT/after.log 2>&1
echo "bench (this tree) rc=$? at ${SECONDS}s"; [ -f $OUT/after.json ] && summary $OUT/after.json
if [ -n "$BEFORE" ] && [ "$(left)" -gt 60 ]; then
  (cd "$BEFORE" && PYTHONPATH=$PWD:/tmp/site timeout $(( $(left) - 10 )) python3 "$ROOT/scripts/bench_varlen_train.py" \
    --quick --json $OUT/before.json > $OUT/before.log 2>&1)
  echo "bench (before) rc=$? at ${SECONDS}s"; [ -f $OUT/before.json ] && summary $OUT/before.json
fi
