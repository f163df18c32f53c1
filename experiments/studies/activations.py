"""Approximation on real activations: every estimator against exact attention on a trained model's q, k, v.

The model is the Shakespeare character LM with softmax attention (the config's
``model`` fields), trained in ``workdir/model`` by ``experiments.train.training`` or
resumed from there (``config.model_dir`` points elsewhere). Its queries, keys
and values are captured from its own forward pass (Flax
``capture_intermediates`` on each attention layer's query/key/value
projections; rotary positions applied with ``models.rotary``, as the softmax
layer does), on held-out plays: the first ``fit_batches`` evaluation batches fit
what an estimator learns or estimates from data (Hedgehog's and Taylor's maps by
``layers.distillation_loss``, FAVOR++'s and FAVOR#'s statistics), the next
``measure_batches`` measure. F is the actual feature dimension per head, so
estimators with different feature maps are compared at equal state size.

Shapes: B batch, L length, H heads, D head dim, F features, R fitted rows.
"""

from __future__ import annotations

import copy
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import tasks
from experiments.configs import common
from experiments.train import models, plotting, training
from favor_jax import core, layers


def model_config(config):
  """The training config of the captured model: the config's ``model`` block, which must be one softmax run."""
  source = copy.deepcopy(config.model)
  if source.attention.type != "softmax":
    raise ValueError(f"model.attention.type must be 'softmax' (the estimators are measured against the exact "
                     f"attention of a softmax model), got {source.attention.type!r}")
  if source.variants or source.only:
    raise ValueError("model.variants and model.only must be empty: the study trains one softmax model, got "
                     f"{len(source.variants)} variants, only={source.only!r}")
  training.check_config(source)
  return source


def check_study(config) -> None:
  """The study's own fields, each named when bad (before the model trains)."""
  names = [e[0] for e in ESTIMATORS]
  unknown = [n for n in config.estimators if n not in names]
  if unknown or not config.estimators:
    raise ValueError(f"config.estimators must name one or more of {names}; unknown: {unknown or 'none given'}")
  for name in ("fit_batches", "measure_batches", "num_draws", "fit_sequences", "fit_steps"):
    tasks.positive_int(f"config.{name}", config[name])
  need, held_out = config.fit_batches + config.measure_batches, config.model.data.num_eval_batches
  if need > held_out:  # named before the model trains (``run`` checks the batches it gets too)
    raise ValueError(f"fit_batches + measure_batches = {need}, but the model's held-out set has {held_out} "
                     "batches (model.data.num_eval_batches)")
  if not config.features:
    raise ValueError("config.features must list at least one feature count")
  for f in config.features:
    tasks.positive_int("config.features", f)
  for name, kernel, _, how in ESTIMATORS:
    least = core.get_kernel(kernel).num_features(1, 1)  # one projection row (random) or fitted row
    if name in config.estimators and min(config.features) < least:
      raise ValueError(f"config.features={tuple(config.features)}: estimator {name!r} needs F >= {least} "
                       f"(one {'fitted' if how == 'fitted' else 'projection'} row), got {min(config.features)}")
  if not config.fit_lr > 0:
    raise ValueError(f"config.fit_lr must be > 0, got {config.fit_lr!r}")
  cluster = common.cluster_fields(config.model.mesh)
  if config.model.mesh.distributed or cluster:
    cluster = {"distributed": config.model.mesh.distributed, **cluster}
    raise ValueError(f"model.mesh asks for a multi-process cluster ({cluster}), but this study runs in one "
                     "process (its measurements gather every array on it): train the model with a training "
                     "config on the cluster and give its run directory as config.model_dir")


def unread(config) -> dict:
  """{field: why} of the study's fields the selected estimators leave unread."""
  hows = {how for name, _, _, how in ESTIMATORS if name in config.estimators}
  out = {}
  if "fitted" not in hows:
    out.update({f: "no fitted estimator in config.estimators" for f in ("fit_steps", "fit_lr", "fit_sequences")})
  if "random" not in hows:
    out["num_draws"] = "no randomly drawn estimator in config.estimators"
  return out


def runs(config) -> list[tuple[str, str, object]]:
  """[(name, field prefix, training config)]: the captured model's run (``training.check_overrides_used``)."""
  check_study(config)
  return [("model", "model.", model_config(config))]


def trained_params(config, workdir, progress):
  """The softmax model's parameters: trains it in ``config.model_dir`` (default ``workdir/model``) or resumes
  the finished run there."""
  run_dir = config.model_dir or os.path.join(workdir, "model")
  progress(f"the softmax model in {run_dir} (trained there if not finished)")
  records, state = training.train(model_config(config), run_dir, progress=progress)
  evals = [r for r in records if r["kind"] == "eval"]
  return jax.device_get(state.params), evals[-1]


def capture(source, params, batches):
  """Per layer, (q, k, v) [B, L, H, D] of ``source``'s softmax model (a training config) with ``params`` on
  ``batches`` (concatenated), rotary applied to q, k."""
  task = tasks.make_task(source)
  model = models.make_model(source, task.vocab_size, task.num_classes, task.max_len)
  names = ("query", "key", "value")
  tokens = np.concatenate([b.tokens for b in batches])
  _, captured = jax.jit(lambda p, t: model.apply(
      {"params": p}, t, capture_intermediates=lambda module, method: module.name in names,
      mutable=["intermediates"]))(params, tokens)
  out = []
  for i in range(source.model.num_layers):
    got = captured["intermediates"][f"block_{i}"]["attention"]
    q, k, v = (got[n]["__call__"][0] for n in names)
    if source.model.positions == "rotary":
      q, k = models.rotary(q), models.rotary(k)
    out.append((q, k, v))
  return out


def fitted_rows(kernel: str, features: int) -> int:
  """R, the rows of a fitted map giving at most ``features`` features (the kernel record's count: Hedgehog
  2R ≤ F, Taylor 1 + R + R(R+1)/2 ≤ F); at least 1."""
  rows = 1
  while core.kernels.num_features(kernel, rows + 1, rows + 1) <= features:
    rows += 1
  return rows


def fit_map(kernel, rows, q_fit, k_fit, steps, lr, key, init=None, *, v_fit=None, objective="cross_entropy",
            window=0, gate_bias=None):
  """A per-head map [H, R, D] for ``kernel`` fitted by distillation (causal) on ``q_fit``, ``k_fit`` (Adam,
  ``steps``), from ``init`` or unit-norm orthogonal rows; returns it, the fitted gate bias (or None) and the
  final loss.

  ``objective``, ``window``: ``layers.distillation_loss``'s (``output_mse`` needs ``v_fit``). ``gate_bias``
  [H]: fit a constant per-head forget gate with the map, log f_h = log σ(b_h) from b = ``gate_bias`` (the
  bias of a FoX gate whose weight is zero: a swapped-in gated model starts from the fitted decay)."""
  heads, dim = q_fit.shape[-2:]
  if init is None:
    draw = core.draw_projection(key, "orthogonal", rows, dim)
    init = draw / jnp.linalg.norm(draw, axis=-1, keepdims=True)  # unit rows: the identity's scale
  fitted = {"map": jnp.broadcast_to(init, (heads, rows, dim)).astype(jnp.float32)}
  if gate_bias is not None:
    fitted["gate_bias"] = jnp.asarray(gate_bias, jnp.float32)
  optimizer = optax.adam(lr)

  # q, k, v are arguments, not closed over: XLA would constant-fold the attention weights of constants.
  def loss(w, q, k, v):
    decay = jax.nn.log_sigmoid(w["gate_bias"]) if "gate_bias" in w else None
    return layers.distillation_loss(q, k, w["map"], kernel=kernel, causal=True, objective=objective, value=v,
                                    log_decay=decay, window=window)

  @jax.jit
  def step(w, opt_state, q, k, v):
    grads = jax.grad(loss)(w, q, k, v)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(w, updates), opt_state

  opt_state = optimizer.init(fitted)
  for _ in range(steps):
    fitted, opt_state = step(fitted, opt_state, q_fit, k_fit, v_fit)
  return fitted["map"], fitted.get("gate_bias"), float(jax.jit(loss)(fitted, q_fit, k_fit, v_fit))


def errors(q, k, v, projection, kernel, rho, window):
  """(relative output error, mean KL(softmax ‖ estimator) per row) of one estimator on one layer."""
  return tuple(float(x) for x in _errors(q, k, v, projection, kernel, rho, window))


@functools.partial(jax.jit, static_argnames=("kernel", "window"))  # one program, not one per operation
def _errors(q, k, v, projection, kernel, rho, window):
  exact = core.softmax_attention(q, k, v, causal=True)
  if window:
    out = core.hybrid_attention(q, k, v, projection, window=window, kernel=kernel, causal=True, rho=rho)
  else:
    out = core.favor_attention(q, k, v, projection, kernel=kernel, causal=True, rho=rho)
  target = core.attention_weights(q, k, kernel="softmax", causal=True)
  approx = core.attention_weights(q, k, projection, kernel=kernel, causal=True, window=window, rho=rho)
  seen = target > 0
  kl = jnp.sum(jnp.where(seen, target * (jnp.log(jnp.where(seen, target, 1.0))
                                         - jnp.log(jnp.maximum(approx, 1e-30))), 0.0), axis=-1)
  return jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact), jnp.mean(kl)


# (name, kernel, window, how its map is made): "random" draws, "fitted" distillation.
ESTIMATORS = (("favor+", "positive", 0, "random"), ("hyperbolic", "hyperbolic", 0, "random"),
              ("favor++", "optimal_positive", 0, "random"), ("favor#", "saderf", 0, "random"),
              ("favor+ + window 16", "positive", 16, "random"),
              ("taylor (fitted)", "taylor", 0, "fitted"), ("hedgehog (fitted)", "hedgehog", 0, "fitted"))


def run(config, progress=print, workdir=None):
  check_study(config)
  params, model_eval = trained_params(config, workdir, progress)
  source = model_config(config)
  batches = tasks.make_task(source).eval_batches
  need = config.fit_batches + config.measure_batches
  if need > len(batches):
    raise ValueError(f"fit_batches + measure_batches = {need}, but the model's held-out set has {len(batches)} "
                     "batches (model.data.num_eval_batches)")
  fit = capture(source, params, batches[:config.fit_batches])
  measure = capture(source, params, batches[config.fit_batches:need])
  estimators = [e for e in ESTIMATORS if e[0] in config.estimators]
  records = []
  for layer, ((q_fit, k_fit, _), (q, k, v)) in enumerate(zip(fit, measure)):
    dim = q.shape[-1]
    for name, kernel, window, how in estimators:
      kern = core.get_kernel(kernel)
      rho = None
      if kern.compute_statistic is not None:  # fitted on the fitting batches, as a layer's running value
        rho = jnp.mean(kern.compute_statistic(q_fit, k_fit), axis=0)
      for features in config.features:
        key = jax.random.PRNGKey(config.seed * 1000 + features)
        fit_loss = float("nan")
        if how == "fitted":
          rows = fitted_rows(kernel, features)
          fitted, _, fit_loss = fit_map(kernel, rows, q_fit[:config.fit_sequences], k_fit[:config.fit_sequences],
                                     config.fit_steps, config.fit_lr, key)
          projections = [fitted]
        else:
          rows = features // (kern.num_features(1, dim))  # M with F = num_features(M): M or F/2
          projections = [core.draw_projection(k_, "orthogonal", rows, dim)
                         for k_ in jax.random.split(key, config.num_draws)]
        errs = [errors(q, k, v, w, kernel, rho, window) for w in projections]
        rel, kl = (float(np.mean(x)) for x in zip(*errs))
        records.append(dict(layer=layer, estimator=name, kernel=kernel, window=window, rows=rows,
                            features=core.kernels.num_features(kernel, rows, dim), target_features=features,
                            rel_error=rel, kl=kl, draws=len(projections), fit_loss=fit_loss,
                            model_eval_bpc=model_eval.get("eval_bpc", float("nan"))))
        progress(f"layer {layer} {name:>18} F={records[-1]['features']:<4} rel {rel:.4f} KL {kl:.4f}")
  return records


def _mean_over_layers(records):
  table: dict[tuple, list[dict]] = {}
  for r in records:
    table.setdefault((r["estimator"], r["target_features"]), []).append(r)
  return {key: dict(rs[0], rel_error=float(np.mean([r["rel_error"] for r in rs])),
                    kl=float(np.mean([r["kl"] for r in rs])), features=max(r["features"] for r in rs))
          for key, rs in table.items()}


def summarize(records, config) -> str:
  table = _mean_over_layers(records)
  names = list(dict.fromkeys(r["estimator"] for r in records))
  bpc = records[0]["model_eval_bpc"]
  lines = ["# Approximation on real activations", "",
           f"Queries, keys and values of every layer and head of the trained Shakespeare softmax model "
           f"({config.model.model.num_layers} layers × {config.model.model.num_heads} heads, its eval "
           f"{bpc:.3f} bits/char), captured on {config.measure_batches} held-out batches; maps and statistics "
           f"fitted on "
           f"{config.fit_batches} other held-out batches (the maps distilled on {config.fit_sequences} of their "
           f"sequences, {config.fit_steps} Adam steps). Causal attention. Relative error "
           "‖out − exact‖/‖exact‖ and mean KL(softmax ‖ estimator) per query row, mean over layers (random "
           f"maps: also over {config.num_draws} orthogonal draws). F: actual features per head.", ""]
  for metric, label in (("rel_error", "relative output error"), ("kl", "attention-weight KL")):
    lines += [f"## {label}", "", "| estimator | " + " | ".join(f"F≤{f}" for f in config.features)
              + " | vs FAVOR+ at each F |", "|---|" + "---|" * (len(config.features) + 1)]
    for name in names:
      cells = [table[name, f] for f in config.features]
      ratio = " / ".join(f"{c[metric] / table['favor+', f][metric]:.2f}" for c, f in zip(cells, config.features)
                         if ("favor+", f) in table)
      lines.append(f"| {name} | " + " | ".join(f"{c[metric]:.4f} (F={c['features']})" for c in cells)
                   + f" | {ratio} |")
    lines.append("")
  if "favor+" in names and len(names) > 1:
    best = min((table[n, f]["rel_error"] / table["favor+", f]["rel_error"], n, f)
               for n in names for f in config.features if n != "favor+")
    lines.append(f"Best relative output error against FAVOR+ at the same F: {best[1]} at F≤{best[2]}, "
                 f"{best[0]:.2f}× FAVOR+'s (goal ≤ 0.33).")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir):
  table = _mean_over_layers(records)
  names = list(dict.fromkeys(r["estimator"] for r in records))
  fig, axes = plotting.subplots(1, 2, figsize=(10, 3.8))
  for name, style in zip(names, plotting.styles(len(names))):
    points = sorted((table[name, f]["features"], table[name, f]["rel_error"], table[name, f]["kl"])
                    for f in config.features)
    f, rel, kl = zip(*points)
    axes[0].plot(f, rel, marker="o", label=name, **style)
    axes[1].plot(f, kl, marker="o", label=name, **style)
  for ax, label in zip(axes, ("relative output error", "KL(softmax ‖ estimator) per row")):
    ax.set(xlabel="F (features per head)", ylabel=label)
    plotting.log2_ticks(ax, config.features)
    plotting.plain_log(ax)
    ax.grid(alpha=0.3)
  plotting.legend_right(fig)
  fig.suptitle("trained Shakespeare softmax model's q, k, v (held-out plays), causal, mean over layers")
  return [plotting.save(fig, os.path.join(workdir, "error_vs_features.png"))]

