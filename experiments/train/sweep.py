"""Training study for experiments.main: one training run per variant, collected into one table and plot.

A config's ``variants`` lists (name, {dotted field: value}) pairs; each run
trains in ``workdir/name`` (its own checkpoints and ``metrics.jsonl``), and
rerunning the command resumes every unfinished run. All variants are checked
before the first one starts.
"""

from __future__ import annotations

import copy
import json
import os

import jax
import numpy as np

from experiments.configs import common
from experiments.tasks import listops
from experiments.train import diagnostics, flops, models, paths, plotting, training


def variant_configs(config) -> list[tuple[str, object]]:
  """[(name, config with the variant's overrides)], filtered by ``config.only``; each one checked, and no two
  computing the same (a variant that leaves a field to the config, changed on the command line, would run
  another variant's config under its own name)."""
  out, seen = [], {}
  for name, overrides in common.selected_variants(config):
    c = common.set_fields(copy.deepcopy(config), overrides, what=f"variant {name!r} overrides")
    training.check_config(c)
    check_variant_read(name, overrides, c)
    fields = json.dumps(training.run_fields(c, resume=False), sort_keys=True)
    if fields in seen:
      raise ValueError(f"variants {seen[fields]!r} and {name!r} would run the same config (the command line's "
                       "values included): a variant must set the fields that make it what its name says")
    seen[fields] = name
    out.append((name, c))
  return out


def check_variant_read(name: str, overrides: dict, config) -> None:
  """Stops on a field the variant sets that its run does not read (as for a command-line value): the study's
  own fields (its labels, ``variants``, ``only``) and those ``training.unused_fields`` names (e.g. FAVOR's under
  softmax, ``attention.num_features`` for a kernel without a random projection, ``mesh.fsdp`` on one device)."""
  unused = training.unused_fields(config)
  for field, value in overrides.items():
    top = field.split(".")[0]
    why = (f"{top} is the study's field, not a run's" if top in training.NOT_OF_THE_RUN
           else next((why for f, why in unused.items() if field == f or field.startswith(f + ".")), None))
    if why is not None:
      raise ValueError(f"variant {name!r} sets {field}={value!r}, which its run does not read ({why}): drop it "
                       "from the variant, or set the fields that make it apply")


def runs(config) -> list[tuple[str, str, object]]:
  """[(name, field prefix, training config)] of every run (``training.check_overrides_used``)."""
  return [(name, "", c) for name, c in variant_configs(config)]


def features(config) -> int:
  """F, the feature dimension of the config's FAVOR layers (0 for softmax): ``flops.feature_map``'s."""
  return flops.feature_map(config)[1]


def sequence_length(config) -> int:
  """L of a task's sequences: ``data.seq_len`` (MQAR, Shakespeare), else the padded ``data.max_length`` (ListOps)."""
  return config.data.get("seq_len", None) or config.data.max_length


def attention_fields(config) -> dict:
  """The attention fields a record holds (what ``setting`` describes); those a kernel does not use are empty."""
  a, unused = config.attention, training.unused_fields(config)
  field = lambda name, empty: empty if f"attention.{name}" in unused else a[name]
  return dict(attention=a.type, kernel=field("kernel", ""), num_features=field("num_features", 0),
              projection=field("projection", ""), redraw_every=field("redraw_every", 0),
              window=field("window", 0), qk_head_dim=field("qk_head_dim", 0), short_conv=config.model.short_conv,
              forget_gate=a.get("forget_gate", False), alibi=a.get("alibi", False),
              control_variate=field("control_variate", 0.0) if "control_variate" in a else 0.0,
              qk_map=field("qk_map", "none") if "qk_map" in a else "none",
              positions=config.model.positions, pack=config.data.get("pack", False))


def final_record(name: str, config, records: list[dict]) -> dict:
  evals = [r for r in records if r["kind"] == "eval"]
  trains = [r for r in records if r["kind"] == "train"]
  return dict(
      name=name, task=config.task, **attention_fields(config), features=features(config),
      state_size=models.decode_state_size(config, sequence_length(config)),
      seq_len=sequence_length(config), num_kv_pairs=config.data.get("num_kv_pairs", 0),
      steps=config.train.steps, seed=config.train.seed,
      train_loss=trains[-1]["train_loss"], **{k: v for k, v in evals[-1].items() if k.startswith("eval_")},
      best_eval_accuracy=max(r["eval_accuracy"] for r in evals),
      # steps/s over the last logging window, as tokens/s and MFU are (a record without it: the whole process's)
      steps_per_s=trains[-1].get("window_steps_per_s", trains[-1].get("steps_per_s", float("nan"))),
      **{k: trains[-1][k] for k in THROUGHPUT_FIELDS if k in trains[-1]})


THROUGHPUT_FIELDS = ("window_steps_per_s", "tokens_per_s", "flops_per_token", "flops_per_token_causal_half",
                     "ceiling", "ceiling_kind", "ceiling_flops_per_s", "devices", "devices_present", *flops.MFU_FIELDS)


def _utilisation(r: dict) -> str:
  """A record's MFU cell: a fraction of the published peak, or labelled as a fraction of a measured matmul."""
  if "mfu" in r:
    return f"{r['mfu']:.2%}"
  return f"{r['mfu_vs_measured_matmul']:.2%} of matmul" if "mfu_vs_measured_matmul" in r else ""


def _ceilings(records: list[dict]) -> list[str]:
  """The summary's note on its throughput columns: the window they share, each ceiling's value and kind, the
  convention of causal products and the other convention's figure."""
  timed = [r for r in records if "ceiling" in r]
  if not timed:
    return []
  lines = ["", "steps/s, tokens/s and MFU: the last logging window's rates (this process's clock, evaluations and "
           "checkpoint saves excluded); MFU = tokens/s × model FLOPs per token (train: 3 × forward, attention "
           "included, a causal product counted whole as XLA computes it; docs/training.md) / the ceiling:"]
  for source, kind, value in sorted({(r["ceiling"], r["ceiling_kind"], r["ceiling_flops_per_s"]) for r in timed}):
    lines.append(f"- {source}: {value / 1e12:.3g} TFLOP/s ({kind})"
                 + (": a same-run ceiling, not the chip's peak; its column reads 'of matmul'"
                    if kind == flops.MEASURED else ""))
  half = [r for r in timed if "mfu_causal_half" in r or "mfu_vs_measured_matmul_causal_half" in r]
  if half:
    lines.append("- counting a causal product's kept half only (MaxText's convention): " + ", ".join(
        f"{r['name']} {r.get('mfu_causal_half', r.get('mfu_vs_measured_matmul_causal_half')):.2%}" for r in half))
  return lines


def run(config, progress, workdir) -> list[dict]:
  runs = variant_configs(config)
  for _, c in runs:  # every variant can be sampled, checked before the first one trains
    training.check_decodes(c)
  style = plotting.run_styles(name for name, _ in runs)
  results, stopped = [], []
  for i, (name, c) in enumerate(runs):
    progress(f"run {i + 1}/{len(runs)}: {name}")
    try:
      records, state = training.train(c, os.path.join(workdir, name),
                                      progress=lambda m, n=name: progress(f"{n} {m}"))
    except training.Stopped as e:  # the other runs still train up to their stop (a preemptible job's share)
      stopped += e.runs
      continue
    results.append(final_record(name, c, records))
    if config.get("config_name") == "sharp":  # issue 53: each run's attention on its own activations
      results[-1].update(diagnostics.own_activations(c, state))
    if jax.process_index() == 0:  # multi-host: process 0 writes the plots (in the run's colour of curves.png)
      plotting.training_curves({name: records}, os.path.join(workdir, name, "loss.png"), {name: style[name]})
  if stopped:
    raise training.Stopped(stopped)
  return results


def _main_metric(records):
  """The headline metric of a study's records: the first of ``plotting.LM_METRICS`` they hold (language models),
  else eval accuracy."""
  return next((m for m in plotting.LM_METRICS if m in records[0]), "eval_accuracy")


# Fields that make runs the same setting (all but the seed): mean_over_seeds groups on them.
SETTING = ("task", "attention", "kernel", "num_features", "projection", "redraw_every", "window", "qk_head_dim",
           "short_conv", "seq_len", "num_kv_pairs", "steps", "forget_gate", "alibi", "positions", "pack",
           "control_variate", "qk_map")


def mean_over_seeds(records: list[dict], metric: str) -> list[dict]:
  """One row per setting (``SETTING``): the first run's name and fields, ``metric`` (and ``metric`` at other
  lengths, ``METRIC_at_L``) and best accuracy averaged over its seeds, ``seeds`` the seeds, ``spread`` max − min
  of ``metric``."""
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    groups.setdefault(tuple(r.get(f) for f in SETTING), []).append(r)
  rows = []
  for runs in groups.values():
    values = [r[metric] for r in runs]
    at_lengths = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k.startswith(metric + "_at_")
                  and all(k in r for r in runs)}
    rows.append({**runs[0], **at_lengths, metric: sum(values) / len(values), "seeds": [r["seed"] for r in runs],
                 "spread": max(values) - min(values),
                 "best_eval_accuracy": sum(r["best_eval_accuracy"] for r in runs) / len(runs)})
  return rows


def setting(r) -> str:
  """What a run's attention is, in words: "softmax", "taylor d=16 + window 16", "positive M=64 + conv 4"."""
  conv = f" + conv {r['short_conv']}" if r.get("short_conv") else ""  # records from before the field: none
  conv += " + forget gate" * bool(r.get("forget_gate")) + " + alibi" * bool(r.get("alibi"))
  if r["attention"] == "softmax":
    return "softmax" + conv
  parts = [r["kernel"]]
  if r["num_features"]:
    parts.append(f"M={r['num_features']}")
  if r.get("qk_head_dim"):  # records from before the field: none
    parts.append(f"d={r['qk_head_dim']}")
  if r["redraw_every"]:
    parts.append(f"redraw {r['redraw_every']}")
  if r.get("qk_map", "none") != "none":  # records from before the field: none
    parts.append(f"qk {r['qk_map']}")
  window = f" + window {r['window']}" if r.get("window") else ""
  window += f" (control variate {r['control_variate']:g})" if r.get("control_variate") else ""
  return " ".join(parts) + window + conv


def markdown_table(columns: list[str], rows: list[list[str]]) -> list[str]:
  """A markdown table's lines, without the columns that are empty in every row."""
  keep = [i for i in range(len(columns)) if any(row[i] for row in rows)]
  pick = lambda cells: "| " + " | ".join(cells[i] for i in keep) + " |"
  return [pick(columns), "|" + "---|" * len(keep)] + [pick(row) for row in rows]


def chance_accuracy(r: dict) -> float:
  """Accuracy without learning the task beyond its format: MQAR, one of the sequence's ``num_kv_pairs`` values;
  ListOps, one of its classes; 0 where not defined (language models: no accuracy is read as a result)."""
  if r["task"] == "mqar" and r.get("num_kv_pairs"):
    return 1.0 / r["num_kv_pairs"]
  if r["task"] == "listops":
    return 1.0 / listops.NUM_CLASSES
  return 0.0


def _seeds(r: dict) -> str:
  n = len(r.get("seeds", [r["seed"]]))
  return f", mean over {n} seeds" if n > 1 else ""


def compared_with_softmax(run: dict, base: dict, metric: str) -> str:
  """One line: ``run`` against softmax's ``base`` on ``metric``. Bits/char and losses: their ratio (run /
  softmax). Accuracies: both and their difference in points, none when both lie within twice chance (a ratio
  of two near-chance accuracies is noise, not a result)."""
  if metric != "eval_accuracy":
    return f"- {run['name']}: {run[metric] / base[metric]:.3f}{_seeds(run)}"
  chance = chance_accuracy(run)
  if chance and max(run[metric], base[metric]) < 2 * chance:
    return (f"- {run['name']}: {100 * run[metric]:.1f}% and softmax {100 * base[metric]:.1f}%: both below twice "
            f"chance ({100 * chance:.1f}%), neither has learned the task: no comparison")
  return (f"- {run['name']}: {100 * run[metric]:.1f}% against softmax's {100 * base[metric]:.1f}% "
          f"({100 * (run[metric] - base[metric]):+.1f} points){_seeds(run)}")


def finding(settings: list[dict], metric: str) -> str:
  """The study's result in one sentence: the best run that is not softmax against softmax in the same model."""
  lower_better = metric != "eval_accuracy"
  pairs = [(r, b) for b in settings if b["attention"] == "softmax" for r in settings
           if r["attention"] != "softmax" and all(r.get(f) == b.get(f) for f in COMPARED_ON)]
  if not pairs:
    return ""
  best, base = (min if lower_better else max)(pairs, key=lambda p: p[0][metric])
  chance = chance_accuracy(best) if not lower_better else 0.0
  if chance and max(best[metric], base[metric]) < 2 * chance:
    return (f"Finding: no run learns the task in {best['steps']} steps (every accuracy below twice chance, "
            f"{100 * chance:.1f}%).")
  if lower_better:
    result = f"{best[metric]:.3f} against softmax's {base[metric]:.3f} ({best[metric] / base[metric]:.3f}×)"
  else:
    result = f"{100 * best[metric]:.1f}% against softmax's {100 * base[metric]:.1f}%"
  return (f"Finding: the best run without softmax, {best['name']} ({setting(best)}), reaches {metric} {result} "
          f"after {best['steps']} steps{_seeds(best)}.")


COMPARED_ON = ("num_kv_pairs", "seq_len", "short_conv")  # a run is compared with softmax where these agree


def summarize(records: list[dict], config) -> str:
  metric = _main_metric(records)
  settings = mean_over_seeds(records, metric)
  lines = [f"# Training: {config.task}\n"]
  found = finding(settings, metric)
  if found:
    lines += [found, ""]
  lines += ["F: feature dimension per head (– for softmax); state: numbers per layer and sequence kept to decode "
            "the next token (softmax: its key-value cache at the training length L; for an encoder task, what a "
            "causal layer of the same shape would keep).\n"]
  # A tokenizer's runs: bits per token and perplexity beside the headline bits per byte (a byte vocabulary's are
  # its bits per byte and 2^bpc)
  extra = [(k, label) for k, label in (("eval_bits_per_token", "eval bits/token"), ("eval_perplexity", "perplexity"))
           if metric in ("eval_bits_per_byte", "eval_bits_per_token") and k != metric]
  columns = ["run", "attention", "F", "L", "kv pairs", "seed", "steps", "eval loss", metric,
             *(label for _, label in extra), "best eval acc", "state", "steps/s", "tokens/s", "MFU"]
  lines += markdown_table(columns, [
      [r["name"], setting(r), str(r["features"] or "–"), str(r["seq_len"]), str(r["num_kv_pairs"] or ""),
       str(r["seed"]), str(r["steps"]), f"{r['eval_loss']:.4f}", f"{r[metric]:.4f}",
       *(f"{r[k]:.4f}" if k in r else "" for k, _ in extra),
       f"{r['best_eval_accuracy']:.4f}", str(r["state_size"]), f"{r['steps_per_s']:.2f}",
       f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "", _utilisation(r)]
      for r in records])
  if metric == "eval_bits_per_byte":
    lines += ["", f"{metric}: held-out bits per byte of text = bits per token × the held-out target tokens / the "
              "bytes they stand for (data.tokenizer's); bits per byte compare runs of different tokenizers, bits "
              "per token and perplexity only runs of the same one."]
  elif metric == "eval_bits_per_token":
    lines += ["", f"{metric}: held-out bits per token; the token file's tokenizer is not given (data.tokenizer), so "
              "the bytes per token and bits per byte are unknown."]
  lines += _ceilings(records)
  idle = [r for r in records if r.get("devices", 0) < r.get("devices_present", 0)]
  if idle:
    lines += ["", "Idle devices: " + "; ".join(f"{r['name']} trained on {r['devices']} of the {r['devices_present']} "
                                                "devices present" for r in idle)
              + " (its mesh.data × mesh.sequence; mesh.data=-1 takes every device)."]
  if len(settings) < len(records):
    lines += ["", f"## Mean over seeds ({metric}; spread = max − min)", ""]
    lines += markdown_table(
        ["run", "attention", "kv pairs", "seeds", metric, "spread", "best eval acc"],
        [[r["name"], setting(r), str(r["num_kv_pairs"] or ""), str(len(r["seeds"])), f"{r[metric]:.4f}",
          f"{r['spread']:.4f}", f"{r['best_eval_accuracy']:.4f}"] for r in settings])
  lengths = sorted({int(k.rpartition("_")[2]) for r in records for k in r if k.startswith(metric + "_at_")})
  if lengths:
    lines += ["", f"## Length extrapolation ({metric}, mean over seeds; trained at L, evaluated at longer lengths "
              "without retraining)", ""]
    cell = lambda r, n: f"{r[f'{metric}_at_{n}']:.4f}" if f"{metric}_at_{n}" in r else ""
    lines += markdown_table(
        ["run", "attention", "positions", "seeds", "at L"] + [f"at {n}" for n in lengths],
        [[r["name"], setting(r), str(r.get("positions", "")), str(len(r["seeds"])), f"{r[metric]:.4f}"]
         + [cell(r, n) for n in lengths] for r in settings])
  for base in (r for r in settings if r["attention"] == "softmax"):
    others = [r for r in settings if r["attention"] == "favor" and all(r.get(f) == base.get(f) for f in COMPARED_ON)]
    if others:
      pairs = f", {base['num_kv_pairs']} kv pairs" if base["num_kv_pairs"] else ""
      ratio = f" {metric} ratio run / softmax" if metric != "eval_accuracy" else ""
      lines += ["", f"Relative to softmax ({base['name']}{pairs}{_seeds(base)}):{ratio}"]
      lines += [compared_with_softmax(r, base, metric) for r in others]
  pairs = [(r, s) for r in records for s in records if r["redraw_every"] and not s["redraw_every"]
           and all(r.get(f) == s.get(f) for f in SETTING if f != "redraw_every") and r["seed"] == s["seed"]]
  if pairs:
    lines += ["", "## Feature redraw (same setting and seed)", ""]
    lines += markdown_table(
        ["kernel", "M", "redraw every", f"{metric} with redraw", "without", "best acc with", "without"],
        [[r["kernel"], str(r["num_features"]), str(r["redraw_every"]), f"{r[metric]:.4f}", f"{s[metric]:.4f}",
          f"{r['best_eval_accuracy']:.4f}", f"{s['best_eval_accuracy']:.4f}"] for r, s in pairs])
  lines += against_fox(settings, records, metric, lengths)
  return "\n".join(lines) + "\n"


def against_fox(settings: list[dict], records: list[dict], metric: str, lengths: list[int]) -> list[str]:
  """The gated runs against the Forgetting Transformer (softmax + forget gate), mean over seeds: ``metric`` at each
  length as a ratio run / FoX, and the train step's time as a ratio (each run's last logging window: tokens/s of
  FoX over the run's). [] without a FoX run."""
  fox = [r for r in settings if r["attention"] == "softmax" and r.get("forget_gate") and not r.get("alibi")]
  if not fox or metric == "eval_accuracy":
    return []
  fox = fox[0]
  key = lambda r: tuple(r.get(f) for f in SETTING)
  rate = lambda r: float(np.mean([x["tokens_per_s"] for x in records if key(x) == key(r) and x.get("tokens_per_s")]
                                 or [float("nan")]))
  ratio = lambda r, k: f"{r[k] / fox[k]:.3f}" if k in r and k in fox else ""
  keys = [metric] + [f"{metric}_at_{n}" for n in lengths]
  out = ["", f"## Against FoX ({fox['name']}{_seeds(fox)}): {metric} ratio run / FoX, train-step time ratio", ""]
  out += markdown_table(
      ["run", "attention", "seeds", "at L"] + [f"at {n}" for n in lengths] + ["step time / FoX's"],
      [[r["name"], setting(r), str(len(r["seeds"]))] + [ratio(r, k) for k in keys] + [f"{rate(fox) / rate(r):.2f}"]
       for r in settings if r.get("forget_gate") and r is not fox])
  diagnosed = [r for r in records if "own_error" in r]
  if diagnosed:
    out += ["", "## On each run's own activations (first held-out batch, at L; mean over layers)", "",
            "entropy: of the exact gated softmax rows (nats); peak logit: the largest q·k/√d a row sees; ‖x+y‖²: at "
            "the row's heaviest key (one positive feature pair's relative variance there is e^{‖x+y‖²} − 1); "
            "error: ‖out − exact‖/‖exact‖ of the run's own estimator against the exact gated softmax.", ""]
    out += markdown_table(
        ["run", "attention", "seed", "entropy", "peak logit", "‖x+y‖² at the heaviest key", "own error"],
        [[r["name"], setting(r), str(r["seed"]), f"{r['attention_entropy']:.3f}", f"{r['peak_logit']:.2f}",
          f"{r['peak_pair_sq']:.2f}", f"{r['own_error']:.3f}" if r["attention"] == "favor" else "–"]
         for r in diagnosed])
  return out


def plot(records: list[dict], config, workdir: str) -> list[str]:
  """curves.png (every run's training and evaluation curves) and state.png (quality against decoding state, one
  point per setting): each run in the colour, marker and label it has in every figure of the study."""
  curves = {}
  for r in records:
    text = paths.read_text(os.path.join(workdir, r["name"], "metrics.jsonl"))
    curves[r["name"]] = [json.loads(line) for line in text.splitlines()]
  style = plotting.run_styles(curves)
  written = [plotting.training_curves(curves, os.path.join(workdir, "curves.png"), style)]
  metric = _main_metric(records)
  written.append(plotting.quality_vs_state(mean_over_seeds(records, metric), metric, style,
                                           os.path.join(workdir, "state.png")))
  timed = [r for r in records if r.get("tokens_per_s")]
  if config.get("config_name") == "sharp" and timed:  # bits/char against step time (issue 53's figure)
    rows = [{**r, "step_s": config.train.batch_size * r["seq_len"] / r["tokens_per_s"]} for r in timed]
    written.append(plotting.quality_vs_step_time(rows, metric, style, os.path.join(workdir, "step_time.png")))
  return written
