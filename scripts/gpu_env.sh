# Sourced by the scripts/gpu_check*.sh scripts, from the repository root, on the GPU machine:
# install the wheels that travel in .whl/ (the machine has no network; README says which), and
# put the checkout on PYTHONPATH with one kernel cache for the whole call.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupyflash_cache}
