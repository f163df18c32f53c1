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
    fused_map: the features as the fused TPU programs compute them on chip from q, k and the projection
      (``"positive"``: log φ = ω·x − ‖x‖²/2 − log √M; ``"hyperbolic"``: the same for [ω; −ω], − log √(2M);
      ``"optimal_positive"``: FAVOR++'s B·ω·x − ‖x‖²/2 + c from the call's ρ, ``kernels.oprf_affine``;
      ``"saderf"``: FAVOR#, the same with x = Ψq·d^{-1/4} for queries and Ψ⁻¹k·d^{-1/4} for keys, Ψ and ρ from
      the call's statistic; x = q·d^{-1/4}), or None: the programs read the features ``log_features`` gives
      (computed by XLA). Set it only where ``log_features`` is exactly that formula; a record of your own keeps None.
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
  fused_map: str | None = None

  @property
  def data_dependent(self) -> bool:
    return self.statistic is not None

  def statistic_shape(self, query_shape) -> tuple[int, ...]:
    """The shape ``compute_statistic`` gives for queries and keys of ``query_shape`` [..., L, H, D]
    ([..., H] for FAVOR++'s ρ, [..., H, D+1] for FAVOR#'s)."""
    one = jax.ShapeDtypeStruct(tuple(query_shape[:-3]) + (1,) + tuple(query_shape[-2:]), jnp.float32)
    return jax.eval_shape(self.compute_statistic, one, one).shape

  def check_features(self, query, key, projection=None, **statistic) -> None:
    """Checks ``log_features`` against the contract on one row of ``query`` and ``key`` (shapes only, by
    ``jax.eval_shape``: at trace time, nothing computed), so a record of one's own fails here with what the
    contract wants, not deep inside an algorithm.

    Args:
      query: queries [..., Lq, H, D] (or a ``jax.ShapeDtypeStruct``).
      key: keys [..., Lk, H, D].
      projection: ω [M, D] or [H, M, D], or None.
      **statistic: the data statistic under the record's ``statistic`` keyword, if it takes one.

    Raises:
      TypeError: ``log_features`` does not return two :class:`LogFeatures`, or one has neither part, a part
        that is not a floating array.
      ValueError: a part's shape is not [..., L, H, F] (log: F or 1) for its input's [..., L, H, D], query and
        key features differ in F, or F differs from ``num_features(M, D)``.
    """
    row = lambda x: jax.ShapeDtypeStruct(tuple(x.shape[:-3]) + (1,) + tuple(x.shape[-2:]), jnp.float32)
    out = jax.eval_shape(lambda q, k: self.log_features(q, k, projection, **statistic), row(query), row(key))
    contract = (f"kernel {self.name!r}: log_features(query, key, projection) must return a pair "
                "(LogFeatures(log, mult), LogFeatures(log, mult)) of favor_jax.core.LogFeatures, φ = mult · exp(log)")
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(f, LogFeatures) for f in out)):
      raise TypeError(f"{contract}; got {_describe(out)}")
    widths = []
    for f, x, what in zip(out, (query, key), ("query", "key")):
      if f.log is None and f.mult is None:
        raise TypeError(f"{contract}; the {what} features have log=None and mult=None (give at least one)")
      rows = tuple(x.shape[:-3]) + (1,) + tuple(x.shape[-2:-1])  # [..., L, H] of one row
      for part, a in (("log", f.log), ("mult", f.mult)):
        if a is None:
          continue
        dtype = getattr(a, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
          raise TypeError(f"{contract}; the {what} features' {part} must be a floating array, got "
                          f"{_describe(a)}")
        if a.ndim < 1 or tuple(a.shape[:-1]) != rows:
          raise ValueError(f"{contract}; the {what} features' {part} must have shape [..., L, H, F] = "
                           f"{rows + ('F',)} for a {what} of shape {rows + tuple(x.shape[-1:])}, got {tuple(a.shape)}")
      width = f.mult.shape[-1] if f.mult is not None else f.log.shape[-1]
      if f.log is not None and f.mult is not None and f.log.shape[-1] not in (1, width):
        raise ValueError(f"{contract}; the {what} features' log must have F = {width} entries (as mult) or 1 "
                         f"(one per row), got {f.log.shape[-1]}")
      widths.append(width)
    if widths[0] != widths[1]:
      raise ValueError(f"{contract}; query and key features must have one F, got {widths[0]} and {widths[1]}")
    m = None if projection is None else projection.shape[-2]
    want = self.num_features(m, query.shape[-1])
    if want != widths[0]:
      raise ValueError(f"kernel {self.name!r}: num_features({m}, {query.shape[-1]}) = {want}, but its log_features "
                       f"return F = {widths[0]} features; make num_features(M, D) give the F log_features returns")

  def check_projection_given(self, projection) -> None:
    """A projection given to a kernel that takes none is refused, not ignored."""
    if projection is not None and not self.takes_projection:
      raise ValueError(f"kernel {self.name!r} takes no projection (its features are a fixed function of q "
                       f"and k), got one of shape {jnp.shape(projection)}: pass None")

  def __call__(self, query, key, projection=None, *, stabilize: bool = True, **statistic):
    self.check_projection_given(projection)
    self.check_features(query, key, projection, **statistic)
    fq, fk = self.log_features(query, key, projection, **statistic)
    return (materialise(fq, stabilize=stabilize, over_keys=False),
            materialise(fk, stabilize=stabilize, over_keys=True))


def _describe(x) -> str:
  """What a value is, for an error: a type and, for arrays, shape and dtype (tuples item by item)."""
  if isinstance(x, LogFeatures):
    return f"LogFeatures({_describe(x.log)}, {_describe(x.mult)})"
  if isinstance(x, (tuple, list)):
    return f"{type(x).__name__} of {len(x)}: (" + ", ".join(_describe(a) for a in x) + ")"
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
  return "None" if x is None else type(x).__name__


def causal_statistic_error(kernel: Kernel, query) -> ValueError:
  """The error for a data-dependent kernel used causally without its statistic."""
  need = kernel.statistic_shape(query.shape)
  return ValueError(
      f"{kernel.name} takes its statistic {kernel.statistic} from the whole sequence, which in causal "
      f"attention would let future keys shape past outputs; pass {kernel.statistic}= (shape broadcastable "
      f"to {need}, e.g. a running average kept by the layer) or use a data-independent kernel")

