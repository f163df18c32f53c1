"""Attention transfer (issue 53, item 4): converting a trained softmax model to Hedgehog, by the weights'
cross-entropy (Hedgehog) or the outputs' squared error (LoLCATs), with and without a fitted per-head decay, at
exact windows of 0, 4 and 16 keys; each converted model then fine-tuned.

The backward-compatibility study's CPU setting (``backward_compat.py:quick``: the Shakespeare quick model, 1200
softmax steps, 300 fine-tune steps), distilling on one batch for 150 steps: one softmax pretraining, then per
variant the swap, the distillation of each layer's map (``finetune.distill_*``) and the fine-tune, against
softmax fine-tuned for the same steps. Two seeds of every variant (seed 1 as NAME_seed1: the new maps' and gates'
initialisation, the distillation batch and the fine-tune's data order), one pretrained softmax model.

    python -m experiments.main --config=experiments/configs/conversion.py --workdir=experiments/results/conversion_cpu
    python -m experiments.main --config=experiments/configs/conversion.py:quick --workdir=/tmp/conversion

A variant with ``finetune.distill_decay`` has a forget gate (FoX's, weight zero at init): the fitted decay is
its bias. ``hedgehog_w0_mse_gate`` has the same gate left at its initial bias, so the two differ only by the
fitted decay.
"""

from experiments.configs import backward_compat, common


def get_config(arg=None):
  """The study at the backward-compatibility study's CPU size; ``arg="quick"``: a subset of variants (three)."""
  quick = common.is_quick(arg)
  config = backward_compat.get_config("quick")  # the CPU setting: Shakespeare quick model, 1200 + 300 steps
  config.config_name = "conversion"  # this file
  config.quick = quick  # True: the quick version (FILE.py:quick)
  # Distillation on one batch of 32 sequences, 150 Adam steps per layer (backward_compat: 2 batches, 300 steps):
  # a distillation step computes every pair's weight from its features in log space, [B, H, L, L, F] per layer
  # (about 0.6 s a step here), so the study's 10 distilled variants fit in half an hour on a 2-core CPU.
  config.finetune.update(distill_batches=1, distill_steps=150)
  hedgehog = lambda window, **more: common.favor_variant("hedgehog", window=window, **more)
  mse = {"finetune.distill_objective": "output_mse"}  # LoLCATs' attention transfer
  decay = {**mse, "finetune.distill_decay": True}  # and a per-head decay, the gate's starting bias
  variants = [("softmax_control", {"attention.type": "softmax"})]  # softmax fine-tuned for the same steps
  for w in (0, 4, 16):  # exact windows: none, 4 keys, 16 keys (L/8)
    variants += [(f"hedgehog_w{w}_ce", hedgehog(w)),  # the weights' cross-entropy (Hedgehog's objective)
                 (f"hedgehog_w{w}_mse", {**hedgehog(w), **mse}),  # the outputs' squared error
                 (f"hedgehog_w{w}_mse_decay", {**hedgehog(w, forget_gate=True), **decay})]  # + fitted decay
  variants += [("hedgehog_w0_mse_gate", {**hedgehog(0, forget_gate=True), **mse})]  # the gate, decay not fitted
  config.variants = common.with_seeds(tuple(variants), (0, 1))  # seed 1 as NAME_seed1
  config.only = ""  # every variant
  if quick:
    config.train.steps = 100  # softmax pretraining steps
    config.finetune.update(steps=20, warmup_steps=5, eval_every=10, distill_steps=30)
    config.only = "softmax_control,hedgehog_w4_ce,hedgehog_w4_mse_decay"  # a subset (--config.only)
  return config
