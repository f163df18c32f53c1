"""A layer's projection: the initial draw (or a learned kernel's identity map), redraws and their schedule."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from favor_jax import core
from favor_jax.layers.settings import FavorSettings

draw_projection = core.draw_projection
draw_projection_by_index = core.draw_projection_by_index


def layer_projection(key, settings: FavorSettings, heads: int, qk_dim: int):
  """The initial projection a layer of ``settings`` stores (None if it uses none).

  Random kernels: [M, D], or [H, M, D] with each head an independent draw.
  Learned kernels: the identity, [D, D] or [H, D, D].
  """
  role = settings.role
  if role == "none":
    return None
  lead = (heads,) if settings.per_head else ()
  if role == "learned":
    return jnp.broadcast_to(jnp.eye(qk_dim, dtype=jnp.float32), lead + (qk_dim, qk_dim))
  draw = lambda k: draw_projection(k, settings.projection_kind, settings.features, qk_dim)
  return _per_head_draws(draw, key, lead)


def _per_head_draws(draw, key, lead):
  return draw(key) if not lead else jax.vmap(draw)(jax.random.split(key, lead[0]))


def redraw_projection(key, kind, old):
  """A fresh projection shaped like ``old`` ([M, D], or [H, M, D]: H independent draws) in ``old``'s dtype.

  ``kind``: a name in ``PROJECTIONS``, or its index there (may be traced).
  """
  if old.ndim not in (2, 3):
    raise ValueError(f"a stored projection must have shape [M, D] or [H, M, D], got {old.shape}")
  by = draw_projection if isinstance(kind, str) else draw_projection_by_index
  draw = lambda k: by(k, kind, *old.shape[-2:])
  return _per_head_draws(draw, key, old.shape[:-2]).astype(old.dtype)


def redraw_due(step, every: int):
  """True on the steps where an ``every``-step redraw schedule draws new features (never if 0).

  Works on a traced ``step``, so a jitted train step compiles once.
  """
  if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 0:
    raise ValueError(f"redraw every must be a non-negative int, got {every!r}")
  if every == 0:
    return jnp.asarray(False)
  return (jnp.asarray(step) % every) == 0
