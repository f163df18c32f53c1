"""Speed and memory study: exact attention vs FAVOR+ (bidirectional and causal algorithms) against length.

    python -m experiments.main --config=experiments/configs/speed.py --workdir=workdir/speed
    python -m experiments.main --config=experiments/configs/speed.py:quick --workdir=/tmp/s
    # on a GPU (cuDNN is the exact baseline there):
    python -m experiments.main --config=experiments/configs/speed.py --workdir=workdir/speed_gpu \
        --config.dtype=bfloat16 --config.memory=compiled
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  """The study; ``arg="quick"``: a smoke version, two short lengths, every method but the slow-to-compile
  materialised prefix states, all in one process (each of its configurations is a compilation: minutes on
  2 CPU cores)."""
  quick = common.is_quick(arg)
  config = ml_collections.ConfigDict()
  config.experiment = "speed"  # which study experiments.main runs
  config.quick = quick  # True: the quick version (FILE.py:quick); set on the full one, asks for it
  config.batch = 1  # B
  config.heads = 8  # H
  config.head_dim = 64  # D (= Dv)
  config.num_features = 256  # M, projection rows
  config.dtype = "float32"  # input dtype; "bfloat16" on accelerators
  config.seq_lens = (256, 1024, 4096, 16384, 65536, 131072)  # L sweep
  # softmax: ours; jax_dot_product_attention: XLA on CPU, cuDNN on GPU; favor: chunked causal /
  # bidirectional; favor_scan: the paper's per-token recurrence; favor_cumsum: materialised prefix states;
  # favor_sharp: FAVOR#; taylor: 2nd-order Taylor at D; taylor_d16: Taylor on q/k head dim 16 (values D);
  # hybrid_w64: exact window of 64 + FAVOR+; favor_pallas: the fused Pallas kernels, causal only (GPU; on
  # a CPU they run in Pallas's interpreter, far too slowly for this sweep) (experiments/studies/speed.py: ESTIMATORS);
  # favor_pallas_gated: the fused kernels with a forget gate; tpu_flash_attention, tpu_splash_attention: jax's
  # TPU kernels (experiments/studies/tpu_attention.py; interpreted off a TPU);
  # any kernel of core.KERNELS by its name (e.g. elu_plus_one, hedgehog) runs with favor_attention's defaults;
  # NAME_plain_scan, NAME_plain_chunked, NAME_plain_chunked_remat: NAME's raw features with no stabiliser, causal
  # only (trax's per-token scan; chunks as ours; the same, rematerialised: experiments/studies/plain_passes.py).
  config.methods = ("softmax", "jax_dot_product_attention", "favor", "favor_scan", "favor_cumsum", "favor_sharp",
                    "taylor", "taylor_d16", "hybrid_w64")
  config.causal = (False, True)  # attention modes to time
  config.passes = ("fwd", "fwd_bwd")  # forward only, and forward + backward
  config.repeats = 5  # timed runs per configuration (median reported)
  # "process": each configuration in its own process, peak resident memory while it runs (CPU);
  # "compiled": XLA's accounting of the compiled program, all in one process (fast; use on GPU).
  config.memory = "process"
  config.memory_limit_gb = 0.0  # a program needing more is recorded as out_of_memory, not run (0: auto)
  config.scan_max_len = 16384  # the per-token scan is skipped (recorded) beyond this length
  if quick:
    config.seq_lens = (256, 1024)
    config.heads = 2
    config.num_features = 64
    config.methods = tuple(m for m in config.methods if m not in ("favor_cumsum", "taylor"))
    config.repeats = 2
    config.memory = "compiled"  # a process per configuration costs a JAX start-up each (~3 s)
  return config
