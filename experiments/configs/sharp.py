"""Sharp attention at linear cost (issue 53): how many features, how small an exact window and which
corrections bring gated FAVOR+ to the Forgetting Transformer (FoX) on Shakespeare, the forgetting study's setting
(``forgetting.py``: no positions, packed plays, trained at L=128, evaluated at 128, 512 and 2048).

Variants: FoX and softmax; gated FAVOR+ at M = 64, 128, 256, 512; exact windows of 1, 2, 4, 8 keys at M = 64 and
256; the control-variate hybrid (``core.hybrid_attention(control_variate=...)``, EVA) against the plain hybrid at
the same window; RFA's bounded logits and learned per-head q/k maps (``attention.qk_map``); two seeds each.

    python -m experiments.main --config=experiments/configs/sharp.py --workdir=experiments/results/sharp_cpu
    python -m experiments.main --config=experiments/configs/sharp.py:quick --workdir=/tmp/sharp

The study took 85 minutes on a 2-core CPU as two streams of runs (34 runs of 300 steps);
experiments/results/sharp_cpu holds it.
A subset: ``--config.only=NAME,...`` (seed 1 of a variant is NAME_seed1).
"""

from experiments.configs import common, forgetting


def get_config(arg=None):
  """The study (the forgetting study's CPU model, 300 steps, two seeds); ``arg="quick"``: a seconds-long smoke
  version."""
  config = forgetting.get_config(arg)  # model, data, steps and schedule of that study
  config.config_name = "sharp"  # this file
  favor = common.favor_variant
  gated = lambda m, **more: favor("positive", forget_gate=True, num_features=m, **more)  # gated FAVOR+ at M
  variants = [("softmax", {"attention.type": "softmax"}),  # exact softmax, no positions
              ("softmax_forget_gate", {"attention.type": "softmax", "attention.forget_gate": True})]  # FoX
  variants += [(f"favor_m{m}", gated(m)) for m in (64, 128, 256, 512)]  # item 1: the features lever
  variants += [(f"favor_m{m}_window{w}", gated(m, window=w)) for m in (64, 256) for w in (1, 2, 4, 8)]  # item 2
  # Item 3: the control-variate hybrid at window 4 (β 0.1: larger ones inflate the error on random q, k,
  # docs/estimators.md) against favor_m64_window4 (β 0).
  variants += [("favor_m64_window4_cv", gated(64, window=4, control_variate=0.1))]
  # Item 5: RFA's bounded logits, and learned per-head maps of q, k before the positive features.
  variants += [("favor_m64_bounded", gated(64, qk_map="bounded")),
               ("favor_m64_learned_qk", gated(64, qk_map="learned"))]
  config.variants = common.with_seeds(tuple(variants), (0, 1))  # seed 1 as NAME_seed1
  config.only = ""  # every variant
  if config.quick:
    config.only = "softmax_forget_gate,favor_m64_window4,favor_m64_bounded"  # a subset (--config.only)
  return config
