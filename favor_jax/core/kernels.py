"""Feature maps φ with φ(q)ᵀφ(k) ≈ κ(q, k), all of the form φ = mult · exp(log).

Softmax kernels estimate κ(q, k) = exp(q·k/√d): they work on x = q·d^{-1/4} and
y = k·d^{-1/4} and estimate exp(x·y). Each public kernel is a pure function

    kernel(query, key, projection, *, stabilize=True) -> (query_features, key_features)

with features ``[..., L, H, F]``. With ``stabilize=False`` the features are the
raw ones, whose inner product is the estimator. With ``stabilize=True`` each
query row is divided by its largest feature and all keys of one (batch, head)
by their largest feature: factors that cancel in normalised attention.

Internally every kernel also exposes ``kernel.log_features``, which keeps the
exponential part in log domain so that :func:`favor_attention` can choose a
stabiliser that never looks at future keys (see ``causal.py``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from favor_jax.core import checks

__all__ = [
    "positive", "hyperbolic", "trigonometric", "optimal_positive", "relu", "elu_plus_one",
    "oprf_rho", "broadcast_rho", "KERNELS", "get_kernel", "LogFeatures",
]


class LogFeatures(NamedTuple):
  """φ = mult · exp(log). ``log``: [..., L, H, F] or [..., L, H, 1] (None: 0); ``mult``: [..., L, H, F] (None: 1)."""
  log: Array | None
  mult: Array | None


def _scaled(x):
  """x·d^{-1/4} in float32, so that exp(xᵀy) is the softmax kernel exp(q·k/√d)."""
  return x.astype(jnp.float32) * x.shape[-1] ** -0.25


def _project(x_LHD, projection_MD):
  return jnp.einsum("...lhd,md->...lhm", x_LHD, projection_MD.astype(jnp.float32))


def _half_sq_norm(x_LHD):
  return 0.5 * jnp.sum(jnp.square(x_LHD), axis=-1, keepdims=True)


def materialise(f: LogFeatures, *, stabilize: bool, over_keys: bool) -> Array:
  """Features as an array; ``stabilize`` divides by the max over features (and over L if ``over_keys``)."""
  if f.log is None:
    return f.mult
  log = f.log
  if stabilize:
    axes = (-3, -1) if over_keys else (-1,)
    log = log - jax.lax.stop_gradient(jnp.max(log, axis=axes, keepdims=True))
  out = jnp.exp(log)
  return out if f.mult is None else out * f.mult


def _public(log_features, *, data_dependent=False):
  """Wraps ``log_features(query, key, projection, **kw)`` as a public feature-map kernel."""

  def kernel(query, key, projection, *, stabilize: bool = True, **kwargs):
    fq, fk = log_features(query, key, projection, **kwargs)
    return (materialise(fq, stabilize=stabilize, over_keys=False),
            materialise(fk, stabilize=stabilize, over_keys=True))

  kernel.__name__ = kernel.__qualname__ = log_features.__name__.lstrip("_")
  kernel.__doc__ = log_features.__doc__
  kernel.log_features = log_features
  kernel.data_dependent = data_dependent
  return kernel


def _checked(query, key, projection):
  checks.check_qk(query, key)
  checks.check_projection(projection, query.shape[-1])
  return _scaled(query), _scaled(key)


def _positive(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
              projection: Float[Array, "M D"]):
  """FAVOR+ positive features (Choromanski et al. 2021, Lemma 1):

      φ(x) = exp(ωᵢᵀx − ‖x‖²/2) / √M,   E[φ(x)ᵀφ(y)] = exp(xᵀy)  for ωᵢ ~ N(0, I).
  """
  x, y = _checked(query, key, projection)
  log_norm = 0.5 * math.log(projection.shape[0])
  feats = [LogFeatures(_project(z, projection) - _half_sq_norm(z) - log_norm, None) for z in (x, y)]
  return tuple(feats)


def _hyperbolic(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
                projection: Float[Array, "M D"]):
  """FAVOR+ hyperbolic features (Choromanski et al. 2021, Lemma 1), 2M features:

      φ(x) = exp(−‖x‖²/2) / √(2M) · [exp(ωᵢᵀx), exp(−ωᵢᵀx)],   E[φ(x)ᵀφ(y)] = exp(xᵀy).
  """
  x, y = _checked(query, key, projection)
  log_norm = 0.5 * math.log(2 * projection.shape[0])

  def feats(z):
    wz = _project(z, projection)
    return LogFeatures(jnp.concatenate([wz, -wz], axis=-1) - _half_sq_norm(z) - log_norm, None)

  return feats(x), feats(y)


def _trigonometric(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
                   projection: Float[Array, "M D"]):
  """Random Fourier features for the softmax kernel (Rahimi & Recht 2007; Performer §2.3), 2M features:

      φ(x) = exp(‖x‖²/2) / √M · [sin(ωᵢᵀx), cos(ωᵢᵀx)],   E[φ(x)ᵀφ(y)] = exp(xᵀy).

  Not positive: the attention denominator can be near 0 or negative.
  """
  x, y = _checked(query, key, projection)
  log_norm = 0.5 * math.log(projection.shape[0])

  def feats(z):
    wz = _project(z, projection)
    return LogFeatures(_half_sq_norm(z) - log_norm, jnp.concatenate([jnp.sin(wz), jnp.cos(wz)], -1))

  return feats(x), feats(y)


def oprf_rho(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
             key_mask: Bool[Array, "... Lk"] | None = None) -> Float[Array, "... H"]:
  """FAVOR++ statistic ρ = mean_{i,j} ‖xᵢ + yⱼ‖² / d, per batch element and head.

  x = q·d^{-1/4}, y = k·d^{-1/4}; masked keys are left out. The mean over all
  pairs is ‖x‖²‾ + ‖y‖²‾ + 2·x̄ᵀȳ, so it costs O(L·d).
  """
  checks.check_qk(query, key)
  checks.check_key_mask(key_mask, key.shape)
  x, y = _scaled(query), _scaled(key)
  d = x.shape[-1]
  x_sq = jnp.mean(jnp.sum(x * x, -1), axis=-2)  # [..., H]
  x_bar = jnp.mean(x, axis=-3)  # [..., H, D]
  if key_mask is None:
    w = jnp.ones(y.shape[:-2], jnp.float32)
  else:
    w = jnp.broadcast_to(key_mask, y.shape[:-2]).astype(jnp.float32)
  w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1.0)
  y_sq = jnp.einsum("...l,...lh->...h", w, jnp.sum(y * y, -1))
  y_bar = jnp.einsum("...l,...lhd->...hd", w, y)
  return jnp.maximum(x_sq + y_sq + 2 * jnp.sum(x_bar * y_bar, -1), 0.0) / d  # ≥ 0 but for rounding


def broadcast_rho(rho, query) -> Float[Array, "... H"]:
  """ρ as float32 broadcast to query's [..., H] (batch dims and heads), or a clear error."""
  batch_heads = query.shape[:-3] + query.shape[-2:-1]
  rho = jnp.asarray(rho, jnp.float32)
  try:
    return jnp.broadcast_to(rho, batch_heads)
  except ValueError:
    raise ValueError(f"rho must broadcast to [..., H] = {batch_heads}, got shape {rho.shape}") from None


def check_rho(rho, query) -> Float[Array, "... H"]:
  """ρ broadcast to [..., H]; a concrete ρ must be finite and ≥ 0 (it is a mean of ‖x + y‖²/d)."""
  if not isinstance(rho, jax.core.Tracer):
    values = np.asarray(rho, np.float32)
    bad = ~(np.isfinite(values) & (values >= 0))
    if bad.any():
      raise ValueError(f"rho must be finite and >= 0 (a mean of squared norms), got {values[bad][:4]} "
                       f"among its {values.size} values")
  return broadcast_rho(rho, query)


def _optimal_positive(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
                      projection: Float[Array, "M D"], *, rho=None, key_mask=None,
                      causal: bool = False):
  """FAVOR++ / optimal positive random features (Likhosherstov et al. 2022, "Chefs' Random Tables"):

      φ(x) = (1−4A)^{d/4} exp(A‖ω‖² + B ωᵀx − ‖x‖²/2) / √M,   B = √(1−4A),  A < 1/8,

  unbiased for exp(xᵀy) for every such A. A* = (1 − 2ρ − √((2ρ+1)² + 8ρ)) / 16
  minimises the mean over all (query, key) pairs of log E[(φ(x)ᵀφ(y))²], with
  ρ = :func:`oprf_rho` (per batch element and head). A* ≤ 0; ρ → 0 gives FAVOR+.

  ρ is computed from the whole sequence unless given. Causal attention must not
  look ahead, so ``causal=True`` requires ``rho`` from the caller (e.g. a
  running average kept by the layer). ρ is held constant under ``grad``: A only
  picks the estimator's variance, and E[∇ estimate] is the true gradient at any A.
  """
  x, y = _checked(query, key, projection)
  if rho is None:
    if causal:
      raise ValueError(
          "optimal_positive (FAVOR++) takes its statistic ρ from the whole sequence, which in "
          "causal attention would let future keys shape past outputs; pass rho= (shape "
          f"broadcastable to {query.shape[:-3] + query.shape[-2:-1]}, e.g. a running average "
          "of oprf_rho kept by the layer) or use a data-independent kernel")
    rho = oprf_rho(query, key, key_mask)
  rho = jax.lax.stop_gradient(check_rho(rho, query))
  d = x.shape[-1]
  a = (1.0 - 2.0 * rho - jnp.sqrt(jnp.square(2.0 * rho + 1.0) + 8.0 * rho)) / 16.0
  a = jnp.where(rho >= 0, a, jnp.nan)  # a traced invalid ρ (NaN, < 0) gives NaN outputs, never zeros
  a_1H1 = a[..., None, :, None]
  b_1H1 = jnp.sqrt(1.0 - 4.0 * a_1H1)
  w_sq_M = jnp.sum(jnp.square(projection.astype(jnp.float32)), -1)
  const = 0.25 * d * jnp.log1p(-4.0 * a_1H1) + a_1H1 * w_sq_M - 0.5 * math.log(projection.shape[0])

  def feats(z):
    return LogFeatures(b_1H1 * _project(z, projection) - _half_sq_norm(z) + const, None)

  return feats(x), feats(y)


def _relu(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
          projection: Float[Array, "M D"]):
  """Generalized-kernel ReLU features (Performer §2.2; not a softmax estimator):

      φ(x) = max(ωᵢᵀx, 0) / √M  with x = q·d^{-1/4}.
  """
  x, y = _checked(query, key, projection)
  scale = projection.shape[0] ** -0.5
  return tuple(LogFeatures(None, jax.nn.relu(_project(z, projection)) * scale) for z in (x, y))


def _elu_plus_one(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
                  projection: Float[Array, "M D"] | None = None):
  """Deterministic linear-attention baseline (Katharopoulos et al. 2020), F = D:

      φ(x) = elu(x) + 1  on the raw inputs. The projection is not used (may be None).
  """
  checks.check_qk(query, key)
  return tuple(LogFeatures(None, jax.nn.elu(z.astype(jnp.float32)) + 1.0) for z in (query, key))


positive = _public(_positive)
hyperbolic = _public(_hyperbolic)
trigonometric = _public(_trigonometric)
optimal_positive = _public(_optimal_positive, data_dependent=True)
relu = _public(_relu)
elu_plus_one = _public(_elu_plus_one)

KERNELS = {
    "positive": positive,
    "hyperbolic": hyperbolic,
    "trigonometric": trigonometric,
    "optimal_positive": optimal_positive,
    "relu": relu,
    "elu_plus_one": elu_plus_one,
}

# Kernels whose estimate E[φ(q)ᵀφ(k)] is exactly exp(q·k/√d).
SOFTMAX_KERNELS = ("positive", "hyperbolic", "trigonometric", "optimal_positive")


def get_kernel(kernel):
  """A kernel by name (one of ``KERNELS``) or a callable returned unchanged."""
  if callable(kernel):
    return kernel
  if kernel not in KERNELS:
    raise ValueError(f"unknown kernel {kernel!r}; choose one of {sorted(KERNELS)} or pass a callable")
  return KERNELS[kernel]


def num_features(kernel, num_projections: int, head_dim: int) -> int:
  """F, the feature count ``kernel`` produces from an [M, D] projection."""
  name = getattr(kernel, "__name__", kernel)
  if name in ("hyperbolic", "trigonometric"):
    return 2 * num_projections
  if name == "elu_plus_one":
    return head_dim
  return num_projections
