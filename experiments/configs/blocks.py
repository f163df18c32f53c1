"""Block sizes of the causal pass (XLA chunk size; fused Pallas kernels' chunk, warps, feature block).

    # on a GPU (experiments/gpu_check.sh runs it); the GPU defaults in favor_jax.core.fused come from it:
    python -m experiments.main --config=experiments/configs/blocks.py --workdir=workdir/blocks \
        --config.dtype=bfloat16
    python -m experiments.main --config=experiments/configs/blocks.py:quick --workdir=/tmp/b   # CPU smoke
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  """The sweep; ``arg="quick"``: a CPU smoke version (Pallas interpreted, tiny shapes, seconds)."""
  quick = common.is_quick(arg)
  config = ml_collections.ConfigDict()
  config.experiment = "blocks"  # which study experiments.main runs
  config.quick = quick  # True: the quick version (FILE.py:quick); set on the full one, asks for it
  config.batch = 1  # B
  config.heads = 8  # H
  config.head_dim = 64  # D (= Dv)
  config.num_features = 256  # M, projection rows (FAVOR+: F = M)
  config.dtype = "bfloat16"  # input dtype (the speed study's GPU setting)
  config.seq_lens = (4096, 16384)  # L: the two targets
  config.passes = ("fwd", "fwd_bwd")  # forward only, and forward + backward
  # The choices below are the fastest region of the first H200 sweep (experiments/results/pallas_h200_bf16:
  # chunks 32-256, warps 4 and 8, feature blocks 32 and 64 at L=4096), kept small enough for gpu_check.sh.
  config.xla_chunks = (64, 128, 256)  # causal_method="chunked": chunk_size (XLA autotunes each: ~10-40 s)
  config.pallas_chunks = (64, 128)  # causal_method="pallas": chunk rows C (powers of two >= 16)
  config.num_warps = (4, 8)  # Triton warps per program
  config.block_fs = (32,)  # features per program of the sequential (state) kernels
  config.repeats = 5  # timed runs per configuration (median reported)
  if quick:
    config.heads = 2
    config.num_features = 32
    config.dtype = "float32"
    config.seq_lens = (64,)
    config.passes = ("fwd",)
    config.xla_chunks = (16, 32)
    config.pallas_chunks = (16,)
    config.num_warps = (4,)
    config.block_fs = (16,)
    config.repeats = 1
  return config
