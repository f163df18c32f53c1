"""The Performer paper's backward-compatibility experiment (Choromanski et al. 2021, §4.2).

Train a softmax Transformer; swap FAVOR attention in with the *same*
parameters (FavorAttention has Flax attention's parameter tree); report the
loss right after the swap and after a short fine-tune. A softmax model
fine-tuned for the same steps from the same point is the control: the
fine-tune gain beyond it is what the swap cost.
"""

from __future__ import annotations

import copy
import os

from experiments import plotting, sweep, training


def phase_configs(config):
  """(pretrain softmax, [(name, fine-tune config)]) with every config checked up front."""
  pretrain = copy.deepcopy(config)
  pretrain.attention.type, pretrain.attention.redraw_every = "softmax", 0
  finetunes = []
  for name, c in sweep.variant_configs(config):
    c.train.steps, c.train.lr = config.finetune.steps, config.finetune.lr
    c.train.warmup_steps = min(config.finetune.warmup_steps, c.train.steps - 1)
    c.train.eval_every = c.train.log_every = config.finetune.eval_every
    training.check_config(c)
    finetunes.append((name, c))
  training.check_config(pretrain)
  return pretrain, finetunes


def run(config, progress, workdir) -> list[dict]:
  pretrain, finetunes = phase_configs(config)
  progress("pretraining the softmax model")
  records, state = training.train(pretrain, os.path.join(workdir, "pretrain_softmax"),
                                  lambda m: progress(f"pretrain_softmax {m}"))
  pretrained = [r for r in records if r["kind"] == "eval"][-1]
  out = []
  for name, c in finetunes:
    progress(f"swap + fine-tune: {name}")
    runs, _ = training.train(c, os.path.join(workdir, name), lambda m, n=name: progress(f"{n} {m}"),
                             init_params=state.params)
    evals = [r for r in runs if r["kind"] == "eval"]
    a = c.attention
    out.append(dict(name=name, attention=a.type, kernel=a.kernel if a.type == "favor" else "",
                    num_features=a.num_features if a.type == "favor" else 0,
                    pretrain_steps=pretrain.train.steps, finetune_steps=c.train.steps,
                    softmax_eval_loss=pretrained["eval_loss"], after_swap_eval_loss=evals[0]["eval_loss"],
                    after_finetune_eval_loss=evals[-1]["eval_loss"],
                    curve=[(r["step"], r["eval_loss"]) for r in evals]))
  return out


def summarize(records, config) -> str:
  lines = [f"# Backward compatibility: softmax-trained {config.task} model, attention swapped\n",
           f"Pretrained softmax for {records[0]['pretrain_steps']} steps; eval loss "
           f"{records[0]['softmax_eval_loss']:.4f}.\n",
           "| attention after swap | kernel | M | eval loss right after swap | after fine-tune "
           "| fine-tune steps | vs softmax |", "|" + "---|" * 7]
  for r in records:
    lines.append(f"| {r['name']} | {r['kernel']} | {r['num_features'] or ''} | {r['after_swap_eval_loss']:.4f} | "
                 f"{r['after_finetune_eval_loss']:.4f} | {r['finetune_steps']} | "
                 f"{r['after_finetune_eval_loss'] / r['softmax_eval_loss']:.3f}× |")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir) -> list[str]:
  fig, ax = plotting.subplots(figsize=(6, 4))
  for r in records:
    steps, losses = zip(*r["curve"])
    ax.plot(steps, losses, marker=".", label=r["name"])
  ax.axhline(records[0]["softmax_eval_loss"], color="k", ls="--", lw=1, label="softmax before swap")
  ax.set(xlabel="fine-tune step (0 = right after the swap)", ylabel="eval loss", yscale="log",
         title=f"Swapping attention in a softmax-trained {config.task} model")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  path = os.path.join(workdir, "backward_compat.png")
  return [plotting.save(fig, path)]
