"""The main job: what the library is for, in one table and one figure, in minutes on a CPU.

Trains each variant of the config (softmax, FAVOR+, the best linear-time variants) on the same task with
:mod:`experiments.train.sweep`, then compiles one train step of each run's model on one sequence of
``config.long.length`` tokens, reads XLA's memory accounting of it (arguments + outputs + temporaries) and
times it (median of ``config.long.repeats`` steps): quality where softmax is affordable, cost where it is not.
"""

from __future__ import annotations

import copy
import os
import time

import jax
import tqdm

from experiments.studies import tradeoff
from experiments.studies.timing import median_of
from experiments.train import paths, plotting, sweep, training

SHOWCASE_FIELDS = ("long",)  # the study's own fields: no training run reads them


def training_config(config):
  """``config`` without the showcase's own fields: what :mod:`experiments.train.sweep` trains (a run's recorded
  fields stay those of a training run, so resuming does not depend on ``long``)."""
  config = copy.deepcopy(config)
  config.unlock()
  for field in SHOWCASE_FIELDS:
    del config[field]
  config.experiment = "train"
  return config


def runs(config) -> list[tuple[str, str, object]]:
  """[(name, field prefix, training config)] of every run (``training.check_overrides_used``)."""
  return sweep.runs(training_config(config))


def check_long(config) -> None:
  """``config.long``'s fields, named when bad, before anything trains."""
  length, repeats = config.long.length, config.long.repeats
  if isinstance(length, bool) or not isinstance(length, int) or length < 0:
    raise ValueError(f"config.long.length must be an int >= 0 (0 = no long-sequence step), got {length!r}")
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"config.long.repeats must be an int >= 1 (timed steps), got {repeats!r}")
  if length and config.model.positions != "rotary":
    raise ValueError(f"config.long.length={length} needs rotary positions (the same parameters at any length), "
                     f"got model.positions={config.model.positions!r}; or set config.long.length=0")


def long_step_cost(config, length: int, repeats: int) -> tuple[float, int]:
  """(median seconds, XLA's bytes: arguments + outputs + temporaries) of one train step of ``config``'s model
  on one sequence of ``length`` tokens, on one device, compilation excluded."""
  config = copy.deepcopy(config)
  config.mesh.update(data=1, sequence=1)
  run = training.build(config)
  step, batch = tradeoff.long_train_step(config, run, length)
  compiled = step.lower(run.state, batch).compile()
  mem = compiled.memory_analysis()
  nbytes = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
  seconds = median_of(lambda: jax.block_until_ready(compiled(run.state, batch).params), repeats, warmup=False)
  return seconds, nbytes


def run(config, progress, workdir) -> list[dict]:
  """Trains every variant (resuming finished or unfinished runs), then measures each one's long train step."""
  check_long(config)
  records = sweep.run(training_config(config), progress, workdir)
  length = config.long.length
  if not length:
    return records
  variants = dict(sweep.variant_configs(training_config(config)))
  out, start = [], time.time()
  for i, r in enumerate(records):
    meter = lambda done: tqdm.tqdm.format_meter(done, len(records), time.time() - start, unit=" runs", ascii=" #",
                                                bar_format=training.PROGRESS)
    progress(f"{meter(i)} compiling and timing {r['name']}'s train step at L={length}")
    seconds, nbytes = long_step_cost(variants[r["name"]], length, config.long.repeats)
    out.append(dict(r, long_length=length, long_step_s=seconds, long_bytes=nbytes))
    progress(f"{meter(i + 1)} {r['name']}: {seconds:.3f} s per train step at L={length}, {nbytes / 2**30:.2f} GiB")
  return out


def _softmax(records):
  return next((r for r in records if r["attention"] == "softmax"), None)


# A quality gap this small is not one a single seed can show: softmax's two seeds differed by 2% in the
# Shakespeare estimators study (docs/experiments.md). Within it the finding says "a tie on this evidence".
TIE = 0.03


def finding(records) -> str:
  """The study's result in one sentence: the best linear-time run against softmax, in quality and cost, saying
  how many seeds and steps it rests on; a gap within ``TIE`` is a tie on that evidence, never equal quality."""
  metric = sweep._main_metric(records)
  base = _softmax(records)
  linear = [r for r in records if r["attention"] != "softmax"]
  if base is None or not linear:
    return "No softmax run and linear-time run side by side: nothing to compare."
  lower_better = metric != "eval_accuracy"
  best = (min if lower_better else max)(linear, key=lambda r: r[metric])
  unit = "bits/char" if metric == "eval_bpc" else metric.replace("_", " ")
  ratio = best[metric] / base[metric]
  seeds = min(len(r.get("seeds", [r["seed"]])) for r in (base, best))  # a setting's runs (sweep.mean_over_seeds)
  numbers = (f"{best[metric]:.3f} against {base[metric]:.3f}, {ratio:.3f}×, "
             f"{'one seed' if seeds == 1 else f'the mean of {seeds} seeds'}")
  gap = abs(ratio - 1)
  if gap <= TIE:
    verdict = (f"is within {gap:.1%} of softmax's {unit} ({numbers}): a gap under the {TIE:.0%} this study counts "
               "as a tie, not a claim of equal quality")
  else:
    verdict = f"is {gap:.1%} {'worse' if (ratio > 1) == lower_better else 'better'} than softmax in {unit} ({numbers})"
  sentence = f"After {best['steps']} steps, {sweep.setting(best)} {verdict}"
  if "long_step_s" in best:
    speed = base["long_step_s"] / best["long_step_s"]
    memory = base["long_bytes"] / best["long_bytes"]
    sentence += (f"; at L={best['long_length']} its train step takes {best['long_step_s']:.2f} s against "
                 f"softmax's {base['long_step_s']:.2f} s ({speed:.0f}× faster) in {memory:.1f}× less memory")
  others = [r for r in linear if r is not best]
  if others:
    sentence += (f"; the others' {unit}: " + ", ".join(f"{sweep.setting(r)} {r[metric] / base[metric]:.3f}×"
                                                        for r in others) + " softmax's")
  return sentence + "."


def summarize(records, config) -> str:
  metric = sweep._main_metric(records)
  base = _softmax(records)
  length = config.long.length
  columns = ["run", "attention", "bits/char" if metric == "eval_bpc" else metric, "× softmax",
             "decoding state (numbers/layer)"]
  if length:
    columns += [f"s/step at L={length}", "× softmax's time", f"memory at L={length} (GiB)"]
  lines = ["# Softmax against linear-time attention: quality and long-sequence cost", "", finding(records), "",
           f"Quality: {metric} on held-out text after {records[0]['steps']} steps (seed {records[0]['seed']}, one "
           "run each). Decoding state: what one layer keeps per sequence to decode the next token (softmax: its "
           f"key-value cache at L={records[0]['seq_len']})."
           + (f" At L={length}: one train step of the same model on one sequence of {length} tokens, compiled, "
              f"then timed (median of {config.long.repeats}); memory: XLA's accounting of the compiled step "
              "(arguments + outputs + temporaries)." if length else ""), "",
           "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in records:
    cells = [r["name"], sweep.setting(r), f"{r[metric]:.3f}", f"{r[metric] / base[metric]:.3f}" if base else "",
             str(r["state_size"])]
    if length:
      cells += [f"{r['long_step_s']:.3f}", f"{r['long_step_s'] / base['long_step_s']:.3f}" if base else "",
                f"{r['long_bytes'] / 2**30:.2f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir) -> list[str]:
  """showcase.png: held-out quality against step per run; the long train step's seconds and memory per run.
  Each run one colour and label in every panel (``plotting.run_styles``)."""
  import json
  metric = sweep._main_metric(records)
  style = plotting.run_styles([r["name"] for r in records])
  panels = 3 if config.long.length else 1
  fig, axes = plotting.subplots(1, panels, figsize=(4.4 * panels, 3.8), squeeze=False)
  ax = axes[0, 0]
  ends = []
  for r in records:
    lines = paths.read_text(os.path.join(workdir, r["name"], "metrics.jsonl")).splitlines()
    evals = [e for e in map(json.loads, lines) if e["kind"] == "eval" and e["step"] > 0]
    ax.plot([e["step"] for e in evals], [e[metric] for e in evals], label=r["name"], **style[r["name"]])
    ends += [e[metric] for e in evals]
  plotting.ticks_enclose(ax, ends)
  better = "lower" if metric != "eval_accuracy" else "higher"
  ax.set(xlabel="step", ylabel=f"held-out {'bits/char' if metric == 'eval_bpc' else metric}",
         title=f"quality ({better} is better)")
  ax.grid(alpha=0.3)
  if config.long.length:
    names = [r["name"] for r in records]
    for ax, field, scale, label in ((axes[0, 1], "long_step_s", 1.0, "seconds per train step"),
                                    (axes[0, 2], "long_bytes", 2.0**-30, "memory of the train step (GiB)")):
      values = [r[field] * scale for r in records]
      bars = ax.bar(range(len(records)), values, color=[style[n]["color"] for n in names])
      ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
      ax.set_xticks(range(len(records)), [""] * len(records))
      ax.set(ylabel=label, title=f"one train step at L={config.long.length}")
      ax.margins(y=0.15)
      ax.grid(alpha=0.3, axis="y")
  plotting.legend_right(fig)
  return [plotting.save(fig, os.path.join(workdir, "showcase.png"))]
