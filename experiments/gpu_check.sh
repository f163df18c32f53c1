#!/usr/bin/env bash
# One short run on a lent NVIDIA GPU (about 6 minutes on an H200): the fused Pallas causal kernels compiled
# and checked against the XLA pass, the Pallas tests on the GPU, the speed study's causal configurations in
# bfloat16 (cuDNN, the XLA chunked pass, the fused kernels), then the block-size sweep. Each stage has its
# own time limit and the script goes on after a failed stage (it says so), so one run returns every result
# it can. Results go under $OUT (default workdir/gpu): log.txt, speed/ and blocks/.
#   bash experiments/gpu_check.sh
# A CPU dry run of the script itself (small sizes, Pallas interpreted):
#   SMOKE_LEN=256 SPEED_LENS="(256,)" BLOCKS_CONFIG=experiments/configs/blocks.py:quick OUT=/tmp/g bash experiments/gpu_check.sh
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

stage "smoke: fused kernels fwd+bwd against the XLA chunked pass, L=4096, float32 and bfloat16"
timeout "${SMOKE_TIMEOUT:-120}" python3 - <<'PY' 2>&1 || echo "SMOKE FAILED (exit $?)"
import time, jax, jax.numpy as jnp
from favor_jax import core
from experiments import speed
import os
q, k, v, p = speed.inputs(int(os.environ.get("SMOKE_LEN", 4096)), seed=1)
for dtype in (jnp.float32, jnp.bfloat16):
  x = tuple(a.astype(dtype) for a in (q, k, v))
  outs = {}
  for method in ("chunked", "pallas"):
    f = lambda q, k, v, m=method: core.favor_attention(q, k, v, p, causal=True, causal_method=m)
    loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) * jnp.cos(jnp.arange(64.0)))
    t0 = time.time()
    run = jax.jit(lambda *a, f=f, loss=loss: (f(*a), jax.grad(loss, argnums=(0, 1, 2))(*a)))
    out = jax.block_until_ready(run(*x))
    outs[method] = out
    print(f"{jnp.dtype(dtype).name} {method}: compiled and ran in {time.time() - t0:.1f} s")
  rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
  (o1, g1), (o2, g2) = outs["chunked"], outs["pallas"]
  print(f"  {jnp.dtype(dtype).name}: output rel. diff {rel(o2, o1):.2e}; grads q/k/v rel. diff "
        + " ".join(f"{rel(a, b):.2e}" for a, b in zip(g2, g1)))
PY

stage "Pallas tests on the GPU (compiled kernels, not the interpreter)"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-150}" \
  python3 -m pytest -o addopts="" -q -n 4 -p no:cacheprovider tests/core/test_fused.py 2>&1 | tail -30

stage "speed study: causal, bfloat16, cuDNN vs XLA chunked vs fused Pallas"
timeout "${SPEED_TIMEOUT:-200}" python3 -m experiments.main --config=experiments/configs/speed.py \
  --workdir="$OUT/speed" --config.dtype=bfloat16 --config.memory=compiled --config.causal="(True,)" \
  --config.methods="('jax_dot_product_attention', 'favor', 'favor_pallas')" \
  --config.seq_lens="${SPEED_LENS:-(1024, 4096, 16384, 65536)}" 2>&1 | grep -v "^|" | tail -60

stage "block sizes: XLA chunk size, Pallas chunk/warps/feature block"
timeout "${BLOCKS_TIMEOUT:-200}" python3 -m experiments.main --config="${BLOCKS_CONFIG:-experiments/configs/blocks.py}" \
  --workdir="$OUT/blocks" 2>&1 | grep -v "^|" | tail -80
stage "done"
