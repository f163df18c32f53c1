"""Causal FAVOR as fused Pallas kernels (Triton on GPU; Pallas's interpreter elsewhere): ``causal_method="pallas"``.

The same estimator as :func:`favor_jax.core.causal_xla.chunked`, computed by four kernels over chunks of C
rows, with the features in log domain (φ = exp(log)) and every stabiliser taken from keys a row may see:

- ``_states_kernel`` (one program per (sequence·head, feature block), chunks in order): the state before
  each chunk, S_c = Σ_{j in earlier chunks} e^{ℓk_j − μ_c} v_j and z_c = Σ e^{ℓk_j − μ_c}, μ_c the
  per-feature maximum over those keys (rescaled when it grows, as online softmax does);
- ``_output_kernel`` (one program per (sequence·head, chunk)): row t's scale m_t = max(max_f ℓq_tf + μ_f,
  max_f ℓq_tf + λ_f), λ the chunk's own key maximum, then numerator and denominator times e^{−m_t}: the
  state read out, plus the chunk's own lower-triangular [C, C] product;
- backward: ``_suffix_kernel`` (chunks in reverse) sums e^{ℓq_t − m_t} [dnum_t, dden_t] over later chunks,
  stabilised by its own running maximum ν; ``_grads_kernel`` (per chunk) gives ∂ℓq, ∂ℓk, ∂v from the
  prefix and suffix states and the chunk's own products. The scales are constants under ``grad``, as in
  the XLA pass. Features are computed outside the kernels (by the kernel's own ``log_features``, in
  XLA), so every kernel whose features are pure exponentials runs here; the backward recomputes them from
  q and k (the custom VJP keeps the inputs, the row scales and the chunk states, not the features).

m_t may exceed the row's largest term s_t when a later key in the chunk raised λ; then every term of
row t is scaled by e^{−(m_t − s_t)}. The denominator is at least that factor (its largest term), so
a row whose denominator falls below e^{−SAFE_GAP} is detected, and the whole call is redone by the XLA
chunked pass, which handles it exactly: never a silent zero. Shape letters: see :mod:`favor_jax.core`;
here R = N·H rows of (sequence, head), c chunks, C rows per chunk, F features (padded to a power of two),
E value width (padded likewise).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from favor_jax.core.features import exponential_features, head_major
from favor_jax.core.state import SAFE_GAP, parts

NEG_INF = -jnp.inf


class Blocks(NamedTuple):
  """Static launch choices: chunk rows C, feature block (sequential kernels), Triton warps, interpreter."""
  chunk: int
  block_f: int
  num_warps: int
  interpret: bool
  operands: str = "float32"  # "bfloat16" for bfloat16 inputs: products of features take it (see _dot)


def pallas_block(size: int) -> bool:
  """Whether the fused kernels take this block size (chunk, feature block): a power of two >= 16,
  Triton's block shapes."""
  return size >= 16 and not size & (size - 1)


def _pow2(n: int, least: int = 16) -> int:
  return max(least, 1 << (int(n) - 1).bit_length())


def _safe(x):
  """−∞ → 0 (no key: an offset that multiplies only zeros); comparisons, since Triton has no isfinite."""
  return jnp.where(x == NEG_INF, 0.0, x)


def _dot(a, b, blocks, trans_a=False, trans_b=False, state=False):
  """A matrix product, accumulated in float32. Float32 and float16 inputs (or mixed): full float32
  operands. Bfloat16 inputs (all of q, k, v): products of features, values and cotangents take bfloat16
  (tensor cores); products with a float32 state (large dynamic range) take float32 operands at TF32 on a
  GPU. Never float16: features span e^{−SAFE_GAP}..1 and float16 flushes below e^{−17} (a row's own terms
  would vanish)."""
  if blocks.operands == "float32":
    return plgpu.dot(a, b, trans_a, trans_b, precision=jax.lax.Precision.HIGHEST)
  if state:
    return plgpu.dot(a.astype(jnp.float32), b.astype(jnp.float32), trans_a, trans_b)
  dtype = jnp.dtype(blocks.operands)
  return plgpu.dot(a.astype(dtype), b.astype(dtype), trans_a, trans_b)


def _tril(c):
  return jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]


def _empty_state(bf, e):
  """(μ [bf], S [bf, E], z [bf]) of no rows: μ = −∞, S = 0, z = 0."""
  return (jnp.full((bf,), NEG_INF, jnp.float32), jnp.zeros((bf, e), jnp.float32), jnp.zeros((bf,), jnp.float32))


def _absorb(carry, g, x, w, blocks):
  """The state recurrences' step (prefix states forward, suffix sums backward): add rows with log weights
  g [C, bf], values x [C, E] and z-weights w [C] (None: 1) to (μ, S, z), rescaled to the new maximum μ':

      μ' = max(μ, max_rows g),  S' = S e^{μ−μ'} + Σ_rows e^{g−μ'} x,  z' = z e^{μ−μ'} + Σ_rows e^{g−μ'} w.
  """
  mu, s, z = carry
  new = jnp.maximum(mu, jnp.max(g, axis=0))
  decay = jnp.exp(mu - _safe(new))
  p = jnp.exp(g - _safe(new)[None, :])
  z_add = jnp.sum(p if w is None else p * w[:, None], axis=0)
  return new, s * decay[:, None] + _dot(p, x, blocks, trans_a=True), z * decay + z_add


def _store(refs, c, carry):
  for ref, x in zip(refs, carry):
    ref[c, ...] = x


def _states_kernel(lk_ref, v_ref, mu_ref, s_ref, z_ref, *, blocks, n_chunks):
  """Exclusive prefix states before every chunk (and after the last): μ [c+1, F], S [c+1, F, E], z [c+1, F]."""
  c_rows, bf = blocks.chunk, lk_ref.shape[-1]

  def body(c, carry):
    _store((mu_ref, s_ref, z_ref), c, carry)
    rows = pl.ds(c * c_rows, c_rows)
    return _absorb(carry, lk_ref[rows, :], v_ref[rows, :], None, blocks)

  last = jax.lax.fori_loop(0, n_chunks, body, _empty_state(bf, v_ref.shape[-1]))
  _store((mu_ref, s_ref, z_ref), n_chunks, last)


def _feature_blocks(f, bf):
  return [slice(i, i + bf) for i in range(0, f, bf)]


def _output_kernel(lq_ref, lk_ref, v_ref, mu_ref, s_ref, z_ref, num_ref, den_ref, m_ref, *, blocks):
  """One chunk's rows: numerator [C, E], denominator [C] and row scale m [C] (−∞ only if no finite key)."""
  c_rows, f = lq_ref.shape
  fbs = _feature_blocks(f, blocks.block_f)
  m = jnp.full((c_rows,), NEG_INF, jnp.float32)
  for fb in fbs:
    lq = lq_ref[:, fb]
    lam = jnp.max(lk_ref[:, fb], axis=0)
    m = jnp.maximum(m, jnp.max(lq + jnp.maximum(lam, mu_ref[fb])[None, :], axis=1))
  ms = _safe(m)[:, None]
  num = jnp.zeros(num_ref.shape, jnp.float32)
  den = jnp.zeros((c_rows,), jnp.float32)
  a = jnp.zeros((c_rows, c_rows), jnp.float32)
  for fb in fbs:
    lq, lk, mu = lq_ref[:, fb], lk_ref[:, fb], mu_ref[fb]
    lam = jnp.max(lk, axis=0)
    q_state = jnp.exp(lq + mu[None, :] - ms)
    num += _dot(q_state, s_ref[fb, :], blocks, state=True)
    den += jnp.sum(q_state * z_ref[fb][None, :], axis=1)
    a += _dot(jnp.exp(lq + lam[None, :] - ms), jnp.exp(lk - _safe(lam)[None, :]), blocks, trans_b=True)
  a = jnp.where(_tril(c_rows), a, 0.0)
  num_ref[...] = num + _dot(a, v_ref[...], blocks)
  den_ref[...] = den + jnp.sum(a, axis=1)
  m_ref[...] = m


def _suffix_kernel(lq_ref, mq_ref, dnum_ref, dden_ref, nu_ref, r_ref, rz_ref, *, blocks, n_chunks):
  """Exclusive suffix sums after every chunk: R_c = Σ_{t later} e^{ℓq_t − m_t − ν_c}[dnum_t], rz_c likewise."""
  c_rows, bf = blocks.chunk, lq_ref.shape[-1]

  def body(i, carry):
    c = n_chunks - 1 - i
    _store((nu_ref, r_ref, rz_ref), c, carry)
    rows = pl.ds(c * c_rows, c_rows)
    g = lq_ref[rows, :] - mq_ref[rows][:, None]  # −∞ for rows that see no key
    return _absorb(carry, g, dnum_ref[rows, :], dden_ref[rows], blocks)

  jax.lax.fori_loop(0, n_chunks, body, _empty_state(bf, dnum_ref.shape[-1]))


def _grads_kernel(lq_ref, lk_ref, v_ref, ms_ref, dnum_ref, dden_ref, mu_ref, s_ref, z_ref, nu_ref, r_ref, rz_ref,
                  dlq_ref, dlk_ref, dv_ref, *, blocks):
  """One chunk's ∂ℓq [C, F], ∂ℓk [C, F], ∂v [C, E] given the cotangents of numerator and denominator."""
  c_rows, f = lq_ref.shape
  tril = _tril(c_rows)
  v, dnum, dden = v_ref[...], dnum_ref[...], dden_ref[...]
  ms = ms_ref[...][:, None]
  g = jnp.where(tril, _dot(dnum, v, blocks, trans_b=True) + dden[:, None], 0.0)  # ∂/∂(row t's term j)
  a = jnp.zeros((c_rows, c_rows), jnp.float32)
  dv = jnp.zeros(dv_ref.shape, jnp.float32)
  for fb in _feature_blocks(f, blocks.block_f):
    lq, lk = lq_ref[:, fb], lk_ref[:, fb]
    lam = jnp.max(lk, axis=0)
    q_state = jnp.exp(lq + mu_ref[fb][None, :] - ms)
    q_chunk = jnp.exp(lq + lam[None, :] - ms)
    k_chunk = jnp.exp(lk - _safe(lam)[None, :])
    k_later = jnp.exp(lk + nu_ref[fb][None, :])  # ≤ 1: ν ≤ −ℓk for keys that later rows see
    a += _dot(q_chunk, k_chunk, blocks, trans_b=True)
    from_state = _dot(dnum, s_ref[fb, :], blocks, trans_b=True, state=True) + dden[:, None] * z_ref[fb][None, :]
    dlq_ref[:, fb] = q_state * from_state + q_chunk * _dot(g, k_chunk, blocks)
    dlk_ref[:, fb] = (k_chunk * _dot(g, q_chunk, blocks, trans_a=True)
                      + k_later * (_dot(v, r_ref[fb, :], blocks, trans_b=True, state=True) + rz_ref[fb][None, :]))
    dv += _dot(k_later, r_ref[fb, :], blocks, state=True)
  a = jnp.where(tril, a, 0.0)
  dv_ref[...] = dv + _dot(a, dnum, blocks, trans_a=True)


def _call(kernel, grid, in_specs, out_specs, out_shape, blocks, **kw):
  return pl.pallas_call(
      functools.partial(kernel, blocks=blocks, **kw), grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=blocks.interpret,
      compiler_params=None if blocks.interpret else plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2))


def _spec(shape, index_map):
  return pl.BlockSpec(shape, index_map)


def _prefix_states(lk, v, blocks):
  r, length, f = lk.shape
  e, bf, nc = v.shape[-1], blocks.block_f, length // blocks.chunk
  seq = lambda w: _spec((None, length, w), lambda i, j: (i, 0, j))
  f32 = jnp.float32
  return _call(
      _states_kernel, (r, f // bf), [seq(bf), _spec((None, length, e), lambda i, j: (i, 0, 0))],
      [_spec((None, nc + 1, bf), lambda i, j: (i, 0, j)), _spec((None, nc + 1, bf, e), lambda i, j: (i, 0, j, 0)),
       _spec((None, nc + 1, bf), lambda i, j: (i, 0, j))],
      [jax.ShapeDtypeStruct((r, nc + 1, f), f32), jax.ShapeDtypeStruct((r, nc + 1, f, e), f32),
       jax.ShapeDtypeStruct((r, nc + 1, f), f32)],
      blocks, n_chunks=nc)(lk, v)


def _chunk_specs(c_rows, f, e):
  """BlockSpecs of one chunk's rows [C, F], values [C, E], per-row [C], and its states μ/z [F], S [F, E]."""
  rows = lambda w: _spec((None, c_rows, w), lambda i, c: (i, c, 0))
  return dict(feat=rows(f), val=rows(e), row=_spec((None, c_rows), lambda i, c: (i, c)),
              vec=_spec((None, None, f), lambda i, c: (i, c, 0)),
              mat=_spec((None, None, f, e), lambda i, c: (i, c, 0, 0)))


def _forward(lq, lk, v, blocks):
  r, length, f = lq.shape
  e, nc = v.shape[-1], length // blocks.chunk
  mu, s, z = _prefix_states(lk, v, blocks)
  sp = _chunk_specs(blocks.chunk, f, e)
  f32 = jnp.float32
  num, den, m = _call(
      _output_kernel, (r, nc), [sp["feat"], sp["feat"], sp["val"], sp["vec"], sp["mat"], sp["vec"]],
      [sp["val"], sp["row"], sp["row"]],
      [jax.ShapeDtypeStruct((r, length, e), f32), jax.ShapeDtypeStruct((r, length), f32),
       jax.ShapeDtypeStruct((r, length), f32)],
      blocks)(lq, lk, v, mu, s, z)
  return (num, den, m), (mu, s, z)


@jax.custom_jvp
def _first_order_only(x):
  """x; differentiating it (the backward pass's inputs, under a second derivative) raises a clear error
  instead of Pallas's own, which names none of the caller's arguments."""
  return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
  raise ValueError("causal_method='pallas' has first derivatives only (its backward kernels are not "
                   "differentiable); for second derivatives (grad of grad, hessian) use causal_method='chunked'")


def _floating_first_order(x):
  return _first_order_only(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(log_rows, blocks, q, k, v, seen, *consts):
  """(numerator [R, L, E], denominator [R, L], row scale m [R, L]) times e^{−m}, the features
  ``log_rows(q, k, *consts)`` (padded [R, L, F] float32 logs); ``seen`` [R, L] bool."""
  (num, den, m), _ = _forward(*log_rows(q, k, *consts), v, blocks)
  return num, den, m


def _fused_fwd(log_rows, blocks, q, k, v, seen, *consts):
  q, k, v, consts = jax.tree.map(_floating_first_order, (q, k, v, consts))  # a second derivative: clear error
  (num, den, m), states = _forward(*log_rows(q, k, *consts), v, blocks)
  # Kept for the backward: the inputs (not the float32 log features, F/D·4/itemsize times their size:
  # recomputed there) and one state per chunk.
  return (num, den, m), (q, k, v, seen, consts, m, states)


def _fused_bwd(log_rows, blocks, res, cts):
  res, cts = jax.tree.map(_floating_first_order, (res, cts))
  q, k, v, seen, consts, m, (mu, s, z) = res
  (lq, lk), features_vjp = jax.vjp(log_rows, q, k, *consts)
  dnum, dden, _ = cts  # the scale is a constant (as in the XLA pass)
  r, length, f = lq.shape
  e, bf, nc = v.shape[-1], blocks.block_f, length // blocks.chunk
  f32 = jnp.float32
  ms = _safe(jax.lax.stop_gradient(m))
  mq = jnp.where(seen, ms, jnp.inf)  # rows that see no key have no terms: leave them out of ν
  seq = lambda w: _spec((None, length, w), lambda i, j: (i, 0, j))
  row_all = _spec((None, length), lambda i, j: (i, 0))
  nu, rr, rz = _call(
      _suffix_kernel, (r, f // bf), [seq(bf), row_all, _spec((None, length, e), lambda i, j: (i, 0, 0)), row_all],
      [_spec((None, nc, bf), lambda i, j: (i, 0, j)), _spec((None, nc, bf, e), lambda i, j: (i, 0, j, 0)),
       _spec((None, nc, bf), lambda i, j: (i, 0, j))],
      [jax.ShapeDtypeStruct((r, nc, f), f32), jax.ShapeDtypeStruct((r, nc, f, e), f32),
       jax.ShapeDtypeStruct((r, nc, f), f32)],
      blocks, n_chunks=nc)(lq, mq, dnum, dden)
  sp = _chunk_specs(blocks.chunk, f, e)
  dlq, dlk, dv = _call(
      _grads_kernel, (r, nc),
      [sp["feat"], sp["feat"], sp["val"], sp["row"], sp["val"], sp["row"], sp["vec"], sp["mat"], sp["vec"],
       sp["vec"], sp["mat"], sp["vec"]],
      [sp["feat"], sp["feat"], sp["val"]],
      [jax.ShapeDtypeStruct(lq.shape, f32), jax.ShapeDtypeStruct(lk.shape, f32), jax.ShapeDtypeStruct(v.shape, f32)],
      blocks)(lq, lk, v, ms, dnum, dden, mu, s, z, nu, rr, rz)
  # Masked keys (ℓk = −∞) and padded features get exactly zero gradient already.
  dq, dk, *dconsts = features_vjp((dlq, dlk))
  dconsts = [None if d.dtype == jax.dtypes.float0 else d for d in dconsts]  # a mask is a constant
  return (dq, dk, dv.astype(v.dtype), None, *dconsts)


_fused.defvjp(_fused_fwd, _fused_bwd)


# Launch choices on a GPU, the fastest of the block-size sweep (experiments/configs/blocks.py) on an H200 in
# bfloat16, B=1 H=8 D=64 M=256 (experiments/results/pallas_h200_bf16): chunk 64, 4 warps, feature blocks
# of 32, at L=4096 forward (0.450 ms) and forward + backward (1.033 ms; 1.202 ms with blocks of 64).
GPU_DEFAULTS = dict(chunk_size=64, num_warps=4, block_f=32)


def blocks_for(chunk_size: int = GPU_DEFAULTS["chunk_size"], *, num_warps: int = GPU_DEFAULTS["num_warps"],
               block_f: int = GPU_DEFAULTS["block_f"], interpret: bool | None = None) -> Blocks:
  """Launch choices; ``interpret`` None: Pallas's interpreter unless the default backend is a GPU."""
  if not pallas_block(chunk_size):
    raise ValueError(f"causal_method='pallas' needs chunk_size a power of two >= 16, got {chunk_size}")
  if not pallas_block(block_f):
    raise ValueError(f"block_f must be a power of two >= 16, got {block_f}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return Blocks(chunk_size, block_f, num_warps, bool(interpret))


def causal(features, q, k, v, mask, *, chunk_size: int = 64, blocks: Blocks | None = None,
           return_scale: bool = False, fallback=None):
  """Causal linear attention through the fused kernels: (numerator [N, L, H, Dv], denominator [N, L, H]).

  The contract of :func:`favor_jax.core.causal_xla.chunked` (both times the same per-row factor e^{−scale};
  ``return_scale`` adds the scale [N, L, H], −∞ where a row sees no key). The feature map must give
  pure exponentials, φ = exp(log) with a log per feature (:func:`~favor_jax.core.features.exponential_features`,
  read off the features: e.g. positive, hyperbolic, FAVOR++, FAVOR#, Hedgehog, ELU+1); others (signed or
  polynomial features) raise ``ValueError``: use ``"chunked"``.
  ``fallback``: the pass that redoes the call where rows lost their terms, called as
  ``fallback(features, q, k, v, mask, chunk_size=C, return_scale=True)`` (:mod:`favor_jax.core.causal` gives
  the XLA chunked pass); None or False (tests only): the fused result even where rows lost their terms.
  """
  blocks = blocks_for(chunk_size) if blocks is None else blocks
  if not exponential_features(features, q, k):
    raise ValueError("causal_method='pallas' needs features that are exponentials with a log per feature "
                     "(no multiplier); this kernel's are not: use causal_method='chunked'")
  n, length, h = q.shape[:3]
  f = jax.eval_shape(lambda: head_major(features, q, k)[0].log).shape[-1]
  dv = v.shape[-1]
  padded, fp, ep = -(-length // blocks.chunk) * blocks.chunk, _pow2(f), _pow2(dv)
  bf = min(blocks.block_f, fp)
  # Bfloat16 operands only where the output is bfloat16 (every input is): a float32 value or key must not be
  # rounded to bfloat16 inside. Float16's range is too short: see _dot.
  operands = "bfloat16" if jnp.result_type(q, k, v) == jnp.bfloat16 else "float32"
  blocks = blocks._replace(block_f=bf, operands=operands)

  def rows(x, value, width):  # [N, H, L, W] -> [N·H, padded, width]
    x = x.reshape((n * h, length, x.shape[-1]))
    return jnp.pad(x, ((0, 0), (0, padded - length), (0, width - x.shape[-1])), constant_values=value)

  def log_rows(q, k):
    fq, fk = head_major(features, q, k)
    log_q, _ = parts(fq)
    log_k, _ = parts(fk, mask[:, None, :, None])
    return rows(log_q.astype(jnp.float32), NEG_INF, fp), rows(log_k.astype(jnp.float32), NEG_INF, fp)

  # The features' own parameters (projection, ρ, a learned map) as explicit arguments of the custom VJP.
  log_rows, consts = jax.closure_convert(log_rows, q, k)
  vv = rows(jnp.swapaxes(v, 1, 2), 0.0, ep)
  seen_NL = jax.lax.associative_scan(jnp.logical_or, mask, axis=1)
  seen = jnp.broadcast_to(seen_NL[:, None], (n, h, length)).reshape((n * h, length))
  seen = jnp.pad(seen, ((0, 0), (0, padded - length)))
  num, den, m = _fused(log_rows, blocks, q, k, vv, seen, *consts)
  back = lambda x: jnp.swapaxes(x[:, :length].reshape((n, h, length) + x.shape[2:]), 1, 2)
  num, den = back(num[..., :dv]), back(den)
  scale = back(jnp.where(seen, jax.lax.stop_gradient(m), NEG_INF))
  # A later key in a row's chunk raised its scale so far that its terms may have left float32's range:
  # redo the call with the XLA pass, which computes such chunks per token.
  lost = lost_rows(den, scale)
  if not fallback:
    return (num, den, scale) if return_scale else (num, den)
  out = jax.lax.cond(
      jnp.any(lost), lambda: fallback(features, q, k, v, mask, chunk_size=blocks.chunk, return_scale=True),
      lambda: (num, den, scale))
  return out if return_scale else out[:2]


def lost_rows(den, scale):
  """Rows that see a key but whose denominator (≥ their largest term) fell below e^{−SAFE_GAP}."""
  return jnp.isfinite(scale) & (den < jnp.exp(-SAFE_GAP))
