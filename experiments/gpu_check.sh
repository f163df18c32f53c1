#!/usr/bin/env bash
# One short run on a lent NVIDIA GPU (under 9 minutes on an H200): the fused Pallas tests with the kernels
# compiled by Triton (gated and packed calls included), the speed study's causal configurations in bfloat16
# (cuDNN, the XLA chunked pass, the fused kernels) to L=131072, a gated row (FAVOR+ with a forget gate, XLA
# chunked vs the fused kernels), then the block-size sweep. Each stage has its own time limit (the stage limits
# sum to 9 minutes) and the script goes on after a failed stage, so one run returns every result it can.
# Results go under $OUT (default workdir/gpu): speed/, speed_gated/ and blocks/ (each: results.json,
# summary.md, a plot).
#   bash experiments/gpu_check.sh
# A CPU dry run of the script itself (small sizes, Pallas interpreted):
#   SPEED_LENS="(256,)" GATED_LENS="(256,)" BLOCKS_CONFIG=experiments/configs/blocks.py:quick OUT=/tmp/g \
#     bash experiments/gpu_check.sh
set -uo pipefail
OUT=${OUT:-workdir/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the GPU image lacks (ml_collections), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
stage() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv;
  python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1

stage "Pallas tests on the GPU (compiled kernels, not the interpreter)"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-90}" \
  python3 -m pytest -o addopts="" -q -n 4 -p no:cacheprovider tests/core/test_fused.py 2>&1 | tail -30

stage "speed study: causal, bfloat16, our softmax and cuDNN vs XLA chunked vs fused Pallas"
timeout "${SPEED_TIMEOUT:-240}" python3 -m experiments.main --config=experiments/configs/speed.py \
  --workdir="$OUT/speed" --config.dtype=bfloat16 --config.memory=compiled --config.causal="(True,)" \
  --config.methods="('softmax', 'jax_dot_product_attention', 'favor', 'favor_pallas')" \
  --config.seq_lens="${SPEED_LENS:-(4096, 16384, 65536, 131072)}" --config.repeats=3 2>&1 | grep -v "^|" | tail -60

stage "gated speed row: FAVOR+ with a forget gate, XLA chunked vs fused Pallas (gates in the kernels)"
timeout "${GATED_TIMEOUT:-90}" python3 -m experiments.main --config=experiments/configs/speed.py \
  --workdir="$OUT/speed_gated" --config.dtype=bfloat16 --config.memory=compiled --config.causal="(True,)" \
  --config.methods="('favor_gated', 'favor_pallas_gated')" \
  --config.seq_lens="${GATED_LENS:-(16384, 65536)}" --config.repeats=3 2>&1 | grep -v "^|" | tail -30

stage "block sizes: XLA chunk size, Pallas chunk/warps/feature block"
timeout "${BLOCKS_TIMEOUT:-120}" python3 -m experiments.main --config="${BLOCKS_CONFIG:-experiments/configs/blocks.py}" \
  --workdir="$OUT/blocks" 2>&1 | grep -v "^|" | tail -80
stage "done"
