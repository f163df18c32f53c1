"""The running statistic of a causal layer with a data-dependent kernel (FAVOR++'s ρ, FAVOR#'s Ψ)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from favor_jax import core
from favor_jax.core import precision as precision_lib


def statistic_of(kernel, query, key, key_mask, query_mask=None, precision=None):
  """``kernel``'s statistic of this batch, per batch element (over the unmasked keys and real queries); its
  dots at the layer's ``precision`` (checked: ``FavorSettings.precision``)."""
  with precision_lib.scope(precision):
    return core.get_kernel(kernel).compute_statistic(query, key, key_mask, query_mask)


def check_running_statistic(kernel, *, train: bool, decode: bool, mutable: bool = True) -> None:
  """A running statistic (FAVOR++'s ρ) is updated in training only where it can be: its collection mutable
  (Linen), and not while decoding (the cached states were built with the ρ before)."""
  if not train:
    return
  name = core.get_kernel(kernel).statistic
  if decode:
    raise ValueError(f"decoding with deterministic=False would update the running {name} of kernel {kernel!r} "
                     "from single tokens while the cache holds states built with the earlier one: decode with "
                     "deterministic=True (NNX: model.eval())")
  if not mutable:
    raise ValueError(f"deterministic=False updates the running {name} of kernel {kernel!r} in the 'favor' "
                     "collection, which this apply cannot change: pass mutable=['favor'] (or "
                     "deterministic=True to use it as it is)")


def initial_statistic(kernel, heads: int, qk_dim: int):
  """Zeros shaped like ``kernel``'s statistic of one sequence (FAVOR++'s ρ: [H]); zero ρ is FAVOR+."""
  return jnp.zeros(core.get_kernel(kernel).statistic_shape((1, 1, heads, qk_dim))[1:], jnp.float32)


def updated_statistic(kernel, running, query, key, key_mask, momentum: float, query_mask=None, precision=None):
  """Exponential moving average of ``kernel``'s statistic with this batch's mean one (no gradient; over the
  unmasked keys and the queries of ``query_mask``; ``precision`` as in :func:`statistic_of`).

  The kernel record computes the statistic per batch element; its mean over the batch elements that hold a
  real query and an unmasked key keeps the running value's shape (FAVOR++'s ρ: [H]). An element that is all
  padding has no statistic and is left out (it would pull the mean towards 0); a batch of such elements
  leaves the running value as it was.
  """
  batch_stat = jax.lax.stop_gradient(statistic_of(kernel, query, key, key_mask, query_mask, precision))
  batch = query.shape[:-3]
  batch_dims = tuple(range(len(batch)))
  present = lambda mask: jnp.ones(batch, bool) if mask is None else jnp.broadcast_to(jnp.any(mask, -1), batch)
  real_B = present(query_mask) & present(key_mask)
  count = jnp.sum(real_B)

  def step(old, new):
    real = real_B.reshape(batch + (1,) * (new.ndim - len(batch)))
    new = jnp.sum(jnp.where(real, new.astype(jnp.float32), 0.0), axis=batch_dims) / jnp.maximum(count, 1)
    if new.shape != old.shape:
      raise ValueError(f"the running statistic has shape {old.shape}, this batch's has {new.shape}")
    return jnp.where(count > 0, momentum * old + (1 - momentum) * new, old)

  return jax.tree.map(step, running, batch_stat)
