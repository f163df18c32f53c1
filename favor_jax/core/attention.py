"""Exact softmax attention (the reference), normalised linear attention and FAVOR attention.

Layout: query ``[..., Lq, H, D]``, key ``[..., Lk, H, D]``, value ``[..., Lk, H, Dv]``,
output ``[..., Lq, H, Dv]`` in the inputs' dtype; float32 inside.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from favor_jax.core import bidirectional as bidirectional_lib
from favor_jax.core import causal as causal_lib
from favor_jax.core import checks, shared
from favor_jax.core import kernels as kernels_lib

__all__ = [
    "softmax_attention", "linear_attention", "favor_attention", "favor_decode_init", "favor_decode_step",
]


def softmax_attention(
    query: Float[Array, "... Lq H D"],
    key: Float[Array, "... Lk H D"],
    value: Float[Array, "... Lk H Dv"],
    *,
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
) -> Float[Array, "... Lq H Dv"]:
  """Exact attention, softmax(q kᵀ/√d) v (Vaswani et al. 2017); the reference FAVOR estimates.

  A query that can see no key (all masked) returns 0.
  """
  shared.validate(query, key, value, key_mask, causal)
  batch = query.shape[:-3]
  mask = shared.mask_NL(key_mask, key)
  q, k, v, bad, _ = shared.split_nonfinite(*(shared.flatten(x, batch) for x in (query, key, value)), mask,
                                              causal=causal)
  f32 = jnp.float32
  logits = jnp.einsum("nqhd,nkhd->nhqk", q.astype(f32), k.astype(f32)) / math.sqrt(query.shape[-1])
  allowed = mask[:, None, None, :]
  if causal:
    allowed = allowed & jnp.tril(jnp.ones(logits.shape[-2:], bool))
  logits = jnp.where(allowed, logits, -jnp.inf)
  peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
  num = jnp.einsum("nhqk,nkhd->nqhd", weights, v.astype(f32))
  out = shared.poison(shared.divide(num, jnp.moveaxis(jnp.sum(weights, axis=-1), -2, -1)), bad)
  return out.reshape(batch + out.shape[1:]).astype(shared.out_dtype(query, key, value))


def _run(feature_fn, query, key, value, key_mask, causal, causal_method, chunk_size):
  batch = query.shape[:-3]
  mask = shared.mask_NL(key_mask, key)
  q, k, v, bad, _ = shared.split_nonfinite(*(shared.flatten(x, batch) for x in (query, key, value)), mask,
                                              causal=causal)
  v = v.astype(jnp.float32)
  if not causal:
    num, den = bidirectional_lib.bidirectional(feature_fn, q, k, v, mask)
  elif causal_method == "chunked":
    num, den = causal_lib.chunked(feature_fn, q, k, v, mask, chunk_size=chunk_size)
  else:
    num, den = causal_lib.CAUSAL_METHODS[causal_method](feature_fn, q, k, v, mask)
  out = shared.poison(shared.divide(num, den), bad)
  return out.reshape(batch + out.shape[1:]).astype(shared.out_dtype(query, key, value))


def linear_attention(
    query_features: Float[Array, "... Lq H F"],
    key_features: Float[Array, "... Lk H F"],
    value: Float[Array, "... Lk H Dv"],
    *,
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    causal_method: str = "chunked",
    chunk_size: int = 64,
) -> Float[Array, "... Lq H Dv"]:
  """Normalised linear attention given features (Katharopoulos et al. 2020):

      out_t = Σ_j (φ_tᵀ ψ_j) v_j / Σ_j φ_tᵀ ψ_j,  over j ≤ t if ``causal``, unmasked j only.

  Equals ``(A v) / (A 1)`` with ``A = φ ψᵀ`` (lower-triangular if causal) without
  forming A. Rows with a zero denominator return 0. Features are used as given.
  """
  shared.validate(query_features, key_features, value, key_mask, causal, "query_features", "key_features")
  checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS)
  chunk_size = checks.check_chunk_size(chunk_size)

  def feature_fn(qf, kf):
    as_is = lambda x: kernels_lib.LogFeatures(None, x.astype(jnp.float32))
    return as_is(qf), as_is(kf)

  feature_fn.layout_free = True
  return _run(feature_fn, query_features, key_features, value, key_mask, causal,
              causal_method, chunk_size)


def favor_attention(
    query: Float[Array, "... Lq H D"],
    key: Float[Array, "... Lk H D"],
    value: Float[Array, "... Lk H Dv"],
    projection: Float[Array, "M D"] | None,
    *,
    kernel="positive",
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    rho: Float[Array, "... H"] | None = None,
    causal_method: str = "chunked",
    chunk_size: int = 64,
) -> Float[Array, "... Lq H Dv"]:
  """FAVOR attention (Choromanski et al. 2021, "Rethinking Attention with Performers"):

      out = D⁻¹ (φ(Q) (φ(K)ᵀ V)),  D = diag(φ(Q) (φ(K)ᵀ 1)),

  with φ the random feature map ``kernel`` (a name from ``kernels.KERNELS`` or a
  callable ``kernel(q, k, projection, *, stabilize) -> (φq, φk)``). For softmax
  kernels this is an unbiased-kernel estimate of ``softmax_attention``.

  Keys are stabilised in log domain by a running maximum over past keys only,
  so causal outputs never depend, even numerically, on later tokens.
  ``causal_method``: ``"chunked"`` (default; exact causal chunks of
  ``chunk_size`` with carried state), ``"scan"`` (the paper's per-token
  recurrence) or ``"cumsum"`` (materialised prefix states). ``rho`` is the
  FAVOR++ statistic, required for ``optimal_positive`` when ``causal``.

  Degenerate and non-finite inputs: a query that sees no unmasked key gives 0.
  A non-finite query gives NaN in its own row; a non-finite unmasked key or
  value gives NaN in the rows that may see it (and in no earlier row); masked
  keys are ignored whatever they hold. A concrete ``rho`` must be finite and
  ≥ 0 (else ``ValueError``; a traced one gives NaN). A zero projection gives
  each kernel at ω = 0: positive/hyperbolic/FAVOR++ features are then the
  same for every ω, so keys are weighted by exp(−‖k‖²/(2√d)); ReLU features
  are 0 and every row is 0; trigonometric ones weight keys by exp(+‖k‖²/(2√d)).
  """
  shared.validate(query, key, value, key_mask, causal)
  checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS)
  chunk_size = checks.check_chunk_size(chunk_size)
  kern, data_dependent = shared.resolve_kernel(kernel, projection, rho, query)
  if data_dependent and rho is None:
    if causal:
      raise kernels_lib.causal_statistic_error(kern, query)
    rho = kern.compute_statistic(query, key, key_mask)
  feature_fn = shared.feature_fn_for(kern, projection, shared.flat_rho(rho, query), causal)
  return _run(feature_fn, query, key, value, key_mask, causal, causal_method, chunk_size)


def favor_decode_init(
    query: Float[Array, "... 1 H D"],
    value: Float[Array, "... 1 H Dv"],
    projection: Float[Array, "M D"] | None,
    *,
    kernel="positive",
) -> shared.RecurrentState:
  """The empty recurrent state for :func:`favor_decode_step`, sized from one step's inputs.

  State: S = Σ_j e^{log φ(k_j) − μ}[v_j, 1]ᵀ per head ([N, H, F, Dv+1], N the
  flattened batch) and μ, the running per-feature maximum of log φ(k_j).
  """
  shared.validate(query, query, value, None, True)
  kern, data_dependent = shared.resolve_kernel(kernel, projection, None, query)
  rho = jnp.zeros(query.shape[:-3] + query.shape[-2:-1]) if data_dependent else None
  feature_fn = shared.feature_fn_for(kern, projection, shared.flat_rho(rho, query), True)
  batch = query.shape[:-3]
  q, v = shared.flatten(query, batch), shared.flatten(value, batch)
  return shared.initial_state(feature_fn, q, q, v)


def _check_state(state, want) -> None:
  shapes = lambda s: tuple(getattr(x, "shape", None) for x in s)
  if not isinstance(state, tuple) or len(state) != 2 or shapes(state) != shapes(want):
    got = shapes(state) if isinstance(state, tuple) and len(state) == 2 else type(state).__name__
    raise ValueError(
        f"state (mu, s) has shapes {got}; these inputs need {shapes(want)} ([N, H, Fm] and "
        "[N, H, F, Dv+1]: flattened batch, heads, features, value size). Decode with the batch, "
        "heads, projection and value size the state was made for (favor_decode_init).")


def favor_decode_step(
    state: shared.RecurrentState,
    query: Float[Array, "... l H D"],
    key: Float[Array, "... l H D"],
    value: Float[Array, "... l H Dv"],
    projection: Float[Array, "M D"] | None,
    *,
    kernel="positive",
    key_mask: Bool[Array, "... l"] | None = None,
    rho: Float[Array, "... H"] | None = None,
    chunk_size: int = 64,
) -> tuple[shared.RecurrentState, Float[Array, "... l H Dv"]]:
  """Continues causal FAVOR attention from ``state`` by l ≥ 1 tokens; O(M·Dv) state per head:

      S ← S + φ(k_t)[v_t, 1]ᵀ,   out_t = φ(q_t)ᵀS[:, :Dv] / φ(q_t)ᵀS[:, Dv]

  (with the running stabiliser). One token costs O(M·(D+Dv)); a longer step
  (a prompt) runs the chunked algorithm. Steps over tokens 0..t give the same
  outputs as ``favor_attention(..., causal=True)``. A non-finite key or value
  makes this and every later output NaN (the returned state is NaN).
  """
  shared.validate(query, key, value, key_mask, True)
  chunk_size = checks.check_chunk_size(chunk_size)
  kern, data_dependent = shared.resolve_kernel(kernel, projection, rho, query)
  if data_dependent and rho is None:
    raise kernels_lib.causal_statistic_error(kern, query)
  feature_fn = shared.feature_fn_for(kern, projection, shared.flat_rho(rho, query), True)
  batch = query.shape[:-3]
  q, k, v = (shared.flatten(x, batch) for x in (query, key, value))
  _check_state(state, jax.eval_shape(lambda q, k, v: shared.initial_state(feature_fn, q, k, v), q, k, v))
  mask = shared.mask_NL(key_mask, key)
  poisoned = ~jnp.all(jnp.isfinite(state.s), axis=(-2, -1)) | jnp.any(jnp.isnan(state.mu), axis=-1)
  q, k, v, bad, poisoned = shared.split_nonfinite(q, k, v, mask, causal=True, prior=poisoned)
  v = v.astype(jnp.float32)
  state = shared.RecurrentState(*(jnp.where(jnp.isfinite(x) | jnp.isneginf(x), x, 0.0) for x in state))
  if q.shape[1] == 1:
    fq, fk = feature_fn(q, k)
    first = lambda f: kernels_lib.LogFeatures(*(None if x is None else x[:, 0] for x in f))
    state, num, den = causal_lib.advance(state, first(fq), first(fk), v[:, 0], mask[:, 0])
    num, den = num[:, None], den[:, None]
  else:
    num, den, state = causal_lib.chunked(feature_fn, q, k, v, mask, chunk_size=chunk_size, state=state,
                                         return_state=True)
  state = shared.RecurrentState(*(jnp.where(poisoned.reshape(poisoned.shape + (1,) * (x.ndim - 2)),
                                                jnp.nan, x) for x in state))
  out = shared.poison(shared.divide(num, den), bad)
  return state, out.reshape(batch + out.shape[1:]).astype(shared.out_dtype(query, key, value))
