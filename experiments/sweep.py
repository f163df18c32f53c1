"""Training study for experiments.main: one training run per variant, collected into one table and plot.

A config's ``variants`` lists (name, {dotted field: value}) pairs; each run
trains in ``workdir/name`` (its own checkpoints and ``metrics.jsonl``), and
rerunning the command resumes every unfinished run. All variants are checked
before the first one starts.
"""

from __future__ import annotations

import copy
import os

import jax

from experiments import plotting, training
from experiments.configs import common


def variant_configs(config) -> list[tuple[str, object]]:
  """[(name, config with the variant's overrides)], filtered by ``config.only``; each one checked."""
  out = []
  for name, overrides in common.selected_variants(config):
    c = common.set_fields(copy.deepcopy(config), overrides, what=f"variant {name!r} overrides")
    training.check_config(c)
    out.append((name, c))
  return out


def final_record(name: str, config, records: list[dict]) -> dict:
  evals = [r for r in records if r["kind"] == "eval"]
  trains = [r for r in records if r["kind"] == "train"]
  a = config.attention
  favor = a.type == "favor"
  return dict(
      name=name, task=config.task, attention=a.type, kernel=a.kernel if favor else "",
      num_features=a.num_features if favor else 0, projection=a.projection if favor else "",
      redraw_every=a.redraw_every, steps=config.train.steps, seed=config.train.seed,
      train_loss=trains[-1]["train_loss"], **{k: v for k, v in evals[-1].items() if k.startswith("eval_")},
      best_eval_accuracy=max(r["eval_accuracy"] for r in evals),
      steps_per_s=trains[-1].get("steps_per_s", float("nan")))


def run(config, progress, workdir) -> list[dict]:
  runs = variant_configs(config)
  results = []
  for i, (name, c) in enumerate(runs):
    progress(f"run {i + 1}/{len(runs)}: {name}")
    records, _ = training.train(c, os.path.join(workdir, name), progress=lambda m, n=name: progress(f"{n} {m}"))
    results.append(final_record(name, c, records))
    if jax.process_index() == 0:  # multi-host: process 0 writes the plots
      plotting.training_curves({name: records}, os.path.join(workdir, name, "loss.png"))
  return results


def _main_metric(records):
  return "eval_bpc" if "eval_bpc" in records[0] else "eval_accuracy"


def summarize(records: list[dict], config) -> str:
  metric = _main_metric(records)
  lines = [f"# Training: {config.task}\n",
           f"| run | attention | kernel | M | projection | redraw every | steps | eval loss | {metric} "
           "| best eval acc | steps/s |", "|" + "---|" * 11]
  for r in records:
    lines.append(f"| {r['name']} | {r['attention']} | {r['kernel']} | {r['num_features'] or ''} | "
                 f"{r['projection']} | {r['redraw_every'] or 'never'} | {r['steps']} | {r['eval_loss']:.4f} | "
                 f"{r[metric]:.4f} | {r['best_eval_accuracy']:.4f} | {r['steps_per_s']:.2f} |")
  softmax = [r for r in records if r["attention"] == "softmax"]
  if softmax:
    base = softmax[0][metric]
    lines += ["", f"Relative to softmax ({softmax[0]['name']}): {metric} ratio FAVOR / softmax"]
    lines += [f"- {r['name']}: {r[metric] / base:.3f}" for r in records if r["attention"] == "favor"]
  pairs = [(r, s) for r in records for s in records if r["redraw_every"] and not s["redraw_every"]
           and (r["kernel"], r["num_features"], r["projection"], r["seed"]) ==
           (s["kernel"], s["num_features"], s["projection"], s["seed"])]
  if pairs:
    lines += ["", "## Feature redraw (same kernel, M, projection, seed)", "",
              f"| kernel | M | redraw every | {metric} with redraw | without | best acc with | without |",
              "|" + "---|" * 7]
    lines += [f"| {r['kernel']} | {r['num_features']} | {r['redraw_every']} | {r[metric]:.4f} | {s[metric]:.4f} | "
              f"{r['best_eval_accuracy']:.4f} | {s['best_eval_accuracy']:.4f} |" for r, s in pairs]
  return "\n".join(lines) + "\n"


def plot(records: list[dict], config, workdir: str) -> list[str]:
  import json
  curves = {}
  for r in records:
    with open(os.path.join(workdir, r["name"], "metrics.jsonl")) as f:
      curves[r["name"]] = [json.loads(line) for line in f]
  return [plotting.training_curves(curves, os.path.join(workdir, "curves.png"))]
