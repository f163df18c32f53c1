"""Flax wrappers over :mod:`favor_jax.core`: no math of their own.

- :func:`make_attention_fn` — a drop-in ``attention_fn`` for
  ``flax.linen.MultiHeadDotProductAttention`` and ``flax.nnx.MultiHeadAttention``.
- :mod:`favor_jax.layers.linen` / :mod:`favor_jax.layers.nnx` — ``FavorAttention``
  modules that own their projection (random, per head, or a learned feature
  map), redraw it and decode token by token, optionally with an exact local window.
- :func:`distillation_loss` — Hedgehog's loss fitting a learned feature map to
  softmax's attention weights (converting a trained softmax model).

What a layer keeps for a kernel is read off its ``core.KERNELS`` record: a
random projection (``favor`` collection, redrawable), a learned ``feature_map``
(``params``, ``Kernel.learned``) or nothing (``needs_projection=False``).

Inside: ``settings`` (:class:`FavorSettings`, checked once when built), ``projection`` (draws, redraws),
``statistic`` (FAVOR++'s/FAVOR#'s running statistic), ``inputs`` (Flax's masks and arguments),
``attend`` (the one call into core), ``adapter`` and ``distillation``.
"""

from favor_jax.layers.adapter import make_attention_fn
from favor_jax.layers.distillation import distillation_loss
from favor_jax.layers.projection import draw_projection, redraw_due

# Beside __all__: the settings record, what a kernel keeps and the defaults (for the experiments and the docs).
from favor_jax.layers.settings import DEFAULT_NUM_FEATURES as DEFAULT_NUM_FEATURES
from favor_jax.layers.settings import DEFAULT_PROJECTION as DEFAULT_PROJECTION
from favor_jax.layers.settings import PROJECTIONS
from favor_jax.layers.settings import RHO_MOMENTUM as RHO_MOMENTUM
from favor_jax.layers.settings import FavorSettings as FavorSettings
from favor_jax.layers.settings import projection_role as projection_role

__all__ = ["make_attention_fn", "draw_projection", "redraw_due", "distillation_loss", "PROJECTIONS"]
