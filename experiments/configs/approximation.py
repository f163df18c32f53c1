"""Approximation study: FAVOR error against exact softmax attention, vs M, per kernel and projection.

    python -m experiments.main --config=experiments/configs/approximation.py --workdir=workdir/approximation
    python -m experiments.main --config=experiments/configs/approximation.py:quick --workdir=/tmp/a
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  """The study; ``arg="quick"``: a smoke version, about 20 s on 2 CPU cores (fewer kernels, Ms, draws)."""
  quick = common.is_quick(arg)
  config = ml_collections.ConfigDict()
  config.experiment = "approximation"  # which study experiments.main runs
  config.quick = quick  # True: the quick version (FILE.py:quick); set on the full one, asks for it
  config.seed = 0  # seed of the inputs and of the projection draws
  config.num_draws = 20  # projection draws averaged per configuration (>= 20 for published numbers)
  # Sweeps.
  config.kernels = ("positive", "hyperbolic", "trigonometric", "optimal_positive", "relu", "elu_plus_one")
  config.projections = ("iid", "orthogonal", "simplex")  # favor_jax.layers.PROJECTIONS
  config.num_features = (16, 32, 64, 128, 256, 512, 1024)  # M, the number of projection rows
  # (name, sequence length, head dim, input scale): q, k ~ N(0, 1)·scale, v ~ N(0, 1).
  # "seed" is the seed article's experiment; "hard" is d=64 with unit-variance q, k.
  config.settings = (("seed", 64, 32, 0.3), ("moderate", 256, 64, 0.5), ("hard", 256, 64, 1.0))
  if quick:
    config.num_draws = 4
    config.kernels = ("positive", "hyperbolic", "optimal_positive")
    config.projections = ("iid", "orthogonal")
    config.num_features = (32, 128, 512)
    config.settings = (("seed", 64, 32, 0.3),)
  return config
