"""What the attention algorithms share, and what ``favor_jax.parallel`` builds on (internal API).

The log-domain state and its monoid, key summaries and the read-out of a state,
padding, input validation, kernel resolution, non-finite handling and the
guarded division. Shape letters: see :mod:`favor_jax.core`.

Stabilisers (all offsets are constants under ``grad``; they cancel exactly):
keys are scaled per feature by a maximum over the keys a query may see (all
unmasked keys, or only past keys when causal, the state rescaled when the
maximum grows, as online softmax does); each query row is scaled by its
largest term, so the largest term of its denominator is 1 for positive
features.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from favor_jax.core import checks
from favor_jax.core import kernels as kernels_lib

NEG_INF = -jnp.inf


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


def split_nonfinite(q, k, v, mask, *, causal: bool, axis_name=None, prior=None, gates=None):
  """Non-finite inputs, taken out of the computation and marked (one rule for every algorithm).

  Returns q, k, v with non-finite entries (and masked keys) set to 0, and ``bad`` [N, Lq, H]: the
  rows whose exact output depends on a non-finite input — their own query, or
  an unmasked key or value they may see (j ≤ t if ``causal``). Masked keys are
  absent, whatever they hold. ``axis_name``: the sequence is split over this
  mesh axis (inside ``shard_map``); keys on earlier devices count as seen (all
  devices', if not causal). ``prior`` [N, H]: a non-finite key came before
  (a poisoned decode state). Also returns ``seen`` [N, H]: whether the keys
  up to the last position held one (the state after them is poisoned). ``gates``: a ``gates.Gates``; a bad
  log gate counts as a non-finite key at its position, and nothing is seen across a reset (causal: a −∞
  gate; bidirectional: the rows of other segments).
  """
  finite = lambda x: jnp.all(jnp.isfinite(x), axis=-1)
  bad_kv = ~(finite(k) & finite(v)) & mask[:, :, None]
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
  k = jnp.where(mask[:, :, None, None], zero(k), jnp.zeros((), k.dtype))
  return zero(q), k, zero(v), ~finite(q) | seen, seen[:, -1]


def poison(out, bad):
  """NaN in the rows ``bad`` [N, L, H] of out [N, L, H, Dv], as exact attention gives.

  Added, so that gradients pass through unchanged: those of other rows are what
  they would be without the non-finite input (a product with NaN would make
  every gradient NaN, also of losses on earlier rows, through 0·NaN).
  """
  return out + jnp.where(bad[..., None], jnp.nan, 0.0)


def finite_or_zero(m):
  return jnp.where(jnp.isfinite(m), m, 0.0)


def rescaled_sum(a, b):
  """Monoid on (log-scale m, state S): (m₁, S₁) ⊕ (m₂, S₂) = (m, S₁e^{m₁−m} + S₂e^{m₂−m}), m = max."""
  m1, s1 = a
  m2, s2 = b
  m = jax.lax.stop_gradient(jnp.maximum(m1, m2))  # a constant under grad (a gate's gradient flows through S)
  safe = finite_or_zero(m)
  return m, s1 * jnp.exp(m1 - safe)[..., None] + s2 * jnp.exp(m2 - safe)[..., None]


def parts(f, keep=None):
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


def keep_rows(mask):
  """An [N, L] (or [N]) key mask as the ``keep`` of L-major [N, L, H, F] features."""
  return None if mask is None else mask[..., None, None]


def exp_times(log, offset, mult):
  out = jnp.exp(log - jax.lax.stop_gradient(offset))
  return out if mult is None else out * mult


def with_ones(v):
  return jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)


def head_major(feature_fn, q, k):
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


def pad_to(x, length, value=0):
  pad = length - x.shape[1]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


class RecurrentState(NamedTuple):
  """Constant-size causal state: S_f = Σ_{j<t} e^{log φ(k_j)_f − μ_f}[v_j, 1], μ the running max."""
  mu: Array  # [N, H, Fm]
  s: Array  # [N, H, F, Dv+1]
  segment: Array | None = None  # int32 [N]: a decode state's last segment id (favor_decode_init); None inside


def initial_state(feature_fn, q, k, v) -> RecurrentState:
  """The state before any key; F and the width of μ are read off the feature map's shapes."""
  fk = jax.eval_shape(feature_fn, q[:, :1], k[:, :1])[1]
  f = fk.mult.shape[-1] if fk.mult is not None else fk.log.shape[-1]
  fm = 1 if fk.log is None else fk.log.shape[-1]
  n, _, h = q.shape[:3]
  return RecurrentState(jnp.full((n, h, fm), NEG_INF, jnp.float32),
                        jnp.zeros((n, h, f, v.shape[-1] + 1), jnp.float32))


def validate(query, key, value, key_mask, causal, q_name="query", k_name="key", query_mask=None):
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


# Denominators are normalised so that an aligned term is ~1; below this nothing reliable is
# left (and 1/den would overflow in the backward pass), so the row counts as empty.
TINY_DEN = 1e-30


@jax.custom_jvp
def _ratio(num, den):
  return num / den


@_ratio.defjvp
def _ratio_jvp(primals, tangents):
  # d(n/d) = (dn − (n/d)·dd)/d: never forms 1/d², which overflows for small d.
  (num, den), (d_num, d_den) = primals, tangents
  out = num / den
  return out, (d_num - out * d_den) / den


def divide(num, den):
  """num / den, with 0 where nothing was attended to (all keys masked, or a vanishing denominator).

  A NaN denominator stays NaN: a non-finite number never turns into a silent 0.
  """
  den = den[..., None]
  empty = jnp.abs(den) <= TINY_DEN
  return jnp.where(empty, 0.0, _ratio(num, jnp.where(empty, 1.0, den)))


def out_dtype(*xs):
  return jnp.result_type(*[x.dtype for x in xs])


def resolve_kernel(kernel, projection, rho, query):
  """(kernel, whether it is data-dependent), after checking projection and rho against it."""
  kern = kernels_lib.get_kernel(kernel)
  record = isinstance(kern, kernels_lib.Kernel)
  name = kern.name if record else getattr(kern, "__name__", repr(kern))
  if projection is not None:
    if record:
      kern.check_projection_given(projection)
    checks.check_projection(projection, query.shape[-1], query.shape[-2])
  elif not record or kern.needs_projection:
    raise ValueError(f"kernel {name!r} needs a projection [M, {query.shape[-1]}], got None")
  data_dependent = record and kern.data_dependent
  if rho is not None and not data_dependent:
    raise ValueError(f"rho passes the statistic of a data-dependent kernel (one of "
                     f"{kernels_lib.data_dependent_names()}); kernel {name!r} takes none")
  return kern, data_dependent


def flat_rho(rho, query, kern):
  """The statistic ``rho`` broadcast to ``kern.statistic_shape`` and flattened to [N, H, ...] like the
  batch; None stays None."""
  if rho is None:
    return None
  shape = kern.statistic_shape(query.shape)
  rho = jnp.asarray(rho, jnp.float32)
  try:
    rho = jnp.broadcast_to(rho, shape)
  except ValueError:
    raise ValueError(f"rho must broadcast to {kern.name}'s statistic shape {shape}, got shape "
                     f"{rho.shape}") from None
  return rho.reshape((-1,) + shape[query.ndim - 3:])


def feature_fn_for(kern, projection, rho_NH, causal):
  """feature_fn(q, k) -> (LogFeatures, LogFeatures) on flattened [N, l, H, D] slices.

  Our kernels with a shared (or no) projection are ``layout_free`` (per row, ρ
  aligned with the heads axis whatever the leading dims); a user callable with its own key
  stabiliser (a max over all positions) is ``whole_sequence``.
  """
  if isinstance(kern, kernels_lib.Kernel):
    def feature_fn(q, k):
      trailing = () if rho_NH is None else rho_NH.shape[2:]  # the statistic's shape beyond [N, H]
      given = {} if rho_NH is None else {kern.statistic: rho_NH.reshape(q.shape[:-3] + q.shape[-2:-1] + trailing)}
      return kern.log_features(q, k, projection, **given)

    # A per-head projection [H, M, D] pairs ω with the heads axis, so the rows keep their layout.
    feature_fn.layout_free = projection is None or projection.ndim == 2
    return feature_fn

  def feature_fn(q, k):
    # stabilize=True would scale keys by a max over all positions, future ones included.
    qf, kf = kern(q, k, projection, stabilize=not causal)
    return (kernels_lib.LogFeatures(None, qf.astype(jnp.float32)),
            kernels_lib.LogFeatures(None, kf.astype(jnp.float32)))

  feature_fn.whole_sequence = not causal
  return feature_fn


# Keys (then queries) per step of a blocked pass: the [N, H, 512, F] features of one block stay in
# cache (the fastest of 256/512/1024/2048 at L=16384 on a 2-core CPU).
BLOCK = 512


def cut(x, start, size):
  """x[:, start:start + size] (a traced start allowed)."""
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def fold(step, init, size: int, block: int):
  """``step(carry, start, size)`` over [0, size) in blocks: a loop over the full ones, then the rest."""
  block = max(min(block, size), 1)
  full, rest = divmod(size, block)
  if full:  # the first block outside the loop: its result has the inputs' types (e.g. varying
    init = step(init, 0, block)  # over a shard_map axis), which the loop's carry must have
  out = jax.lax.fori_loop(1, full, jax.checkpoint(lambda i, c: step(c, i * block, block)), init)
  return step(out, full * block, rest) if rest else out


def add_keys(state: RecurrentState, fk, v, mask) -> RecurrentState:
  """``state`` with keys added: fk head-major LogFeatures [N, H, l, F]; v [N, l, H, Dv]; mask [N, l]."""
  log_k, mult_k = parts(fk, None if mask is None else mask[:, None, :, None])
  mu_NHF = jax.lax.stop_gradient(jnp.max(log_k, axis=2))
  k_hat = exp_times(log_k, finite_or_zero(mu_NHF)[:, :, None], mult_k)
  v1_NHlE = with_ones(jnp.swapaxes(v, 1, 2))
  return RecurrentState(*rescaled_sum((state.mu, state.s), (mu_NHF, jnp.einsum("nhlf,nhle->nhfe", k_hat, v1_NHlE))))


def key_state(feature_fn, k, v, mask, block: int | None = None) -> RecurrentState:
  """The state of all keys k [N, L, H, D] from the empty one, folded ``block`` (default BLOCK) at a time."""
  block = BLOCK if block is None else block

  def step(state, start, size):
    fk = head_major(feature_fn, k[:, :0], cut(k, start, size))[1]  # keys only: no query features
    return add_keys(state, fk, cut(v, start, size), cut(mask, start, size))

  return fold(step, initial_state(feature_fn, k, k, v), k.shape[1], block)


def read_out(fq, state: RecurrentState, *, with_scale: bool = False):
  """Query rows against a state: fq LogFeatures [..., R, F], state μ [..., F], S [..., F, E] -> [..., R, E].

  Each row is scaled by its largest term s = max_f (log φ(q)_f + μ_f); ``with_scale``
  also returns s [..., R] (a constant under grad; −∞ for the empty state).
  """
  log_q, mult_q = parts(fq)
  # A feature no key has (μ_f = −∞) adds nothing: it must not set the row's scale (taken as μ_f = 0 it
  # could exceed every real term by more than float32's range, and the row would come out 0).
  shifted = log_q + state.mu[..., None, :]
  scale = jax.lax.stop_gradient(jnp.max(shifted, axis=-1))
  y = jnp.einsum("...rf,...fe->...re", exp_times(shifted, finite_or_zero(scale)[..., None], mult_q), state.s)
  if not with_scale:
    return y
  seen = jnp.any(jnp.isfinite(state.mu), axis=-1, keepdims=True)
  return y, jnp.where(seen, scale, NEG_INF)

