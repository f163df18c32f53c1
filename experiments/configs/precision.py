"""Precision study: each estimator's output error under precision="highest" and under a TPU's default (one
bfloat16 pass per dot, emulated), against float64 exact causal softmax attention, per input scale.

    python -m experiments.main --config=experiments/configs/precision.py --workdir=experiments/results/precision_cpu
    python -m experiments.main --config=experiments/configs/precision.py:quick --workdir=/tmp/p
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  """The study; ``arg="quick"``: a smoke version (two kernels, one draw, L=32)."""
  quick = common.is_quick(arg)
  config = ml_collections.ConfigDict()
  config.experiment = "precision"  # which study experiments.main runs
  config.quick = quick  # True: the quick version (FILE.py:quick); set on the full one, asks for it
  config.seed = 0  # seed of the inputs and of the projection draws
  config.kernels = ("positive", "hyperbolic", "optimal_positive", "saderf", "trigonometric", "relu",
                    "elu_plus_one", "taylor", "hedgehog")  # hedgehog: its learned map at init (identity)
  config.scales = (1.0, 7.0, 20.0)  # input scales: q, k ~ N(0, 1)·0.5·scale
  config.seq_len = 128  # L
  config.dim = 32  # D, head dim of q, k and v
  config.heads = 2  # H
  config.num_features = 128  # M, projection rows of the random-feature kernels
  config.num_draws = 3  # projection draws averaged (the deterministic kernels: the same value each time)
  config.chunk_size = 64  # C of the chunked causal pass
  if quick:
    config.kernels = ("positive", "taylor")
    config.seq_len = 32
    config.num_draws = 1
    config.chunk_size = 16
  return config
