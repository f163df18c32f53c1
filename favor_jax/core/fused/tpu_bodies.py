"""The Mosaic kernels' bodies for :mod:`favor_jax.core.fused.tpu` (its docstring: what each computes, the shape
letters), and the record of one call's static choices they read; the grid, the blocks and the custom VJP's
program are there."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from favor_jax.core.fused import rows as fused_rows
from favor_jax.core.fused.rows import PER_ROW_MAPS, SCALED_MAPS
from favor_jax.core.state import SAFE_GAP

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
  x_scale: float = 1.0  # d^{-1/4}: the on-chip features scale q and k first, as XLA's (``statistics.scaled``)
  project: bool = True  # the backward gives the projection's gradient (on chip; False: nothing differentiates it)


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


def _operand(x, cfg):
  """x as this call's products see their operands (:func:`favor_jax.core.fused.rows.as_operand`)."""
  return fused_rows.as_operand(x, cfg.operands)


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
  """The gates of one chunk, g [1, C] (≤ 0, −∞ at a reset), as (a [C, 1], b [C, 1], total [1, 1], e^D [C, C],
  D [C, C]):
  a_t = Σ_{start≤l≤t} g_l, b_j = Σ_{j<l≤end} g_l, total = Σ_{start≤l≤end} g_l, D_tj = Σ_{j<l≤t} g_l (and
  e^D = 0 for j > t). Sums of terms ≤ 0 (never differences of running sums: no cancellation), −∞ where a
  reset is among the terms; D by a log-depth scan on the VPU (:func:`suffix_sums`, O(C² log C) additions,
  no [C, C] × [C, C] product): row t holds g_{l+1} for l + 1 ≤ t, summed from lane j on."""
  t, l = _iota(c, 0), _iota(c, 1)
  if g_ref is None:
    return 0.0, 0.0, 0.0, jnp.where(l <= t, 1.0, 0.0), jnp.where(l <= t, 0.0, NEG_INF)
  g = g_ref[...]
  reset = jnp.where(g == NEG_INF, 1.0, 0.0)
  fin = jnp.where(g == NEG_INF, 0.0, g)

  def summed(keep):  # Σ_l g_l over keep [C, C] (rows × positions l), −∞ with a reset among them
    s = jnp.sum(jnp.where(keep, fin, 0.0), axis=1, keepdims=True)
    return jnp.where(jnp.sum(jnp.where(keep, reset, 0.0), axis=1, keepdims=True) > 0, NEG_INF, s)

  total = jnp.where(jnp.sum(reset, axis=1, keepdims=True) > 0, NEG_INF, jnp.sum(fin, axis=1, keepdims=True))
  lane = jax.lax.broadcasted_iota(jnp.int32, g.shape, 1)
  g_next = jnp.where(lane + 1 < c, pltpu.roll(g, c - 1, 1), 0.0)  # g_{l+1} at lane l
  d = jnp.where(l <= t, jnp.minimum(suffix_sums(jnp.where(l + 1 <= t, g_next, 0.0)), 0.0), NEG_INF)
  return summed(l <= t), summed(l > t), total, jnp.exp(d), d


def _start(first, *scratch):
  """At a row's first chunk (``first``): the empty state (μ = −∞, S = 0, z = 0)."""
  @pl.when(first)
  def _():
    mu, *rest = scratch
    mu[...] = jnp.full(mu.shape, NEG_INF, jnp.float32)
    for x in rest:
      x[...] = jnp.zeros(x.shape, jnp.float32)


def _absorb(mu_ref, st_ref, z_ref, logs, x, w, total, cfg):
  """The state recurrence's step: decay (μ, Sᵀ, z) by ``total``, add rows with log weights ``logs`` [C, F],
  vectors x [C, Dv] (into Sᵀ [Dv, F]) and scalars w [C, 1] (into z [1, F], a sublane reduction: the
  denominator's state, no column of ones in the values), rescaled to the new maximum
  μ' = max(μ + total, max_rows logs). Values (w None): Sᵀ and z sum the same weights, rounded as the product's
  operands (:func:`_operand`); cotangents (w = ∂den, from float32 ∂num outside): float32 operands, so that
  Rᵀ and r stay consistent with each other."""
  mu = mu_ref[...] + total
  new = jnp.maximum(mu, jnp.max(logs, axis=0, keepdims=True))
  safe = finite_offset(new)
  e = jnp.exp(logs - safe)
  e = e if w is not None else _operand(e, cfg)
  keep = jnp.exp(mu - safe)
  st_ref[...] = st_ref[...] * keep + _dot(x, e, "tn", cfg, state=w is not None)
  z_ref[...] = z_ref[...] * keep + (jnp.sum(e, axis=0, keepdims=True) if w is None else
                                    jnp.sum(w * e, axis=0, keepdims=True))
  mu_ref[...] = new


def _log_features(xs, p, fb, cfg):
  """Log features [C, F] computed on chip from rows xs [C, D] already scaled (float32 x·d^{-1/4}, the order of
  XLA's features: scaling the projection instead made outputs at ×20 twenty times less accurate against
  float64): xs pᵀ − ‖xs‖²/2 + fb, p [F, D] the projection (hyperbolic: stacked with its negative), fb [1, F]
  the log-normaliser (−∞ for padded features). Float32 operands at the call's precision (on a TPU the default
  is one bfloat16 pass, as XLA's own product of the projection there)."""
  return _dot(xs, p, "nt", cfg, state=True) - 0.5 * jnp.sum(xs * xs, axis=1, keepdims=True) + fb


def chunk_terms(lq_ref, lk_ref, v_ref, refs, cfg):
  """One chunk's log features (read, or computed from q, k and the projection where ``cfg.feature_map``), its
  values, the gates' decays (:func:`_decays`) and λ [1, F], and (feature map) the context of the features'
  backward (q, k in float32 times their scales, the projection, the scales); ``refs`` starts with the
  projection's, the normaliser's and the key bias's refs (feature map), then the row's scales of q and of k
  [1, D] (maps of ``SCALED_MAPS``: d^{-1/4}·Ψ and d^{-1/4}/Ψ; otherwise d^{-1/4} for both), then the gate's ref
  if gated."""
  ctx = None
  if cfg.feature_map:
    p_ref, fb_ref, kb_ref, *refs = refs
    uq = uk = cfg.x_scale
    if cfg.feature_map in SCALED_MAPS:
      uq_ref, uk_ref, *refs = refs
      uq, uk = uq_ref[...], uk_ref[...]
    p, fb = p_ref[...], fb_ref[...]
    qs, ks = lq_ref[...].astype(jnp.float32) * uq, lk_ref[...].astype(jnp.float32) * uk
    lq, lk = _log_features(qs, p, fb, cfg), _log_features(ks, p, fb, cfg) + kb_ref[...]
    ctx = (qs, ks, p, uq, uk)
  else:
    lq, lk = lq_ref[...], lk_ref[...]
  g_ref, refs = (refs[0], refs[1:]) if cfg.gated else (None, refs)
  return (lq, lk, v_ref[...]) + _decays(g_ref, lk.shape[0]) + (jnp.max(lk, axis=0, keepdims=True),), ctx, refs


def _features_grad(dl, xs, u, p, outs, cfg, first):
  """From ∂ℓ [C, F] of the log features of rows xs = u·x (u: d^{-1/4}, or the row's scale [1, D] of
  :func:`chunk_terms`; :func:`_log_features`), into ``outs`` in order: ∂x [C, D] = u (∂ℓ p − (Σ_f ∂ℓ_f) xs); the
  projection's ∂p [F, D] += ∂ℓᵀ xs accumulated over the
  row's chunks (resident: its block does not move along the chunk axis; zeroed at the row's ``first`` chunk); a
  per-row normaliser's ∂fb [1, F] += Σ_t ∂ℓ_t the same way (maps of ``PER_ROW_MAPS``); Σ_f ∂ℓ_f [C, 1] (gated:
  the gates' gradient); neither ∂p nor ∂fb where ``cfg.project`` is False."""
  dx_ref, *rest = outs
  dp_ref = rest.pop(0) if cfg.project else None
  db_ref = rest.pop(0) if cfg.project and cfg.feature_map in PER_ROW_MAPS else None
  total = jnp.sum(dl, axis=1, keepdims=True)
  dx_ref[...] = (u * (_dot(dl, p, "nn", cfg, state=True) - total * xs)).astype(dx_ref.dtype)
  if cfg.gated:
    rest[0][...] = total
  if dp_ref is None:
    return

  @pl.when(first)
  def _():
    dp_ref[...] = jnp.zeros(dp_ref.shape, jnp.float32)
    if db_ref is not None:
      db_ref[...] = jnp.zeros(db_ref.shape, jnp.float32)

  dp_ref[...] += _dot(dl, xs, "tn", cfg, state=True)
  if db_ref is not None:
    db_ref[...] += jnp.sum(dl, axis=0, keepdims=True)


def _row(x, t):
  """Row t of x [C, W] as [1, W] (a masked maximum: no dynamic index on the sublane axis)."""
  return jnp.max(jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) == t, x, NEG_INF), axis=0, keepdims=True)


def _put(x, t, row):
  """x [C, W] with row t replaced by ``row`` [1, W]."""
  return jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) == t, row, x)


def _exact_row(t, lq, lk, log_decay_t, m=None, read=None):
  """Row t's own terms in its chunk, at a key scale from the keys it sees: (P [C, F], m_t [1, 1]) with
  P_jf = e^{ℓq_tf + ℓk_jf + D_tj − m_t} = e^{ℓq_tf + λ_tf − m_t} · e^{ℓk_jf + D_tj − λ_tf}, λ_tf =
  max_{j ≤ t} (ℓk_jf + D_tj) (0 for j > t). m_t: given (the backward's row scale), or the exact scale
  max_f ℓq_tf + max(λ_tf, read_tf) (``read`` [1, F]: the carried state's scale at row t). Both factors are
  ≤ 1 and row t's largest term is 1: nothing overflows, and a term is lost only below e^{−87} of it.
  ``log_decay_t``: Dᵀ [C, C] (row j, lane t)."""
  lq_t = _row(lq, t)
  d_t = jnp.max(jnp.where(jax.lax.broadcasted_iota(jnp.int32, log_decay_t.shape, 1) == t, log_decay_t, NEG_INF),
                axis=1, keepdims=True)  # [C, 1]: D_tj along j, −∞ for j > t
  keys = lk + d_t
  lam_t = jnp.max(keys, axis=0, keepdims=True)
  if m is None:
    m = jnp.max(lq_t + jnp.maximum(lam_t, read), axis=1, keepdims=True)
  return jnp.exp(keys - finite_offset(lam_t)) * jnp.exp(lq_t + lam_t - finite_offset(m)), m


def _each_lost_row(lost, fix, carry):
  """``carry`` after ``fix(t, carry)`` for every row t flagged in ``lost`` [C, 1] (1.0: lost), in order."""
  def step(t, carry):
    flag = jnp.max(jnp.where(jax.lax.broadcasted_iota(jnp.int32, lost.shape, 0) == t, lost, 0.0)) > 0
    return jax.lax.cond(flag, lambda c: fix(t, c), lambda c: c, carry)
  return jax.lax.fori_loop(0, lost.shape[0], step, carry)


def _when_lost(lost, log_decay, fix, carry):
  """``carry`` after ``fix(t, carry, Dᵀ)`` for every row t flagged in ``lost`` (:func:`_each_lost_row`); the
  transpose and the loop only in a chunk with such a row."""
  def redo(carry):
    log_decay_t = log_decay.T
    return _each_lost_row(lost, lambda t, c: fix(t, c, log_decay_t), carry)
  return jax.lax.cond(jnp.max(lost) > 0, redo, lambda c: c, carry)


def _lost_in_chunk(lq, lam, ms):
  """Rows [C, 1] (1.0: lost) whose row scale ms [C, 1] (the forward's, exact for a row it recomputed) lies more
  than SAFE_GAP/2 below their in-chunk one-product scale max_f (ℓq_tf + λ_f): the rows the forward recomputed
  (their gap is over SAFE_GAP, every other row's is ≤ 0), whose one-product factor e^{ℓq + λ − m} may overflow."""
  return jnp.where(jnp.max(lq + lam, axis=1, keepdims=True) - ms > 0.5 * SAFE_GAP, 1.0, 0.0)


def _row_grad_terms(t, lq, lk, v, log_decay_t, ms, dnum, dden):
  """Row t's exact terms P [C, F] (:func:`_exact_row` at its scale ms_t) and ∂/∂(its weight of key j) [C, 1]."""
  p, _ = _exact_row(t, lq, lk, log_decay_t, m=_row(ms, t))
  return p, jnp.sum(v.astype(jnp.float32) * _row(dnum, t), axis=1, keepdims=True) + _row(dden, t)


def forward_body(lq_ref, lk_ref, v_ref, *refs, cfg, first):
  """num [C, Dv] and den [C, 1] (times e^{−m}), m [C, 1] (−∞ where no key is in reach) and the number of rows
  recomputed [1, 1]: a row whose denominator fell below e^{−SAFE_GAP} (a later key of its chunk raised the
  one-product scale above its own terms) is computed again alone at its exact scale (:func:`_exact_row`)."""
  (lq, lk, v, a, b, total, decay, log_decay, lam), _, refs = chunk_terms(lq_ref, lk_ref, v_ref, refs, cfg)
  num_ref, den_ref, m_ref, count_ref, mu_ref, st_ref, z_ref = refs
  _start(first, mu_ref, st_ref, z_ref)
  read = mu_ref[...] + a
  m = jnp.max(lq + jnp.maximum(lam, read), axis=1, keepdims=True)
  ms = finite_offset(m)
  w = _operand(_dot(jnp.exp(lq + lam - ms), jnp.exp(lk - finite_offset(lam)), "nt", cfg) * decay, cfg)
  eq = jnp.exp(lq + read - ms)
  num_ref[...] = _dot(eq, st_ref[...], "nt", cfg, state=True) + _dot(w, v, "nn", cfg)
  den = jnp.sum(eq * z_ref[...], axis=1, keepdims=True) + jnp.sum(w, axis=1, keepdims=True)
  den_ref[...], m_ref[...] = den, m
  lost = jnp.where(fused_rows.lost_rows(den, m), 1.0, 0.0)
  count_ref[...] = jnp.zeros(count_ref.shape, jnp.float32)

  @pl.when(jnp.max(lost) > 0)
  def _():
    log_decay_t, vf = log_decay.T, v.astype(jnp.float32)

    def fix(t, carry):  # row t's own terms at its exact scale; the carried state's part below, for all at once
      num_in, den_in, m_new = carry
      p, m_t = _exact_row(t, lq, lk, log_decay_t, read=mu_ref[...] + (_row(a, t) if cfg.gated else a))
      w_t = jnp.sum(p, axis=1, keepdims=True)  # [C, 1]: row t's weight of key j
      return (_put(num_in, t, jnp.sum(w_t * vf, axis=0, keepdims=True)),
              _put(den_in, t, jnp.sum(w_t, axis=0, keepdims=True)), _put(m_new, t, m_t))

    num_in, den_in, m_new = _each_lost_row(lost, fix, (jnp.zeros(num_ref.shape, jnp.float32), jnp.zeros_like(den), m))
    eq = jnp.exp(lq + read - finite_offset(m_new))
    redone = lost > 0
    num_ref[...] = jnp.where(redone, _dot(eq, st_ref[...], "nt", cfg, state=True) + num_in, num_ref[...])
    den_ref[...] = jnp.where(redone, jnp.sum(eq * z_ref[...], axis=1, keepdims=True) + den_in, den)
    m_ref[...] = m_new
    count_ref[...] = jnp.sum(jnp.where(redone & (m_new > NEG_INF), 1.0, 0.0), axis=0, keepdims=True)

  _absorb(mu_ref, st_ref, z_ref, lk + b, v, None, total, cfg)


def dq_body(lq_ref, lk_ref, v_ref, *refs, cfg, first):
  """∂ℓq [C, F] (or, feature map: ∂q, ∂p, Σ_f ∂ℓq) from ∂num [C, Dv], ∂den [C, 1] and the row scales
  m [C, 1] (+∞ for rows without terms); a row the forward recomputed, its own terms again alone."""
  (lq, lk, v, a, b, total, decay, log_decay, lam), ctx, refs = chunk_terms(lq_ref, lk_ref, v_ref, refs, cfg)
  m_ref, dnum_ref, dden_ref, *refs = refs
  outs, (mu_ref, st_ref, z_ref) = refs[:-3], refs[-3:]
  _start(first, mu_ref, st_ref, z_ref)
  ms, dnum, dden = m_ref[...], dnum_ref[...], dden_ref[...]
  g = (_dot(dnum, v, "nt", cfg, state=True) + dden) * decay  # ∂/∂(row t's weight of key j); ∂num float32 as ∂den
  from_state = jnp.exp(lq + mu_ref[...] + a - ms) * (_dot(dnum, st_ref[...], "nn", cfg, state=True)
                                                     + dden * z_ref[...])
  lost = _lost_in_chunk(lq, lam, ms)
  q_chunk = jnp.where(lost > 0, 0.0, jnp.exp(lq + lam - ms))
  dlq = from_state + q_chunk * _dot(g, jnp.exp(lk - finite_offset(lam)), "nn", cfg)

  def fix(t, dlq, log_decay_t):
    p, g_t = _row_grad_terms(t, lq, lk, v, log_decay_t, ms, dnum, dden)
    return _put(dlq, t, _row(dlq, t) + jnp.sum(p * g_t, axis=0, keepdims=True))

  dlq = _when_lost(lost, log_decay, fix, dlq)
  if ctx is None:
    outs[0][...] = dlq
  else:
    _features_grad(dlq, ctx[0], ctx[3], ctx[2], outs, cfg, first)
  _absorb(mu_ref, st_ref, z_ref, lk + b, v, None, total, cfg)


def dk_body(lq_ref, lk_ref, v_ref, *refs, cfg, first):
  """∂ℓk [C, F] (or, feature map: ∂k, ∂p, Σ_f ∂ℓk) and ∂v [C, Dv] (chunks in reverse), the suffix state
  (ν [1, F], Rᵀ [Dv, F] of ∂num, r [1, F] of ∂den) in scratch; a row the forward recomputed adds its terms
  alone."""
  (lq, lk, v, a, b, total, decay, log_decay, lam), ctx, refs = chunk_terms(lq_ref, lk_ref, v_ref, refs, cfg)
  m_ref, dnum_ref, dden_ref, *refs = refs
  outs, (nu_ref, rt_ref, r_ref) = refs[:-3], refs[-3:]
  _start(first, nu_ref, rt_ref, r_ref)
  ms, dnum, dden, rt = m_ref[...], dnum_ref[...], dden_ref[...], rt_ref[...]
  lost = _lost_in_chunk(lq, lam, ms)
  q_chunk, k_chunk = jnp.where(lost > 0, 0.0, jnp.exp(lq + lam - ms)), jnp.exp(lk - finite_offset(lam))
  g = (_dot(dnum, v, "nt", cfg, state=True) + dden) * decay
  w = _dot(q_chunk, k_chunk, "nt", cfg) * decay
  k_later = jnp.exp(lk + b + nu_ref[...])  # ≤ 1: ν ≤ −(ℓk + b) for keys the later rows see
  dlk = k_chunk * _dot(g, q_chunk, "tn", cfg) + k_later * (_dot(v, rt, "nn", cfg, state=True) + r_ref[...])
  dv = _dot(w, dnum, "tn", cfg) + _dot(k_later, rt, "nt", cfg, state=True)

  def fix(t, carry, log_decay_t):
    p, g_t = _row_grad_terms(t, lq, lk, v, log_decay_t, ms, dnum, dden)
    return carry[0] + p * g_t, carry[1] + jnp.sum(p, axis=1, keepdims=True) * _row(dnum, t)

  dlk, dv = _when_lost(lost, log_decay, fix, (dlk, dv))
  outs[-1][...] = dv
  if ctx is None:
    outs[0][...] = dlk
  else:
    _features_grad(dlk, ctx[1], ctx[4], ctx[2], outs[:-1], cfg, first)
  _absorb(nu_ref, rt_ref, r_ref, lq - ms + a, dnum, dden, total, cfg)


CHUNK_KINDS, STEP_KINDS = ("f", "e", "1", "x"), ("g", "k")  # blocks of rows; one entry per chunk (tpu._call)


def stepped(body, kinds, chunks: int, reverse: bool, cfg: Config):
  """``body`` over a grid step of ``chunks`` chunks, walked in turn (in reverse where ``reverse``) on views of
  one chunk each: refs of ``kinds`` "f", "e", "1", "x" hold the step's chunks × C rows, "g" and "k" one row per
  chunk; the others (per row, scratch) are whole. ``first``: the row's first chunk (the grid's first step, its
  first chunk walked)."""
  c = cfg.chunk
  if chunks == 1:
    return lambda *refs: body(*refs, cfg=cfg, first=pl.program_id(1) == 0)

  def view(ref, kind, j):
    if kind in CHUNK_KINDS:
      return ref.at[pl.ds(pl.multiple_of(j * c, c), c)]
    return ref.at[pl.ds(j, 1)] if kind in STEP_KINDS else ref

  def run(*refs):
    row_start = pl.program_id(1) == 0  # read outside the loop (interpreters substitute the grid's ids there)

    def one(i, carry):
      j = chunks - 1 - i if reverse else i
      body(*(view(ref, kind, j) for ref, kind in zip(refs, kinds)), cfg=cfg, first=row_start & (i == 0))
      return carry
    jax.lax.fori_loop(0, chunks, one, 0)

  return run
