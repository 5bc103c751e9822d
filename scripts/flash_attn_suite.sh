#!/usr/bin/env bash
# flash-attn's own test file, unchanged, against cupyflash.flash_attn (installed as `flash_attn`).
#
#   scripts/flash_attn_suite.sh stage FLASH_ATTENTION_CHECKOUT DIR   # on a machine with the checkout
#   scripts/flash_attn_suite.sh run DIR [--sample N] [pytest arguments]   # on the GPU machine
#   scripts/flash_attn_suite.sh rerun-oom DIR [WORKERS ...]   # after run: its out-of-memory cases
#
# `stage` copies four files of a flash-attention checkout into DIR: tests/test_flash_attn.py and the
# pure-Python helpers it imports besides the interface (bert_padding's pad/unpad, the rotary
# embedding and its Triton kernel), and writes DIR/conftest.py, which calls
# cupyflash.flash_attn.install() and registers the helpers under their flash_attn.* names before
# pytest imports the test file. Nothing of flash-attn's interface or kernels is used. `run`
# runs pytest there (einops and triton must be importable) and prints the outcome counts; each
# failure is also written to DIR/failures.txt as it happens (node id, the error's last line).
# The file holds about half a million cases (about 75 minutes on 14 workers of an H100); --sample N
# keeps the cases whose node id hashes (CRC-32) to 0 modulo N, the same ones on every machine and
# run, every test function represented in proportion to its cases, taken as pytest parametrizes
# each function (a sample of the collected items left each worker minutes of collecting).
# `rerun-oom` runs the cases that failed with torch.OutOfMemoryError again on fewer workers (default
# 4, then 0: one process), each round on the previous round's out-of-memory cases: many workers
# share one GPU, and the file's 131k-key cache cases (their references in float32) need several GB
# each (2026-12-06: 258 of a 1-in-25 sample on 14 workers, all passing alone). DIR/failures.txt
# then holds the run's other failures and what failed again.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
stage)
  src=$2 dir=$3
  mkdir -p "$dir"
  cp "$src/tests/test_flash_attn.py" "$dir/test_flash_attn.py"
  cp "$src/flash_attn/bert_padding.py" "$dir/_fa_bert_padding.py"
  cp "$src/flash_attn/layers/rotary.py" "$dir/_fa_layers_rotary.py"
  cp "$src/flash_attn/ops/triton/rotary.py" "$dir/_fa_ops_triton_rotary.py"
  (cd "$src" && git log -1 --format='flash-attention %H %cs' 2>/dev/null || echo "flash-attention (no git)") > "$dir/SOURCE"
  cat > "$dir/conftest.py" <<'PY'
"""cupyflash.flash_attn as `flash_attn`, with flash-attn's own pure-Python helpers under their
names (the test file imports them beside the interface)."""
import importlib.util
import sys
import types
from pathlib import Path

import cupyflash.flash_attn

cupyflash.flash_attn.install()
here = Path(__file__).parent
for name, file in [
    ("flash_attn.ops.triton.rotary", "_fa_ops_triton_rotary.py"),
    ("flash_attn.bert_padding", "_fa_bert_padding.py"),
    ("flash_attn.layers.rotary", "_fa_layers_rotary.py"),
]:
    for parent in ("flash_attn.ops", "flash_attn.ops.triton", "flash_attn.layers"):
        sys.modules.setdefault(parent, types.ModuleType(parent))
    spec = importlib.util.spec_from_file_location(name, here / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


SAMPLE = int(__import__("os").environ.get("FLASH_ATTN_SUITE_SAMPLE", "1"))


def _sampled(nodeid):
    """--sample N (scripts/flash_attn_suite.sh): the cases whose node id's CRC-32 is 0 modulo N."""
    import zlib

    return zlib.crc32(nodeid.encode()) % SAMPLE == 0


import pytest  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_generate_tests(metafunc):
    """The sample taken as each test function is parametrized, before pytest makes its items (the
    whole file's half million took each worker minutes to collect). A function none of whose
    cases is sampled keeps its first, dropped below (pytest would make an unparametrized item)."""
    yield
    calls = getattr(metafunc, "_calls", None)
    if SAMPLE > 1 and calls:
        kept = [c for c in calls if _sampled(f"{metafunc.definition.nodeid}[{c.id}]")]
        metafunc._calls = kept or calls[:1]


_worker = []


def pytest_configure(config):
    _worker.append(hasattr(config, "workerinput"))  # an xdist worker (its controller writes)


def pytest_runtest_logreport(report):
    """Each failure as it comes, into failures.txt beside this file: its node id and the error's
    last line (a run stopped by its time limit keeps them)."""
    if report.failed and not _worker[0]:
        message = str(report.longrepr).strip().splitlines()[-1:] or [""]
        with open(Path(__file__).parent / "failures.txt", "a") as f:
            f.write(f"{report.nodeid} ({report.when}) | {message[0][:300]}\n")


def pytest_collection_modifyitems(config, items):
    if SAMPLE > 1:
        chosen = [_sampled(item.nodeid) for item in items]
        config.hook.pytest_deselected(items=[item for item, keep in zip(items, chosen) if not keep])
        items[:] = [item for item, keep in zip(items, chosen) if keep]
PY
  echo "staged $(cat "$dir/SOURCE") into $dir"
  ;;
run)
  dir=$2; shift 2
  sample=1
  if [ "${1:-}" = --sample ]; then sample=$2; shift 2; fi
  cd "$dir"
  rm -f failures.txt
  # tee -i: an interrupt (timeout -s INT) stops pytest, which still prints its summary, not tee
  FLASH_ATTN_SUITE_SAMPLE=$sample PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -p no:cacheprovider -o addopts="" "$@" test_flash_attn.py \
    | tee -i pytest.log | tail -30
  ;;
rerun-oom)
  dir=$2; shift 2
  rounds=("$@"); [ ${#rounds[@]} -eq 0 ] && rounds=(4 0)
  cd "$dir"
  for workers in "${rounds[@]}"; do
    grep "OutOfMemoryError" failures.txt 2>/dev/null \
      | sed 's#^.*\(test_flash_attn.py::\)#\1#; s# (\(call\|setup\|teardown\)) |.*##' | sort -u > oom.txt
    [ -s oom.txt ] || break
    mv failures.txt "failures_before_$workers.txt"
    grep -v "OutOfMemoryError" "failures_before_$workers.txt" > failures.txt  # the other failures stay
    xdist=(-n "$workers"); [ "$workers" = 0 ] && xdist=()
    echo "rerun-oom: $(wc -l < oom.txt) out-of-memory cases again, workers: $workers (0: one process)"
    FLASH_ATTN_SUITE_SAMPLE=1 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -p no:cacheprovider \
      -o addopts="" "${xdist[@]}" $(cat oom.txt) | tee -i "pytest_oom_$workers.log" | tail -3
  done
  ;;
*) sed -n 2,13p "$0"; exit 2 ;;
esac
