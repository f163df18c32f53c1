"""ListOps (Long Range Arena): an encoder classifier over nested MAX/MIN/MED/SM expressions, softmax vs FAVOR.

    # LRA size (accelerators):
    python -m experiments.main --config=experiments/configs/listops.py --workdir=workdir/listops
    python -m experiments.main --config=experiments/configs/listops.py:quick --workdir=/tmp/l
"""

from experiments.configs import common


def get_config(arg=None):
  """LRA size; ``arg="quick"``: CPU size, short shallow expressions, a small model, a few hundred steps."""
  quick = common.is_quick(arg)
  config = common.training_config("listops", "listops", quick)
  config.data.max_depth = 10  # deepest nesting (LRA: 10)
  config.data.max_args = 10  # most arguments per operator (LRA: 10)
  config.data.min_length = 500  # shortest expression in tokens (LRA: 500)
  config.data.max_length = 2000  # longest expression, and the padded sequence length (LRA: 2000)
  config.data.num_train = 96_000  # generated training expressions (LRA: 96k)
  config.data.num_eval = 2_000  # generated held-out expressions (LRA: 2k)
  config.model.d_model = 256  # residual width
  config.model.num_layers = 4  # blocks
  config.model.num_heads = 4  # heads
  config.model.mlp_dim = 1024  # MLP width
  config.model.positions = "learned"  # absolute positions, as in LRA's baselines
  config.train.steps = 5000  # optimiser steps
  config.train.batch_size = 32  # expressions per step
  config.train.lr = 5e-4  # peak learning rate
  config.train.warmup_steps = 500  # warmup steps
  config.train.eval_every = 500  # steps between evaluations
  config.train.checkpoint_every = 500  # steps between checkpoints
  config.attention.num_features = 256  # M
  favor = common.favor_variant
  window = 12 if quick else 250  # hybrids' exact window (both directions): about L/8
  config.variants = common.with_seeds((
      ("softmax", {"attention.type": "softmax"}), ("favor_positive", favor("positive")),
      ("favor_positive_redraw", {**favor("positive"), "attention.redraw_every": 500}),
      ("favor_relu", favor("relu")),
      # Beyond FAVOR+: Taylor on q, k of dim 16 (153 features), FAVOR+ with an exact window, Hedgehog, FAVOR#.
      ("taylor_d16", favor("taylor", qk_head_dim=16)), ("favor_positive_window", favor("positive", window=window)),
      ("hedgehog", favor("hedgehog")), ("favor_sharp", favor("saderf"))), seeds=(0, 1))  # two seeds each
  if quick:
    config.data.update(max_depth=4, max_args=5, min_length=16, max_length=96, num_train=4000, num_eval=256)
    config.model.update(d_model=64, num_layers=2, num_heads=2, mlp_dim=128)
    config.attention.num_features = 64
    config.train.update(steps=600, warmup_steps=50, lr=2e-3, eval_every=100, checkpoint_every=200)
    config.only = "softmax,favor_positive"  # a subset of the variants (still overridable with --config.only)
  return config
