"""A seconds-long MQAR config (one small layer, a few steps) for tests and smoke runs; ``shrink`` any config.

    python -m experiments.main --config=experiments/configs/tiny.py --workdir=/tmp/tiny
"""

from experiments.configs import common, mqar


def shrink(config):
  """``config`` with a one-layer width-32 model, 6 steps of 4 sequences, logs every 2 steps."""
  config.variants, config.only = (), ""
  if config.task == "mqar":
    config.data.update(seq_len=32, num_kv_pairs=4, vocab_size=64, num_eval_batches=1)
  config.model.update(d_model=32, num_layers=1, num_heads=2, mlp_dim=64)
  config.attention.num_features = 16  # M
  config.attention.chunk_size = 8  # several causal chunks even at length 32
  config.train.update(steps=6, batch_size=8, warmup_steps=2, log_every=2, eval_every=3, checkpoint_every=2)
  return config


def get_config(arg=None):
  """``arg="quick"``: the same (already seconds long)."""
  config = shrink(mqar.get_config())
  config.config_name = "tiny"  # this file
  config.quick = common.is_quick(arg)
  return config
