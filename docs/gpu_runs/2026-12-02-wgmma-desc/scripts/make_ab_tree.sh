#!/usr/bin/env bash
# An A/B tree for ab3.py: .ab/NAME/NAME (cupyflash of COMMIT, default HEAD, renamed NAME, its torch
# op namespace NAME) beside .ab/NAME/kernels_cu, with PATCH applied (git apply -p1) if given.
#   usage: make_ab_tree.sh NAME [COMMIT] [PATCH]     (run in the repository root)
set -euo pipefail
NAME=$1 COMMIT=${2:-HEAD} PATCH=${3:-}
rm -rf ".ab/$NAME" && mkdir -p ".ab/$NAME"
git archive "$COMMIT" cupyflash kernels_cu | tar x -C ".ab/$NAME"
if [ -n "$PATCH" ]; then git apply -p1 --directory=".ab/$NAME" "$PATCH"; fi
mv ".ab/$NAME/cupyflash" ".ab/$NAME/$NAME"
sed -i "s/^_LIB = \"cupyflash\"/_LIB = \"$NAME\"/" ".ab/$NAME/$NAME/_torch_ops.py"
grep -q "^_LIB = \"$NAME\"" ".ab/$NAME/$NAME/_torch_ops.py"
