"""Multi-query associative recall (Zoology): softmax vs FAVOR kernels at M ∈ {64, 256}, with/without redraw,
and the estimators beyond FAVOR+ (Taylor, hybrids, Hedgehog, FAVOR#) with their decoding state sizes.

    python -m experiments.main --config=experiments/configs/mqar.py --workdir=workdir/mqar
    python -m experiments.main --config=experiments/configs/mqar.py:quick --workdir=/tmp/m
"""

from experiments.configs import common


def get_config(arg=None):
  """The study; ``arg="quick"``: a smoke size (about 40 s on 2 CPU cores), 60 steps of two variants; it
  checks the pipeline, and no variant learns the task in 60 steps."""
  quick = common.is_quick(arg)
  config = common.training_config("mqar", "mqar", quick)
  config.data.seq_len = 128  # L: tokens per sequence
  config.data.num_kv_pairs = 8  # N: key-value pairs, each queried once
  config.data.vocab_size = 256  # keys from [1, 128), values from [128, 256)
  config.data.power_a = 0.01  # query-gap power law exponent (Zoology's default)
  config.data.random_non_queries = True  # filler positions get random tokens (Zoology's default)
  config.data.num_eval_batches = 8  # held-out batches (of train.batch_size) per evaluation
  config.model.d_model = 64  # residual width
  config.model.num_heads = 2  # heads (head dim 32)
  config.model.mlp_dim = 128  # MLP width
  config.train.steps = 1500  # optimiser steps (softmax's jump from ~10% to ~100% comes late and varies)
  config.train.batch_size = 64  # sequences per step
  config.train.lr = 3e-3  # peak learning rate
  config.train.eval_every = 250  # steps between evaluations
  config.train.checkpoint_every = 500  # steps between checkpoints
  favor = common.favor_variant
  config.variants = (("softmax", {"attention.type": "softmax"}),) + tuple(
      (f"{kernel}_m{m}" + (f"_redraw{redraw}" if redraw else ""), favor(kernel, num_features=m, redraw_every=redraw))
      for kernel in ("positive", "hyperbolic", "relu") for m in (64, 256) for redraw in (0, 100)
      if kernel == "positive" or (m, redraw) == (64, 0)) + (  # the M and redraw ablations on FAVOR+
      # Beyond FAVOR+: Taylor (Based's 2nd-order map on q, k of dim 16: 153 features), Hedgehog (learned,
      # 2·32 = 64 features), FAVOR# (saderf, M = 64) and hybrids: exact attention over the last 16 keys.
      ("taylor_d16", favor("taylor", qk_head_dim=16)),
      ("taylor_d16_w16", favor("taylor", qk_head_dim=16, window=16)),  # Based: Taylor + a sliding window
      ("positive_m64_w16", favor("positive", num_features=64, window=16)),
      ("hedgehog", favor("hedgehog")),
      ("saderf_m64", favor("saderf", num_features=64)))
  # The recall-memory sweep over key-value pairs (Zoology): softmax, FAVOR+ and the best linear-time
  # variant at 8 pairs (Hedgehog), again at 16 and 32 pairs ("NAME_kvN"; the runs above are 8 pairs).
  kv_sweep = [(name, fields) for name, fields in config.variants if name in ("softmax", "positive_m64", "hedgehog")]
  config.variants += tuple((f"{name}_kv{pairs}", {**fields, "data.num_kv_pairs": pairs})
                           for pairs in (16, 32) for name, fields in kv_sweep)
  # Short convolutions (Based, Zoology): every block opens with a residual causal depthwise conv of width 4,
  # the token shift that recall's induction step needs; the same model otherwise ("NAME_conv4").
  conv = [(name, fields) for name, fields in config.variants
          if name in ("softmax", "positive_m64", "taylor_d16_w16", "hedgehog")]
  # Two seeds each ("NAME_conv4_seed1": train.seed = 1), then 16 pairs ("NAME_conv4_kv16").
  conv = [(f"{name}_conv4", {**fields, "model.short_conv": 4}) for name, fields in conv]
  config.variants += common.with_seeds(conv, (0, 1)) + tuple(
      (f"{name}_kv16", {**fields, "data.num_kv_pairs": 16}) for name, fields in conv)
  if quick:
    config.train.update(steps=60, batch_size=32, warmup_steps=10, log_every=10, eval_every=30,
                        checkpoint_every=30)
    config.data.num_eval_batches = 2
    config.only = "softmax,positive_m64"  # a subset of the variants (still overridable with --config.only)
  return config
