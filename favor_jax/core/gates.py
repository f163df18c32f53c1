"""Forget gates and packed segments (internal): the per-position log gate and the algebra that carries it.

A forget gate f_l ∈ [0, 1] per position and head biases softmax attention by the
decay between key and query (the Forgetting Transformer, Lin et al. 2025; RFA's
gate, Peng et al. 2021; ALiBi's linear bias for a constant one, Press et al. 2022):

    w_tj ∝ κ(q_t, k_j) · exp(Σ_{j<l≤t} log f_l).

A packed row's segment boundary (a position whose id differs from the one before)
is a gate of exactly 0 there (log f = −∞) for causal attention; bidirectional
attention keeps pairs of one segment (see ``hybrid.segmented``).

Everything here takes the log gate g [..., L, H] (≤ 0, −∞ at a reset) and never
forms a global running sum G_t to subtract (float32 would cancel at long L):
decays are sums over the positions between a key and the point it is read at
(all terms ≤ 0, so no cancellation), added to a state's log-scale μ, which stays
a constant under ``grad`` while the gate's gradient flows through the exponent
of the factor that rescales the state. Shape letters: see :mod:`favor_jax.core`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from favor_jax.core import features as features_lib
from favor_jax.core import state as state_lib

NEG_INF = -jnp.inf


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi's per-head slopes m_h (Press et al. 2022), float32 [H]; the bias of head h is −m_h·(t − j).

  For H a power of two: 2^{−8h/H}, h = 1..H, steepest (largest) first. Otherwise, in the order of the paper's
  code: the H' = 2^⌊log₂H⌋ slopes of H' heads (2^{−8h/H'}, steepest first), then the first H − H' of every
  other slope of 2H' heads (2^{−8h/2H'} for h = 1, 3, 5, …), which lie between them: the order is not
  monotone, e.g. ``alibi_slopes(3) = [2⁻⁴, 2⁻⁸, 2⁻²] = [0.0625, 0.0039, 0.25]``. As a forget gate:
  ``log_gate = −m_h`` at every position (:func:`alibi_log_gate`).

  Args:
    num_heads: H, the number of heads.

  Returns:
    The slopes m_h > 0, float32 [H], head h's at index h in the order above.

  Raises:
    ValueError: ``num_heads`` is not a positive int.

  References:
    Press et al. 2022, "Train Short, Test Long: Attention with Linear Biases Enables Input Length
    Extrapolation" (ICLR).
  """
  if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads <= 0:
    raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

  def power_of_two(n):
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]

  n = int(num_heads)
  low = 2 ** int(math.floor(math.log2(n)))
  slopes = power_of_two(low) + power_of_two(2 * low)[0::2][:n - low]
  return np.asarray(slopes, np.float32)


def alibi_log_gate(num_heads: int, length: int) -> np.ndarray:
  """ALiBi as a constant forget gate: log f = −m_h at every position, float32 [length, H] (broadcasts over
  the batch as ``log_gate``).

  Args:
    num_heads: H, the number of heads.
    length: L, the number of positions.

  Returns:
    −m_h at every position, float32 [L, H]: pass it as ``log_gate=`` with ``causal=True``.

  Raises:
    ValueError: ``num_heads`` or ``length`` is not a positive int.

  References:
    Press et al. 2022, "Train Short, Test Long: Attention with Linear Biases Enables Input Length
    Extrapolation" (ICLR).
  """
  if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length <= 0:
    raise ValueError(f"length must be a positive int, got {length!r}")
  return np.broadcast_to(-alibi_slopes(num_heads), (int(length), int(num_heads))).copy()


class Gates(NamedTuple):
  """A call's gates and segments, flattened like the batch ([N, ...]); fields None when not given.

  ``log``: [N, L, H] float32, the log gate with −∞ at every reset (a segment start, an exact zero gate),
  causal only; bad entries replaced by 0. ``start``: [N, L] bool, segment starts (position 0 only if the
  call continues a state of another segment). ``bad``: [N, L, H] bool, a NaN, +∞ or positive log gate.
  """
  log: Array | None
  start: Array | None
  bad: Array | None


def _check_shape(name, x, need, what):
  ok = x.ndim >= len(what) and tuple(x.shape[-len(what):]) == tuple(need[-len(what):])
  if ok:
    try:
      ok = jnp.broadcast_shapes(x.shape, need) == tuple(need)
    except ValueError:
      ok = False
  if not ok:
    raise ValueError(f"{name} must have shape {tuple(need)} (batch dims..., {', '.join(what)}; leading dims may "
                     f"broadcast), got {tuple(x.shape)}")


def check(log_gate, segment_ids, query, causal: bool) -> None:
  """Trace-time checks of ``log_gate`` [..., L, H] (floating, causal only) and ``segment_ids`` [..., L] (int).

  Raises:
    TypeError: a non-float ``log_gate`` or non-integer ``segment_ids``.
    ValueError: a shape that does not broadcast to the query's, or ``log_gate`` with ``causal=False``.
  """
  batch, length, heads = query.shape[:-3], query.shape[-3], query.shape[-2]
  if log_gate is not None:
    if not causal:
      raise ValueError("log_gate is a forget gate of causal attention (the decay between a key and a later "
                       "query); got causal=False. Use segment_ids for packed bidirectional attention")
    dtype = getattr(log_gate, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"log_gate must be a floating-point array [..., L, H] (log of the gate, <= 0), got "
                      f"{type(log_gate).__name__} of dtype {dtype}")
    _check_shape("log_gate", log_gate, batch + (length, heads), ("L", "H"))
  if segment_ids is not None:
    dtype = getattr(segment_ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(f"segment_ids must be an integer array [..., L] (equal ids attend to each other), got "
                      f"{type(segment_ids).__name__} of dtype {dtype}")
    _check_shape("segment_ids", segment_ids, batch + (length,), ("L",))


def prepare(log_gate, segment_ids, query, causal: bool, *, previous=None) -> Gates | None:
  """The checked gates of a call, flattened to [N, ...] (None when neither is given).

  ``previous`` [N] int: the segment id before position 0 (a decode state's); position 0 starts a segment
  where it differs.
  """
  check(log_gate, segment_ids, query, causal)
  if log_gate is None and segment_ids is None:
    return None
  batch, length, heads = query.shape[:-3], query.shape[-3], query.shape[-2]
  n = math.prod(batch)
  start = bad = None
  if segment_ids is not None:
    ids = jnp.broadcast_to(segment_ids, batch + (length,)).reshape((n, length))
    first = jnp.zeros((n, 1), bool) if previous is None else (ids[:, :1] != previous[:, None])
    start = jnp.concatenate([first, ids[:, 1:] != ids[:, :-1]], axis=1)
  if not causal:
    return Gates(None, start, None)
  g = jnp.zeros((n, length, heads), jnp.float32)
  if log_gate is not None:
    g = jnp.broadcast_to(log_gate, batch + (length, heads)).reshape((n, length, heads)).astype(jnp.float32)
    bad = jnp.isnan(g) | (g > 0)
    g = jnp.where(bad, 0.0, g)
  if start is not None:
    g = jnp.where(start[..., None], NEG_INF, g)
  return Gates(g, start, bad)


def reset(gates: Gates | None, causal: bool):
  """[N, L] or [N, L, H] bool: where nothing earlier is seen (a −∞ gate, or a segment start); None: nowhere."""
  if gates is None:
    return None
  if causal:
    return jnp.isneginf(gates.log)
  return gates.start


def segment_index(start):
  """[N, L] int32: the segment each position is in (0, 1, ...), counted from the starts."""
  return jnp.cumsum(start.astype(jnp.int32), axis=1)


def decayed_max(a, m, axis: int):
  """Inclusive scan of (a, m) ⊕ (a', m') = (a + a', max(m + a', m')) along ``axis``: m_t = max_{j≤t}(m_j + Σ_{j<l≤t}
  a_l) and the sum of a up to t. ``a`` has one trailing dim fewer than ``m`` (broadcast over it)."""
  def op(x, y):
    a1, m1 = x
    a2, m2 = y
    return a1 + a2, jnp.maximum(m1 + a2[..., None], m2)

  return jax.lax.associative_scan(op, (a, m), axis=axis)


def combine(x, y):
  """The gated monoid on (a, μ, S), h ↦ h·e^a + S·e^μ: (a₁, μ₁, S₁) ⊕ (a₂, μ₂, S₂) = (a₁ + a₂, (μ₁ + a₂, S₁) ⊕ (μ₂, S₂))
  with ⊕ the rescaled sum (``state_lib.rescaled_sum``); a [...], μ [..., Fm], S [..., F, E]."""
  a1, m1, s1 = x
  a2, m2, s2 = y
  return (a1 + a2,) + state_lib.rescaled_sum((m1 + a2[..., None], s1), (m2, s2))


def segsum(g):
  """g [..., C] -> [..., C, C]: D[t, j] = Σ_{j<l≤t} g_l for j ≤ t (0 on the diagonal), −∞ for j > t.

  Summed from t back to j + 1 (all terms ≤ 0: no cancellation, a −∞ gate gives −∞).
  """
  c = g.shape[-1]
  lower = jnp.tril(jnp.ones((c, c), bool))
  terms = jnp.where(lower, g[..., None, :], 0.0)  # [t, l]: g_l for l ≤ t
  tail = jax.lax.associative_scan(jnp.add, terms, axis=terms.ndim - 1, reverse=True)  # Σ_{j≤l≤t}
  exclusive = jnp.concatenate([tail[..., 1:], jnp.zeros_like(tail[..., :1])], axis=-1)  # Σ_{j<l≤t}
  return jnp.where(lower, exclusive, NEG_INF)


def to_end(g, axis: int = 1):
  """Σ_{j<l≤end} g_l for each j along ``axis`` (the decay from position j to the last one)."""
  tail = jax.lax.associative_scan(jnp.add, g, axis=axis % g.ndim, reverse=True)
  zero = jnp.zeros_like(jax.lax.slice_in_dim(g, 0, 1, axis=axis))
  return jnp.concatenate([jax.lax.slice_in_dim(tail, 1, g.shape[axis], axis=axis), zero], axis=axis)


def offset(f, off):
  """LogFeatures ``f`` [..., F] with the log-scale ``off`` [...] added (``state_lib.parts``' normalised form)."""
  log, mult = state_lib.parts(f)
  return type(f)(log + off[..., None], mult)


def bias(g_NLH):
  """The explicit [N, H, L, L] bias Σ_{j<l≤t} g_l (−∞ above the diagonal and across a reset)."""
  return segsum(jnp.swapaxes(g_NLH, 1, 2))


def biased(logits, gates: Gates | None, causal: bool):
  """Logits [N, H, Lq, Lk] with the gates' bias (causal) or −∞ across segments (bidirectional)."""
  if gates is None:
    return logits
  if causal:
    return logits + bias(gates.log)
  seg = segment_index(gates.start)
  return jnp.where((seg[:, :, None] == seg[:, None, :])[:, None], logits, NEG_INF)


def key_state(features: features_lib.Features, k, v, mask, gate, key_offset=None, block: int | None = None):
  """(a, state): the total log gate a [N, H] of the positions and the state of all keys k [N, L, H, D] decayed
  to the last one (``state_lib.key_state`` with gates ``gate`` [N, L, H]; ``key_offset`` [N, L, H]: a decay each
  key carries in, as in ``causal_xla.chunked``), folded a block at a time."""
  block = state_lib.BLOCK if block is None else block

  def step(carry, start, size):
    a, state = carry
    g = state_lib.cut(gate, start, size)
    fk = features_lib.head_major(features, k[:, :0], state_lib.cut(k, start, size))[1]
    carried = to_end(g) if key_offset is None else to_end(g) + state_lib.cut(key_offset, start, size)
    fk = offset(fk, jnp.swapaxes(carried, 1, 2))
    total = jnp.sum(g, axis=1)  # [N, H]
    decayed = state._replace(mu=jax.lax.stop_gradient(state.mu) + total[..., None])
    return a + total, state_lib.add_keys(decayed, fk, state_lib.cut(v, start, size), state_lib.cut(mask, start, size))

  init = (jnp.zeros(k.shape[:1] + k.shape[2:3], jnp.float32), state_lib.initial_state(features, k, k, v))
  return state_lib.fold(step, init, k.shape[1], block)


def exclusive_prefix(a, state, axis_name):
  """The state of every key on the devices before this one along ``axis_name`` (inside ``shard_map``), decayed by
  the gates in between: one ``all_gather`` of (a, μ, S), each earlier device's μ raised by the sum of the a of
  the devices after it and before this one (no device reads a later one)."""
  a_P, mu_P, s_P = jax.lax.all_gather((a, state.mu, state.s), axis_name)
  earlier_P = jnp.arange(a_P.shape[0]) < jax.lax.axis_index(axis_name)
  between_P = to_end(jnp.where(earlier_P[:, None, None], a_P, 0.0), axis=0)  # Σ a_r over q < r < this device
  earlier = earlier_P.reshape((-1,) + (1,) * (mu_P.ndim - 1))
  mu_P = jnp.where(earlier, jax.lax.stop_gradient(mu_P) + between_P[..., None], NEG_INF)
  mu = jax.lax.stop_gradient(jnp.max(mu_P, axis=0))
  weight_P = jnp.exp(mu_P - state_lib.finite_or_zero(mu))  # 0 for this and later devices
  return state_lib.RecurrentState(mu, jnp.sum(s_P * weight_P[..., None], axis=0))
