# Sourced by the pending GPU scripts (GPU machine, tree root, $OUT set): the carried wheels into
# /tmp/site, FlashAttention-4 on the path where its two parts are staged and .peers/fa4w came
# along, cupyflash's tree and the wheels on PYTHONPATH, and the GPU and driver into $OUT/env.log.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
if [ -d /tmp/fa4site/nvidia_cutlass_dsl ] && [ -d .peers/fa4w ] && [ -d .peers/bin ]; then
  source .peers/bin/fa4_env.sh
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupyflash_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.log
