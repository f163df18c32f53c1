"""The README's main job: softmax vs FAVOR variants on character-level Shakespeare, in minutes on 2 CPU cores.

    python -m experiments.main --config=experiments/configs/quickstart.py --workdir=workdir/quickstart

Writes summary.md (the comparison table: validation bits per character per
attention), curves.png (train and validation curves of every variant) and one
directory per variant (metrics.jsonl, checkpoints, loss.png). Rerunning the
command resumes where it stopped.
"""

from experiments.configs import common, shakespeare


def get_config(arg=None):
  """``arg="quick"``: a seconds-long smoke version, two variants, 20 steps."""
  quick = common.is_quick(arg)
  config = shakespeare.get_config("quick")  # the Shakespeare CPU-size model and data
  config.config_name = "quickstart"  # this file
  config.quick = quick  # this file's quick version, not Shakespeare's
  config.train.steps = 500  # optimiser steps per variant
  config.train.eval_every = 100  # steps between validation evaluations
  config.train.checkpoint_every = 100  # steps between checkpoints
  config.attention.num_features = 64  # M random features per head (head dim 32)
  favor = lambda kernel: {"attention.type": "favor", "attention.kernel": kernel}
  config.variants = (("softmax", {"attention.type": "softmax"}),  # exact softmax attention (Flax's)
                     ("favor_positive", favor("positive")),  # FAVOR+ (positive random features)
                     ("favor_positive_redraw", {**favor("positive"), "attention.redraw_every": 50}),
                     ("favor_relu", favor("relu")))  # ReLU random features (Performer-ReLU)
  config.only = ""  # run every variant
  if quick:
    config.train.update(steps=20, warmup_steps=5, eval_every=10, log_every=10)
    config.data.num_eval_batches = 1
    config.only = "softmax,favor_positive"  # a subset of the variants (still overridable with --config.only)
  return config
