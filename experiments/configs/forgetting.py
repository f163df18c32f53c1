"""Forget gates on Shakespeare (issue 40): softmax, the Forgetting Transformer (softmax + forget gate), FAVOR+,
FAVOR+ with the gate, with the gate and an exact window, and Hedgehog with the gate, two seeds each, trained at
L=128 on CPU and evaluated at 128, 512 and 2048 characters without retraining (length extrapolation). No
position embeddings (FoX's setting; learned absolute ones cannot run past the training length); the packed
windows carry each play as a document.

    python -m experiments.main --config=experiments/configs/forgetting.py --workdir=workdir/forgetting
    python -m experiments.main --config=experiments/configs/forgetting.py:quick --workdir=/tmp/f
"""

from experiments.configs import common, shakespeare


def get_config(arg=None):
  """The CPU study (Shakespeare's CPU-size model); ``arg="quick"``: a seconds-long smoke version, two variants,
  a tiny model, 4 steps."""
  quick = common.is_quick(arg)
  config = shakespeare.get_config("quick")  # the Shakespeare CPU-size model and data (L=128)
  config.config_name = "forgetting"  # this file
  config.quick = quick  # this file's quick version, not Shakespeare's
  config.model.positions = "none"  # no positions: a causal model still orders tokens, the gate adds recency
  config.data.pack = True  # plays as documents: attention never crosses from one play into the next
  config.data.eval_lengths = (512, 2048)  # extrapolation: 4x and 16x the training length, final evaluation
  config.data.num_eval_batches = 4  # held-out characters per length = this × train.batch_size × 128 (8192)
  config.train.steps = 300  # optimiser steps per run (12 runs in ~35 min on 2 shared CPU cores)
  config.train.batch_size = 16  # windows per step
  config.train.warmup_steps = 30  # linear warmup steps
  config.train.eval_every = 100  # steps between evaluations at the training length
  config.train.checkpoint_every = 100  # steps between checkpoints
  config.attention.num_features = 64  # M random features per head (head dim 32)
  favor = common.favor_variant
  gate = {"attention.forget_gate": True}
  variants = (("softmax", {"attention.type": "softmax"}),  # exact softmax, no positions
              ("softmax_forget_gate", {"attention.type": "softmax", **gate}),  # the Forgetting Transformer
              ("favor_positive", favor("positive")),  # FAVOR+
              ("favor_positive_forget_gate", favor("positive", forget_gate=True)),  # gated FAVOR+
              ("favor_positive_forget_gate_window", favor("positive", forget_gate=True, window=16)),  # + exact L/8
              ("hedgehog_forget_gate", favor("hedgehog", forget_gate=True)))  # learned features, gated
  config.variants = common.with_seeds(variants, (0, 1))  # seed 1 as NAME_seed1
  config.only = ""  # every variant
  if quick:
    config.data.update(seq_len=32, eval_lengths=(64,), num_eval_batches=1)
    config.model.update(d_model=32, num_layers=1, num_heads=2, mlp_dim=64)
    config.attention.num_features = 16
    config.train.update(steps=4, batch_size=4, warmup_steps=1, eval_every=2, log_every=2, checkpoint_every=2)
    config.only = "softmax_forget_gate,favor_positive_forget_gate"  # a subset (overridable with --config.only)
  return config
