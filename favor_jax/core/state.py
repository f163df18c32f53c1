"""The log-domain state of keys and its read-out (internal API, what ``favor_jax.parallel`` builds on too).

A state (μ, S) holds keys as S_f = Σ_j e^{log φ(k_j)_f − μ_f}[v_j, 1], μ the
per-feature maximum of their logs; states combine by the rescaled-sum monoid.
Keys are added block by block (:func:`add_keys`, :func:`key_state`), query rows
read a state (:func:`read_out`), and the guarded division turns the read-out's
numerator and denominator into the output. Shape letters: see :mod:`favor_jax.core`.

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

from favor_jax.core import features as features_lib

NEG_INF = -jnp.inf

# The intra-chunk terms of row t are taken against the chunk's per-feature key maximum (one matrix
# product for the whole chunk). A key later in the chunk can raise that maximum above everything row t
# may see; once it does by more than this many e-folds, row t's terms would fall below float32's range,
# and the block is computed by the per-token recurrence instead (the same estimator, exact, slower).
# The terms so dropped are below e^{-(87 - 40)} of the row's largest.
SAFE_GAP = 40.0

# Keys (then queries) per step of a blocked pass: the [N, H, 512, F] features of one block stay in
# cache (the fastest of 256/512/1024/2048 at L=16384 on a 2-core CPU).
BLOCK = 512


def finite_or_zero(m):
  return jnp.where(jnp.isfinite(m), m, 0.0)


def rescaled_sum(a, b):
  """Monoid on (log-scale m, state S): (m₁, S₁) ⊕ (m₂, S₂) = (m, S₁e^{m₁−m} + S₂e^{m₂−m}), m = max."""
  m1, s1 = a
  m2, s2 = b
  m = jax.lax.stop_gradient(jnp.maximum(m1, m2))  # a constant under grad (a gate's gradient flows through S)
  safe = finite_or_zero(m)
  return m, s1 * jnp.exp(m1 - safe)[..., None] + s2 * jnp.exp(m2 - safe)[..., None]


# A feature equal to 0 (ReLU below its hinge, a Taylor coordinate, a user map's zero) adds nothing to a weight,
# so it must not set a row's scale: a query whose features miss a key's would be scaled to that key's largest
# feature, its real terms (an earlier key decayed by a gate, say) falling e^-80 under it and below TINY_DEN,
# a silent zero row. So a feature under e^-SMALL_GAP of its row's largest carries its size in the log, floored
# at e^-ZERO_GAP: a key no feature of the query reaches counts at most e^-ZERO_GAP of its peak, a real term at
# least e^-2·SMALL_GAP of the scale, and rows stay exact down to decays of e^-(ZERO_GAP + 69) (TINY_DEN = e^-69).
# Larger features keep their size in mult: a row's log can be huge (×1e9 inputs: 1e17) and would lose it. The
# floor keeps φ_f = e^{log} · mult differentiable at a zero feature (its gradient lives in mult); its terms fall
# below float32's range only where they are under e^-(87 - ZERO_GAP) of the row's scale.
SMALL_GAP = 20.0
ZERO_GAP = 60.0


def parts(f, keep=None):
  """(log, mult) with |mult| ≤ 1 and log broadcastable ([..., F] or [..., 1]); rows where ``keep``
  (broadcastable to log, e.g. mask[..., None, None] for [N, L, H, F]) is False get log −∞.

  Features given without a log part are split into a per-row scale and the row divided by it, so every
  algorithm sees the same normalised form; then features with a multiplier under e^-SMALL_GAP of their row's
  largest (0 included) get their own size in the log (floored at e^-ZERO_GAP), so that a feature that is 0
  does not set a row's scale (a row all 0: log −∞).
  """
  log, mult = f.log, f.mult
  if mult is not None:
    size = jax.lax.stop_gradient(jnp.abs(mult))
    peak = jnp.max(size, axis=-1, keepdims=True)
    some = peak > 0
    if log is None:  # the row's scale into the log
      log = jnp.log(jnp.where(some, peak, 1.0))
      mult = mult / jnp.where(some, peak, 1.0)
    size = size / jnp.where(some, peak, 1.0)
    bound = jnp.where(size < math.exp(-SMALL_GAP), jnp.maximum(size, math.exp(-ZERO_GAP)), 1.0)
    log = jnp.where(some, log + jnp.log(bound), NEG_INF)  # [..., F]; a row all 0 weighs nothing
    # A select, not a bare division: features normalised twice (an offset, then a state's parts) would otherwise
    # reach XLA as (m / b₁) / b₂, which its simplifier folds into m / (b₁·b₂), and two floors e^-ZERO_GAP
    # multiply to 0 in float32: 0 / 0 for every zero feature (ReLU's decode with a window was NaN from its
    # first token, jitted only). Through the select each division stands alone, as eagerly.
    mult = jnp.where(bound < 1.0, mult / bound, mult)
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


class RecurrentState(NamedTuple):
  """Constant-size causal state of the keys seen so far, in log domain.

  S_f = Σ_{j<t} e^{log φ(k_j)_f − μ_f}[v_j, 1], μ the running per-feature maximum of log φ(k_j). Inside the
  algorithms the batch dims are flattened into N; :func:`~favor_jax.core.favor_decode_init` and
  :func:`~favor_jax.core.favor_decode_step` give and take it with the batch dims ``...`` instead.

  Attributes:
    mu: μ, float32 [N, H, Fm] (Fm: F, or 1 for features without multiplier with one log per row).
    s: S, float32 [N, H, F, Dv+1] (the last column: the denominator's sums).
  """
  mu: Array  # [N, H, Fm]
  s: Array  # [N, H, F, Dv+1]
  segment: Array | None = None  # int32 [N]: a decode state's last segment id (favor_decode_init); None inside


def initial_state(features: features_lib.Features, q, k, v) -> RecurrentState:
  """The state before any key; F and the width of μ are read off the feature map's shapes."""
  log_k, mult_k = jax.eval_shape(lambda q, k: parts(features.fn(q, k)[1]), q[:, :1], k[:, :1])
  f = mult_k.shape[-1] if mult_k is not None else log_k.shape[-1]
  fm = log_k.shape[-1]
  n, _, h = q.shape[:3]
  return RecurrentState(jnp.full((n, h, fm), NEG_INF, jnp.float32),
                        jnp.zeros((n, h, f, v.shape[-1] + 1), jnp.float32))


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


def key_state(features: features_lib.Features, k, v, mask, block: int | None = None) -> RecurrentState:
  """The state of all keys k [N, L, H, D] from the empty one, folded ``block`` (default BLOCK) at a time."""
  block = BLOCK if block is None else block

  def step(state, start, size):
    fk = features_lib.head_major(features, k[:, :0], cut(k, start, size))[1]  # keys only: no query features
    return add_keys(state, fk, cut(v, start, size), cut(mask, start, size))

  return fold(step, initial_state(features, k, k, v), k.shape[1], block)


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
