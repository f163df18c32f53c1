"""Precision study: what a backend's default precision for float32 dots does to each estimator.

For each kernel and input scale, causal attention (the chunked pass) with ``precision="highest"``, under a
recent GPU's default (TF32 operands) and under a TPU's (one bfloat16 pass per dot), both emulated
(:mod:`experiments.studies.emulation`), against exact softmax attention in float64. Records the relative output
error of each and the shift of each default from "highest" (what the default alone moves), averaged over
projection draws.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments import tasks
from experiments.studies import emulation
from favor_jax import core

# mode -> explicit mantissa bits of each dot's operands (None: precision="highest", float32)
MODES = {"highest": None, "tensorfloat32": emulation.TENSORFLOAT32_BITS, "bfloat16_pass": emulation.BFLOAT16_BITS}


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

    calls = {mode: jax.jit(lambda q, k, v, w: attend(q, k, v, w, "highest")) if bits is None
             else emulation.rounded_dots(lambda q, k, v, w: attend(q, k, v, w, None), bits)
             for mode, bits in MODES.items()}
    for scale in config.scales:
      q, k, v = make_inputs(config.seq_len, config.dim, config.heads, scale, config.seed)
      want = exact64(q, k, v)
      errors = {mode: [] for mode in MODES}
      shifts = {mode: [] for mode in MODES if mode != "highest"}
      for draw in range(config.num_draws):
        w = projection(kernel, jax.random.PRNGKey(config.seed * 1000 + draw), config.num_features, config.dim)
        args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))
        outs = {mode: np.asarray(calls[mode](*args, w), np.float64) for mode in MODES}
        for mode in MODES:
          errors[mode].append(np.linalg.norm(outs[mode] - want) / np.linalg.norm(want))
        for mode in shifts:
          shifts[mode].append(np.linalg.norm(outs[mode] - outs["highest"]) / np.linalg.norm(outs["highest"]))
      record = dict(kernel=kernel, input_scale=scale,
                    draws=config.num_draws if core.get_kernel(kernel).needs_projection else 1)
      record.update({f"rel_error_{mode}": float(np.mean(errors[mode])) for mode in MODES})
      record.update({f"shift_{mode}": float(np.mean(shifts[mode])) for mode in shifts})
      record.update({f"shift_{mode}_max": float(np.max(shifts[mode])) for mode in shifts})
      records.append(record)
      progress(f"{kernel:>16} x{scale:<4} " + " ".join(f"{k}={v:.3e}" for k, v in record.items()
                                                       if k.startswith(("rel_error", "shift")) and "max" not in k))
  return records


def summarize(records, config) -> str:
  scales = list(config.scales)
  lines = [f"# Precision study: relative output error vs float64 exact causal softmax attention "
           f"(L={config.seq_len}, D={config.dim}, H={config.heads}, M={config.num_features}, chunked pass, "
           f"{config.num_draws} draws)", "",
           "Error at precision='highest', and the shift ‖out − out_highest‖/‖out_highest‖ of each emulated "
           "default: TF32 operands (a GPU's, Ampere on) / one bfloat16 pass (a TPU's).", "",
           "| kernel | error ×1 | " + " | ".join(f"shift TF32 / bf16 ×{s:g}" for s in scales) + " |",
           "|---|---|" + "---|" * len(scales)]
  by = {(r["kernel"], r["input_scale"]): r for r in records}
  for kernel in config.kernels:
    cells = [by[(kernel, s)] for s in scales]
    lines.append(f"| {kernel} | {cells[0]['rel_error_highest']:.3f} | " + " | ".join(
        f"{r['shift_tensorfloat32']:.1e} / {r['shift_bfloat16_pass']:.1e}" for r in cells) + " |")
  lines += ["", "Error at each scale (highest / TF32 / bf16):", "",
            "| kernel | " + " | ".join(f"×{s:g}" for s in scales) + " |", "|---|" + "---|" * len(scales)]
  for kernel in config.kernels:
    lines.append(f"| {kernel} | " + " | ".join(
        " / ".join(f"{by[(kernel, s)][f'rel_error_{mode}']:.3f}" for mode in MODES) for s in scales) + " |")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir):
  return []
