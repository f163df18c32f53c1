#!/usr/bin/env bash
# One short run on a lent NVIDIA GPU: the core and layer tests on the GPU, then the speed study in
# bfloat16 up to L=131072 with cuDNN as the exact baseline. Results go under $OUT (default workdir/gpu).
#   bash experiments/gpu_check.sh
set -uo pipefail
OUT=${OUT:-workdir/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the GPU image lacks (ml_collections), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv;
  python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/machine.txt"
# The suite's core and layer tests on the GPU; 8 workers share it, so no preallocation.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-120}" \
  python3 -m pytest -o addopts="" -q -x -n 8 -p no:cacheprovider tests/core tests/layers 2>&1 | tail -25 | tee "$OUT/tests.txt"
timeout "${SPEED_TIMEOUT:-300}" python3 -m experiments.main --config=experiments/configs/speed.py \
  --workdir="$OUT/speed" --config.dtype=bfloat16 --config.memory=compiled \
  --config.seq_lens="(1024, 4096, 16384, 65536, 131072)" 2>&1 | grep -v "^|" | tail -60
