#!/usr/bin/env bash
# Run the asv suite on the GPU machine for one or more commits and bring the results back.
#
#   scripts/asv_gpu.sh OUT_DIR COMMIT [COMMIT ...]
#
# Run from the repository root on the GPU machine, with .whl/ (asv and its needs, see README)
# and .gitbundle/cupyflash.bundle carried along: the working tree there has no git history, so
# the bundle (made here by `git bundle create .gitbundle/cupyflash.bundle --all`) gives asv the
# commits. Each commit is measured from its own checkout, with its own benchmarks. A commit
# named twice is measured again under the machine name h200-repeat: the noise measurement
# scripts/asv_gate.py reads. The results come back as OUT_DIR/asv_results.tgz. ASV_BENCH, if set,
# is passed as asv's --bench regex (a run of part of the suite when device time is short).
set -euo pipefail
OUT_DIR=$1
shift
ROOT=$PWD
PYTHON=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1
command -v git >/dev/null || { echo "git is needed on the GPU machine for asv" >&2; exit 1; }
rm -rf /tmp/cf-repo /tmp/asv-results
git clone -q "$ROOT/.gitbundle/cupyflash.bundle" /tmp/cf-repo
git -C /tmp/cf-repo config user.email asv@localhost
git -C /tmp/cf-repo config user.name asv

seen=""
for commit in "$@"; do
  full=$(git -C /tmp/cf-repo rev-parse "$commit")
  src=/tmp/cf-src-${full:0:12}
  [ -d "$src" ] || git -C /tmp/cf-repo worktree add -q --detach "$src" "$full"
  machine=h200
  case " $seen " in *" $full "*) machine=h200-repeat ;; esac
  seen="$seen $full"
  conf=/tmp/asv-${full:0:12}.json
  "$PYTHON" - "$src" "$conf" <<'PY'
import json, re, sys
src, conf = sys.argv[1], sys.argv[2]
text = open(f"{src}/benchmarks_asv/asv.conf.json").read()
config = json.loads(re.sub(r"^\s*//.*$", "", text, flags=re.M))
config.update(repo="/tmp/cf-repo", benchmark_dir=f"{src}/benchmarks_asv/benchmarks",
              results_dir="/tmp/asv-results", html_dir="/tmp/asv-html")
json.dump(config, open(conf, "w"), indent=1)
PY
  "$PYTHON" -m asv machine --yes --machine "$machine" --config "$conf" >/dev/null
  echo "== asv: $commit ($full) as $machine"
  ASV_PYTHONPATH=$src "$PYTHON" -m asv run --config "$conf" --python=same --set-commit-hash "$full" \
    --machine "$machine" --show-stderr ${ASV_BENCH:+--bench "$ASV_BENCH"} 2>&1 | tee -a "$OUT_DIR/asv_run.log"
done
tar czf "$OUT_DIR/asv_results.tgz" -C /tmp/asv-results .
