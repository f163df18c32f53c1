"""Sequence-parallel FAVOR+ (favor_jax.parallel) vs one device at long L, with communication from the shapes.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.main \
        --config=experiments/configs/sequence_parallel.py --workdir=workdir/sequence_parallel
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  """The study; ``arg="quick"``: a seconds-long smoke version (L=1024, small heads)."""
  quick = common.is_quick(arg)
  config = ml_collections.ConfigDict()
  config.experiment = "sequence_parallel"  # which study experiments.main runs
  config.quick = quick  # True: the quick version (FILE.py:quick); set on the full one, asks for it
  config.devices = 8  # devices on the sequence axis (forced CPU devices here, chips on an accelerator)
  config.batch = 1  # B
  config.heads = 8  # H
  config.head_dim = 64  # D (= Dv)
  config.num_features = 256  # M
  config.dtype = "float32"  # input dtype; "bfloat16" on accelerators
  config.seq_lens = (4096, 16384, 65536)  # L sweep (divisible by devices, or padded with masked keys)
  config.causal = (False, True)  # bidirectional and causal
  config.passes = ("fwd", "fwd_bwd")  # forward, and forward + backward
  config.repeats = 3  # timed runs per configuration (median reported)
  if quick:
    config.seq_lens = (1024,)
    config.heads = 2
    config.num_features = 32
    config.repeats = 1
  return config
