"""Learned maps of a FAVOR layer's q, k before its features (the training model's ``attention.qk_map``)."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from favor_jax.layers import linen as favor_linen

# attention.qk_map: FAVOR's q, k before the features: as projected, RFA's unit-norm q, k with a learned per-head
# temperature, or a learned per-head [D, D] map (the identity at init); see QKMap.
QK_MAPS = ("none", "bounded", "learned")
TEMPERATURE_INIT = 4.0  # "bounded": each head's temperature τ at init (its logits lie in [−τ, τ])


class QKMap(nn.Module):
  """A learned per-head map of a FAVOR layer's q, k [..., L, H, D] before its features (``attention.qk_map``).

  ``"bounded"`` (Random Feature Attention, Peng et al. 2021): q ← d^{1/4}·√τ_h·q/‖q‖, k likewise, so the logit
  q·k/√d = τ_h·cos(q, k) lies in [−τ_h, τ_h], τ_h = exp(``log_temperature``_h) learned (``TEMPERATURE_INIT`` at
  init). The positive features stay an unbiased estimate of exp(τ_h·cos(q, k)), the gated softmax of the
  bounded logits, and ‖x + y‖² ≤ 4τ_h bounds one feature pair's relative variance by (e^{4τ_h} − 1)/M.

  ``"learned"``: q ← A_h q, k ← A_h k, with A_h [D, D] per head, the identity at init (``map``): the features
  estimate exp(qᵀA_hᵀA_h k/√d) without bias, a learned bilinear softmax logit; training may shrink the norms
  (and so the variance) in directions the task does not need. ``qk_transform`` (e.g. rotary) runs first.
  """
  kind: str
  qk_transform: object = None  # (query, key[, positions]) -> (query, key), applied first (None: none)

  @nn.compact
  def __call__(self, query, key, positions=None):
    if self.qk_transform is not None:
      query, key = (self.qk_transform(query, key) if positions is None
                    else self.qk_transform(query, key, positions=positions))
    heads, dim = query.shape[-2:]
    if self.kind == "bounded":
      log_t = self.param("log_temperature", nn.initializers.constant(math.log(TEMPERATURE_INIT)), (heads,))
      scale = dim ** 0.25 * jnp.exp(0.5 * log_t)[:, None]  # [H, 1]
      unit = lambda x: x * jax.lax.rsqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-12)
      return (unit(query) * scale).astype(query.dtype), (unit(key) * scale).astype(key.dtype)
    if self.kind == "learned":
      a_HDD = self.param("map", lambda _, shape: jnp.broadcast_to(jnp.eye(dim), shape), (heads, dim, dim))
      apply = lambda x: jnp.einsum("...hd,hed->...he", x, a_HDD.astype(x.dtype))
      return apply(query), apply(key)
    raise ValueError(f"attention.qk_map must be one of {QK_MAPS}, got {self.kind!r}")


class MappedFavorAttention(nn.Module):
  """``FavorAttention`` whose q, k pass a :class:`QKMap` (its parameters under ``qk_map``, the layer's under
  ``favor``) before the features and the exact window alike."""
  attention: object  # the model's ``models.AttentionSpec`` (its ``favor`` settings, ``qk_map``, ``num_kv_heads``)
  num_heads: int
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BLD, mask=None, deterministic=True, segment_ids=None):
    fields = {f.name: getattr(self.attention.favor, f.name) for f in dataclasses.fields(self.attention.favor)}
    fields["qk_transform"] = QKMap(self.attention.qk_map, fields["qk_transform"], name="qk_map")
    layer = favor_linen.FavorAttention(num_heads=self.num_heads, num_kv_heads=self.attention.num_kv_heads,
                                       name="favor", dtype=self.dtype, param_dtype=self.param_dtype, **fields)
    packed = {} if segment_ids is None else {"segment_ids": segment_ids}
    return layer(x_BLD, mask=mask, deterministic=deterministic, **packed)
