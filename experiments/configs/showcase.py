"""THE main job: softmax vs FAVOR+ vs the best linear-time variants, quality and long-sequence cost, in minutes.

    python -m experiments.main --config=experiments/configs/showcase.py --workdir=workdir/showcase

Trains the Shakespeare character model (2 layers, d=128, 128-character windows) with each attention for
``train.steps`` steps, then times one train step of the same model on one sequence of ``long.length``
tokens and reads XLA's memory accounting of it. Writes summary.md (one table and the finding in a
sentence), showcase.png (one figure) and one directory per run (metrics.jsonl, checkpoints, loss.png).
4 min 42 s on 2 quiet CPU cores from a fresh clone (experiments/results/showcase_cpu); rerunning resumes finished runs.
The 10-minute comparison of FAVOR+'s feature maps alone is experiments/configs/quickstart.py.
"""

import ml_collections

from experiments.configs import common, shakespeare


def get_config(arg=None):
  """``arg="quick"``: a seconds-long smoke version (tiny model and steps, a short "long" length)."""
  quick = common.is_quick(arg)
  config = shakespeare.get_config("quick")  # the Shakespeare CPU-size model, data and optimiser
  config.experiment = "showcase"  # experiments.main runs experiments.studies.showcase
  config.config_name = "showcase"  # this file
  config.quick = quick  # this file's quick version, not Shakespeare's
  config.train.steps = 200  # optimiser steps per run (batch 32 × 128 characters)
  config.train.warmup_steps = 20  # linear warmup steps, then cosine decay to 0.1 × lr
  config.train.log_every = 25  # steps between progress lines (train-loss records)
  config.train.eval_every = 100  # steps between validation evaluations
  config.train.checkpoint_every = 100  # steps between checkpoints (a rerun resumes from the latest)
  config.attention.num_features = 64  # M random features per head (head dim 32)
  window = 16  # the hybrids' exact window: the last L/8 keys exactly, the kernel beyond
  favor = common.favor_variant
  config.variants = (("softmax", {"attention.type": "softmax"}),  # exact softmax attention (Flax's)
                     ("favor_positive", favor("positive")),  # FAVOR+: positive random features alone
                     ("favor_positive_window", favor("positive", window=window)),  # FAVOR+ + exact window
                     ("hedgehog", favor("hedgehog")))  # Hedgehog: a learned feature map (2 × head dim)
  config.only = ""  # comma-separated variant names to run (empty = all)
  config.long = ml_collections.ConfigDict()  # the long-sequence cost of one train step (not a run's field)
  config.long.length = 8192  # tokens of the one sequence (batch 1) the train step is timed on; 0 = skip
  config.long.repeats = 1  # timed steps (median), after compiling; softmax's step takes ~10 s at 8192
  if quick:
    config.model.update(d_model=32, num_heads=2, mlp_dim=64)
    config.data.update(seq_len=32, num_eval_batches=1)
    config.train.update(steps=20, batch_size=4, warmup_steps=5, log_every=10, eval_every=10, checkpoint_every=10)
    config.long.length = 256
    config.only = "softmax,favor_positive_window"  # a subset of the variants (still overridable)
  return config
