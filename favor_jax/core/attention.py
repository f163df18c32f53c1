"""Exact softmax attention (the reference), normalised linear attention and FAVOR attention.

Layout: query ``[..., Lq, H, D]``, key ``[..., Lk, H, D]``, value ``[..., Lk, H, Dv]``,
output ``[..., Lq, H, Dv]`` in the inputs' dtype; float32 inside.

Each public function checks its arguments once, here (``inputs.validate``, ``checks``), resolves its
kernel into a :class:`~favor_jax.core.features.Features` record, and runs its algorithm
(``bidirectional``, ``causal``'s methods, ``hybrid``) inside the input envelope (``inputs.envelope``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from favor_jax.core import bidirectional as bidirectional_lib
from favor_jax.core import causal as causal_lib
from favor_jax.core import causal_xla, checks, inputs
from favor_jax.core import features as features_lib
from favor_jax.core import gates as gates_lib
from favor_jax.core import hybrid as hybrid_lib
from favor_jax.core import kernels as kernels_lib
from favor_jax.core import state as state_lib
from favor_jax.core.features import for_call as _feature_fn  # (tests and experiments/blocks.py read it here)

__all__ = [
    "softmax_attention", "linear_attention", "favor_attention", "hybrid_attention", "favor_decode_init",
    "favor_decode_step",
]


def softmax_attention(
    query: Float[Array, "... Lq H D"],
    key: Float[Array, "... Lk H D"],
    value: Float[Array, "... Lk H Dv"],
    *,
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    log_gate: Float[Array, "... L H"] | None = None,
    segment_ids: Int[Array, "... L"] | None = None,
) -> Float[Array, "... Lq H Dv"]:
  """Exact attention, softmax(q kᵀ/√d) v (Vaswani et al. 2017); the reference FAVOR estimates.

  A query that can see no key (all masked) returns 0. ``log_gate`` (causal only): log f_l ≤ 0 of a forget
  gate per position and head (−∞: a reset); logits + Σ_{j<l≤t} log f_l (Forgetting Transformer, Lin et al.
  2025; constant: ALiBi, :func:`alibi_log_gate`). ``segment_ids``: packed documents, pairs within a run of
  equal ids only. A NaN, +∞ or positive log gate gives NaN in the rows that may see it (as a NaN key).

  Raises:
    ValueError, TypeError: a bad argument (named), ``log_gate`` with ``causal=False``.
  """
  inputs.validate(query, key, value, key_mask, causal)
  gates = gates_lib.prepare(log_gate, segment_ids, query, causal)

  def exact(q, k, v, mask):
    f32 = jnp.float32
    logits = jnp.einsum("nqhd,nkhd->nhqk", q.astype(f32), k.astype(f32)) / math.sqrt(query.shape[-1])
    allowed = mask[:, None, None, :]
    if causal:
      allowed = allowed & jnp.tril(jnp.ones(logits.shape[-2:], bool))
    logits = jnp.where(allowed, gates_lib.biased(logits, gates, causal), -jnp.inf)
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
    num = jnp.einsum("nhqk,nkhd->nqhd", weights, v.astype(f32))
    return state_lib.divide(num, jnp.moveaxis(jnp.sum(weights, axis=-1), -2, -1))

  return inputs.envelope(exact, query, key, value, key_mask, causal=causal, in_range=False, gates=gates)


def _linear(features, query, key, value, key_mask, causal, causal_method, chunk_size, in_range=True, gates=None):
  """Normalised linear attention by ``features`` in the input envelope: the bidirectional pass (within
  segments: ``hybrid.segmented``), or the causal one ``causal_method`` chooses (arguments checked by the
  caller); ``gates`` a ``gates.Gates``."""
  def algorithm(q, k, v, mask):
    v = v.astype(jnp.float32)
    if not causal and gates is not None:
      return state_lib.divide(*hybrid_lib.segmented(features, q, k, v, mask, gates.start, chunk_size))
    if not causal:
      return bidirectional_lib.bidirectional(features, q, k, v, mask, divide=True)
    return causal_lib.attend(features, q, k, v, mask, causal_method=causal_method, chunk_size=chunk_size,
                             gate=None if gates is None else gates.log)

  return inputs.envelope(algorithm, query, key, value, key_mask, causal=causal, in_range=in_range, gates=gates)


def linear_attention(
    query_features: Float[Array, "... Lq H F"],
    key_features: Float[Array, "... Lk H F"],
    value: Float[Array, "... Lk H Dv"],
    *,
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    causal_method: str = "auto",
    chunk_size: int = 64,
    log_gate: Float[Array, "... L H"] | None = None,
    segment_ids: Int[Array, "... L"] | None = None,
) -> Float[Array, "... Lq H Dv"]:
  """Normalised linear attention given features (Katharopoulos et al. 2020):

      out_t = Σ_j (φ_tᵀ ψ_j) v_j / Σ_j φ_tᵀ ψ_j,  over j ≤ t if ``causal``, unmasked j only.

  Equals ``(A v) / (A 1)`` with ``A = φ ψᵀ`` (lower-triangular if causal) without
  forming A. Rows with a zero denominator return 0. Features are used as given. ``log_gate`` and
  ``segment_ids`` as in :func:`favor_attention`.

  Raises:
    ValueError, TypeError: a bad argument (named).
  """
  inputs.validate(query_features, key_features, value, key_mask, causal, "query_features", "key_features")
  checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS, causal)
  chunk_size = checks.check_chunk_size(chunk_size)
  gates = gates_lib.prepare(log_gate, segment_ids, query_features, causal, method=causal_method)
  return _linear(features_lib.as_given(), query_features, key_features, value, key_mask, causal, causal_method,
                 chunk_size, in_range=False, gates=gates)


def favor_attention(
    query: Float[Array, "... Lq H D"],
    key: Float[Array, "... Lk H D"],
    value: Float[Array, "... Lk H Dv"],
    projection: Float[Array, "M D"] | Float[Array, "H M D"] | None,
    *,
    kernel="positive",
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    rho: Float[Array, "... H"] | Float[Array, "... H D+1"] | None = None,
    causal_method: str = "auto",
    chunk_size: int = 64,
    query_mask: Bool[Array, "... Lq"] | None = None,
    log_gate: Float[Array, "... L H"] | None = None,
    segment_ids: Int[Array, "... L"] | None = None,
) -> Float[Array, "... Lq H Dv"]:
  """FAVOR attention (Choromanski et al. 2021, "Rethinking Attention with Performers"):

      out = D⁻¹ (φ(Q) (φ(K)ᵀ V)),  D = diag(φ(Q) (φ(K)ᵀ 1)),

  with φ the random feature map ``kernel`` (a name from ``kernels.KERNELS`` or a
  callable ``kernel(q, k, projection, *, stabilize) -> (φq, φk)``). For softmax
  kernels this is an unbiased-kernel estimate of ``softmax_attention``.

  Keys are stabilised in log domain by a running maximum over past keys only,
  so causal outputs never depend, even numerically, on later tokens. That holds
  for ``kernels.Kernel`` records (every name in ``KERNELS``, or one of your own:
  its log-features and facts, see ``kernels.py``). A plain callable gives its
  features in linear domain, with its own stabiliser: it is called with
  ``stabilize=True`` over the whole sequence when not causal, but causal passes
  (and :func:`favor_jax.parallel.sequence_parallel_attention`, whose devices see
  part of the keys) call it with ``stabilize=False`` (its stabiliser would look
  ahead), so its features must stay within float32's range there: where they
  underflow (e.g. exp(ωx − ‖x‖²/2) at large ‖x‖) rows come out 0 or wrong. Make
  such a map a ``Kernel`` record.
  ``causal_method`` and ``chunk_size`` choose the causal pass (a value outside
  their range is refused either way); bidirectional attention has one pass,
  folding keys in blocks of its own, and reads neither (``"pallas"`` is
  refused there: it has no fused kernel).
  ``causal_method``: ``"auto"`` (default: ``"pallas"`` on a GPU where the
  kernel's features allow it, else ``"chunked"``), ``"chunked"`` (exact
  causal chunks of ``chunk_size`` with carried state, XLA), ``"pallas"``
  (the same chunks as fused Pallas kernels; Pallas's interpreter off GPU;
  ``chunk_size`` a power of two ≥ 16; first derivatives only: a second one
  raises ``ValueError``),
  ``"scan"`` (the paper's per-token recurrence) or ``"cumsum"``
  (materialised prefix states). ``"chunked"`` and ``"pallas"`` (custom
  VJPs) are reverse mode only: under ``jax.jvp``/``jax.jacfwd`` JAX raises
  ``TypeError`` ("can't apply forward-mode autodiff (jvp) to a custom_vjp
  function"); ``"scan"`` and ``"cumsum"`` take forward mode. On an H200 the fused kernels ran fwd+bwd
  3.4-4.8× faster than ``"chunked"`` with 3.2-3.6× its memory (that code kept
  float32 log features for the backward pass; it now recomputes them, keeping the
  inputs and one state per chunk, not yet measured on a GPU; README "Measured
  speed"): pass ``"chunked"`` where memory is short. ``rho`` is the
  statistic of a data-dependent kernel, required when ``causal``: FAVOR++'s ρ
  [..., H] (``optimal_positive``) or FAVOR#'s [..., H, D+1] (``saderf``: log Ψ
  per coordinate, then ρ; see ``kernels.saderf_statistic``). Not causal, it is
  computed here over the unmasked keys and the queries of ``query_mask``
  (False: padding; None: all): pass the padding mask of a padded self-attention
  as both masks, so the real rows do not depend on how much padding follows.
  ``query_mask`` selects nothing else: every query's row is computed.

  Degenerate and non-finite inputs: a query that sees no unmasked key gives 0.
  A non-finite query gives NaN in its own row; a non-finite unmasked key or
  value gives NaN in the rows that may see it (and in no earlier row); masked
  keys are ignored whatever they hold. A concrete ``rho`` must be finite and
  ≥ 0 (else ``ValueError``; a traced one gives NaN). A zero projection gives
  each kernel at ω = 0: positive/hyperbolic/FAVOR++ features are then the
  same for every ω, so keys are weighted by exp(−‖k‖²/(2√d)); ReLU features
  are 0 and every row is 0; trigonometric ones weight keys by exp(+‖k‖²/(2√d)).

  ``log_gate``, ``segment_ids``: as in :func:`softmax_attention` (unbiased for its weights: the state decays
  by f_t in its log-scale before key t joins, RFA's gate, Peng et al. 2021; bidirectional segments: a causal
  pass with resets and a reversed one; a data-dependent kernel's statistic stays the whole row's). ``"pallas"``
  refuses them (``ValueError``); ``"auto"`` then runs ``"chunked"``.

  Raises:
    ValueError, TypeError: a bad argument (named).
  """
  inputs.validate(query, key, value, key_mask, causal, query_mask=query_mask)
  checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS, causal)
  chunk_size = checks.check_chunk_size(chunk_size)
  gates = gates_lib.prepare(log_gate, segment_ids, query, causal, method=causal_method)
  features = _feature_fn(kernel, projection, rho, query, key, key_mask, causal, blocked=gates is not None,
                         query_mask=query_mask)
  return _linear(features, query, key, value, key_mask, causal, causal_method, chunk_size, gates=gates)


def hybrid_attention(
    query: Float[Array, "... Lq H D"],
    key: Float[Array, "... Lk H D"],
    value: Float[Array, "... Lk H Dv"],
    projection: Float[Array, "M D"] | Float[Array, "H M D"] | None,
    *,
    window: int,
    kernel="positive",
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    rho: Float[Array, "... H"] | Float[Array, "... H D+1"] | None = None,
    chunk_size: int = 64,
    query_mask: Bool[Array, "... Lq"] | None = None,
    log_gate: Float[Array, "... L H"] | None = None,
    segment_ids: Int[Array, "... L"] | None = None,
) -> Float[Array, "... Lq H Dv"]:
  """Exact softmax weights near each query, the kernel's estimate for all other keys, one normaliser
  (Scatterbrain: Chen et al. 2021; Based's local + global split, Arora et al. 2024):

      out_t = Σ_j w_tj v_j / Σ_j w_tj,   w_tj = exp(q_t·k_j/√d) if j is in t's window, else φ(q_t)ᵀφ(k_j),

  the window being t − window < j ≤ t (``causal``) or |t − j| < window. With an
  unbiased softmax kernel each w_tj is an unbiased estimate of exp(q_t·k_j/√d).
  ``window=0`` is :func:`favor_attention`; a window covering the sequence is
  :func:`softmax_attention`. O(L·(window + F)·(D + Dv)) time, no [L, L] array;
  the causal stabiliser never looks ahead. Needs Lq = Lk (positions are shared).
  Masks, non-finite inputs, ``rho``, ``query_mask``, ``log_gate`` and ``segment_ids`` behave as in
  :func:`favor_attention`; the exact window gets the same bias as the kernel's part.

  Raises:
    ValueError, TypeError: a bad argument (named).
  """
  inputs.validate(query, key, value, key_mask, causal, query_mask=query_mask)
  checks.check_causal_lengths(query, key, "hybrid attention (its window is positions t − j, causal or not)")
  window = checks.check_window(window)
  chunk_size = checks.check_chunk_size(chunk_size)
  gates = gates_lib.prepare(log_gate, segment_ids, query, causal)
  # Window 0 is favor_attention with causal_method "auto", its other arguments checked above.
  features = _feature_fn(kernel, projection, rho, query, key, key_mask, causal,
                         blocked=window > 0 or gates is not None, query_mask=query_mask)
  if window == 0:
    return _linear(features, query, key, value, key_mask, causal, "auto", chunk_size, gates=gates)

  def algorithm(q, k, v, mask):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    return state_lib.divide(*hybrid_lib.hybrid(features, q, k, v, mask, window, causal, chunk_size, gates))

  return inputs.envelope(algorithm, query, key, value, key_mask, causal=causal, gates=gates)


def favor_decode_init(
    query: Float[Array, "... 1 H D"],
    value: Float[Array, "... 1 H Dv"],
    projection: Float[Array, "M D"] | Float[Array, "H M D"] | None,
    *,
    kernel="positive",
    window: int = 0,
) -> state_lib.RecurrentState | hybrid_lib.HybridState:
  """The empty state for :func:`favor_decode_step`, sized from one step's inputs.

  ``window=0``: a :class:`RecurrentState`, S = Σ_j e^{log φ(k_j) − μ}[v_j, 1]ᵀ per
  head ([..., H, F, Dv+1], ``...`` the inputs' batch dimensions) and μ, the running
  per-feature maximum of log φ(k_j). ``window > 0`` (:func:`hybrid_attention`): a
  :class:`HybridState`, the last ``window`` keys and values ([..., W, H, D + Dv])
  and the RecurrentState of the keys before them. Every array but the hybrid
  state's token count leads with the batch dimensions, so a state decodes only
  inputs of the batch shape it was made for. Its shapes are checked; the kernel
  and projection it was built with are not recorded (a state is arrays only, to
  pass through jit and scans): continue it with those it was made with.
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
) -> tuple[state_lib.RecurrentState | hybrid_lib.HybridState, Float[Array, "... l H Dv"]]:
  """Continues causal FAVOR attention from ``state`` by l ≥ 1 tokens; O(M·Dv) state per head:

      S ← S + φ(k_t)[v_t, 1]ᵀ,   out_t = φ(q_t)ᵀS[:, :Dv] / φ(q_t)ᵀS[:, Dv]

  (with the running stabiliser). One token costs O(M·(D+Dv)); a longer step
  (a prompt) runs the chunked algorithm. Steps over tokens 0..t give the same
  outputs as ``favor_attention(..., causal=True)``; with ``window > 0`` those of
  ``hybrid_attention(..., window=window, causal=True)`` (O(window·(D+Dv) + F·Dv)
  state; tokens are taken one at a time). A non-finite key or value makes this
  and every later output NaN (the returned state is NaN) up to the next reset.

  ``log_gate``: the state (and a window's buffer) decays as in :func:`favor_attention`. ``segment_ids``: the
  state records the last id; a token whose id differs from the one before (also the state's) starts afresh.
  Pass them on every step or on none.

  Raises:
    ValueError, TypeError: a bad argument (named), or a state of other sizes.
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
