"""Exact attention inside a local window, a kernel's estimate outside it, one normaliser (internal).

The Scatterbrain decomposition (Chen et al. 2021, "Scatterbrain: Unifying Sparse
and Low-rank Attention"): the weight of key j for query t is the exact
exp(q_t·k_j/√d) if j is within ``window`` positions of t, else φ(q_t)ᵀφ(k_j).
With an unbiased kernel every unnormalised weight stays unbiased, and the
largest weights (the nearby, typically aligned keys) carry no estimation error.

The kernel's part covers exactly the keys beyond the window, so it is Scatterbrain's "low-rank minus its
own restriction to the sparse support" already: φ(q_t)ᵀφ(k_j) summed over every key minus the same sum over
the window's keys is, term by term, the sum beyond the window. ``control`` (β, :func:`hybrid`) adds a
control variate (Zheng et al. 2023, "Efficient Attention via Control Variates"): the window's own kernel
estimate, whose expectation (the exact window) is known here, corrects the estimate beyond it.

Both parts are linear in L. Inside the window: blocks of C ≥ window queries
against their own and neighbouring key blocks, O(L·C·(D + Dv)). Outside: the
chunked causal pass over the keys delayed by ``window`` positions (keys
j ≤ t − w for row t); bidirectional adds the same on the reversed sequence
(j ≥ t + w). Causal with a window no longer than the chunk, both parts run in the same pass
(:func:`one_pass`: each block of the chunked pass computes its rows' window too). Each part reports its
per-row log-scale and the parts are summed on their common maximum, so no part's terms underflow because
another's are larger. Shape letters: see :mod:`favor_jax.core`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from favor_jax.core import causal_xla, inputs
from favor_jax.core import gates as gates_lib
from favor_jax.core import state as state_lib
from favor_jax.core.features import head_major

LOCAL_BLOCK = 32  # the smallest query block of the exact part (larger windows use blocks of `window`)


class HybridState(NamedTuple):
  """Decode state of hybrid attention: the last ``window`` keys exactly, the older ones as features.

  Inside the algorithms the batch dims are flattened into N; :func:`~favor_jax.core.favor_decode_init` and
  :func:`~favor_jax.core.favor_decode_step` give and take it with the batch dims ``...`` instead.

  Attributes:
    keys: [N, W, H, D], a ring buffer: slot (t mod W) holds token t.
    values: [N, W, H, Dv], the same slots' values.
    valid: bool [N, W], whether the slot holds an unmasked key.
    position: int32 [], the tokens seen so far.
    recurrent: the :class:`~favor_jax.core.RecurrentState` of the keys that left the window.
  """
  keys: Array  # [N, W, H, D] ring buffer: slot (t mod W) holds token t
  values: Array  # [N, W, H, Dv]
  valid: Array  # bool [N, W]: the slot holds an unmasked key
  position: Array  # int32 []: tokens seen so far
  recurrent: state_lib.RecurrentState  # the keys that left the window
  decay: Array  # [N, W, H]: Σ of the log gates since each slot's key came (0 without gates; −∞ after a reset)
  segment: Array  # int32 [N]: the last segment id (see favor_decode_step)


def merge(*terms, with_scale: bool = False):
  """Sums (num [..., Dv], den [...], log-scale [...]) terms, each the sum times e^{−scale}, on their
  common largest scale; returns (num, den) on that scale (and the scale, ``with_scale``). A −∞ scale is an
  empty term."""
  top = state_lib.finite_or_zero(jax.lax.stop_gradient(jnp.max(jnp.stack([s for _, _, s in terms]), axis=0)))
  weights = [jnp.exp(jax.lax.stop_gradient(s) - top) for _, _, s in terms]  # 0 for an empty term
  num = sum(n * w[..., None] for (n, _, _), w in zip(terms, weights))
  den = sum(d * w for (_, d, _), w in zip(terms, weights))
  return (num, den, top) if with_scale else (num, den)


def _times(term, coefficient):
  """A (num, den, log-scale) term times ``coefficient`` [N, L, H] (may be negative)."""
  num, den, scale = term
  return num * coefficient[..., None], den * coefficient, scale


def _exact(logits, allowed, v, spec):
  """Softmax terms of logits where allowed: (num, den, log-scale) with the row's max as scale."""
  logits = jnp.where(allowed, logits, -jnp.inf)
  peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
  weights = jnp.exp(logits - state_lib.finite_or_zero(peak)[..., None])
  return jnp.einsum(spec, weights, v), jnp.sum(weights, axis=-1), peak


def local(q, k, v, mask, window: int, causal: bool, gate=None, segment=None):
  """The exact part: keys with t − w < j ≤ t (causal) or |t − j| < w, unmasked.

  q, k [N, L, H, D] (float32), v [N, L, H, Dv], mask [N, L]. Returns num [N, L, H, Dv],
  den and log-scale [N, L, H]. ``gate`` [N, L, H]: the logits get the decay Σ_{j<l≤t} g_l (causal);
  ``segment`` [N, L]: only keys of the query's segment (``gates.segment_index``).
  """
  n, length, h, d = q.shape
  c = min(max(window, LOCAL_BLOCK), length)
  nb = -(-length // c)
  blocks = lambda x, fill=0: inputs.pad_to(x, nb * c, fill).reshape((n, nb, c) + x.shape[2:])
  q_NbCHD, k_NbCHD, v_NbCHE, m_NbC = blocks(q), blocks(k), blocks(v), blocks(mask, False)

  def context(x, fill):  # the key blocks a query block may reach: previous, own (and next)
    edge = jnp.full_like(x[:, :1], fill)
    around = [jnp.concatenate([edge, x[:, :-1]], axis=1), x]
    if not causal:
      around.append(jnp.concatenate([x[:, 1:], edge], axis=1))
    return jnp.concatenate(around, axis=2)

  k_ctx, v_ctx, m_ctx = context(k_NbCHD, 0), context(v_NbCHE, 0), context(m_NbC, False)
  t = jnp.arange(c)[:, None]
  j = jnp.arange(m_ctx.shape[2])[None, :] - c  # key offset from the query block's start
  gap = t - j
  band = ((gap >= 0) & (gap < window)) if causal else (jnp.abs(gap) < window)
  allowed = (band & m_ctx[:, :, None, :])[:, :, None]  # [N, nb, 1, C, ctx]
  logits = jnp.einsum("nbihd,nbjhd->nbhij", q_NbCHD, k_ctx) / math.sqrt(d)
  if gate is not None:  # the decay from each context key to each query of the block (its last C positions)
    logits = logits + gates_lib.segsum(jnp.moveaxis(context(blocks(gate), 0), 3, 2))[..., c:, :]
  if segment is not None:
    s_ctx = context(blocks(segment, -1), -1)
    allowed = allowed & (blocks(segment, -1)[:, :, :, None] == s_ctx[:, :, None, :])[:, :, None]
  num, den, scale = _exact(logits, allowed, v_ctx, "nbhij,nbjhe->nbihe")
  to_rows = lambda x: x.reshape((n, nb * c) + x.shape[3:])[:, :length]
  swap = lambda x: to_rows(jnp.swapaxes(x, 2, 3))  # [N, nb, H, C] -> [N, L, H]
  return to_rows(num), swap(den), swap(scale)


def _delayed(x, window, fill=0):
  """x [N, L, ...] delayed by ``window`` positions along L (the first ``window`` filled)."""
  length = x.shape[1]
  head = jnp.full((x.shape[0], min(window, length)) + x.shape[2:], fill, x.dtype)
  return jnp.concatenate([head, x[:, :max(length - window, 0)]], axis=1)


def _delayed_keys(k, v, mask, delay: int, gate=None):
  """(k, v, mask) delayed by ``delay`` positions and, with ``gate``, the pass's gate arguments: the slots keep
  the gates, and the key in slot u (key u − delay) carries in Σ_{u−delay<l≤u} g_l (a window sum, no
  difference of running sums)."""
  shift = lambda x, fill=0: _delayed(x, delay, fill) if delay else x
  extra = {}
  if gate is not None:
    carried = jax.lax.reduce_window(gate, 0.0, jax.lax.add, (1, delay, 1), (1, 1, 1),
                                    [(0, 0), (delay - 1, 0), (0, 0)]) if delay else None
    extra = dict(gate=gate, key_offset=carried)
  return shift(k), shift(v), shift(mask, False), extra


def side(features, q, k, v, mask, delay: int, chunk_size: int, gate=None):
  """Keys j ≤ t − ``delay`` by the chunked pass over the keys delayed by ``delay``: (num, den, log-scale).
  ``gate`` [N, L, H]: pair (t, j) decays by Σ_{j<l≤t} g_l (see ``_delayed_keys``)."""
  k, v, mask, extra = _delayed_keys(k, v, mask, delay, gate)
  return causal_xla.chunked(features, q, k, v, mask, chunk_size=chunk_size, return_scale=True, **extra)


def one_pass(features, q, k, v, mask, window: int, chunk_size: int, gate=None, beta=None):
  """The causal hybrid in one chunked pass, for a window no longer than a chunk: (num, den, log-scale).

  Each block of rows (``causal_xla.over_blocks``) runs the kernel part over the keys delayed by ``window``
  and, on the same rows, the exact part over its own keys and the ``window`` keys before them (the first
  rows of its delayed keys), and merges the two there: no separate pass over the sequence for the window.
  ``beta`` [N, L, H] (the control variate, :func:`hybrid`): a second state, of every key, runs beside the
  first in the same blocks."""
  chunk = min(chunk_size, q.shape[1])
  k_late, v_late, mask_late, extra = _delayed_keys(k, v, mask, window, gate)
  xs = dict(q=q, k=k, v=v, mask=mask, k_late=k_late, v_late=v_late, mask_late=mask_late)
  if gate is not None:  # the gate; the decay each delayed key carries in; the gates of the window keys before
    xs.update(gate=gate, key_offset=extra["key_offset"], gate_late=_delayed(gate, window))
  if beta is not None:
    xs.update(beta=beta)

  def body(carry, x):
    gated = {} if gate is None else dict(gate=x["gate"])
    state, far = causal_xla._chunked_block(features, chunk, carry[0], x["q"], x["k_late"], x["v_late"],
                                           x["mask_late"], key_offset=x.get("key_offset"), **gated)
    before = lambda late, now: jnp.concatenate([late[:, :window], now], axis=1)  # and the window keys before
    near = local(before(jnp.zeros_like(x["q"]), x["q"]), before(x["k_late"], x["k"]), before(x["v_late"], x["v"]),
                 before(x["mask_late"], x["mask"]), window, True,
                 None if gate is None else before(x["gate_late"], x["gate"]))
    parts = [tuple(y[:, window:] for y in near), causal_xla.columns(far)]
    carry_out = (state,)
    if beta is not None:  # (1 + β)·(S_W + Ŝ_F) − β·Ŝ_{W∪F}: the state of every key beside the delayed one
      every_state, every = causal_xla._chunked_block(features, chunk, carry[1], x["q"], x["k"], x["v"],
                                                     x["mask"], **gated)
      parts = [_times(p, 1 + x["beta"]) for p in parts] + [_times(causal_xla.columns(every), -x["beta"])]
      carry_out += (every_state,)
    num, den, scale = merge(*parts, with_scale=True)
    return carry_out, jnp.concatenate([num, den[..., None], scale[..., None]], axis=-1)

  start = state_lib.initial_state(features, q, k, v)
  _, y = causal_xla.over_blocks(body, (start,) * (1 if beta is None else 2), xs, chunk,
                                chunk * causal_xla.BLOCK_CHUNKS)
  return causal_xla.columns(y)


def reverse_gate(start):
  """start [N, L] segment starts -> the gate [N, L, 1] of the reversed sequence: −∞ after each segment's last
  position (pair (t, i ≥ t) of the original crosses a start in (t, i])."""
  ends = jnp.concatenate([start[:, 1:], jnp.zeros_like(start[:, :1])], axis=1)
  return jnp.flip(jnp.where(ends, -jnp.inf, 0.0), axis=1)[..., None]


def distant(features, q, k, v, mask, window: int, causal: bool, chunk_size: int, gate=None, start=None,
            back: int | None = None):
  """The kernel part: keys with j ≤ t − w (and j ≥ t + ``back`` unless causal; ``back`` None: w);
  (num, den, log-scale). ``gate`` [N, L, H] (causal) or ``start`` [N, L] (segment starts, not causal) as in
  :func:`side`. ``window=0, back=1``: every key a row may see."""
  if not causal and start is not None:
    gate = jnp.broadcast_to(jnp.where(start, -jnp.inf, 0.0)[..., None], q.shape[:3])
  terms = [side(features, q, k, v, mask, window, chunk_size, gate)]
  if not causal:
    rev = lambda x: None if x is None else jnp.flip(x, axis=1)
    gate_back = None if start is None else jnp.broadcast_to(reverse_gate(start), q.shape[:3])
    delay = window if back is None else back
    terms.append(tuple(map(rev, side(features, *map(rev, (q, k, v, mask)), delay, chunk_size, gate_back))))
  return merge(*terms) + (jnp.max(jnp.stack([s for _, _, s in terms]), axis=0),)


def hybrid(features, q, k, v, mask, window: int, causal: bool, chunk_size: int, gates=None, control=None,
           with_scale: bool = False):
  """(num, den) of hybrid attention on one common per-row scale (inputs as in ``local``; ``gates`` a
  ``gates.Gates``; ``with_scale``: and that log-scale [N, L, H], num·e^{scale} being the unnormalised sum).

  ``control``: None, or β broadcastable to [N, L, H] (one coefficient per head: [H]), the control variate's
  coefficient. With Ŝ_A the kernel's estimate summed over the keys A, S_A the exact sum, W the window and F the
  keys beyond it, the estimate is S_W + Ŝ_F − β·(Ŝ_W − S_W) = (1 + β)·(S_W + Ŝ_F) − β·Ŝ_{W∪F}: one more
  chunked pass (every key, no delay). E[Ŝ_W] = S_W, so for any β fixed with respect to the random features it
  is unbiased, weight by weight (each window weight's estimate (1 + β)·w − β·ŵ, each beyond ŵ).
  """
  gate = None if gates is None else gates.log
  start = None if gates is None or causal else gates.start
  segment = None if start is None else gates_lib.segment_index(start)
  beta = None if control is None else jnp.broadcast_to(jnp.asarray(control, jnp.float32), q.shape[:3])
  if causal and window <= min(chunk_size, q.shape[1]):
    num, den, scale = one_pass(features, q, k, v, mask, window, chunk_size, gate, beta)
    return (num, den, scale) if with_scale else (num, den)
  near = local(q, k, v, mask, window, causal, gate, segment)
  far = distant(features, q, k, v, mask, window, causal, chunk_size, gate, start)
  if control is None:
    return merge(near, far, with_scale=with_scale)
  every = distant(features, q, k, v, mask, 0, causal, chunk_size, gate, start, back=1)
  return merge(_times(near, 1 + beta), _times(far, 1 + beta), _times(every, -beta), with_scale=with_scale)


def initial_state(features, q, v, window: int) -> HybridState:
  n, _, h, d = q.shape
  return HybridState(jnp.zeros((n, window, h, d), jnp.float32),
                     jnp.zeros((n, window, h, v.shape[-1]), jnp.float32),
                     jnp.zeros((n, window), bool), jnp.zeros((), jnp.int32),
                     state_lib.initial_state(features, q, q, v), jnp.zeros((n, window, h), jnp.float32),
                     jnp.zeros((n,), jnp.int32))


def step(features, state: HybridState, q, k, v, mask, gate=None, control=None):
  """Tokens one at a time: the key leaving the window joins the features, the new one the buffer.

  q, k [N, l, H, D], v [N, l, H, Dv] (finite), mask [N, l], ``gate`` [N, l, H] log forget gates (None: 0):
  each step the features' state and every slot's decay grow by g_t, and the key leaving the window joins
  the state with its slot's decay. ``control``: β (shape () or [H]) as in :func:`hybrid`: the row is
  (1 + β)·S_W + Ŝ_F − β·Ŝ_W, Ŝ_W the kernel's estimate over the buffer's keys (their features computed here,
  O(W·F·D) per token). Returns (state, num, den) on a common scale.
  """
  gate = jnp.zeros(q.shape[:3], jnp.float32) if gate is None else gate
  beta = None if control is None else jnp.broadcast_to(jnp.asarray(control, jnp.float32), (q.shape[0], q.shape[2]))
  window = state.keys.shape[1]
  d = q.shape[-1]

  def one(state, x):
    q_t, k_t, v_t, m_t, g_t = x
    slot = state.position % window
    old = lambda a: jax.lax.dynamic_index_in_dim(a, slot, axis=1, keepdims=True)
    decay = state.decay + g_t[:, None]
    fk_old = head_major(features, old(state.keys)[:, :0], old(state.keys))[1]
    fk_old = gates_lib.offset(fk_old, jnp.swapaxes(old(decay), 1, 2))  # [N, H, 1]
    past = state.recurrent._replace(mu=jax.lax.stop_gradient(state.recurrent.mu) + g_t[..., None])
    recurrent = state_lib.add_keys(past, fk_old, old(state.values), old(state.valid))
    put = lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), slot, axis=1)
    state = HybridState(put(state.keys, k_t), put(state.values, v_t), put(state.valid, m_t),
                        state.position + 1, recurrent, put(decay, jnp.zeros_like(g_t)), state.segment)
    logits = jnp.einsum("nhd,nwhd->nhw", q_t, state.keys) / math.sqrt(d) + jnp.swapaxes(state.decay, 1, 2)
    exact = _exact(logits, state.valid[:, None, :], state.values, "nhw,nwhe->nhe")
    fq = head_major(features, q_t[:, None], k_t[:, None])[0]
    row = lambda y, scale: (y[..., 0, :-1], y[..., 0, -1], scale[..., 0])  # [N, H, 1, E] -> one row's term
    far = row(*state_lib.read_out(fq, recurrent, with_scale=True))
    if beta is None:
      return state, merge(exact, far)
    fk_w = gates_lib.offset(head_major(features, state.keys[:, :0], state.keys)[1], jnp.swapaxes(state.decay, 1, 2))
    own = state_lib.add_keys(state_lib.initial_state(features, q_t[:, None], q_t[:, None], state.values[:, :1]),
                             fk_w, state.values, state.valid)  # the buffer's keys as a state of features
    near_hat = row(*state_lib.read_out(fq, own, with_scale=True))
    return state, merge(_times(exact, 1 + beta), far, _times(near_hat, -beta))

  t_major = lambda x: jnp.moveaxis(x, 1, 0)
  state, (num, den) = jax.lax.scan(one, state, tuple(map(t_major, (q, k, v, mask, gate))))
  return state, jnp.moveaxis(num, 0, 1), jnp.moveaxis(den, 0, 1)


def segmented(features, q, k, v, mask, start, chunk_size: int):
  """Bidirectional attention within segments (start [N, L]): keys j ≤ t by the causal pass with a reset at
  each segment start, keys j > t by the reversed one with a reset after each segment's end; (num, den)."""
  forward = jnp.broadcast_to(jnp.where(start, -jnp.inf, 0.0)[..., None], q.shape[:3])
  rev = lambda x: jnp.flip(x, axis=1)
  back = jnp.broadcast_to(reverse_gate(start), q.shape[:3])
  return merge(side(features, q, k, v, mask, 0, chunk_size, forward),
               tuple(map(rev, side(features, *map(rev, (q, k, v, mask)), 1, chunk_size, back))))
