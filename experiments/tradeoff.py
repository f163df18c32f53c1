"""Quality against speed: every estimator's result in the committed training studies against its training
throughput, timed here one variant at a time (not taken from the runs, which may have shared the machine).

For each (study, results directory): the directory's ``config.json`` (the config that ran) rebuilds each
run's variant; its train step is compiled and timed (median of ``timing_repeats`` blocks of ``timing_steps``
steps, on the study's own batch size and length). Records: quality (the study's headline metric), decoding
state, steps/s.
"""

from __future__ import annotations

import copy
import json
import os

import jax
import ml_collections

from experiments import plotting, sweep, training
from experiments.timing import median_of


def load_study(directory: str) -> tuple[ml_collections.ConfigDict, list[dict]]:
  """The config a training study ran with and its records (``config.json``, ``results.json`` of ``directory``)."""
  paths = [os.path.join(directory, f) for f in ("config.json", "results.json")]
  missing = [p for p in paths if not os.path.exists(p)]
  if missing:
    raise ValueError(f"{directory} is not a training study's results directory: {', '.join(missing)} missing")
  with open(paths[0]) as f:
    config = ml_collections.ConfigDict(json.load(f)["config"])
  with open(paths[1]) as f:
    records = json.load(f)
  if config.get("experiment") != "train":
    raise ValueError(f"{directory} holds a {config.get('experiment')!r} study, not a training study")
  return config, records


def _variants(config):
  config.variants = tuple((name, dict(fields)) for name, fields in config.variants)  # JSON gave lists
  return config


def steps_per_second(config, steps: int, repeats: int) -> float:
  """Training steps per second of ``config`` on this machine (one device), compile excluded."""
  config = copy.deepcopy(config)
  config.mesh.update(data=1, sequence=1)
  run = training.build(config)
  step = training.make_train_step(run.model, run.optimizer, config.attention.redraw_every, jax.random.PRNGKey(1))
  batches = [run.task.train_batch(i) for i in range(steps)]

  def block():
    s = run.state
    for b in batches:
      s = step(s, b)
    jax.block_until_ready(s.params)

  return steps / median_of(block, repeats)


def run(config, progress=print, workdir=None):
  out = []
  for study, directory in config.studies:
    ran, records = load_study(directory)
    ran = _variants(ran)
    ran.only = ",".join(r["name"] for r in records)
    variants = dict(sweep.variant_configs(ran))
    metric = sweep._main_metric(records)
    for r in records:
      rate = steps_per_second(variants[r["name"]], config.timing_steps, config.timing_repeats)
      out.append(dict(study=study, name=r["name"], setting=sweep.setting(r), metric=metric, value=r[metric],
                      seed=r["seed"], state_size=r["state_size"], seq_len=r["seq_len"],
                      batch_size=variants[r["name"]].train.batch_size, steps_per_s=rate))
      progress(f"{study} {r['name']:>24} {metric} {r[metric]:.4f} {rate:.2f} steps/s")
  return out


def summarize(records, config) -> str:
  lines = ["# Quality against training speed", "",
           f"Quality: each study's committed result; steps/s: the run's train step timed here alone (median of "
           f"{config.timing_repeats} × {config.timing_steps} steps after compiling).", "",
           "| study | run | attention | L | batch | quality | decoding state | steps/s |", "|" + "---|" * 8]
  for r in records:
    lines.append(f"| {r['study']} | {r['name']} | {r['setting']} | {r['seq_len']} | {r['batch_size']} | "
                 f"{r['metric']} {r['value']:.4f} | {r['state_size']} | {r['steps_per_s']:.2f} |")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir):
  studies = list(dict.fromkeys(r["study"] for r in records))
  fig, axes = plotting.subplots(1, len(studies), figsize=(4.8 * len(studies), 3.8), squeeze=False)
  names = sorted({r["setting"] for r in records})
  style = dict(zip(names, plotting.styles(len(names))))
  for ax, study in zip(axes[0], studies):
    rows = [r for r in records if r["study"] == study]
    groups: dict[str, list[dict]] = {}
    for r in rows:
      groups.setdefault(r["setting"], []).append(r)
    for setting, runs in groups.items():
      value = sum(r["value"] for r in runs) / len(runs)
      rate = sum(r["steps_per_s"] for r in runs) / len(runs)
      ax.scatter(rate, value, color=style[setting]["color"], s=40, label=setting,
                 marker="o" if setting != "softmax" else "*")
    ax.set(xlabel=f"training steps/s (L={rows[0]['seq_len']}, batch {rows[0]['batch_size']})",
           ylabel=rows[0]["metric"].replace("_", " "), title=study)
    ax.grid(alpha=0.3)
  plotting.legend_right(fig)
  return [plotting.save(fig, os.path.join(workdir, "tradeoff.png"))]
