"""Causal attention's methods, chosen in one place: the XLA passes (:mod:`favor_jax.core.causal_xla`) and the
fused Pallas kernels, Mosaic for TPU (:mod:`favor_jax.core.fused.tpu`) and Triton for GPU
(:mod:`favor_jax.core.fused.gpu`), by ``causal_method``.

The fused kernel is chosen where the program is lowered (``jax.lax.platform_dependent``), not by the machine
that traces it: exporting for a TPU from any machine takes the Mosaic kernel, for CUDA or ROCm the Triton
one. On a CPU ``"pallas"`` runs Pallas's interpreter of the target named by the environment variable
``FAVOR_JAX_PALLAS_INTERPRET`` (``"mosaic"``, the default, or ``"triton"``), so both kernels' arithmetic runs
anywhere; on an accelerator a kernel is always compiled, never interpreted. What cannot run on the target
(another platform, an argument the kernel there lacks) fails when lowered for it, with a message naming it.

Every method takes :class:`~favor_jax.core.features.Features` and the flattened q, k [N, L, H, D],
v [N, L, H, Dv], mask [N, L]; :func:`attend` returns the output, the others the numerator and
denominator (both times the same per-row factor) as :func:`~favor_jax.core.causal_xla.chunked` does.
"""

from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from favor_jax.core import features as features_lib
from favor_jax.core import state as state_lib
from favor_jax.core.causal_xla import chunked, cumsum, scan
from favor_jax.core.features import exponential_features
from favor_jax.core.fused import gpu as fused
from favor_jax.core.fused import rows as fused_rows
from favor_jax.core.fused import tpu as fused_tpu

INTERPRET_ENV = "FAVOR_JAX_PALLAS_INTERPRET"
INTERPRET_TARGETS = ("mosaic", "triton")
_TRITON_TAKES = set(inspect.signature(fused.causal).parameters)


def interpreted_target() -> str:
  """The kernel ``"pallas"`` interprets on a CPU: ``FAVOR_JAX_PALLAS_INTERPRET`` (``"mosaic"`` if unset).

  Raises:
    ValueError: the variable names another target.
  """
  target = os.environ.get(INTERPRET_ENV, "mosaic")
  if target not in INTERPRET_TARGETS:
    raise ValueError(f"{INTERPRET_ENV} must be one of {INTERPRET_TARGETS} (the Pallas kernel interpreted on a "
                     f"CPU), got {target!r}")
  return target


# A branch for a platform that cannot run the call: traced like the others (platform_dependent traces every
# branch), it fails only if lowered, with its message.
_unavailable_p = Primitive("favor_unavailable")
_unavailable_p.multiple_results = True
_unavailable_p.def_abstract_eval(lambda *, avals, message: avals)


def _unavailable_lowering(ctx, *, avals, message):
  platform = ", ".join(ctx.module_context.platforms)
  raise ValueError(f"{message} (lowering for {platform})")


mlir.register_lowering(_unavailable_p, _unavailable_lowering)


def _bind(message, tree):
  """Arrays shaped as ``tree`` (of ShapeDtypeStructs or arrays; None stays None) that fail at lowering."""
  leaves, structure = jax.tree.flatten(tree)
  avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves)
  return jax.tree.unflatten(structure, _unavailable_p.bind(avals=avals, message=message))


def _unavailable(message) -> fused_rows.Program:
  """A target that cannot run the call: outputs and gradients that fail when lowered, with ``message`` (a
  gradient never silently becomes zero)."""
  def forward(features, q, k, v, gate, mask):
    return _bind(message, _shapes(q, v))

  def backward(static, params, q, k, v, gate, mask, scale, dnum, dden, *, project=True):
    return _bind(message, (q, k, v, gate, tuple(params)))

  return fused_rows.Program(forward, backward)


def _shapes(q, v):
  """The shapes of (num [N, L, H, Dv], den [N, L, H], scale [N, L, H]), float32, as every pass returns them."""
  f32 = jnp.result_type(v.dtype, jnp.float32)
  return (jax.ShapeDtypeStruct(q.shape[:3] + v.shape[-1:], f32), jax.ShapeDtypeStruct(q.shape[:3], f32),
          jax.ShapeDtypeStruct(q.shape[:3], f32))


def _xla(precision):
  """The XLA chunked pass at ``precision`` (the fused kernels' redo of rows that lost their terms), on v in
  float32 (the fused kernels take v in its own dtype; the XLA pass's products follow its operands')."""
  def xla(features, q, k, v, mask, **kw):
    given = {} if precision is None else {"precision": precision}
    return chunked(features, q, k, v.astype(jnp.result_type(v.dtype, jnp.float32)), mask, **kw, **given)
  return xla


def _xla_program(chunk_size, precision) -> fused_rows.Program:
  """The XLA chunked pass as a target (``"auto"`` on a CPU): its own forward, its backward by autodiff (its
  forward recomputed there)."""
  redo = fused_rows.xla_redo(_xla(precision), chunk_size)

  def backward(static, params, q, k, v, gate, mask, scale, dnum, dden, *, project=True):  # project: see rows.run
    call = lambda q, k, v, gate, *params: redo(features_lib.rebuilt(static, params), q, k, v, gate, mask)[:2]
    dq, dk, dv, dg, *dparams = jax.vjp(call, q, k, v, gate, *params)[1]((dnum, dden))
    return dq, dk, dv, dg, tuple(dparams)

  return fused_rows.Program(redo, backward)


def _mosaic(features, q, k, v, gate, chunk_size, precision, interpret):
  cfg = fused_tpu.config(q, k, v, gate, chunk_size=chunk_size, precision=precision, interpret=interpret,
                         features=features)
  return fused_tpu.program(cfg)


def _triton(features, q, k, v, gate, chunk_size, precision, interpret):
  """The Triton kernels, given ``gate`` and ``precision`` where :func:`favor_jax.core.fused.gpu.causal` takes them."""
  given = {name: x for name, x in (("gate", gate), ("precision", precision)) if x is not None}
  lacking = sorted(set(given) - _TRITON_TAKES)
  if lacking:
    return _unavailable(f"causal_method='pallas': the Triton kernels take no {' or '.join(lacking)}; use "
                        "causal_method='chunked'")
  return fused.program(fused.call_blocks(fused.blocks_for(chunk_size, interpret=interpret), q, k, v, gate,
                                         precision, features))


def _fused(features, q, k, v, mask, gate, chunk_size, precision, *, return_scale, divide, xla_elsewhere: bool):
  """The output (``divide``) or (num, den[, scale]) by the fused kernel of the platform the program is lowered
  for; on a CPU the XLA pass (``xla_elsewhere``) or the interpreter of :func:`interpreted_target`. One
  custom VJP around the choice (:func:`favor_jax.core.fused.rows.run`), so a gradient keeps the residuals of
  no target but the one lowered."""
  if divide and return_scale:
    raise ValueError("causal_method 'pallas'/'auto' with divide=True returns the output only: return_scale must "
                     "be False")
  fused.blocks_for(chunk_size)  # the chunk every target takes (a power of two >= 16), checked on any machine
  if xla_elsewhere:
    cpu = _xla_program(chunk_size, precision)
  else:
    interpreted = _mosaic if interpreted_target() == "mosaic" else _triton
    cpu = interpreted(features, q, k, v, gate, chunk_size, precision, True)
  programs = dict(tpu=_mosaic(features, q, k, v, gate, chunk_size, precision, False),
                  cuda=_triton(features, q, k, v, gate, chunk_size, precision, False),
                  rocm=_triton(features, q, k, v, gate, chunk_size, precision, False), cpu=cpu,
                  default=_unavailable("causal_method='pallas' has no fused kernel for this platform (TPU: Mosaic; "
                                       "CUDA, ROCm: Triton; CPU: interpreted); use causal_method='chunked'"))
  out = fused_rows.run(programs, fused_rows.xla_redo(_xla(precision), chunk_size), features, q, k, v, gate, mask)
  return state_lib.divide(*out[:2]) if divide else tuple(out[:3] if return_scale else out[:2])


def auto(features, q, k, v, mask, *, chunk_size: int = 64, return_scale: bool = False, divide: bool = False,
         gate=None, precision=None):
  """The fused kernel where the call fits it (exponential features, a power-of-two chunk >= 16) and the
  program is lowered for a TPU or a GPU, the XLA chunked pass elsewhere; the same estimator either way.
  Traced on a machine whose default backend is a CPU, the XLA pass only (the kernels' branches, traced
  for nothing there, cost a second per trace): to export the fused kernel from a CPU, use ``"pallas"``.
  ``gate`` [N, L, H]: log forget gates (see :func:`~favor_jax.core.causal_xla.chunked`)."""
  given = {} if gate is None else {"gate": gate}
  if jax.default_backend() == "cpu" or not (fused.pallas_block(chunk_size) and exponential_features(features, q, k)):
    return _xla(precision)(features, q, k, v, mask, chunk_size=chunk_size, return_scale=return_scale,
                           divide=divide, **given)
  return _fused(features, q, k, v, mask, gate, chunk_size, precision, return_scale=return_scale, divide=divide,
                xla_elsewhere=True)


def pallas(features, q, k, v, mask, *, chunk_size: int = 64, return_scale: bool = False, divide: bool = False,
           gate=None, precision=None):
  """The chunked pass as fused Pallas kernels, Mosaic on a TPU and Triton on a GPU (chosen where lowered),
  interpreted on a CPU (:func:`interpreted_target`); rows that lost their terms in a chunk's product computed
  again alone inside the kernels, the call redone by the XLA chunked pass where a row is still lost (none is
  expected). ``divide``: the output num/den only, as :func:`chunked` gives it.

  Raises:
    ValueError: features that are not pure exponentials, a chunk that is not a power of two >= 16, or
      ``divide`` with ``return_scale``.
  """
  if not exponential_features(features, q, k):
    raise ValueError("causal_method='pallas' needs features that are exponentials with a log per feature "
                     "(no multiplier); this kernel's are not: use causal_method='chunked'")
  return _fused(features, q, k, v, mask, gate, chunk_size, precision, return_scale=return_scale, divide=divide,
                xla_elsewhere=False)


CAUSAL_METHODS = {"auto": auto, "chunked": chunked, "pallas": pallas, "scan": scan, "cumsum": cumsum}


def attend(features, q, k, v, mask, *, causal_method: str, chunk_size: int, gate=None, precision=None):
  """The output [N, L, H, Dv] of causal attention by ``causal_method`` (one of ``CAUSAL_METHODS``, checked by
  the caller); the chunked passes divide inside their blocks. ``gate`` [N, L, H]: log forget gates.
  ``precision``: of every dot, forward and backward (``precision.check``ed; None: the backend's default)."""
  if causal_method in ("auto", "chunked", "pallas"):
    return CAUSAL_METHODS[causal_method](features, q, k, v, mask, chunk_size=chunk_size, divide=True, gate=gate,
                                         precision=precision)
  return state_lib.divide(*CAUSAL_METHODS[causal_method](features, q, k, v, mask, gate=gate, precision=precision))
