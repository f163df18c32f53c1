"""NNX ``FavorAttention``: ``flax.nnx.MultiHeadAttention`` with FAVOR inside.

Subclasses Flax's module, so constructor arguments and parameter names are
Flax's own; adds ``num_features``, ``kernel``, ``projection``, ``causal``.
The projection is a :class:`FavorProjection` variable (not an ``nnx.Param``:
optimizers built on ``nnx.Param`` never touch it; it is saved with the state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from favor_jax import core, layers

__all__ = ["FavorAttention", "FavorProjection", "FavorStats", "redraw"]


class FavorProjection(nnx.Variable):
  """The random projection ω [M, head_dim]: state, never a trainable parameter."""


class FavorStats(nnx.Variable):
  """Running FAVOR++ statistic ρ [H] of a causal layer."""


def redraw(model: nnx.Module, key, due=True) -> None:
  """Redraws, in place and independently per layer, every FavorAttention projection in ``model`` where ``due``.

  Works inside ``nnx.jit``; ``due`` may be traced (see ``layers.redraw_due``).
  """
  found = [m for _, m in nnx.iter_graph(model) if isinstance(m, FavorAttention)]
  if not found:
    raise ValueError("redraw found no FavorAttention layer in the model")
  for i, module in enumerate(found):
    module.redraw(jax.random.fold_in(key, i), due=due)


class FavorAttention(nnx.MultiHeadAttention):
  """Multi-head FAVOR attention (Choromanski et al. 2021) with Flax NNX's interface.

  ``decode=True`` with :meth:`init_cache` decodes in O(M·Dv) per token from a
  constant-size state. Causal FAVOR++ layers keep a running ρ, updated in
  training (``deterministic=False``) after the step that used the old value.
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, *, num_features: int = 256, kernel: str = "positive",
               projection: str = "orthogonal", causal: bool = False, chunk_size: int = 64,
               rho_momentum: float = 0.99, rngs: nnx.Rngs, **flax_kwargs):
    if "attention_fn" in flax_kwargs:
      raise ValueError("FavorAttention computes its own attention; do not pass attention_fn")
    if flax_kwargs.get("num_kv_heads") not in (None, num_heads):
      raise ValueError(f"FavorAttention needs num_kv_heads == num_heads ({num_heads}), "
                       f"got {flax_kwargs['num_kv_heads']}")
    layers.check_favor_args(num_features=num_features, kernel=kernel, projection=projection, causal=causal,
                            decode=flax_kwargs.get("decode", False))
    super().__init__(num_heads, in_features, qkv_features, out_features, rngs=rngs, **flax_kwargs)
    self.kernel = kernel
    self.projection_kind = projection
    self.causal = causal
    self.chunk_size = chunk_size
    self.rho_momentum = rho_momentum
    self.projection = FavorProjection(
        layers.draw_projection(rngs.params(), projection, num_features, self.head_dim))
    data_dependent = layers.is_data_dependent(kernel)
    self.rho = FavorStats(jnp.zeros((num_heads,), jnp.float32)) if causal and data_dependent else None
    self.cached_mu = self.cached_s = nnx.data(None)

  def redraw(self, key, due=True) -> None:
    """Sets a fresh projection drawn from ``key`` (kept as is where ``due`` is False).

    Not while a decode cache is held: its state was built with the current
    projection (call :meth:`clear_cache` first, then :meth:`init_cache` again).
    """
    if self.cached_s is not None:
      raise ValueError("this layer holds a decode cache built with its current projection; a redraw "
                       "would mix that state with new features. Call clear_cache() first, then "
                       "init_cache(...) again after the redraw.")
    old = self.projection[...]
    fresh = layers.draw_projection(key, self.projection_kind, *old.shape).astype(old.dtype)
    self.projection[...] = jnp.where(due, fresh, old)

  def init_cache(self, input_shape, dtype=jnp.float32) -> None:
    """Allocates the recurrent state for ``decode=True``; ``input_shape`` is [batch..., length, features]."""
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
      raise TypeError(f"init_cache dtype must be a floating-point dtype (the state is float32), got {dtype}")
    if len(input_shape) < 2:
      raise ValueError(f"input_shape must be [batch..., length, features], got {tuple(input_shape)}")
    batch = tuple(input_shape[:-2])
    q = jnp.zeros(batch + (1, self.num_heads, self.head_dim), dtype)
    state = core.favor_decode_init(q, q, self.projection[...], kernel=self.kernel)
    self.cached_mu, self.cached_s = nnx.Cache(state.mu), nnx.Cache(state.s)

  def clear_cache(self) -> None:
    """Drops the decode state (after which :meth:`redraw` is allowed)."""
    self.cached_mu = self.cached_s = nnx.data(None)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, deterministic=None,
               rngs=None, sow_weights=False, decode=None):
    del rngs
    if sow_weights:
      raise ValueError("sow_weights is not supported: FAVOR attention never forms attention weights")
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"inputs_q has {inputs_q.shape[-1]} features, the module expects {self.in_features}")
    query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)

    if deterministic is None:
      deterministic = True if self.deterministic is None else self.deterministic
    layers.check_dropout(self.dropout_rate, deterministic)
    key_mask = layers.key_mask_from_flax(mask, key)
    rho = None
    if self.rho is not None:
      rho = self.rho[...]
      if not deterministic:
        self.rho[...] = layers.updated_rho(rho, query, key, key_mask, self.rho_momentum)
    attend = dict(kernel=self.kernel, key_mask=key_mask, rho=rho, chunk_size=self.chunk_size)
    projection = self.projection[...]
    with layers.precision_scope(self.precision):
      if self.decode if decode is None else decode:
        if self.cached_s is None:
          raise ValueError("decode=True needs the recurrent state: call init_cache(input_shape) first")
        state = core.RecurrentState(self.cached_mu[...], self.cached_s[...])
        state, x = core.favor_decode_step(state, query, key, value, projection, **attend)
        self.cached_mu[...], self.cached_s[...] = state.mu, state.s
      else:
        x = core.favor_attention(query, key, value, projection, causal=self.causal, **attend)
    return self.out(x)
