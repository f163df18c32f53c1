"""The statistics of the data-dependent kernels (FAVOR++, FAVOR#): their formulas and their checks.

A data-dependent kernel's features depend on a statistic of the queries and keys
(:class:`~favor_jax.core.kernels.Kernel` ``statistic``/``compute_statistic``): FAVOR++'s ρ
(:func:`oprf_rho`) and FAVOR#'s [log Ψ, ρ] (:func:`saderf_statistic`), means over all (query, key)
pairs computed in O(L·d), with masked and non-finite rows left out. Both work on x = q·d^{-1/4}
and y = k·d^{-1/4} (:func:`scaled`), the inputs of the softmax kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from favor_jax.core import checks

__all__ = ["oprf_rho", "saderf_statistic", "broadcast_rho", "check_rho", "MAX_SQ_NORM", "in_range", "CLIP"]


def scaled(x):
  """x·d^{-1/4} in float32, so that exp(xᵀy) is the softmax kernel exp(q·k/√d)."""
  return x.astype(jnp.float32) * x.shape[-1] ** -0.25


# Every kernel's range: the query and key rows whose x = q·d^{-1/4} has ‖x‖² ≤ MAX_SQ_NORM (entries up to
# ~1.1e18·d^{1/4}/√d). Inside it, every term of every kernel's formula and of the statistics (means of ‖x‖²
# over the sequence, FAVOR++'s A ≈ −ρ/4) is a float32 number, so the attention is the formula rounded to
# float32: each log-domain term to ~eps·‖x‖², never a row lost below the float range. Beyond it (‖x‖²
# overflows at 2^128: exp(−‖x‖²/2) = 0 for every feature, a silent zero row) a row counts as non-finite:
# NaN in the rows that depend on it (``inputs.split_nonfinite``), left out of the statistics.
MAX_SQ_NORM = 2.0 ** 120


def _within(x_LHD):
  """Per row [..., L, H]: x (already scaled) is finite with ‖x‖² ≤ MAX_SQ_NORM (False for NaN)."""
  return jnp.sum(jnp.square(x_LHD), axis=-1) <= MAX_SQ_NORM


def in_range(z: Float[Array, "... L H D"]) -> Bool[Array, "... L H"]:
  """Whether each query or key row is inside every kernel's range (finite, ‖z·d^{-1/4}‖² ≤ MAX_SQ_NORM).

  Args:
    z: queries or keys [..., L, H, D].

  Returns:
    [..., L, H] bool, False for a row with a non-finite entry or a squared norm beyond the range.
  """
  return _within(scaled(z))


def _query_rows(x_LHD, query_mask):
  """(x with the queries left out zeroed, the count kept per head [..., H]): a mean over queries is a sum
  divided by it. Left out: those of ``query_mask`` False (padding), and those non-finite or beyond the range
  (``MAX_SQ_NORM``) in a head (such a query is NaN in its own row only, never in the statistic of the others)."""
  keep = _within(x_LHD)
  if query_mask is not None:
    keep = keep & jnp.broadcast_to(query_mask, x_LHD.shape[:-2])[..., None]
  count = jnp.maximum(jnp.sum(keep.astype(jnp.float32), axis=-2), 1.0)
  return jnp.where(keep[..., None], x_LHD, 0.0), count


def _key_weights(y_LHD, key_mask):
  """(y with masked and non-finite keys zeroed, per key 1/(unmasked keys) or 0 if masked: [..., Lk]): a mean
  over keys is a contraction with the weights. A non-finite unmasked key (or one beyond the range) is left out:
  it is seen by every row (NaN there)."""
  w = jnp.ones(y_LHD.shape[:-2], jnp.float32)
  if key_mask is not None:
    w = jnp.broadcast_to(key_mask, y_LHD.shape[:-2]).astype(jnp.float32)
  keep = (w > 0)[..., None] & _within(y_LHD)
  return jnp.where(keep[..., None], y_LHD, 0.0), w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1.0)


def oprf_rho(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
             key_mask: Bool[Array, "... Lk"] | None = None,
             query_mask: Bool[Array, "... Lq"] | None = None) -> Float[Array, "... H"]:
  """FAVOR++ statistic ρ = mean_{i,j} ‖xᵢ + yⱼ‖² / d, per batch element and head.

  x = q·d^{-1/4}, y = k·d^{-1/4}; masked keys, masked queries (``query_mask``:
  padding) and non-finite rows are left out. The mean over all pairs is
  ‖x‖²‾ + ‖y‖²‾ + 2·x̄ᵀȳ, so it costs O(L·d).
  """
  x, count_H, y, w_L = _statistic_inputs(query, key, key_mask, query_mask)
  x_sq = jnp.sum(jnp.sum(x * x, -1) / count_H[..., None, :], axis=-2)  # [..., H]; divided first: no overflow
  x_bar = jnp.sum(x, axis=-3) / count_H[..., None]  # [..., H, D]
  y_sq = jnp.einsum("...l,...lh->...h", w_L, jnp.sum(y * y, -1))
  y_bar = jnp.einsum("...l,...lhd->...hd", w_L, y)
  return jnp.maximum(x_sq + y_sq + 2 * jnp.sum(x_bar * y_bar, -1), 0.0) / x.shape[-1]  # ≥ 0 but for rounding


def _statistic_inputs(query, key, key_mask, query_mask, clip=False):
  """x = q·d^{-1/4} with its count of kept queries (``_query_rows``), y = k·d^{-1/4} with its keys'
  weights (``_key_weights``); inputs checked. ``clip``: both winsorised (``_winsorised``)."""
  checks.check_qk(query, key)
  checks.check_lengths(query, key)
  checks.check_key_mask(key_mask, key.shape)
  checks.check_key_mask(query_mask, query.shape, "query_mask")
  x, y = scaled(query), scaled(key)
  if clip:
    x, y = _winsorised(x, query_mask), _winsorised(y, key_mask)
  return (*_query_rows(x, query_mask), *_key_weights(y, key_mask))


# FAVOR#'s moments are taken of values winsorised at ±√(CLIP · c_l) per coordinate, c_l the larger of the
# median of x_l² and the median of ‖x‖²/d over the kept rows: one token adds at most CLIP·c_l/n to a mean of
# n rows, whatever its size. For Gaussian rows the cap is |x_l| > 5.4σ (probability 7e-8): ordinary data
# are unchanged.
CLIP = 64.0


def _winsorised(x_LHD, row_mask):
  """x with each coordinate clipped to ±√(CLIP · c_l) (per batch element, head and coordinate; see ``CLIP``),
  c_l from the rows in range and of ``row_mask`` (None: all) only; the other rows are returned as they are."""
  keep = _within(x_LHD)
  if row_mask is not None:
    keep = keep & jnp.broadcast_to(row_mask, x_LHD.shape[:-2])[..., None]
  sq = jnp.where(keep[..., None], jnp.square(x_LHD), jnp.nan)
  per_coordinate = jnp.nanmedian(sq, axis=-3, keepdims=True)
  per_row = jnp.nanmedian(jnp.sum(sq, -1, keepdims=True), axis=-3, keepdims=True) / x_LHD.shape[-1]
  cap = jnp.sqrt(CLIP * jnp.fmax(per_coordinate, per_row))  # NaN where no row is kept: nothing to clip
  return jnp.where(keep[..., None], jnp.clip(x_LHD, -cap, cap), x_LHD)


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


def saderf_statistic(query: Float[Array, "... Lq H D"], key: Float[Array, "... Lk H D"],
                     key_mask: Bool[Array, "... Lk"] | None = None,
                     query_mask: Bool[Array, "... Lq"] | None = None) -> Float[Array, "... H D+1"]:
  """FAVOR#'s statistic per batch element and head: [log Ψ₁, …, log Ψ_D, ρ], O(L·d).

  Ψ = diag(Ψ_l) minimises the mean over all (query, key) pairs of ‖Ψx + Ψ⁻¹y‖²
  = Σ_l (Ψ_l² m_l^x + Ψ_l⁻² m_l^y) + 2·x̄ᵀȳ, with m^x = mean_i x_i², m^y = mean_j y_j²
  per coordinate: Ψ_l = (m_l^y / m_l^x)^{1/4}. ρ is that mean over pairs / d, the
  FAVOR++ statistic (:func:`oprf_rho`) of the rescaled pairs. x = q·d^{-1/4},
  y = k·d^{-1/4}; masked keys, masked queries (``query_mask``: padding) and
  non-finite rows are left out. A coordinate that is (nearly) zero in all
  queries or all keys gets a bounded Ψ_l (every Ψ > 0 is unbiased).

  The means are taken of winsorised values (each coordinate clipped at ±√(CLIP·c_l), c_l the larger of
  the median x_l² and the median ‖x‖²/d, ``CLIP`` = 64), so that one token cannot set Ψ and ρ for all: it
  adds at most CLIP·c_l/n to a mean over n rows (log Ψ_l moves by at most ¼·log(1 + CLIP·c_l/S_l), S_l the
  sum of x_l² over the other rows). Data with no value beyond the cap (Gaussian rows: |x_l| > 5.4σ,
  probability 7e-8) get the paper's statistic unchanged; any Ψ > 0 and A < 1/8 keep the estimator
  unbiased, so the clip changes its variance only.
  """
  x, count_H, y, w_L = _statistic_inputs(query, key, key_mask, query_mask, clip=True)
  mx, x_bar = (jnp.sum(z / count_H[..., None, :, None], axis=-3) for z in (x * x, x))  # [..., H, D]
  my, y_bar = jnp.einsum("...l,...lhd->...hd", w_L, y * y), jnp.einsum("...l,...lhd->...hd", w_L, y)
  floor = 1e-8 * jnp.mean(mx + my, axis=-1, keepdims=True) + 1e-30
  log_psi = 0.25 * (jnp.log(my + floor) - jnp.log(mx + floor))
  psi_sq = jnp.exp(2.0 * log_psi)
  pairs = jnp.sum(psi_sq * mx + my / psi_sq + 2.0 * x_bar * y_bar, axis=-1)
  rho = jnp.maximum(pairs, 0.0) / x.shape[-1]  # ≥ 0 but for rounding
  return jnp.concatenate([log_psi, rho[..., None]], axis=-1)


def saderf_parts(statistic, query):
  """(log Ψ [..., H, D], ρ [..., H]) from a statistic broadcastable to [..., H, D+1], or a clear error.

  A concrete statistic must have finite log Ψ and a finite ρ ≥ 0; a traced invalid one gives NaN.
  """
  d = query.shape[-1]
  want = query.shape[:-3] + query.shape[-2:-1] + (d + 1,)
  shape = jnp.shape(statistic)
  try:
    fits = jnp.broadcast_shapes(shape, want) == want
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(f"rho (saderf's statistic: log Ψ for each of the D={d} coordinates, then ρ) must "
                     f"broadcast to [..., H, D+1] = {want}, got shape {shape}; see kernels.saderf_statistic")
  if not isinstance(statistic, jax.core.Tracer):
    values = np.broadcast_to(np.asarray(statistic, np.float32), want)
    bad_psi, rho = ~np.isfinite(values[..., :d]), values[..., d]
    bad_rho = ~(np.isfinite(rho) & (rho >= 0))
    if bad_psi.any() or bad_rho.any():
      raise ValueError(f"rho (saderf's statistic [..., H, D+1]) needs finite log Ψ (its first {d} entries) "
                       f"and a finite ρ >= 0 (its last entry); got {int(bad_psi.sum())} non-finite log Ψ "
                       f"and ρ values {rho[bad_rho][:4]}")
  statistic = jnp.broadcast_to(jnp.asarray(statistic, jnp.float32), want)
  log_psi, rho = statistic[..., :d], statistic[..., d]
  ok = jnp.all(jnp.isfinite(log_psi), axis=-1) & jnp.isfinite(rho) & (rho >= 0)
  return jnp.where(jnp.isfinite(log_psi), log_psi, 0.0), jnp.where(ok, rho, jnp.nan)
