"""Causal FAVOR as fused Pallas kernels (Triton on GPU; Pallas's interpreter elsewhere): ``causal_method="pallas"``.

The same estimator as :func:`favor_jax.core.causal_xla.chunked`, computed by four kernels over chunks of C
rows (their bodies: :mod:`favor_jax.core.fused.gpu_bodies`), with the features in log domain (φ = exp(log)) and
every stabiliser taken from keys a row may see:

- ``states_kernel`` (one program per (sequence·head, feature block), chunks in order): the state before
  each chunk, S_c = Σ_{j in earlier chunks} e^{ℓk_j − μ_c} v_j and z_c = Σ e^{ℓk_j − μ_c}, μ_c the
  per-feature maximum over those keys (rescaled when it grows, as online softmax does);
- ``output_kernel`` (one program per (sequence·head, chunk)): row t's scale m_t = max(max_f ℓq_tf + μ_f,
  max_f ℓq_tf + λ_f), λ the chunk's own key maximum, then numerator and denominator times e^{−m_t}: the
  state read out, plus the chunk's own lower-triangular [C, C] product; a row that lost its terms in that
  product computed again alone (below);
- backward: ``suffix_kernel`` (chunks in reverse) sums e^{ℓq_t − m_t} [dnum_t, dden_t] over later chunks,
  stabilised by its own running maximum ν; ``grads_kernel`` (per chunk) gives ∂ℓq, ∂ℓk, ∂v from the
  prefix and suffix states and the chunk's own products. The scales are constants under ``grad``, as in
  the XLA pass. For the maps whose kernel record says how (``Kernel.fused_map``: positive, hyperbolic,
  FAVOR++ and FAVOR# with their statistic; ``fused.rows.feature_map``) every kernel computes the log
  features from the rows of q and k in their dtype, the projection, the normaliser (and FAVOR#'s scales) where
  it reads them (``gpu_bodies.LogRows``: nothing of size L×F in either program; ``grads_kernel`` gives ∂q, ∂k
  and, where the projection is differentiated, its gradient per chunk); for the other exponential maps XLA
  computes them (the kernel's own ``log_features``, recomputed for the backward from q and k). The custom VJP
  keeps the inputs and the row scales.

Forget gates (``gate``, log f ≤ 0, −∞ a reset; packed segments arrive as −∞ gates): before key t joins,
the state decays by e^{g_t}, as in the XLA pass. The states carry the decay in their log-scale μ (each chunk's
keys referenced to its end); a row reads the state before its chunk at μ + b_t (b_t: the gates from the
chunk's start to t) and its chunk's own products times e^{D_tj} ≤ 1, D_tj = Σ_{j<l≤t} g_l; its scale m_t
takes the decayed state maximum and the chunk's undecayed key maximum. The gate's gradient is a sum over the
pairs (j, t) each gate separates (see ``grads_kernel``).

m_t may exceed the row's largest term s_t when a later key in the chunk raised λ (or, gated, when its
nearer keys decayed); then every term of row t is scaled by e^{−(m_t − s_t)}. The denominator is at least
that factor (its largest term), so a row whose denominator falls below e^{−SAFE_GAP} is detected and
computed again alone inside ``output_kernel`` at its exact scale (``gpu_bodies.recompute_lost``: O(C·F) per
such row, under a ``cond`` a chunk without one never enters), and ``grads_kernel`` adds the same rows'
terms alone (it knows them by m_t lying far below the chunk's one-product scale): a lost row costs its own
terms, not the call. The count is returned (``return_recomputed``); a row still lost after that (none is
expected) redoes the call by the XLA chunked pass (a net: never a silent zero). Shape letters:
see :mod:`favor_jax.core`; here R = N·H rows of (sequence, head), c chunks, C rows per chunk, F features
(padded to a power of two), E value width (padded likewise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from favor_jax.core import features as features_lib
from favor_jax.core.features import exponential_features, head_major
from favor_jax.core.fused import gpu_bodies as kern
from favor_jax.core.fused import rows as fused_rows
from favor_jax.core.fused.gpu_bodies import NEG_INF, Blocks
from favor_jax.core.fused.gpu_rows import Rows, pow2
from favor_jax.core.fused.rows import lost_rows
from favor_jax.core.gates import to_end

__all__ = ["Blocks", "GPU_DEFAULTS", "blocks_for", "causal", "lost_rows", "pallas_block"]


def pallas_block(size: int) -> bool:
  """Whether the fused kernels take this block size (chunk, feature block): a power of two >= 16,
  Triton's block shapes."""
  return size >= 16 and not size & (size - 1)


def _call(kernel, grid, in_specs, out_specs, out_shape, blocks, **kw):
  return pl.pallas_call(
      functools.partial(kernel, blocks=blocks, **kw), grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=blocks.interpret,
      compiler_params=None if blocks.interpret else plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2))


def _spec(shape, index_map):
  return pl.BlockSpec(shape, index_map)


def _f32(*shapes):
  return [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]


def _seq_specs(length, e):
  """BlockSpecs of the sequential kernels (grid: rows, feature blocks): a whole row's features [L, w],
  values [L, E], per-row numbers [L]."""
  return dict(feat=lambda w: _spec((None, length, w), lambda i, j: (i, 0, j)),
              val=_spec((None, length, e), lambda i, j: (i, 0, 0)), row=_spec((None, length), lambda i, j: (i, 0)))


def _state_specs(n, bf, e):
  """BlockSpecs of n states per row (μ or z [n, bf], S [n, bf, E]) of one feature block."""
  vec = _spec((None, n, bf), lambda i, j: (i, 0, j))
  return [vec, _spec((None, n, bf, e), lambda i, j: (i, 0, j, 0)), vec]


def _prefix_states(lk, v, gate_rows, blocks, chip=None):
  """The prefix states from the log features lk [R, L, F], or (``chip``) from the rows of k [R, L, D]."""
  r, length = lk.shape[:2]
  f = lk.shape[-1] if chip is None else chip.p.shape[1]
  e, bf, nc = v.shape[-1], blocks.block_f, length // blocks.chunk
  sp = _seq_specs(length, e)
  gated = () if gate_rows is None else (gate_rows[1], gate_rows[2])  # b, e
  ins, extra, more = [sp["feat"](bf)], [], []
  if chip is not None:
    (extra, more), ins = chip.ins("k", length, bf, seq=True), [chip.x_spec(length, seq=True)]
  return _call(kern.states_kernel, (r, f // bf), ins + [sp["val"]] + extra + [sp["row"]] * len(gated),
               _state_specs(nc + 1, bf, e), _f32((r, nc + 1, f), (r, nc + 1, f, e), (r, nc + 1, f)),
               blocks, n_chunks=nc, scale=None if chip is None else blocks.x_scale)(lk, v, *more, *gated)


def _chunk_specs(c_rows, f, e):
  """BlockSpecs of one chunk's rows [C, F], values [C, E], per-row [C], and its states μ/z [F], S [F, E]."""
  rows = lambda w: _spec((None, c_rows, w), lambda i, c: (i, c, 0))
  return dict(feat=rows(f), val=rows(e), row=_spec((None, c_rows), lambda i, c: (i, c)),
              vec=_spec((None, None, f), lambda i, c: (i, c, 0)),
              mat=_spec((None, None, f, e), lambda i, c: (i, c, 0, 0)))


def _gate_rows(g, chunk):
  """(g, b, e) [R, L] from the log gates g [R, L] (L a multiple of ``chunk``): b_t the gates from t's chunk's
  start to t, e_j those after j to its chunk's end; running sums inside each chunk (no difference taken)."""
  gc = g.reshape((g.shape[0], -1, chunk))
  b = jax.lax.associative_scan(jnp.add, gc, axis=2)
  return g, b.reshape(g.shape), to_end(gc, axis=2).reshape(g.shape)


def _forward(lq, lk, v, gate_rows, blocks, chip=None):
  """The forward from the log features lq, lk [R, L, F], or (``chip``) from the rows of q and k [R, L, D]."""
  r, length = lq.shape[:2]
  f = lq.shape[-1] if chip is None else chip.p.shape[1]
  e, nc = v.shape[-1], length // blocks.chunk
  mu, s, z = _prefix_states(lk, v, gate_rows, blocks, chip)
  sp = _chunk_specs(blocks.chunk, f, e)
  gated = () if gate_rows is None else gate_rows[:2]  # g, b
  ins, extra, more = [sp["feat"], sp["feat"]], [], []
  if chip is not None:
    (extra, more), ins = chip.ins("qk", blocks.chunk, f, seq=False), [chip.x_spec(blocks.chunk, seq=False)] * 2
  num, den, m, redone = _call(
      kern.output_kernel, (r, nc), ins + [sp["val"], sp["vec"], sp["mat"], sp["vec"]] + extra
      + [sp["row"]] * len(gated), [sp["val"], sp["row"], sp["row"], sp["row"]],
      _f32((r, length, e), (r, length), (r, length), (r, length)),
      blocks, scale=None if chip is None else blocks.x_scale)(lq, lk, v, mu, s, z, *more, *gated)
  return num, den, m, redone


def program(blocks: Blocks) -> fused_rows.Program:
  """The Triton kernels as a :class:`~favor_jax.core.fused.rows.Program`: the prefix states and the outputs
  (forward); the prefix states recomputed, the suffix states and the gradients (backward). Kept between them:
  the inputs and the row scales (not the features, F/D·4/itemsize times the inputs, nor the chunk states,
  F·E floats per chunk and row)."""
  def to_kernel(rows, q, params):
    """(the map ω -> (p, fb) the kernels read, the rows' scales of q and k or None)."""
    of_projection, scales = fused_rows.on_chip_inputs(blocks.feature_map, params, q, rows.fp, blocks.x_scale)
    return (lambda w: rows.projection(of_projection(w))), scales

  def forward(features, q, k, v, gate, mask):
    rows = Rows(features, q, v, mask, gate, blocks.chunk)
    gate_rows = None if rows.gate is None else _gate_rows(rows.gate, blocks.chunk)
    if blocks.feature_map:  # the kernels compute the features
      of_projection, scales = to_kernel(rows, q, features.params)
      q_rows, k_rows, chip = rows.on_chip(q, k, *of_projection(features.params[0]), scales)
      num, den, m, redone = _forward(q_rows, k_rows, rows.value_rows(v), gate_rows, blocks, chip)
    else:
      num, den, m, redone = _forward(*rows.log_rows(q, k), rows.value_rows(v), gate_rows, blocks)
    recomputed = jnp.sum(redone, axis=1).astype(jnp.int32).reshape(q.shape[0], q.shape[2])
    return (rows.back(num[..., :v.shape[-1]]), rows.back(den),
            rows.back(jnp.where(rows.seen, jax.lax.stop_gradient(m), NEG_INF)), recomputed)

  def backward(static, params, q, k, v, gate, mask, scale, dnum, dden, *, project=True):
    def logs(q, k, *params):
      return Rows(features_lib.rebuilt(static, params), q, v, mask, gate, blocks.chunk).log_rows(q, k)

    rows = Rows(features_lib.rebuilt(static, params), q, v, mask, gate, blocks.chunk)
    chip = None
    if blocks.feature_map:  # the kernels compute the features; the projection's gradient comes back through p
      of_projection, scales = to_kernel(rows, q, params)
      (p, fb), p_vjp = jax.vjp(of_projection, params[0])
      lq, lk, chip = rows.on_chip(q, k, p, fb, scales)  # rows of q and k where the log features are read
    else:
      (lq, lk), features_vjp = jax.vjp(logs, q, k, *params)
    vv = rows.value_rows(v)
    gate_rows = None if gate is None else _gate_rows(rows.gate, blocks.chunk)
    mu, s, z = _prefix_states(lk, vv, gate_rows, blocks, chip)
    dnum, dden = rows.of(dnum.astype(jnp.float32), 0.0, rows.ep), rows.of(dden.astype(jnp.float32), 0.0)
    r, length = lq.shape[:2]
    f = lq.shape[-1] if chip is None else chip.p.shape[1]
    e, bf, nc, c_rows = vv.shape[-1], blocks.block_f, length // blocks.chunk, blocks.chunk
    ms = jnp.where(rows.seen, kern.safe(rows.of(scale, NEG_INF)), 0.0)
    mq = jnp.where(rows.seen, ms, jnp.inf)  # rows that see no key have no terms: leave them out of ν
    seq = _seq_specs(length, e)
    gated = () if gate_rows is None else gate_rows[1:2]  # b
    ins, extra, more = [seq["feat"](bf)], [], []
    if chip is not None:
      (extra, more), ins = chip.ins("q", length, bf, seq=True), [chip.x_spec(length, seq=True)]
    nu, rr, rz = _call(kern.suffix_kernel, (r, f // bf), ins + [seq["row"], seq["val"], seq["row"]] + extra
                       + [seq["row"]] * len(gated), _state_specs(nc, bf, e),
                       _f32((r, nc, f), (r, nc, f, e), (r, nc, f)), blocks, n_chunks=nc,
                       scale=None if chip is None else blocks.x_scale)(lq, mq, dnum, dden, *more, *gated)
    sp = _chunk_specs(c_rows, f, e)
    gated = () if gate_rows is None else gate_rows  # g, b, e
    x_specs, x_shape, extra, more, dp_out = [sp["feat"]] * 2, (r, length, f), [], [], []
    if chip is not None:
      (extra, more), x_specs, x_shape = chip.ins("qk", c_rows, f, seq=False), [chip.x_spec(c_rows, False)] * 2, lq.shape
      if project:  # the projection's gradient per chunk (and FAVOR++'s normaliser's: it depends on ω)
        d = lq.shape[-1]
        dp_out = [(_spec((None, None, f, d), lambda i, c: (i, c, 0, 0)), (r, nc, f, d))]
        if blocks.feature_map in fused_rows.PER_ROW_MAPS:
          dp_out.append((_spec((None, None, f), lambda i, c: (i, c, 0)), (r, nc, f)))
    dlq, dlk, dv, *dg = _call(
        kern.grads_kernel, (r, nc),
        x_specs + [sp["val"], sp["row"], sp["val"], sp["row"], sp["vec"], sp["mat"], sp["vec"],
                   sp["vec"], sp["mat"], sp["vec"]] + extra + [sp["row"]] * len(gated),
        x_specs + [sp["val"]] + [sp["row"]] * (gate is not None) + [spec for spec, _ in dp_out],
        _f32(x_shape, x_shape, vv.shape, *[(r, length)] * (gate is not None), *[shape for _, shape in dp_out]),
        blocks, scale=None if chip is None else blocks.x_scale, project=bool(dp_out),
    )(lq, lk, vv, ms, dnum, dden, mu, s, z, nu, rr, rz, *more, *gated)
    # Masked keys (ℓk = −∞) and padded features get exactly zero gradient already.
    if chip is None:
      dq, dk, *dparams = features_vjp((dlq, dlk))
    else:
      of_x = lambda x: rows.of(x, 0.0, lq.shape[-1])
      dq = fused_rows.transpose(of_x, q, dlq.astype(q.dtype))
      dk = fused_rows.transpose(of_x, k, dlk.astype(k.dtype))
      dparams = [None, None if params[1] is None else jnp.zeros_like(params[1])]  # ρ held constant
      if dp_out:
        per_group = lambda x, g: x.sum(1).reshape((-1, g) + x.shape[2:]).sum(0)  # rows (n, h) -> groups
        dfb = per_group(dg.pop(), chip.fb.shape[0]) if len(dp_out) == 2 else jnp.zeros_like(chip.fb)
        dparams[0] = p_vjp((per_group(dg.pop(), chip.p.shape[0]), dfb))[0]
    dv = fused_rows.transpose(rows.value_rows, v, dv.astype(v.dtype))
    dg = fused_rows.transpose(rows.gate_rows, gate, dg[0]) if dg else None
    return dq, dk, dv, dg, tuple(dparams)

  return fused_rows.Program(forward, backward)


# Launch choices on a GPU, the fastest of the block-size sweep (experiments/configs/blocks.py) on an H200 in
# bfloat16, B=1 H=8 D=64 M=256 (experiments/results/pallas_h200_bf16): chunk 64, 4 warps, feature blocks
# of 32, at L=4096 forward (0.450 ms) and forward + backward (1.033 ms; 1.202 ms with blocks of 64).
GPU_DEFAULTS = dict(chunk_size=64, num_warps=4, block_f=32)


def blocks_for(chunk_size: int = GPU_DEFAULTS["chunk_size"], *, num_warps: int = GPU_DEFAULTS["num_warps"],
               block_f: int = GPU_DEFAULTS["block_f"], interpret: bool | None = None) -> Blocks:
  """Launch choices; ``interpret`` None: Pallas's interpreter unless the default backend is a GPU.

  Args:
    chunk_size: C, rows per chunk, a power of two >= 16.
    num_warps: Triton warps per program.
    block_f: features per block of the sequential kernels, a power of two >= 16.
    interpret: run the kernels in Pallas's interpreter (None: unless the default backend is a GPU).

  Returns:
    The :class:`Blocks` (``operands``, ``gated`` and ``precision`` are set by :func:`causal` per call).

  Raises:
    ValueError: a chunk or feature block that is not a power of two >= 16.
  """
  if not pallas_block(chunk_size):
    raise ValueError(f"causal_method='pallas' needs chunk_size a power of two >= 16, got {chunk_size}")
  if not pallas_block(block_f):
    raise ValueError(f"block_f must be a power of two >= 16, got {block_f}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return Blocks(chunk_size, block_f, num_warps, bool(interpret))


def _precision(precision):
  """None or a ``jax.lax.Precision`` (its name as a string is taken too); anything else: ValueError."""
  if precision is None or isinstance(precision, jax.lax.Precision):
    return precision
  try:
    return jax.lax.Precision(precision)
  except (ValueError, TypeError, KeyError):
    raise ValueError(f"precision must be None or a jax.lax.Precision (or its name: 'default', 'high', "
                     f"'highest'), got {precision!r}") from None


def call_blocks(blocks: Blocks, q, k, v, gate, precision, features=None) -> Blocks:
  """``blocks`` completed for one call: the feature block (at most the padded features), the operand dtype
  (bfloat16 only where every input is bfloat16 and the precision asks no more: a float32 value or key must
  not be rounded to bfloat16 inside; float16's range is too short, see ``kern.dot``), gates, precision."""
  precision = _precision(precision)
  if features is not None:
    f = jax.eval_shape(lambda: head_major(features, q, k)[0].log).shape[-1]
    blocks = blocks._replace(block_f=min(blocks.block_f, pow2(f)), x_scale=q.shape[-1] ** -0.25,
                             feature_map=fused_rows.feature_map(features))
  low = jnp.result_type(q, k, v) == jnp.bfloat16 and precision in (None, jax.lax.Precision.DEFAULT)
  return blocks._replace(operands="bfloat16" if low else "float32", gated=gate is not None, precision=precision)


def causal(features, q, k, v, mask, *, chunk_size: int = 64, blocks: Blocks | None = None,
           return_scale: bool = False, return_recomputed: bool = False, fallback=None, gate=None, precision=None):
  """Causal linear attention through the fused kernels: (numerator [N, L, H, Dv], denominator [N, L, H]).

  The contract of :func:`favor_jax.core.causal_xla.chunked` (both times the same per-row factor e^{−scale};
  ``return_scale`` adds the scale [N, L, H], −∞ where a row sees no key; ``return_recomputed`` the number of
  rows [N, H] int32 the kernels computed again alone, those that lost their terms in their chunk's product).
  The feature map must give
  pure exponentials, φ = exp(log) with a log per feature (:func:`~favor_jax.core.features.exponential_features`,
  read off the features: e.g. positive, hyperbolic, FAVOR++, FAVOR#, Hedgehog, ELU+1); others (signed or
  polynomial features) raise ``ValueError``: use ``"chunked"``.

  ``gate`` [N, L, H]: log forget gates, ≤ 0, −∞ a reset (``gates.prepare``'s ``log``, segment starts
  included): the state decays by e^{g_t} before key t joins, as in the XLA pass; differentiable.
  ``precision``: of every product in the kernels, forward and backward: None (the backend's default: on a GPU
  TF32 for float32 operands, and bfloat16 products of features where every input is bfloat16), or a
  ``jax.lax.Precision`` (HIGHEST: float32 products throughout, bfloat16 inputs included).
  ``fallback``: the pass that redoes the call where a row still lost its terms after the kernels' own
  recompute (a net: none is expected), called as
  ``fallback(features, q, k, v, mask, chunk_size=C, return_scale=True, gate=gate)`` (the caller binds
  anything else, e.g. its precision; :mod:`favor_jax.core.causal` gives the XLA chunked pass); None or False
  (tests only): the fused result even there.
  """
  blocks = blocks_for(chunk_size) if blocks is None else blocks
  precision = _precision(precision)
  if not exponential_features(features, q, k):
    raise ValueError("causal_method='pallas' needs features that are exponentials with a log per feature "
                     "(no multiplier); this kernel's are not: use causal_method='chunked'")
  n, length, h = q.shape[:3]
  if gate is not None and tuple(gate.shape) != (n, length, h):
    raise ValueError(f"gate must have shape [N, L, H] = {(n, length, h)}, got {tuple(gate.shape)}")
  blocks = call_blocks(blocks, q, k, v, gate, precision, features)

  out = fused_rows.run(program(blocks), fused_rows.xla_redo(fallback, blocks.chunk), features, q, k, v, gate, mask)
  return out[:3 if return_scale else 2] + (out[3:] if return_recomputed else ())
