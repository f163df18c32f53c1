"""Approximation study: how close FAVOR attention gets to exact softmax attention.

For each setting (sequence length, head dim, input scale), kernel, projection
and number of random features M, draws ``config.num_draws`` projections and
records the error of the attention output and of the attention matrix.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from experiments import tasks
from experiments.train import plotting
from favor_jax import core
from favor_jax.core import draw_projection

# The seed article's published table (n=64, d=32, inputs ×0.3): its MSE is flat in M.
SEED_TABLE = {32: 0.000958, 64: 0.000857, 128: 0.000871, 256: 0.000870, 512: 0.000927}


def make_inputs(seq_len, dim, scale, seed):
  """q, k ~ N(0, 1)·scale and v ~ N(0, 1), one head: [1, L, 1, D]."""
  rng = np.random.default_rng(seed)
  q, k = (rng.standard_normal((1, seq_len, 1, dim)) * scale for _ in range(2))
  v = rng.standard_normal((1, seq_len, 1, dim))
  return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def attention_matrix(qf, kf):
  """Row-normalised φq φkᵀ: FAVOR's implicit attention weights (formed only for measuring)."""
  a = jnp.einsum("blhf,bshf->bhls", qf, kf)
  den = jnp.sum(a, -1, keepdims=True)
  return jnp.where(den != 0, a / jnp.where(den != 0, den, 1.0), 0.0)


def exact_matrix(q, k):
  return jax.nn.softmax(jnp.einsum("blhd,bshd->bhls", q, k) / math.sqrt(q.shape[-1]), axis=-1)


def measure(kernel, projection, num_features, q, k, v, keys):
  """Per-draw (mse, rel_error, kernel_mse) for one configuration, vmapped over the draws."""
  exact = core.softmax_attention(q, k, v)
  exact_a = exact_matrix(q, k)
  kern = core.get_kernel(kernel)

  def one(key):
    w = draw_projection(key, projection, num_features, q.shape[-1])
    out = core.favor_attention(q, k, v, w, kernel=kernel)
    qf, kf = kern(q, k, w)
    return (jnp.mean((out - exact) ** 2),
            jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact),
            jnp.mean((attention_matrix(qf, kf) - exact_a) ** 2))

  return [np.asarray(x, np.float64) for x in jax.jit(jax.vmap(one))(keys)]


def uniform_baseline(q, k, v):
  """Error of plain averaging of the values (what attention with no information would give)."""
  exact = core.softmax_attention(q, k, v)
  out = jnp.broadcast_to(jnp.mean(v, axis=-3, keepdims=True), exact.shape)
  return (float(jnp.mean((out - exact) ** 2)), float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact)),
          float(jnp.mean((1.0 / k.shape[-3] - exact_matrix(q, k)) ** 2)))


def check_study(config) -> None:
  """The sweeps' values, each named when bad (before anything is measured). A learned kernel (Hedgehog) is
  refused: a random draw of its map measures a model nobody trained (the activations study fits it)."""
  if not config.kernels:
    raise ValueError("config.kernels must name at least one kernel")
  for kernel in config.kernels:
    if not isinstance(kernel, str) or kernel not in core.KERNELS:
      raise ValueError(f"config.kernels must hold names in {sorted(core.KERNELS)}, got {kernel!r}")
    if core.KERNELS[kernel].learned:
      raise ValueError(f"config.kernels: {kernel!r} has a learned map, which a random draw does not estimate; "
                       "the activations study (experiments/configs/activations.py) measures it fitted")
  if not config.projections or any(p not in core.PROJECTIONS for p in config.projections):
    raise ValueError(f"config.projections must hold one or more of {tuple(core.PROJECTIONS)}, got "
                     f"{tuple(config.projections)!r}")
  if not config.num_features:
    raise ValueError("config.num_features must list at least one feature count")
  for m in config.num_features:
    tasks.positive_int("config.num_features", m)
  if not isinstance(config.num_draws, int) or config.num_draws < 2:
    raise ValueError(f"config.num_draws must be an int >= 2 (the 95% interval needs two draws), "
                     f"got {config.num_draws!r}")
  if not config.settings:
    raise ValueError("config.settings must list at least one (name, sequence length, head dim, input scale)")
  for setting in config.settings:
    if not isinstance(setting, (tuple, list)) or len(setting) != 4:
      raise ValueError(f"config.settings must hold (name, sequence length, head dim, input scale) tuples, got "
                       f"{setting!r}")
    name, seq_len, dim, scale = setting
    tasks.positive_int(f"config.settings[{name!r}] sequence length", seq_len)
    tasks.positive_int(f"config.settings[{name!r}] head dim", dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
      raise ValueError(f"config.settings[{name!r}] input scale must be a finite number > 0, got {scale!r}")
  names = [setting[0] for setting in config.settings]
  for field, values in (("settings (names)", names), ("kernels", list(config.kernels)),
                        ("projections", list(config.projections)), ("num_features", list(config.num_features))):
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:  # the summary, plots and claims look records up by these: a repeat would show another's numbers
      raise ValueError(f"config.{field} must not repeat a value, got {repeated} more than once in "
                       f"{tuple(values)!r}")
  if isinstance(config.seed, bool) or not isinstance(config.seed, int) or config.seed < 0:
    raise ValueError(f"config.seed must be an int >= 0, got {config.seed!r}")


def unread(config) -> dict:
  """{field: why} of the sweep's fields that the chosen kernels leave unread."""
  if any(core.get_kernel(k).needs_projection for k in config.kernels if k in core.KERNELS):
    return {}
  why = f"no kernel in config.kernels={tuple(config.kernels)} takes a projection"
  return {f: why for f in ("projections", "num_features", "num_draws")}


def run(config, progress=print, workdir=None):
  check_study(config)
  records = []
  for name, seq_len, dim, scale in config.settings:
    q, k, v = make_inputs(seq_len, dim, scale, config.seed)
    base = dict(setting=name, dim=dim, input_scale=scale, seq_len=seq_len)
    mse, rel, kmse = uniform_baseline(q, k, v)
    records.append(dict(base, kernel="uniform", projection="none", num_features=0, feature_dim=0,
                        mse=mse, mse_ci95=0.0, rel_error=rel, kernel_mse=kmse, draws=1))
    for kernel in config.kernels:
      if not core.get_kernel(kernel).needs_projection:  # deterministic features: one measurement, no M sweep
        mse, rel, kmse = measure(kernel, "iid", 1, q, k, v, jax.random.split(jax.random.PRNGKey(0), 1))
        records.append(dict(base, kernel=kernel, projection="none", num_features=0,
                            feature_dim=core.kernels.num_features(core.get_kernel(kernel), None, dim),
                            mse=float(mse[0]), mse_ci95=0.0, rel_error=float(rel[0]), kernel_mse=float(kmse[0]),
                            draws=1))
        progress(f"{name} {kernel:>16} {'none':>10} (no projection) mse={records[-1]['mse']:.3e}")
        continue
      for projection in config.projections:
        for m in config.num_features:
          keys = jax.random.split(jax.random.PRNGKey(config.seed * 7919 + m), config.num_draws)
          mse, rel, kmse = measure(kernel, projection, m, q, k, v, keys)
          records.append(dict(
              base, kernel=kernel, projection=projection, num_features=m,
              feature_dim=core.kernels.num_features(core.get_kernel(kernel), m, dim),
              mse=float(mse.mean()), mse_ci95=float(1.96 * mse.std(ddof=1) / math.sqrt(len(mse))),
              rel_error=float(rel.mean()), kernel_mse=float(kmse.mean()), draws=len(mse)))
          progress(f"{name} {kernel:>16} {projection:>10} M={m:<5} mse={records[-1]['mse']:.3e}")
  return records


# --- claims of the papers, checked on the records -------------------------------------------

def _mse(records):
  return {(r["setting"], r["kernel"], r["projection"], r["num_features"]): r for r in records}


def _compare(records, better, worse, settings=None):
  """Cases where ``better`` (kernel, projection) has lower MSE than ``worse``, over settings and M."""
  table = _mse(records)
  wins, cases = [], []
  for (setting, kernel, projection, m), r in table.items():
    if (kernel, projection) != better or (settings is not None and setting not in settings):
      continue
    other = table.get((setting, *worse, m))
    if other is None:
      continue
    # A difference inside both confidence intervals is a tie, not a loss.
    tie = abs(r["mse"] - other["mse"]) <= r["mse_ci95"] + other["mse_ci95"]
    cases.append((setting, m))
    if r["mse"] < other["mse"] or tie:
      wins.append((setting, m))
  return wins, cases


def claims(records, config):
  """Markdown lines: each claim, and where it does or does not hold here."""
  lines = []
  softmax_kernels = [k for k in config.kernels if core.kernels.KERNELS[k].estimates_softmax]

  def report(text, pairs, settings=None):
    wins = cases = 0
    failed = []
    for better, worse in pairs:
      w, c = _compare(records, better, worse, settings)
      wins, cases = wins + len(w), cases + len(c)
      failed += [f"{better[0]}/{better[1]} vs {worse[0]}/{worse[1]} @ {s}, M={m}"
                 for s, m in sorted(set(c) - set(w))]
    verdict = "holds" if cases and wins == cases else ("mostly holds" if wins > cases / 2 else "does not hold")
    lines.append(f"- **{text}**: {verdict} here ({wins}/{cases} comparisons; ties within 95% CI count)")
    lines.extend(f"  - not here: {f}" for f in failed[:8])
    if len(failed) > 8:
      lines.append(f"  - … and {len(failed) - 8} more")

  if "iid" in config.projections and "orthogonal" in config.projections:
    report("orthogonal below iid", [((k, "orthogonal"), (k, "iid")) for k in softmax_kernels])
  if "simplex" in config.projections and "orthogonal" in config.projections:
    report("simplex ≤ orthogonal", [((k, "simplex"), (k, "orthogonal")) for k in softmax_kernels])
  for p in config.projections:
    if {"hyperbolic", "positive"} <= set(config.kernels):
      report(f"hyperbolic ≤ positive ({p})", [(("hyperbolic", p), ("positive", p))])
    if {"optimal_positive", "positive"} <= set(config.kernels):
      report(f"FAVOR++ below FAVOR+ ({p})", [(("optimal_positive", p), ("positive", p))])
    if {"trigonometric", "positive"} <= set(config.kernels):
      # The claim is about small kernel values, i.e. large-norm inputs: the "hard" setting.
      small = [name for name, _, _, scale in config.settings if scale >= 1.0]
      report(f"positive below trigonometric when kernel values are small ({p}; settings {small})",
             [(("positive", p), ("trigonometric", p))], small)
      report(f"positive below trigonometric at small inputs ({p}; not claimed, for contrast)",
             [(("positive", p), ("trigonometric", p))], [n for n, _, _, s in config.settings if s < 1.0])
  return lines


def summarize(records, config) -> str:
  lines = ["# Approximation study", "",
           f"Mean over {config.num_draws} projection draws; MSE of the attention output against exact "
           "softmax attention (±95% CI), relative Frobenius error, and MSE of the attention matrix.", ""]
  for name, seq_len, dim, scale in config.settings:
    rows = [r for r in records if r["setting"] == name]
    uniform = next(r for r in rows if r["kernel"] == "uniform")
    lines += [f"## {name}: L={seq_len}, d={dim}, q,k ~ N(0,1)×{scale}", "",
              f"Uniform averaging of v: MSE {uniform['mse']:.3e}, rel. error {uniform['rel_error']:.3f}."
              + "".join(f" FAVOR+ (positive, orthogonal, M={r['num_features']}): {r['mse'] / uniform['mse']:.2g}× "
                        "that MSE." for r in rows if r["kernel"] == "positive"
                        and r["projection"] == "orthogonal" and r["num_features"] == 256), "",
              "| kernel | projection | " + " | ".join(f"M={m}" for m in config.num_features) + " |",
              "| --- | --- | " + " | ".join("---" for _ in config.num_features) + " |"]
    for kernel in config.kernels:
      fixed = [r for r in rows if r["kernel"] == kernel and r["projection"] == "none"]
      if fixed:  # no projection: the same features at every M
        lines.append(f"| {kernel} | none (no M) | " + " | ".join([f"{fixed[0]['mse']:.2e}"] * len(config.num_features))
                     + " |")
        continue
      for projection in config.projections:
        cells = [next(f"{r['mse']:.2e}" for r in rows
                      if r["kernel"] == kernel and r["projection"] == projection and r["num_features"] == m)
                 for m in config.num_features]
        lines.append(f"| {kernel} | {projection} | " + " | ".join(cells) + " |")
    lines.append("")
  seed = [r for r in records if r["setting"] == "seed" and r["kernel"] == "positive"
          and r["projection"] == "orthogonal" and r["num_features"] in SEED_TABLE]
  if seed:
    lines += ["## The seed article's experiment, corrected", "",
              "| M | seed article's table | FAVOR+ here (orthogonal) |", "| --- | --- | --- |"]
    lines += [f"| {r['num_features']} | {SEED_TABLE[r['num_features']]:.2e} | {r['mse']:.2e} |" for r in seed]
    lines.append("")
  lines += ["## The papers' claims, checked here", ""] + claims(records, config)
  return "\n".join(lines) + "\n"


def plot(records, config, workdir):
  paths = [_plot_setting(records, config, setting, workdir) for setting in config.settings]
  seed = sorted((r["num_features"], r["mse"]) for r in records if r["setting"] == "seed"
                and r["kernel"] == "positive" and r["projection"] == "orthogonal")
  if seed:
    fig, ax = plotting.subplots(figsize=(4.5, 3.2))
    ax.plot(*zip(*sorted(SEED_TABLE.items())), marker="s", label="seed article (biased)")
    ax.plot(*zip(*seed), marker="o", label="FAVOR+ here (orthogonal)")
    ax.set(xlabel="M (random features)", ylabel="output MSE",
           title="seed experiment: L=64, d=32, inputs ×0.3")
    plotting.log2_ticks(ax, [m for m, _ in seed] + list(SEED_TABLE))
    plotting.plain_log(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(plotting.save(fig, f"{workdir}/seed_experiment.png"))
  return paths


def _plot_setting(records, config, setting, workdir):
  """A panel per kernel: output MSE (±95% CI) against M, a line per projection, uniform averaging dotted."""
  name, seq_len, dim, scale = setting
  cols = min(3, len(config.kernels))
  rows = -(-len(config.kernels) // cols)
  fig, axes = plotting.subplots(rows, cols, figsize=(3.4 * cols, 2.9 * rows), squeeze=False)
  uniform = next(r["mse"] for r in records if r["setting"] == name and r["kernel"] == "uniform")
  for ax in axes.flat[len(config.kernels):]:
    ax.set_visible(False)
  for ax, kernel in zip(axes.flat, config.kernels):
    fixed = [r["mse"] for r in records if r["setting"] == name and r["kernel"] == kernel and r["projection"] == "none"]
    if fixed:  # no projection: one value at every M
      ax.axhline(fixed[0], color="k", label="no projection (same at every M)")
    for projection, color in zip(config.projections if not fixed else (), plotting.COLORS):
      pts = sorted((r["num_features"], r["mse"], r["mse_ci95"]) for r in records
                   if r["setting"] == name and r["kernel"] == kernel and r["projection"] == projection)
      m, mse, ci = (np.array(x) for x in zip(*pts))
      ax.plot(m, mse, marker="o", ms=3, color=color, label=projection)
      ax.fill_between(m, np.maximum(mse - ci, mse * 0.05), mse + ci, color=color, alpha=0.2)
    ax.axhline(uniform, color="gray", ls=":", label="uniform average of v")
    ax.set(title=kernel, xlabel="M (random features)" if ax in axes[-1] else "")
    plotting.log2_ticks(ax, config.num_features)
    ax.set_xlim(min(config.num_features), max(config.num_features))
    ax.tick_params(axis="x", labelsize=8)
    plotting.plain_log(ax)
    ax.grid(alpha=0.3)
  for row in axes:
    row[0].set_ylabel("output MSE")
  plotting.legend_right(fig, title="projection")
  fig.suptitle(f"{name}: L={seq_len}, d={dim}, q, k ~ N(0, 1)×{scale}; MSE of the output against exact "
               f"softmax attention, mean of {config.num_draws} draws, 95% CI")
  return plotting.save(fig, f"{workdir}/error_vs_m_{name}.png")
