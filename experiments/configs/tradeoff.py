"""Quality against training speed for every estimator, from the committed MQAR, Shakespeare and forget-gate
studies.

    python -m experiments.main --config=experiments/configs/tradeoff.py --workdir=experiments/results/tradeoff_cpu

Times each run's train step alone on this machine (run it on a quiet one); the quality numbers are read
from the studies' results directories.
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  """The figure; ``arg="quick"``: fewer timed steps."""
  quick = common.is_quick(arg)
  config = ml_collections.ConfigDict()
  config.experiment = "tradeoff"  # which study experiments.main runs
  config.quick = quick  # True: the quick version (FILE.py:quick); set on the full one, asks for it
  # (study, results directory of a training study: its config.json and results.json).
  config.studies = (("mqar", "experiments/results/mqar_estimators_cpu"),
                    ("shakespeare", "experiments/results/shakespeare_estimators_cpu"),
                    ("forgetting", "experiments/results/forgetting_cpu"))
  config.timing_steps = 10  # train steps per timed block
  config.timing_repeats = 3  # timed blocks (median)
  # Also time one train step of each model on a sequence this long (0 = skip). 8192: the committed result's
  # length on a 24 GiB machine (softmax's step holds H·L² attention weights per layer; 16384 was not run).
  config.long_length = 8192
  if quick:
    config.timing_steps, config.timing_repeats, config.long_length = 3, 1, 256
  return config
