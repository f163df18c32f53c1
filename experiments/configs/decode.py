"""Decode speed: per-token latency, tokens/s and the decode state's memory after prompts of 1k to 64k tokens,
FAVOR+'s constant-size state against softmax's key-value cache, one model size.

    python -m experiments.main --config=experiments/configs/decode.py --workdir=experiments/results/decode_cpu
    python -m experiments.main --config=experiments/configs/decode.py:quick --workdir=/tmp/decode
    python -m experiments.main --config=experiments/configs/decode.py:gqa --workdir=experiments/results/decode_cpu/gqa

``:gqa``: grouped-query attention at 64k, the state's bytes and per-token time for 1, 2 and 4 (all) key/value
heads (``:gqa_quick``: seconds).
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  """The study (a few minutes on 2 CPU cores); ``arg="quick"``: seconds (a 1-layer model, prompts of 256, 512);
  ``"gqa"``: one prompt length, 64k, each number of key/value heads in ``kv_heads``; ``"gqa_quick"``: both."""
  gqa = arg in ("gqa", "gqa_quick")
  quick = common.is_quick({"gqa": None, "gqa_quick": "quick"}.get(arg, arg))
  base = common.training_config("decode", "shakespeare", quick)
  config = ml_collections.ConfigDict()
  config.experiment = "decode"  # which study experiments.main runs
  config.config_name = "decode"  # this file
  config.quick = quick  # True: the quick version (FILE.py:quick); set on the full one, asks for it
  config.model = base.model  # the LM both attentions decode with (a byte vocabulary)
  config.model.update(d_model=256, num_layers=4, num_heads=4, mlp_dim=1024, positions="rotary")
  config.attention = base.attention  # FAVOR's fields (attention.type is set per run: see `types`)
  config.attention.update(kernel="positive", num_features=128, chunk_size=64)
  config.data = ml_collections.ConfigDict({"pack": False})  # no packed documents while decoding
  config.types = ("favor", "softmax")  # the attentions compared, at the same model size
  config.prompt_lens = (1024, 4096, 16384, 32768, 65536)  # tokens before the timed decode steps
  config.batch = 1  # sequences decoded together
  config.repeats = 16  # timed decode steps per case (the median is reported)
  config.prefill_chunk = 1024  # FAVOR's real prefill runs the prompt in calls of this many tokens
  config.seed = 0  # parameters, prompt tokens and the softmax cache's synthetic keys and values
  config.kv_heads = ()  # grouped-query attention: run each case per number of key/value heads (empty: as model)
  if gqa:
    config.prompt_lens = (65536,)
    config.kv_heads = (1, 2, 4)  # 4: every head its own key/value head (model.num_heads)
  if quick:
    config.model.update(d_model=64, num_layers=1, num_heads=2, mlp_dim=128)
    config.attention.num_features = 16
    config.prompt_lens = (256, 512) if not gqa else (256,)
    config.kv_heads = (1, 2) if gqa else ()
    config.repeats = 3
    config.prefill_chunk = 256
  return config
