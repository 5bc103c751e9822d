#!/usr/bin/env bash
# What the pending GPU calls carry, rebuilt on the CPU machine (all of it git-ignored, so a fresh
# checkout lacks it): .whl (scripts/fetch_wheels.sh's wheels, ring-flash-attn and einops),
# .peers/fa4x1 fa4x2 fa4w bin (FlashAttention-4: ../shared/peers/fa4_pack.sh, about 5 minutes),
# .peers/fa2tests (flash-attn's test file, staged from a flash-attention checkout), .ab/t8f and
# .ab/host_ab.py (call3.sh's host A/B: the tree of 8f608e0, before the front-door redesign).
#   usage (repository root): scripts/pending_gpu/stage.sh FLASH_ATTENTION_CHECKOUT
set -euo pipefail
cd "$(dirname "$0")/../.."
checkout=${1:?a flash-attention checkout (a git repository: its HEAD is staged)}
grep -qx '/.peers/' .git/info/exclude 2>/dev/null || echo /.peers/ >> .git/info/exclude
bash scripts/fetch_wheels.sh
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl ring-flash-attn==0.1.8 einops
rm -rf .ab/t8f && mkdir -p .ab/t8f && git archive 8f608e0 cupyflash kernels_cu | tar -x -C .ab/t8f
cp docs/evidence/2026-12-05-sinks-mods-tree/scripts/host_ab.py .ab/host_ab.py
src=$(mktemp -d)
git -C "$checkout" archive HEAD tests/test_flash_attn.py flash_attn/bert_padding.py flash_attn/layers/rotary.py \
  flash_attn/ops/triton/rotary.py | tar -x -C "$src"
bash scripts/flash_attn_suite.sh stage "$src" .peers/fa2tests
git -C "$checkout" log -1 --format="flash-attention %h (%ad)" --date=short > .peers/fa2tests/SOURCE
rm -rf "$src"
bash ../shared/peers/fa4_pack.sh
du -sh .whl .peers/* .ab/t8f
