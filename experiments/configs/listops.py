"""ListOps (Long Range Arena): an encoder classifier over nested MAX/MIN/MED/SM expressions, softmax vs FAVOR.

    python -m experiments.main --config=experiments/configs/listops.py --workdir=workdir/listops   # LRA size (TPU)
    python -m experiments.main --config=experiments/configs/listops.py --workdir=/tmp/l --config.quick=True
"""

from experiments.configs.common import training_config


def get_config():
  config = training_config("listops", "listops")
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
  favor = lambda kernel: {"attention.type": "favor", "attention.kernel": kernel}
  config.variants = (("softmax", {}), ("favor_positive", favor("positive")),
                     ("favor_positive_redraw", {**favor("positive"), "attention.redraw_every": 500}),
                     ("favor_relu", favor("relu")))
  return config


def apply_quick(config):
  """CPU size: short shallow expressions, a small model, a few hundred steps."""
  config.data.max_depth = 4
  config.data.max_args = 5
  config.data.min_length = 16
  config.data.max_length = 96
  config.data.num_train = 4000
  config.data.num_eval = 256
  config.model.d_model = 64
  config.model.num_layers = 2
  config.model.num_heads = 2
  config.model.mlp_dim = 128
  config.attention.num_features = 64
  config.train.steps = 600
  config.train.warmup_steps = 50
  config.train.lr = 2e-3
  config.train.eval_every = 100
  config.train.checkpoint_every = 200
  config.only = "softmax,favor_positive"  # a subset of the variants (still overridable with --config.only)
  return config
