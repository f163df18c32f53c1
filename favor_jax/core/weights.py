"""Explicit attention weights: what softmax or a feature map implies for every (query, key) pair.

Quadratic in L (and O(Lq·Lk·F) work for kernels with per-feature logs): for
analysis, plots and distilling feature maps at small L, never inside a model's
forward pass at length.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from favor_jax.core import checks, inputs
from favor_jax.core import features as features_lib
from favor_jax.core import gates as gates_lib
from favor_jax.core import kernels as kernels_lib
from favor_jax.core import precision as precision_lib
from favor_jax.core import state as state_lib

__all__ = ["attention_weights"]

QUERY_BLOCK = 32  # query rows per step of the kernel log-weights ([block, Lk, F] at a time)


def _kernel_log_weights(fq, fk):
  """log |φ(q_i)ᵀφ(k_j)| and its sign, [N, H, Lq, Lk], exact for any feature sizes (no underflow)."""
  log_q, mult_q = state_lib.parts(fq)  # L-major [N, L, H, Fm], [N, L, H, F] (mult may be None)
  log_k, mult_k = state_lib.parts(fk)
  head_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 2)  # [N, H, L, F]
  log_q, mult_q, log_k, mult_k = map(head_major, (log_q, mult_q, log_k, mult_k))

  @jax.checkpoint
  def rows(x):  # one block of query rows: [N, H, b, F] -> [N, H, b, Lk]
    lq, mq = x
    terms = lq[..., :, None, :] + log_k[..., None, :, :]
    signs = None if mq is None else mq[..., :, None, :] * mult_k[..., None, :, :]
    return jax.nn.logsumexp(terms, axis=-1, b=signs, return_sign=True)

  length = log_q.shape[2]
  block = min(QUERY_BLOCK, length)
  padded = -(-length // block) * block
  pad = lambda x: None if x is None else jnp.pad(x, [(0, 0), (0, 0), (0, padded - length), (0, 0)])
  split = lambda x: None if x is None else jnp.moveaxis(
      x.reshape(x.shape[:2] + (padded // block, block, x.shape[-1])), 2, 0)
  log_w, sign = jax.lax.map(rows, (split(pad(log_q)), split(pad(mult_q))))
  merge = lambda x: jnp.moveaxis(x, 0, 2).reshape(x.shape[1:3] + (padded, x.shape[-1]))[:, :, :length]
  return merge(log_w), merge(sign)


@precision_lib.honoured
def attention_weights(
    query: Float[Array, "... Lq H D"],
    key: Float[Array, "... Lk H D"],
    projection: Float[Array, "M D"] | Float[Array, "H M D"] | None = None,
    *,
    kernel="softmax",
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    window: int = 0,
    rho: Float[Array, "... H"] | Float[Array, "... H D+1"] | None = None,
    query_mask: Bool[Array, "... Lq"] | None = None,
    log: bool = False,
    log_gate: Float[Array, "... L H"] | None = None,
    segment_ids: Int[Array, "... L"] | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> Float[Array, "... H Lq Lk"]:
  """Computes the normalised weights A [..., H, Lq, Lk] with out = A v, as the attention functions do.

  ``kernel="softmax"``: softmax(q kᵀ/√d) (:func:`softmax_attention`). Otherwise the weights
  φ(q_i)ᵀφ(k_j) / Σ_j φ(q_i)ᵀφ(k_j) of a feature map (as in :func:`favor_attention`); with ``window > 0``
  the keys within the window get the exact exp(q·k/√d) instead (:func:`hybrid_attention`). Rows sum to 1
  over the keys they may see (j ≤ t if ``causal``, unmasked); a row that sees none is 0. Computed in log
  domain, so a weight is as exact as float32 holds it however far apart its row's terms are (one below
  float32's range is 0; ``log=True`` keeps its log). Quadratic in L: for analysis, not a forward pass.

  ``log_gate`` and ``segment_ids``: every weight
  (exact or the kernel's) gets the bias of :func:`softmax_attention` (Σ_{j<l≤t} log f_l; −∞ across
  segments); a bad log gate counts as a non-finite key.

  Args:
    query: queries, shape [..., Lq, H, D].
    key: keys, shape [..., Lk, H, D].
    projection: ω, [M, D] or [H, M, D]; None for ``"softmax"`` or a kernel that takes none.
    kernel: ``"softmax"``, a name in ``KERNELS`` or a :class:`~favor_jax.core.kernels.Kernel` record, or a callable
      (as in :func:`favor_attention`).
    causal: whether query t sees only keys j ≤ t (needs Lq = Lk).
    key_mask: optional bool [..., Lk]; False leaves a key out (weight 0, whatever it holds).
    window: W ≥ 0, the exact window of :func:`hybrid_attention` (0: none; needs Lq = Lk).
    rho: a data-dependent kernel's statistic, as in :func:`favor_attention`.
    query_mask: optional bool [..., Lq], the queries a data-dependent kernel's statistic averages over.
    log: return log A, normalised in log domain (−inf where A is 0), for weights that are never negative
      (a kernel whose record says ``positive_weights``; a row with a negative weight is NaN).
    log_gate: optional float [..., L, H], the log of a forget gate per position and head, causal
      only, as in :func:`~favor_jax.core.favor_attention`.
    segment_ids: optional int [..., L], packed documents, as in :func:`~favor_jax.core.favor_attention`.
    precision: the precision of every dot product of the call, as in :func:`~favor_jax.core.favor_attention`.

  Returns:
    A (or log A), float32, shape [..., H, Lq, Lk].

  Raises:
    TypeError: if ``causal`` or ``log`` is not a bool, an input is not a floating array or a mask not bool.
    ValueError: if shapes disagree, a length is 0, ``causal`` or ``window`` with Lq ≠ Lk, ``window`` is not
      an int ≥ 0, ``kernel="softmax"`` gets a projection or ``rho``, or as :func:`favor_attention` raises
      for the kernel, ``rho`` and ``precision``.
  """
  checks.check_bool("causal", causal)
  checks.check_bool("log", log)
  checks.check_qk(query, key)
  checks.check_lengths(query, key)
  checks.check_key_mask(key_mask, key.shape)
  checks.check_key_mask(query_mask, query.shape, "query_mask")
  window = checks.check_window(window)
  if causal or window or segment_ids is not None:
    checks.check_causal_lengths(query, key, "causal attention" if causal else (
        "a window (positions t − j)" if window else "segment_ids (positions)"))
  gates = gates_lib.prepare(log_gate, segment_ids, query, causal)
  batch = query.shape[:-3]
  mask = inputs.mask_NL(key_mask, key)
  q, k = (inputs.flatten(x, batch).astype(jnp.float32) for x in (query, key))
  # The rule of every attention function: non-finite inputs (and, for a kernel, rows beyond its range) out,
  # masked keys zeroed whatever they hold, NaN in the rows that depend on one (bad [N, Lq, H]); the weights
  # have no value, so an empty one.
  softmax = isinstance(kernel, str) and kernel == "softmax"
  q, k, _, bad, _ = inputs.split_nonfinite(q, k, jnp.zeros(k.shape[:-1] + (0,), k.dtype), mask, causal=causal,
                                           in_range=not softmax, gates=gates)
  lq, lk = q.shape[1], k.shape[1]
  gap = jnp.arange(lq)[:, None] - jnp.arange(lk)[None, :]
  allowed = mask[:, None, None, :] & ((gap >= 0) if causal else True)  # [N, 1, Lq, Lk]
  exact = jnp.einsum("nqhd,nkhd->nhqk", q, k) / math.sqrt(query.shape[-1])
  if softmax:
    if rho is not None or projection is not None:
      raise ValueError("kernel='softmax' takes no projection and no rho")
    log_w, sign = exact, jnp.ones_like(exact)
  else:
    features = features_lib.for_call(kernel, projection, rho, query, key, key_mask, causal, blocked=True,
                                     query_mask=query_mask)
    log_pairs = getattr(kernels_lib.get_kernel(kernel), "log_pairs", None)  # a closed form, where the sum cancels
    if log_pairs is not None:
      log_w = log_pairs(q, k, projection)
      sign = jnp.ones_like(log_w)
    else:
      log_w, sign = _kernel_log_weights(*features.fn(q, k))
    if window:
      near = (jnp.abs(gap) < window) & ((gap >= 0) if causal else True)
      log_w, sign = jnp.where(near, exact, log_w), jnp.where(near, 1.0, sign)
  log_w = jnp.where(allowed, gates_lib.biased(log_w, gates, causal), -jnp.inf)
  if log:
    total = jax.nn.logsumexp(log_w, axis=-1, keepdims=True)
    out = jnp.where(jnp.isfinite(total), log_w - state_lib.finite_or_zero(total), -jnp.inf)
    out = jnp.where(jnp.any(allowed & (sign < 0), axis=-1, keepdims=True), jnp.nan, out)
  else:
    peak = jax.lax.stop_gradient(jnp.max(log_w, axis=-1, keepdims=True))
    w = sign * jnp.exp(log_w - state_lib.finite_or_zero(peak))
    out = state_lib.divide(w, jnp.sum(w, axis=-1))
  out = inputs.poison(out, jnp.swapaxes(bad, 1, 2))  # rows [N, H, Lq]
  return out.reshape(batch + out.shape[1:])
