"""Causal FAVOR as fused Pallas kernels for TPU (Mosaic): ``causal_method="pallas"`` where the program is lowered
for a TPU (and, interpreted, on a CPU: see :mod:`favor_jax.core.causal`).

The same estimator as :func:`favor_jax.core.causal_xla.chunked` and the Triton kernels
(:mod:`favor_jax.core.fused.gpu`): features in log domain (φ = exp(log)), every stabiliser from keys a row may
see, the row scales constants under ``grad``. Where the kernel record says how (``Kernel.fused_map``:
positive, hyperbolic; :func:`feature_map`), the kernels read q, k, v in their own dtype and the projection
and compute the log features ω·x − ‖x‖²/2 − log √M in VMEM, forward and backward (nothing of size L×F goes
through HBM; the backward gives ∂q, ∂k and the projection's gradient per row); for any other exponential map
(FAVOR++, FAVOR#, Hedgehog, ELU+1, a record of your own) XLA computes the log features (the kernel's own
``log_features``) and the kernels read them. Three kernels, each over a grid (sequence·head "parallel",
chunk "arbitrary") with its running state in VMEM scratch, so no per-chunk state goes to HBM:

- ``_forward_kernel`` (chunks in order): the prefix state (μ [1, F], Sᵀ [Dv, F] and the denominator's own
  z [1, F], S_f = Σ_j e^{ℓk_jf + d_j − μ_f} v_j, z_f the same without v_j, d_j the gates' decay from key j to
  the chunk's start), row t's scale m_t = max_f (ℓq_tf + max(λ_f, μ_f + a_t)) (λ the chunk's own key
  maximum, a_t the decay from the chunk's start to t), and num_t, den_t times e^{−m_t}: the state read out
  plus the chunk's own [C, C] product times e^{D}, D_tj = Σ_{j<l≤t} g_l (−∞ for j > t and across a reset);
- ``_dq_kernel`` (chunks in order, the prefix state recomputed): ∂ℓq (or ∂q and ∂ω);
- ``_dk_kernel`` (chunks in reverse): the suffix state (Rᵀ [Dv, F] of ∂num, r [1, F] of ∂den, ν their running
  maximum), then ∂ℓk (or ∂k and ∂ω) and ∂v.

The gates' gradient is ∂g_l = Σ_{t ≥ l} Σ_f (∂ℓq_tf − ∂ℓk_tf) (every pair j < l ≤ t counted once), summed
in XLA within each segment between resets. Feature widths are padded to the lane width (128); values are
not padded (a block as wide as its array); the chunk is a multiple of 128 when compiled (8 when
interpreted), L a multiple of the chunk. Products of features and values take bfloat16 operands where every
input is bfloat16 and the precision is the default, products with a state (and the projection's) float32
ones. A later key in a row's chunk can raise its scale m_t above its largest term; rows whose denominator
falls below e^{−SAFE_GAP} are detected and the call is redone by the XLA pass (never a silent zero), decided
inside the custom VJP (:func:`favor_jax.core.fused.rows.run`).
Shape letters: see :mod:`favor_jax.core`; R = N·H rows, C rows per chunk, F features (padded), D head dim.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from favor_jax.core import features as features_lib
from favor_jax.core.features import exponential_features, head_major
from favor_jax.core.fused import rows as fused_rows

NEG_INF = -jnp.inf
LANE, SUBLANE = 128, 8  # a TPU vector register's lanes (minor axis) and sublanes


class Config(NamedTuple):
  """Static choices of one call: chunk rows C, Mosaic (``interpret`` False) or an interpreter (True: Pallas's
  generic one; ``pltpu.InterpretParams``: its TPU interpret mode), the dots' precision and
  operand dtype ("bfloat16" for products of features and values when every input is bfloat16 and the
  precision is the default), whether gates are given, and whether the kernels compute the features from q,
  k and the projection (``feature_map``, see :func:`feature_map`) or read them."""
  chunk: int
  interpret: Any
  precision: Any
  operands: str
  gated: bool
  feature_map: str | None = None  # the kernel record's ``fused_map``: features computed on chip; None: read
  half_sq: float = 0.0  # c = d^{-1/2}/2 of the on-chip features' −c‖x‖²


def chunk_rows(chunk_size: int, interpret: bool) -> int:
  """C: ``chunk_size`` rounded up to a multiple of 128 when compiled (the lane axis of the [C, C] products
  and of the transposed state updates on the MXU), of 8 when interpreted (any sublane-aligned chunk)."""
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
  unit = SUBLANE if interpret else LANE
  return -(-chunk_size // unit) * unit


def mosaic_precision(precision):
  """A checked precision (None, a ``jax.lax.Precision``, its name, a ``DotAlgorithmPreset`` name) as Mosaic
  takes it: None (the caller's ``jax.default_matmul_precision`` if set, else Mosaic's default), ``DEFAULT``
  (one bfloat16 pass: "default", "bfloat16", "BF16_BF16_F32") or ``HIGHEST`` (float32 contraction). Mosaic
  has no three-pass mode: "high", "tensorfloat32" and the other presets take ``HIGHEST``, at least as
  precise as asked."""
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
    if precision is None:
      return None
  if isinstance(precision, (tuple, list)):
    precision = precision[0]
  name = precision.name if hasattr(precision, "name") else str(precision)
  if name.lower() in ("default", "bfloat16", "bf16_bf16_f32"):
    return jax.lax.Precision.DEFAULT
  return jax.lax.Precision.HIGHEST


def _safe(x):
  """−∞ → 0: an offset that multiplies only zeros (no key yet)."""
  return jnp.where(x == NEG_INF, 0.0, x)


def _dot(a, b, dims: str, cfg: Config, state: bool = False):
  """a·b ("nn"), a·bᵀ ("nt") or aᵀ·b ("tn"), accumulated in float32 at ``cfg.precision``. Products with a
  state (large dynamic range) take float32 operands; the others bfloat16 ones where ``cfg.operands`` says so."""
  contract = {"nn": ((1,), (0,)), "nt": ((1,), (1,)), "tn": ((0,), (0,))}[dims]
  dtype = jnp.float32 if state or cfg.operands == "float32" else jnp.bfloat16
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (contract, ((), ())), precision=cfg.precision,
                             preferred_element_type=jnp.float32)


def _iota(c, axis):
  return jax.lax.broadcasted_iota(jnp.int32, (c, c), axis)


def _suffix_sums(x):
  """Σ_{l ≥ j} x[t, l] for every (t, j) of x [C, C]: a log-depth (Hillis–Steele) scan along the lanes, log2 C
  steps of a lane rotation and an add on the VPU. With terms of one sign (here ≤ 0, −∞ allowed) every
  partial sum is a sum of such terms: relative error ≤ log2(C)·ε, no cancellation, and a −∞ term gives −∞
  (never ∞ − ∞)."""
  c = x.shape[1]
  lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  step = 1
  while step < c:
    x = x + jnp.where(lane + step < c, pltpu.roll(x, c - step, 1), 0.0)  # x[t, l + step], 0 past the end
    step *= 2
  return x


def _decays(g_ref, c):
  """The gates of one chunk, g [1, C] (≤ 0, −∞ at a reset), as (a [C, 1], b [C, 1], total [1, 1], e^D [C, C]):
  a_t = Σ_{start≤l≤t} g_l, b_j = Σ_{j<l≤end} g_l, total = Σ_{start≤l≤end} g_l, D_tj = Σ_{j<l≤t} g_l (and
  e^D = 0 for j > t). Sums of terms ≤ 0 (never differences of running sums: no cancellation), −∞ where a
  reset is among the terms; D by a log-depth scan on the VPU (:func:`_suffix_sums`, O(C² log C) additions,
  no [C, C] × [C, C] product): row t holds g_{l+1} for l + 1 ≤ t, summed from lane j on."""
  t, l = _iota(c, 0), _iota(c, 1)
  if g_ref is None:
    return 0.0, 0.0, 0.0, jnp.where(l <= t, 1.0, 0.0)
  g = g_ref[...]
  reset = jnp.where(g == NEG_INF, 1.0, 0.0)
  fin = jnp.where(g == NEG_INF, 0.0, g)

  def summed(keep):  # Σ_l g_l over keep [C, C] (rows × positions l), −∞ with a reset among them
    s = jnp.sum(jnp.where(keep, fin, 0.0), axis=1, keepdims=True)
    return jnp.where(jnp.sum(jnp.where(keep, reset, 0.0), axis=1, keepdims=True) > 0, NEG_INF, s)

  total = jnp.where(jnp.sum(reset, axis=1, keepdims=True) > 0, NEG_INF, jnp.sum(fin, axis=1, keepdims=True))
  lane = jax.lax.broadcasted_iota(jnp.int32, g.shape, 1)
  g_next = jnp.where(lane + 1 < c, pltpu.roll(g, c - 1, 1), 0.0)  # g_{l+1} at lane l
  d = _suffix_sums(jnp.where(l + 1 <= t, g_next, 0.0))
  decay = jnp.where(l <= t, jnp.exp(jnp.minimum(d, 0.0)), 0.0)
  return summed(l <= t), summed(l > t), total, decay


def _start(*scratch):
  """At a row's first chunk: the empty state (μ = −∞, S = 0, z = 0)."""
  @pl.when(pl.program_id(1) == 0)
  def _():
    mu, *rest = scratch
    mu[...] = jnp.full(mu.shape, NEG_INF, jnp.float32)
    for x in rest:
      x[...] = jnp.zeros(x.shape, jnp.float32)


def _absorb(mu_ref, st_ref, z_ref, logs, x, w, total, cfg):
  """The state recurrence's step: decay (μ, Sᵀ, z) by ``total``, add rows with log weights ``logs`` [C, F],
  vectors x [C, Dv] (into Sᵀ [Dv, F]) and scalars w [C, 1] (into z [1, F], a sublane reduction: the
  denominator's state, no column of ones in the values), rescaled to the new maximum
  μ' = max(μ + total, max_rows logs)."""
  mu = mu_ref[...] + total
  new = jnp.maximum(mu, jnp.max(logs, axis=0, keepdims=True))
  safe = _safe(new)
  e = jnp.exp(logs - safe)
  keep = jnp.exp(mu - safe)
  st_ref[...] = st_ref[...] * keep + _dot(x, e, "tn", cfg)
  z_ref[...] = z_ref[...] * keep + (jnp.sum(e, axis=0, keepdims=True) if w is None else
                                    jnp.sum(w * e, axis=0, keepdims=True))
  mu_ref[...] = new


def _log_features(x, p, fb, cfg):
  """Log features [C, F] of rows x [C, D] (their dtype) computed on chip: x pᵀ − c‖x‖² + fb, p [F, D] the
  projection already scaled by d^{-1/4} (and, hyperbolic, stacked with its negative), c = d^{-1/2}/2, fb
  [1, F] the log-normaliser (−∞ for padded features). Float32 operands at the call's precision (on a TPU
  the default is one bfloat16 pass, as XLA's own product of the projection there)."""
  xf = x.astype(jnp.float32)
  return _dot(xf, p, "nt", cfg, state=True) - cfg.half_sq * jnp.sum(xf * xf, axis=1, keepdims=True) + fb


def _chunk(lq_ref, lk_ref, v_ref, refs, cfg):
  """One chunk's log features (read, or computed from q, k and the projection where ``cfg.feature_map``), its
  values, the gates' decays and λ [1, F], and (feature map) the context of the features' backward (q, k in
  float32, the projection); ``refs`` starts with the projection's, the normaliser's and the key bias's refs
  (feature map), then the gate's ref if gated."""
  ctx = None
  if cfg.feature_map:
    p_ref, fb_ref, kb_ref, *refs = refs
    p, fb = p_ref[...], fb_ref[...]
    q, k = lq_ref[...], lk_ref[...]
    lq, lk = _log_features(q, p, fb, cfg), _log_features(k, p, fb, cfg) + kb_ref[...]
    ctx = (q.astype(jnp.float32), k.astype(jnp.float32), p)
  else:
    lq, lk = lq_ref[...], lk_ref[...]
  g_ref, refs = (refs[0], refs[1:]) if cfg.gated else (None, refs)
  return (lq, lk, v_ref[...]) + _decays(g_ref, lk.shape[0]) + (jnp.max(lk, axis=0, keepdims=True),), ctx, refs


def _features_grad(dl, x, p, dx_ref, dp_ref, sum_ref, cfg):
  """From ∂ℓ [C, F] of the rows' log features: ∂x [C, D] = ∂ℓ p − 2c (Σ_f ∂ℓ_f) x into ``dx_ref``, the
  projection's ∂p [F, D] += ∂ℓᵀ x accumulated over the row's chunks in ``dp_ref`` (resident: its block does
  not move along the chunk axis), and Σ_f ∂ℓ_f [C, 1] into ``sum_ref`` (gated: the gates' gradient)."""
  total = jnp.sum(dl, axis=1, keepdims=True)
  dx_ref[...] = (_dot(dl, p, "nn", cfg, state=True) - 2.0 * cfg.half_sq * total * x).astype(dx_ref.dtype)

  @pl.when(pl.program_id(1) == 0)
  def _():
    dp_ref[...] = jnp.zeros(dp_ref.shape, jnp.float32)

  dp_ref[...] += _dot(dl, x, "tn", cfg, state=True)
  if sum_ref is not None:
    sum_ref[...] = total


def _forward_kernel(lq_ref, lk_ref, v_ref, *refs, cfg):
  """num [C, Dv] and den [C, 1] (times e^{−m}) and m [C, 1] (−∞ where no key is in reach)."""
  (lq, lk, v, a, b, total, decay, lam), _, refs = _chunk(lq_ref, lk_ref, v_ref, refs, cfg)
  num_ref, den_ref, m_ref, mu_ref, st_ref, z_ref = refs
  _start(mu_ref, st_ref, z_ref)
  read = mu_ref[...] + a
  m = jnp.max(lq + jnp.maximum(lam, read), axis=1, keepdims=True)
  ms = _safe(m)
  w = _dot(jnp.exp(lq + lam - ms), jnp.exp(lk - _safe(lam)), "nt", cfg) * decay
  eq = jnp.exp(lq + read - ms)
  num_ref[...] = _dot(eq, st_ref[...], "nt", cfg, state=True) + _dot(w, v, "nn", cfg)
  den_ref[...] = jnp.sum(eq * z_ref[...], axis=1, keepdims=True) + jnp.sum(w, axis=1, keepdims=True)
  m_ref[...] = m
  _absorb(mu_ref, st_ref, z_ref, lk + b, v, None, total, cfg)


def _dq_kernel(lq_ref, lk_ref, v_ref, *refs, cfg):
  """∂ℓq [C, F] (or, feature map: ∂q, ∂p, Σ_f ∂ℓq) from ∂num [C, Dv], ∂den [C, 1] and the row scales
  m [C, 1] (+∞ for rows without terms)."""
  (lq, lk, v, a, b, total, decay, lam), ctx, refs = _chunk(lq_ref, lk_ref, v_ref, refs, cfg)
  m_ref, dnum_ref, dden_ref, *refs = refs
  outs, (mu_ref, st_ref, z_ref) = refs[:-3], refs[-3:]
  _start(mu_ref, st_ref, z_ref)
  ms, dnum, dden = m_ref[...], dnum_ref[...], dden_ref[...]
  g = (_dot(dnum, v, "nt", cfg) + dden) * decay  # ∂/∂(row t's weight of key j)
  from_state = jnp.exp(lq + mu_ref[...] + a - ms) * (_dot(dnum, st_ref[...], "nn", cfg, state=True)
                                                     + dden * z_ref[...])
  dlq = from_state + jnp.exp(lq + lam - ms) * _dot(g, jnp.exp(lk - _safe(lam)), "nn", cfg)
  if ctx is None:
    outs[0][...] = dlq
  else:
    _features_grad(dlq, ctx[0], ctx[2], outs[0], outs[1], outs[2] if cfg.gated else None, cfg)
  _absorb(mu_ref, st_ref, z_ref, lk + b, v, None, total, cfg)


def _dk_kernel(lq_ref, lk_ref, v_ref, *refs, cfg):
  """∂ℓk [C, F] (or, feature map: ∂k, ∂p, Σ_f ∂ℓk) and ∂v [C, Dv] (chunks in reverse), the suffix state
  (ν [1, F], Rᵀ [Dv, F] of ∂num, r [1, F] of ∂den) in scratch."""
  (lq, lk, v, a, b, total, decay, lam), ctx, refs = _chunk(lq_ref, lk_ref, v_ref, refs, cfg)
  m_ref, dnum_ref, dden_ref, *refs = refs
  outs, (nu_ref, rt_ref, r_ref) = refs[:-3], refs[-3:]
  _start(nu_ref, rt_ref, r_ref)
  ms, dnum, dden, rt = m_ref[...], dnum_ref[...], dden_ref[...], rt_ref[...]
  q_chunk, k_chunk = jnp.exp(lq + lam - ms), jnp.exp(lk - _safe(lam))
  g = (_dot(dnum, v, "nt", cfg) + dden) * decay
  w = _dot(q_chunk, k_chunk, "nt", cfg) * decay
  k_later = jnp.exp(lk + b + nu_ref[...])  # ≤ 1: ν ≤ −(ℓk + b) for keys the later rows see
  dlk = k_chunk * _dot(g, q_chunk, "tn", cfg) + k_later * (_dot(v, rt, "nn", cfg, state=True) + r_ref[...])
  dv_ref = outs[-1]
  dv_ref[...] = _dot(w, dnum, "tn", cfg) + _dot(k_later, rt, "nt", cfg, state=True)
  if ctx is None:
    outs[0][...] = dlk
  else:
    _features_grad(dlk, ctx[1], ctx[2], outs[0], outs[1], outs[2] if cfg.gated else None, cfg)
  _absorb(nu_ref, rt_ref, r_ref, lq - ms + a, dnum, dden, total, cfg)


def _call(kernel, cfg, rows, f, e, ins, outs, reverse=False, d=None, groups=1):
  """``kernel`` over the grid (R rows, chunks); ``ins``/``outs``: per array, its kind ("f" [C, F], "e"
  [C, E], "1" [C, 1], "g" the gate [1, C], "x" [C, D] rows of q or k, "p" the projection [F, D] of the row's
  head (``groups``: 1 shared, H per head), "n" the normaliser [1, F], "P" an accumulated [F, D] per row) and,
  for outs, its dtype; scratch: a state (μ [1, F], Sᵀ [E, F], z [1, F]); E = Dv, unpadded (a block as wide
  as its array)."""
  c, n_chunks = cfg.chunk, rows // cfg.chunk
  chunk = (lambda i, j: (i, n_chunks - 1 - j, 0)) if reverse else (lambda i, j: (i, j, 0))
  spec = {"f": pl.BlockSpec((None, c, f), chunk), "e": pl.BlockSpec((None, c, e), chunk),
          "1": pl.BlockSpec((None, c, 1), chunk), "x": pl.BlockSpec((None, c, d), chunk),
          "p": pl.BlockSpec((None, f, d), lambda i, j: (i % groups, 0, 0)),
          "n": pl.BlockSpec((1, f), lambda i, j: (0, 0)),
          "P": pl.BlockSpec((None, f, d), lambda i, j: (i, 0, 0)),
          "g": pl.BlockSpec((None, None, 1, c), lambda i, j: chunk(i, j) + (0,))}
  n = ins[0][1].shape[0]
  shape = {"f": (n, rows, f), "e": (n, rows, e), "1": (n, rows, 1), "x": (n, rows, d), "P": (n, f, d)}
  params = dict(interpret=cfg.interpret) if cfg.interpret else dict(
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=(n, n_chunks), in_specs=[spec[kind] for kind, _ in ins],
      out_specs=[spec[kind] for kind, _ in outs],
      out_shape=[jax.ShapeDtypeStruct(shape[kind], dtype) for kind, dtype in outs],
      scratch_shapes=[pltpu.VMEM((1, f), jnp.float32), pltpu.VMEM((e, f), jnp.float32),
                      pltpu.VMEM((1, f), jnp.float32)], **params,
  )(*(x for _, x in ins))


def _gate_rows(g, c):
  """[R, L] gates as [R, L/C, 1, C] (a chunk's gates along the lane axis)."""
  return None if g is None else g.reshape((g.shape[0], g.shape[1] // c, 1, c))


def _ins(lq, lk, v, g, cfg):
  gate = [("g", _gate_rows(g, cfg.chunk))] if cfg.gated else []
  return [("f", lq), ("f", lk), ("e", v)] + gate


def _forward(lq, lk, v, g, cfg):
  r, length, f = lq.shape
  return _call(_forward_kernel, cfg, length, f, v.shape[-1], _ins(lq, lk, v, g, cfg), _FORWARD_OUTS)


_FORWARD_OUTS = [("e", jnp.float32), ("1", jnp.float32), ("1", jnp.float32)]  # num, den, m


def feature_map(features) -> str | None:
  """The on-chip feature map for ``features`` (a :class:`~favor_jax.core.features.Features`), chosen once from
  the kernel record: its ``fused_map`` ("positive": φ = exp(ωx − ‖x‖²/2)/√M, "hyperbolic": the same with
  [ω; −ω], /√(2M)) where the call gives a projection and no statistic; None (a record without one, a
  kernel of your own, a plain callable, given features): the features from XLA, read by the kernels."""
  kern = getattr(features, "kernel", None)
  params = getattr(features, "params", ())
  name = getattr(kern, "fused_map", None)
  if name is None or len(params) != 2 or params[0] is None or params[1] is not None:
    return None
  return name


def _projection_rows(projection, name, f_pad, d):
  """(p [G, F, D] float32, fb [1, F]): the projection as the kernels read it (scaled by d^{-1/4}; hyperbolic:
  stacked with its negative; padded with zero rows to F), and the log-normaliser (−∞ on padded features).
  G = 1 for a shared [M, D] projection, H for one per head [H, M, D]."""
  w = projection.astype(jnp.float32) * d ** -0.25
  w = w[None] if w.ndim == 2 else w
  if name == "hyperbolic":
    w = jnp.concatenate([w, -w], axis=-2)
  f = w.shape[-2]
  log_norm = 0.5 * math.log(f)  # √M positive, √(2M) hyperbolic
  fb = jnp.where(jnp.arange(f_pad) < f, -log_norm, NEG_INF)[None].astype(jnp.float32)
  return jnp.pad(w, ((0, 0), (0, f_pad - f), (0, 0))), fb


def program(cfg: Config) -> fused_rows.Program:
  """The Mosaic kernels as a :class:`~favor_jax.core.fused.rows.Program`: the forward kernel, then (backward)
  the ∂ℓq and ∂ℓk/∂v kernels. With ``cfg.feature_map`` the kernels read q, k, v in their dtype and the
  projection and compute the features on chip, forward and backward (nothing of size L×F in HBM; the
  backward gives ∂q, ∂k and the projection's gradient per row); otherwise they read the features XLA computed
  (recomputed from q, k and the projection for the backward). Kept between forward and backward: the inputs
  and the row scales."""
  def on_chip(rows, q, k, mask, projection, features):
    f_pad = -(-jax.eval_shape(lambda: head_major(features, q, k)[0].log).shape[-1] // LANE) * LANE
    p, fb = _projection_rows(projection, cfg.feature_map, f_pad, q.shape[-1])
    n, length, h = q.shape[:3]
    key_bias = jnp.where(jnp.broadcast_to(mask[:, :, None], (n, length, h)), 0.0, NEG_INF)
    x_ins = [("x", rows.of(q, 0.0)), ("x", rows.of(k, 0.0))]
    extra = [("p", p), ("n", fb), ("1", rows.of(key_bias, NEG_INF)[..., None])]
    return x_ins, extra, f_pad, p.shape[0]

  def ins_of(first, v_rows, extra, g):
    gate = [("g", _gate_rows(g, cfg.chunk))] if cfg.gated else []
    return first[:2] + [("e", v_rows)] + extra + gate

  def forward(features, q, k, v, gate, mask):
    rows = fused_rows.prepare(features, q, k, v, mask, gate, chunk=cfg.chunk, lane=LANE)
    vv = rows.value_rows(v)
    if cfg.feature_map:
      x_ins, extra, f, groups = on_chip(rows, q, k, mask, features.params[0], features)
      num, den, m = _call(_forward_kernel, cfg, vv.shape[1], f, vv.shape[-1], ins_of(x_ins, vv, extra, rows.gate),
                          _FORWARD_OUTS, d=q.shape[-1], groups=groups)
    else:
      num, den, m = _forward(*rows.log_rows(q, k), vv, rows.gate, cfg)
    return rows.back(num), rows.back(den[..., 0]), rows.back(jnp.where(rows.seen, m[..., 0], NEG_INF))

  def backward(static, params, q, k, v, gate, mask, scale, dnum, dden):
    features = features_lib.rebuilt(static, params)
    rows = fused_rows.prepare(features, q, k, v, mask, gate, chunk=cfg.chunk, lane=LANE)
    vv = rows.value_rows(v)
    length, e = vv.shape[1], vv.shape[-1]
    ms = jnp.where(rows.seen, _safe(rows.of(scale, NEG_INF)), jnp.inf)[..., None]  # rows without terms: none
    dy = [("e", rows.of(dnum.astype(jnp.float32), 0.0)), ("1", rows.of(dden.astype(jnp.float32), 0.0)[..., None])]
    if cfg.feature_map:
      return on_chip_backward(features, params, rows, q, k, v, gate, mask, vv, ms, dy)

    def logs(q, k, *params):
      features = features_lib.rebuilt(static, params)
      return fused_rows.prepare(features, q, k, v, mask, gate, chunk=cfg.chunk, lane=LANE).log_rows(q, k)

    (lq, lk), features_vjp = jax.vjp(logs, q, k, *params)
    f = lq.shape[-1]
    ins = _ins(lq, lk, vv, rows.gate, cfg) + [("1", ms)] + dy
    (dlq,) = _call(_dq_kernel, cfg, length, f, e, ins, [("f", jnp.float32)])
    dlk, dvv = _call(_dk_kernel, cfg, length, f, e, ins, [("f", jnp.float32), ("e", jnp.float32)], reverse=True)
    dq, dk, *dparams = features_vjp((dlq, dlk))  # masked keys and padded features: exactly zero already
    dg = None if gate is None else jnp.sum(dlq, -1) - jnp.sum(dlk, -1)
    return (dq, dk, *finish(rows, v, gate, dvv, dg), tuple(dparams))

  def finish(rows, v, gate, dvv, dg_rows):
    dv = fused_rows.transpose(rows.value_rows, v, dvv.astype(v.dtype))
    dg = None
    if gate is not None:
      dg = fused_rows.transpose(rows.gate_rows, gate, fused_rows.gate_grad(dg_rows, rows.gate))
    return dv, dg

  def on_chip_backward(features, params, rows, q, k, v, gate, mask, vv, ms, dy):
    projection = params[0]
    x_ins, extra, f, groups = on_chip(rows, q, k, mask, projection, features)
    length, e, d = vv.shape[1], vv.shape[-1], q.shape[-1]
    ins = ins_of(x_ins, vv, extra, rows.gate) + [("1", ms)] + dy
    grads = [("x", jnp.float32), ("P", jnp.float32)] + ([("1", jnp.float32)] if cfg.gated else [])
    dq_rows, dpq, *sq = _call(_dq_kernel, cfg, length, f, e, ins, grads, d=d, groups=groups)
    dk_rows, dpk, *sk, dvv = _call(_dk_kernel, cfg, length, f, e, ins, grads + [("e", jnp.float32)], reverse=True,
                                   d=d, groups=groups)
    of_x = lambda x: rows.of(x, 0.0)
    dq = fused_rows.transpose(of_x, q, dq_rows.astype(q.dtype))
    dk = fused_rows.transpose(of_x, k, dk_rows.astype(k.dtype))
    dp = (dpq + dpk).reshape((-1, groups) + dpq.shape[1:]).sum(0)  # [G, F, D]: rows are (sequence, head)
    _, p_vjp = jax.vjp(lambda w: _projection_rows(w, cfg.feature_map, f, d)[0], projection)
    (dproj,) = p_vjp(dp)
    dg = None if gate is None else sq[0][..., 0] - sk[0][..., 0]
    return (dq, dk, *finish(rows, v, gate, dvv, dg), (dproj, None))

  return fused_rows.Program(forward, backward)


def config(q, k, v, gate, *, chunk_size: int, precision, interpret, features=None) -> Config:
  """The :class:`Config` of one call (its chunk, precision and operand dtype from the inputs; the on-chip
  feature map from ``features``' kernel record, :func:`feature_map`)."""
  c = chunk_rows(chunk_size, bool(interpret))
  operands = "bfloat16" if jnp.result_type(q, k, v) == jnp.bfloat16 and precision is None else "float32"
  name = None if features is None else feature_map(features)
  return Config(c, interpret, mosaic_precision(precision), operands, gate is not None, name,
                0.5 / math.sqrt(q.shape[-1]))


def causal(features, q, k, v, mask, *, chunk_size: int = 128, gate=None, precision=None, interpret=False,
           return_scale: bool = False, fallback=None):
  """Causal linear attention through the Mosaic kernels: (numerator [N, L, H, Dv], denominator [N, L, H]).

  The contract of :func:`favor_jax.core.causal_xla.chunked` (both times the same per-row factor e^{−scale};
  ``return_scale`` adds the scale [N, L, H], −∞ where a row sees no key). ``gate`` [N, L, H]: log forget
  gates (≤ 0, −∞ a reset: segment starts are −∞ gates). The feature map must give pure exponentials
  (:func:`~favor_jax.core.features.exponential_features`); others raise ``ValueError``. ``precision``: of every
  dot, forward and backward (:func:`mosaic_precision`). ``interpret``: False, Mosaic (a TPU, or lowering
  for one); True, Pallas's generic interpreter (any machine; no side effects, so it may sit in a
  ``platform_dependent`` branch); a ``pltpu.InterpretParams``, Pallas's TPU interpret mode (any machine; it
  also checks reads out of bounds and of uninitialised memory). ``fallback``: the pass that redoes the call
  where rows lost their terms, called as
  ``fallback(features, q, k, v, mask, chunk_size=C, return_scale=True[, gate=gate])``; None (tests only): the
  fused result even there.

  Raises:
    ValueError: features that are not pure exponentials, or a ``chunk_size`` that is not a positive int.
  """
  if not exponential_features(features, q, k):
    raise ValueError("causal_method='pallas' needs features that are exponentials with a log per feature "
                     "(no multiplier); this kernel's are not: use causal_method='chunked'")
  cfg = config(q, k, v, gate, chunk_size=chunk_size, precision=precision, interpret=interpret, features=features)
  out = fused_rows.run(program(cfg), fused_rows.xla_redo(fallback, cfg.chunk), features, q, k, v, gate, mask)
  return out if return_scale else out[:2]
