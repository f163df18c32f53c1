"""NNX ``FavorAttention``: ``flax.nnx.MultiHeadAttention`` with FAVOR inside.

Subclasses Flax's module, so constructor arguments and parameter names are
Flax's own; adds ``num_features``, ``kernel``, ``projection``,
``per_head_projection``, ``window``, ``qk_head_dim``, ``causal``, ``qk_transform`` and the mesh (and takes Flax's
``num_kv_heads``, grouped-query attention); its call
adds ``query_mask`` [batch..., Lq] (False: a padded query, left out of FAVOR++'s and FAVOR#'s statistic;
self-attention: the key padding of ``mask``; give it in padded cross-attention).
A random projection is a :class:`FavorProjection` variable (not an
``nnx.Param``: optimizers built on ``nnx.Param`` never touch it; it is saved
with the state). A learned kernel's map (``hedgehog``) is the ``nnx.Param``
``feature_map``, initialised to the identity; kernels without a projection
(``taylor``, ``elu_plus_one``) store none.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.attention import default_kernel_init
from jax.sharding import Mesh

from favor_jax import core
from favor_jax.layers import gates, inputs, statistic
from favor_jax.layers.attend import attend
from favor_jax.layers.projection import layer_projection, redraw_projection
from favor_jax.layers.settings import FavorSettings, check_num_kv_heads

__all__ = ["FavorAttention", "FavorProjection", "FavorStats", "redraw"]


class FavorProjection(nnx.Variable):
  """The random projection ω of a FavorAttention layer: state, never a trainable parameter.

  Optimizers built on ``nnx.Param`` never touch it; it is saved with the model's state.

  Args:
    value: ω, [M, D] shared by the heads or [H, M, D] one per head (D: the query/key head dim).
  """


class FavorStats(nnx.Variable):
  """The running statistic of a causal data-dependent kernel, updated in training.

  Args:
    value: FAVOR++'s ρ [H], or FAVOR#'s [H, D+1] (log Ψ, then ρ).
  """


def redraw(model: nnx.Module, key, due=True) -> None:
  """Redraws, in place and independently per layer, every FavorAttention projection in ``model`` where ``due``.

  Layers without a random projection (learned or fixed feature maps) are left as they are. Works inside
  ``nnx.jit``.

  Args:
    model: an NNX module holding FavorAttention layers.
    key: PRNG key; layer i draws from ``fold_in(key, i)``.
    due: bool, may be traced (e.g. :func:`favor_jax.layers.redraw_due`): False keeps the old projections.

  Returns:
    None; the projections are replaced in place.

  Raises:
    ValueError: if ``model`` has no FavorAttention layer, none with a random projection, or one holding a
      decode cache (checked before any layer changes).
  """
  found = [m for _, m in nnx.iter_graph(model) if isinstance(m, FavorAttention)]
  if not found:
    raise ValueError("redraw found no FavorAttention layer in the model")
  random = [m for m in found if m.projection is not None]
  if not random:
    raise ValueError(f"redraw found no FavorAttention layer with a random projection: kernels "
                     f"{sorted({m.kernel for m in found})} have nothing to redraw")
  if any(m.decode_state is not None for m in random):  # checked before any layer changes
    raise ValueError("a layer holds a decode cache built with its current projection; a redraw would mix "
                     "that state with new features. Call clear_cache() on the model first, then "
                     "init_cache(...) again after the redraw.")
  for i, module in enumerate(random):
    module.redraw(jax.random.fold_in(key, i), due=due)


class FavorAttention(nnx.MultiHeadAttention):
  """Multi-head FAVOR attention with Flax NNX's interface, a drop-in for ``nnx.MultiHeadAttention``.

  ``decode=True`` with :meth:`init_cache` decodes token by token from a constant-size state (plus the last
  ``window`` keys and values). Causal data-dependent layers (FAVOR++, FAVOR#) keep a running statistic
  (:class:`FavorStats`), updated in training (``deterministic=False``) after the step that used the old
  value, so no output depends on later tokens.

  Args:
    num_heads: H, as in ``nnx.MultiHeadAttention``.
    in_features: the inputs' features, as in ``nnx.MultiHeadAttention``.
    qkv_features: as in ``nnx.MultiHeadAttention`` (None: ``in_features``).
    out_features: as in ``nnx.MultiHeadAttention`` (None: ``in_features``).
    num_features: M, the random projection's rows; None: 256. Refused by kernels without a random
      projection (``taylor``, ``elu_plus_one``, learned ``hedgehog``).
    kernel: a name in ``core.KERNELS`` or a :class:`~favor_jax.core.kernels.Kernel` record.
    projection: ``"orthogonal"``, ``"iid"`` or ``"simplex"``; None: ``"orthogonal"``. Refused as
      ``num_features`` is.
    per_head_projection: True: [H, M, D], each head an independent draw (None: per head for learned
      kernels only).
    window: W ≥ 0; > 0: exact softmax within the window plus the kernel's estimate elsewhere
      (``core.hybrid_attention``).
    qk_head_dim: query/key head dim, when it differs from the value's.
    causal: causal attention (fixed at construction).
    chunk_size: C, the chunk length of the causal pass.
    causal_method: as in ``core.favor_attention``.
    rho_momentum: the running statistic's weight on its past, for a causal data-dependent kernel only
      (None: ``layers.RHO_MOMENTUM`` there).
    mesh: a ``jax.sharding.Mesh`` for sequence-parallel attention
      (``parallel.sequence_parallel_attention``); not with decode or a window.
    sequence_axis: the mesh axis the sequence is split over (with ``mesh``).
    batch_axis: an optional mesh axis the batch is split over.
    qk_transform: ``(query, key) -> (query, key)`` applied to the [..., L, H, D] projections (after
      ``normalize_qk``) before the features, e.g. rotary embeddings. To decode it must also take
      ``positions`` ([l] int32, the new tokens' absolute indices, counted by the cache); the full pass calls
      it without, for positions 0..L-1.
    forget_gate: causal only: a learned per-head gate f_l = σ(x_l·w_h + b_h) from the keys' input (FoX),
      the ``nnx.Linear`` ``forget_gate`` (weight zero, bias ``layers.gates.FORGET_GATE_BIAS`` at init).
    alibi: causal only: ALiBi's fixed gate log f = −m_h (``core.alibi_slopes``); with ``forget_gate``, the
      log gates add.
    control_variate: β of the hybrid's control variate (``core.hybrid_attention``), with a ``window`` only; 0:
      the plain hybrid. Decoding takes it too (``core.favor_decode_step``).
    rngs: ``nnx.Rngs`` for the parameters and the projection's draw.
    **flax_kwargs: the other arguments of ``nnx.MultiHeadAttention`` (``decode``, ``dropout_rate``,
      ``normalize_qk``, initialisers, dtypes, ``precision`` (of every dot: the projections and the attention
      core, as ``core.favor_attention``'s), ``num_kv_heads``, ...), but ``attention_fn``. ``num_kv_heads``
      (grouped-query attention) must divide ``num_heads``: query head h reads key/value head
      ``h // (num_heads // num_kv_heads)``, as in Flax; the attention runs per query head. The decode state is
      kept per key/value head (1/group the bytes) where that is exact — a projection shared by all heads (or
      none), a kernel without a statistic of the data, no ``forget_gate`` or ``alibi`` (both per query head) —
      and per query head otherwise; ``kv_state`` (set at construction) says which, and why.

  Raises:
    ValueError: for ``attention_fn``, a ``num_kv_heads`` that does not divide ``num_heads``, or an invalid
      setting (named).
    TypeError: for a setting of the wrong type (e.g. a non-callable ``qk_transform``, a non-bool ``causal``).

  References:
    Choromanski et al. 2021, "Rethinking Attention with Performers" (ICLR).
    Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate" (ICLR).
    Press et al. 2022, "Train Short, Test Long: Attention with Linear Biases Enables Input Length
    Extrapolation" (ICLR).
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, *, num_features: int | None = None, kernel: str = "positive",
               projection: str | None = None, per_head_projection: bool | None = None, window: int = 0,
               qk_head_dim: int | None = None, causal: bool = False, chunk_size: int = 64,
               causal_method: str = "auto", rho_momentum: float | None = None, mesh: Mesh | None = None,
               sequence_axis: str | None = None, batch_axis: str | None = None, qk_transform=None,
               forget_gate: bool = False, alibi: bool = False, control_variate: float = 0.0, rngs: nnx.Rngs,
               **flax_kwargs):
    if "attention_fn" in flax_kwargs:
      raise ValueError("FavorAttention computes its own attention; do not pass attention_fn")
    check_num_kv_heads(flax_kwargs.get("num_kv_heads"), num_heads)
    settings = FavorSettings.build(
        kernel=kernel, num_features=num_features, projection=projection, per_head_projection=per_head_projection,
        causal=causal, causal_method=causal_method, chunk_size=chunk_size, window=window, qk_head_dim=qk_head_dim,
        rho_momentum=rho_momentum, decode=flax_kwargs.get("decode", False), qk_transform=qk_transform, mesh=mesh,
        sequence_axis=sequence_axis, batch_axis=batch_axis, forget_gate=forget_gate, alibi=alibi,
        precision=flax_kwargs.get("precision"), control_variate=control_variate)
    super().__init__(num_heads, in_features, qkv_features, out_features, rngs=rngs, **flax_kwargs)
    self.settings = settings
    self.kv_state = settings.kv_state(num_heads, flax_kwargs.get("num_kv_heads"))  # (exact, why not), checked once
    self.kernel = kernel
    self.projection_kind = settings.projection_kind
    self.window = window
    self.control_variate = settings.control_variate
    self.causal = causal
    self.chunk_size = chunk_size
    self.causal_method = causal_method
    self.rho_momentum = settings.rho_momentum  # None: the layer keeps no running statistic
    self.mesh, self.sequence_axis, self.batch_axis = mesh, sequence_axis, batch_axis
    self.qk_transform = qk_transform
    self.qk_head_dim = qk_head_dim or self.head_dim
    if self.qk_head_dim != self.head_dim:
      self._rebuild_query_key(flax_kwargs, rngs)
    initial = layer_projection(rngs.params(), settings, num_heads, self.qk_head_dim)
    learned = settings.role == "learned"
    self.projection = FavorProjection(initial) if initial is not None and not learned else nnx.data(None)
    self.projection_shape = None if initial is None else tuple(initial.shape)
    self.feature_map = nnx.Param(initial.astype(self.param_dtype)) if learned else nnx.data(None)
    self.statistic = (FavorStats(statistic.initial_statistic(kernel, num_heads, self.qk_head_dim))
                      if settings.keeps_statistic else nnx.data(None))
    self.decode_state = nnx.data(None)
    self.decode_index = nnx.data(None)  # with a qk_transform: the next decoded token's position (init_cache)
    kernel_init, bias_init = gates.forget_gate_init(self.param_dtype)
    self.forget_gate = (nnx.Linear(self.in_kv_features, num_heads, kernel_init=kernel_init, bias_init=bias_init,
                                   param_dtype=self.param_dtype, precision=self.precision, rngs=rngs)
                        if forget_gate else nnx.data(None))

  def _rebuild_query_key(self, flax_kwargs, rngs) -> None:
    """Query and key maps (and their LayerNorms) to ``qk_head_dim`` per head instead of the value's."""
    linear = lambda in_features, heads=self.num_heads: nnx.LinearGeneral(
        in_features, (heads, self.qk_head_dim), dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=flax_kwargs.get("kernel_init", default_kernel_init),
        bias_init=flax_kwargs.get("bias_init", nnx.initializers.zeros_init()), use_bias=self.use_bias,
        precision=self.precision, promote_dtype=self.qkv_promote_dtype, dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls, rngs=rngs,
        **{k: flax_kwargs[k] for k in ("kernel_metadata", "bias_metadata") if k in flax_kwargs})
    self.query, self.key = linear(self.in_features), linear(self.in_kv_features, self.num_kv_heads)
    if self.normalize_qk:
      ln = lambda meta: nnx.LayerNorm(self.qk_head_dim, use_bias=False, dtype=self.dtype,
                                      param_dtype=self.param_dtype, promote_dtype=self.ln_promote_dtype,
                                      scale_metadata=flax_kwargs.get(meta, {}), rngs=rngs)
      self.query_ln, self.key_ln = ln("query_ln_scale_metadata"), ln("key_ln_scale_metadata")

  def _projection(self):
    """What the core functions get: the random projection, the learned map, or None."""
    for var in (self.projection, self.feature_map):
      if var is not None:
        return var[...]
    return None

  def redraw(self, key, due=True) -> None:
    """Sets a fresh projection drawn from ``key`` (kept as is where ``due`` is False).

    Per-head projections get one independent draw per head. Not while a decode cache is held: its state
    was built with the current projection (call :meth:`clear_cache` first, then :meth:`init_cache` again).

    Args:
      key: PRNG key.
      due: bool, may be traced: False keeps the old projection.

    Raises:
      ValueError: if the layer has no random projection, holds a decode cache, or its projection's shape
        was changed.
    """
    if self.projection is None:
      raise ValueError(f"kernel {self.kernel!r} has no random projection to redraw"
                       + (" (its feature_map is trained)" if self.feature_map is not None else ""))
    if self.decode_state is not None:
      raise ValueError("this layer holds a decode cache built with its current projection; a redraw "
                       "would mix that state with new features. Call clear_cache() first, then "
                       "init_cache(...) again after the redraw.")
    old = self.projection[...]
    if old.shape != self.projection_shape:
      raise ValueError(f"projection must have shape {self.projection_shape} (per_head_projection="
                       f"{len(self.projection_shape) == 3}), got {old.shape}; set it back or build a new layer")
    fresh = redraw_projection(key, self.projection_kind, old)
    self.projection[...] = jnp.where(due, fresh, old)

  def init_cache(self, input_shape, dtype=jnp.float32) -> None:
    """Allocates the decode state for ``decode=True``.

    Args:
      input_shape: the inputs' shape, [batch..., length, features] (the state is sized for its batch).
      dtype: a floating dtype for the sizing inputs (the state itself is float32).

    Raises:
      TypeError: if ``dtype`` is not floating.
      ValueError: if ``input_shape`` has fewer than 2 dims, or the layer is not causal.
    """
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
      raise TypeError(f"init_cache dtype must be a floating-point dtype (the state is float32), got {dtype}")
    if len(input_shape) < 2:
      raise ValueError(f"input_shape must be [batch..., length, features], got {tuple(input_shape)}")
    if not self.causal:
      raise ValueError("init_cache: decoding needs causal=True (it is autoregressive)")
    batch = tuple(input_shape[:-2])
    q = jnp.zeros(batch + (1, self.num_heads, self.qk_head_dim), dtype)
    heads = self.num_kv_heads if self.kv_state[0] else self.num_heads  # a state per key/value head where exact
    v = jnp.zeros(batch + (1, heads, self.head_dim), dtype)
    state = core.favor_decode_init(q, v, self._projection(), kernel=self.kernel, window=self.window)
    self.decode_state = nnx.Cache(state)
    self.decode_index = nnx.Cache(jnp.zeros((), jnp.int32)) if self.qk_transform is not None else nnx.data(None)

  def clear_cache(self) -> None:
    """Drops the decode state (after which :meth:`redraw` is allowed).

    Returns:
      None.
    """
    self.decode_state = nnx.data(None)
    self.decode_index = nnx.data(None)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, deterministic=None,
               rngs=None, sow_weights=False, decode=None, is_causal=False, out_sharding=None, qkv_sharding=None,
               query_mask=None, segment_ids=None):
    """Applies FAVOR attention to the inputs, projected as ``nnx.MultiHeadAttention`` does.

    Args:
      inputs_q: query inputs, [batch..., Lq, in_features].
      inputs_k: key inputs, [batch..., Lk, features]; None: ``inputs_q``.
      inputs_v: value inputs, [batch..., Lk, features]; None: ``inputs_k``.
      mask: NNX's attention mask, key padding only ([batch..., 1, 1, Lk] broadcastable); None: no padding.
      deterministic: as in NNX; False (training) also updates a causal data-dependent kernel's statistic.
      rngs: ignored (attention dropout is refused).
      sow_weights: must be False (FAVOR forms no attention weights).
      decode: decode one step from the cache (None: the layer's ``decode``); needs :meth:`init_cache`.
      is_causal: True only on a layer built with ``causal=True`` (causality is fixed at construction).
      out_sharding: must be None (split with ``mesh``, ``sequence_axis``, ``batch_axis`` instead).
      qkv_sharding: must be None.
      query_mask: optional bool [batch..., Lq], False for a padded query, left out of FAVOR++'s and
        FAVOR#'s statistic; in self-attention it defaults to the key padding of ``mask``; give it in
        padded cross-attention.
      segment_ids: optional int [batch..., L], packed documents (no pair crosses a segment; decoding starts
        afresh at a new id); padding stays ``mask``.

    Returns:
      The output, [batch..., Lq, out_features].

    Raises:
      ValueError: for ``sow_weights``, ``is_causal`` on a non-causal layer, a sharding argument, inputs of
        the wrong features, a mask that is not key padding, attention dropout while training, or decoding
        without :meth:`init_cache`.
      TypeError: for inputs of the wrong type (as the input checks raise).
    """
    del rngs
    if sow_weights:
      raise ValueError("sow_weights is not supported: FAVOR attention never forms attention weights")
    if is_causal and not self.causal:
      raise ValueError("is_causal=True on a layer built with causal=False: build it with causal=True (its "
                       "causal pass, running statistic and decoding are fixed at construction)")
    if out_sharding is not None or qkv_sharding is not None:
      raise ValueError("out_sharding and qkv_sharding are not supported by FavorAttention: split the sequence "
                       "with mesh, sequence_axis and batch_axis")
    inputs_q, inputs_k, inputs_v = inputs.check_inputs(inputs_q, inputs_k, inputs_v)
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"inputs_q has {inputs_q.shape[-1]} features, the module expects {self.in_features}")
    query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    decode = self.decode if decode is None else decode
    positions = None
    if decode:
      self.settings.check_decode_at_call()  # decode may be asked for at call time
      if self.decode_state is None:
        raise ValueError("decode=True needs the recurrent state: call init_cache(input_shape) first")
      if self.decode_index is not None:  # with a qk_transform: the new tokens' positions, counted on
        index = self.decode_index.get_value()
        positions = index + jnp.arange(query.shape[-3], dtype=jnp.int32)
        self.decode_index.set_value(index + query.shape[-3])
    query, key = inputs.transform_qk(self.qk_transform, query, key, positions)
    grouped = (key, value) if decode and self.kv_state[0] else None  # a state per key/value head
    key, value = inputs.repeat_kv_heads(key, value, self.num_heads)

    deterministic = inputs.resolve_deterministic(self.dropout_rate, self.deterministic, deterministic)
    key_mask, query_mask = inputs.padding_masks(mask, inputs_q, inputs_k, key, query_mask, query)
    rho = None
    if self.statistic is not None:
      rho = self.statistic.get_value()
      statistic.check_running_statistic(self.kernel, train=not deterministic, decode=decode)
      if not deterministic:
        self.statistic.set_value(
            statistic.updated_statistic(self.kernel, rho, query, key, key_mask, self.rho_momentum, query_mask,
                                        self.settings.precision))
    projection = self._projection()
    logit = None if self.forget_gate is None else self.forget_gate(inputs_k.astype(jnp.float32))
    log_gate = gates.layer_log_gate(logit, self.settings.alibi, key.shape[:-1])
    if decode:
      if self.decode_state is None:
        raise ValueError("decode=True needs the recurrent state: call init_cache(input_shape) first")
      key, value = grouped or (key, value)
      state, x = core.favor_decode_step(self.decode_state.get_value(), query, key, value, projection,
                                        kernel=self.kernel, key_mask=key_mask, rho=rho,
                                        chunk_size=self.chunk_size, window=self.window,
                                        precision=self.settings.precision,
                                        control_variate=self.settings.control_variate,
                                        **gates.gate_kwargs(log_gate, segment_ids))
      self.decode_state.set_value(state)
    else:
      x = attend(query, key, value, projection, self.settings, key_mask=key_mask, query_mask=query_mask, rho=rho,
                 log_gate=log_gate, segment_ids=segment_ids)
    return self.out(x)


def _constructor_signature(cls) -> inspect.Signature:
  """What ``cls(...)`` takes, for ``inspect.signature``, ``help()``, IDEs and the API page (NNX's metaclass
  shows ``(*args, **kwargs)``): ``cls.__init__``'s own arguments, then in place of its ``**flax_kwargs`` the
  keyword arguments of ``nnx.MultiHeadAttention`` it passes on (as keyword-only; ``attention_fn`` is refused).
  Read from the two ``__init__``s, so an argument added to either appears here."""
  own = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self
  named = {p.name for p in own} | {"attention_fn"}
  flax = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
          for p in list(inspect.signature(nnx.MultiHeadAttention.__init__).parameters.values())[1:]
          if p.name not in named and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
  positional = [p for p in own if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  keyword = [p for p in own if p.kind == p.KEYWORD_ONLY]
  return inspect.Signature(positional + keyword + flax)


FavorAttention.__signature__ = _constructor_signature(FavorAttention)
