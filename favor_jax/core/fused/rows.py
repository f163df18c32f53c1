"""What the fused causal kernels' callers do around them (internal): the inputs as padded head-major rows, which
rows have a key in reach, the gates' gradient from the features', and the redo of rows that lost their terms.

Shape letters: see :mod:`favor_jax.core`; R = N·H rows of (sequence, head), L padded to whole chunks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jaxtyping import Array

from favor_jax.core import features as features_lib
from favor_jax.core import kernels as kernels_lib
from favor_jax.core import statistics
from favor_jax.core.features import head_major
from favor_jax.core.state import SAFE_GAP, parts

NEG_INF = -jnp.inf
# The on-chip feature maps (``Kernel.fused_map``) whose projection and normaliser are one per row (from the
# call's statistic), and those that also scale q and k by a vector per row first (FAVOR#: Ψ and Ψ⁻¹).
PER_ROW_MAPS = ("optimal_positive", "saderf")
SCALED_MAPS = ("saderf",)


class Rows(NamedTuple):
  """A call's inputs as rows: ``log_rows(q, k)`` -> log features [R, L, F] (float32, −∞ for masked keys, padded
  features and positions), ``value_rows(v)`` -> [R, L, Dv], gate [R, L] or
  None (``gate_rows(gate)`` makes it), seen [R, L] bool (a key in reach: unmasked, at or before the row, no
  reset in between), ``of(x, fill)`` ([N, L, H(, W)] -> [R, L(, W)], padded with ``fill``) and ``back``
  ([R, L, ...] -> [N, L, H, ...], the padding cut). Every map here is linear in its array, so a backward
  transposes it (``jax.linear_transpose``)."""
  log_rows: Callable
  value_rows: Callable
  gate_rows: Callable
  gate: Array | None
  seen: Array
  of: Callable
  back: Callable


def _round_up(n, unit):
  return -(-n // unit) * unit


def _running_max(x):
  return jax.lax.associative_scan(jnp.maximum, x, axis=x.ndim - 1)


def prepare(features, q, k, v, mask, gate, *, chunk: int, lane: int) -> Rows:
  """The rows of q, k [N, L, H, D], v [N, L, H, Dv], mask [N, L], gate [N, L, H] (or None): L padded to a
  multiple of ``chunk``, features to a multiple of ``lane`` (values unpadded: a block as wide as its array)."""
  n, length, h = q.shape[:3]
  f = jax.eval_shape(lambda: head_major(features, q, k)[0].log).shape[-1]
  padded, fp = _round_up(length, chunk), _round_up(f, lane)

  def rows(x, value, width=None):  # [N, H, L, W] or [N, H, L] -> [N·H, padded(, width)]
    x = x.reshape((n * h,) + x.shape[2:])
    pad = [(0, 0), (0, padded - length)] + ([] if width is None else [(0, width - x.shape[-1])])
    return jnp.pad(x, pad, constant_values=value)

  def log_rows(q, k):
    fq, fk = head_major(features, q, k)
    log_q, _ = parts(fq)
    log_k, _ = parts(fk, mask[:, None, :, None])
    return rows(log_q.astype(jnp.float32), NEG_INF, fp), rows(log_k.astype(jnp.float32), NEG_INF, fp)

  def value_rows(v):  # [N, L, H, Dv] -> [R, L, Dv] (the denominator has a state of its own: no column of ones)
    return rows(jnp.swapaxes(v, 1, 2), 0.0, v.shape[-1])

  gate_rows = lambda gate: rows(jnp.swapaxes(gate.astype(jnp.float32), 1, 2), 0.0)  # [N, L, H] -> [R, L]
  of = lambda x, fill: rows(jnp.swapaxes(x, 1, 2), fill, None if x.ndim == 3 else x.shape[-1])
  position = jnp.arange(length)
  last_key = _running_max(jnp.where(mask, position, -1))[:, None, :]  # [N, 1, L]
  g = None
  if gate is None:
    seen = jnp.broadcast_to(last_key >= 0, (n, h, length))
  else:
    last_reset = _running_max(jnp.where(jnp.swapaxes(gate, 1, 2) == NEG_INF, position, -1))
    seen = (last_key >= 0) & (last_key >= last_reset)
    g = gate_rows(gate)
  seen = rows(seen, False)
  back = lambda x: jnp.swapaxes(x[:, :length].reshape((n, h, length) + x.shape[2:]), 1, 2)
  return Rows(log_rows, value_rows, gate_rows, g, seen, of, back)


def feature_map(features) -> str | None:
  """The on-chip feature map for ``features`` (a :class:`~favor_jax.core.features.Features`), chosen once from
  the kernel record: its ``fused_map`` ("positive": φ = exp(ωx − ‖x‖²/2)/√M, "hyperbolic": the same with
  [ω; −ω], /√(2M); "optimal_positive": FAVOR++ from the call's ρ; "saderf": FAVOR#, FAVOR++ of Ψq and Ψ⁻¹k
  from the call's statistic) where the call gives a projection, and a
  statistic exactly where the map takes one; None (a record without one, a kernel of your own, a plain
  callable, given features): the features from XLA, read by the kernels."""
  kern = getattr(features, "kernel", None)
  params = getattr(features, "params", ())
  name = getattr(kern, "fused_map", None)
  if name is None or len(params) != 2 or params[0] is None or (params[1] is None) == (name in PER_ROW_MAPS):
    return None
  return name


def key_bias(mask, h: int):
  """[N, L, H] float32: 0 for a key ``mask`` [N, L] keeps, −∞ for one it drops (added to the key's log
  features by kernels that compute them)."""
  return jnp.where(jnp.broadcast_to(mask[:, :, None], mask.shape + (h,)), 0.0, NEG_INF)


def projection_rows(projection, name, f_pad, rho_NH=None, d=None):
  """(p [G, F, D] float32, fb): the projection as the kernels read it (hyperbolic: stacked with its negative;
  padded with zero rows to F), and the log-normaliser (−∞ on padded features): [1, F] with G = 1 for a shared
  [M, D] projection, H for one per head [H, M, D]; FAVOR++ (a map of ``PER_ROW_MAPS``), one per row from ρ
  [N, H] (``kernels.oprf_affine``): p = B·ω [R, F, D] and fb = c [R, 1, F], R = N·H (ρ held constant)."""
  w = projection.astype(jnp.float32)
  w = w[None] if w.ndim == 2 else w
  if name == "hyperbolic":
    w = jnp.concatenate([w, -w], axis=-2)
  f = w.shape[-2]
  live = jnp.arange(f_pad) < f
  if name in PER_ROW_MAPS:
    b_NH1, c_NHM = kernels_lib.oprf_affine(jax.lax.stop_gradient(rho_NH), projection, d)
    w = (b_NH1[..., None] * w).reshape((-1, f, w.shape[-1]))  # [N, H, M, D] -> rows
    fb = jnp.where(live, jnp.pad(c_NHM.reshape((-1, 1, f)), ((0, 0), (0, 0), (0, f_pad - f))), NEG_INF)
  else:
    fb = jnp.where(live, -0.5 * math.log(f), NEG_INF)[None]  # √M positive, √(2M) hyperbolic
  return jnp.pad(w, ((0, 0), (0, f_pad - f), (0, 0))), fb.astype(jnp.float32)


def on_chip_inputs(name, params, q, f_pad, x_scale):
  """What the kernels that compute the map ``name``'s features read besides q, k: (``of_projection``, w ->
  :func:`projection_rows` of this call, its statistic and F = ``f_pad``; the rows' scales (u_q, u_k) [R, 1, D]
  or None). Maps of ``SCALED_MAPS`` (FAVOR#) scale q and k per (sequence, head) row first: d^{-1/4}·Ψ and
  d^{-1/4}/Ψ, Ψ from the statistic [N, H, D+1] = (log Ψ, ρ), held constant as in ``kernels.saderf``; the
  others by ``x_scale`` = d^{-1/4} alone (None).

  Args:
    name: the map (:func:`feature_map`).
    params: the features' arrays (projection, statistic or None).
    q: [N, L, H, D].
    f_pad: F, the features padded.
    x_scale: d^{-1/4}.
  """
  statistic, scales = params[1], None
  if name in SCALED_MAPS:
    log_psi, statistic = statistics.saderf_parts(jax.lax.stop_gradient(params[1]), q)
    psi = jnp.exp(log_psi).reshape((-1, 1, q.shape[-1]))  # rows (sequence, head), as the projection's
    scales = (x_scale * psi, x_scale / psi)
  return (lambda w: projection_rows(w, name, f_pad, statistic, q.shape[-1])), scales


def transpose(fn, x, ct):
  """The cotangent of x under the linear map ``fn`` (a :class:`Rows` map) given ``ct`` of its result."""
  return jax.linear_transpose(fn, jax.ShapeDtypeStruct(x.shape, x.dtype))(ct)[0]


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


first_order_only = _floating_first_order


def as_operand(x, operands: str):
  """x (float32) as a product's operands see it (rounded to the dtype ``operands`` names), in float32. Where a
  numerator takes weights through such a product, its denominator sums the same ones, and a state's z the
  same as its S: an output stays a convex combination of its values (with unrounded sums a one-hot row came
  out as (1 + 2⁻⁹)·v, and its ∂q at ×20, amplified by ‖q‖, 17% of the largest off)."""
  return x if operands == "float32" else x.astype(operands).astype(jnp.float32)


def lost_rows(den, scale):
  """Rows that see a key but whose denominator (≥ their largest term) fell below e^{−SAFE_GAP}.

  Elementwise: the callers' rule and the Mosaic forward kernel's (on its [C, 1] rows), one definition.

  Args:
    den: the denominators [N, L, H] (times e^{−scale}).
    scale: the rows' log-scales [N, L, H], −∞ where a row sees no key.

  Returns:
    bool [N, L, H].
  """
  return jnp.isfinite(scale) & (den < math.exp(-SAFE_GAP))


def gate_grad(x, g):
  """∂g [R, L] from x_t = Σ_f (∂ℓq_tf − ∂ℓk_tf) [R, L]: ∂g_l = Σ_{t≥l} x_t, summed up to the next reset
  only (the pairs across it have weight 0: fewer terms, no cancellation), 0 at a reset (−∞ gate)."""
  reset = g == NEG_INF
  # In reverse order a reset ends its segment: a segment starts right after one.
  xr, start = x[:, ::-1], jnp.concatenate([jnp.zeros_like(reset[:, :1]), reset[:, ::-1][:, :-1]], axis=1)

  def op(a, b):
    (xa, sa), (xb, sb) = a, b
    return jnp.where(sb, xb, xa + xb), sa | sb

  summed, _ = jax.lax.associative_scan(op, (xr, start), axis=1)
  return jnp.where(reset, 0.0, summed[:, ::-1])


class Program(NamedTuple):
  """One target's fused pass: ``forward(features, q, k, v, gate, mask) -> (num, den, scale[, recomputed])``
  (scale [N, L, H] the rows' log-scales, −∞ where a row sees no key: the only statistic kept for the backward;
  recomputed [N, H] int32 the rows the kernel computed again alone, where it does) and
  ``backward(features, params, q, k, v, gate, mask, scale, dnum, dden, *, project) -> (dq, dk, dv, dgate,
  dparams)`` (``features`` without its arrays, rebuilt from ``params`` there:
  :func:`favor_jax.core.features.rebuilt`; ``dparams`` as ``params``, None where one is None or, ``project``
  False, for the projection: nothing differentiates it)."""
  forward: Callable
  backward: Callable


def run(programs, redo, features, q, k, v, gate, mask):
  """(num, den, scale, recomputed) by ``programs`` (a :class:`Program`, or a dict of them by
  ``jax.lax.platform_dependent``'s keywords: the target chosen where the program is lowered), or by ``redo``
  (``redo(features, q, k, v, gate, mask)``, the XLA pass; None: never, tests only) where a row lost its terms
  (:func:`lost_rows`); recomputed [N, H]: the rows the kernel computed again alone (0 where a target does not).

  One custom VJP around all of it: the forward takes the target's forward and one ``cond`` whose branches
  return outputs only (the redo's primal), the backward the target's backward or, where the forward redid
  the call, the redo differentiated (its forward recomputed there). The residuals are the inputs, the
  features' arrays, the row scales [N, L, H] and one flag: no residual of a branch not taken (neither of
  another target nor of the redo) is kept or zero-filled, and no zero cotangent is added.
  """
  static, params = features_lib.split(features)
  return _run(programs, redo, static, q, k, v, gate, mask, *params)


def _outputs(out, q):
  """A program's forward as (num, den, scale, recomputed): a count of 0 per (sequence, head) if it gives none."""
  out = tuple(out)
  return out if len(out) == 4 else out + (jnp.zeros((q.shape[0], q.shape[2]), jnp.int32),)


def _forward(programs, redo, static, q, k, v, gate, mask, params):
  features = features_lib.rebuilt(static, params)
  if isinstance(programs, Program):
    out = _outputs(programs.forward(features, q, k, v, gate, mask), q)
  else:
    out = _platform_forward(programs, static, q, k, v, gate, mask, params)
  out, recomputed = out[:3], out[3]
  if redo is None:
    return out + (recomputed,), out[2], jnp.zeros((), bool)
  lost = jnp.any(lost_rows(out[1], out[2]))
  final = jax.lax.cond(lost, lambda: tuple(redo(features, q, k, v, gate, mask)), lambda: out)
  return final + (recomputed,), out[2], lost


def _platform_forward(programs, static, q, k, v, gate, mask, params):
  def branch(prog):
    return lambda q, k, v, gate, mask, params: _outputs(
        prog.forward(features_lib.rebuilt(static, params), q, k, v, gate, mask), q)
  return jax.lax.platform_dependent(q, k, v, gate, mask, params,
                                    **{p: branch(prog) for p, prog in programs.items()})


def _no_projection(dparams, project):
  """``dparams`` without the projection's gradient where nothing differentiates it (``project`` False)."""
  return tuple(dparams) if project or not dparams else (None,) + tuple(dparams[1:])


def _platform_backward(programs, static, project, *args):
  def backward(prog):
    def run(*args):
      *grads, dparams = prog.backward(static, *args, project=project)
      return (*grads, _no_projection(dparams, project))
    return run

  if isinstance(programs, Program):
    return backward(programs)(*args)
  return jax.lax.platform_dependent(*args, **{p: backward(prog) for p, prog in programs.items()})


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _run(programs, redo, static, q, k, v, gate, mask, *params):
  return _forward(programs, redo, static, q, k, v, gate, mask, params)[0]


def _run_fwd(programs, redo, static, q, k, v, gate, mask, *params):
  # Whether the projection (the features' first array) is differentiated: kept as the residuals' structure,
  # () or None (no array), so the backward knows it while tracing and leaves its gradient out where not.
  project = () if params and isinstance(params[0], CustomVJPPrimal) and params[0].perturbed else None
  q, k, v, gate, mask, params = jax.tree.map(lambda x: x.value, (q, k, v, gate, mask, params),
                                             is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
  q, k, v, gate, params = jax.tree.map(first_order_only, (q, k, v, gate, params))  # 2nd derivative: error
  out, scale, lost = _forward(programs, redo, static, q, k, v, gate, mask, params)
  return out, (q, k, v, gate, mask, params, scale, lost, project)


def _run_bwd(programs, redo, static, res, cts):
  # The scale is a constant (as in the XLA pass), the count an integer; a cotangent not given is a zero.
  cts = tuple(jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct for ct in cts[:2])
  (q, k, v, gate, mask, params, scale, lost, project), (dnum, dden) = jax.tree.map(first_order_only, (res, cts))
  project = project is not None

  def fused():
    return tuple(_platform_backward(programs, static, project, params, q, k, v, gate, mask, scale, dnum, dden))

  def again():
    def call(q, k, v, gate, *params):
      return tuple(redo(features_lib.rebuilt(static, params), q, k, v, gate, mask))[:2]
    _, vjp = jax.vjp(call, q, k, v, gate, *params)
    dq, dk, dv, dg, *dparams = vjp((dnum, dden))
    return dq, dk, dv, dg, _no_projection(dparams, project)

  if redo is None:
    dq, dk, dv, dg, dparams = fused()
  else:
    dq, dk, dv, dg, dparams = jax.lax.cond(lost, again, fused)
  return (dq, dk, dv, dg, None, *dparams)


_run.defvjp(_run_fwd, _run_bwd, symbolic_zeros=True)


def xla_redo(fallback, chunk: int):
  """``fallback(features, q, k, v, mask, chunk_size=chunk, return_scale=True[, gate=gate])`` as :func:`run`
  calls it: (features, q, k, v, gate, mask) -> (num, den, scale); None where ``fallback`` is None or False."""
  if not fallback:
    return None

  def redo(features, q, k, v, gate, mask):
    given = {} if gate is None else {"gate": gate}
    return tuple(fallback(features, q, k, v, mask, chunk_size=chunk, return_scale=True, **given))
  return redo
