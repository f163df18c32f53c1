"""Linear-attention algorithms on log-domain features, with stabilisers that never look ahead.

Each algorithm receives ``feature_fn(q_NlHD, k_NlHD) -> (fq, fk)``, two
:class:`~favor_jax.core.kernels.LogFeatures` (φ = mult · exp(log)), and returns
the numerator Σ_j φ(q_t)ᵀφ(k_j) v_j and denominator Σ_j φ(q_t)ᵀφ(k_j), both
multiplied by the same per-query factor exp(−s_t) (it cancels in the ratio).

Stabilisers (all offsets are constants under ``grad``; they cancel exactly):
- keys are scaled per feature by a maximum over the keys a query may see:
  all unmasked keys (bidirectional), or only past keys (causal), with the
  carried state rescaled when the maximum grows, as online softmax does;
- each query row picks s_t = max_f (log φ(q_t)_f + key scale_f), so the largest
  term of its denominator is ≥ 1 for positive features.
Causal chunks use per-row scales inside a chunk (exactly causal, no [C, C, F]
work) and the per-feature scales for the state carried across chunks.

Shapes: N flattened batch, L length, H heads, F features, E = Dv + 1 (value
with a column of ones, which carries the denominator).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from favor_jax.core.kernels import LogFeatures

NEG_INF = -jnp.inf


def split_nonfinite(q, k, v, mask, *, causal: bool, axis_name=None, prior=None):
  """Non-finite inputs, taken out of the computation and marked (one rule for every algorithm).

  Returns q, k, v with non-finite entries set to 0, and ``bad`` [N, Lq, H]: the
  rows whose exact output depends on a non-finite input — their own query, or
  an unmasked key or value they may see (j ≤ t if ``causal``). Masked keys are
  absent, whatever they hold. ``axis_name``: the sequence is split over this
  mesh axis (inside ``shard_map``); keys on earlier devices count as seen (all
  devices', if not causal). ``prior`` [N, H]: a non-finite key came before
  (a poisoned decode state). Also returns ``seen`` [N, H]: whether the keys
  up to the last position held one (the state after them is poisoned).
  """
  finite = lambda x: jnp.all(jnp.isfinite(x), axis=-1)
  bad_kv = ~(finite(k) & finite(v)) & mask[:, :, None]
  if prior is not None:
    bad_kv = bad_kv.at[:, 0].set(bad_kv[:, 0] | prior)
  if causal:
    seen = jax.lax.associative_scan(jnp.logical_or, bad_kv, axis=1)
    if axis_name is not None:
      any_P = jax.lax.all_gather(jnp.any(bad_kv, axis=1), axis_name)  # [devices, N, H]
      earlier_P = jnp.arange(any_P.shape[0]) < jax.lax.axis_index(axis_name)
      seen = seen | jnp.any(any_P & earlier_P[:, None, None], axis=0)[:, None]
  else:
    seen = jnp.any(bad_kv, axis=1, keepdims=True)
    if axis_name is not None:
      seen = jax.lax.psum(seen.astype(jnp.int32), axis_name) > 0
  zero = lambda x: jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))
  return zero(q), zero(k), zero(v), ~finite(q) | seen, seen[:, -1]


def poison(out, bad):
  """NaN in the rows ``bad`` [N, L, H] of out [N, L, H, Dv], as exact attention gives.

  Added, so that gradients pass through unchanged: those of other rows are what
  they would be without the non-finite input (a product with NaN would make
  every gradient NaN, also of losses on earlier rows, through 0·NaN).
  """
  return out + jnp.where(bad[..., None], jnp.nan, 0.0)


def _finite_or_zero(m):
  return jnp.where(jnp.isfinite(m), m, 0.0)


def _rescaled_sum(a, b):
  """Monoid on (log-scale m, state S): (m₁, S₁) ⊕ (m₂, S₂) = (m, S₁e^{m₁−m} + S₂e^{m₂−m}), m = max."""
  m1, s1 = a
  m2, s2 = b
  m = jnp.maximum(m1, m2)
  safe = _finite_or_zero(m)
  return m, s1 * jnp.exp(m1 - safe)[..., None] + s2 * jnp.exp(m2 - safe)[..., None]


def _parts(f, keep=None):
  """(log, mult) with |mult| ≤ 1 and log broadcastable ([..., F] or [..., 1]); rows where ``keep``
  (broadcastable to log, e.g. mask[..., None, None] for [N, L, H, F]) is False get log −∞.

  Features given without a log part are split into a per-row scale and the
  row divided by it, so every algorithm sees the same normalised form.
  """
  log, mult = f.log, f.mult
  if log is None:
    peak = jax.lax.stop_gradient(jnp.max(jnp.abs(mult), axis=-1, keepdims=True))
    log = jnp.log(jnp.where(peak > 0, peak, 1.0))
    mult = mult / jnp.where(peak > 0, peak, 1.0)
  if keep is not None:
    log = jnp.where(keep, log, NEG_INF)
  return log, mult


def _keep(mask):
  """An [N, L] (or [N]) key mask as the ``keep`` of L-major [N, L, H, F] features."""
  return None if mask is None else mask[..., None, None]


def _exp_times(log, offset, mult):
  out = jnp.exp(log - jax.lax.stop_gradient(offset))
  return out if mult is None else out * mult


def _with_ones(v):
  return jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)


# Keys (then queries) per step of the bidirectional pass: the [N, H, 512, F] features of one block
# stay in cache. Fastest of 256/512/1024/2048 at L=16384 on a 2-core CPU: forward 0.2–0.4 s (run
# to run) against 0.54 s for the whole sequence at once (whose [L, H, F] temporaries go to memory),
# fwd+bwd 0.66–0.83 s against 1.25 s.
BLOCK = 512


def _head_major(feature_fn, q, k):
  """feature_fn on [N, l, H, D] slices, returned head-major: log/mult [N, H, l, F] (log may be [..., 1]).

  Layout-free feature maps (``feature_fn.layout_free``) are fed [N, H, l, 1, D]: heads become a
  batch dimension, so the projection and every later product are plain batched matrix products.
  """
  if getattr(feature_fn, "layout_free", False):
    to_hm = lambda x: jnp.swapaxes(x, 1, 2)[..., None, :]
    back = lambda a: None if a is None else a[..., 0, :]
    fq, fk = feature_fn(to_hm(q), to_hm(k))
  else:
    back = lambda a: None if a is None else jnp.swapaxes(a, 1, 2)
    fq, fk = feature_fn(q, k)
  return tuple(type(f)(back(f.log), back(f.mult)) for f in (fq, fk))


def bidirectional(feature_fn, q, k, v, mask, axis_name=None):
  """Σ over all unmasked keys; per-feature key scale μ_f = max_j log φ(k_j)_f.

  Keys are folded in blocks of ``BLOCK`` with the rescaled-sum monoid (the scale
  of the running sum grows with μ, as in online softmax), then every query block
  reads the state. Feature maps that need the whole sequence at once
  (``feature_fn.whole_sequence``) get one block. ``axis_name``: the keys are
  split along the sequence over this mesh axis (inside ``shard_map``): one
  ``pmax`` of μ and one ``psum`` of the rescaled Σφ(k)[v, 1]ᵀ make every
  device's state the full one.
  """
  n, length, h = q.shape[:3]
  whole = getattr(feature_fn, "whole_sequence", False)
  cut = lambda x, start, size: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)

  block_for = lambda size: max(size if whole else min(BLOCK, size), 1)

  def fold(step, init, size):
    """``step`` over [0, size) in blocks: a loop over the full ones, then the rest."""
    block = block_for(size)
    full, rest = divmod(size, block)
    if full:  # the first block outside the loop: its result has the inputs' types (e.g. varying
      init = step(init, 0, block)  # over a shard_map axis), which the loop's carry must have
    out = jax.lax.fori_loop(1, full, lambda i, c: step(c, i * block, block), init)
    return step(out, full * block, rest) if rest else out

  if whole:  # one block each way: both sides' features from one call
    fq_all, fk_all = _head_major(feature_fn, q, k)
    key_features = lambda start, size: fk_all
    query_features = lambda start, size: fq_all
  else:  # each side alone: the other gets a zero-length slice
    key_features = lambda start, size: _head_major(feature_fn, q[:, :0], cut(k, start, size))[1]
    query_features = lambda start, size: _head_major(feature_fn, cut(q, start, size), k[:, :0])[0]

  def add_keys(state, start, size):
    fk = key_features(start, size)
    keep = None if mask is None else cut(mask, start, size)[:, None, :, None]
    log_k, mult_k = _parts(fk, keep)
    mu_NHF = jax.lax.stop_gradient(jnp.max(log_k, axis=2))
    k_hat = _exp_times(log_k, _finite_or_zero(mu_NHF)[:, :, None], mult_k)
    v1_NHlE = _with_ones(jnp.swapaxes(cut(v, start, size), 1, 2))
    return RecurrentState(*_rescaled_sum(state, (mu_NHF, jnp.einsum("nhlf,nhle->nhfe", k_hat, v1_NHlE))))

  def read(start, size):
    log_q, mult_q = _parts(query_features(start, size))
    shifted = log_q + _finite_or_zero(mu_NHF)[:, :, None]
    q_hat = _exp_times(shifted, jnp.max(shifted, axis=-1, keepdims=True), mult_q)
    y_NHlE = jnp.einsum("nhlf,nhfe->nhle", q_hat, s_NHFE)
    return y_NHlE[..., :-1], y_NHlE[..., -1]

  mu_NHF, s_NHFE = fold(add_keys, initial_state(feature_fn, q, k, v), k.shape[1])
  if axis_name is not None:
    top = _finite_or_zero(jax.lax.stop_gradient(jax.lax.pmax(mu_NHF, axis_name)))
    s_NHFE = jax.lax.psum(s_NHFE * jnp.exp(mu_NHF - top)[..., None], axis_name)
    mu_NHF = top
  # Query blocks are independent: a map, whose outputs are stacked (a carried output buffer
  # would make the backward pass copy it once per block).
  block = block_for(length)
  full, rest = divmod(length, block)
  ys = jax.lax.map(lambda i: read(i * block, block), jnp.arange(full))  # [b, N, H, l, ...]
  ys = [jnp.moveaxis(y, 0, 2).reshape((n, h, full * block) + y.shape[4:]) for y in ys]
  if rest:
    ys = [jnp.concatenate(pair, axis=2) for pair in zip(ys, read(full * block, rest))]
  return tuple(jnp.swapaxes(y, 1, 2) for y in ys)


# The intra-chunk terms of row t are taken against the chunk's per-feature key maximum (one matrix
# product for the whole chunk). A key later in the chunk can raise that maximum above everything row t
# may see; once it does by more than this many e-folds, row t's terms would fall below float32's range,
# and the block is computed by the per-token recurrence instead (the same estimator, exact, slower).
# The terms so dropped are below e^{-(87 - 40)} of the row's largest.
SAFE_GAP = 40.0


def _running_max(x, axis):
  """Inclusive running maximum along ``axis`` in log depth (``lax.cummax`` is a quadratic window on CPU)."""
  return jax.lax.associative_scan(jnp.maximum, x, axis=axis)


def _chunked_block(feature_fn, chunk, carry, q, k, v, mask):
  """Causal pass over one block (a multiple of ``chunk``), given the state of all earlier keys.

  carry = (μ [N, H, Fm], S [N, H, F, E]) with S_f = Σ_{j earlier} e^{log φ(k_j)_f − μ_f}[v_j, 1].
  Every query row t is scaled by its exact largest term s_t = max over the keys
  j ≤ t and features f of log φ(q_t)_f + log φ(k_j)_f (online-softmax style, so
  no row falls below the float range while the per-token scan's does not).
  Across chunks: prefix states from an associative scan of the rescaled-sum
  monoid. Inside a chunk: one product against the chunk's per-feature key
  maximum λ_f, checked against s_t (``SAFE_GAP``), else the per-token
  recurrence. Head-major inside (see ``_head_major``).
  """
  fq, fk = _head_major(feature_fn, q, k)
  log_q, mult_q = _parts(fq)
  log_k, mult_k = _parts(fk, None if mask is None else mask[:, None, :, None])
  v_NHlD = jnp.swapaxes(v, 1, 2)
  n, length, h = q.shape[:3]
  nc = length // chunk
  split = lambda x: None if x is None else x.reshape((n, h, nc, chunk, x.shape[-1]))

  # Exact row maxima, from per-feature running maxima of the keys (all offsets: constants under grad).
  lg_q, lg_k = jax.lax.stop_gradient(split(log_q)), jax.lax.stop_gradient(split(log_k))
  lam_NHcF = jnp.max(lg_k, axis=3)
  mu_in = jax.lax.stop_gradient(carry.mu)
  seen_before = _running_max(jnp.concatenate([mu_in[:, :, None], lam_NHcF], axis=2), axis=2)
  mu_NHcF = seen_before[:, :, :nc]  # max over all keys before chunk c (−∞: none)
  row_max = lambda log_kf: jnp.max(lg_q + log_kf, axis=-1)
  s_raw = jnp.maximum(row_max(mu_NHcF[:, :, :, None]), row_max(_running_max(lg_k, axis=3)))
  s_NHcC = _finite_or_zero(s_raw)
  s_chunk = row_max(_finite_or_zero(lam_NHcF)[:, :, :, None])  # the scale of the one-product form
  safe = ~jnp.any(jnp.isfinite(s_raw) & (s_chunk - s_raw > SAFE_GAP))

  def one_product(carry):
    lq, mq, lk, mk, v1 = map(split, (log_q, mult_q, log_k, mult_k, _with_ones(v_NHlD)))
    local = _exp_times(lk, _finite_or_zero(lam_NHcF)[:, :, :, None], mk)
    local_NHcFE = jnp.einsum("nhcjf,nhcje->nhcfe", local, v1)
    ms = jnp.concatenate([carry.mu[:, :, None], lam_NHcF], axis=2)
    ss = jnp.concatenate([carry.s[:, :, None], local_NHcFE], axis=2)
    ms, ss = jax.lax.associative_scan(_rescaled_sum, (ms, ss), axis=2)
    # Keys before chunk c: S scaled by μ (finite where any such key has a finite feature).
    q_inter = _exp_times(lq + mu_NHcF[:, :, :, None], s_NHcC[..., None], mq)
    inter_NHcCE = jnp.einsum("nhctf,nhcfe->nhcte", q_inter, ss[:, :, :nc])
    q_chunk = _exp_times(lq + _finite_or_zero(lam_NHcF)[:, :, :, None], s_chunk[..., None], mq)
    gain = jnp.exp(jnp.minimum(s_chunk - s_NHcC, SAFE_GAP))[..., None]  # e^{s_chunk − s_t}
    w_NHcCC = jnp.einsum("nhctf,nhcjf->nhctj", q_chunk, local) * gain
    w_NHcCC = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool)), w_NHcCC, 0.0)
    y = inter_NHcCE + jnp.einsum("nhctj,nhcje->nhcte", w_NHcCC, v1)
    return RecurrentState(ms[:, :, nc], ss[:, :, nc]), y.reshape((n, h, length, -1))

  def per_token(carry):
    t_major = lambda x: None if x is None else jnp.moveaxis(x, 2, 0)

    def step(state, x):
      lq, mq, lk, mk, v_t = x
      state, num, den = advance(state, LogFeatures(lq, mq), LogFeatures(lk, mk), v_t)
      return state, jnp.concatenate([num, den[..., None]], axis=-1)

    state, y = jax.lax.scan(step, carry, tuple(map(t_major, (log_q, mult_q, log_k, mult_k, v_NHlD))))
    return state, jnp.moveaxis(y, 0, 2)

  state, y_NHlE = jax.lax.cond(safe, one_product, per_token, carry)
  return state, jnp.swapaxes(y_NHlE, 1, 2)


def _pad_to(x, length, value=0):
  pad = length - x.shape[1]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def initial_state(feature_fn, q, k, v) -> "RecurrentState":
  """The state before any key; F and the width of μ are read off the feature map's shapes."""
  fk = jax.eval_shape(feature_fn, q[:, :1], k[:, :1])[1]
  f = fk.mult.shape[-1] if fk.mult is not None else fk.log.shape[-1]
  fm = 1 if fk.log is None else fk.log.shape[-1]
  n, _, h = q.shape[:3]
  return RecurrentState(jnp.full((n, h, fm), NEG_INF, jnp.float32),
                        jnp.zeros((n, h, f, v.shape[-1] + 1), jnp.float32))


def chunked(feature_fn, q, k, v, mask, *, chunk_size: int = 64, block_chunks: int = 4, state=None,
            return_state: bool = False):
  """Chunked causal linear attention: O(L·C·(F+Dv)) inside chunks, O(L·F·Dv) across them.

  Blocks of ``block_chunks`` chunks run under ``lax.scan`` with a
  rematerialised body (4 was fastest, fwd and fwd+bwd, on a 2-core CPU at
  L=16384; larger blocks make the associative scan's intermediates dominate), so fwd+bwd keeps the inputs and one [F, Dv+1] state per
  block, not the O(L·F) features and [C, C] weights. ``state`` continues
  from earlier keys (a :class:`RecurrentState`); ``return_state`` also returns
  the state after the last key.
  """
  n, length = q.shape[:2]
  chunk = min(chunk_size, length)
  block = chunk * block_chunks
  carry = initial_state(feature_fn, q, k, v) if state is None else state
  body = lambda c, x: _chunked_block(feature_fn, chunk, c, *x)
  if length <= block:
    padded = -(-length // chunk) * chunk
    xs = [_pad_to(x, padded) for x in (q, k, v)] + [_pad_to(mask, padded, False)]
    carry, y = body(carry, xs)
  else:
    padded = -(-length // block) * block
    nb = padded // block
    to_blocks = lambda x: jnp.moveaxis(x.reshape((n, nb, block) + x.shape[2:]), 1, 0)
    xs = [to_blocks(_pad_to(x, padded)) for x in (q, k, v)] + [to_blocks(_pad_to(mask, padded, False))]
    carry, y = jax.lax.scan(jax.checkpoint(body), carry, xs)
    y = jnp.moveaxis(y, 0, 1).reshape((n, padded) + y.shape[3:])
  y = y[:, :length]
  if return_state:
    return y[..., :-1], y[..., -1], carry
  return y[..., :-1], y[..., -1]


def key_state(feature_fn, q, k, v, mask) -> "RecurrentState":
  """The state after all of this block's keys, from the empty state: (μ_f = max_j log φ(k_j)_f, S)."""
  log_k, mult_k = _parts(feature_fn(q, k)[1], _keep(mask))
  mu_NHF = jax.lax.stop_gradient(jnp.max(log_k, axis=1))
  k_hat = _exp_times(log_k, _finite_or_zero(mu_NHF)[:, None], mult_k)
  return RecurrentState(mu_NHF, jnp.einsum("nlhf,nlhe->nhfe", k_hat, _with_ones(v)))


def exclusive_prefix(state: "RecurrentState", axis_name) -> "RecurrentState":
  """The state of every key on the devices before this one along ``axis_name`` (inside ``shard_map``).

  One ``all_gather`` of [devices, N, H, F, Dv+1] states, then the rescaled-sum
  monoid over the earlier devices' states only: no device reads a later one.
  """
  mu_P, s_P = jax.lax.all_gather((state.mu, state.s), axis_name)
  earlier_P = jnp.arange(mu_P.shape[0]) < jax.lax.axis_index(axis_name)
  mu_P = jnp.where(earlier_P.reshape((-1,) + (1,) * (mu_P.ndim - 1)), jax.lax.stop_gradient(mu_P), NEG_INF)
  mu = jnp.max(mu_P, axis=0)
  weight_P = jnp.exp(mu_P - _finite_or_zero(mu))  # 0 for later devices (μ = −∞)
  return RecurrentState(mu, jnp.sum(s_P * weight_P[..., None], axis=0))


def _prefix_readout(log_q, mult_q, mu, s):
  """Query t against a state (μ, S) that already includes key t."""
  shifted = log_q + _finite_or_zero(mu)
  q_hat = _exp_times(shifted, _finite_or_zero(jnp.max(shifted, axis=-1, keepdims=True)), mult_q)
  return jnp.einsum("...f,...fe->...e", q_hat, s)


class RecurrentState(NamedTuple):
  """Constant-size causal state: S_f = Σ_{j<t} e^{log φ(k_j)_f − μ_f}[v_j, 1], μ the running max."""
  mu: Array  # [N, H, Fm]
  s: Array  # [N, H, F, Dv+1]


def advance(state: RecurrentState, fq, fk, v, mask=None):
  """One token: add key t to the state (rescaling it if μ grows), then read query t.

  ``fq``/``fk``: LogFeatures of one position, [N, H, F]; ``v``: [N, H, Dv].
  Returns (new state, numerator [N, H, Dv], denominator [N, H]).
  """
  log_q, mult_q = _parts(fq)
  log_k, mult_k = _parts(fk, _keep(mask))
  new_mu = jnp.maximum(state.mu, jax.lax.stop_gradient(log_k))
  safe = _finite_or_zero(new_mu)
  s = (state.s * jnp.exp(state.mu - safe)[..., None]
       + jnp.einsum("nhf,nhe->nhfe", _exp_times(log_k, safe, mult_k), _with_ones(v)))
  y = _prefix_readout(log_q, mult_q, new_mu, s)
  return RecurrentState(new_mu, s), y[..., :-1], y[..., -1]


def scan(feature_fn, q, k, v, mask):
  """The Performer paper's per-token recurrence (one ``lax.scan`` step per position), for comparison."""
  fq, fk = feature_fn(q, k)

  def step(state, x):
    fq_t, fk_t, v_t, m_t = x
    state, num, den = advance(state, fq_t, fk_t, v_t, m_t)
    return state, (num, den)

  t_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
  xs = jax.tree_util.tree_map(t_major, (fq, fk, v, mask))
  _, (num, den) = jax.lax.scan(step, initial_state(feature_fn, q, k, v), xs)
  return jnp.moveaxis(num, 0, 1), jnp.moveaxis(den, 0, 1)


def cumsum(feature_fn, q, k, v, mask):
  """Materialised prefix states S_t = Σ_{j≤t} φ(k_j)[v_j, 1]ᵀ: O(L·F·Dv) memory, for comparison."""
  fq, fk = feature_fn(q, k)
  log_q, mult_q = _parts(fq)
  log_k, mult_k = _parts(fk, _keep(mask))
  m = jax.lax.stop_gradient(log_k)
  outer = jnp.einsum("nlhf,nlhe->nlhfe", _exp_times(log_k, _finite_or_zero(m), mult_k), _with_ones(v))
  mu, s = jax.lax.associative_scan(_rescaled_sum, (m, outer), axis=1)
  y = _prefix_readout(log_q, mult_q, mu, s)
  return y[..., :-1], y[..., -1]


CAUSAL_METHODS = {"chunked": chunked, "scan": scan, "cumsum": cumsum}  # the keys: checks.CAUSAL_METHODS
