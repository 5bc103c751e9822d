#!/usr/bin/env bash
# attention_varlen's score functions on a GPU: their tests (test_gpu_mods.py -k varlen: forward and
# gradients against the float64 host path, the packed Hopper backward at d = 64 / 128, the mma.sync
# one at d = 80, a learned table through autograd, torch.compile), attention_with_kvcache's mask_mod
# over the drafts (test_gpu_tree_mask.py -k mask_mod), then with the time left the packed training
# step with a score function beside its padded twin and FlexAttention (varlen_mods_bench.sh's).
#   usage (GPU machine, tree root, $OUT set): scripts/pending_gpu/validate_varlen_mods.sh [SECONDS]
#   carry: .whl   (scripts/pending_gpu/stage.sh makes it)
set -uo pipefail
END=${1:-300}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
timeout -s INT 150 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short -W ignore \
  tests/test_gpu_mods.py tests/test_gpu_tree_mask.py -k "varlen or mask_mod" > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "^FAILED|^ERROR|^E  |passed|failed" $OUT/tests.log | cut -c1-250 | head -30
[ $(( END - SECONDS )) -gt 60 ] && timeout -s INT $(( END - SECONDS - 5 )) python3 scripts/bench_varlen_train.py --quick \
  --score-mod > $OUT/varlen_mods.jsonl 2> $OUT/varlen_mods.err
echo "bench rc=$? at ${SECONDS}s"; cut -c1-700 $OUT/varlen_mods.jsonl; tail -3 $OUT/varlen_mods.err | cut -c1-300
