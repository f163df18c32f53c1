"""Causal FAVOR as fused Pallas kernels for TPU (Mosaic): ``causal_method="pallas"`` where the program is lowered
for a TPU (and, interpreted, on a CPU: see :mod:`favor_jax.core.causal`).

The same estimator as :func:`favor_jax.core.causal_xla.chunked` and the Triton kernels
(:mod:`favor_jax.core.fused.gpu`): features in log domain (φ = exp(log)), every stabiliser from keys a row may
see, the row scales constants under ``grad``. Where the kernel record says how (``Kernel.fused_map``:
positive, hyperbolic, FAVOR++, FAVOR#; :func:`~favor_jax.core.fused.rows.feature_map`), the kernels read q, k,
v in their own dtype and the projection and compute the log features ω·x − ‖x‖²/2 − log √M (FAVOR++:
B·ω·x − ‖x‖²/2 + c, its projection B·ω and normaliser c one per (sequence, head) from the call's ρ, held
constant; FAVOR#: the same of Ψq and Ψ⁻¹k, the scales Ψ per (sequence, head) from its statistic) in VMEM,
forward and backward
(nothing of size L×F goes through HBM; the backward gives ∂q, ∂k and the projection's gradient per row, and
FAVOR++'s normaliser's, which depends on ω); for any other exponential map (Hedgehog, ELU+1, a record of
your own) XLA computes the log features (the kernel's own ``log_features``) and the kernels read them.
Three kernels, each over a grid (sequence·head "parallel", step "arbitrary") with its running state in VMEM
scratch, so no per-chunk state goes to HBM; a grid step's blocks hold up to four chunks (:func:`step_chunks`:
512 rows at the compiled chunk of 128), which it walks in turn (two-level chunking: fewer, larger DMA blocks,
fewer steps' fixed cost, the same [C, C] products):

- ``forward_body`` (chunks in order): the prefix state (μ [1, F], Sᵀ [Dv, F] and the denominator's own
  z [1, F], S_f = Σ_j e^{ℓk_jf + d_j − μ_f} v_j, z_f the same without v_j, d_j the gates' decay from key j to
  the chunk's start), row t's scale m_t = max_f (ℓq_tf + max(λ_f, μ_f + a_t)) (λ the chunk's own key
  maximum, a_t the decay from the chunk's start to t), and num_t, den_t times e^{−m_t}: the state read out
  plus the chunk's own [C, C] product times e^{D}, D_tj = Σ_{j<l≤t} g_l (−∞ for j > t and across a reset);
- ``dq_body`` (chunks in order, the prefix state recomputed): ∂ℓq (or ∂q and ∂ω);
- ``dk_body`` (chunks in reverse): the suffix state (Rᵀ [Dv, F] of ∂num, r [1, F] of ∂den, ν their running
  maximum), then ∂ℓk (or ∂k and ∂ω) and ∂v.

The gates' gradient is ∂g_l = Σ_{t ≥ l} Σ_f (∂ℓq_tf − ∂ℓk_tf) (every pair j < l ≤ t counted once), summed
in XLA within each segment between resets. Feature widths are padded to the lane width (128); values are
not padded (a block as wide as its array); the chunk is a multiple of 128 when compiled (8 when
interpreted), L a multiple of the chunk. Products of features and values take bfloat16 operands where every
input is bfloat16 and the precision is the default, products with a state (and the projection's) float32
ones. A later key in a row's chunk can raise its scale m_t above its largest term: a row whose denominator
falls below e^{−SAFE_GAP} is computed again alone inside the forward kernel at its exact scale (never a
silent zero; O(C·F) on the VPU per such row, and for a chunk with any, one more product with its state), and
the backward kernels recompute the same rows' terms alone (they know them by m_t lying far below the chunk's
one-product scale). The number of such rows is a returned statistic (``return_recomputed``); a row still
lost after that (none is expected) redoes the call by the XLA pass, decided inside the custom VJP
(:func:`favor_jax.core.fused.rows.run`).
Shape letters: see :mod:`favor_jax.core`; R = N·H rows, C rows per chunk, F features (padded), D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from favor_jax.core import features as features_lib
from favor_jax.core.features import exponential_features, head_major
from favor_jax.core.fused import rows as fused_rows
from favor_jax.core.fused.tpu_bodies import (
  NEG_INF,
  PER_ROW_MAPS,
  Config,
  dk_body,
  dq_body,
  finite_offset,
  forward_body,
  stepped,
)

LANE, SUBLANE = 128, 8  # a TPU vector register's lanes (minor axis) and sublanes


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


STEP_CHUNKS = 4  # at most this many chunks per grid step: DMA blocks of up to 4·C rows (512 when compiled)


def step_chunks(n_chunks: int) -> int:
  """S: the chunks one grid step walks in turn (its blocks hold S·C rows): the largest divisor of a row's chunk
  count up to ``STEP_CHUNKS``. A grid step has a fixed cost; S of them per step divide the steps by S."""
  return max(s for s in range(1, STEP_CHUNKS + 1) if n_chunks % s == 0)


def _call(kernel, cfg, rows, f, e, ins, outs, reverse=False, d=None, groups=1):
  """``kernel`` over the grid (R rows, steps of S chunks, :func:`step_chunks`); ``ins``/``outs``: per array,
  its kind ("f" [C, F], "e" [C, E], "1" [C, 1], "g" the gate [1, C], "k" one number per chunk [1, 1], "x"
  [C, D] rows of q or k, "p" the projection [F, D] of the row's head (``groups``: 1 shared, H per head, R one
  per row), "n" the normaliser [1, F], "b" one per row (an input, or an output accumulated over the row's
  chunks), "P" an accumulated [F, D] per row, "u" a row's scale of q or k [1, D]; the body sees one chunk of
  each, :func:`tpu_bodies.stepped`) and, for outs, its dtype; scratch: a state (μ [1, F], Sᵀ [E, F], z [1, F]);
  E = Dv, unpadded (a block as wide as its array)."""
  c, n_chunks = cfg.chunk, rows // cfg.chunk
  s = step_chunks(n_chunks)
  steps = n_chunks // s
  block = (lambda i, j: (i, steps - 1 - j, 0)) if reverse else (lambda i, j: (i, j, 0))
  spec = {"f": pl.BlockSpec((None, s * c, f), block), "e": pl.BlockSpec((None, s * c, e), block),
          "1": pl.BlockSpec((None, s * c, 1), block), "x": pl.BlockSpec((None, s * c, d), block),
          "p": pl.BlockSpec((None, f, d), lambda i, j: (i % groups, 0, 0)),
          "n": pl.BlockSpec((1, f), lambda i, j: (0, 0)), "b": pl.BlockSpec((None, 1, f), lambda i, j: (i, 0, 0)),
          "u": pl.BlockSpec((None, 1, d), lambda i, j: (i, 0, 0)),
          "P": pl.BlockSpec((None, f, d), lambda i, j: (i, 0, 0)),
          "g": pl.BlockSpec((None, None, s, c), lambda i, j: block(i, j) + (0,)),
          "k": pl.BlockSpec((None, None, s, 1), lambda i, j: block(i, j) + (0,))}
  n = ins[0][1].shape[0]
  shape = {"f": (n, rows, f), "e": (n, rows, e), "1": (n, rows, 1), "x": (n, rows, d), "P": (n, f, d),
           "b": (n, 1, f), "k": (n, steps, s, 1)}
  params = dict(interpret=cfg.interpret) if cfg.interpret else dict(
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))
  kinds = [kind for kind, _ in ins + outs] + ["state"] * 3
  return pl.pallas_call(
      stepped(kernel, kinds, s, reverse, cfg), grid=(n, steps),
      in_specs=[spec[kind] for kind, _ in ins], out_specs=[spec[kind] for kind, _ in outs],
      out_shape=[jax.ShapeDtypeStruct(shape[kind], dtype) for kind, dtype in outs],
      scratch_shapes=[pltpu.VMEM((1, f), jnp.float32), pltpu.VMEM((e, f), jnp.float32),
                      pltpu.VMEM((1, f), jnp.float32)], **params,
  )(*(x.reshape(n, steps, s, c) if kind == "g" else x for kind, x in ins))


def _gate_rows(g, c):
  """[R, L] gates as [R, L/C, 1, C] (a chunk's gates along the lane axis)."""
  return None if g is None else g.reshape((g.shape[0], g.shape[1] // c, 1, c))


def _ins(lq, lk, v, g, cfg):
  gate = [("g", _gate_rows(g, cfg.chunk))] if cfg.gated else []
  return [("f", lq), ("f", lk), ("e", v)] + gate


def _forward(lq, lk, v, g, cfg):
  r, length, f = lq.shape
  return _call(forward_body, cfg, length, f, v.shape[-1], _ins(lq, lk, v, g, cfg), _FORWARD_OUTS)


_FORWARD_OUTS = [("e", jnp.float32), ("1", jnp.float32), ("1", jnp.float32), ("k", jnp.float32)]  # num, den, m, count


def program(cfg: Config) -> fused_rows.Program:
  """The Mosaic kernels as a :class:`~favor_jax.core.fused.rows.Program`: the forward kernel, then (backward)
  the ∂ℓq and ∂ℓk/∂v kernels. With ``cfg.feature_map`` the kernels read q, k, v in their dtype and the
  projection and compute the features on chip, forward and backward (nothing of size L×F in HBM; the
  backward gives ∂q, ∂k and the projection's gradient per row); otherwise they read the features XLA computed
  (recomputed from q, k and the projection for the backward). Kept between forward and backward: the inputs
  and the row scales."""
  def projection_rows(features, params, q, k):
    """(w -> (p, fb), F, the rows' scales of q and k as inputs or none): ``fused.rows.on_chip_inputs``."""
    f_pad = -(-jax.eval_shape(lambda: head_major(features, q, k)[0].log).shape[-1] // LANE) * LANE
    of_projection, scales = fused_rows.on_chip_inputs(cfg.feature_map, params, q, f_pad, cfg.x_scale)
    return of_projection, f_pad, [("u", u) for u in scales or ()]

  def on_chip(rows, q, k, mask, p, fb, scales):
    key_bias = fused_rows.key_bias(mask, q.shape[2])
    x_ins = [("x", rows.of(q, 0.0)), ("x", rows.of(k, 0.0))]
    normaliser = "b" if cfg.feature_map in PER_ROW_MAPS else "n"
    return x_ins, [("p", p), (normaliser, fb), ("1", rows.of(key_bias, NEG_INF)[..., None])] + scales

  def ins_of(first, v_rows, extra, g):
    gate = [("g", _gate_rows(g, cfg.chunk))] if cfg.gated else []
    return first[:2] + [("e", v_rows)] + extra + gate

  def forward(features, q, k, v, gate, mask):
    rows = fused_rows.prepare(features, q, k, v, mask, gate, chunk=cfg.chunk, lane=LANE)
    vv = rows.value_rows(v)
    if cfg.feature_map:
      of_projection, f, scales = projection_rows(features, features.params, q, k)
      p, fb = of_projection(features.params[0])
      x_ins, extra = on_chip(rows, q, k, mask, p, fb, scales)
      num, den, m, count = _call(forward_body, cfg, vv.shape[1], f, vv.shape[-1],
                                 ins_of(x_ins, vv, extra, rows.gate), _FORWARD_OUTS, d=q.shape[-1], groups=p.shape[0])
    else:
      num, den, m, count = _forward(*rows.log_rows(q, k), vv, rows.gate, cfg)
    recomputed = jnp.sum(count, axis=(1, 2, 3)).astype(jnp.int32).reshape(q.shape[0], q.shape[2])
    return (rows.back(num), rows.back(den[..., 0]), rows.back(jnp.where(rows.seen, m[..., 0], NEG_INF)),
            recomputed)

  def backward(static, params, q, k, v, gate, mask, scale, dnum, dden, *, project=True):
    features = features_lib.rebuilt(static, params)
    rows = fused_rows.prepare(features, q, k, v, mask, gate, chunk=cfg.chunk, lane=LANE)
    vv = rows.value_rows(v)
    length, e = vv.shape[1], vv.shape[-1]
    ms = jnp.where(rows.seen, finite_offset(rows.of(scale, NEG_INF)), jnp.inf)[..., None]  # rows without terms: none
    dy = [("e", rows.of(dnum.astype(jnp.float32), 0.0)), ("1", rows.of(dden.astype(jnp.float32), 0.0)[..., None])]
    if cfg.feature_map:
      return on_chip_backward(features, params, rows, q, k, v, gate, mask, vv, ms, dy, cfg._replace(project=project))

    def logs(q, k, *params):
      features = features_lib.rebuilt(static, params)
      return fused_rows.prepare(features, q, k, v, mask, gate, chunk=cfg.chunk, lane=LANE).log_rows(q, k)

    (lq, lk), features_vjp = jax.vjp(logs, q, k, *params)
    f = lq.shape[-1]
    ins = _ins(lq, lk, vv, rows.gate, cfg) + [("1", ms)] + dy
    (dlq,) = _call(dq_body, cfg, length, f, e, ins, [("f", jnp.float32)])
    dlk, dvv = _call(dk_body, cfg, length, f, e, ins, [("f", jnp.float32), ("e", jnp.float32)], reverse=True)
    dq, dk, *dparams = features_vjp((dlq, dlk))  # masked keys and padded features: exactly zero already
    dg = None if gate is None else jnp.sum(dlq, -1) - jnp.sum(dlk, -1)
    return (dq, dk, *finish(rows, v, gate, dvv, dg), tuple(dparams))

  def finish(rows, v, gate, dvv, dg_rows):
    dv = fused_rows.transpose(rows.value_rows, v, dvv.astype(v.dtype))
    dg = None
    if gate is not None:
      dg = fused_rows.transpose(rows.gate_rows, gate, fused_rows.gate_grad(dg_rows, rows.gate))
    return dv, dg

  def on_chip_backward(features, params, rows, q, k, v, gate, mask, vv, ms, dy, cfg):
    of_projection, f, scales = projection_rows(features, params, q, k)
    (p, fb), p_vjp = jax.vjp(of_projection, params[0])  # the kernels' projection rows, and their map back to ω
    x_ins, extra = on_chip(rows, q, k, mask, p, fb, scales)
    length, e, d, groups = vv.shape[1], vv.shape[-1], q.shape[-1], p.shape[0]
    ins = ins_of(x_ins, vv, extra, rows.gate) + [("1", ms)] + dy
    per_row = cfg.project and cfg.feature_map in PER_ROW_MAPS  # the normaliser's too (it depends on ω)
    grads = ([("x", jnp.float32)] + [("P", jnp.float32)] * cfg.project + [("b", jnp.float32)] * per_row
             + [("1", jnp.float32)] * cfg.gated)
    dq_rows, *q_rest = _call(dq_body, cfg, length, f, e, ins, grads, d=d, groups=groups)
    dk_rows, *k_rest, dvv = _call(dk_body, cfg, length, f, e, ins, grads + [("e", jnp.float32)],
                                  reverse=True, d=d, groups=groups)
    of_x = lambda x: rows.of(x, 0.0)
    dq = fused_rows.transpose(of_x, q, dq_rows.astype(q.dtype))
    dk = fused_rows.transpose(of_x, k, dk_rows.astype(k.dtype))
    dproj = None
    if cfg.project:
      dpq, dpk = q_rest.pop(0), k_rest.pop(0)
      dp = (dpq + dpk).reshape((-1, groups) + dpq.shape[1:]).sum(0)  # [G, F, D]: rows are (sequence, head)
      dfb = (q_rest.pop(0) + k_rest.pop(0)) if per_row else None
      (dproj,) = p_vjp((dp, jnp.zeros_like(fb) if dfb is None else dfb))
    dg = None if gate is None else q_rest[0][..., 0] - k_rest[0][..., 0]
    drho = None if params[1] is None else jnp.zeros_like(params[1])  # held constant (kernels.oprf_affine)
    return (dq, dk, *finish(rows, v, gate, dvv, dg), (dproj, drho))

  return fused_rows.Program(forward, backward)


def config(q, k, v, gate, *, chunk_size: int, precision, interpret, features=None) -> Config:
  """The :class:`Config` of one call (its chunk, precision and operand dtype from the inputs; the on-chip
  feature map from ``features``' kernel record, :func:`~favor_jax.core.fused.rows.feature_map`)."""
  c = chunk_rows(chunk_size, bool(interpret))
  operands = "bfloat16" if jnp.result_type(q, k, v) == jnp.bfloat16 and precision is None else "float32"
  name = None if features is None else fused_rows.feature_map(features)
  return Config(c, interpret, mosaic_precision(precision), operands, gate is not None, name,
                q.shape[-1] ** -0.25)


def causal(features, q, k, v, mask, *, chunk_size: int = 128, gate=None, precision=None, interpret=False,
           return_scale: bool = False, return_recomputed: bool = False, fallback=None):
  """Causal linear attention through the Mosaic kernels: (numerator [N, L, H, Dv], denominator [N, L, H]).

  The contract of :func:`favor_jax.core.causal_xla.chunked` (both times the same per-row factor e^{−scale};
  ``return_scale`` adds the scale [N, L, H], −∞ where a row sees no key; ``return_recomputed`` adds the number
  of rows [N, H] int32 the kernels computed again alone, those that lost their terms in their chunk's
  product). ``gate`` [N, L, H]: log forget gates (≤ 0, −∞ a reset: segment starts are −∞ gates). The feature
  map must give pure exponentials (:func:`~favor_jax.core.features.exponential_features`); others raise
  ``ValueError``. ``precision``: of every dot, forward and backward (:func:`mosaic_precision`).
  ``interpret``: False, Mosaic (a TPU, or lowering for one); True, Pallas's generic interpreter (any machine;
  no side effects, so it may sit in a ``platform_dependent`` branch); a ``pltpu.InterpretParams``, Pallas's
  TPU interpret mode (any machine; it also checks reads out of bounds and of uninitialised memory).
  ``fallback``: the pass that redoes the call where a row still lost its terms after the kernels' own
  recompute (a net: none is expected), called as
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
  return out[:3 if return_scale else 2] + (out[3:] if return_recomputed else ())
