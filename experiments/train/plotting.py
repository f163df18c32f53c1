"""Figures for the studies: headless matplotlib, readable axes, legends that cover no data."""

from __future__ import annotations

import itertools
import math

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
          "tab:gray", "tab:olive", "tab:cyan")
LINESTYLES = ("-", "--", ":", "-.")


def subplots(*args, **kwargs):
  """``plt.subplots`` on the Agg backend (no display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt.subplots(*args, **kwargs)


def save(fig, path: str, dpi: int = 120) -> str:
  """Saves and closes ``fig`` at ``path`` (a local path or a run directory's URL: ``paths``); the canvas grows
  to hold a legend placed outside the axes."""
  import matplotlib.pyplot as plt

  from experiments.train import paths
  fig.tight_layout()
  paths.save_figure(fig, path, dpi=dpi, bbox_inches="tight")
  plt.close(fig)
  return path


def distinct_colors(n: int) -> list:
  """``n`` colours no two alike: the ten of COLORS, else twenty from tab20, else ``n`` samples of a colormap
  (never fewer than ``n``: a ``zip`` with them drops no series)."""
  import matplotlib
  if n <= len(COLORS):
    return list(COLORS[:n])
  if n <= 20:
    return [matplotlib.colormaps["tab20"](i) for i in range(n)]
  return [matplotlib.colormaps["turbo"](i / (n - 1)) for i in range(n)]


def styles(n: int) -> list[dict]:
  """``n`` distinct (colour, line style) pairs: the ten colours with a solid line, then dashed, ..."""
  if n > len(COLORS) * len(LINESTYLES):
    raise ValueError(f"at most {len(COLORS) * len(LINESTYLES)} distinguishable series, got {n}")
  pairs = itertools.product(LINESTYLES, COLORS)
  return [dict(color=c, linestyle=ls) for ls, c in itertools.islice(pairs, n)]


def point_styles(names) -> dict[str, dict]:
  """Per name, a scatter style (colour, marker) no other of ``names`` shares: colours cycle by ten and
  markers by twelve, so pairs repeat only after sixty names."""
  return {name: dict(color=c, marker=m)
          for name, c, m in zip(names, itertools.cycle(COLORS), itertools.cycle("osD^vP*Xph<>"))}


MARKERS = "osD^vP*Xph<>"


def run_styles(names) -> dict[str, dict]:
  """Per run name, in the order given, one colour, marker and line style that every figure of a study uses for
  it (``training_curves``, ``quality_vs_state``, the showcase): no two names share all three."""
  names = list(dict.fromkeys(names))
  colors = distinct_colors(len(names))
  return {name: dict(color=c, linestyle=LINESTYLES[(i // len(COLORS)) % len(LINESTYLES)],
                     marker=MARKERS[i % len(MARKERS)]) for i, (name, c) in enumerate(zip(names, colors))}


def ticks_enclose(ax, values, axis: str = "y") -> None:
  """A linear ``axis`` whose limits are the major ticks at or beyond the least and greatest of ``values``, so
  the lowest labelled tick never sits above the data's lowest point (nor the highest below its highest)."""
  from matplotlib import ticker
  lo, hi = min(values), max(values)
  if lo == hi:
    lo, hi = lo - 0.5 * abs(lo or 1), hi + 0.5 * abs(hi or 1)
  ticks = ticker.MaxNLocator(nbins=6).tick_values(lo, hi)
  step = ticks[1] - ticks[0]
  getattr(ax, f"set_{axis}lim")(math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step)
  getattr(ax, f"{axis}axis").set_major_locator(ticker.MultipleLocator(step))


def short_number(n: int) -> str:
  """256 → "256", 1024 → "1k", 131072 → "128k": tick labels that fit side by side."""
  if n >= 1024 and n % 1024 == 0:
    return f"{n // 1024}k"
  return f"{n:g}" if isinstance(n, float) else str(n)


def log2_ticks(ax, values, axis: str = "x") -> None:
  """A base-2 log axis with one labelled tick per value in ``values`` (e.g. the M or L swept), no others."""
  from matplotlib import ticker
  values = sorted({v for v in values if v > 0})
  getattr(ax, f"set_{axis}scale")("log", base=2)
  target = getattr(ax, f"{axis}axis")
  target.set_major_locator(ticker.FixedLocator(values))
  target.set_major_formatter(ticker.FixedFormatter([short_number(v) for v in values]))
  target.set_minor_locator(ticker.NullLocator())


def plain_log(ax, axis: str = "y") -> None:
  """A log axis labelled 0.5, 2, 1000, 1e-05 instead of 5×10⁻¹, 2×10⁰, 10³ (matplotlib's choice of ticks)."""
  from matplotlib import ticker

  class Plain(ticker.LogFormatter):
    def _num_to_string(self, x, vmin, vmax):
      return f"{x:.6g}"

  getattr(ax, f"set_{axis}scale")("log")
  target = getattr(ax, f"{axis}axis")
  target.set_major_formatter(Plain())
  target.set_minor_formatter(Plain(labelOnlyBase=False))


def legend_right(fig, handles=None, labels=None, **kwargs):
  """One legend for the whole figure, to the right of every panel (``save`` makes room for it); by default
  each label once, from whichever panel shows it first."""
  if handles is None:
    first = {}
    for ax in fig.axes:
      for handle, label in zip(*ax.get_legend_handles_labels()):
        first.setdefault(label, handle)
    handles, labels = list(first.values()), list(first)
  return fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
                    frameon=False, **kwargs)


# A language model's headline metrics, in the order a figure prefers them, with their units: a byte
# vocabulary's bits per byte (named eval_bpc, bits/char of ASCII text), a tokenizer's bits per byte, bits per token.
LM_METRICS = {"eval_bpc": "bits/char", "eval_bits_per_byte": "bits/byte", "eval_bits_per_token": "bits/token"}


def training_curves(curves: dict[str, list[dict]], path: str, style: dict[str, dict] | None = None) -> str:
  """Train loss and the headline evaluation metric per step, one line per run, in one unit.

  Args:
    curves: a run's name -> its ``metrics.jsonl`` records. Language models are shown in bits: the train panel in
      bits per token (bits/char for a byte vocabulary's ``eval_bpc`` runs), the eval panel in the first of
      ``LM_METRICS`` every run reports (bits/char, bits/byte, bits/token); the others as loss in nats and eval
      accuracy.
    path: the PNG to write.
    style: a run's name -> its colour, marker and line style (``run_styles``); by default ``run_styles(curves)``.

  Returns:
    ``path``. Each panel's lowest and highest labelled ticks enclose its curves (``ticks_enclose``).
  """
  style = style or run_styles(curves)
  reported = lambda m: all(any(m in r for r in records) for records in curves.values())
  metric = next((m for m in LM_METRICS if reported(m)), "eval_accuracy")
  bpc = metric != "eval_accuracy"  # a language model: losses in bits
  to_unit = (lambda nats: nats / math.log(2)) if bpc else (lambda nats: nats)
  metric_label = "eval " + LM_METRICS.get(metric, "accuracy")
  train_unit = "bits/char" if metric == "eval_bpc" else "bits/token" if bpc else "nats"
  fig, (ax_train, ax_eval) = subplots(1, 2, figsize=(10, 3.8))
  shown = {ax_train: [], ax_eval: []}
  for name, records in curves.items():
    line, marker = {k: v for k, v in style[name].items() if k != "marker"}, style[name]["marker"]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval" and metric in r]
    shown[ax_train] += [to_unit(r["train_loss"]) for r in train]
    shown[ax_eval] += [r[metric] for r in evals]
    ax_train.plot([r["step"] for r in train], [to_unit(r["train_loss"]) for r in train], label=name, **line)
    ax_eval.plot([r["step"] for r in evals], [r[metric] for r in evals], marker=marker, markersize=4, label=name,
                 **line)
  ax_train.set(xlabel="step", ylabel=f"train loss ({train_unit}, window mean)")
  ax_eval.set(xlabel="step", ylabel=metric_label)
  for ax in (ax_train, ax_eval):
    if shown[ax]:
      ticks_enclose(ax, shown[ax])
    ax.grid(alpha=0.3)
  if len(curves) == 1:
    fig.suptitle(next(iter(curves)))
  else:
    legend_right(fig)
  return save(fig, path)


def spread_equal_x(xs: list[float], factor: float = 2 ** 0.15) -> list[float]:
  """``xs`` (on a log axis) with points that share a value moved apart sideways, symmetric about it, by powers
  of ``factor``: markers at one x would hide each other."""
  groups: dict[float, list[int]] = {}
  for i, x in enumerate(xs):
    groups.setdefault(x, []).append(i)
  out = list(xs)
  for x, members in groups.items():
    for j, i in enumerate(members):
      out[i] = x * factor ** (j - (len(members) - 1) / 2)
  return out


def quality_vs_state(rows: list[dict], metric: str, style: dict[str, dict], path: str) -> str:
  """The recall–memory frontier (Zoology, Based): ``metric`` against each run's decoding state size.

  One point per row, in its run's ``style[row["name"]]`` colour and marker and labelled by its name; one panel
  per number of key-value pairs (MQAR) or a single panel; the state axis is log-scaled (rows with the same state
  spread sideways: ``spread_equal_x``), the metric axis shared by the panels (small differences are not
  magnified). Softmax's state is its key-value cache at the training length.
  """
  panels = sorted({r.get("num_kv_pairs", 0) for r in rows})
  fig, axes = subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False, sharey=True)
  for ax, pairs in zip(axes[0], panels):
    shown = [r for r in rows if r.get("num_kv_pairs", 0) == pairs]
    for r, x in zip(shown, spread_equal_x([r["state_size"] for r in shown])):
      ax.scatter(x, r[metric], color=style[r["name"]]["color"], marker=style[r["name"]]["marker"], s=40,
                 alpha=0.85, label=r["name"])
    ax.set_xscale("log", base=2)
    ax.set(xlabel="decoding state per layer (numbers; equal ones spread sideways)",
           ylabel=metric.replace("_", " "), title=f"{pairs} key-value pairs" if pairs else None)
    ax.grid(alpha=0.3)
  legend_right(fig)
  return save(fig, path)


def quality_vs_step_time(rows: list[dict], metric: str, style: dict[str, dict], path: str) -> str:
  """``metric`` against each run's seconds per train step (the trade-off study's axes, here from the run's own
  clock: ``batch × seq_len / tokens_per_s`` of its last logging window, so compilation and evaluations are not
  in it). One point per row, in its run's colour and marker, labelled by its name."""
  fig, axes = subplots(1, 1, figsize=(5.2, 3.8), squeeze=False)
  ax = axes[0, 0]
  for r in rows:
    ax.scatter(r["step_s"], r[metric], color=style[r["name"]]["color"], marker=style[r["name"]]["marker"], s=40,
               alpha=0.85, label=r["name"])
  ax.set(xlabel="seconds per train step (the run's own clock)", ylabel=metric.replace("_", " "))
  ax.grid(alpha=0.3)
  legend_right(fig)
  return save(fig, path)
