"""Causal linear attention in XLA on log-domain features: the chunked pass, the per-token scan, materialised
prefix states, and the decode step; stabilisers that never look ahead (the methods are chosen in
:mod:`favor_jax.core.causal`).

Each algorithm receives :class:`~favor_jax.core.features.Features`, ``fn(q_NlHD, k_NlHD) -> (fq, fk)``, two
:class:`~favor_jax.core.kernels.LogFeatures` (φ = mult · exp(log)), and returns
the numerator Σ_{j≤t} φ(q_t)ᵀφ(k_j) v_j and denominator Σ_{j≤t} φ(q_t)ᵀφ(k_j),
both multiplied by the same per-query factor exp(−s_t) (it cancels in the
ratio), s_t the row's largest term over the keys it may see. Shape letters:
see :mod:`favor_jax.core`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from favor_jax.core import gates as gates_lib
from favor_jax.core import inputs
from favor_jax.core import precision as precision_lib
from favor_jax.core import state as state_lib
from favor_jax.core.features import head_major
from favor_jax.core.kernels import LogFeatures
from favor_jax.core.state import SAFE_GAP, RecurrentState

BLOCK_CHUNKS = 4  # chunks per scan step of the chunked pass (see chunked)
GROUP = 16  # tokens per group of the per-token pass's backward (√ of a 256-token block; see _token_groups)


def _running_max(x, axis):
  """Inclusive running maximum along ``axis`` in log depth (``lax.cummax`` is a quadratic window on CPU)."""
  return jax.lax.associative_scan(jnp.maximum, x, axis=axis)


def _chunked_block(features, chunk, carry, q, k, v, mask, gate=None, key_offset=None):
  """Causal pass over one block (a multiple of ``chunk``), given the state of all earlier keys.

  carry = (μ [N, H, Fm], S [N, H, F, E]) with S_f = Σ_{j earlier} e^{log φ(k_j)_f − μ_f}[v_j, 1].
  Every query row t is scaled by its exact largest term s_t = max over the keys
  j ≤ t and features f of log φ(q_t)_f + log φ(k_j)_f (online-softmax style, so
  no row falls below the float range while the per-token scan's does not).
  Across chunks: prefix states from an associative scan of the rescaled-sum
  monoid. Inside a chunk: one product against the chunk's per-feature key
  maximum λ_f, checked against s_t (``SAFE_GAP``), else the per-token
  recurrence. Head-major inside (see ``head_major``).

  ``gate`` [N, l, H]: log forget gates (``gates``): before key t joins, the state decays by e^{g_t}. Then
  the row scale is the gated maximum, the carried state is read at lq + μ + Σ_{start≤l≤t} g_l, the
  intra-chunk products are multiplied by e^{D_tj}, D = ``gates.segsum`` (the gate is one number per head,
  so it factors out of the feature sum), and each chunk's state is referenced to its end. ``key_offset``
  [N, l, H]: added to the keys' log-features (a decay a key carries from before its position).
  """
  fq, fk = head_major(features, q, k)
  log_q, mult_q = state_lib.parts(fq)
  log_k, mult_k = state_lib.parts(fk, None if mask is None else mask[:, None, :, None])
  log_k = log_k if key_offset is None else log_k + jnp.swapaxes(key_offset, 1, 2)[..., None]
  v_NHlD = jnp.swapaxes(v, 1, 2)
  n, length, h = q.shape[:3]
  nc = length // chunk
  split = lambda x: None if x is None else x.reshape((n, h, nc, chunk, x.shape[-1]))
  g_NHcC = None if gate is None else jnp.swapaxes(gate, 1, 2).reshape((n, h, nc, chunk))

  # Exact row maxima, from per-feature running maxima of the keys (all offsets: constants under grad).
  lg_q, lg_k = jax.lax.stop_gradient(split(log_q)), jax.lax.stop_gradient(split(log_k))
  lam_NHcF = jnp.max(lg_k, axis=3)
  mu_in = jax.lax.stop_gradient(carry.mu)
  row_max = lambda log_kf: jnp.max(lg_q + log_kf, axis=-1)
  if g_NHcC is None:
    seen_before = _running_max(jnp.concatenate([mu_in[:, :, None], lam_NHcF], axis=2), axis=2)
    mu_NHcF = seen_before[:, :, :nc]  # max over all keys before chunk c (−∞: none)
    s_raw = jnp.maximum(row_max(mu_NHcF[:, :, :, None]), row_max(_running_max(lg_k, axis=3)))
  else:  # the same maxima of gated terms: decayed running maxima (a reset forgets what came before)
    sum_NHcC, key_max = gates_lib.decayed_max(jax.lax.stop_gradient(g_NHcC), lg_k, axis=3)
    lam_end = key_max[:, :, :, -1]  # the chunk's keys, decayed to its end
    a_in = jnp.concatenate([jnp.zeros_like(sum_NHcC[:, :, :1, 0]), sum_NHcC[:, :, :, -1]], axis=2)
    mu_NHcF = gates_lib.decayed_max(a_in, jnp.concatenate([mu_in[:, :, None], lam_end], axis=2), axis=2)[1][:, :, :nc]
    s_raw = jnp.maximum(row_max(mu_NHcF[:, :, :, None] + sum_NHcC[..., None]), row_max(key_max))
  s_NHcC = state_lib.finite_or_zero(s_raw)
  lam_NHc1F = state_lib.finite_or_zero(lam_NHcF)[:, :, :, None]  # the one-product form's key scale
  # The scale of the one product: its largest possible term, over the features some key of the chunk has
  # (a feature none has, λ_f = −∞, must not raise it; a chunk of padding has none and cannot be unsafe).
  s_chunk_raw = row_max(lam_NHcF[:, :, :, None])
  s_chunk = state_lib.finite_or_zero(s_chunk_raw)
  safe = ~jnp.any(jnp.isfinite(s_raw) & (s_chunk_raw - s_raw > SAFE_GAP))

  def one_product(carry):
    lq, mq, lk, mk, v1 = map(split, (log_q, mult_q, log_k, mult_k, state_lib.with_ones(v_NHlD)))
    local = state_lib.exp_times(lk, lam_NHc1F, mk)
    if g_NHcC is None:
      local_NHcFE = jnp.einsum("nhcjf,nhcje->nhcfe", local, v1)
      ms = jnp.concatenate([carry.mu[:, :, None], lam_NHcF], axis=2)
      ss = jnp.concatenate([carry.s[:, :, None], local_NHcFE], axis=2)
      ms, ss = jax.lax.associative_scan(state_lib.rescaled_sum, (ms, ss), axis=2)
      read_mu = mu_NHcF[:, :, :, None]
    else:  # the chunk's own state referenced to its end; chunks combined by the gated monoid
      decay_NHcCC = gates_lib.segsum(g_NHcC)
      sum_NHcC = jax.lax.associative_scan(jnp.add, g_NHcC, axis=3)
      ends = state_lib.exp_times(lk + decay_NHcCC[..., -1, :, None], state_lib.finite_or_zero(lam_end)[:, :, :, None],
                                 mk)
      ss = jnp.concatenate([carry.s[:, :, None], jnp.einsum("nhcjf,nhcje->nhcfe", ends, v1)], axis=2)
      a_NHc = jnp.concatenate([jnp.zeros_like(sum_NHcC[:, :, :1, 0]), sum_NHcC[:, :, :, -1]], axis=2)
      ms = jnp.concatenate([carry.mu[:, :, None], lam_end], axis=2)
      _, ms, ss = jax.lax.associative_scan(gates_lib.combine, (a_NHc, ms, ss), axis=2)
      read_mu = ms[:, :, :nc, None] + sum_NHcC[..., None]
    # Keys before chunk c: S scaled by μ (finite where any such key has a finite feature).
    q_inter = state_lib.exp_times(lq + read_mu, s_NHcC[..., None], mq)
    inter_NHcCE = jnp.einsum("nhctf,nhcfe->nhcte", q_inter, ss[:, :, :nc])
    q_chunk = state_lib.exp_times(lq + lam_NHcF[:, :, :, None], s_chunk[..., None], mq)  # 0 where λ_f = −∞
    w_NHcCC = jnp.einsum("nhctf,nhcjf->nhctj", q_chunk, local)
    if g_NHcC is None:
      gain = jnp.exp(jnp.minimum(s_chunk - s_NHcC, SAFE_GAP))[..., None]  # e^{s_chunk − s_t}
      w_NHcCC = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool)), w_NHcCC * gain, 0.0)
    else:  # times the decay from j to t (e^{−∞} = 0 above the diagonal)
      w_NHcCC = w_NHcCC * jnp.exp(jnp.minimum(decay_NHcCC + (s_chunk - s_NHcC)[..., None], SAFE_GAP))
    y = inter_NHcCE + jnp.einsum("nhctj,nhcje->nhcte", w_NHcCC, v1)
    y = jnp.concatenate([y, s_raw[..., None]], axis=-1)  # the row scale s_t (−∞: no key seen) as a column
    return RecurrentState(ms[:, :, nc], ss[:, :, nc]), y.reshape((n, h, length, -1))

  def per_token(carry):
    g = math.gcd(length, GROUP)
    grouped = lambda x: None if x is None else jnp.moveaxis(x, 2, 0).reshape((length // g, g) + x.shape[:2]
                                                                            + x.shape[3:])
    g_NHl1 = None if gate is None else jnp.swapaxes(gate, 1, 2)[..., None]
    xs = tuple(map(grouped, (log_q, mult_q, log_k, mult_k, v_NHlD, g_NHl1)))
    state, y = _token_groups(precision_lib.current(), carry, xs)
    return state, jnp.moveaxis(y.reshape((length,) + y.shape[2:]), 0, 2)

  state, y_NHlE = jax.lax.cond(safe, one_product, per_token, carry)
  return state, jnp.swapaxes(y_NHlE, 1, 2)


def _token_step(state, x):
  """One token of the per-token recurrence on head-major parts: x = (log_q, mult_q, log_k, mult_k, v, gate)."""
  lq, mq, lk, mk, v_t, g_t = x
  g_t = None if g_t is None else g_t[..., 0]
  state, num, den, scale = advance(state, LogFeatures(lq, mq), LogFeatures(lk, mk), v_t, gate=g_t, with_scale=True)
  return state, jnp.concatenate([num, den[..., None], scale[..., None]], axis=-1)


def _token_group(state, xs):
  return jax.lax.scan(_token_step, state, xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _token_groups(precision, carry, xs):
  """The per-token recurrence over groups of tokens ([groups, g, ...] inputs): (final state, rows).

  Its own VJP keeps only its inputs: the chunked pass runs it as one branch of a ``lax.cond``, whose
  backward allocates every branch's residuals whichever ran, so stored states would be a cost of every
  block. The backward recomputes one state per group, then differentiates group by group in reverse
  (one group's per-token states at a time). ``precision``: the dots' (``precision.current()`` where the pass
  is traced), in force again in the forward and backward rules, which may be traced later.
  """
  with precision_lib.scope(precision):
    return jax.lax.scan(_token_group, carry, xs)


def _token_groups_fwd(precision, carry, xs):
  return _token_groups(precision, carry, xs), (carry, xs)


def _token_groups_bwd(precision, res, cts):
  carry, xs = res
  ct_state, ct_y = cts

  def back(ct_end, inputs):
    start, x, ct_y_group = inputs
    _, vjp = jax.vjp(_token_group, start, x)
    return vjp((ct_end, ct_y_group))

  with precision_lib.scope(precision):
    _, starts = jax.lax.scan(lambda state, x: (_token_group(state, x)[0], state), carry, xs)
    return jax.lax.scan(back, ct_state, (starts, xs, ct_y), reverse=True)


_token_groups.defvjp(_token_groups_fwd, _token_groups_bwd)


@precision_lib.honoured
def chunked(features, q, k, v, mask, *, chunk_size: int = 64, block_chunks: int = BLOCK_CHUNKS, state=None,
            return_state: bool = False, return_scale: bool = False, divide: bool = False, gate=None,
            key_offset=None, precision=None):
  """Chunked causal linear attention: O(L·C·(F+Dv)) inside chunks, O(L·F·Dv) across them.

  Blocks of ``block_chunks`` chunks run under ``lax.scan`` with a
  rematerialised body (larger blocks make the associative scan's
  intermediates dominate), so fwd+bwd keeps the inputs and one [F, Dv+1]
  state per block, not the O(L·F) features and [C, C] weights. ``state`` continues
  from earlier keys (a :class:`RecurrentState`); ``return_state`` also returns
  the state after the last key; ``return_scale`` the rows' log-scale s_t [N, L, H]
  (numerator and denominator are the sums times e^{−s_t}; −∞ where no key was seen). ``divide``: return
  only the output num/den [N, L, H, Dv] (``state.divide``), taken inside each block, so that under ``grad``
  the division's backward pass is part of each block's recomputation too (at the top level it formed
  several [N, L, H, Dv] temporaries on XLA:CPU). ``gate`` [N, L, H]: log forget gates (−∞: a reset), see
  :mod:`favor_jax.core.gates`; the state decays by e^{g_t} before key t joins (also a given ``state``).
  ``key_offset`` [N, L, H] (with ``gate``): a log-decay each key carries in (see ``hybrid.side``).
  ``precision``: of every dot, forward and backward (None: the one in force, see :mod:`favor_jax.core.precision`).
  """
  if divide and (return_state or return_scale):
    raise ValueError("chunked(divide=True) returns the output only: return_state and return_scale must be False")
  chunk = min(chunk_size, q.shape[1])
  carry = state_lib.initial_state(features, q, k, v) if state is None else state

  def body(c, x):
    c, y = _chunked_block(features, chunk, c, *x)
    return c, state_lib.divide(*columns(y)[:2]) if divide else y

  xs = [q, k, v, mask] + [x for x in (gate, key_offset) if x is not None]
  carry, y = over_blocks(body, carry, xs, chunk, chunk * block_chunks)
  if divide:
    return y
  num, den, scale = columns(y)
  out = (num, den) + ((scale,) if return_scale else ())
  return out + (carry,) if return_state else out


def columns(y):
  """The chunked pass's rows [..., Dv + 2] as (numerator [..., Dv], denominator [...], log-scale [...])."""
  return y[..., :-2], y[..., -2], y[..., -1]


def over_blocks(body, carry, xs, chunk: int, block: int):
  """``body(carry, xs_block) -> (carry, y_block)`` over the rows of ``xs`` (a pytree of [N, L, ...] arrays): one
  call on all of them (padded to a multiple of ``chunk``) where L ≤ ``block``, else one ``lax.scan`` step per
  ``block`` rows with a rematerialised body. Padding is 0 (False for a mask); returns (carry, y [N, L, ...])."""
  n, length = jax.tree.leaves(xs)[0].shape[:2]
  pad = lambda to: lambda x: inputs.pad_to(x, to, False if x.dtype == jnp.bool_ else 0)
  if length <= block:
    carry, y = body(carry, jax.tree.map(pad(-(-length // chunk) * chunk), xs))
  else:
    padded = -(-length // block) * block
    to_blocks = lambda x: jnp.moveaxis(pad(padded)(x).reshape((n, padded // block, block) + x.shape[2:]), 1, 0)
    carry, y = jax.lax.scan(jax.checkpoint(body), carry, jax.tree.map(to_blocks, xs))
    y = jnp.moveaxis(y, 0, 1).reshape((n, padded) + y.shape[3:])
  return carry, y[:, :length]


def exclusive_prefix(state: RecurrentState, axis_name) -> RecurrentState:
  """The state of every key on the devices before this one along ``axis_name`` (inside ``shard_map``).

  One ``all_gather`` of [devices, N, H, F, Dv+1] states, then the rescaled-sum
  monoid over the earlier devices' states only: no device reads a later one.
  """
  mu_P, s_P = jax.lax.all_gather((state.mu, state.s), axis_name)
  earlier_P = jnp.arange(mu_P.shape[0]) < jax.lax.axis_index(axis_name)
  mu_P = jnp.where(earlier_P.reshape((-1,) + (1,) * (mu_P.ndim - 1)), jax.lax.stop_gradient(mu_P), state_lib.NEG_INF)
  mu = jnp.max(mu_P, axis=0)
  weight_P = jnp.exp(mu_P - state_lib.finite_or_zero(mu))  # 0 for later devices (μ = −∞)
  return RecurrentState(mu, jnp.sum(s_P * weight_P[..., None], axis=0))


def _one_row(f):
  """LogFeatures [..., F] as one-row blocks [..., 1, F] for ``state.read_out``."""
  return LogFeatures(*(None if x is None else x[..., None, :] for x in f))


def advance(state: RecurrentState, fq, fk, v, mask=None, *, gate=None, with_scale: bool = False, group: int = 1):
  """One token: decay the state by the gate, add key t (rescaling it if μ grows), then read query t.

  ``fq``/``fk``: LogFeatures of one position, [N, H, F]; ``v``: [N, H, Dv]; ``gate``: [N, H] log forget gate
  (an addition to the state's log-scale μ; −∞ empties the state). ``group`` G > 1 (grouped-query decoding):
  the state, ``fk``, ``v`` and ``gate`` have Hkv = H/G heads and query head h reads state head h // G.
  Returns (new state, numerator [N, H, Dv], denominator [N, H]) and, ``with_scale``,
  the row's log-scale [N, H] (see ``state.read_out``).
  """
  log_k, mult_k = state_lib.parts(fk, state_lib.keep_rows(mask))
  mu = state.mu if gate is None else jax.lax.stop_gradient(state.mu) + gate[..., None]
  new_mu = jax.lax.stop_gradient(jnp.maximum(mu, log_k))
  safe = state_lib.finite_or_zero(new_mu)
  s = (state.s * jnp.exp(mu - safe)[..., None]
       + jnp.einsum("nhf,nhe->nhfe", state_lib.exp_times(log_k, safe, mult_k), state_lib.with_ones(v)))
  state = RecurrentState(new_mu, s)
  if group == 1:
    y, scale = state_lib.read_out(_one_row(fq), state, with_scale=True)
    y, scale = y[..., 0, :], scale[..., 0]
  else:  # the G query rows of each state head read it together: [N, Hkv, G, F] against [N, Hkv, F, E]
    rows = lambda x: None if x is None else x.reshape(x.shape[:-2] + (x.shape[-2] // group, group, x.shape[-1]))
    y, scale = state_lib.read_out(LogFeatures(*(rows(x) for x in fq)), state, with_scale=True)
    y, scale = y.reshape(y.shape[:-3] + (-1, y.shape[-1])), scale.reshape(scale.shape[:-2] + (-1,))
  out = state, y[..., :-1], y[..., -1]
  return out + (scale,) if with_scale else out


@precision_lib.honoured
def scan(features, q, k, v, mask, *, gate=None, precision=None):
  """The Performer paper's per-token recurrence (one ``lax.scan`` step per position), for comparison;
  ``gate`` [N, L, H] and ``precision`` as in :func:`chunked`."""
  fq, fk = features.fn(q, k)

  def step(state, x):
    fq_t, fk_t, v_t, m_t, g_t = x
    state, num, den = advance(state, fq_t, fk_t, v_t, m_t, gate=g_t)
    return state, (num, den)

  t_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
  xs = jax.tree_util.tree_map(t_major, (fq, fk, v, mask, gate))
  _, (num, den) = jax.lax.scan(step, state_lib.initial_state(features, q, k, v), xs)
  return jnp.moveaxis(num, 0, 1), jnp.moveaxis(den, 0, 1)


@precision_lib.honoured
def cumsum(features, q, k, v, mask, *, gate=None, precision=None):
  """Materialised prefix states S_t = Σ_{j≤t} φ(k_j)[v_j, 1]ᵀ: O(L·F·Dv) memory, for comparison; ``gate``
  [N, L, H] and ``precision`` as in :func:`chunked` (prefixes of the gated monoid ``gates.combine``)."""
  fq, fk = features.fn(q, k)
  log_k, mult_k = state_lib.parts(fk, state_lib.keep_rows(mask))
  m = jax.lax.stop_gradient(log_k)
  k_hat = state_lib.exp_times(log_k, state_lib.finite_or_zero(m), mult_k)
  outer = jnp.einsum("nlhf,nlhe->nlhfe", k_hat, state_lib.with_ones(v))
  if gate is None:
    mu, s = jax.lax.associative_scan(state_lib.rescaled_sum, (m, outer), axis=1)
  else:
    _, mu, s = jax.lax.associative_scan(gates_lib.combine, (gate, m, outer), axis=1)
  y = state_lib.read_out(_one_row(fq), RecurrentState(mu, s))[..., 0, :]
  return y[..., :-1], y[..., -1]
