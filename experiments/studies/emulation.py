"""What an accelerator's default precision does to a float32 program, emulated on any machine.

A TPU multiplies float32 matrices at ``jax.lax.Precision.DEFAULT`` in one bfloat16 pass: each operand rounded
to bfloat16 (8 significant bits), the products (exact in float32) summed in float32; a GPU from Ampere on in
TF32 (11 significant bits), also summed in float32. :func:`rounded_dots` runs a function with exactly that
for every float32 ``dot_general`` that states no precision (or DEFAULT), and as traced for the rest: an
interpreter of the function's jaxpr, reaching the dots inside ``scan``, ``cond``, ``while``, ``jit``,
``checkpoint`` and custom-derivative calls. Forward only (differentiate the function before passing it in to
emulate its backward pass). One definition, read by the precision study (:mod:`experiments.studies.precision`) and the
tests of the library's rules under these defaults.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

BFLOAT16_BITS = 7  # explicit mantissa bits of a TPU's default pass (bfloat16)
TENSORFLOAT32_BITS = 10  # of a GPU's default from Ampere on (TF32)

# Calls whose body runs as it stands (inlined): custom rules are for derivatives, not for this forward pass.
_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
           "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr"}


def _rounded(x, mantissa_bits):
  """A float32 operand rounded (to nearest) to ``mantissa_bits`` explicit bits, float32's exponent kept."""
  return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=mantissa_bits) if x.dtype == jnp.float32 else x


def _default(precision) -> bool:
  return precision is None or (isinstance(precision, tuple) and all(p == jax.lax.Precision.DEFAULT for p in precision))


def _rewrite(closed: jax_core.ClosedJaxpr, bits: int) -> jax_core.ClosedJaxpr:
  """``closed`` with its default-precision dots emulated, as a jaxpr of the same signature."""
  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
  return jax.make_jaxpr(lambda *args: _eval(closed.jaxpr, closed.consts, args, bits))(*avals)


def _param(value, bits):
  if isinstance(value, jax_core.ClosedJaxpr):
    return _rewrite(value, bits)
  if isinstance(value, tuple) and value and all(isinstance(v, jax_core.ClosedJaxpr) for v in value):
    return tuple(_rewrite(v, bits) for v in value)
  return value


def _eval(jaxpr, consts, args, bits):
  env = {}
  read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]
  for var, val in zip(jaxpr.constvars, consts):
    env[var] = val
  for var, val in zip(jaxpr.invars, args):
    env[var] = val
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name == "dot_general" and _default(eqn.params["precision"]):
      outs = [jax.lax.dot_general(*(_rounded(x, bits) for x in invals), eqn.params["dimension_numbers"],
                                  precision=jax.lax.Precision.HIGHEST,
                                  preferred_element_type=eqn.params["preferred_element_type"])]
    elif name in _INLINE and _INLINE[name] in eqn.params:
      body = eqn.params[_INLINE[name]]
      outs = (_eval(body.jaxpr, body.consts, invals, bits) if isinstance(body, jax_core.ClosedJaxpr)
              else _eval(body, (), invals, bits))
    elif any(isinstance(v, jax_core.Jaxpr) for v in eqn.params.values()):
      raise NotImplementedError(f"rounded_dots cannot reach the dots inside {name!r} (e.g. a Pallas kernel's)")
    else:
      outs = eqn.primitive.bind(*invals, **{k: _param(v, bits) for k, v in eqn.params.items()})
      outs = outs if eqn.primitive.multiple_results else [outs]
    for var, val in zip(eqn.outvars, outs):
      env[var] = val
  return [read(v) for v in jaxpr.outvars]


def rounded_dots(fn, mantissa_bits: int = BFLOAT16_BITS):
  """``fn`` with every float32 dot of default precision computed on operands of ``mantissa_bits`` bits.

  Args:
    fn: a function of arrays (pytrees allowed) to arrays, traceable by ``jax.make_jaxpr``.
    mantissa_bits: explicit mantissa bits each operand keeps: ``BFLOAT16_BITS`` (a TPU's default, one
      bfloat16 pass) or ``TENSORFLOAT32_BITS`` (a recent GPU's, TF32).

  Returns:
    A jitted function of the same arguments: ``fn``'s result, each default-precision float32 ``dot_general``
    taken on operands rounded to nearest at ``mantissa_bits`` with products summed in float32 (other dots as
    traced).
  """
  def run(*args):
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), mantissa_bits)
    return jax.tree.unflatten(jax.tree.structure(shapes), out)

  return jax.jit(run)


bfloat16_dots = functools.partial(rounded_dots, mantissa_bits=BFLOAT16_BITS)  # a TPU's default
tensorfloat32_dots = functools.partial(rounded_dots, mantissa_bits=TENSORFLOAT32_BITS)  # a recent GPU's default
