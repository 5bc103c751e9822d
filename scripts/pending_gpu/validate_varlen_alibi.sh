#!/usr/bin/env bash
# One call for the two Hopper backward changes no GPU has run, when the device time left allows
# one: the built-in ALiBi on the Hopper kernels (7b3472e; validate_alibi.sh's tests, sanitizer
# and forward A/B) and packed sequences on the Hopper backward (validate_varlen_bwd.sh's tests,
# sanitizer and training step, with BEFORE_TREE's step in a second process). The benchmarks that
# take longest (bench-train, bench-mods) are left to validate_alibi.sh.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_varlen_alibi.sh [SECONDS] [BEFORE_TREE]
#   carry: .whl and BEFORE_TREE
set -uo pipefail
END=${1:-560}
BEFORE=${2:-}
ROOT=$PWD
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT 250 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short -W ignore \
  tests/test_alibi.py tests/test_flash_attn_lowlevel.py tests/test_gpu_backward.py tests/test_varlen.py \
  tests/test_gpu_sinks.py tests/test_dq_tiles_c_twin.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -25
for only in "varlen backward" alibi; do
  timeout 60 python3 scripts/sanitize.py --out "/tmp/sanitize_${only// /_}" --only "$only" --tools memcheck,racecheck \
    --lib torch --timeout 25 > "$OUT/sanitize_${only// /_}.log" 2>&1
  echo "sanitize '$only' rc=$? at ${SECONDS}s"; tail -3 "$OUT/sanitize_${only// /_}.log" | cut -c1-250
done
timeout 45 python3 - > $OUT/fwd_ab.log 2>&1 <<'PY'
# the built-in ALiBi's forward, Hopper against FA2, one process (bf16, B x N = 16k, H x d = 2048)
import torch, cupyflash
from cupyflash.bench import alibi_slopes, three_timings_ms
for d in (64, 128):
    n = 4096
    b, h = 16384 // n, 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slopes = alibi_slopes(h)
    calls = {a: (lambda a=a: cupyflash.attention(q, k, v, alibi_slopes=slopes, algorithm=a)) for a in ("fa3", "fa2")}
    diff = (calls["fa3"]().float() - calls["fa2"]().float()).abs().max().item()
    t = three_timings_ms(calls, repeat=9, warmup_ms=150.0)
    print(f"d={d} N={n} fa3/fa2 speed", [round(m["fa2"] / m["fa3"], 3) for m in t.values()], "max|diff|", diff, flush=True)
PY
echo "fwd A/B rc=$? at ${SECONDS}s"; tail -3 $OUT/fwd_ab.log
summary() {
  python3 -c "import json, sys
for r in json.load(open(sys.argv[1])):
    t = r['tflops']; names = sorted(t['interleaved'])
    print(r['shape'], r['head_dim'], 'causal' if r['causal'] else 'plain', {n: [t[k].get(n) for k in t] for n in names},
          'dgrad', r.get('max_grad_diff_vs_torch_varlen'))" "$1"
}
[ "$(left)" -gt 40 ] && timeout $(( $(left) > 120 ? 110 : $(left) - 10 )) python3 scripts/bench_varlen_train.py --quick \
  --json $OUT/after.json > $OUT/after.log 2>&1
echo "bench (this tree) rc=$? at ${SECONDS}s"; [ -f $OUT/after.json ] && summary $OUT/after.json
if [ -n "$BEFORE" ] && [ "$(left)" -gt 40 ]; then
  (cd "$BEFORE" && PYTHONPATH=$PWD:/tmp/site timeout $(( $(left) - 8 )) python3 "$ROOT/scripts/bench_varlen_train.py" \
    --quick --json $OUT/before.json > $OUT/before.log 2>&1)
  echo "bench (before) rc=$? at ${SECONDS}s"; [ -f $OUT/before.json ] && summary $OUT/before.json
fi
