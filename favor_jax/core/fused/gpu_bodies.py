"""The bodies of the fused causal kernels (internal; launched by :mod:`favor_jax.core.fused.gpu`, which describes the
algorithm). Written with ``jax.numpy`` and Pallas refs only, so Triton compiles them on a GPU and Pallas's
interpreter runs them anywhere.

Forget gates (``Blocks.gated``): g_l ≤ 0 per row (−∞: a reset), the decay of key j at row t e^{D_tj},
D_tj = Σ_{j<l≤t} g_l. Per chunk the kernels read g, b_t = Σ_{chunk start≤l≤t} g_l (the decay from the
chunk's start to row t, where the state before the chunk is referenced) and e_j = Σ_{j<l≤chunk end} g_l (the
decay from key j to the chunk's end); the chunk's own D is a running sum of gates down its rows (never a
difference of running sums: no cancellation, and a −∞ gate gives −∞, never ∞ − ∞).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from favor_jax.core.fused.rows import PER_ROW_MAPS, SCALED_MAPS, as_operand
from favor_jax.core.state import SAFE_GAP

NEG_INF = -jnp.inf


class Blocks(NamedTuple):
  """Static launch choices: chunk rows C, feature block (sequential kernels), Triton warps, interpreter.

  ``operands``: "bfloat16" where every input is bfloat16 and ``precision`` asks for no more (products of
  features take it, see ``dot``); ``gated``: the kernels take forget gates; ``precision``: None (the
  backend's default) or a ``jax.lax.Precision`` for every product (see ``dot``); ``feature_map``: the map
  the kernels compute from the rows of q and k, forward and backward (:class:`LogRows`), None: they read
  XLA's features.
  """
  chunk: int
  block_f: int
  num_warps: int
  interpret: bool
  operands: str = "float32"
  gated: bool = False
  precision: Any = None
  feature_map: str | None = None  # the kernels compute the features from q, k (``fused.rows.feature_map``)
  x_scale: float = 1.0  # d^{-1/4}, for those features


def safe(x):
  """−∞ → 0 (no key: an offset that multiplies only zeros); comparisons, since Triton has no isfinite."""
  return jnp.where(x == NEG_INF, 0.0, x)


def dot(a, b, blocks, trans_a=False, trans_b=False, state=False):
  """A matrix product, accumulated in float32, at ``blocks.precision`` (None: the backend's default for its
  operands: on a GPU TF32 for float32 operands, as XLA's own float32 products there; HIGHEST: full float32).

  Float32 operands unless ``blocks.operands`` is "bfloat16" (every input bfloat16, precision None or
  DEFAULT): then products of features, values and cotangents take bfloat16 (tensor cores), and products with
  a float32 state (``state``: its dynamic range is large) float32 operands. Never float16: features span
  e^{−SAFE_GAP}..1 and float16 flushes below e^{−17} (a row's own terms would vanish)."""
  if blocks.operands == "float32" or state:
    return plgpu.dot(a.astype(jnp.float32), b.astype(jnp.float32), trans_a, trans_b, precision=blocks.precision)
  dtype = jnp.dtype(blocks.operands)
  return plgpu.dot(a.astype(dtype), b.astype(dtype), trans_a, trans_b)


class LogRows:
  """Log features computed from rows of q or k where they are read, indexed as the features XLA computes
  ([rows, features]): xs[rows]·p[features]ᵀ − ‖xs[rows]‖²/2 + fb[features] + bias[rows], xs = u·x, x the rows
  [L, D] in their dtype, p the projection rows [F, D], fb the log-normaliser [F] (−∞: padded features), bias
  [L] (−∞: masked keys and padded positions), u = d^{-1/4} or the row's scales [D] (``u_ref``: FAVOR#);
  products in float32 (``dot``'s state products)."""

  def __init__(self, x_ref, p_ref, fb_ref, bias_ref, scale, blocks, u_ref=None):
    self.refs, self.scale, self.blocks, self.u_ref = (x_ref, p_ref, fb_ref, bias_ref), scale, blocks, u_ref
    self.shape = (x_ref.shape[0], p_ref.shape[0])

  def __getitem__(self, index):
    rows, features = index if isinstance(index, tuple) else (index, slice(None))
    x_ref, p_ref, fb_ref, bias_ref = self.refs
    x = self.scaled(rows)
    return (dot(x, p_ref[features, :], self.blocks, trans_b=True, state=True)
            - 0.5 * jnp.sum(x * x, axis=1)[:, None] + fb_ref[features][None, :] + bias_ref[rows][:, None])

  def u(self):
    return self.scale if self.u_ref is None else self.u_ref[...][None, :]

  def scaled(self, rows=slice(None)):
    """u·x [rows, D] in float32."""
    return self.refs[0][rows, :].astype(jnp.float32) * self.u()

  def backprop(self, dl, features, acc):
    """``acc`` (∂ℓ·p [C, D], Σ_f ∂ℓ [C]) plus one feature block's ∂ℓ [C, bf]; :meth:`to_rows` finishes."""
    return acc[0] + dot(dl, self.refs[1][features, :], self.blocks, state=True), acc[1] + jnp.sum(dl, axis=1)

  def to_rows(self, acc):
    """∂x [C, D] = u·(∂ℓ·p − (Σ_f ∂ℓ_f)·u·x) from :meth:`backprop`'s sums (∂ℓ_f/∂x = u·(p_f − u·x))."""
    return self.u() * (acc[0] - acc[1][:, None] * self.scaled())


def on_chip(logs, refs, blocks, scale):
  """``logs`` (the refs of log features a kernel reads first) as :class:`LogRows` where ``scale`` is given:
  then ``refs`` starts with the projection's and the normaliser's refs, one bias ref per features' ref and,
  for maps of ``SCALED_MAPS``, one scale ref per features' ref (the rows of q or k take the places of the
  features; ``fused.gpu_rows.OnChip.ins``); the rest of ``refs`` after them."""
  if scale is None:
    return logs, refs
  p_ref, fb_ref, *refs = refs
  n = len(logs)
  biases, refs = refs[:n], refs[n:]
  us, refs = (refs[:n], refs[n:]) if blocks.feature_map in SCALED_MAPS else ([None] * n, refs)
  return [LogRows(x, p_ref, fb_ref, b, scale, blocks, u) for x, b, u in zip(logs, biases, us)], refs


def _rows_cols(c):
  return jnp.arange(c)[:, None], jnp.arange(c)[None, :]


def decay(g):
  """The chunk's decays D [C, C] from its gates g [C]: D_tj = Σ_{j<l≤t} g_l for j ≤ t, −∞ for j > t; summed
  down the rows (D_tj = Σ_{t'≤t, t'>j} g_t'), every term ≤ 0."""
  t, j = _rows_cols(g.shape[0])
  d = jnp.cumsum(jnp.where(t > j, g[:, None], 0.0), axis=0)
  return jnp.where(t >= j, d, NEG_INF)


def empty_state(bf, e):
  """(μ [bf], S [bf, E], z [bf]) of no rows: μ = −∞, S = 0, z = 0."""
  return (jnp.full((bf,), NEG_INF, jnp.float32), jnp.zeros((bf, e), jnp.float32), jnp.zeros((bf,), jnp.float32))


def absorb(carry, g, x, w, blocks, a=None):
  """The state recurrences' step (prefix states forward, suffix sums backward): decay (μ, S, z) by e^{a} (a
  gated chunk's total log gate), then add rows with log weights g [C, bf], values x [C, E] and z-weights w [C]
  (None: 1), rescaled to the new maximum μ':

      μ' = max(μ + a, max_rows g),  S' = S e^{μ+a−μ'} + Σ_rows e^{g−μ'} x,  z' = z e^{μ+a−μ'} + Σ_rows e^{g−μ'} w.
  """
  mu, s, z = carry
  mu = mu if a is None else mu + a
  new = jnp.maximum(mu, jnp.max(g, axis=0))
  shrink = jnp.exp(mu - safe(new))
  p = jnp.exp(g - safe(new)[None, :])
  p = p if w is not None else as_operand(p, blocks.operands)  # values: S and z sum the same weights
  z_add = jnp.sum(p if w is None else p * w[:, None], axis=0)
  return new, s * shrink[:, None] + dot(p, x, blocks, trans_a=True, state=w is not None), z * shrink + z_add


def _store(refs, c, carry):
  for ref, x in zip(refs, carry):
    ref[c, ...] = x


def _split(refs, n_gate):
  """(gate refs or None, the rest): the gate inputs come after the others."""
  return (tuple(refs[:n_gate]) or None), refs[n_gate:]


def states_kernel(lk_ref, v_ref, *refs, blocks, n_chunks, scale=None):
  """Exclusive prefix states before every chunk (and after the last): μ [c+1, F], S [c+1, F, E], z [c+1, F];
  gated (refs: b, e): each referenced at the end of the chunk before (e_j: key j's decay to its chunk's end).
  ``scale``: features computed from the rows of k (:func:`on_chip`)."""
  (lk_ref,), refs = on_chip([lk_ref], refs, blocks, scale)
  gate_refs, (mu_ref, s_ref, z_ref) = _split(refs, 2 if blocks.gated else 0)
  c_rows, bf = blocks.chunk, lk_ref.shape[-1]

  def body(c, carry):
    _store((mu_ref, s_ref, z_ref), c, carry)
    rows = pl.ds(c * c_rows, c_rows)
    lk = lk_ref[rows, :]
    if gate_refs is None:
      return absorb(carry, lk, v_ref[rows, :], None, blocks)
    b, e = gate_refs[0][rows], gate_refs[1][rows]
    return absorb(carry, lk + e[:, None], v_ref[rows, :], None, blocks, a=jnp.min(b))  # min b: the chunk's total

  last = jax.lax.fori_loop(0, n_chunks, body, empty_state(bf, v_ref.shape[-1]))
  _store((mu_ref, s_ref, z_ref), n_chunks, last)


def _feature_blocks(f, bf):
  return [slice(i, i + bf) for i in range(0, f, bf)]


def chunk_scales(lq_ref, lk_ref, mu_ref, gate_refs, fbs, m=None):
  """(m [C], sc [C], W [C, C], D [C, C]): row t's scale m_t = max(max_f(ℓq_tf + μ_f) + b_t, sc_t) (``m`` given:
  the forward's, exact for a row it recomputed), sc_t = max_f(ℓq_tf + λ_f) the scale of the chunk's one
  product (λ its per-feature key maximum, undecayed), D_tj = Σ_{j<l≤t} g_l (0 without gates; −∞ for j > t)
  and W = e^D. Each factor of a term e^{ℓq_t + λ − m_t}·e^{ℓk_j − λ}·W_tj is ≤ 1; a row whose own terms lie
  far below e^{m_t} (a later key of the chunk raised λ, or its nearer keys decayed) is recomputed alone
  (:func:`recompute_lost`)."""
  c_rows = lq_ref.shape[0]
  t, j = _rows_cols(c_rows)
  inter = sc = jnp.full((c_rows,), NEG_INF, jnp.float32)
  for fb in fbs:
    lq = lq_ref[:, fb]
    if m is None:
      inter = jnp.maximum(inter, jnp.max(lq + mu_ref[fb][None, :], axis=1))
    sc = jnp.maximum(sc, jnp.max(lq + jnp.max(lk_ref[:, fb], axis=0)[None, :], axis=1))
  d = jnp.where(t >= j, 0.0, NEG_INF) if gate_refs is None else decay(gate_refs[0][...])
  if m is None:
    m = jnp.maximum(inter + (0.0 if gate_refs is None else gate_refs[1][...]), sc)
  return m, sc, jnp.exp(d), d


def _row_of(x, t):
  """Row t of x [C(, W)] as [W] (or a scalar): a masked maximum, no dynamic index."""
  sel = jnp.arange(x.shape[0]) == t
  return jnp.max(jnp.where(sel[:, None] if x.ndim == 2 else sel, x, NEG_INF), axis=0)


def _put(x, t, row):
  """x [C(, W)] with row t replaced by ``row`` [W] (or a scalar)."""
  sel = jnp.arange(x.shape[0]) == t
  return jnp.where(sel[:, None], row[None, :], x) if x.ndim == 2 else jnp.where(sel, row, x)


def _exact_terms(t, lq, lk, d, m_t):
  """Row t's own terms in one feature block at its scale m_t: P [C, bf], P_jf = e^{ℓq_tf + ℓk_jf + D_tj − m_t}
  as e^{ℓq_tf + λ_tf − m_t}·e^{ℓk_jf + D_tj − λ_tf}, λ_tf = max_{j≤t}(ℓk_jf + D_tj) (its key scale from the keys
  it sees: both factors ≤ 1 for m_t ≥ max_f(ℓq_tf + λ_tf), nothing overflows)."""
  keys = lk + _row_of(d, t)[:, None]
  lam = jnp.max(keys, axis=0)
  return jnp.exp(keys - safe(lam)[None, :]) * jnp.exp(_row_of(lq, t) + lam - safe(m_t))[None, :]


def recompute_lost(lost, lq_ref, lk_ref, v, mu_ref, s_ref, z_ref, b, d, fbs, carry):
  """(num [C, E], den [C], m [C]) of ``carry`` with each row flagged in ``lost`` [C] computed again alone at
  its exact scale m_t = max_f(ℓq_tf + max(λ_tf, μ_f + b_t)) (:func:`_exact_terms`; b [C] the gates from the
  chunk's start, or 0.0): O(C·F) per such row, never entered by a chunk without one (rows with no key in reach
  get m = −∞, num = den = 0)."""
  def row(t, carry):
    def redo(carry):
      b_t = b if isinstance(b, float) else _row_of(b, t)
      m_t = jnp.full((), NEG_INF, jnp.float32)
      for fb in fbs:
        lq_t, keys = _row_of(lq_ref[:, fb], t), lk_ref[:, fb] + _row_of(d, t)[:, None]
        m_t = jnp.maximum(m_t, jnp.max(lq_t + jnp.maximum(jnp.max(keys, axis=0), mu_ref[fb] + b_t)))
      w, num_t, den_t = jnp.zeros(v.shape[:1], jnp.float32), jnp.zeros(v.shape[1:], jnp.float32), 0.0
      for fb in fbs:
        lq = lq_ref[:, fb]  # once per block (computed from q where the kernel computes the features)
        w += jnp.sum(_exact_terms(t, lq, lk_ref[:, fb], d, m_t), axis=1)
        q_state = jnp.exp(_row_of(lq, t) + mu_ref[fb] + b_t - safe(m_t))
        num_t += jnp.sum(q_state[:, None] * s_ref[fb, :], axis=0)
        den_t += jnp.sum(q_state * z_ref[fb])
      num, den, m = carry
      return (_put(num, t, num_t + jnp.sum(w[:, None] * v.astype(jnp.float32), axis=0)),
              _put(den, t, den_t + jnp.sum(w)), _put(m, t, m_t))
    return jax.lax.cond(_row_of(lost, t) > 0, redo, lambda c: c, carry)
  return jax.lax.fori_loop(0, lost.shape[0], row, carry)


def lost_row_grads(lost, lq, lk, d, m, g0, carry):
  """(∂ℓq, ∂ℓk [C, bf] of one feature block, the exact weights [C, C]) of ``carry`` plus, for each row t flagged
  in ``lost`` [C], its own terms P at its scale m_t (:func:`_exact_terms`): ∂ℓq_t += Σ_j g0_tj P_j,
  ∂ℓk_j += g0_tj P_j, weight_tj += Σ_f P_jf (g0_tj = ∂loss/∂(row t's weight of key j))."""
  def row(t, carry):
    def add(carry):
      dlq, dlk, a = carry
      p, g_t = _exact_terms(t, lq, lk, d, _row_of(m, t)), _row_of(g0, t)
      return (_put(dlq, t, _row_of(dlq, t) + jnp.sum(g_t[:, None] * p, axis=0)), dlk + g_t[:, None] * p,
              _put(a, t, _row_of(a, t) + jnp.sum(p, axis=1)))
    return jax.lax.cond(_row_of(lost, t) > 0, add, lambda c: c, carry)
  return jax.lax.fori_loop(0, lost.shape[0], row, carry)


def output_kernel(lq_ref, lk_ref, v_ref, mu_ref, s_ref, z_ref, *refs, blocks, scale=None):
  """One chunk's rows: numerator [C, E], denominator [C], row scale m [C] (−∞ only if no finite key; see
  ``chunk_scales``) and 1.0 for a row computed again alone (its denominator fell below e^{−SAFE_GAP} in the
  chunk's one product: :func:`recompute_lost`), else 0.0. ``scale``: features computed from the rows of q and
  k (:func:`on_chip`)."""
  (lq_ref, lk_ref), refs = on_chip([lq_ref, lk_ref], refs, blocks, scale)
  gate_refs, (num_ref, den_ref, m_ref, redone_ref) = _split(refs, 2 if blocks.gated else 0)
  c_rows, f = lq_ref.shape
  fbs = _feature_blocks(f, blocks.block_f)
  m, _, weights, d = chunk_scales(lq_ref, lk_ref, mu_ref, gate_refs, fbs)
  b = 0.0 if gate_refs is None else gate_refs[1][...]
  ms = safe(m)[:, None]
  read = ms - (0.0 if gate_refs is None else b[:, None])  # the state: at μ + b_t
  num = jnp.zeros(num_ref.shape, jnp.float32)
  den = jnp.zeros((c_rows,), jnp.float32)
  a = jnp.zeros((c_rows, c_rows), jnp.float32)
  for fb in fbs:
    lq, lk, mu = lq_ref[:, fb], lk_ref[:, fb], mu_ref[fb]
    lam = jnp.max(lk, axis=0)
    q_state = jnp.exp(lq + mu[None, :] - read)
    num += dot(q_state, s_ref[fb, :], blocks, state=True)
    den += jnp.sum(q_state * z_ref[fb][None, :], axis=1)
    a += dot(jnp.exp(lq + lam[None, :] - ms), jnp.exp(lk - safe(lam)[None, :]), blocks, trans_b=True)
  a = as_operand(a * weights, blocks.operands)  # the weights num takes, summed by den
  out = (num + dot(a, v_ref[...], blocks), den + jnp.sum(a, axis=1), m)
  lost = jnp.where((m > NEG_INF) & (out[1] < math.exp(-SAFE_GAP)), 1.0, 0.0)
  num, den, m = jax.lax.cond(jnp.max(lost) > 0, lambda c: recompute_lost(
      lost, lq_ref, lk_ref, v_ref[...], mu_ref, s_ref, z_ref, b, d, fbs, c), lambda c: c, out)
  num_ref[...], den_ref[...], m_ref[...] = num, den, m
  redone_ref[...] = jnp.where(m > NEG_INF, lost, 0.0)


def suffix_kernel(lq_ref, mq_ref, dnum_ref, dden_ref, *refs, blocks, n_chunks, scale=None):
  """Exclusive suffix sums after every chunk: R_c = Σ_{t later} e^{ℓq_t − m_t − ν_c}[dnum_t], rz_c likewise;
  gated (refs: b): referenced at the chunk's end (b_t: the decay from a chunk's start to row t).
  ``scale``: features computed from the rows of q (:func:`on_chip`)."""
  (lq_ref,), refs = on_chip([lq_ref], refs, blocks, scale)
  gate_refs, (nu_ref, r_ref, rz_ref) = _split(refs, 1 if blocks.gated else 0)
  c_rows, bf = blocks.chunk, lq_ref.shape[-1]

  def body(i, carry):
    c = n_chunks - 1 - i
    _store((nu_ref, r_ref, rz_ref), c, carry)
    rows = pl.ds(c * c_rows, c_rows)
    g = lq_ref[rows, :] - mq_ref[rows][:, None]  # −∞ for rows that see no key
    if gate_refs is None:
      return absorb(carry, g, dnum_ref[rows, :], dden_ref[rows], blocks)
    b = gate_refs[0][rows]
    return absorb(carry, g + b[:, None], dnum_ref[rows, :], dden_ref[rows], blocks, a=jnp.min(b))

  jax.lax.fori_loop(0, n_chunks, body, empty_state(bf, dnum_ref.shape[-1]))


def grads_kernel(lq_ref, lk_ref, v_ref, ms_ref, dnum_ref, dden_ref, mu_ref, s_ref, z_ref, nu_ref, r_ref, rz_ref,
                 *refs, blocks, scale=None, project=False):
  """One chunk's ∂ℓq [C, F], ∂ℓk [C, F], ∂v [C, E] (and gated, refs g, b, e: ∂g [C]) given the cotangents of
  numerator and denominator. ``scale``: features computed from the rows of q and k (:func:`on_chip`), whose
  ∂q, ∂k [C, D] take the places of ∂ℓq, ∂ℓk (nothing of size C×F written), and ``project``: the chunk's part of
  the projection rows' gradient, Σ_t ∂ℓq_t ⊗ u·q_t + ∂ℓk_t ⊗ u·k_t [F, D], after the others (maps of
  ``PER_ROW_MAPS``: then the normaliser's, Σ_t ∂ℓq_t + ∂ℓk_t [F]).

  The gate's: with P_tj = ∂loss/∂(term t, j) · (term t, j), ∂g_l = Σ over the pairs j < l ≤ t of P_tj, split
  by where the pair lies: both in the chunk (its rows' sums of P over t ≥ l, less its keys' over j ≥ l), an
  earlier key (row t ≥ l reading the state), a later row (key j < l read by a later chunk), or both outside
  (⟨prefix state, suffix sum⟩ across the chunk); each part a sum of its own pairs.

  A row the forward recomputed alone (its scale m_t lies more than SAFE_GAP/2 below the chunk's one-product
  scale: every other row's is at or above it) takes no part in the chunk's products here either; its own
  terms are added alone (:func:`lost_row_grads`)."""
  (lq_ref, lk_ref), refs = on_chip([lq_ref, lk_ref], refs, blocks, scale)
  gate_refs, (dlq_ref, dlk_ref, dv_ref, *dg_ref) = _split(refs, 3 if blocks.gated else 0)
  db_ref = dg_ref.pop() if project and blocks.feature_map in PER_ROW_MAPS else None
  dp_ref = dg_ref.pop() if project else None
  chip = scale is not None
  if chip:
    xq, xk = lq_ref.scaled(), lk_ref.scaled()
    acc_q = acc_k = (jnp.zeros(dlq_ref.shape, jnp.float32), jnp.zeros(dlq_ref.shape[:1], jnp.float32))
  c_rows, f = lq_ref.shape
  fbs = _feature_blocks(f, blocks.block_f)
  m, sc, weights, d = chunk_scales(lq_ref, lk_ref, mu_ref, gate_refs, fbs, m=ms_ref[...])
  lost = jnp.where(sc - m > 0.5 * SAFE_GAP, 1.0, 0.0)
  v, dnum, dden = v_ref[...], dnum_ref[...], dden_ref[...]
  ms = m[:, None]
  if gate_refs is None:
    read, b_end, k_end = ms, None, 0.0
  else:
    b, e = gate_refs[1][...], gate_refs[2][...]
    read, b_end, k_end = ms - b[:, None], jnp.min(b), e[:, None]
    row_state = key_later = jnp.zeros((c_rows,), jnp.float32)
    across = jnp.zeros((), jnp.float32)
  g0 = dot(dnum, v, blocks, trans_b=True, state=True) + dden[:, None]  # ∂/∂(row t's weight of j); float32 as ∂den
  g = g0 * weights
  a = a_lost = jnp.zeros((c_rows, c_rows), jnp.float32)
  dv = jnp.zeros(dv_ref.shape, jnp.float32)
  for fb in fbs:
    lq, lk, mu, nu = lq_ref[:, fb], lk_ref[:, fb], mu_ref[fb], nu_ref[fb]
    lam = jnp.max(lk, axis=0)
    q_state = jnp.exp(lq + mu[None, :] - read)
    q_chunk = jnp.where(lost[:, None] > 0, 0.0, jnp.exp(lq + lam[None, :] - ms))
    k_chunk = jnp.exp(lk - safe(lam)[None, :])
    k_later = jnp.exp(lk + k_end + nu[None, :])  # ≤ 1: ν ≤ −(ℓk + decay) for keys that later rows see
    a += dot(q_chunk, k_chunk, blocks, trans_b=True)
    from_state = dot(dnum, s_ref[fb, :], blocks, trans_b=True, state=True) + dden[:, None] * z_ref[fb][None, :]
    dlq_state = q_state * from_state
    dlk_later = k_later * (dot(v, r_ref[fb, :], blocks, trans_b=True, state=True) + rz_ref[fb][None, :])
    dlq = dlq_state + q_chunk * dot(g, k_chunk, blocks)
    dlk = k_chunk * dot(g, q_chunk, blocks, trans_a=True) + dlk_later
    dlq, dlk, a_lost = jax.lax.cond(jnp.max(lost) > 0, lambda c: lost_row_grads(lost, lq, lk, d, m, g0, c),
                                    lambda c: c, (dlq, dlk, a_lost))
    if chip:
      acc_q, acc_k = lq_ref.backprop(dlq, fb, acc_q), lk_ref.backprop(dlk, fb, acc_k)
      if project:
        dp_ref[fb, :] = (dot(dlq, xq, blocks, trans_a=True, state=True)
                         + dot(dlk, xk, blocks, trans_a=True, state=True))
      if db_ref is not None:
        db_ref[fb] = jnp.sum(dlq, axis=0) + jnp.sum(dlk, axis=0)
    else:
      dlq_ref[:, fb], dlk_ref[:, fb] = dlq, dlk
    dv += dot(k_later, r_ref[fb, :], blocks, state=True)
    if gate_refs is not None:
      row_state += jnp.sum(dlq_state, axis=1)
      key_later += jnp.sum(dlk_later, axis=1)
      inner = jnp.sum(s_ref[fb, :] * r_ref[fb, :], axis=1) + z_ref[fb] * rz_ref[fb]
      across += jnp.sum(jnp.exp(mu + b_end + nu) * inner)  # ≤ 1 each: a product of two states' maxima
  a = a * weights + a_lost  # every row's weight of each key of the chunk
  dv_ref[...] = dv + dot(a, dnum, blocks, trans_a=True)
  if chip:
    dlq_ref[...], dlk_ref[...] = lq_ref.to_rows(acc_q), lk_ref.to_rows(acc_k)
  if gate_refs is not None:
    pairs = g0 * a  # P_tj
    l, t = _rows_cols(c_rows)
    from_rows = jnp.sum(pairs, axis=1) + row_state - jnp.sum(pairs, axis=0)  # [t]; the last: keys j = t
    dg_ref[0][...] = (jnp.sum(jnp.where(t >= l, from_rows[None, :], 0.0), axis=1)
                      + jnp.sum(jnp.where(t < l, key_later[None, :], 0.0), axis=1) + across)
