"""Linen ``FavorAttention``: Flax's multi-head attention with FAVOR inside.

Same constructor arguments and parameter tree as
``flax.linen.MultiHeadDotProductAttention`` (a softmax model's ``params`` load
unchanged), plus ``num_features``, ``kernel``, ``projection``, ``causal``,
``per_head_projection``, ``window``, ``qk_head_dim`` and ``num_kv_heads``.

Variables besides ``params``:

- ``favor`` (kernels with a random projection): ``projection`` [M, D] or
  [H, M, D] and ``projection_kind`` (index into ``PROJECTIONS``), and for a
  causal data-dependent kernel (FAVOR++) its running statistic, named after the
  kernel's ``statistic`` (``rho`` [H]). Never trained; saved with checkpoints;
  the projection is replaced only by :func:`redraw`. Kernels without a
  projection (``taylor``, ``elu_plus_one``) store none.
- ``params/feature_map`` (learned kernels, ``hedgehog``): the trained map W,
  [H, D, D] (or [D, D] with ``per_head_projection=False``), the identity at init.
- ``cache`` (``decode=True``): the decode state's fields (``mu``, ``s``; with a
  ``window``, those of ``core.HybridState``), per key/value head where that is exact (grouped-query attention
  with keys whose features and gates are the same for a group's query heads: ``FavorSettings.kv_state``), else
  per query head; with a ``qk_transform``, also ``index`` (int32, the tokens decoded so far: the next token's
  position).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import FrozenDict
from jax import Array
from jax.sharding import Mesh

from favor_jax import core
from favor_jax.layers import gates, inputs, statistic
from favor_jax.layers.attend import attend
from favor_jax.layers.projection import layer_projection, redraw_projection
from favor_jax.layers.settings import PROJECTIONS, FavorSettings, check_num_kv_heads

__all__ = ["FavorAttention", "redraw"]


def redraw(variables, key, due=True):
  """Redraws every FavorAttention projection in ``variables`` (independently per layer) where ``due``.

  Per-head projections [H, M, D] get H independent draws. Layers stacked by ``nn.scan`` (their
  projections [layers..., M, D]) get one independent draw per layer. Learned feature maps
  (``params``) are never touched. Pure and jit-friendly.

  Args:
    variables: a model's full variables (``model.init(...)``'s output, with the ``favor`` collection), a
      dict or a ``FrozenDict``; no ``cache``.
    key: PRNG key; each layer draws from ``fold_in(key, layer index)``.
    due: bool, may be traced (e.g. :func:`favor_jax.layers.redraw_due`): False keeps the old projections.

  Returns:
    New variables of the same type (a ``FrozenDict`` stays one) with ``favor/.../projection`` redrawn,
    each in its old dtype and of its old kind (``projection_kind``).

  Raises:
    ValueError: if ``variables`` has no ``favor`` collection (only ``params``, or kernels without a random
      projection), or holds a decode ``cache`` built with the current projections.
  """
  favor = variables.get("favor")
  if favor is None:
    raise ValueError("no 'favor' collection in variables: pass the full variables of a model with "
                     "FavorAttention layers (model.init(...) output), not only params; layers whose kernel "
                     "has no random projection (taylor, hedgehog, elu_plus_one) have nothing to redraw")
  if variables.get("cache"):
    raise ValueError("variables hold a decode 'cache' built with the current projections; a redraw would "
                     "mix it with new features. Redraw the variables without 'cache' and build a new "
                     "cache afterwards (init with decode=True).")
  counter = [0]

  def visit(tree):
    if not isinstance(tree, Mapping):
      return tree
    if "projection" in tree and "projection_kind" in tree:
      old, kind = tree["projection"], tree["projection_kind"]
      layer_key = jax.random.fold_in(key, counter[0])
      counter[0] += 1
      stacked = jnp.shape(kind)  # nn.scan stacks a layer's variables: one independent draw per stacked layer
      draw = redraw_projection
      for _ in stacked:
        draw = jax.vmap(draw)
      if stacked:
        keys = jax.random.split(layer_key, math.prod(stacked))
        layer_key = keys.reshape(stacked + keys.shape[1:])
      out = {**tree, "projection": jnp.where(due, draw(layer_key, kind, old), old)}
    else:
      out = {k: visit(v) for k, v in sorted(tree.items())}
    return FrozenDict(out) if isinstance(tree, FrozenDict) else out

  out = {**variables, "favor": visit(favor)}
  return FrozenDict(out) if isinstance(variables, FrozenDict) else out


class FavorAttention(nn.MultiHeadDotProductAttention):
  """Multi-head FAVOR attention as a Linen module, a drop-in for ``nn.MultiHeadDotProductAttention``.

  Takes every attribute of ``flax.linen.MultiHeadDotProductAttention`` (but ``attention_fn`` and the
  attention-weight einsum classes, which it refuses) and the same parameter tree, plus those below. The
  settings are checked once per module instance (its first call), raising ValueError or TypeError naming
  the attribute. Flax's ``precision`` is that of every dot: the q/k/v/out projections and
  the attention core (``core.favor_attention``'s ``precision``; None: the backend's default).

  Attributes:
    num_features: M, the random projection's rows; None: 256. Refused by kernels without a random
      projection (``taylor``, ``elu_plus_one``, learned ``hedgehog``).
    kernel: a name in ``core.KERNELS`` or a :class:`~favor_jax.core.kernels.Kernel` record (or a callable given the
      projection).
    projection: ``"orthogonal"``, ``"iid"`` or ``"simplex"``; None: ``"orthogonal"``. Refused as
      ``num_features`` is.
    per_head_projection: True: [H, M, D], each head its own independent draw (or its own learned map).
      None: per head for learned kernels, shared otherwise.
    window: W ≥ 0; > 0: exact softmax for the keys within W positions and the kernel's estimate for the
      rest (``core.hybrid_attention``; Scatterbrain).
    qk_head_dim: query/key head dim when it differs from the value head dim (``qkv_features //
      num_heads``), as Based's Taylor layers (16) do.
    causal: causal attention.
    chunk_size: C, the chunk length of the causal pass.
    causal_method: as in ``core.favor_attention`` (``"auto"``: the fused Pallas kernels on a GPU where
      they apply, the XLA chunked pass elsewhere).
    rho_momentum: the running statistic's weight on its past, for a causal data-dependent kernel only
      (default ``layers.RHO_MOMENTUM``); updated when ``deterministic=False`` and the ``favor`` collection
      is mutable, and only *after* the step that used the old value, so no output depends on later tokens.
    qk_transform: ``(query, key) -> (query, key)`` applied to the [..., L, H, D] projections (after
      ``normalize_qk``) before the features, e.g. rotary embeddings. With ``decode=True`` it must also take
      ``positions`` ([l] int32, the new tokens' absolute indices, from the cache's ``index``); the full pass
      calls it without, for positions 0..L-1.
    num_kv_heads: grouped-query attention: the key and value heads (None: ``num_heads``), dividing
      ``num_heads``; query head h reads key/value head ``h // (num_heads // num_kv_heads)``. The ``key`` and
      ``value`` kernels are [features, num_kv_heads, head_dim]; the attention runs per query head. The decode
      state is kept per key/value head (1/group the bytes) where that is exact: a projection shared by all
      heads (or none), a kernel without a statistic of the data, and no ``forget_gate`` or ``alibi`` (both
      per query head); otherwise per query head (``kv_state`` says which, and why).
    mesh: a ``jax.sharding.Mesh`` for sequence-parallel attention
      (``parallel.sequence_parallel_attention``); not with decode or a window.
    sequence_axis: the mesh axis the sequence is split over (with ``mesh``).
    batch_axis: an optional mesh axis the batch is split over.
    forget_gate: causal only: a learned per-head forget gate f_l = σ(x_l·w_h + b_h) from the keys' input x
      (the layer's input in self-attention), the Forgetting Transformer's; ``params/forget_gate``
      (``kernel`` [features, H], zero at init; ``bias`` [H], ``layers.gates.FORGET_GATE_BIAS`` at init, so
      every gate starts at σ(5) ≈ 0.993).
    alibi: causal only: ALiBi's fixed per-head gate log f = −m_h (``core.alibi_slopes``). With both, the
      log gates add.
    control_variate: β of the hybrid's control variate (``core.hybrid_attention``), with a ``window`` only; 0:
      the plain hybrid. Decoding takes it too (``core.favor_decode_step``).

  References:
    Choromanski et al. 2021, "Rethinking Attention with Performers" (ICLR).
    Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate" (ICLR).
    Press et al. 2022, "Train Short, Test Long: Attention with Linear Biases Enables Input Length
    Extrapolation" (ICLR).
  """
  num_features: int | None = None
  kernel: str = "positive"
  projection: str | None = None
  per_head_projection: bool | None = None
  window: int = 0
  qk_head_dim: int | None = None
  causal: bool = False
  chunk_size: int = 64
  causal_method: str = "auto"
  rho_momentum: float | None = None
  qk_transform: Callable[[Array, Array], tuple[Array, Array]] | None = None
  mesh: Mesh | None = None
  sequence_axis: str | None = None
  batch_axis: str | None = None
  forget_gate: bool = False
  alibi: bool = False
  num_kv_heads: int | None = None
  control_variate: float = 0.0

  @functools.cached_property
  def settings(self) -> FavorSettings:
    """The layer's settings, checked once per module instance (its first call; Flax clones the module for
    each ``init``/``apply``, a new instance), never per call."""
    if self.attention_fn is not nn.dot_product_attention:
      raise ValueError("FavorAttention computes its own attention; do not pass attention_fn")
    if self.qk_attn_weights_einsum_cls is not None or self.attn_weights_value_einsum_cls is not None:
      raise ValueError("attention-weight einsum classes do not apply to FAVOR attention")
    check_num_kv_heads(self.num_kv_heads, self.num_heads)
    return FavorSettings.build(
        kernel=self.kernel, num_features=self.num_features, projection=self.projection,
        per_head_projection=self.per_head_projection, causal=self.causal, causal_method=self.causal_method,
        chunk_size=self.chunk_size, window=self.window, qk_head_dim=self.qk_head_dim,
        rho_momentum=self.rho_momentum, decode=self.decode, qk_transform=self.qk_transform, mesh=self.mesh,
        sequence_axis=self.sequence_axis, batch_axis=self.batch_axis, forget_gate=self.forget_gate,
        alibi=self.alibi, precision=self.precision, control_variate=self.control_variate)

  @functools.cached_property
  def kv_state(self) -> tuple[bool, str]:
    """(exact, reason): whether decoding keeps one state per key/value head (``FavorSettings.kv_state``), checked
    once per module instance, as :attr:`settings` is."""
    return self.settings.kv_state(self.num_heads, self.num_kv_heads)

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, deterministic=None,
               dropout_rng=None, sow_weights=False, query_mask=None, segment_ids=None):
    """Applies FAVOR attention to the inputs, projected as ``nn.MultiHeadDotProductAttention`` does.

    Args:
      inputs_q: query inputs, [batch..., Lq, features].
      inputs_k: key inputs, [batch..., Lk, features]; None: ``inputs_q``.
      inputs_v: value inputs, [batch..., Lk, features]; None: ``inputs_k``.
      mask: Flax's attention mask, key padding only ([batch..., 1, 1, Lk] broadcastable); None: no padding.
      deterministic: as in Flax; False (training) also updates a causal data-dependent kernel's running
        statistic.
      dropout_rng: ignored (attention dropout is refused).
      sow_weights: must be False (FAVOR forms no attention weights).
      query_mask: optional bool [batch..., Lq], False for a padded query, which FAVOR++'s and FAVOR#'s
        statistic leaves out. In self-attention it defaults to the key padding; pass it in padded
        cross-attention.
      segment_ids: optional int [batch..., L], packed documents: a segment is a run of equal consecutive
        ids, and no pair crosses one (padding stays ``mask``). Decoding starts afresh at a token whose id
        differs from the one before it.

    Returns:
      The output, [batch..., Lq, out_features] (``out_features`` or the inputs' features).

    Raises:
      ValueError: for ``sow_weights``, a mask that is not key padding, ``qkv_features`` not divisible by
        ``num_heads``, ``num_kv_heads`` not dividing ``num_heads``, attention dropout while training, a stored
        projection or feature map of the wrong shape, a decode call without (or with the wrong kind of)
        ``cache``, or invalid settings.
      TypeError: for inputs or settings of the wrong type (as the input and settings checks raise).
    """
    del dropout_rng
    settings = self.settings
    if sow_weights:
      raise ValueError("sow_weights is not supported: FAVOR attention never forms attention weights")
    inputs_q, inputs_k, inputs_v = inputs.check_inputs(inputs_q, inputs_k, inputs_v)
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(f"qkv_features {qkv_features} must be divisible by num_heads {self.num_heads}")
    head_dim = qkv_features // self.num_heads
    qk_dim = self.qk_head_dim or head_dim
    kv_heads = self.num_kv_heads or self.num_heads
    dense = lambda name, dim, heads=self.num_heads: nn.DenseGeneral(
        axis=-1, dtype=self.dtype, param_dtype=self.param_dtype, features=(heads, dim),
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision, dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls, name=name)
    query, key = dense("query", qk_dim)(inputs_q), dense("key", qk_dim, kv_heads)(inputs_k)
    value = dense("value", head_dim, kv_heads)(inputs_v)
    if self.normalize_qk:
      ln = lambda name: nn.LayerNorm(name=name, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
      query, key = ln("query_ln")(query), ln("key_ln")(key)
    positions = self._positions(query.shape[-3]) if self.decode and self.qk_transform is not None else None
    query, key = inputs.transform_qk(self.qk_transform, query, key, positions)
    grouped = (key, value) if self.decode and self.kv_state[0] else None  # a state per key/value head
    key, value = inputs.repeat_kv_heads(key, value, self.num_heads)
    projection = self._projection(settings, qk_dim)
    logit = None
    if settings.forget_gate:
      kernel_init, bias_init = gates.forget_gate_init()
      logit = nn.DenseGeneral(features=self.num_heads, axis=-1, dtype=jnp.float32, param_dtype=self.param_dtype,
                              kernel_init=kernel_init, bias_init=bias_init, precision=self.precision,
                              name="forget_gate")(inputs_k)
    log_gate = gates.layer_log_gate(logit, settings.alibi, key.shape[:-1])

    deterministic = inputs.resolve_deterministic(self.dropout_rate, self.deterministic, deterministic)
    key_mask, query_mask = inputs.padding_masks(mask, inputs_q, inputs_k, key, query_mask, query)
    rho = self._running_statistic(settings, query, key, key_mask, query_mask, train=not deterministic)
    if self.decode:
      key, value = grouped or (key, value)
      x = self._decode(settings, query, key, value, projection, key_mask, rho, log_gate, segment_ids)
    else:
      x = attend(query, key, value, projection, settings, key_mask=key_mask, query_mask=query_mask, rho=rho,
                 log_gate=log_gate, segment_ids=segment_ids)
    return nn.DenseGeneral(
        features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision, dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name="out")(x)

  def _projection(self, settings, qk_dim):
    """The drawn ``favor/projection``, the trained ``params/feature_map``, or None (kernel without one)."""
    role = settings.role
    if role == "none":
      return None
    lead = (self.num_heads,) if settings.per_head else ()
    initial = lambda rng: layer_projection(rng, settings, self.num_heads, qk_dim)
    if role == "learned":
      want, name = lead + (qk_dim, qk_dim), "params/feature_map"
      if self.has_variable("params", "feature_map"):  # checked here: Flax's own check names no argument
        self._check_shape(name, self.get_variable("params", "feature_map"), want)
      value = self.param("feature_map", lambda rng: initial(rng).astype(self.param_dtype))
    else:
      value = self.variable("favor", "projection", lambda: initial(self.make_rng("params"))).value
      self.variable("favor", "projection_kind",
                    lambda: jnp.asarray(PROJECTIONS.index(settings.projection_kind), jnp.int32))
      want, name = lead + (settings.features, qk_dim), "favor/projection"
    self._check_shape(name, value, want)
    return value

  def _check_shape(self, name, value, want):
    if value.shape != want:
      raise ValueError(f"{name} must have shape {want}, got {value.shape} (num_heads={self.num_heads}, "
                       f"kernel={self.kernel!r}, per_head_projection={self.per_head_projection})")

  def _running_statistic(self, settings, query, key, key_mask, query_mask, train):
    """Causal data-dependent kernels: the running statistic as it was before this step (then updated
    if training). Named after the kernel's ``statistic`` (FAVOR++: ``rho`` [H])."""
    if not settings.keeps_statistic:
      return None
    kern = core.get_kernel(self.kernel)
    stat = self.variable("favor", kern.statistic, statistic.initial_statistic, self.kernel, *query.shape[-2:])
    used = stat.value
    if self.is_initializing():
      return used
    statistic.check_running_statistic(self.kernel, train=train, decode=self.decode,
                                      mutable=self.is_mutable_collection("favor"))
    if train:
      stat.value = statistic.updated_statistic(self.kernel, used, query, key, key_mask, settings.rho_momentum,
                                               query_mask, settings.precision)
    return used

  def _positions(self, length):
    """Decoding with a ``qk_transform``: the new tokens' positions [length] from ``cache/index`` (then moved
    on by ``length``; at init: 0..length-1, the index left at 0)."""
    if not self.is_initializing() and not self.has_variable("cache", "index"):
      raise ValueError("decode=True with a qk_transform needs the decode position: pass the 'cache' collection "
                       "from model.init(...) of this model (decode=True; it holds 'index'), and mutable=['cache']")
    index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    positions = index.value + jnp.arange(length, dtype=jnp.int32)
    if not self.is_initializing():
      index.value = index.value + length
    return positions

  def _decode(self, settings, query, key, value, projection, key_mask, rho, log_gate, segment_ids):
    empty = lambda: core.favor_decode_init(query[..., :1, :, :], value[..., :1, :, :], projection,
                                           kernel=self.kernel, window=self.window)
    state_type = type(jax.eval_shape(empty))  # RecurrentState, or HybridState with a window
    fields = state_type._fields
    if not self.has_variable("cache", fields[0]):
      if not self.is_initializing():
        other = [name for name in ("mu", "keys") if self.has_variable("cache", name)]
        if other:  # a cache of the other kind: RecurrentState (window=0) vs HybridState (window > 0)
          raise ValueError(f"the 'cache' collection holds a {'window=0' if other[0] == 'mu' else 'window > 0'} "
                           f"state ({other[0]!r}), but this layer has window={self.window} (fields {fields}): "
                           "build the cache with model.init(...) of this model (decode=True)")
        raise ValueError("decode=True needs the recurrent state: pass the 'cache' collection from "
                         "model.init(...) (with decode=True) in the variables, and mutable=['cache']")
      state = empty()
      for name in fields:
        self.variable("cache", name, lambda name=name: getattr(state, name))
      return attend(query, *inputs.repeat_kv_heads(key, value, self.num_heads), projection, settings,
                    key_mask=key_mask, rho=rho, log_gate=log_gate, segment_ids=segment_ids)
    cache = [self.variable("cache", name) for name in fields]
    state = state_type(*(c.value for c in cache))
    state, x = core.favor_decode_step(state, query, key, value, projection, kernel=self.kernel, key_mask=key_mask,
                                      rho=rho, chunk_size=self.chunk_size, window=self.window,
                                      precision=settings.precision, control_variate=settings.control_variate,
                                      **gates.gate_kwargs(log_gate, segment_ids))
    for c, new in zip(cache, state):
      c.value = new
    return x
