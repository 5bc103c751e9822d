#!/usr/bin/env bash
# The built-in ALiBi (alibi_slopes) on the Hopper kernels, which no GPU has run: the forward takes
# variants.cuh's Alibi in its score hook on the plain tiles, the backward adds the bias where P^T
# is formed (softcap with ALiBi keeps the mma.sync backward). So: test_alibi's tests (every head
# dim and flag against the formula, forward and backward, both slope layouts, deterministic) and
# flash-attn's lower-level functions' (ALiBi among their options), compute-sanitizer over the
# ALiBi cases, then the timings: the Hopper forward against the FA2 one in one process
# (algorithm="fa3" / "fa2"), and the built-in ALiBi beside the same ALiBi as a score_mod and
# FlexAttention's (bench-mods; its "over built-in" column), and a training step with ALiBi beside
# the same step without it (bench-train's cupyflash_alibi). The prediction: forward + backward
# 1.6-1.8x what it was at d = 64 (the score_mod ALiBi on these kernels:
# docs/evidence/2026-12-06-h100-session-4/), the forward within 5% of FA2's at d = 64 and above it
# at d = 128.
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_alibi.sh [SECONDS]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it)
set -uo pipefail
END=${1:-560}
left() { echo $((END - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT 200 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short -W ignore \
  tests/test_alibi.py tests/test_flash_attn_lowlevel.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.log | cut -c1-250 | tail -20
timeout 150 python3 scripts/sanitize.py --out /tmp/sanitize_alibi --only alibi --tools memcheck,racecheck \
  --lib torch --timeout 70 > $OUT/sanitize.log 2>&1
echo "sanitize rc=$? at ${SECONDS}s"; tail -4 $OUT/sanitize.log | cut -c1-250
timeout 60 python3 - > $OUT/fwd_ab.log 2>&1 <<'PY'
# the built-in ALiBi's forward, Hopper against FA2, one process (bf16, B x N = 16k, H x d = 2048)
import torch, cupyflash
from cupyflash.bench import alibi_slopes, three_timings_ms
for d in (64, 128):
    for n in (4096, 16384):
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        slopes = alibi_slopes(h)
        calls = {a: (lambda a=a: cupyflash.attention(q, k, v, alibi_slopes=slopes, algorithm=a)) for a in ("fa3", "fa2")}
        diff = (calls["fa3"]().float() - calls["fa2"]().float()).abs().max().item()
        t = three_timings_ms(calls, repeat=15, warmup_ms=200.0)
        print(f"d={d} N={n} fa3/fa2 speed", [round(m["fa2"] / m["fa3"], 3) for m in t.values()], "max|diff|", diff, flush=True)
PY
echo "fwd A/B rc=$? at ${SECONDS}s"; cat $OUT/fwd_ab.log | tail -5
# a training step with ALiBi beside the same step without it and cuDNN's (N = 4k, d = 64 and 128)
timeout 150 python3 -m cupyflash bench-train --dtype bfloat16 --quick --head-dims 64 128 \
  --backends cupyflash cupyflash_alibi cudnn --json $OUT/train.json > $OUT/train.log 2>&1
echo "train rc=$? at ${SECONDS}s"; python3 -c "import json; from cupyflash.bench import ratio_range as r
for row in json.load(open('$OUT/train.json'))['training']:
    print(row['head_dim'], row['seqlen'], 'causal' if row['causal'] else 'plain', 'alibi/ours', r(row, 'cupyflash_alibi', 'cupyflash'), 'alibi/cudnn', r(row, 'cupyflash_alibi', 'cudnn'))"
[ "$(left)" -gt 80 ] && timeout $(( $(left) - 10 )) python3 -m cupyflash bench-mods --head-dims 64 128 --backward \
  --functions alibi --json $OUT/mods.json > $OUT/mods.log 2>&1
echo "mods rc=$? at ${SECONDS}s"; grep -v "^ *warn\|Warning" $OUT/mods.log | tail -9 | cut -c1-250
