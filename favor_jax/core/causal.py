"""Causal attention's methods, chosen in one place: the XLA passes (:mod:`favor_jax.core.causal_xla`) and the
fused Pallas kernels (:mod:`favor_jax.core.fused`), by ``causal_method``.

Every method takes :class:`~favor_jax.core.features.Features` and the flattened q, k [N, L, H, D],
v [N, L, H, Dv], mask [N, L]; :func:`attend` returns the output, the others the numerator and
denominator (both times the same per-row factor) as :func:`~favor_jax.core.causal_xla.chunked` does.
"""

from __future__ import annotations

import jax

from favor_jax.core import fused
from favor_jax.core import gates as gates_lib
from favor_jax.core import precision as precision_lib
from favor_jax.core import state as state_lib
from favor_jax.core.causal_xla import chunked, cumsum, scan
from favor_jax.core.features import exponential_features


def auto(features, q, k, v, mask, *, chunk_size: int = 64, return_scale: bool = False, divide: bool = False,
         gate=None, precision=None):
  """The fused Pallas kernels on a GPU where they apply (exponential features, a power-of-two chunk, no
  gates), the XLA chunked pass elsewhere; the same estimator either way. ``gate`` [N, L, H]: log forget gates
  (see :func:`~favor_jax.core.causal_xla.chunked`)."""
  if gate is not None:
    return chunked(features, q, k, v, mask, chunk_size=chunk_size, return_scale=return_scale, divide=divide,
                   gate=gate, precision=precision)
  use_fused = (jax.default_backend() == "gpu" and fused.pallas_block(chunk_size)
               and exponential_features(features, q, k))
  run = pallas if use_fused else chunked
  return run(features, q, k, v, mask, chunk_size=chunk_size, return_scale=return_scale, divide=divide,
             precision=precision)


@precision_lib.honoured
def pallas(features, q, k, v, mask, *, chunk_size: int = 64, return_scale: bool = False, divide: bool = False,
           gate=None, precision=None):
  """The chunked pass as fused Pallas kernels (:func:`favor_jax.core.fused.causal`), redone by the XLA
  chunked pass where rows lost their terms. ``divide``: the output num/den only, as :func:`chunked` gives it.

  Raises:
    ValueError: ``gate`` is given (the fused kernels take no gates).
  """
  if gate is not None:
    raise ValueError(gates_lib.NOT_FUSED)
  if divide and return_scale:
    raise ValueError("pallas(divide=True) returns the output only: return_scale must be False")
  out = fused.causal(features, q, k, v, mask, chunk_size=chunk_size, return_scale=return_scale, fallback=chunked)
  return state_lib.divide(*out) if divide else out


CAUSAL_METHODS = {"auto": auto, "chunked": chunked, "pallas": pallas, "scan": scan, "cumsum": cumsum}


def attend(features, q, k, v, mask, *, causal_method: str, chunk_size: int, gate=None, precision=None):
  """The output [N, L, H, Dv] of causal attention by ``causal_method`` (one of ``CAUSAL_METHODS``, checked by
  the caller); the chunked passes divide inside their blocks. ``gate`` [N, L, H]: log forget gates.
  ``precision``: of every dot, forward and backward (``precision.check``ed; None: the backend's default)."""
  if causal_method in ("auto", "chunked", "pallas"):
    return CAUSAL_METHODS[causal_method](features, q, k, v, mask, chunk_size=chunk_size, divide=True, gate=gate,
                                         precision=precision)
  return state_lib.divide(*CAUSAL_METHODS[causal_method](features, q, k, v, mask, gate=gate, precision=precision))
