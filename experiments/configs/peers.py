"""favor_jax side by side with performer-pytorch's FastAttention: time, memory, approximation, causality.

    pip install -e ".[peers]"
    python -m experiments.main --config=experiments/configs/peers.py --workdir=workdir/peers
    python -m experiments.main --config=experiments/configs/peers.py:quick --workdir=/tmp/p
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  """The comparison; ``arg="quick"``: a seconds-long smoke version."""
  quick = common.is_quick(arg)
  config = ml_collections.ConfigDict()
  config.experiment = "peers"  # which study experiments.main runs
  config.quick = quick  # True: the quick version (FILE.py:quick); set on the full one, asks for it
  config.seed = 0  # seed of the approximation inputs
  config.batch = 1  # B
  config.heads = 8  # H
  config.head_dim = 64  # D
  config.num_features = 256  # M, for both libraries
  config.threads = 0  # CPU threads for each library (0: all cores)
  config.causal = (False, True)  # modes compared
  config.seq_lens = (1024, 4096, 16384)  # bidirectional lengths
  config.causal_seq_lens = (1024, 4096)  # causal lengths (the peer's CPU causal path is slow)
  config.passes = ("fwd", "fwd_bwd")  # forward, and forward + backward
  config.repeats = 3  # timed runs per case (median reported)
  config.approx_seq_len = 512  # length of the approximation comparison
  config.approx_draws = 5  # feature draws per library in the approximation comparison
  if quick:
    config.heads = 2
    config.num_features = 32
    config.seq_lens = (256,)
    config.causal_seq_lens = (256,)
    config.passes = ("fwd",)
    config.repeats = 1
    config.approx_seq_len = 64
    config.approx_draws = 2
  return config
