"""Decoding: FAVOR attention one token (or a few) at a time, from a constant-size state.

The state of :func:`favor_decode_init` carries the keys seen so far (and, with a window, a ring buffer of the
last keys); :func:`favor_decode_step` adds new keys and reads the new queries, equal to the causal pass of
:func:`~favor_jax.core.favor_attention` / :func:`~favor_jax.core.hybrid_attention` over the whole sequence.

Grouped-query attention: given key and value with Hkv < H heads (H a multiple of Hkv), the state holds one
head per key/value head, and query head h reads the state of key/value head ``h // (H // Hkv)``. That is exact
because the state holds only the keys' side (Σφ(k)[v, 1]ᵀ, its running maximum, a window's keys): it is the
same for every query head of a group when the keys' features are, i.e. with a projection shared by all heads
([M, D]), a kernel without a statistic of the data, and gates per key/value head (or none). Those are checked;
where they do not hold, repeat key and value to the query's heads (one state per query head, as before).
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

  Grouped-query attention: a value with Hkv < H heads (H a multiple of Hkv) makes a state per key/value head,
  1/(H/Hkv) the size, which :func:`favor_decode_step` then takes with key and value of Hkv heads (see the
  module's docstring for when that is exact; a per-head projection or a data-dependent kernel is refused).

  Args:
    query: one step's query, shape [..., 1, H, D] (sizes the state).
    value: one step's value, shape [..., 1, H, Dv], or [..., 1, Hkv, Dv] for a state per key/value head.
    projection: ω, [M, D] or [H, M, D]; None for a kernel that takes none.
    kernel: as in :func:`favor_attention`.
    window: W ≥ 0, the exact window of :func:`hybrid_attention` (0: plain FAVOR).

  Returns:
    ``window=0``: a :class:`RecurrentState`, S = Σ_j e^{log φ(k_j) − μ}[v_j, 1]ᵀ ([..., H, F, Dv+1]) and μ,
    the running per-feature maximum of log φ(k_j); ``window > 0``: a :class:`HybridState`, the last W keys
    and values ([..., W, H, D + Dv]) and the RecurrentState of the keys before them. Float32. H is the
    value's heads (Hkv for a state per key/value head).

  Raises:
    TypeError: if an input is not a floating array.
    ValueError: if the shapes disagree (a value's heads must divide the query's), ``window`` is not an int ≥ 0,
      the kernel is unknown or lacks a projection it needs, or a state per key/value head would not be exact.
  """
  groups = _groups(query, value, projection, kernel, "value")
  like_key = query[..., ::groups, :]  # a stand-in key of the state's heads
  inputs.validate(like_key, like_key, value, None, True)
  window = checks.check_window(window)
  kern, data_dependent = features_lib.resolve_kernel(kernel, projection, None, like_key)
  rho = jnp.zeros(kern.statistic_shape(like_key.shape)) if data_dependent else None
  features = features_lib.of_kernel(kern, projection, features_lib.flat_rho(rho, like_key, kern), True)
  batch = query.shape[:-3]
  k, v = inputs.flatten(like_key, batch), inputs.flatten(value, batch)
  return _state_batch(_empty_state(features, k, k, v, window), batch)


def _groups(query, kv, projection, kernel, name: str) -> int:
  """G = H // Hkv, the query heads that read one state head: 1 when ``kv`` (the key or value) has the query's
  heads (or shapes that the input checks will refuse); else checked that one state per key/value head is exact.

  Raises:
    ValueError: if Hkv does not divide H, or the state per key/value head would not be exact (a projection per
      head, a data-dependent kernel, a kernel that is not a record).
  """
  if not (hasattr(query, "shape") and hasattr(kv, "shape")) or query.ndim < 3 or kv.ndim != query.ndim:
    return 1
  heads, kv_heads = query.shape[-2], kv.shape[-2]
  if kv_heads == heads:
    return 1
  if kv_heads == 0 or heads % kv_heads:
    raise ValueError(f"{name} has {kv_heads} heads and query {heads}: for a state per key/value head (grouped-query "
                     f"attention) the key's and value's heads must divide the query's ({name} shape {kv.shape}, "
                     f"query shape {query.shape})")
  why = None
  if projection is not None and jnp.ndim(projection) == 3:
    why = (f"projection has shape {jnp.shape(projection)}, one per query head: the keys' features differ between "
           "the query heads of a group")
  kern = kernels_lib.get_kernel(kernel)
  if not isinstance(kern, kernels_lib.Kernel):
    why = "the kernel is a callable, not a Kernel record: its key features may depend on the query heads"
  elif kern.data_dependent:
    why = (f"kernel {kern.name!r} takes a statistic of the data per query head (its {kern.statistic!r}), so the "
           "keys' features differ between the query heads of a group")
  if why:
    raise ValueError(f"{name} has {kv_heads} heads and query {heads} (a state per key/value head), but {why}; "
                     "repeat key and value to the query's heads for a state per query head")
  return heads // kv_heads


# The head axis of each decode state's arrays, on the flattened batch (None: no head axis).
_HEAD_AXES = {"mu": 1, "s": 1, "keys": 2, "values": 2, "decay": 2}


def _by_heads(state, fn):
  """``state`` with ``fn(x, axis)`` applied to its arrays that have a head axis (a hybrid's recurrent part too)."""
  fields = {}
  for name, x in state._asdict().items():
    if isinstance(x, state_lib.RecurrentState):
      fields[name] = _by_heads(x, fn)
    elif name in _HEAD_AXES and x is not None:
      fields[name] = fn(x, _HEAD_AXES[name])
  return state._replace(**fields)


def _to_query_heads(state, groups: int):
  """A state per key/value head as the state per query head it stands for (each head repeated G times)."""
  return state if groups == 1 else _by_heads(state, lambda x, axis: jnp.repeat(x, groups, axis=axis))


def _to_kv_heads(state, groups: int):
  """Inverse of :func:`_to_query_heads`: the first query head of each group (all of a group's are equal)."""
  return state if groups == 1 else _by_heads(
      state, lambda x, axis: jax.lax.slice_in_dim(x, 0, x.shape[axis], groups, axis=axis))


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
    control_variate: float | Float[Array, ""] | Float[Array, " H"] | None = None,
) -> tuple[state_lib.RecurrentState | hybrid_lib.HybridState, Float[Array, "... l H Dv"]]:
  """Continues causal FAVOR attention from ``state`` by l ≥ 1 tokens, with O(M·Dv) state per head.

  ``S ← S + φ(k_t)[v_t, 1]ᵀ``, ``out_t = φ(q_t)ᵀS[:, :Dv] / φ(q_t)ᵀS[:, Dv]`` (with the running stabiliser).
  One token costs O(M·(D+Dv)); a longer step (a prompt) runs the chunked algorithm. Steps over tokens 0..t
  give the outputs of ``favor_attention(..., causal=True)``; with ``window > 0`` those of
  ``hybrid_attention(..., window=window, causal=True)`` (O(window·(D+Dv) + F·Dv) state; one token at a time),
  and with ``control_variate`` β those of ``hybrid_attention(..., control_variate=β)`` (the buffer's keys'
  features recomputed each token: O(window·F·D) more work, no more state).

  ``log_gate``: the state (and a window's buffer) decays as in :func:`favor_attention`. ``segment_ids``: the
  state records the last id; a token whose id differs from the one before (also the state's) starts afresh.
  Pass them on every step or on none.

  Grouped-query attention: key and value of Hkv < H heads (H a multiple of Hkv) continue a state per key/value
  head (:func:`favor_decode_init` given a value of Hkv heads); query head h reads the state of key/value head
  ``h // (H // Hkv)``. One token then adds each key to one state head and reads it for the group's G = H/Hkv
  queries (1/G of the state's bytes read and written); a longer step (a prompt) or a window runs per query head
  on the state repeated and keeps one head per group. ``log_gate`` is then per key/value head ([..., l, Hkv],
  or broadcast from [..., l, 1]). Refused where it would not be exact (see the module's docstring).

  Args:
    state: from :func:`favor_decode_init` or the last step (a ``(mu, s)`` tuple reads as a RecurrentState).
    query: queries, shape [..., l, H, D].
    key: keys, shape [..., l, H, D], or [..., l, Hkv, D] for a state per key/value head.
    value: values, shape [..., l, H, Dv] (or [..., l, Hkv, Dv], as the key).
    projection: ω, [M, D] or [H, M, D], the one the state was made with.
    kernel: the kernel the state was made with: a name in ``KERNELS`` or a :class:`~favor_jax.core.kernels.Kernel`
      record, as in :func:`favor_attention`.
    key_mask: optional bool [..., l]; False leaves a key out.
    rho: a data-dependent kernel's statistic (required: decoding is causal), as in :func:`favor_attention`.
    chunk_size: C, the chunk length for a step of l > 1 tokens.
    window: W, the window the state was made with.
    log_gate: optional float [..., l, H], the log of a forget gate per position and head, causal
      only, as in :func:`~favor_jax.core.favor_attention` ([..., l, Hkv] with a state per key/value head).
    segment_ids: optional int [..., l], packed documents, as in :func:`~favor_jax.core.favor_attention`.
      A new id resets the state (the state records the last id): pass ids on every step or on none.
    precision: the precision of every dot product of the call, as in :func:`~favor_jax.core.favor_attention`.
    control_variate: β of the hybrid's control variate, with a ``window`` only, as in
      :func:`~favor_jax.core.hybrid_attention` (None or 0: the plain hybrid).

  Returns:
    ``(new_state, out)``: the state after these tokens (NaN once a non-finite key or value was seen) and
    the output, shape [..., l, H, Dv], in the inputs' dtype.

  Raises:
    TypeError: if an input is not a floating array, the state's leaves are not float32 (a cast cache), or
      ``control_variate`` is neither a real number nor a floating array.
    ValueError: if the state's type or shapes do not fit these inputs (batch shape, heads, features, value
      size, window), for key/value heads that do not divide the query's or a state per key/value head that would
      not be exact (a per-head projection, a data-dependent kernel, a gate per query head), as
      :func:`favor_attention` raises for shapes, kernel, ``rho``, ``chunk_size`` and ``precision``, or as
      :func:`hybrid_attention` raises for ``control_variate`` (not finite, another shape than () or [H], not 0
      with ``window=0``).
  """
  groups = _groups(query, key, projection, kernel, "key")
  if groups > 1:  # checked on the key/value heads, then run on them repeated to the query's (as the full pass)
    checks.check_value(key, value)
    key_kv, value_kv = key, value
    key, value = (jnp.repeat(x, groups, axis=-2) for x in (key, value))
    log_gate = _gate_to_query_heads(log_gate, groups, key_kv.shape[-2])
  else:
    key_kv, value_kv = key, value
  inputs.validate(query, key, value, key_mask, True)
  chunk_size = checks.check_chunk_size(chunk_size)
  window = checks.check_window(window)
  control = checks.check_control_variate(control_variate, window, query.shape[-2])
  features = _feature_fn(kernel, projection, rho, query, key, key_mask, True)
  batch = query.shape[:-3]
  want = jax.eval_shape(lambda *x: _state_batch(_empty_state(features, *(inputs.flatten(y, batch) for y in x),
                                                             window), batch), key_kv, key_kv, value_kv)
  state = _state_flat(_check_state(state, want), batch)  # per key/value head with groups > 1
  full = _to_query_heads(state, groups)  # per query head (the state itself when groups == 1)
  gates = gates_lib.prepare(log_gate, segment_ids, query, True, previous=state.segment)
  segment = state.segment if segment_ids is None else jnp.broadcast_to(
      segment_ids, query.shape[:-2]).reshape(-1, query.shape[-3])[:, -1].astype(jnp.int32)
  gate = None if gates is None else gates.log
  recurrent = full.recurrent if window else full
  poisoned = ~jnp.all(jnp.isfinite(recurrent.s), axis=(-2, -1)) | jnp.any(jnp.isnan(recurrent.mu), axis=-1)
  clean = lambda s: s._replace(**{f: jnp.where(jnp.isfinite(x) | jnp.isneginf(x), x, 0.0)
                                  for f, x in (("mu", s.mu), ("s", s.s))}, segment=None)  # the passes' carry
  kv = lambda x: None if x is None or groups == 1 else x[:, ::groups]  # [N, H, ...] -> one head per group

  def step(q, k, v, mask, seen):  # seen [N, H]: a non-finite key or value up to the last token (or before)
    spoil = lambda s, seen: s._replace(**{f: jnp.where(seen.reshape(seen.shape + (1,) * (x.ndim - 2)), jnp.nan, x)
                                          for f, x in (("mu", s.mu), ("s", s.s))})
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    if window:
      new, num, den = hybrid_lib.step(features, full._replace(recurrent=clean(recurrent)), q, k, v, mask, gate,
                                      control)
      new = new._replace(recurrent=spoil(new.recurrent, seen), segment=segment)
      return state_lib.divide(num, den), _to_kv_heads(new, groups)
    if q.shape[1] == 1:  # one token: the keys' side on the state's own heads, G query rows read each
      fq, fk = features.fn(q, k)
      first = lambda f: kernels_lib.LogFeatures(*(None if x is None else x[:, 0] for x in f))
      fk, v_t, g_t = first(fk), v[:, 0], None if gate is None else gate[:, 0]
      if groups > 1:  # the group's keys, values and gates are equal (repeated): one of each
        fk, v_t, g_t, seen = kernels_lib.LogFeatures(kv(fk.log), kv(fk.mult)), kv(v_t), kv(g_t), kv(seen)
      new, num, den = causal_xla.advance(clean(state), first(fq), fk, v_t, mask[:, 0], gate=g_t, group=groups)
      return state_lib.divide(num[:, None], den[:, None]), spoil(new, seen)._replace(segment=segment)
    num, den, new = causal_xla.chunked(features, q, k, v, mask, chunk_size=chunk_size, state=clean(full),
                                       return_state=True, gate=gate)
    return state_lib.divide(num, den), _to_kv_heads(spoil(new, seen)._replace(segment=segment), groups)

  out, state = inputs.decode_envelope(step, query, key, value, key_mask, prior=poisoned, gates=gates)
  return _state_batch(state, batch), out


def _gate_to_query_heads(log_gate, groups: int, kv_heads: int):
  """A state per key/value head's ``log_gate`` [..., l, Hkv] (or [..., l, 1]) repeated to the query heads; a gate
  per query head is refused: the group's heads would decay one state differently."""
  if log_gate is None or not hasattr(log_gate, "shape") or log_gate.ndim < 2 or log_gate.shape[-1] == 1:
    return log_gate
  if log_gate.shape[-1] != kv_heads:
    raise ValueError(f"log_gate has {log_gate.shape[-1]} heads (shape {log_gate.shape}); with a state per key/value "
                     f"head (key and value of {kv_heads} heads) it needs one gate per key/value head, "
                     f"[..., l, {kv_heads}] (or [..., l, 1]): a gate per query head decays one state differently for "
                     "the group's query heads, which only a state per query head can hold")
  return jnp.repeat(log_gate, groups, axis=-1)
