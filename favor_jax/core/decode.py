"""Decoding: FAVOR attention one token (or a few) at a time, from a constant-size state.

The state of :func:`favor_decode_init` carries the keys seen so far (and, with a window, a ring buffer of the
last keys); :func:`favor_decode_step` adds new keys and reads the new queries, equal to the causal pass of
:func:`~favor_jax.core.favor_attention` / :func:`~favor_jax.core.hybrid_attention` over the whole sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from favor_jax.core import causal_xla, checks, inputs
from favor_jax.core import features as features_lib
from favor_jax.core import gates as gates_lib
from favor_jax.core import hybrid as hybrid_lib
from favor_jax.core import kernels as kernels_lib
from favor_jax.core import precision as precision_lib
from favor_jax.core import state as state_lib
from favor_jax.core.features import for_call as _feature_fn

__all__ = ["favor_decode_init", "favor_decode_step"]


def favor_decode_init(
    query: Float[Array, "... 1 H D"],
    value: Float[Array, "... 1 H Dv"],
    projection: Float[Array, "M D"] | Float[Array, "H M D"] | None,
    *,
    kernel="positive",
    window: int = 0,
) -> state_lib.RecurrentState | hybrid_lib.HybridState:
  """Makes the empty decoding state for :func:`favor_decode_step`, sized from one step's inputs.

  Its arrays (but the hybrid token count) lead with the batch dims: it decodes inputs of that batch shape
  only. Kernel and projection are not recorded (arrays only, for jit and scans): continue with the same ones.

  Args:
    query: one step's query, shape [..., 1, H, D] (sizes the state).
    value: one step's value, shape [..., 1, H, Dv] (sizes the state).
    projection: ω, [M, D] or [H, M, D]; None for a kernel that takes none.
    kernel: as in :func:`favor_attention`.
    window: W ≥ 0, the exact window of :func:`hybrid_attention` (0: plain FAVOR).

  Returns:
    ``window=0``: a :class:`RecurrentState`, S = Σ_j e^{log φ(k_j) − μ}[v_j, 1]ᵀ ([..., H, F, Dv+1]) and μ,
    the running per-feature maximum of log φ(k_j); ``window > 0``: a :class:`HybridState`, the last W keys
    and values ([..., W, H, D + Dv]) and the RecurrentState of the keys before them. Float32.

  Raises:
    TypeError: if an input is not a floating array.
    ValueError: if the shapes disagree, ``window`` is not an int ≥ 0, or the kernel is unknown or lacks a
      projection it needs.
  """
  inputs.validate(query, query, value, None, True)
  window = checks.check_window(window)
  kern, data_dependent = features_lib.resolve_kernel(kernel, projection, None, query)
  rho = jnp.zeros(kern.statistic_shape(query.shape)) if data_dependent else None
  features = features_lib.of_kernel(kern, projection, features_lib.flat_rho(rho, query, kern), True)
  batch = query.shape[:-3]
  q, v = inputs.flatten(query, batch), inputs.flatten(value, batch)
  return _state_batch(_empty_state(features, q, q, v, window), batch)


def _empty_state(features, q, k, v, window):
  if window:
    return hybrid_lib.initial_state(features, q, v, window)
  return state_lib.initial_state(features, q, k, v)._replace(segment=jnp.zeros(q.shape[:1], jnp.int32))


def _state_batch(state, batch):
  """The state's arrays with their leading flattened batch N given the dimensions ``batch`` (0-d leaves kept)."""
  return jax.tree.map(lambda x: x.reshape(batch + x.shape[1:]) if x.ndim else x, state)


def _state_flat(state, batch):
  """Inverse of :func:`_state_batch`: the leading dimensions ``batch`` flattened into one."""
  return jax.tree.map(lambda x: inputs.flatten(x, batch) if x.ndim else x, state)


def _check_state(state, want):
  """``state`` as the type ``want`` has (a plain (mu, s) tuple is taken as a RecurrentState), or a clear error."""
  if isinstance(want, state_lib.RecurrentState) and type(state) is tuple and len(state) == 2:
    state = state_lib.RecurrentState(*state, segment=jnp.zeros(want.segment.shape, want.segment.dtype))
  leaves = lambda s: [getattr(x, "shape", None) for x in jax.tree_util.tree_leaves(s)]
  if type(state) is not type(want) or leaves(state) != leaves(want):
    got = f"{type(state).__name__} with shapes {leaves(state)}"
    raise ValueError(
        f"state is a {got}; these inputs need a {type(want).__name__} with shapes {leaves(want)} "
        "(batch dimensions, heads, features, value size; window). Decode with the batch shape, heads, projection, "
        "value size and window the state was made for (favor_decode_init).")
  dtypes = lambda s: [jnp.dtype(x.dtype if hasattr(x, "dtype") else jnp.result_type(x)).name
                      for x in jax.tree_util.tree_leaves(s)]
  if dtypes(state) != dtypes(want):  # e.g. a cache cast to bfloat16: its running max and sums rounded
    raise TypeError(f"state has leaves of dtypes {dtypes(state)}; favor_decode_init makes {dtypes(want)} "
                    "(the state is kept in float32 whatever the inputs' dtype): do not cast it")
  return state


@precision_lib.honoured
def favor_decode_step(
    state: state_lib.RecurrentState | hybrid_lib.HybridState,
    query: Float[Array, "... l H D"],
    key: Float[Array, "... l H D"],
    value: Float[Array, "... l H Dv"],
    projection: Float[Array, "M D"] | Float[Array, "H M D"] | None,
    *,
    kernel="positive",
    key_mask: Bool[Array, "... l"] | None = None,
    rho: Float[Array, "... H"] | Float[Array, "... H D+1"] | None = None,
    chunk_size: int = 64,
    window: int = 0,
    log_gate: Float[Array, "... l H"] | None = None,
    segment_ids: Int[Array, "... l"] | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[state_lib.RecurrentState | hybrid_lib.HybridState, Float[Array, "... l H Dv"]]:
  """Continues causal FAVOR attention from ``state`` by l ≥ 1 tokens, with O(M·Dv) state per head.

  ``S ← S + φ(k_t)[v_t, 1]ᵀ``, ``out_t = φ(q_t)ᵀS[:, :Dv] / φ(q_t)ᵀS[:, Dv]`` (with the running stabiliser).
  One token costs O(M·(D+Dv)); a longer step (a prompt) runs the chunked algorithm. Steps over tokens 0..t
  give the outputs of ``favor_attention(..., causal=True)``; with ``window > 0`` those of
  ``hybrid_attention(..., window=window, causal=True)`` (O(window·(D+Dv) + F·Dv) state; one token at a time).

  ``log_gate``: the state (and a window's buffer) decays as in :func:`favor_attention`. ``segment_ids``: the
  state records the last id; a token whose id differs from the one before (also the state's) starts afresh.
  Pass them on every step or on none.

  Args:
    state: from :func:`favor_decode_init` or the last step (a ``(mu, s)`` tuple reads as a RecurrentState).
    query: queries, shape [..., l, H, D].
    key: keys, shape [..., l, H, D].
    value: values, shape [..., l, H, Dv].
    projection: ω, [M, D] or [H, M, D], the one the state was made with.
    kernel: the kernel the state was made with: a name in ``KERNELS`` or a :class:`~favor_jax.core.kernels.Kernel`
      record, as in :func:`favor_attention`.
    key_mask: optional bool [..., l]; False leaves a key out.
    rho: a data-dependent kernel's statistic (required: decoding is causal), as in :func:`favor_attention`.
    chunk_size: C, the chunk length for a step of l > 1 tokens.
    window: W, the window the state was made with.
    log_gate: optional float [..., l, H], the log of a forget gate per position and head, causal
      only, as in :func:`~favor_jax.core.favor_attention`.
    segment_ids: optional int [..., l], packed documents, as in :func:`~favor_jax.core.favor_attention`.
      A new id resets the state (the state records the last id): pass ids on every step or on none.
    precision: the precision of every dot product of the call, as in :func:`~favor_jax.core.favor_attention`.

  Returns:
    ``(new_state, out)``: the state after these tokens (NaN once a non-finite key or value was seen) and
    the output, shape [..., l, H, Dv], in the inputs' dtype.

  Raises:
    TypeError: if an input is not a floating array, or the state's leaves are not float32 (a cast cache).
    ValueError: if the state's type or shapes do not fit these inputs (batch shape, heads, features, value
      size, window), or as :func:`favor_attention` raises for shapes, kernel, ``rho``, ``chunk_size`` and ``precision``.
  """
  inputs.validate(query, key, value, key_mask, True)
  chunk_size = checks.check_chunk_size(chunk_size)
  window = checks.check_window(window)
  features = _feature_fn(kernel, projection, rho, query, key, key_mask, True)
  batch = query.shape[:-3]
  want = jax.eval_shape(lambda *x: _state_batch(_empty_state(features, *(inputs.flatten(y, batch) for y in x),
                                                             window), batch), query, key, value)
  state = _state_flat(_check_state(state, want), batch)
  gates = gates_lib.prepare(log_gate, segment_ids, query, True, previous=state.segment)
  segment = state.segment if segment_ids is None else jnp.broadcast_to(
      segment_ids, query.shape[:-2]).reshape(-1, query.shape[-3])[:, -1].astype(jnp.int32)
  gate = None if gates is None else gates.log
  recurrent = state.recurrent if window else state
  poisoned = ~jnp.all(jnp.isfinite(recurrent.s), axis=(-2, -1)) | jnp.any(jnp.isnan(recurrent.mu), axis=-1)
  clean = lambda s: s._replace(**{f: jnp.where(jnp.isfinite(x) | jnp.isneginf(x), x, 0.0)
                                  for f, x in (("mu", s.mu), ("s", s.s))}, segment=None)  # the passes' carry

  def step(q, k, v, mask, seen):  # seen [N, H]: a non-finite key or value up to the last token (or before)
    spoil = lambda s: s._replace(**{f: jnp.where(seen.reshape(seen.shape + (1,) * (x.ndim - 2)), jnp.nan, x)
                                    for f, x in (("mu", s.mu), ("s", s.s))})
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    if window:
      new, num, den = hybrid_lib.step(features, state._replace(recurrent=clean(recurrent)), q, k, v, mask, gate)
      return state_lib.divide(num, den), new._replace(recurrent=spoil(new.recurrent), segment=segment)
    if q.shape[1] == 1:
      fq, fk = features.fn(q, k)
      first = lambda f: kernels_lib.LogFeatures(*(None if x is None else x[:, 0] for x in f))
      new, num, den = causal_xla.advance(clean(state), first(fq), first(fk), v[:, 0], mask[:, 0],
                                         gate=None if gate is None else gate[:, 0])
      num, den = num[:, None], den[:, None]
    else:
      num, den, new = causal_xla.chunked(features, q, k, v, mask, chunk_size=chunk_size, state=clean(state),
                                         return_state=True, gate=gate)
    return state_lib.divide(num, den), spoil(new)._replace(segment=segment)

  out, state = inputs.decode_envelope(step, query, key, value, key_mask, prior=poisoned, gates=gates)
  return _state_batch(state, batch), out
