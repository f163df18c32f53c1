#!/usr/bin/env bash
# One command on a TPU VM (like experiments/gpu_check.sh on a GPU): the fused Pallas tests compiled for the
# TPU (tests/core/test_fused_tpu.py), the causal speed study in bfloat16 of favor_attention(causal_method=
# "pallas") against jax's TPU flash attention (jax.experimental.pallas.ops.tpu.flash_attention), its splash
# attention and our XLA chunked pass at L=4k..128k, then a chunk-size sweep (experiments/studies/tpu_blocks.py).
# Each stage has its own time limit and the script goes on after a failed stage, so one run returns every
# result it can. Results under $OUT (default workdir/tpu): speed/ and blocks/ (results.json, summary.md).
#   pip install -U "jax[tpu]" && pip install -e ".[experiments,dev]" && bash experiments/tpu_check.sh
# A CPU dry run of the script itself (small sizes, float32, every kernel in Pallas's interpreter, forward only), which
# it also is wherever jax's default backend is not a TPU (tests/experiments/test_tpu_check.py runs it):
#   TPU_CHECK_DRY_RUN=1 OUT=/tmp/t bash experiments/tpu_check.sh
set -uo pipefail
OUT=${OUT:-workdir/tpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
stage() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
BACKEND=$(python3 -c "import jax; print(jax.default_backend())" 2>/dev/null)
DRY=${TPU_CHECK_DRY_RUN:-0}
if [ "$BACKEND" != "tpu" ] && [ "$DRY" != "1" ]; then
  echo "jax's default backend is '$BACKEND', not a TPU: running the CPU dry run (small sizes, interpreted)"
  DRY=1
fi
{ date -u; python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  python3 -c "import jax; d = jax.devices()[0]; print(getattr(d, 'device_kind', d.platform))"
} 2>&1 | tee "$OUT/machine.txt"
# exact attention: our reference beside jax's TPU flash and splash kernels (jax.nn.dot_product_attention is XLA's
# whole product on a TPU, as ours), then FAVOR+
METHODS="('softmax', 'tpu_flash_attention', 'tpu_splash_attention', 'favor', 'favor_pallas')"
if [ "$DRY" = "1" ]; then
  # float32: a CPU multiplies bfloat16 slowly, and the study's error check (bfloat16 only) would compile each
  # method again; the dry run checks that every stage runs, not speed or error
  DTYPE=float32; LENS=${SPEED_LENS:-(128,)}; SIZES="--config.heads=1 --config.num_features=32 --config.repeats=1"
  PASSES="--config.passes=('fwd',)"; TESTS="--collect-only"
  BLOCKS_ARGS="--lens 64 --chunks 16 --heads 1 --num_features 32 --repeats 1 --passes fwd --dtype float32"
else
  DTYPE=bfloat16; LENS=${SPEED_LENS:-(4096, 16384, 65536, 131072)}; SIZES="--config.repeats=3"; TESTS=""
  PASSES="--config.passes=('fwd', 'fwd_bwd')"; BLOCKS_ARGS="--lens 4096,16384 --chunks 64,128,256,512"
fi

stage "Pallas tests on the TPU (the Mosaic kernels compiled; dry run: collected only)"
if [ -f tests/core/test_fused_tpu.py ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -o addopts="" -q -p no:cacheprovider $TESTS \
    tests/core/test_fused_tpu.py 2>&1 | tail -30
else
  echo "tests/core/test_fused_tpu.py is missing in this checkout: no TPU kernel tests to run"
fi

stage "speed study: causal, bfloat16, our softmax, TPU flash / splash attention vs XLA chunked vs fused Pallas"
timeout "${SPEED_TIMEOUT:-600}" python3 -m experiments.main --config=experiments/configs/speed.py \
  --workdir="$OUT/speed" --config.dtype=$DTYPE --config.memory=compiled --config.causal="(True,)" \
  --config.methods="$METHODS" --config.seq_lens="$LENS" $SIZES "$PASSES" 2>&1 | grep -v "^|" | tail -60

stage "chunk sizes: favor_attention's XLA chunked pass and causal_method='pallas'"
timeout "${BLOCKS_TIMEOUT:-300}" python3 -m experiments.studies.tpu_blocks --out "$OUT/blocks" $BLOCKS_ARGS 2>&1 \
  | grep -v '^{' | tail -40
stage "done"
