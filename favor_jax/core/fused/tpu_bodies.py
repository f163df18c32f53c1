"""The Mosaic kernels' bodies for :mod:`favor_jax.core.fused.tpu` (its docstring: what each computes, the shape
letters), and the record of one call's static choices they read; the grid, the blocks and the custom VJP's
program are there."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = -jnp.inf


class Config(NamedTuple):
  """Static choices of one call: chunk rows C, Mosaic (``interpret`` False) or an interpreter (True: Pallas's
  generic one; ``pltpu.InterpretParams``: its TPU interpret mode), the dots' precision and
  operand dtype ("bfloat16" for products of features and values when every input is bfloat16 and the
  precision is the default), whether gates are given, and whether the kernels compute the features from q,
  k and the projection (``feature_map``, see :func:`feature_map`) or read them."""
  chunk: int
  interpret: Any
  precision: Any
  operands: str
  gated: bool
  feature_map: str | None = None  # the kernel record's ``fused_map``: features computed on chip; None: read
  half_sq: float = 0.0  # c = d^{-1/2}/2 of the on-chip features' −c‖x‖²


def finite_offset(x):
  """−∞ → 0: an offset that multiplies only zeros (no key yet)."""
  return jnp.where(x == NEG_INF, 0.0, x)


def _dot(a, b, dims: str, cfg: Config, state: bool = False):
  """a·b ("nn"), a·bᵀ ("nt") or aᵀ·b ("tn"), accumulated in float32 at ``cfg.precision``. Products with a
  state (large dynamic range) take float32 operands; the others bfloat16 ones where ``cfg.operands`` says so."""
  contract = {"nn": ((1,), (0,)), "nt": ((1,), (1,)), "tn": ((0,), (0,))}[dims]
  dtype = jnp.float32 if state or cfg.operands == "float32" else jnp.bfloat16
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (contract, ((), ())), precision=cfg.precision,
                             preferred_element_type=jnp.float32)


def _iota(c, axis):
  return jax.lax.broadcasted_iota(jnp.int32, (c, c), axis)


def suffix_sums(x):
  """Σ_{l ≥ j} x[t, l] for every (t, j) of x [C, C]: a log-depth (Hillis–Steele) scan along the lanes, log2 C
  steps of a lane rotation and an add on the VPU. With terms of one sign (here ≤ 0, −∞ allowed) every
  partial sum is a sum of such terms: relative error ≤ log2(C)·ε, no cancellation, and a −∞ term gives −∞
  (never ∞ − ∞)."""
  c = x.shape[1]
  lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  step = 1
  while step < c:
    x = x + jnp.where(lane + step < c, pltpu.roll(x, c - step, 1), 0.0)  # x[t, l + step], 0 past the end
    step *= 2
  return x


def _decays(g_ref, c):
  """The gates of one chunk, g [1, C] (≤ 0, −∞ at a reset), as (a [C, 1], b [C, 1], total [1, 1], e^D [C, C]):
  a_t = Σ_{start≤l≤t} g_l, b_j = Σ_{j<l≤end} g_l, total = Σ_{start≤l≤end} g_l, D_tj = Σ_{j<l≤t} g_l (and
  e^D = 0 for j > t). Sums of terms ≤ 0 (never differences of running sums: no cancellation), −∞ where a
  reset is among the terms; D by a log-depth scan on the VPU (:func:`suffix_sums`, O(C² log C) additions,
  no [C, C] × [C, C] product): row t holds g_{l+1} for l + 1 ≤ t, summed from lane j on."""
  t, l = _iota(c, 0), _iota(c, 1)
  if g_ref is None:
    return 0.0, 0.0, 0.0, jnp.where(l <= t, 1.0, 0.0)
  g = g_ref[...]
  reset = jnp.where(g == NEG_INF, 1.0, 0.0)
  fin = jnp.where(g == NEG_INF, 0.0, g)

  def summed(keep):  # Σ_l g_l over keep [C, C] (rows × positions l), −∞ with a reset among them
    s = jnp.sum(jnp.where(keep, fin, 0.0), axis=1, keepdims=True)
    return jnp.where(jnp.sum(jnp.where(keep, reset, 0.0), axis=1, keepdims=True) > 0, NEG_INF, s)

  total = jnp.where(jnp.sum(reset, axis=1, keepdims=True) > 0, NEG_INF, jnp.sum(fin, axis=1, keepdims=True))
  lane = jax.lax.broadcasted_iota(jnp.int32, g.shape, 1)
  g_next = jnp.where(lane + 1 < c, pltpu.roll(g, c - 1, 1), 0.0)  # g_{l+1} at lane l
  d = suffix_sums(jnp.where(l + 1 <= t, g_next, 0.0))
  decay = jnp.where(l <= t, jnp.exp(jnp.minimum(d, 0.0)), 0.0)
  return summed(l <= t), summed(l > t), total, decay


def _start(*scratch):
  """At a row's first chunk: the empty state (μ = −∞, S = 0, z = 0)."""
  @pl.when(pl.program_id(1) == 0)
  def _():
    mu, *rest = scratch
    mu[...] = jnp.full(mu.shape, NEG_INF, jnp.float32)
    for x in rest:
      x[...] = jnp.zeros(x.shape, jnp.float32)


def _absorb(mu_ref, st_ref, z_ref, logs, x, w, total, cfg):
  """The state recurrence's step: decay (μ, Sᵀ, z) by ``total``, add rows with log weights ``logs`` [C, F],
  vectors x [C, Dv] (into Sᵀ [Dv, F]) and scalars w [C, 1] (into z [1, F], a sublane reduction: the
  denominator's state, no column of ones in the values), rescaled to the new maximum
  μ' = max(μ + total, max_rows logs)."""
  mu = mu_ref[...] + total
  new = jnp.maximum(mu, jnp.max(logs, axis=0, keepdims=True))
  safe = finite_offset(new)
  e = jnp.exp(logs - safe)
  keep = jnp.exp(mu - safe)
  st_ref[...] = st_ref[...] * keep + _dot(x, e, "tn", cfg)
  z_ref[...] = z_ref[...] * keep + (jnp.sum(e, axis=0, keepdims=True) if w is None else
                                    jnp.sum(w * e, axis=0, keepdims=True))
  mu_ref[...] = new


def _log_features(x, p, fb, cfg):
  """Log features [C, F] of rows x [C, D] (their dtype) computed on chip: x pᵀ − c‖x‖² + fb, p [F, D] the
  projection already scaled by d^{-1/4} (and, hyperbolic, stacked with its negative), c = d^{-1/2}/2, fb
  [1, F] the log-normaliser (−∞ for padded features). Float32 operands at the call's precision (on a TPU
  the default is one bfloat16 pass, as XLA's own product of the projection there)."""
  xf = x.astype(jnp.float32)
  return _dot(xf, p, "nt", cfg, state=True) - cfg.half_sq * jnp.sum(xf * xf, axis=1, keepdims=True) + fb


def chunk_terms(lq_ref, lk_ref, v_ref, refs, cfg):
  """One chunk's log features (read, or computed from q, k and the projection where ``cfg.feature_map``), its
  values, the gates' decays and λ [1, F], and (feature map) the context of the features' backward (q, k in
  float32, the projection); ``refs`` starts with the projection's, the normaliser's and the key bias's refs
  (feature map), then the gate's ref if gated."""
  ctx = None
  if cfg.feature_map:
    p_ref, fb_ref, kb_ref, *refs = refs
    p, fb = p_ref[...], fb_ref[...]
    q, k = lq_ref[...], lk_ref[...]
    lq, lk = _log_features(q, p, fb, cfg), _log_features(k, p, fb, cfg) + kb_ref[...]
    ctx = (q.astype(jnp.float32), k.astype(jnp.float32), p)
  else:
    lq, lk = lq_ref[...], lk_ref[...]
  g_ref, refs = (refs[0], refs[1:]) if cfg.gated else (None, refs)
  return (lq, lk, v_ref[...]) + _decays(g_ref, lk.shape[0]) + (jnp.max(lk, axis=0, keepdims=True),), ctx, refs


def _features_grad(dl, x, p, dx_ref, dp_ref, sum_ref, cfg):
  """From ∂ℓ [C, F] of the rows' log features: ∂x [C, D] = ∂ℓ p − 2c (Σ_f ∂ℓ_f) x into ``dx_ref``, the
  projection's ∂p [F, D] += ∂ℓᵀ x accumulated over the row's chunks in ``dp_ref`` (resident: its block does
  not move along the chunk axis), and Σ_f ∂ℓ_f [C, 1] into ``sum_ref`` (gated: the gates' gradient)."""
  total = jnp.sum(dl, axis=1, keepdims=True)
  dx_ref[...] = (_dot(dl, p, "nn", cfg, state=True) - 2.0 * cfg.half_sq * total * x).astype(dx_ref.dtype)

  @pl.when(pl.program_id(1) == 0)
  def _():
    dp_ref[...] = jnp.zeros(dp_ref.shape, jnp.float32)

  dp_ref[...] += _dot(dl, x, "tn", cfg, state=True)
  if sum_ref is not None:
    sum_ref[...] = total


def forward_body(lq_ref, lk_ref, v_ref, *refs, cfg):
  """num [C, Dv] and den [C, 1] (times e^{−m}) and m [C, 1] (−∞ where no key is in reach)."""
  (lq, lk, v, a, b, total, decay, lam), _, refs = chunk_terms(lq_ref, lk_ref, v_ref, refs, cfg)
  num_ref, den_ref, m_ref, mu_ref, st_ref, z_ref = refs
  _start(mu_ref, st_ref, z_ref)
  read = mu_ref[...] + a
  m = jnp.max(lq + jnp.maximum(lam, read), axis=1, keepdims=True)
  ms = finite_offset(m)
  w = _dot(jnp.exp(lq + lam - ms), jnp.exp(lk - finite_offset(lam)), "nt", cfg) * decay
  eq = jnp.exp(lq + read - ms)
  num_ref[...] = _dot(eq, st_ref[...], "nt", cfg, state=True) + _dot(w, v, "nn", cfg)
  den_ref[...] = jnp.sum(eq * z_ref[...], axis=1, keepdims=True) + jnp.sum(w, axis=1, keepdims=True)
  m_ref[...] = m
  _absorb(mu_ref, st_ref, z_ref, lk + b, v, None, total, cfg)


def dq_body(lq_ref, lk_ref, v_ref, *refs, cfg):
  """∂ℓq [C, F] (or, feature map: ∂q, ∂p, Σ_f ∂ℓq) from ∂num [C, Dv], ∂den [C, 1] and the row scales
  m [C, 1] (+∞ for rows without terms)."""
  (lq, lk, v, a, b, total, decay, lam), ctx, refs = chunk_terms(lq_ref, lk_ref, v_ref, refs, cfg)
  m_ref, dnum_ref, dden_ref, *refs = refs
  outs, (mu_ref, st_ref, z_ref) = refs[:-3], refs[-3:]
  _start(mu_ref, st_ref, z_ref)
  ms, dnum, dden = m_ref[...], dnum_ref[...], dden_ref[...]
  g = (_dot(dnum, v, "nt", cfg) + dden) * decay  # ∂/∂(row t's weight of key j)
  from_state = jnp.exp(lq + mu_ref[...] + a - ms) * (_dot(dnum, st_ref[...], "nn", cfg, state=True)
                                                     + dden * z_ref[...])
  dlq = from_state + jnp.exp(lq + lam - ms) * _dot(g, jnp.exp(lk - finite_offset(lam)), "nn", cfg)
  if ctx is None:
    outs[0][...] = dlq
  else:
    _features_grad(dlq, ctx[0], ctx[2], outs[0], outs[1], outs[2] if cfg.gated else None, cfg)
  _absorb(mu_ref, st_ref, z_ref, lk + b, v, None, total, cfg)


def dk_body(lq_ref, lk_ref, v_ref, *refs, cfg):
  """∂ℓk [C, F] (or, feature map: ∂k, ∂p, Σ_f ∂ℓk) and ∂v [C, Dv] (chunks in reverse), the suffix state
  (ν [1, F], Rᵀ [Dv, F] of ∂num, r [1, F] of ∂den) in scratch."""
  (lq, lk, v, a, b, total, decay, lam), ctx, refs = chunk_terms(lq_ref, lk_ref, v_ref, refs, cfg)
  m_ref, dnum_ref, dden_ref, *refs = refs
  outs, (nu_ref, rt_ref, r_ref) = refs[:-3], refs[-3:]
  _start(nu_ref, rt_ref, r_ref)
  ms, dnum, dden, rt = m_ref[...], dnum_ref[...], dden_ref[...], rt_ref[...]
  q_chunk, k_chunk = jnp.exp(lq + lam - ms), jnp.exp(lk - finite_offset(lam))
  g = (_dot(dnum, v, "nt", cfg) + dden) * decay
  w = _dot(q_chunk, k_chunk, "nt", cfg) * decay
  k_later = jnp.exp(lk + b + nu_ref[...])  # ≤ 1: ν ≤ −(ℓk + b) for keys the later rows see
  dlk = k_chunk * _dot(g, q_chunk, "tn", cfg) + k_later * (_dot(v, rt, "nn", cfg, state=True) + r_ref[...])
  dv_ref = outs[-1]
  dv_ref[...] = _dot(w, dnum, "tn", cfg) + _dot(k_later, rt, "nt", cfg, state=True)
  if ctx is None:
    outs[0][...] = dlk
  else:
    _features_grad(dlk, ctx[1], ctx[2], outs[0], outs[1], outs[2] if cfg.gated else None, cfg)
  _absorb(nu_ref, rt_ref, r_ref, lq - ms + a, dnum, dden, total, cfg)
