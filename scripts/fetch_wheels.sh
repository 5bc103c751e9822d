#!/usr/bin/env bash
# The wheels the GPU machine lacks, into .whl/ (git-ignored; carry it with the call): asv 0.6.6 and
# everything it imports there (importlib-metadata 10 needs lazy-importer), and the array-API
# packages the JAX / array-API tests import. The machine has Python 3.12 and no network.
#   usage: scripts/fetch_wheels.sh            (in the repository root, where pip works)
# A call that uses them starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
# (scripts/gpu_check.sh and scripts/asv_gpu.sh do this themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PACKAGES=(asv==0.6.6 asv-runner json5 build tabulate virtualenv importlib-metadata lazy-importer pympler
  distlib filelock platformdirs pyproject-hooks zipp python-discovery packaging pyyaml
  array-api-compat array-api-strict)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${PACKAGES[@]}"
ls .whl
