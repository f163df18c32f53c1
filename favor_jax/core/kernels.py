"""Feature maps φ with φ(q)ᵀφ(k) ≈ κ(q, k), all of the form φ = mult · exp(log).

Softmax kernels estimate κ(q, k) = exp(q·k/√d): they work on x = q·d^{-1/4} and y = k·d^{-1/4} and estimate
exp(x·y). Each public kernel is a :class:`Kernel` record (its formula's facts: feature count, whether it estimates
softmax, whether it needs a projection, which statistic of the data it takes) called as a pure function
``kernel(query, key, projection, *, stabilize=True) -> (query_features, key_features)``, features
``[..., L, H, F]``. With ``stabilize=False`` they are the raw ones, whose inner product is the estimator; with
``stabilize=True`` each query row is divided by its largest feature and all keys of one (batch, head) by theirs:
factors that cancel in normalised attention. ``kernel.log_features`` keeps the exponential part in log domain, so
that :func:`~favor_jax.core.favor_attention` can choose a stabiliser that never looks at future keys.

A new kernel is its ``_log_features`` function and its record below, added to ``KERNELS`` (and ``__all__``):
every attention function, causal method, layer and experiment reads its facts from the record and passes its
statistic under the record's ``statistic`` keyword (formulas and checks: ``favor_jax.core.statistics``). The
fused Pallas path takes kernels whose features are pure exponentials (a log per feature, no multiplier).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from favor_jax.core import checks
from favor_jax.core.records import Kernel, LogFeatures, causal_statistic_error
from favor_jax.core.statistics import broadcast_rho, check_rho, oprf_rho, saderf_parts, saderf_statistic, scaled

__all__ = [
    "positive", "hyperbolic", "trigonometric", "optimal_positive", "relu", "elu_plus_one",
    "oprf_rho", "broadcast_rho", "check_rho", "KERNELS", "Kernel", "get_kernel", "num_features",
    "LogFeatures", "taylor", "hedgehog", "saderf", "saderf_statistic",
]


def _project(x_LHD, projection):
  """ω x for every row: projection [M, D] shared by the heads, or [H, M, D] one per head."""
  if projection.ndim == 3:
    return jnp.einsum("...hd,hmd->...hm", x_LHD, projection.astype(jnp.float32))
  return jnp.einsum("...d,md->...m", x_LHD, projection.astype(jnp.float32))


def _rows(projection) -> int:
  """M, the projection's rows (per head)."""
  return projection.shape[-2]


def _half_sq_norm(x_LHD):
  return 0.5 * jnp.sum(jnp.square(x_LHD), axis=-1, keepdims=True)


def _checked(query, key, projection):
  checks.check_qk(query, key)
  checks.check_projection(projection, query.shape[-1], query.shape[-2])
  return scaled(query), scaled(key)


def _positive(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
              projection: Float[Array, "M D"] | Float[Array, "H M D"]):
  """FAVOR+ positive features (Choromanski et al. 2021, Lemma 1):

      φ(x) = exp(ωᵢᵀx − ‖x‖²/2) / √M,   E[φ(x)ᵀφ(y)] = exp(xᵀy)  for ωᵢ ~ N(0, I).
  """
  x, y = _checked(query, key, projection)
  log_norm = 0.5 * math.log(_rows(projection))
  feats = [LogFeatures(_project(z, projection) - _half_sq_norm(z) - log_norm, None) for z in (x, y)]
  return tuple(feats)


def _hyperbolic(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
                projection: Float[Array, "M D"] | Float[Array, "H M D"]):
  """FAVOR+ hyperbolic features (Choromanski et al. 2021, Lemma 1), 2M features:

      φ(x) = exp(−‖x‖²/2) / √(2M) · [exp(ωᵢᵀx), exp(−ωᵢᵀx)],   E[φ(x)ᵀφ(y)] = exp(xᵀy).
  """
  x, y = _checked(query, key, projection)
  log_norm = 0.5 * math.log(2 * _rows(projection))

  def feats(z):
    wz = _project(z, projection)
    return LogFeatures(jnp.concatenate([wz, -wz], axis=-1) - _half_sq_norm(z) - log_norm, None)

  return feats(x), feats(y)


def _trigonometric(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
                   projection: Float[Array, "M D"] | Float[Array, "H M D"]):
  """Random Fourier features for the softmax kernel (Rahimi & Recht 2007; Performer §2.3), 2M features:

      φ(x) = exp(‖x‖²/2) / √M · [sin(ωᵢᵀx), cos(ωᵢᵀx)],   E[φ(x)ᵀφ(y)] = exp(xᵀy).

  Not positive: the attention denominator can be near 0 or negative.
  """
  x, y = _checked(query, key, projection)
  log_norm = 0.5 * math.log(_rows(projection))

  def feats(z):
    wz = _project(z, projection)
    return LogFeatures(_half_sq_norm(z) - log_norm, jnp.concatenate([jnp.sin(wz), jnp.cos(wz)], -1))

  return feats(x), feats(y)


def _optimal_positive(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
                      projection: Float[Array, "M D"] | Float[Array, "H M D"], *, rho=None, key_mask=None,
                      causal: bool = False):
  """FAVOR++ / optimal positive random features (Likhosherstov et al. 2022, "Chefs' Random Tables"):

      φ(x) = (1−4A)^{d/4} exp(A‖ω‖² + B ωᵀx − ‖x‖²/2) / √M,   B = √(1−4A),  A < 1/8,

  unbiased for exp(xᵀy) for every such A. A* = (1 − 2ρ − √((2ρ+1)² + 8ρ)) / 16 minimises the mean over all
  (query, key) pairs of log E[(φ(x)ᵀφ(y))²], with ρ = :func:`oprf_rho` (per batch element and head). A* ≤ 0;
  ρ → 0 gives FAVOR+.

  ρ is computed from the whole sequence unless given. Causal attention must not look ahead, so ``causal=True``
  requires ``rho`` from the caller (e.g. a running average kept by the layer). ρ is held constant under
  ``grad``: A only picks the estimator's variance, and E[∇ estimate] is the true gradient at any A.
  """
  x, y = _checked(query, key, projection)
  if rho is None:
    if causal:
      raise causal_statistic_error(optimal_positive, query)
    rho = oprf_rho(query, key, key_mask)
  b_H1, const_HM = oprf_affine(jax.lax.stop_gradient(check_rho(rho, query)), projection, x.shape[-1])
  b_1H1, const = b_H1[..., None, :, :], const_HM[..., None, :, :]  # the positions' axis

  def feats(z):
    return LogFeatures(b_1H1 * _project(z, projection) - _half_sq_norm(z) + const, None)

  return feats(x), feats(y)


def oprf_affine(rho: Float[Array, "... H"], projection: Float[Array, "M D"] | Float[Array, "H M D"],
                d: int) -> tuple[Float[Array, "... H 1"], Float[Array, "... H M"]]:
  """FAVOR++'s log features as B·ωᵀx − ‖x‖²/2 + c (:func:`_optimal_positive`), with A* from ρ, B = √(1−4A) and
  c_i = (d/4) log(1−4A) + A‖ωᵢ‖² − log √M. One definition for the XLA features and the fused TPU kernels, which
  compute the same features on chip.

  Args:
    rho: the statistic ρ ≥ 0, [..., H] (a negative or NaN ρ gives NaN coefficients, never zeros).
    projection: ω, [M, D] shared or [H, M, D] one per head.
    d: the head dim D (x = q·d^{-1/4}).

  Returns:
    (B [..., H, 1], c [..., H, M]), float32.

  References:
    Likhosherstov et al., "Chefs' Random Tables: Non-Trigonometric Random Features", NeurIPS 2022.
  """
  r = 2.0 * rho + 1.0  # √((2ρ+1)² + 8ρ) as r·√(1 + 8ρ/r²): finite for any finite ρ (A ≈ −ρ/4 for large ρ)
  a = (1.0 - 2.0 * rho - r * jnp.sqrt(1.0 + 8.0 * rho / jnp.square(r))) / 16.0
  a_H1 = jnp.where(rho >= 0, a, jnp.nan)[..., None]  # a traced invalid ρ (NaN, < 0) gives NaN outputs, never zeros
  w_sq_M = jnp.sum(jnp.square(projection.astype(jnp.float32)), -1)
  const = 0.25 * d * jnp.log1p(-4.0 * a_H1) + a_H1 * w_sq_M - 0.5 * math.log(_rows(projection))
  return jnp.sqrt(1.0 - 4.0 * a_H1), const


def _relu(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
          projection: Float[Array, "M D"] | Float[Array, "H M D"]):
  """Generalized-kernel ReLU features (Performer §2.2; not a softmax estimator):

      φ(x) = max(ωᵢᵀx, 0) / √M  with x = q·d^{-1/4}.
  """
  x, y = _checked(query, key, projection)
  scale = _rows(projection) ** -0.5
  return tuple(LogFeatures(None, jax.nn.relu(_project(z, projection)) * scale) for z in (x, y))


def _elu_plus_one(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
                  projection: Float[Array, "M D"] | Float[Array, "H M D"] | None = None):
  """Deterministic linear-attention baseline (Katharopoulos et al. 2020), F = D:

      φ(x) = elu(x) + 1  on the raw inputs: no projection (the record refuses one: ``takes_projection``).

  In log domain, log φ = log1p(x) for x > 0 and x below: elu(x) + 1 = eˣ there, which float32 would
  round to exactly 0 from x ≈ −17 (a query row then attends to nothing); the stabiliser keeps any x exact.
  """
  checks.check_qk(query, key)

  def log_phi(z):
    z = z.astype(jnp.float32)
    return jnp.where(z > 0, jnp.log1p(jnp.maximum(z, 0.0)), z)

  return tuple(LogFeatures(log_phi(z), None) for z in (query, key))


def _taylor(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
            projection: Float[Array, "M D"] | Float[Array, "H M D"] | None = None):
  """Second-order Taylor features of exp(xᵀy) (Based: Arora et al. 2024, "Simple linear attention
  language models balance the recall-throughput tradeoff"; Zhang et al. 2024), x = q·d^{-1/4}:

      φ(x) = [1, x, x_i²/√2 (i), x_i x_j (i < j)],   φ(x)ᵀφ(y) = 1 + xᵀy + (xᵀy)²/2  exactly,

  1 + D + D(D+1)/2 features (the symmetric half of x⊗x). With a ``projection`` P ([M, D] or [H, M, D]) x is
  first mapped to P x and the identity holds for the mapped vectors (1 + M + M(M+1)/2 features). Not an
  unbiased softmax estimator (a truncation), but 1 + t + t²/2 = ((1 + t)² + 1)/2 ≥ 1/2 for every t, so every
  weight and denominator is positive: no sign cancellation as with trigonometric features.
  """
  checks.check_qk(query, key)
  if projection is not None:
    checks.check_projection(projection, query.shape[-1], query.shape[-2])

  def feats(z):
    z = _taylor_inputs(z, projection)
    i, j = np.triu_indices(z.shape[-1])
    weight = np.where(i == j, math.sqrt(0.5), 1.0).astype(np.float32)
    ones = jnp.ones(z.shape[:-1] + (1,), jnp.float32)
    return LogFeatures(None, jnp.concatenate([ones, z, z[..., i] * z[..., j] * weight], axis=-1))

  return feats(query), feats(key)


def _taylor_inputs(z, projection):
  """x = z·d^{-1/4}, mapped to P x by a ``projection`` P if one is given."""
  z = scaled(z)
  return z if projection is None else _project(z, projection)


def _taylor_log_pairs(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
                      projection: Float[Array, "M D"] | Float[Array, "H M D"] | None = None):
  """log φ(qᵢ)ᵀφ(kⱼ) = log(1 + t + t²/2) = log(((1 + t)² + 1)/2), t = xᵢᵀyⱼ, in closed form [..., H, Lq, Lk].

  The sum over features has terms up to t²/2 for a value ≥ 1/2 (at t = −1): in float32 it loses
  the small weights (3e-3 relative at inputs ×20). Here the error is that of t alone. u = 1 + t is
  scaled by max(|u|, 1) so that no finite t overflows.
  """
  x, y = _taylor_inputs(query, projection), _taylor_inputs(key, projection)
  u = 1.0 + jnp.einsum("...qhd,...khd->...hqk", x, y)
  big = jnp.maximum(jnp.abs(u), 1.0)
  return 2.0 * jnp.log(big) + jnp.log(0.5 * (jnp.square(u / big) + jnp.square(1.0 / big)))


def _taylor_features(m, d):
  width = d if m is None else m
  return 1 + width + width * (width + 1) // 2


def _hedgehog(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
              projection: Float[Array, "M D"] | Float[Array, "H M D"]):
  """Hedgehog's learned feature map (Zhang et al. 2024, "The Hedgehog & the Porcupine"), 2M features:

      φ(x) = [softmax(W x), softmax(−W x)]   (each half normalised over its M features),

  with W the trained ``projection`` (per head [H, M, D] in the layers, initialised
  to the identity) applied to the raw q and k. It makes no unbiasedness claim: W
  is fitted (``layers.distillation_loss``) so that the normalised weights mimic
  softmax's. Positive, so denominators are positive.
  """
  checks.check_qk(query, key)
  checks.check_projection(projection, query.shape[-1], query.shape[-2])

  def feats(z):
    wz = _project(z.astype(jnp.float32), projection)
    both = jnp.concatenate([wz - jax.nn.logsumexp(wz, -1, keepdims=True),
                            -wz - jax.nn.logsumexp(-wz, -1, keepdims=True)], axis=-1)
    return LogFeatures(both, None)

  return feats(query), feats(key)


positive = Kernel("positive", _positive, lambda m, d: m, estimates_softmax=True, fused_map="positive")
hyperbolic = Kernel("hyperbolic", _hyperbolic, lambda m, d: 2 * m, estimates_softmax=True, fused_map="hyperbolic")
trigonometric = Kernel("trigonometric", _trigonometric, lambda m, d: 2 * m, estimates_softmax=True,
                       positive_weights=False)
optimal_positive = Kernel("optimal_positive", _optimal_positive, lambda m, d: m, estimates_softmax=True,
                          statistic="rho", compute_statistic=oprf_rho, fused_map="optimal_positive")
relu = Kernel("relu", _relu, lambda m, d: m, estimates_softmax=False, positive_weights=False)
elu_plus_one = Kernel("elu_plus_one", _elu_plus_one, lambda m, d: d, estimates_softmax=False,
                      needs_projection=False, takes_projection=False)
taylor = Kernel("taylor", _taylor, _taylor_features, estimates_softmax=False, needs_projection=False,
                log_pairs=_taylor_log_pairs)
hedgehog = Kernel("hedgehog", _hedgehog, lambda m, d: 2 * m, estimates_softmax=False, learned=True)


def _saderf(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
            projection: Float[Array, "M D"] | Float[Array, "H M D"], *, rho=None, key_mask=None,
            causal: bool = False):
  """FAVOR# with SADERFs (Likhosherstov et al. 2023, "Dense-Exponential Random Features: Sharp
  Positive Estimators of the Gaussian Kernel"): DERFs whose dense matrices are a diagonal Ψ > 0,

      φ(x) = φ_A(Ψx),  ψ(y) = φ_A(Ψ⁻¹y),  φ_A(z) = (1−4A)^{d/4} exp(A‖ω‖² + √(1−4A) ωᵀz − ‖z‖²/2) / √M,

  unbiased for exp(xᵀy) for every such Ψ and A < 1/8, as (Ψx)ᵀ(Ψ⁻¹y) = xᵀy and φ_A is FAVOR++'s
  (:func:`_optimal_positive`). The mean over all pairs of log E[(φ(x)ᵀψ(y))²] is, up to terms free of Ψ,
  (‖Ψx‖² + ‖Ψ⁻¹y‖²)/(1−8A) averaged, so its minimiser Ψ does not depend on A; A is then FAVOR++'s A* for the
  rescaled pairs. Both come from ``rho`` = :func:`saderf_statistic` ([..., H, D+1]: log Ψ, then ρ), computed
  from the whole sequence unless given; ``causal=True`` requires it from the caller. Ψ = I gives FAVOR++. The
  statistic is held constant under ``grad``: any Ψ and A give an unbiased estimator.
  """
  checks.check_qk(query, key)
  if rho is None:
    if causal:
      raise causal_statistic_error(saderf, query)
    rho = saderf_statistic(query, key, key_mask)
  log_psi, rho = saderf_parts(rho, query)
  psi = jnp.exp(jax.lax.stop_gradient(log_psi))[..., None, :, :]
  return _optimal_positive(query.astype(jnp.float32) * psi, key.astype(jnp.float32) / psi, projection,
                           rho=rho)


saderf = Kernel("saderf", _saderf, lambda m, d: m, estimates_softmax=True, statistic="rho",
                compute_statistic=saderf_statistic, fused_map="saderf")

KERNELS = {k.name: k for k in (positive, hyperbolic, trigonometric, optimal_positive, relu, elu_plus_one,
                               taylor, hedgehog, saderf)}


def data_dependent_names() -> list[str]:
  """The names in ``KERNELS`` whose records take a statistic of the data."""
  return sorted(name for name, kernel in KERNELS.items() if kernel.data_dependent)


def get_kernel(kernel):
  """Looks up a kernel by name; a callable is returned unchanged.

  Args:
    kernel: a name in ``KERNELS`` or a :class:`Kernel` record, or a callable with a kernel's signature.

  Returns:
    The :class:`Kernel` of that name, or ``kernel`` itself.

  Raises:
    ValueError: if ``kernel`` is neither callable nor a name in ``KERNELS``.
  """
  if callable(kernel):
    return kernel
  if not isinstance(kernel, str) or kernel not in KERNELS:
    raise ValueError(f"unknown kernel {kernel!r}; choose one of {sorted(KERNELS)} or pass a callable")
  return KERNELS[kernel]


def num_features(kernel, num_projections: int | None, head_dim: int) -> int:
  """Computes F, the features per head ``kernel`` produces (M for ``positive``, 2M for ``hyperbolic``).

  Args:
    kernel: a name in ``KERNELS`` or a :class:`Kernel` record.
    num_projections: M, the projection's rows (None: without a projection).
    head_dim: D, the head dim of query and key.

  Returns:
    F, an int.

  Raises:
    ValueError: if ``kernel`` is an unknown name.
  """
  return get_kernel(kernel).num_features(num_projections, head_dim)
