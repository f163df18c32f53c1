"""Causal FAVOR as fused Pallas kernels for TPU (Mosaic): ``causal_method="pallas"`` where the program is lowered
for a TPU (and, interpreted, on a CPU: see :mod:`favor_jax.core.causal`).

The same estimator as :func:`favor_jax.core.causal_xla.chunked` and the Triton kernels
(:mod:`favor_jax.core.fused`): features in log domain (φ = exp(log), computed outside the kernels by the
kernel's own ``log_features``), every stabiliser from keys a row may see, the row scales constants under
``grad``. Three kernels, each over a grid (sequence·head "parallel", chunk "arbitrary") with its running
state in VMEM scratch, so no per-chunk state goes to HBM:

- ``_forward_kernel`` (chunks in order): the prefix state (μ [1, F], Sᵀ [E, F], S_f = Σ_j e^{ℓk_jf + d_j − μ_f}
  [v_j, 1], d_j the gates' decay from key j to the chunk's start), row t's scale m_t = max_f (ℓq_tf +
  max(λ_f, μ_f + a_t)) (λ the chunk's own key maximum, a_t the decay from the chunk's start to t), and
  y_t = [num_t, den_t] e^{−m_t}: the state read out plus the chunk's own [C, C] product times e^{D},
  D_tj = Σ_{j<l≤t} g_l (−∞ for j > t and across a reset);
- ``_dq_kernel`` (chunks in order, the prefix state recomputed): ∂ℓq;
- ``_dk_kernel`` (chunks in reverse): the suffix state Rᵀ [E, F] = Σ_{t later} e^{ℓq_t − m_t + d'_t − ν}
  dy_t (ν its running maximum, d'_t the decay from the chunk's end to t), then ∂ℓk and ∂v.

The gates' gradient is ∂g_l = Σ_{t ≥ l} Σ_f (∂ℓq_tf − ∂ℓk_tf) (every pair j < l ≤ t counted once), summed
in XLA within each segment between resets. The value carries a column of ones (the denominator), so one
product gives both; feature and value widths are padded to the lane width (128), the chunk to a multiple
of 128 when compiled (8 when interpreted), L to a multiple of the chunk. A later key in a row's chunk can
raise its scale m_t above its largest term; rows whose denominator falls below e^{−SAFE_GAP} are detected
and the call is redone by the XLA pass (never a silent zero), as in :mod:`favor_jax.core.fused`.
Shape letters: see :mod:`favor_jax.core`; R = N·H rows, C rows per chunk, F features, E = Dv + 1, padded.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from favor_jax.core import features as features_lib
from favor_jax.core import fused_rows
from favor_jax.core.features import exponential_features

NEG_INF = -jnp.inf
LANE, SUBLANE = 128, 8  # a TPU vector register's lanes (minor axis) and sublanes


class Config(NamedTuple):
  """Static choices of one call: chunk rows C, Mosaic (``interpret`` False) or an interpreter (True: Pallas's
  generic one; ``pltpu.InterpretParams``: its TPU interpret mode), the dots' precision and
  operand dtype ("bfloat16" for products of features and values when every input is bfloat16 and the
  precision is the default), and whether gates are given."""
  chunk: int
  interpret: Any
  precision: Any
  operands: str
  gated: bool


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


def _decays(g_ref, c):
  """The gates of one chunk, g [1, C] (≤ 0, −∞ at a reset), as (a [C, 1], b [C, 1], total [1, 1], e^D [C, C]):
  a_t = Σ_{start≤l≤t} g_l, b_j = Σ_{j<l≤end} g_l, total = Σ_{start≤l≤end} g_l, D_tj = Σ_{j<l≤t} g_l (and
  e^D = 0 for j > t). Sums of terms ≤ 0 (never differences of running sums: no cancellation), −∞ where a
  reset is among the terms; D as a product with a 0/1 matrix, at HIGHEST whatever the call's precision
  (a sum, not an attention product: a bfloat16 pass would round the gates)."""
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
  later = jnp.where(l < t, 1.0, 0.0)  # [l, j]: 1 for j < l
  exact = lambda x: jax.lax.dot_general(x, later, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                        preferred_element_type=jnp.float32)
  d_fin = exact(jnp.where(l <= t, fin, 0.0))
  d_reset = exact(jnp.where(l <= t, reset, 0.0))
  decay = jnp.where((l <= t) & (d_reset < 0.5), jnp.exp(jnp.minimum(d_fin, 0.0)), 0.0)
  return summed(l <= t), summed(l > t), total, decay


def _start(*scratch):
  """At a row's first chunk: the empty state (μ = −∞, S = 0)."""
  @pl.when(pl.program_id(1) == 0)
  def _():
    mu, s = scratch
    mu[...] = jnp.full(mu.shape, NEG_INF, jnp.float32)
    s[...] = jnp.zeros(s.shape, jnp.float32)


def _absorb(mu_ref, st_ref, logs, x, total, cfg):
  """The state recurrence's step: decay (μ, Sᵀ) by ``total``, add rows with log weights ``logs`` [C, F] and
  vectors x [C, E], rescaled to the new maximum μ' = max(μ + total, max_rows logs)."""
  mu = mu_ref[...] + total
  new = jnp.maximum(mu, jnp.max(logs, axis=0, keepdims=True))
  safe = _safe(new)
  st_ref[...] = st_ref[...] * jnp.exp(mu - safe) + _dot(x, jnp.exp(logs - safe), "tn", cfg)
  mu_ref[...] = new


def _chunk(lq_ref, lk_ref, v_ref, refs, cfg):
  """One chunk's inputs, the gates' decays and λ [1, F]; ``refs`` starts with the gate's ref if gated."""
  g_ref, refs = (refs[0], refs[1:]) if cfg.gated else (None, refs)
  lk = lk_ref[...]
  return (lq_ref[...], lk, v_ref[...]) + _decays(g_ref, lk.shape[0]) + (jnp.max(lk, axis=0, keepdims=True),), refs


def _forward_kernel(lq_ref, lk_ref, v_ref, *refs, cfg):
  """y [C, E] (numerator and denominator times e^{−m}) and m [C, 1] (−∞ where no key is in reach)."""
  (lq, lk, v, a, b, total, decay, lam), (y_ref, m_ref, mu_ref, st_ref) = _chunk(lq_ref, lk_ref, v_ref, refs, cfg)
  _start(mu_ref, st_ref)
  read = mu_ref[...] + a
  m = jnp.max(lq + jnp.maximum(lam, read), axis=1, keepdims=True)
  ms = _safe(m)
  w = _dot(jnp.exp(lq + lam - ms), jnp.exp(lk - _safe(lam)), "nt", cfg) * decay
  y_ref[...] = _dot(jnp.exp(lq + read - ms), st_ref[...], "nt", cfg, state=True) + _dot(w, v, "nn", cfg)
  m_ref[...] = m
  _absorb(mu_ref, st_ref, lk + b, v, total, cfg)


def _dq_kernel(lq_ref, lk_ref, v_ref, *refs, cfg):
  """∂ℓq [C, F] from dy [C, E] and the row scales m [C, 1] (+∞ for rows without terms)."""
  (lq, lk, v, a, b, total, decay, lam), refs = _chunk(lq_ref, lk_ref, v_ref, refs, cfg)
  m_ref, dy_ref, dlq_ref, mu_ref, st_ref = refs
  _start(mu_ref, st_ref)
  ms, dy = m_ref[...], dy_ref[...]
  g = _dot(dy, v, "nt", cfg) * decay  # ∂/∂(row t's weight of key j)
  from_state = jnp.exp(lq + mu_ref[...] + a - ms) * _dot(dy, st_ref[...], "nn", cfg, state=True)
  dlq_ref[...] = from_state + jnp.exp(lq + lam - ms) * _dot(g, jnp.exp(lk - _safe(lam)), "nn", cfg)
  _absorb(mu_ref, st_ref, lk + b, v, total, cfg)


def _dk_kernel(lq_ref, lk_ref, v_ref, *refs, cfg):
  """∂ℓk [C, F] and ∂[v, 1] [C, E] (chunks in reverse), the suffix state (ν [1, F], Rᵀ [E, F]) in scratch."""
  (lq, lk, v, a, b, total, decay, lam), refs = _chunk(lq_ref, lk_ref, v_ref, refs, cfg)
  m_ref, dy_ref, dlk_ref, dv_ref, nu_ref, rt_ref = refs
  _start(nu_ref, rt_ref)
  ms, dy, rt = m_ref[...], dy_ref[...], rt_ref[...]
  q_chunk, k_chunk = jnp.exp(lq + lam - ms), jnp.exp(lk - _safe(lam))
  g = _dot(dy, v, "nt", cfg) * decay
  w = _dot(q_chunk, k_chunk, "nt", cfg) * decay
  k_later = jnp.exp(lk + b + nu_ref[...])  # ≤ 1: ν ≤ −(ℓk + b) for keys the later rows see
  dlk_ref[...] = k_chunk * _dot(g, q_chunk, "tn", cfg) + k_later * _dot(v, rt, "nn", cfg, state=True)
  dv_ref[...] = _dot(w, dy, "tn", cfg) + _dot(k_later, rt, "nt", cfg, state=True)
  _absorb(nu_ref, rt_ref, lq - ms + a, dy, total, cfg)


def _call(kernel, cfg, rows, f, e, ins, outs, reverse=False):
  """``kernel`` over the grid (R rows, chunks); ``ins``/``outs``: per array, its kind ("f" [C, F], "e"
  [C, E], "1" [C, 1], "g" the gate [1, C]) and, for outs, its dtype; scratch: a state (μ [1, F], Sᵀ [E, F])."""
  c, n_chunks = cfg.chunk, rows // cfg.chunk
  chunk = (lambda i, j: (i, n_chunks - 1 - j, 0)) if reverse else (lambda i, j: (i, j, 0))
  spec = {"f": pl.BlockSpec((None, c, f), chunk), "e": pl.BlockSpec((None, c, e), chunk),
          "1": pl.BlockSpec((None, c, 1), chunk),
          "g": pl.BlockSpec((None, None, 1, c), lambda i, j: chunk(i, j) + (0,))}
  width = {"f": f, "e": e, "1": 1}
  n = ins[0][1].shape[0]
  params = dict(interpret=cfg.interpret) if cfg.interpret else dict(
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=(n, n_chunks), in_specs=[spec[kind] for kind, _ in ins],
      out_specs=[spec[kind] for kind, _ in outs],
      out_shape=[jax.ShapeDtypeStruct((n, rows, width[kind]), dtype) for kind, dtype in outs],
      scratch_shapes=[pltpu.VMEM((1, f), jnp.float32), pltpu.VMEM((e, f), jnp.float32)], **params,
  )(*(x for _, x in ins))


def _gate_rows(g, c):
  """[R, L] gates as [R, L/C, 1, C] (a chunk's gates along the lane axis)."""
  return None if g is None else g.reshape((g.shape[0], g.shape[1] // c, 1, c))


def _ins(lq, lk, v, g, cfg):
  gate = [("g", _gate_rows(g, cfg.chunk))] if cfg.gated else []
  return [("f", lq), ("f", lk), ("e", v)] + gate


def _forward(lq, lk, v, g, cfg):
  r, length, f = lq.shape
  return _call(_forward_kernel, cfg, length, f, v.shape[-1], _ins(lq, lk, v, g, cfg),
               [("e", jnp.float32), ("1", jnp.float32)])


def program(cfg: Config) -> fused_rows.Program:
  """The Mosaic kernels as a :class:`~favor_jax.core.fused_rows.Program`: the forward kernel, then (backward)
  the features recomputed from q, k and the projection (kept: the inputs and the row scales, not the
  features) and the ∂ℓq and ∂ℓk/∂v kernels."""
  def forward(features, q, k, v, gate, mask):
    rows = fused_rows.prepare(features, q, k, v, mask, gate, chunk=cfg.chunk, lane=LANE)
    y, m = _forward(*rows.log_rows(q, k), rows.value_rows(v), rows.gate, cfg)
    dv = v.shape[-1]
    return rows.back(y[..., :dv]), rows.back(y[..., dv]), rows.back(jnp.where(rows.seen, m[..., 0], NEG_INF))

  def backward(static, params, q, k, v, gate, mask, scale, dnum, dden):
    def logs(q, k, *params):
      features = features_lib.rebuilt(static, params)
      return fused_rows.prepare(features, q, k, v, mask, gate, chunk=cfg.chunk, lane=LANE).log_rows(q, k)

    rows = fused_rows.prepare(features_lib.rebuilt(static, params), q, k, v, mask, gate, chunk=cfg.chunk,
                              lane=LANE)
    (lq, lk), features_vjp = jax.vjp(logs, q, k, *params)
    vv = rows.value_rows(v)
    r, length, f = lq.shape
    e, dv = vv.shape[-1], v.shape[-1]
    ms = jnp.where(rows.seen, _safe(rows.of(scale, NEG_INF)), jnp.inf)[..., None]  # rows without terms: none
    y_shape = jax.ShapeDtypeStruct(vv.shape, jnp.float32)
    (dy,) = jax.linear_transpose(lambda y: (rows.back(y[..., :dv]), rows.back(y[..., dv])), y_shape)(
        (dnum.astype(jnp.float32), dden.astype(jnp.float32)))
    ins = _ins(lq, lk, vv, rows.gate, cfg) + [("1", ms), ("e", dy)]
    (dlq,) = _call(_dq_kernel, cfg, length, f, e, ins, [("f", jnp.float32)])
    dlk, dvv = _call(_dk_kernel, cfg, length, f, e, ins, [("f", jnp.float32), ("e", jnp.float32)], reverse=True)
    dq, dk, *dparams = features_vjp((dlq, dlk))  # masked keys and padded features: exactly zero already
    dv_ = fused_rows.transpose(rows.value_rows, v, dvv.astype(v.dtype))
    dg = None
    if gate is not None:
      dg = fused_rows.transpose(rows.gate_rows, gate, fused_rows.gate_grad(jnp.sum(dlq, -1) - jnp.sum(dlk, -1),
                                                                              rows.gate))
    return dq, dk, dv_, dg, tuple(dparams)

  return fused_rows.Program(forward, backward)


def config(q, k, v, gate, *, chunk_size: int, precision, interpret) -> Config:
  """The :class:`Config` of one call (its chunk, precision and operand dtype from the inputs)."""
  c = chunk_rows(chunk_size, bool(interpret))
  operands = "bfloat16" if jnp.result_type(q, k, v) == jnp.bfloat16 and precision is None else "float32"
  return Config(c, interpret, mosaic_precision(precision), operands, gate is not None)


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
  cfg = config(q, k, v, gate, chunk_size=chunk_size, precision=precision, interpret=interpret)
  out = fused_rows.run(program(cfg), fused_rows.xla_redo(fallback, cfg.chunk), features, q, k, v, gate, mask)
  return out if return_scale else out[:2]
