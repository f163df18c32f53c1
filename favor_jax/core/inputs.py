"""What every attention function does to its inputs and output (internal API, ``favor_jax.parallel`` too).

Validation, the batch dims flattened into one, the key mask as [N, L], padding,
and the input envelope: flatten the batch → take non-finite inputs out
(:func:`split_nonfinite`) → the algorithm → NaN in the rows that saw one
(:func:`poison`) → the batch dims back → the inputs' dtype. :func:`envelope`
is that whole path; :func:`over_batch` and :func:`without_nonfinite` are its
two halves, for the sequence-parallel path that runs the inner one per device.
Shape letters: see :mod:`favor_jax.core`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from favor_jax.core import checks, statistics


def validate(query, key, value, key_mask, causal, q_name="query", k_name="key", query_mask=None):
  """The checks of an attention call's arrays and ``causal``, naming the arguments as ``q_name``/``k_name``."""
  checks.check_bool("causal", causal)
  try:
    checks.check_qk(query, key)
  except (TypeError, ValueError) as e:
    raise type(e)(str(e).replace("query", q_name).replace("key", k_name)) from None
  checks.check_lengths(query, key)
  checks.check_value(key, value)
  checks.check_key_mask(key_mask, key.shape)
  checks.check_key_mask(query_mask, query.shape, "query_mask")
  if causal:
    checks.check_causal_lengths(query, key)


def flatten(x, batch):
  return x.reshape((math.prod(batch),) + x.shape[len(batch):])


def mask_NL(key_mask, key):
  batch, length = key.shape[:-3], key.shape[-3]
  if key_mask is None:
    return jnp.ones((math.prod(batch), length), bool)
  return flatten(jnp.broadcast_to(key_mask, batch + (length,)), batch)


def out_dtype(*xs):
  return jnp.result_type(*[x.dtype for x in xs])


def pad_to(x, length, value=0):
  """x [N, L, ...] padded with ``value`` at the end of L to ``length``."""
  pad = length - x.shape[1]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _or_reset(x, y):
  """Monoid of (reset, flag): a reset forgets the flags before it."""
  r1, f1 = x
  r2, f2 = y
  return r1 | r2, f2 | (f1 & ~r2)


def _seen_causal(bad, resets, axis_name=None):
  """bad [N, L, H] flags of positions; [N, L, H]: a flag at some j ≤ t with no reset (resets [N, L(, H)]) in
  (j, t], on this device or (``axis_name``) an earlier one."""
  resets = jnp.broadcast_to(resets if resets.ndim == bad.ndim else resets[..., None], bad.shape)
  reset_NLH, seen = jax.lax.associative_scan(_or_reset, (resets, bad), axis=1)
  if axis_name is not None:  # (reset, flag) of each device, folded over the earlier ones
    r_P, f_P = jax.lax.all_gather((reset_NLH[:, -1], seen[:, -1]), axis_name)
    earlier_P = (jnp.arange(r_P.shape[0]) < jax.lax.axis_index(axis_name))[:, None, None]
    r_P, f_P = r_P & earlier_P, f_P & earlier_P
    carried = r_P[0], f_P[0]
    for p in range(1, r_P.shape[0]):
      carried = _or_reset(carried, (r_P[p], f_P[p]))
    seen = seen | (carried[1][:, None] & ~reset_NLH)
  return seen


def _seen_segment(bad, start):
  """bad [N, L, H]; [N, L, H]: a flag anywhere in t's segment (start [N, L])."""
  fwd = _seen_causal(bad, start)
  ends = jnp.concatenate([start[:, 1:], jnp.zeros_like(start[:, :1])], axis=1)  # t is the last of its segment
  back = jnp.flip(_seen_causal(jnp.flip(bad, 1), jnp.flip(ends, 1)), 1)
  return fwd | back


def split_nonfinite(q, k, v, mask, *, causal: bool, axis_name=None, prior=None, in_range: bool = True,
                    gates=None):
  """Non-finite inputs, taken out of the computation and marked (one rule for every algorithm).

  Returns q, k, v with non-finite entries (and masked keys) set to 0, and ``bad`` [N, Lq, H]: the
  rows whose exact output depends on a non-finite input — their own query, or
  an unmasked key or value they may see (j ≤ t if ``causal``). ``in_range`` (feature maps: every caller but
  exact softmax and given features): a query or key row beyond the kernels' range
  (``statistics.in_range``) counts as non-finite, and is set to 0 whole. Masked keys are
  absent, whatever they hold. ``axis_name``: the sequence is split over this
  mesh axis (inside ``shard_map``); keys on earlier devices count as seen (all
  devices', if not causal). ``prior`` [N, H]: a non-finite key came before
  (a poisoned decode state). Also returns ``seen`` [N, H]: whether the keys
  up to the last position held one (the state after them is poisoned). ``gates``: a ``gates.Gates``; a bad
  log gate counts as a non-finite key at its position, and nothing is seen across a reset (causal: a −∞
  gate; bidirectional: the rows of other segments).
  """
  finite = lambda x: jnp.all(jnp.isfinite(x), axis=-1)
  ok = statistics.in_range if in_range else finite
  ok_q, ok_k = ok(q), ok(k)
  bad_kv = ~(ok_k & finite(v)) & mask[:, :, None]
  resets = None
  if gates is not None:
    bad_kv = bad_kv if gates.bad is None else bad_kv | gates.bad
    resets = jnp.isneginf(gates.log) if causal else gates.start
  if prior is not None:
    first = prior if resets is None else prior & ~(resets[:, 0] if resets.ndim == 3 else resets[:, :1])
    bad_kv = bad_kv.at[:, 0].set(bad_kv[:, 0] | first)
  if resets is not None:
    seen = _seen_causal(bad_kv, resets, axis_name) if causal else _seen_segment(bad_kv, resets)
  elif causal:
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
  # Masked keys are zeros from here on: a user's feature map that stabilises over the keys it is given
  # must not scale the unmasked ones by a masked key's features (they could underflow to silent zeros).
  k = jnp.where((mask[:, :, None] & ok_k)[..., None], k, jnp.zeros((), k.dtype))
  q = jnp.where(ok_q[..., None], q, jnp.zeros((), q.dtype))
  return q, k, zero(v), ~ok_q | seen, seen[:, -1]


def poison(out, bad):
  """NaN in the rows ``bad`` [N, L, H] of out [N, L, H, Dv], as exact attention gives.

  Added, so that gradients pass through unchanged: those of other rows are what
  they would be without the non-finite input (a product with NaN would make
  every gradient NaN, also of losses on earlier rows, through 0·NaN).
  """
  return out + jnp.where(bad[..., None], jnp.nan, 0.0)


def over_batch(fn, query, key, value, key_mask):
  """The outer half of the envelope: ``fn(q, k, v, mask)`` on the batch dims flattened into one (q, k, v
  [N, L, H, ·], mask [N, Lk]) returns (out [N, Lq, H, Dv], carry); returns (out with the batch dims back, in
  the inputs' dtype, carry as it is)."""
  batch = query.shape[:-3]
  out, carry = fn(*(flatten(x, batch) for x in (query, key, value)), mask_NL(key_mask, key))
  return out.reshape(batch + out.shape[1:]).astype(out_dtype(query, key, value)), carry


def without_nonfinite(algorithm, q, k, v, mask, *, causal: bool, axis_name=None, prior=None, in_range=True,
                      gates=None):
  """The inner half of the envelope: ``algorithm(q, k, v, mask, seen)`` on inputs with their non-finite entries
  zeroed (``split_nonfinite``, whose arguments ``causal``, ``axis_name``, ``prior``, ``in_range``, ``gates`` are;
  ``seen`` [N, H]: the
  state after the last key is poisoned) returns (out [N, Lq, H, Dv], carry); returns (out with NaN in the
  rows that may see a non-finite input, carry as it is)."""
  q, k, v, bad, seen = split_nonfinite(q, k, v, mask, causal=causal, axis_name=axis_name, prior=prior,
                                       in_range=in_range, gates=gates)
  out, carry = algorithm(q, k, v, mask, seen)
  return poison(out, bad), carry


def envelope(algorithm, query, key, value, key_mask, *, causal: bool, in_range: bool = True, gates=None):
  """An attention call's path around its algorithm: ``algorithm(q, k, v, mask) -> out [N, Lq, H, Dv]`` on the
  flattened batch with non-finite inputs taken out; returns out [..., Lq, H, Dv] in the inputs' dtype, NaN
  in the rows that may see a non-finite input (``in_range``: or a query or key beyond the kernels' range;
  ``gates``: a flattened ``gates.Gates``, see :func:`split_nonfinite`)."""
  inner = lambda *x: without_nonfinite(lambda q, k, v, mask, _: (algorithm(q, k, v, mask), None), *x,
                                       causal=causal, in_range=in_range, gates=gates)
  return over_batch(inner, query, key, value, key_mask)[0]


def decode_envelope(step, query, key, value, key_mask, *, prior, gates=None):
  """:func:`envelope` for a decode step continuing a state: ``step(q, k, v, mask, seen) -> (out, state)``,
  ``prior`` and ``seen`` [N, H] whether the state before and after the step is poisoned; returns
  (out [..., l, H, Dv] in the inputs' dtype, the state on the flattened batch); ``gates`` as in
  :func:`envelope`."""
  inner = lambda *x: without_nonfinite(step, *x, causal=True, prior=prior, gates=gates)
  return over_batch(inner, query, key, value, key_mask)
