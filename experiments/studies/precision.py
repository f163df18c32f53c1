"""Precision study: what a backend's default precision for float32 dots does to each estimator.

For each kernel and input scale, causal attention (the chunked pass) with ``precision="highest"`` and under
a TPU's default, one bfloat16 pass per dot (:func:`experiments.studies.emulation.bfloat16_dots`), against exact
softmax attention in float64. Records the relative output error of each and the shift between them (what the
default alone moves), averaged over projection draws.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments import tasks
from experiments.studies.emulation import bfloat16_dots
from favor_jax import core

MODES = ("highest", "bfloat16_pass")


def make_inputs(seq_len, dim, heads, scale, seed):
  """q, k ~ N(0, 1)·0.5·scale and v ~ N(0, 1), [1, L, H, D] (×1: the approximation study's "moderate")."""
  rng = np.random.default_rng(seed)
  q, k = (rng.standard_normal((1, seq_len, heads, dim)) * 0.5 * scale for _ in range(2))
  return q, k, rng.standard_normal((1, seq_len, heads, dim))


def exact64(q, k, v):
  """Causal softmax attention in float64 (numpy)."""
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  return np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v)


def projection(kernel, key, num_features, dim):
  """The kernel's ω: a fresh orthogonal draw, the identity for a learned map (its initial value), or None."""
  kern = core.get_kernel(kernel)
  if kern.learned:
    return jnp.eye(dim)
  return core.orthogonal_projection(key, num_features, dim) if kern.needs_projection else None


def check_study(config) -> None:
  """The sweeps' values, each named when bad."""
  for kernel in config.kernels:
    if kernel not in core.KERNELS:
      raise ValueError(f"config.kernels must hold names in {sorted(core.KERNELS)}, got {kernel!r}")
  if not config.kernels or not config.scales:
    raise ValueError("config.kernels and config.scales must each list at least one value")
  for scale in config.scales:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
      raise ValueError(f"config.scales must hold finite numbers > 0, got {scale!r}")
  for field in ("seq_len", "dim", "heads", "num_features", "num_draws", "chunk_size"):
    tasks.positive_int(f"config.{field}", config[field])
  for field in ("kernels", "scales"):
    values = list(config[field])
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:  # the summary looks records up by (kernel, scale): a repeat would show another's numbers
      raise ValueError(f"config.{field} must not repeat a value, got {repeated} more than once")
  if isinstance(config.seed, bool) or not isinstance(config.seed, int) or config.seed < 0:
    raise ValueError(f"config.seed must be an int >= 0, got {config.seed!r}")


def run(config, progress=print, workdir=None):
  check_study(config)
  records = []
  for kernel in config.kernels:
    kern = core.get_kernel(kernel)

    def attend(q, k, v, w, precision, kern=kern):
      # a data-dependent kernel's statistic from the whole sequence (as a layer's running one would hold it)
      rho = kern.compute_statistic(q, k, None, None) if kern.data_dependent else None
      return core.favor_attention(q, k, v, w, kernel=kern, causal=True, causal_method="chunked",
                                  chunk_size=config.chunk_size, precision=precision, rho=rho)

    calls = {"highest": jax.jit(lambda q, k, v, w: attend(q, k, v, w, "highest")),
             "bfloat16_pass": bfloat16_dots(lambda q, k, v, w: attend(q, k, v, w, None))}
    for scale in config.scales:
      q, k, v = make_inputs(config.seq_len, config.dim, config.heads, scale, config.seed)
      want = exact64(q, k, v)
      errors = {mode: [] for mode in MODES}
      shifts = []
      for draw in range(config.num_draws):
        w = projection(kernel, jax.random.PRNGKey(config.seed * 1000 + draw), config.num_features, config.dim)
        args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))
        outs = {mode: np.asarray(calls[mode](*args, w), np.float64) for mode in MODES}
        for mode in MODES:
          errors[mode].append(np.linalg.norm(outs[mode] - want) / np.linalg.norm(want))
        shifts.append(np.linalg.norm(outs["bfloat16_pass"] - outs["highest"]) / np.linalg.norm(outs["highest"]))
      records.append(dict(kernel=kernel, input_scale=scale, rel_error_highest=float(np.mean(errors["highest"])),
                          rel_error_bfloat16_pass=float(np.mean(errors["bfloat16_pass"])),
                          shift=float(np.mean(shifts)), shift_max=float(np.max(shifts)),
                          draws=config.num_draws if core.get_kernel(kernel).needs_projection else 1))
      progress(f"{kernel:>16} x{scale:<4} highest={records[-1]['rel_error_highest']:.3e} "
               f"bf16={records[-1]['rel_error_bfloat16_pass']:.3e} shift={records[-1]['shift']:.3e}")
  return records


def summarize(records, config) -> str:
  scales = list(config.scales)
  lines = [f"# Precision study: relative output error vs float64 exact causal softmax attention "
           f"(L={config.seq_len}, D={config.dim}, H={config.heads}, M={config.num_features}, chunked pass, "
           f"{config.num_draws} draws)", "",
           "Each cell: error with precision='highest' / under one bfloat16 pass per dot (a TPU's default) "
           "(shift: ‖bf16 − highest‖/‖highest‖).", "",
           "| kernel | " + " | ".join(f"×{s:g}" for s in scales) + " |",
           "|---|" + "---|" * len(scales)]
  by = {(r["kernel"], r["input_scale"]): r for r in records}
  for kernel in config.kernels:
    cells = [by[(kernel, s)] for s in scales]
    lines.append(f"| {kernel} | " + " | ".join(
        f"{r['rel_error_highest']:.2e} / {r['rel_error_bfloat16_pass']:.2e} (shift {r['shift']:.1e})"
        for r in cells) + " |")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir):
  return []
