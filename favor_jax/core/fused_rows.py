"""What the fused causal kernels' callers do around them (internal): the inputs as padded head-major rows, which
rows have a key in reach, the gates' gradient from the features', and the redo of rows that lost their terms.

Shape letters: see :mod:`favor_jax.core`; R = N·H rows of (sequence, head), L padded to whole chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from favor_jax.core.features import head_major
from favor_jax.core.fused import _floating_first_order as first_order_only  # noqa: F401 (re-exported)
from favor_jax.core.fused import lost_rows
from favor_jax.core.state import parts

NEG_INF = -jnp.inf


class Rows(NamedTuple):
  """A call's inputs as rows: ``log_rows(q, k, mask, *consts)`` -> log features [R, L, F] (float32, −∞ for masked keys,
  padded features and positions), ``value_rows(v)`` -> [R, L, E] (the value, a column of ones, zeros; a
  function of v alone, so that a custom VJP keeps v, not its padded rows), gate [R, L] or None,
  seen [R, L] bool (a key in reach: unmasked, at or before the row, no reset in between), and ``back``
  ([R, L, ...] -> [N, L, H, ...], the padding cut)."""
  log_rows: Callable
  consts: list
  value_rows: Callable
  gate: Array | None
  seen: Array
  back: Callable


def _round_up(n, unit):
  return -(-n // unit) * unit


def _running_max(x):
  return jax.lax.associative_scan(jnp.maximum, x, axis=x.ndim - 1)


def prepare(features, q, k, v, mask, gate, *, chunk: int, lane: int) -> Rows:
  """The rows of q, k [N, L, H, D], v [N, L, H, Dv], mask [N, L], gate [N, L, H] (or None): L padded to a
  multiple of ``chunk``, features and E = Dv + 1 to a multiple of ``lane``."""
  n, length, h = q.shape[:3]
  f = jax.eval_shape(lambda: head_major(features, q, k)[0].log).shape[-1]
  padded, fp, ep = _round_up(length, chunk), _round_up(f, lane), _round_up(v.shape[-1] + 1, lane)

  def rows(x, value, width=None):  # [N, H, L, W] or [N, H, L] -> [N·H, padded(, width)]
    x = x.reshape((n * h,) + x.shape[2:])
    pad = [(0, 0), (0, padded - length)] + ([] if width is None else [(0, width - x.shape[-1])])
    return jnp.pad(x, pad, constant_values=value)

  def log_rows(q, k, mask):
    fq, fk = head_major(features, q, k)
    log_q, _ = parts(fq)
    log_k, _ = parts(fk, mask[:, None, :, None])
    return rows(log_q.astype(jnp.float32), NEG_INF, fp), rows(log_k.astype(jnp.float32), NEG_INF, fp)

  # The features' own parameters (projection, ρ, a learned map) as explicit arguments of the custom VJP; the mask
  # an argument too (closure_convert hoists floats only: a traced bool left in the closure leaks out of a
  # platform_dependent branch differentiated by grad).
  log_rows, consts = jax.closure_convert(log_rows, q, k, mask)

  def value_rows(v):  # [N, L, H, Dv] -> [R, L, E]: the value, a column of ones (the denominator), zeros
    ones = jnp.ones(v.shape[:-1] + (1,), v.dtype)
    return rows(jnp.swapaxes(jnp.concatenate([v, ones], axis=-1), 1, 2), 0.0, ep)
  position = jnp.arange(length)
  last_key = _running_max(jnp.where(mask, position, -1))[:, None, :]  # [N, 1, L]
  g = None
  if gate is None:
    seen = jnp.broadcast_to(last_key >= 0, (n, h, length))
  else:
    g = jnp.swapaxes(gate.astype(jnp.float32), 1, 2)  # [N, H, L]
    last_reset = _running_max(jnp.where(g == NEG_INF, position, -1))
    seen = (last_key >= 0) & (last_key >= last_reset)
    g = rows(g, 0.0)
  seen = rows(seen, False)
  back = lambda x: jnp.swapaxes(x[:, :length].reshape((n, h, length) + x.shape[2:]), 1, 2)
  return Rows(log_rows, consts, value_rows, g, seen, back)


def gate_grad(x, g):
  """∂g [R, L] from x_t = Σ_f (∂ℓq_tf − ∂ℓk_tf) [R, L]: ∂g_l = Σ_{t≥l} x_t, summed up to the next reset
  only (the pairs across it have weight 0: fewer terms, no cancellation), 0 at a reset (−∞ gate)."""
  reset = g == NEG_INF
  # In reverse order a reset ends its segment: a segment starts right after one.
  xr, start = x[:, ::-1], jnp.concatenate([jnp.zeros_like(reset[:, :1]), reset[:, ::-1][:, :-1]], axis=1)

  def op(a, b):
    (xa, sa), (xb, sb) = a, b
    return jnp.where(sb, xb, xa + xb), sa | sb

  summed, _ = jax.lax.associative_scan(op, (xr, start), axis=1)
  return jnp.where(reset, 0.0, summed[:, ::-1])


def redo_lost(features, q, k, v, mask, gate, out, chunk: int, return_scale: bool, fallback):
  """``out`` = (num, den, scale), or the ``fallback`` pass's where a row lost its terms (see
  :func:`favor_jax.core.fused.lost_rows`); ``fallback`` None or False: ``out`` as it is (tests only)."""
  if fallback:
    given = {} if gate is None else {"gate": gate}
    out = jax.lax.cond(
        jnp.any(lost_rows(out[1], out[2])),
        lambda: tuple(fallback(features, q, k, v, mask, chunk_size=chunk, return_scale=True, **given)),
        lambda: tuple(out))
  return tuple(out) if return_scale else tuple(out[:2])
