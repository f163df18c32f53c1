"""The precision of an attention call's dots: one argument, checked once, in force for every dot (internal).

A public function takes ``precision`` (a ``jax.lax.PrecisionLike``; None: the backend's default, as in
``jax.numpy`` and Flax); :func:`honoured` checks it with :func:`check` and runs the whole body inside
:func:`scope`, JAX's
``default_matmul_precision`` for the call: every ``dot_general`` traced inside (the feature maps'
projections, statistics, the passes, read-outs, the Pallas kernels' bodies) then carries it, and reverse mode
copies a dot's precision to its transposes. What is traced later, outside the call (a ``custom_vjp``'s
backward, a rule run by a transformation of a jitted call), reopens the scope from the value :func:`current`
read while the call was traced (see ``causal_xla._token_groups``).
"""

from __future__ import annotations

import contextlib
import functools

import jax

# The names JAX's default_matmul_precision takes: lax.Precision's and lax.DotAlgorithmPreset's.
_PRECISION_NAMES = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")
NAMES = _PRECISION_NAMES + tuple(p.name for p in jax.lax.DotAlgorithmPreset if p.name != "DEFAULT")


def _name(p):
  """One operand's precision as its name, with a key that equates aliases ("float32" is "highest")."""
  if isinstance(p, jax.lax.Precision):
    return p.name.lower(), p
  if isinstance(p, jax.lax.DotAlgorithmPreset) and p.name in NAMES:
    return p.name, p.name
  if isinstance(p, str) and p in NAMES:
    return p, jax.lax.Precision(p) if p in _PRECISION_NAMES else p
  return None, None


def check(precision, name: str = "precision") -> str | None:
  """``precision`` as the name JAX's ``default_matmul_precision`` takes (None stays None).

  Args:
    precision: None, a ``jax.lax.Precision``, one of its names (``"highest"``, ``"float32"``, ...), a
      ``jax.lax.DotAlgorithmPreset`` or its name, or a pair of equal ones (one per operand).
    name: the argument's name, for the error.

  Returns:
    The name, e.g. ``"highest"``, or None.

  Raises:
    ValueError: for anything else (a pair of different precisions included: one call's dots take one).
  """
  if precision is None:
    return None
  if isinstance(precision, (tuple, list)) and len(precision) == 2:
    (first, key0), (_, key1) = _name(precision[0]), _name(precision[1])
    if first is not None and key0 == key1:
      return first
  else:
    first, _ = _name(precision)
    if first is not None:
      return first
  raise ValueError(f"{name} must be None (the backend's default), a jax.lax.Precision, a jax.lax.DotAlgorithmPreset, "
                   f"one of their names {list(NAMES)}, or a pair of equal ones; got {precision!r}")


def scope(precision: str | None):
  """A context in which every dot traced takes ``precision`` (checked by :func:`check`); None: nothing
  changes (the backend's default, or a ``jax.default_matmul_precision`` the caller set)."""
  return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)


def current() -> str | None:
  """The precision in force where this is traced (a :func:`scope`'s, the caller's, or None)."""
  return jax.config.jax_default_matmul_precision


def honoured(fn):
  """``fn(..., precision=...)`` with ``precision`` checked (:func:`check`) and in force (:func:`scope`) for its
  whole body; ``fn`` receives the checked name, to hand to what is traced outside the call (fused kernels)."""
  @functools.wraps(fn)
  def wrapped(*args, precision=None, **kwargs):
    precision = check(precision)
    with scope(precision):
      return fn(*args, precision=precision, **kwargs)

  return wrapped
