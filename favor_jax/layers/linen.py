"""Linen ``FavorAttention``: Flax's multi-head attention with FAVOR inside.

Same constructor arguments and parameter tree as
``flax.linen.MultiHeadDotProductAttention`` (a softmax model's ``params`` load
unchanged), plus ``num_features``, ``kernel``, ``projection``, ``causal``.

Variables besides ``params``:
- ``favor``: ``projection`` [M, head_dim] and ``projection_kind`` (index into
  ``PROJECTIONS``), and for causal FAVOR++ a running ``rho`` [H]. Never
  trained; saved with checkpoints; replaced only by :func:`redraw`.
- ``cache`` (``decode=True``): the constant-size recurrent state.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import Mesh

from favor_jax import core, layers, parallel

__all__ = ["FavorAttention", "redraw"]


def redraw(variables, key, due=True):
  """New variables with every FavorAttention projection redrawn (independently per layer) where ``due``.

  Pure and jit-friendly: ``due`` may be traced (see ``layers.redraw_due``).
  """
  favor = variables.get("favor")
  if favor is None:
    raise ValueError("no 'favor' collection in variables: pass the full variables of a model with "
                     "FavorAttention layers (model.init(...) output), not only params")
  if variables.get("cache"):
    raise ValueError("variables hold a decode 'cache' built with the current projections; a redraw would "
                     "mix it with new features. Redraw the variables without 'cache' and build a new "
                     "cache afterwards (init with decode=True).")
  counter = [0]

  def visit(tree):
    if isinstance(tree, dict) and "projection" in tree and "projection_kind" in tree:
      old = tree["projection"]
      fresh = layers.draw_projection_by_index(
          jax.random.fold_in(key, counter[0]), tree["projection_kind"], *old.shape)
      counter[0] += 1
      return {**tree, "projection": jnp.where(due, fresh.astype(old.dtype), old)}
    if isinstance(tree, dict):
      return {k: visit(v) for k, v in sorted(tree.items())}
    return tree

  return {**variables, "favor": visit(dict(favor))}


class FavorAttention(nn.MultiHeadDotProductAttention):
  """Multi-head FAVOR attention (Choromanski et al. 2021) as a Linen module.

  Attributes beyond Flax's: ``num_features`` (M), ``kernel`` (a name in
  ``core.KERNELS``), ``projection`` ("orthogonal", "iid", "simplex"),
  ``causal``, ``chunk_size`` (causal chunks) and ``rho_momentum`` (running
  FAVOR++ statistic for causal layers, updated when ``deterministic=False``
  and the ``favor`` collection is mutable, and only *after* the step that
  used the old value, so no output depends on later tokens).
  """
  num_features: int = 256
  kernel: str = "positive"
  projection: str = "orthogonal"
  causal: bool = False
  chunk_size: int = 64
  rho_momentum: float = 0.99
  qk_transform: Callable[[Array, Array], tuple[Array, Array]] | None = None
  mesh: Mesh | None = None
  sequence_axis: str | None = None
  batch_axis: str | None = None

  def _check_config(self):
    if self.attention_fn is not nn.dot_product_attention:
      raise ValueError("FavorAttention computes its own attention; do not pass attention_fn")
    if self.qk_attn_weights_einsum_cls is not None or self.attn_weights_value_einsum_cls is not None:
      raise ValueError("attention-weight einsum classes do not apply to FAVOR attention")
    layers.check_favor_args(num_features=self.num_features, kernel=self.kernel, projection=self.projection,
                            causal=self.causal, decode=self.decode)
    if (self.mesh is None) != (self.sequence_axis is None):
      raise ValueError("sequence-parallel attention needs both mesh and sequence_axis (or neither)")
    if self.decode and self.sequence_axis is not None:
      raise ValueError("decode=True is token by token; it cannot be sequence-parallel (drop sequence_axis)")
    if self.decode and self.qk_transform is not None:
      raise ValueError("qk_transform with decode=True is not supported: the transform does not see "
                       "the positions of decoded tokens")

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, deterministic=None,
               dropout_rng=None, sow_weights=False):
    del dropout_rng
    self._check_config()
    if sow_weights:
      raise ValueError("sow_weights is not supported: FAVOR attention never forms attention weights")
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(f"qkv_features {qkv_features} must be divisible by num_heads {self.num_heads}")
    head_dim = qkv_features // self.num_heads
    dense = lambda name: nn.DenseGeneral(
        axis=-1, dtype=self.dtype, param_dtype=self.param_dtype, features=(self.num_heads, head_dim),
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision, dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls, name=name)
    query, key, value = dense("query")(inputs_q), dense("key")(inputs_k), dense("value")(inputs_v)
    if self.normalize_qk:
      ln = lambda name: nn.LayerNorm(name=name, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
      query, key = ln("query_ln")(query), ln("key_ln")(key)
    if self.qk_transform is not None:
      query, key = self.qk_transform(query, key)

    projection = self.variable(
        "favor", "projection",
        lambda: layers.draw_projection(self.make_rng("params"), self.projection, self.num_features, head_dim))
    self.variable("favor", "projection_kind",
                  lambda: jnp.asarray(layers.PROJECTIONS.index(self.projection), jnp.int32))
    if projection.value.shape != (self.num_features, head_dim):
      raise ValueError(f"favor/projection must have shape {(self.num_features, head_dim)}, "
                       f"got {projection.value.shape}")

    deterministic = True if deterministic is None and self.deterministic is None else (
        self.deterministic if deterministic is None else deterministic)
    layers.check_dropout(self.dropout_rate, deterministic)
    key_mask = layers.key_mask_from_flax(mask, key)
    rho = self._running_rho(query, key, key_mask, train=not deterministic)
    attend = dict(kernel=self.kernel, key_mask=key_mask, rho=rho, chunk_size=self.chunk_size)
    with layers.precision_scope(self.precision):
      if self.decode:
        x = self._decode(query, key, value, projection.value, attend)
      elif self.sequence_axis is not None:
        if rho is None and layers.is_data_dependent(self.kernel):
          attend["rho"] = core.oprf_rho(query, key, key_mask)  # the global statistic (XLA reduces it)
        x = parallel.sequence_parallel_attention(
            query, key, value, projection.value, mesh=self.mesh, axis_name=self.sequence_axis,
            batch_axis=self.batch_axis, causal=self.causal, **attend)
      else:
        x = core.favor_attention(query, key, value, projection.value, causal=self.causal, **attend)
    return nn.DenseGeneral(
        features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision, dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name="out")(x)

  def _running_rho(self, query, key, key_mask, train):
    """Causal FAVOR++: the running ρ as it was before this step (then updated if training)."""
    if not (self.causal and layers.is_data_dependent(self.kernel)):
      return None
    rho = self.variable("favor", "rho", jnp.zeros, (self.num_heads,), jnp.float32)
    used = rho.value
    if train and self.is_mutable_collection("favor") and not self.is_initializing():
      rho.value = layers.updated_rho(used, query, key, key_mask, self.rho_momentum)
    return used

  def _decode(self, query, key, value, projection, attend):
    initialized = self.has_variable("cache", "mu")
    empty = lambda: core.favor_decode_init(query[..., :1, :, :], value[..., :1, :, :], projection,
                                           kernel=self.kernel)
    mu = self.variable("cache", "mu", lambda: empty().mu)
    s = self.variable("cache", "s", lambda: empty().s)
    if not initialized:
      if not self.is_initializing():
        raise ValueError("decode=True needs the recurrent state: pass the 'cache' collection from "
                         "model.init(...) (with decode=True) in the variables, and mutable=['cache']")
      return core.favor_attention(query, key, value, projection, causal=True, **attend)
    state, x = core.favor_decode_step(core.RecurrentState(mu.value, s.value), query, key, value,
                                      projection, **attend)
    mu.value, s.value = state.mu, state.s
    return x
