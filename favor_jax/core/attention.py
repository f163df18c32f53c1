"""Exact softmax attention (the reference), normalised linear attention and FAVOR attention.

Layout: query ``[..., Lq, H, D]``, key ``[..., Lk, H, D]``, value ``[..., Lk, H, Dv]``, output ``[..., Lq, H, Dv]``
in the inputs' dtype; float32 inside. Each public function checks its arguments once, here, resolves its kernel
into a ``features.Features`` record, and runs its algorithm inside the input envelope (``inputs.envelope``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from favor_jax.core import bidirectional as bidirectional_lib
from favor_jax.core import causal as causal_lib
from favor_jax.core import causal_xla, checks, inputs
from favor_jax.core import features as features_lib
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
) -> Float[Array, "... Lq H Dv"]:
  """Computes exact attention softmax(q kᵀ/√d) v, the reference FAVOR estimates.

  Args:
    query: queries, shape [..., Lq, H, D].
    key: keys, shape [..., Lk, H, D].
    value: values, shape [..., Lk, H, Dv].
    causal: whether query t sees only keys j ≤ t (needs Lq = Lk).
    key_mask: optional bool [..., Lk] (broadcastable); False leaves a key out.

  Returns:
    The output, shape [..., Lq, H, Dv], in the inputs' dtype; 0 in a row that can see no key (all masked).

  Raises:
    TypeError: if an input is not a floating array, ``key_mask`` not bool or ``causal`` not a bool.
    ValueError: if the shapes disagree, a length is 0, or ``causal`` with Lq ≠ Lk.

  References:
    Vaswani et al. 2017, "Attention Is All You Need" (NeurIPS).
  """
  inputs.validate(query, key, value, key_mask, causal)

  def exact(q, k, v, mask):
    f32 = jnp.float32
    logits = jnp.einsum("nqhd,nkhd->nhqk", q.astype(f32), k.astype(f32)) / math.sqrt(query.shape[-1])
    allowed = mask[:, None, None, :]
    if causal:
      allowed = allowed & jnp.tril(jnp.ones(logits.shape[-2:], bool))
    logits = jnp.where(allowed, logits, -jnp.inf)
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
    num = jnp.einsum("nhqk,nkhd->nqhd", weights, v.astype(f32))
    return state_lib.divide(num, jnp.moveaxis(jnp.sum(weights, axis=-1), -2, -1))

  return inputs.envelope(exact, query, key, value, key_mask, causal=causal, in_range=False)


def _linear(features, query, key, value, key_mask, causal, causal_method, chunk_size, in_range=True):
  """Normalised linear attention by ``features`` in the input envelope: the bidirectional pass, or the causal
  one ``causal_method`` chooses (arguments checked by the caller)."""
  def algorithm(q, k, v, mask):
    v = v.astype(jnp.float32)
    if not causal:
      return bidirectional_lib.bidirectional(features, q, k, v, mask, divide=True)
    return causal_lib.attend(features, q, k, v, mask, causal_method=causal_method, chunk_size=chunk_size)

  return inputs.envelope(algorithm, query, key, value, key_mask, causal=causal, in_range=in_range)


def linear_attention(
    query_features: Float[Array, "... Lq H F"],
    key_features: Float[Array, "... Lk H F"],
    value: Float[Array, "... Lk H Dv"],
    *,
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    causal_method: str = "auto",
    chunk_size: int = 64,
) -> Float[Array, "... Lq H Dv"]:
  """Computes normalised linear attention from given features: ``out_t = Σ_j (φ_tᵀψ_j) v_j / Σ_j φ_tᵀψ_j``.

  The sum is over unmasked j (j ≤ t if causal): ``(A v) / (A 1)`` with ``A = φ ψᵀ`` (lower-triangular if
  causal), without forming A. Rows with a zero denominator return 0. Features are used as given.

  Args:
    query_features: φ, shape [..., Lq, H, F].
    key_features: ψ, shape [..., Lk, H, F].
    value: values, shape [..., Lk, H, Dv].
    causal: whether query t sees only keys j ≤ t (needs Lq = Lk).
    key_mask: optional bool [..., Lk] (broadcastable); False leaves a key out.
    causal_method: the causal pass, as in :func:`favor_attention`.
    chunk_size: C, the chunk length of the causal pass (checked, unused when not causal).

  Returns:
    The output, shape [..., Lq, H, Dv], in the inputs' dtype.

  Raises:
    TypeError: if an input is not a floating array, ``key_mask`` not bool or ``causal`` not a bool.
    ValueError: if shapes disagree, a length is 0, ``causal`` with Lq ≠ Lk, or as :func:`favor_attention`
      raises for ``causal_method`` and ``chunk_size``.

  References:
    Katharopoulos et al. 2020, "Transformers are RNNs" (ICML).
  """
  inputs.validate(query_features, key_features, value, key_mask, causal, "query_features", "key_features")
  checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS, causal)
  chunk_size = checks.check_chunk_size(chunk_size)
  return _linear(features_lib.as_given(), query_features, key_features, value, key_mask, causal, causal_method,
                 chunk_size, in_range=False)


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
) -> Float[Array, "... Lq H Dv"]:
  """Computes FAVOR attention in linear time: ``out = D⁻¹ (φ(Q) (φ(K)ᵀ V))``, ``D = diag(φ(Q) (φ(K)ᵀ 1))``.

  With a softmax kernel this estimates :func:`softmax_attention` from an unbiased estimate of its kernel. Keys
  are stabilised in log domain by a running maximum over past keys only (for ``Kernel`` records), so causal
  outputs never depend, even numerically, on later tokens. A query that sees no unmasked key gives 0; a
  non-finite query NaN in its own row; a non-finite unmasked key or value NaN in the rows that may see it (in
  no earlier row); masked keys are ignored whatever they hold. Other edges: docs/guarantees.md.

  Args:
    query: queries, shape [..., Lq, H, D].
    key: keys, shape [..., Lk, H, D].
    value: values, shape [..., Lk, H, Dv].
    projection: ω, [M, D] (shared by the heads) or [H, M, D] (one per head); None if the kernel takes none.
    kernel: a name in ``KERNELS``, a :class:`~favor_jax.core.kernels.Kernel`, or a callable
      ``kernel(q, k, projection, *, stabilize) -> (φq, φk)`` (linear-domain features: causal passes and
      ``favor_jax.parallel`` call it with ``stabilize=False``, so they must stay in float32's range).
    causal: whether query t sees only keys j ≤ t (needs Lq = Lk).
    key_mask: optional bool [..., Lk] (broadcastable); False leaves a key out.
    rho: a data-dependent kernel's statistic, FAVOR++'s ρ [..., H] or FAVOR#'s [..., H, D+1] (log Ψ, then ρ);
      required if ``causal``, else computed here over the unmasked keys and the queries of ``query_mask``.
    causal_method: the causal pass: ``"auto"`` (``"pallas"`` on a GPU where the kernel's features allow it,
      else ``"chunked"``), ``"chunked"`` (exact causal chunks with carried state, XLA), ``"pallas"`` (the same
      chunks as fused Pallas kernels; ``chunk_size`` a power of two ≥ 16; first derivatives only),
      ``"scan"`` (per-token recurrence) or ``"cumsum"`` (prefix states). ``"chunked"`` and ``"pallas"`` are
      reverse-mode only (JAX raises TypeError under ``jax.jvp``). Unused (``"pallas"`` refused) when not causal.
    chunk_size: C, the chunk length of the causal pass (checked, unused when not causal).
    query_mask: optional bool [..., Lq]; False leaves a query (padding) out of a data-dependent kernel's
      statistic, nothing else. Pass a padded self-attention's mask as both masks.

  Returns:
    The output, shape [..., Lq, H, Dv], in the inputs' dtype.

  Raises:
    TypeError: if an input is not a floating array, a mask not bool or ``causal`` not a bool.
    ValueError: if shapes disagree, a length is 0, ``causal`` with Lq ≠ Lk, the kernel is unknown or gets a
      projection it does not take or lacks one it needs, a causal data-dependent kernel lacks ``rho``, a
      concrete ``rho`` is invalid, ``causal_method`` is unknown (or ``"pallas"`` when not causal),
      ``chunk_size`` is not a positive int, or a second derivative is taken through ``"pallas"``.

  References:
    Choromanski et al. 2021, "Rethinking Attention with Performers" (ICLR).
  """
  inputs.validate(query, key, value, key_mask, causal, query_mask=query_mask)
  checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS, causal)
  chunk_size = checks.check_chunk_size(chunk_size)
  features = _feature_fn(kernel, projection, rho, query, key, key_mask, causal, query_mask=query_mask)
  return _linear(features, query, key, value, key_mask, causal, causal_method, chunk_size)


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
) -> Float[Array, "... Lq H Dv"]:
  """Computes attention with exact softmax weights near each query and a kernel's estimate elsewhere.

  ``out_t = Σ_j w_tj v_j / Σ_j w_tj``, ``w_tj = exp(q_t·k_j/√d)`` if j is in t's window (``t − window < j ≤ t``
  when causal, ``abs(t − j) < window`` otherwise), else ``φ(q_t)ᵀφ(k_j)``: with an unbiased softmax kernel each
  w_tj is an unbiased estimate of exp(q_t·k_j/√d). ``window=0`` is :func:`favor_attention`; a window covering
  the sequence is :func:`softmax_attention`. O(L·(window + F)·(D + Dv)) time, no [L, L] array; the causal
  stabiliser never looks ahead. Masks, non-finite inputs and ``rho`` behave as in :func:`favor_attention`.

  Args:
    query: queries, shape [..., Lq, H, D].
    key: keys, shape [..., Lk, H, D].
    value: values, shape [..., Lk, H, Dv].
    projection: ω, [M, D] or [H, M, D]; None for a kernel that takes none.
    window: W ≥ 0, the exact window's width in positions (0: none).
    kernel: as in :func:`favor_attention`.
    causal: whether query t sees only keys j ≤ t.
    key_mask: optional bool [..., Lk]; False leaves a key out.
    rho: a data-dependent kernel's statistic, as in :func:`favor_attention`.
    chunk_size: C, the chunk length of the causal pass.
    query_mask: optional bool [..., Lq], as in :func:`favor_attention`.

  Returns:
    The output, shape [..., Lq, H, Dv], in the inputs' dtype.

  Raises:
    TypeError: as :func:`favor_attention` raises.
    ValueError: as :func:`favor_attention` raises, and if Lq ≠ Lk or ``window`` is not an int ≥ 0.

  References:
    Chen et al. 2021, "Scatterbrain: Unifying Sparse and Low-rank Attention" (NeurIPS).
    Arora et al. 2024, "Simple linear attention language models balance the recall-throughput tradeoff".
  """
  inputs.validate(query, key, value, key_mask, causal, query_mask=query_mask)
  checks.check_causal_lengths(query, key, "hybrid attention (its window is positions t − j, causal or not)")
  window = checks.check_window(window)
  chunk_size = checks.check_chunk_size(chunk_size)
  # Window 0 is favor_attention with causal_method "auto", its other arguments checked above.
  features = _feature_fn(kernel, projection, rho, query, key, key_mask, causal, blocked=window > 0,
                         query_mask=query_mask)
  if window == 0:
    return _linear(features, query, key, value, key_mask, causal, "auto", chunk_size)

  def algorithm(q, k, v, mask):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    return state_lib.divide(*hybrid_lib.hybrid(features, q, k, v, mask, window, causal, chunk_size))

  return inputs.envelope(algorithm, query, key, value, key_mask, causal=causal)


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
  state = hybrid_lib.initial_state(features, q, v, window) if window else state_lib.initial_state(features, q, q, v)
  return _state_batch(state, batch)


def _state_batch(state, batch):
  """The state's arrays with their leading flattened batch N given the dimensions ``batch`` (0-d leaves kept)."""
  return jax.tree.map(lambda x: x.reshape(batch + x.shape[1:]) if x.ndim else x, state)


def _state_flat(state, batch):
  """Inverse of :func:`_state_batch`: the leading dimensions ``batch`` flattened into one."""
  return jax.tree.map(lambda x: inputs.flatten(x, batch) if x.ndim else x, state)


def _check_state(state, want):
  """``state`` as the type ``want`` has (a plain (mu, s) tuple is taken as a RecurrentState), or a clear error."""
  if isinstance(want, state_lib.RecurrentState) and type(state) is tuple and len(state) == 2:
    state = state_lib.RecurrentState(*state)
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
) -> tuple[state_lib.RecurrentState | hybrid_lib.HybridState, Float[Array, "... l H Dv"]]:
  """Continues causal FAVOR attention from ``state`` by l ≥ 1 tokens, with O(M·Dv) state per head.

  ``S ← S + φ(k_t)[v_t, 1]ᵀ``, ``out_t = φ(q_t)ᵀS[:, :Dv] / φ(q_t)ᵀS[:, Dv]`` (with the running stabiliser).
  One token costs O(M·(D+Dv)); a longer step (a prompt) runs the chunked algorithm. Steps over tokens 0..t
  give the outputs of ``favor_attention(..., causal=True)``; with ``window > 0`` those of
  ``hybrid_attention(..., window=window, causal=True)`` (O(window·(D+Dv) + F·Dv) state; one token at a time).

  Args:
    state: from :func:`favor_decode_init` or the last step (a ``(mu, s)`` tuple reads as a RecurrentState).
    query: queries, shape [..., l, H, D].
    key: keys, shape [..., l, H, D].
    value: values, shape [..., l, H, Dv].
    projection: ω, [M, D] or [H, M, D], the one the state was made with.
    kernel: the kernel the state was made with.
    key_mask: optional bool [..., l]; False leaves a key out.
    rho: a data-dependent kernel's statistic (required: decoding is causal), as in :func:`favor_attention`.
    chunk_size: C, the chunk length for a step of l > 1 tokens.
    window: W, the window the state was made with.

  Returns:
    ``(new_state, out)``: the state after these tokens (NaN once a non-finite key or value was seen) and
    the output, shape [..., l, H, Dv], in the inputs' dtype.

  Raises:
    TypeError: if an input is not a floating array, or the state's leaves are not float32 (a cast cache).
    ValueError: if the state's type or shapes do not fit these inputs (batch shape, heads, features, value
      size, window), or as :func:`favor_attention` raises for shapes, kernel, ``rho`` and ``chunk_size``.
  """
  inputs.validate(query, key, value, key_mask, True)
  chunk_size = checks.check_chunk_size(chunk_size)
  window = checks.check_window(window)
  features = _feature_fn(kernel, projection, rho, query, key, key_mask, True)
  batch = query.shape[:-3]
  empty = (lambda q, k, v: hybrid_lib.initial_state(features, q, v, window)) if window else (
      lambda q, k, v: state_lib.initial_state(features, q, k, v))
  want = jax.eval_shape(lambda *x: _state_batch(empty(*(inputs.flatten(y, batch) for y in x)), batch),
                        query, key, value)
  state = _state_flat(_check_state(state, want), batch)
  recurrent = state.recurrent if window else state
  poisoned = ~jnp.all(jnp.isfinite(recurrent.s), axis=(-2, -1)) | jnp.any(jnp.isnan(recurrent.mu), axis=-1)
  clean = lambda s: state_lib.RecurrentState(*(jnp.where(jnp.isfinite(x) | jnp.isneginf(x), x, 0.0) for x in s))

  def step(q, k, v, mask, seen):  # seen [N, H]: a non-finite key or value up to the last token (or before)
    spoil = lambda s: state_lib.RecurrentState(*(jnp.where(seen.reshape(seen.shape + (1,) * (x.ndim - 2)),
                                                           jnp.nan, x) for x in s))
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    if window:
      new, num, den = hybrid_lib.step(features, state._replace(recurrent=clean(recurrent)), q, k, v, mask)
      new = new._replace(recurrent=spoil(new.recurrent))
    elif q.shape[1] == 1:
      fq, fk = features.fn(q, k)
      first = lambda f: kernels_lib.LogFeatures(*(None if x is None else x[:, 0] for x in f))
      new, num, den = causal_xla.advance(clean(state), first(fq), first(fk), v[:, 0], mask[:, 0])
      num, den, new = num[:, None], den[:, None], spoil(new)
    else:
      num, den, new = causal_xla.chunked(features, q, k, v, mask, chunk_size=chunk_size, state=clean(state),
                                         return_state=True)
      new = spoil(new)
    return state_lib.divide(num, den), new

  out, state = inputs.decode_envelope(step, query, key, value, key_mask, prior=poisoned)
  return _state_batch(state, batch), out
