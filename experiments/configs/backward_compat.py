"""Backward compatibility (Performer §4.2): train softmax, swap FAVOR in under the same weights, fine-tune.

    python -m experiments.main --config=experiments/configs/backward_compat.py \
        --workdir=workdir/backward_compat
    python -m experiments.main --config=experiments/configs/backward_compat.py:quick --workdir=/tmp/b
"""

import ml_collections

from experiments.configs import common, shakespeare


def get_config(arg=None):
  """``arg="quick"``: CPU size, the Shakespeare quick model and its 1200 steps as pretraining, 300 fine-tune
  steps."""
  quick = common.is_quick(arg)
  config = shakespeare.get_config(arg)  # the same task, data and model as the Shakespeare experiment
  config.experiment = "backward_compat"  # experiments.main runs experiments.studies.backward_compat
  config.config_name = "backward_compat"  # this file
  if not quick:
    config.train.steps = 3000  # softmax pretraining steps
  config.attention.type = "favor"  # the attention swapped in (variants override the kernel)
  config.finetune = ml_collections.ConfigDict()
  config.finetune.steps = 500  # fine-tune steps after the swap
  config.finetune.lr = 3e-4  # peak fine-tune learning rate
  config.finetune.warmup_steps = 20  # fine-tune warmup steps
  config.finetune.eval_every = 50  # fine-tune steps between evaluations (step 0 = right after the swap)
  config.finetune.distill_steps = 300  # learned feature maps (Hedgehog): Adam steps distilling each layer's map
  config.finetune.distill_lr = 1e-2  # their learning rate
  config.finetune.distill_batches = 2  # training batches (of train.batch_size) the distillation fits on
  # "cross_entropy": the attention weights' (Hedgehog); "output_mse": the outputs' squared error (LoLCATs)
  config.finetune.distill_objective = "cross_entropy"
  config.finetune.distill_decay = False  # also fit a per-head decay (needs attention.forget_gate: its start)
  # Each variant fine-tunes from the pretrained softmax weights; "softmax_control" keeps softmax attention.
  window = 16 if quick else 64  # hybrids' exact window: L/8
  favor = common.favor_variant
  config.variants = (("favor_positive", favor("positive")), ("favor_relu", favor("relu")),
                     ("softmax_control", {"attention.type": "softmax"}),
                     # Beyond FAVOR+ (same parameter tree as softmax: no qk_head_dim change): FAVOR# (saderf),
                     # FAVOR+ with an exact window, Taylor on the full head dim, Hedgehog (map distilled first).
                     ("favor_sharp", favor("saderf")),
                     ("favor_positive_window", favor("positive", window=window)),
                     ("taylor", favor("taylor")),
                     ("hedgehog", favor("hedgehog")))
  if quick:
    config.finetune.update(steps=300, lr=1e-3, eval_every=25)
    config.only = "favor_positive,softmax_control"  # a subset of the variants (overridable)
  return config
