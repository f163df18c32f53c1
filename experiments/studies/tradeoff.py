"""Quality against speed: every estimator's result in the committed training studies against its training
throughput, timed here one variant at a time (not taken from the runs, which may have shared the machine).

For each (study, results directory): the directory's ``config.json`` (the config that ran) rebuilds each
run's variant; its train step is compiled and timed (median of ``timing_repeats`` blocks of ``timing_steps``
steps, on the study's own batch size and length), and so is one step of the same model on one sequence of
``long_length`` tokens, where linear-time attention should pay off. Each setting is timed in a fresh process
(``isolation.spawn``): nothing compiled or allocated for one setting is there when the next is timed (in one
process, XLA's CPU client stalled for good in a futex wait after four settings of the sharp study, on
2026-12-05, jax 0.10.2). Records: quality (the study's headline
metric), decoding state, steps/s, seconds per long step.
"""

from __future__ import annotations

import copy
import json
import os

import jax
import jax.numpy as jnp
import matplotlib.ticker
import ml_collections

from experiments import tasks
from experiments.studies import isolation
from experiments.studies.timing import check_sizes, median_of
from experiments.train import models, paths, plotting, sweep, training


def load_study(directory: str) -> tuple[ml_collections.ConfigDict, list[dict]]:
  """The config a training study ran with and its records (``config.json``, ``results.json`` of ``directory``)."""
  files = [os.path.join(directory, f) for f in ("config.json", "results.json")]  # local, or on a bucket
  missing = [p for p in files if not paths.exists(p)]
  if missing:
    raise ValueError(f"{directory} is not a training study's results directory: {', '.join(missing)} missing")
  config = ml_collections.ConfigDict(json.loads(paths.read_text(files[0]))["config"])
  records = json.loads(paths.read_text(files[1]))
  if config.get("experiment") != "train":
    raise ValueError(f"{directory} holds a {config.get('experiment')!r} study, not a training study")
  if "short_conv" not in config.model:  # studies committed before the field ran without one
    config.model.short_conv = 0
  return config, records


def _variants(config):
  config.variants = tuple((name, dict(fields)) for name, fields in config.variants)  # JSON gave lists
  return config


def time_setting(config, steps: int, repeats: int, long_length: int) -> tuple[float, float]:
  """(training steps/s of ``config`` at its own batch and length, seconds of one train step of the same model
  on one sequence of ``long_length`` tokens, NaN when 0) on one device, compile excluded; one build (task,
  optimiser, fresh state) serves both (rotary or no positions: the parameters do not depend on the length)."""
  config = copy.deepcopy(config)
  config.mesh.update(data=1, sequence=1)
  run = training.build(config)

  def train_step(model):
    return training.make_train_step(model, run.optimizer, config.attention.redraw_every, jax.random.PRNGKey(1))

  step = train_step(run.model)
  batches = [run.task.train_batch(i) for i in range(steps)]

  def block():
    s = run.state
    for b in batches:
      s = step(s, b)
    jax.block_until_ready(s.params)

  rate = steps / median_of(block, repeats)
  if not long_length:
    return rate, float("nan")
  long_step, batch = long_train_step(config, run, long_length)
  return rate, median_of(lambda: jax.block_until_ready(long_step(run.state, batch).params), repeats)


def _measure(job: dict) -> dict:
  """A child process's measurement (``isolation.spawn``): :func:`time_setting` of the job's config."""
  rate, seconds = time_setting(ml_collections.ConfigDict(job["config"]), job["steps"], job["repeats"],
                               job["long_length"])
  return dict(steps_per_s=rate, long_step_s=seconds)


def long_train_step(config, run: training.Setup, length: int):
  """(the jitted train step of ``config``'s model built for ``length`` tokens, a batch of one random sequence of
  ``length`` tokens): it steps ``run.state`` (rotary or no positions: the parameters do not depend on the length)."""
  model = models.make_model(config, run.task.vocab_size, run.task.num_classes, length)
  step = training.make_train_step(model, run.optimizer, config.attention.redraw_every, jax.random.PRNGKey(1))
  tokens = jax.random.randint(jax.random.PRNGKey(0), (1, length), 1, run.task.vocab_size)
  return step, tasks.Batch(tokens, tokens, jnp.ones(tokens.shape, jnp.float32))


def run(config, progress=print, workdir=None):
  """Per study, its runs at the study's own task (variants that change ``data.*``, e.g. MQAR's other pair
  counts, are left out); each setting timed once (seeds of a setting share its times)."""
  check_sizes(config)
  studies = [(study, *load_study(directory)) for study, directory in config.studies]
  for study, ran, _ in studies:  # before any timing
    if config.long_length and (ran.task == "listops" or ran.model.positions not in models.ANY_LENGTH):
      raise ValueError(f"long_length={config.long_length}: study {study!r} ({ran.task}, {ran.model.positions} "
                       "positions) cannot run its model at another length; it needs a language model with rotary "
                       "or no positions (or long_length=0)")
  out = []
  for study, ran, records in studies:
    ran = _variants(ran)
    ran.only = ",".join(r["name"] for r in records)
    variants = dict(sweep.variant_configs(ran))
    metric = sweep._main_metric(records)
    times = {}
    for r in records:
      variant = variants[r["name"]]
      if variant.data != ran.data:
        continue
      key = tuple(r.get(f) for f in sweep.SETTING)
      if key not in times:
        job = dict(config=json.loads(variant.to_json()), steps=config.timing_steps, repeats=config.timing_repeats,
                   long_length=config.long_length)
        times[key] = isolation.spawn("experiments.studies.tradeoff", job)
      rate, seconds = times[key]["steps_per_s"], times[key]["long_step_s"]
      out.append(dict(study=study, name=r["name"], setting=sweep.setting(r), metric=metric, value=r[metric],
                      seed=r["seed"], state_size=r["state_size"], seq_len=r["seq_len"],
                      batch_size=variant.train.batch_size, steps_per_s=rate,
                      long_length=config.long_length, long_step_s=seconds))
      progress(f"{study} {r['name']:>24} {metric} {r[metric]:.4f} {rate:.2f} steps/s, "
               f"{seconds:.3f} s/step at L={config.long_length}")
  return out


def summarize(records, config) -> str:
  long = config.long_length
  lines = ["# Quality against training speed", "",
           f"Quality: each study's committed result (its own task: runs that change the data are left out); "
           f"steps/s: the run's train step timed here alone (median of {config.timing_repeats} × "
           f"{config.timing_steps} steps after compiling); s/step at L={long}: one train step of the same model "
           f"on one sequence of {long} tokens (median of {config.timing_repeats}). Seeds of a setting share its "
           "times.", "",
           f"| study | run | attention | L | batch | quality | decoding state | steps/s | s/step at L={long} |",
           "|" + "---|" * 9]
  for r in records:
    lines.append(f"| {r['study']} | {r['name']} | {r['setting']} | {r['seq_len']} | {r['batch_size']} | "
                 f"{r['metric']} {r['value']:.4f} | {r['state_size']} | {r['steps_per_s']:.2f} | "
                 f"{r['long_step_s']:.3f} |")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir):
  """One column per study; top: quality against steps/s at the study's length, bottom (with a long length):
  against seconds per step at ``long_length``. One point per setting (mean over seeds)."""
  studies = list(dict.fromkeys(r["study"] for r in records))
  axes_x = [("steps_per_s", None)] + ([("long_step_s", "log")] if config.long_length else [])
  fig, axes = plotting.subplots(len(axes_x), len(studies), figsize=(4.8 * len(studies), 3.8 * len(axes_x)),
                                squeeze=False)
  style = plotting.point_styles(sorted({r["setting"] for r in records}))
  for column, study in enumerate(studies):
    rows = [r for r in records if r["study"] == study]
    groups: dict[str, list[dict]] = {}
    for r in rows:
      groups.setdefault(r["setting"], []).append(r)
    for (field, scale), ax in zip(axes_x, axes[:, column]):
      for setting, runs in groups.items():
        value = sum(r["value"] for r in runs) / len(runs)
        ax.scatter(runs[0][field], value, **style[setting], s=40, label=setting)
      xlabel = (f"training steps/s (L={rows[0]['seq_len']}, batch {rows[0]['batch_size']})" if field == "steps_per_s"
                else f"seconds per train step (L={config.long_length}, batch 1)")
      ax.set(xlabel=xlabel, ylabel=rows[0]["metric"].replace("_", " "), title=study)
      if scale:
        ax.set_xscale(scale)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: no crowded labels
      ax.grid(alpha=0.3)
  plotting.legend_right(fig)
  return [plotting.save(fig, os.path.join(workdir, "tradeoff.png"))]


if __name__ == "__main__":
  isolation.child_main(_measure)
