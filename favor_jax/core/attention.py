"""Exact softmax attention (the reference), normalised linear attention and FAVOR attention.

Layout: query ``[..., Lq, H, D]``, key ``[..., Lk, H, D]``, value ``[..., Lk, H, Dv]``,
output ``[..., Lq, H, Dv]`` in the inputs' dtype; float32 inside.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from favor_jax.core import causal as causal_lib
from favor_jax.core import checks
from favor_jax.core import kernels as kernels_lib

__all__ = [
    "softmax_attention", "linear_attention", "favor_attention", "favor_decode_init", "favor_decode_step",
]


def _validate(query, key, value, key_mask, causal, q_name="query", k_name="key"):
  try:
    checks.check_qk(query, key)
  except (TypeError, ValueError) as e:
    raise type(e)(str(e).replace("query", q_name).replace("key", k_name)) from None
  checks.check_lengths(query, key)
  checks.check_value(key, value)
  checks.check_key_mask(key_mask, key.shape)
  if causal:
    checks.check_causal_lengths(query, key)


def _flatten(x, batch):
  return x.reshape((math.prod(batch),) + x.shape[len(batch):])


def _mask_NL(key_mask, key):
  batch, length = key.shape[:-3], key.shape[-3]
  if key_mask is None:
    return jnp.ones((math.prod(batch), length), bool)
  return _flatten(jnp.broadcast_to(key_mask, batch + (length,)), batch)


# Denominators are normalised so that an aligned term is ~1; below this nothing reliable is
# left (and 1/den would overflow in the backward pass), so the row counts as empty.
_TINY_DEN = 1e-30


@jax.custom_jvp
def _ratio(num, den):
  return num / den


@_ratio.defjvp
def _ratio_jvp(primals, tangents):
  # d(n/d) = (dn − (n/d)·dd)/d: never forms 1/d², which overflows for small d.
  (num, den), (d_num, d_den) = primals, tangents
  out = num / den
  return out, (d_num - out * d_den) / den


def _divide(num, den):
  """num / den, with 0 where nothing was attended to (all keys masked, or a vanishing denominator).

  A NaN denominator stays NaN: a non-finite number never turns into a silent 0.
  """
  den = den[..., None]
  empty = jnp.abs(den) <= _TINY_DEN
  return jnp.where(empty, 0.0, _ratio(num, jnp.where(empty, 1.0, den)))


def _out_dtype(*xs):
  return jnp.result_type(*[x.dtype for x in xs])


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
  _validate(query, key, value, key_mask, causal)
  batch = query.shape[:-3]
  mask = _mask_NL(key_mask, key)
  q, k, v, bad, _ = causal_lib.split_nonfinite(*(_flatten(x, batch) for x in (query, key, value)), mask,
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
  out = causal_lib.poison(_divide(num, jnp.moveaxis(jnp.sum(weights, axis=-1), -2, -1)), bad)
  return out.reshape(batch + out.shape[1:]).astype(_out_dtype(query, key, value))


def _run(feature_fn, query, key, value, key_mask, causal, causal_method, chunk_size):
  batch = query.shape[:-3]
  mask = _mask_NL(key_mask, key)
  q, k, v, bad, _ = causal_lib.split_nonfinite(*(_flatten(x, batch) for x in (query, key, value)), mask,
                                              causal=causal)
  v = v.astype(jnp.float32)
  if not causal:
    num, den = causal_lib.bidirectional(feature_fn, q, k, v, mask)
  elif causal_method == "chunked":
    num, den = causal_lib.chunked(feature_fn, q, k, v, mask, chunk_size=chunk_size)
  else:
    num, den = causal_lib.CAUSAL_METHODS[causal_method](feature_fn, q, k, v, mask)
  out = causal_lib.poison(_divide(num, den), bad)
  return out.reshape(batch + out.shape[1:]).astype(_out_dtype(query, key, value))


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
  _validate(query_features, key_features, value, key_mask, causal, "query_features", "key_features")
  checks.check_causal_method(causal_method)
  chunk_size = checks.check_chunk_size(chunk_size)

  def feature_fn(qf, kf):
    as_is = lambda x: kernels_lib.LogFeatures(None, x.astype(jnp.float32))
    return as_is(qf), as_is(kf)

  feature_fn.layout_free = True
  return _run(feature_fn, query_features, key_features, value, key_mask, causal,
              causal_method, chunk_size)


def _resolve_kernel(kernel, projection, rho, query):
  """(kernel function, whether it is data-dependent), after checking projection and rho against it."""
  kern = kernels_lib.get_kernel(kernel)
  name = getattr(kern, "__name__", repr(kern))
  if projection is not None:
    checks.check_projection(projection, query.shape[-1])
  elif name != "elu_plus_one":
    raise ValueError(f"kernel {name!r} needs a projection [M, {query.shape[-1]}], got None")
  data_dependent = getattr(kern, "data_dependent", False)
  if rho is not None and not data_dependent:
    raise ValueError(f"rho is the FAVOR++ statistic; kernel {name!r} takes none")
  return kern, data_dependent


def _flat_rho(rho, query):
  """ρ broadcast to [..., H] and flattened to [N, H] like the batch; None stays None."""
  if rho is None:
    return None
  return kernels_lib.broadcast_rho(rho, query).reshape((-1, query.shape[-2]))


def _feature_fn(kern, projection, rho_NH, causal):
  """feature_fn(q, k) -> (LogFeatures, LogFeatures) on flattened [N, l, H, D] slices.

  Our kernels are ``layout_free`` (per row, ρ aligned with the heads axis
  whatever the leading dims); a user callable with its own key
  stabiliser (a max over all positions) is ``whole_sequence``.
  """
  if hasattr(kern, "log_features"):
    def feature_fn(q, k):
      rho = {} if rho_NH is None else {"rho": rho_NH.reshape(q.shape[:-3] + q.shape[-2:-1])}
      return kern.log_features(q, k, projection, **rho)

    feature_fn.layout_free = True
    return feature_fn

  def feature_fn(q, k):
    # stabilize=True would scale keys by a max over all positions, future ones included.
    qf, kf = kern(q, k, projection, stabilize=not causal)
    return (kernels_lib.LogFeatures(None, qf.astype(jnp.float32)),
            kernels_lib.LogFeatures(None, kf.astype(jnp.float32)))

  feature_fn.whole_sequence = not causal
  return feature_fn


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
  """
  _validate(query, key, value, key_mask, causal)
  checks.check_causal_method(causal_method)
  chunk_size = checks.check_chunk_size(chunk_size)
  kern, data_dependent = _resolve_kernel(kernel, projection, rho, query)
  if data_dependent and rho is None:
    if causal:  # the kernel raises its own explanation
      kern.log_features(query, key, projection, causal=True)
    rho = kernels_lib.oprf_rho(query, key, key_mask)
  feature_fn = _feature_fn(kern, projection, _flat_rho(rho, query), causal)
  return _run(feature_fn, query, key, value, key_mask, causal, causal_method, chunk_size)


def favor_decode_init(
    query: Float[Array, "... 1 H D"],
    value: Float[Array, "... 1 H Dv"],
    projection: Float[Array, "M D"] | None,
    *,
    kernel="positive",
) -> causal_lib.RecurrentState:
  """The empty recurrent state for :func:`favor_decode_step`, sized from one step's inputs.

  State: S = Σ_j e^{log φ(k_j) − μ}[v_j, 1]ᵀ per head ([N, H, F, Dv+1], N the
  flattened batch) and μ, the running per-feature maximum of log φ(k_j).
  """
  _validate(query, query, value, None, True)
  kern, data_dependent = _resolve_kernel(kernel, projection, None, query)
  rho = jnp.zeros(query.shape[:-3] + query.shape[-2:-1]) if data_dependent else None
  feature_fn = _feature_fn(kern, projection, _flat_rho(rho, query), True)
  batch = query.shape[:-3]
  q, v = _flatten(query, batch), _flatten(value, batch)
  return causal_lib.initial_state(feature_fn, q, q, v)


def _check_state(state, want) -> None:
  shapes = lambda s: tuple(getattr(x, "shape", None) for x in s)
  if not isinstance(state, tuple) or len(state) != 2 or shapes(state) != shapes(want):
    got = shapes(state) if isinstance(state, tuple) and len(state) == 2 else type(state).__name__
    raise ValueError(
        f"state (mu, s) has shapes {got}; these inputs need {shapes(want)} ([N, H, Fm] and "
        "[N, H, F, Dv+1]: flattened batch, heads, features, value size). Decode with the batch, "
        "heads, projection and value size the state was made for (favor_decode_init).")


def favor_decode_step(
    state: causal_lib.RecurrentState,
    query: Float[Array, "... l H D"],
    key: Float[Array, "... l H D"],
    value: Float[Array, "... l H Dv"],
    projection: Float[Array, "M D"] | None,
    *,
    kernel="positive",
    key_mask: Bool[Array, "... l"] | None = None,
    rho: Float[Array, "... H"] | None = None,
    chunk_size: int = 64,
) -> tuple[causal_lib.RecurrentState, Float[Array, "... l H Dv"]]:
  """Continues causal FAVOR attention from ``state`` by l ≥ 1 tokens; O(M·Dv) state per head:

      S ← S + φ(k_t)[v_t, 1]ᵀ,   out_t = φ(q_t)ᵀS[:, :Dv] / φ(q_t)ᵀS[:, Dv]

  (with the running stabiliser). One token costs O(M·(D+Dv)); a longer step
  (a prompt) runs the chunked algorithm. Steps over tokens 0..t give the same
  outputs as ``favor_attention(..., causal=True)``. A non-finite key or value
  makes this and every later output NaN (the returned state is NaN).
  """
  _validate(query, key, value, key_mask, True)
  chunk_size = checks.check_chunk_size(chunk_size)
  kern, data_dependent = _resolve_kernel(kernel, projection, rho, query)
  if data_dependent and rho is None:
    kern.log_features(query, key, projection, causal=True)  # raises: FAVOR++ needs rho here
  feature_fn = _feature_fn(kern, projection, _flat_rho(rho, query), True)
  batch = query.shape[:-3]
  q, k, v = (_flatten(x, batch) for x in (query, key, value))
  _check_state(state, jax.eval_shape(lambda q, k, v: causal_lib.initial_state(feature_fn, q, k, v), q, k, v))
  mask = _mask_NL(key_mask, key)
  poisoned = ~jnp.all(jnp.isfinite(state.s), axis=(-2, -1)) | jnp.any(jnp.isnan(state.mu), axis=-1)
  q, k, v, bad, poisoned = causal_lib.split_nonfinite(q, k, v, mask, causal=True, prior=poisoned)
  v = v.astype(jnp.float32)
  state = causal_lib.RecurrentState(*(jnp.where(jnp.isfinite(x) | jnp.isneginf(x), x, 0.0) for x in state))
  if q.shape[1] == 1:
    fq, fk = feature_fn(q, k)
    first = lambda f: kernels_lib.LogFeatures(*(None if x is None else x[:, 0] for x in f))
    state, num, den = causal_lib.advance(state, first(fq), first(fk), v[:, 0], mask[:, 0])
    num, den = num[:, None], den[:, None]
  else:
    num, den, state = causal_lib.chunked(feature_fn, q, k, v, mask, chunk_size=chunk_size, state=state,
                                         return_state=True)
  state = causal_lib.RecurrentState(*(jnp.where(poisoned.reshape(poisoned.shape + (1,) * (x.ndim - 2)),
                                                jnp.nan, x) for x in state))
  out = causal_lib.poison(_divide(num, den), bad)
  return state, out.reshape(batch + out.shape[1:]).astype(_out_dtype(query, key, value))
