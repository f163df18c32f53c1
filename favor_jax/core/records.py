"""The record of a feature map's facts (:class:`Kernel`) and its log-domain features (:class:`LogFeatures`).

The records themselves, each beside its formula, are in :mod:`favor_jax.core.kernels`, which re-exports these
names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

__all__ = ["LogFeatures", "Kernel", "materialise", "causal_statistic_error"]


class LogFeatures(NamedTuple):
  """Features kept in log domain: φ = mult · exp(log).

  Attributes:
    log: [..., L, H, F] or [..., L, H, 1] (one log per row); None: 0.
    mult: [..., L, H, F]; None: 1.
  """
  log: Array | None
  mult: Array | None


def materialise(f: LogFeatures, *, stabilize: bool, over_keys: bool) -> Array:
  """Features as an array; ``stabilize`` divides by the max over features (and over L if ``over_keys``)."""
  if f.log is None:
    return f.mult
  log = f.log
  if stabilize:
    axes = (-3, -1) if over_keys else (-1,)
    log = log - jax.lax.stop_gradient(jnp.max(log, axis=axes, keepdims=True))
  out = jnp.exp(log)
  return out if f.mult is None else out * f.mult



@dataclasses.dataclass(frozen=True)
class Kernel:
  """A feature map φ, φ(q)ᵀφ(k) ≈ κ(q, k), with its facts in one record beside its formula.

  ``kernel(query, key, projection=None, *, stabilize=True, **statistic)`` maps query [..., Lq, H, D] and key
  [..., Lk, H, D] (projection [M, D] or [H, M, D]) to features ([..., Lq, H, F], [..., Lk, H, F]);
  ``stabilize`` divides by maxima that cancel in normalised attention, ``statistic`` is ``rho=`` for the
  data-dependent kernels. It raises ValueError for a projection given to a kernel that takes none.

  Attributes:
    name: its key in ``KERNELS``.
    log_features: ``(query, key, projection, **statistic) -> (LogFeatures, LogFeatures)``.
    num_features: ``(M or None, D) -> F``.
    estimates_softmax: E[φ(q)ᵀφ(k)] = exp(q·k/√d) exactly.
    needs_projection: the features need a projection ω.
    takes_projection: False: the features use none, and one given is refused.
    learned: the projection is a trained parameter (identity at init), not a draw.
    positive_weights: φ(q)ᵀφ(k) > 0 for every q, k.
    statistic: keyword of the data statistic the features take (``"rho"``), or None.
    compute_statistic: ``(query, key, key_mask, query_mask) -> statistic`` over the whole sequence
      (masked, non-finite rows left out), or None; causal callers must pass the statistic instead.
  """
  name: str
  log_features: Callable
  num_features: Callable[[int | None, int], int]
  estimates_softmax: bool
  needs_projection: bool = True
  takes_projection: bool = True
  learned: bool = False
  positive_weights: bool = True
  statistic: str | None = None
  compute_statistic: Callable | None = None
  # The pairwise value in closed form, for a kernel whose features are signed and whose sum over features
  # cancels (terms far larger than the sum): (query, key, projection) -> log φ(q_i)ᵀφ(k_j) [..., H, Lq, Lk],
  # which ``attention_weights`` takes instead of the sum (None: the sum, in log domain).
  log_pairs: Callable | None = None

  @property
  def data_dependent(self) -> bool:
    return self.statistic is not None

  def statistic_shape(self, query_shape) -> tuple[int, ...]:
    """The shape ``compute_statistic`` gives for queries and keys of ``query_shape`` [..., L, H, D]
    ([..., H] for FAVOR++'s ρ, [..., H, D+1] for FAVOR#'s)."""
    one = jax.ShapeDtypeStruct(tuple(query_shape[:-3]) + (1,) + tuple(query_shape[-2:]), jnp.float32)
    return jax.eval_shape(self.compute_statistic, one, one).shape

  def check_projection_given(self, projection) -> None:
    """A projection given to a kernel that takes none is refused, not ignored."""
    if projection is not None and not self.takes_projection:
      raise ValueError(f"kernel {self.name!r} takes no projection (its features are a fixed function of q "
                       f"and k), got one of shape {jnp.shape(projection)}: pass None")

  def __call__(self, query, key, projection=None, *, stabilize: bool = True, **statistic):
    self.check_projection_given(projection)
    fq, fk = self.log_features(query, key, projection, **statistic)
    return (materialise(fq, stabilize=stabilize, over_keys=False),
            materialise(fk, stabilize=stabilize, over_keys=True))


def causal_statistic_error(kernel: Kernel, query) -> ValueError:
  """The error for a data-dependent kernel used causally without its statistic."""
  need = kernel.statistic_shape(query.shape)
  return ValueError(
      f"{kernel.name} takes its statistic {kernel.statistic} from the whole sequence, which in causal "
      f"attention would let future keys shape past outputs; pass {kernel.statistic}= (shape broadcastable "
      f"to {need}, e.g. a running average kept by the layer) or use a data-independent kernel")

