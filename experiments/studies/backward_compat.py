"""The Performer paper's backward-compatibility experiment (Choromanski et al. 2021, §4.2).

Train a softmax Transformer; swap FAVOR attention in with the *same*
parameters (FavorAttention has Flax attention's parameter tree); report the
loss right after the swap and after a short fine-tune. A softmax model
fine-tuned for the same steps from the same point is the control: the
fine-tune gain beyond it is what the swap cost.

A kernel with a learned feature map (Hedgehog) gets the softmax weights plus
its map at the identity, then, before fine-tuning, each layer's map is
distilled against the frozen softmax model's own attention weights on training
batches (Zhang et al. 2024; ``layers.distillation_loss``): the loss is reported
right after the swap, after distillation and after fine-tuning. ``finetune.distill_objective`` picks the
weights' cross-entropy (Hedgehog) or the outputs' squared error (LoLCATs' attention transfer), fitted with the
variant's own exact window; ``finetune.distill_decay`` also fits a constant per-head decay, which a gated
variant (``attention.forget_gate``) starts its forget gate from (the gate's bias; its weight is zero).
"""

from __future__ import annotations

import copy
import os

import jax
from flax import traverse_util

from experiments import tasks
from experiments.configs import common
from experiments.studies import activations
from experiments.train import plotting, sweep, training
from favor_jax import layers
from favor_jax.layers import distillation


def check_finetune(f) -> None:
  """The ``finetune`` fields, each named when bad (the fine-tune runs' train.* fields are set from them)."""
  for name in ("steps", "eval_every", "distill_batches"):
    tasks.positive_int(f"finetune.{name}", f[name])
  training._count("finetune.warmup_steps", f.warmup_steps, "no warmup")
  training._count("finetune.distill_steps", f.distill_steps, "no distillation")
  if f.warmup_steps >= f.steps:
    raise ValueError(f"finetune.warmup_steps must be < finetune.steps={f.steps}, got {f.warmup_steps}")
  for name in ("lr", "distill_lr"):
    if not f[name] > 0:
      raise ValueError(f"finetune.{name} must be > 0, got {f[name]!r}")
  if f.distill_objective not in distillation.OBJECTIVES:
    raise ValueError(f"finetune.distill_objective must be one of {distillation.OBJECTIVES}, got "
                     f"{f.distill_objective!r}")
  if not isinstance(f.distill_decay, bool):
    raise TypeError(f"finetune.distill_decay must be a bool, got {f.distill_decay!r}")


def phase_configs(config):
  """(pretrain softmax, [(name, fine-tune config)]) with every config checked up front (the ``finetune`` fields
  per variant, which may set its own)."""
  pretrain = copy.deepcopy(config)
  pretrain.attention.type, pretrain.attention.redraw_every = "softmax", 0
  pretrain.variants, pretrain.only = (), ""
  with pretrain.unlocked():  # the command line's config is locked (config_flags)
    del pretrain["finetune"]  # not the pretraining's: changing it must not stop that run from resuming
  finetunes = []
  for name, c in sweep.variant_configs(config):
    check_finetune(c.finetune)
    if c.finetune.distill_decay and not (c.attention.type == "favor" and c.attention.forget_gate):
      raise ValueError(f"variant {name!r}: finetune.distill_decay=True fits a decay that the model's forget gate "
                       "starts from; it needs attention.type='favor' with attention.forget_gate=True")
    c.train.steps, c.train.lr = config.finetune.steps, config.finetune.lr
    c.train.warmup_steps = config.finetune.warmup_steps
    c.train.eval_every = c.train.log_every = config.finetune.eval_every
    training.check_config(c)
    finetunes.append((name, c))
  training.check_config(pretrain)
  return pretrain, finetunes


def unread(config) -> dict:
  """{field: why}: the distillation's fields when no selected variant has a learned feature map."""
  learned = [name for name, c in sweep.variant_configs(config)
             if c.attention.type == "favor" and layers.projection_role(c.attention.kernel) == "learned"]
  if learned:
    return {}
  why = "no selected variant has a learned feature map to distill (e.g. hedgehog)"
  fields = ("distill_steps", "distill_lr", "distill_batches", "distill_objective", "distill_decay")
  return {f"finetune.{f}": why for f in fields}


def runs(config) -> list[tuple[str, str, object]]:
  """[(name, field prefix, training config)]: the softmax pretraining and every fine-tune."""
  pretrain, finetunes = phase_configs(config)
  return [("pretrain_softmax", "", pretrain)] + [(name, "", c) for name, c in finetunes]


def swapped_params(c, pretrained):
  """``c``'s initial parameters with every one the softmax model has replaced by ``pretrained``'s (a learned
  feature map keeps its initial value, the identity)."""
  new, old = (traverse_util.flatten_dict(jax.device_get(p)) for p in (training.build(c).state.params, pretrained))
  missing = sorted("/".join(k) for k in set(old) - set(new))
  if missing:
    raise ValueError(f"the swapped-in model has no place for the softmax parameters {missing}")
  return traverse_util.unflatten_dict({k: old.get(k, v) for k, v in new.items()})


def eval_loss(c, params) -> float:
  run = training.build(c, params)
  return float(training.make_eval(run.model, run.task, run.mesh)(run.state)["eval_loss"])


def distill(c, params, pretrain, pretrained, progress):
  """``params`` with each layer's learned feature map fitted (``c.finetune.distill_steps`` Adam steps, its
  ``distill_objective``, the variant's window) to the pretrained softmax model's causal attention on the first
  ``distill_batches`` training batches; with ``distill_decay``, also the forget gate's bias (a constant
  per-head decay)."""
  f = c.finetune
  task = tasks.make_task(c)
  batches = [task.train_batch(i) for i in range(f.distill_batches)]
  params = jax.tree.map(lambda x: x, params)
  for i, (q, k, v) in enumerate(activations.capture(pretrain, pretrained, batches)):
    attention = params[f"block_{i}"]["attention"]
    start = attention["feature_map"]
    gate = attention["forget_gate"]["bias"] if f.distill_decay else None
    attention["feature_map"], fitted_gate, loss = activations.fit_map(
        c.attention.kernel, start.shape[-2], q, k, f.distill_steps, f.distill_lr, None, init=start,
        v_fit=v if f.distill_objective == "output_mse" else None, objective=f.distill_objective,
        window=c.attention.window, gate_bias=gate)
    said = ""
    if fitted_gate is not None:
      attention["forget_gate"]["bias"] = fitted_gate.astype(gate.dtype)
      said = f", per-head decay log f = {[round(float(x), 3) for x in jax.nn.log_sigmoid(fitted_gate)]}"
    progress(f"layer {i}: feature map distilled, {f.distill_objective} to softmax {loss:.4f}{said}")
  return params


def run(config, progress, workdir) -> list[dict]:
  pretrain, finetunes = phase_configs(config)
  progress("pretraining the softmax model")
  records, state = training.train(pretrain, os.path.join(workdir, "pretrain_softmax"),
                                  lambda m: progress(f"pretrain_softmax {m}"))
  pretrained = [r for r in records if r["kind"] == "eval"][-1]
  out = []
  for name, c in finetunes:
    progress(f"swap + fine-tune: {name}")
    params, after_swap, after_distill = state.params, None, float("nan")
    if c.attention.type == "favor" and layers.projection_role(c.attention.kernel) == "learned":
      params = swapped_params(c, state.params)
      after_swap = eval_loss(c, params)
      params = distill(c, params, pretrain, jax.device_get(state.params), lambda m, n=name: progress(f"{n} {m}"))
    runs, _ = training.train(c, os.path.join(workdir, name), lambda m, n=name: progress(f"{n} {m}"),
                             init_params=params)
    evals = [r for r in runs if r["kind"] == "eval"]
    if after_swap is not None:
      after_distill = evals[0]["eval_loss"]
    a = c.attention
    distilled = after_swap is not None
    out.append(dict(name=name, attention=a.type, kernel=a.kernel if a.type == "favor" else "",
                    distill_objective=c.finetune.distill_objective if distilled else "",
                    distill_decay=bool(distilled and c.finetune.distill_decay),
                    setting=sweep.setting(sweep.attention_fields(c)),
                    num_features=a.num_features if a.type == "favor" else 0,
                    seed=c.train.seed, pretrain_steps=pretrain.train.steps, finetune_steps=c.train.steps,
                    softmax_eval_loss=pretrained["eval_loss"],
                    after_swap_eval_loss=evals[0]["eval_loss"] if after_swap is None else after_swap,
                    after_distill_eval_loss=after_distill, after_finetune_eval_loss=evals[-1]["eval_loss"],
                    curve=[(r["step"], r["eval_loss"]) for r in evals]))
  return out


def summarize(records, config) -> str:
  control = [r for r in records if r["attention"] == "softmax"]
  lines = [f"# Backward compatibility: softmax-trained {config.task} model, attention swapped\n",
           f"Pretrained softmax for {records[0]['pretrain_steps']} steps; eval loss "
           f"{records[0]['softmax_eval_loss']:.4f}. Learned feature maps are distilled against the frozen "
           f"model's attention ({config.finetune.distill_steps} steps on {config.finetune.distill_batches} "
           "training batches) before fine-tuning.\n",
           "| run | attention | distillation | eval loss right after swap | after distillation | after fine-tune "
           "| fine-tune steps | vs softmax before | vs softmax control |", "|" + "---|" * 9]
  for r in records:
    distilled = r.get("after_distill_eval_loss", float("nan"))
    ratio = (f"{r['after_finetune_eval_loss'] / control[0]['after_finetune_eval_loss']:.3f}×" if control else "")
    how = r.get("distill_objective", "") + (" + per-head decay" if r.get("distill_decay") else "")
    lines.append(f"| {r['name']} | {r.get('setting', r['kernel'])} | {how} | {r['after_swap_eval_loss']:.4f} | "
                 f"{'' if distilled != distilled else f'{distilled:.4f}'} | {r['after_finetune_eval_loss']:.4f} | "
                 f"{r['finetune_steps']} | {r['after_finetune_eval_loss'] / r['softmax_eval_loss']:.3f}× | "
                 f"{ratio} |")
  groups = seed_groups(records)
  if any(len(runs) > 1 for runs in groups.values()):
    lines += _seed_table(groups)
  return "\n".join(lines) + "\n"


def seed_groups(records) -> dict[str, list[dict]]:
  """{variant: its runs}, the seeds of a variant grouped under its name (``common.seedless``)."""
  groups: dict[str, list[dict]] = {}
  for r in records:
    groups.setdefault(common.seedless(r["name"]), []).append(r)
  return groups


def _seed_table(groups) -> list[str]:
  """Each variant's eval loss after fine-tuning: the mean and every seed's value, against the softmax control's
  mean (and seed by seed: the ratios of runs of the same seed)."""
  after = lambda runs: [r["after_finetune_eval_loss"] for r in runs]
  mean = lambda xs: sum(xs) / len(xs)
  control = {r.get("seed", 0): r["after_finetune_eval_loss"] for runs in groups.values() for r in runs
             if r["attention"] == "softmax"}
  lines = ["", "## Mean over seeds (eval loss after fine-tuning)", "",
           "| variant | distillation | seeds | mean | each seed | vs softmax control (mean) "
           "| each seed vs its control |",
           "|" + "---|" * 7]
  for name, runs in groups.items():
    how = runs[0].get("distill_objective", "") + (" + per-head decay" if runs[0].get("distill_decay") else "")
    each = " / ".join(f"{x:.4f}" for x in after(runs))
    ratio = f"{mean(after(runs)) / mean(list(control.values())):.3f}×" if control else ""
    own = " / ".join(f"{r['after_finetune_eval_loss'] / control[r.get('seed', 0)]:.3f}×" for r in runs
                     if r.get("seed", 0) in control)
    lines.append(f"| {name} | {how} | {len(runs)} | {mean(after(runs)):.4f} | {each} | {ratio} | {own} |")
  return lines


def plot(records, config, workdir) -> list[str]:
  """Eval loss against fine-tune step: one colour per variant (ten colours, then dash-dots), its other seeds' curves
  fainter in the same colour; the legend beside the axes."""
  fig, ax = plotting.subplots(figsize=(8, 4))
  for i, (name, runs) in enumerate(seed_groups(records).items()):
    for j, r in enumerate(runs):
      steps, losses = zip(*r["curve"])
      ax.plot(steps, losses, marker=".", ls="-" if i < 10 else "-.", color=f"C{i % 10}", alpha=1.0 if j == 0 else 0.45,
              label=name + (f" ({len(runs)} seeds)" if len(runs) > 1 else "") if j == 0 else None)
  ax.axhline(records[0]["softmax_eval_loss"], color="k", ls="--", lw=1, label="softmax before swap")
  ax.set(xlabel="fine-tune step (0 = right after the swap)", ylabel="eval loss", yscale="log",
         title=f"Swapping attention in a softmax-trained {config.task} model")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  path = os.path.join(workdir, "backward_compat.png")
  return [plotting.save(fig, path)]
