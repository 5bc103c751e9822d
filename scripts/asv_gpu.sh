#!/usr/bin/env bash
# Run the asv suite on the GPU machine and bring the results back.
#
#   scripts/asv_gpu.sh OUT_DIR COMMIT [COMMIT ...]   the named commits, in that order
#   scripts/asv_gpu.sh OUT_DIR --since-measured      main's commits (first parent) after the newest
#                                                    one with results committed on main, newest first
#
# Run from the repository root on the GPU machine, with .whl/ (asv and its needs: scripts/fetch_wheels.sh)
# and .gitbundle/cupyflash.bundle carried along: the working tree there has no git history, so
# the bundle (made here by `git bundle create .gitbundle/cupyflash.bundle --all`) gives asv the
# commits. Every commit is measured with this working tree's suite (benchmarks_asv/benchmarks:
# one benchmark version for all of them, so their results compare, and the fixed references are
# the same code at each) and its own cupyflash (an export of the commit on ASV_PYTHONPATH).
#
# Noise: a commit named twice is measured again under the machine name h200-repeat, the spread
# scripts/asv_gate.py takes its thresholds from; with --since-measured the newest commit is
# measured again right after its first run, unless its repeat is there already or ASV_REPEAT=0.
#
# Time (estimated from the H200 runs of 261e2f6 and 1661eae): a commit takes ~2.5 minutes, the
# first on a fresh machine ~1 more (NVRTC compiles the ~50 kernel variants the suite runs, into
# a kernel cache kept in .asv-gpu/). No commit is started once the time used plus the longest commit
# so far would pass ASV_BUDGET_S (default 540: one call of the GPU machine, 600 s, with room for
# the setup). Results accumulate in .asv-gpu/ (git-ignored, kept between calls while the machine
# stays warm) on top of a copy of benchmarks_asv/results, and after every commit all of them are
# packed into OUT_DIR/asv_results.tgz: unpack it with `tar xzf OUT_DIR/asv_results.tgz -C
# benchmarks_asv/results`. With --since-measured a commit with results there or in .asv-gpu/ is
# skipped, so a second call continues the range. ASV_BENCH, if set, is passed as asv's --bench regex; ASV_LAUNCH=spawn
# runs each benchmark in a spawned process instead of asv.conf.json's forkserver.
set -euo pipefail
OUT_DIR=$1
shift
[ $# -gt 0 ] || { echo "usage: $0 OUT_DIR (COMMIT [COMMIT ...] | --since-measured)" >&2; exit 2; }
ROOT=$PWD
PYTHON=${PYTHON:-python3}
BUDGET=${ASV_BUDGET_S:-540}
STATE=$ROOT/.asv-gpu
REPO=$STATE/repo
mkdir -p "$OUT_DIR" "$STATE/results"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1
# One kernel cache for every commit of every call: commits with the same kernels_cu/ share binaries.
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$STATE/kernel_cache}
command -v git >/dev/null || { echo "git is needed on the GPU machine for asv" >&2; exit 1; }
rm -rf "$REPO"
git clone -q "$ROOT/.gitbundle/cupyflash.bundle" "$REPO"
git -C "$REPO" show-ref -q --verify refs/heads/main || git -C "$REPO" branch -q main origin/main
# The committed results under those of earlier calls on this machine (which win).
tar -C "$ROOT/benchmarks_asv/results" -cf - . | tar -C "$STATE/results" -xf - --skip-old-files

CONF=$STATE/asv.conf.json
"$PYTHON" - "$ROOT" "$STATE" <<'PY'
import json, re, sys
root, state = sys.argv[1], sys.argv[2]
text = open(f"{root}/benchmarks_asv/asv.conf.json").read()
config = json.loads(re.sub(r"^\s*//.*$", "", text, flags=re.M))
config.update(repo=f"{state}/repo", benchmark_dir=f"{root}/benchmarks_asv/benchmarks",
              results_dir=f"{state}/results", html_dir=f"{state}/html")
json.dump(config, open(f"{state}/asv.conf.json", "w"), indent=1)
PY
for machine in h200 h200-repeat; do
  "$PYTHON" -m asv machine --yes --machine "$machine" --config "$CONF" >/dev/null
done

measured() {  # the commits with results on machine $1, one a line
  "$PYTHON" - "$STATE/results/$1" <<'PY'
import json, pathlib, sys
for path in pathlib.Path(sys.argv[1]).glob("*.json"):
    if path.name != "machine.json":
        print(json.loads(path.read_text())["commit_hash"])
PY
}

# The runs, as COMMIT:MACHINE, in order.
runs=()
if [ "$1" = --since-measured ]; then
  committed=" $(git -C "$REPO" ls-tree --name-only main benchmarks_asv/results/h200/ |
    sed -n 's|.*/\([0-9a-f]\{8\}\)-[^/]*\.json$|\1|p' | tr '\n' ' ') "
  done_h200=" $(measured h200 | tr '\n' ' ') "
  done_repeat=" $(measured h200-repeat | tr '\n' ' ') "
  newest=""
  for commit in $(git -C "$REPO" rev-list --first-parent main); do
    case "$committed" in *" ${commit:0:8} "*) break ;; esac
    [ -n "$newest" ] || newest=$commit
    case "$done_h200" in *" $commit "*) ;; *) runs+=("$commit:h200") ;; esac
    if [ "$commit" = "$newest" ] && [ "${ASV_REPEAT:-1}" != 0 ]; then
      case "$done_repeat" in *" $commit "*) ;; *) runs+=("$commit:h200-repeat") ;; esac
    fi
  done
  [ -n "$newest" ] || echo "== main's newest commit has results committed: nothing to measure"
else
  seen=" "
  for name in "$@"; do
    commit=$(git -C "$REPO" rev-parse "$name^{commit}")
    case "$seen" in *" $commit "*) runs+=("$commit:h200-repeat") ;; *) runs+=("$commit:h200") ;; esac
    seen="$seen$commit "
  done
fi

pack() {  # every result so far, replaced whole (a call killed while packing leaves the last one)
  tar czf "$OUT_DIR/asv_results.tgz.part" -C "$STATE/results" .
  mv "$OUT_DIR/asv_results.tgz.part" "$OUT_DIR/asv_results.tgz"
}

longest=0
left=${#runs[@]}
for run in ${runs[@]+"${runs[@]}"}; do
  commit=${run%%:*}
  machine=${run#*:}
  if [ "$longest" -gt 0 ] && [ $((SECONDS + longest)) -gt "$BUDGET" ]; then
    echo "== ${SECONDS}s used, the longest commit took ${longest}s, budget ${BUDGET}s: $left run(s) left for the next call"
    break
  fi
  src=$STATE/src
  rm -rf "$src"
  mkdir -p "$src"
  git -C "$REPO" archive "$commit" | tar -x -C "$src"
  echo "== asv: $commit as $machine (${SECONDS}s into the call)" | tee -a "$OUT_DIR/asv_run.log"
  started=$SECONDS
  status=0
  ASV_PYTHONPATH=$src "$PYTHON" -m asv run --config "$CONF" --python=same --set-commit-hash "$commit" \
    --machine "$machine" --show-stderr ${ASV_LAUNCH:+--launch-method "$ASV_LAUNCH"} \
    ${ASV_BENCH:+--bench "$ASV_BENCH"} 2>&1 | tee -a "$OUT_DIR/asv_run.log" || status=$?
  took=$((SECONDS - started))
  if [ "$took" -gt "$longest" ]; then longest=$took; fi
  left=$((left - 1))
  # asv exits 2 when a benchmark failed (an older commit may lack what the suite calls): go on.
  echo "$commit $machine ${took}s asv-exit=$status" | tee -a "$OUT_DIR/asv_summary.txt"
  pack
done
[ -f "$OUT_DIR/asv_results.tgz" ] || pack
echo "== done in ${SECONDS}s:"
cat "$OUT_DIR/asv_summary.txt" 2>/dev/null || echo "(nothing measured)"
measured=$(grep -c " h200 " "$OUT_DIR/asv_summary.txt" 2>/dev/null || true)
echo "== gate them (here): python scripts/asv_gate.py --pairs ${measured:-1}"
