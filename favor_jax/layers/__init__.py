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
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from favor_jax import core, parallel
from favor_jax.core import causal as causal_lib

__all__ = ["make_attention_fn", "draw_projection", "redraw_due", "distillation_loss", "PROJECTIONS"]

PROJECTIONS = tuple(core.PROJECTIONS)  # the order that a layer's stored projection_kind indexes
DEFAULT_NUM_FEATURES = 256  # M of a random projection when the layer is not given num_features
DEFAULT_PROJECTION = "orthogonal"  # the kind drawn when the layer is not given projection
draw_projection = core.draw_projection
draw_projection_by_index = core.draw_projection_by_index


def projection_role(kernel) -> str:
  """What a layer keeps for ``kernel``: ``"random"`` (a drawn projection in the ``favor`` collection),
  ``"learned"`` (a trained ``feature_map`` parameter, initialised to the identity) or ``"none"``."""
  kern = core.get_kernel(kernel)
  if not isinstance(kern, core.kernels.Kernel):
    return "random"  # a user callable is given a projection, as favor_attention gives it one
  if kern.learned:
    return "learned"
  return "random" if kern.needs_projection else "none"


def per_head(kernel, per_head_projection) -> bool:
  """Whether the layer's projection is [H, M, D]: as asked, else per head for learned kernels only."""
  if per_head_projection is None:
    return projection_role(kernel) == "learned"
  return per_head_projection


# Why decoding honours "auto" and "chunked" only (``check_causal_method``; NNX also asks at call time).
DECODE_RUNS_CHUNKED = "decode=True (a prompt runs the chunked pass, a token one recurrence step)"


def check_favor_args(*, num_features, kernel, projection, causal, decode, window=0, per_head_projection=None,
                     qk_head_dim=None, causal_method="auto") -> None:
  """The checks every FavorAttention layer (Linen and NNX) makes of its FAVOR arguments."""
  core.checks.check_bool("causal", causal)
  if decode is not None:  # NNX's default, as Flax's: not decoding
    core.checks.check_bool("decode", decode)
  core.get_kernel(kernel)
  check_causal_method(causal_method, "window > 0 (hybrid attention)" if window else (
      DECODE_RUNS_CHUNKED if decode else None))
  core.checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS, causal)
  role = projection_role(kernel)
  core.checks.check_positive_int("num_features", num_features, optional=True)
  if projection is not None and projection not in PROJECTIONS:
    raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
  if role != "random":
    what = ("learns its feature map (a [head_dim, head_dim] parameter per head, initialised to the identity)"
            if role == "learned" else "uses no projection (its features are a fixed function of q and k)")
    for name, value in (("num_features", num_features), ("projection", projection)):
      if value is not None:
        raise ValueError(f"kernel {kernel!r} {what}, so {name} has no meaning for it; got {name}={value!r}: "
                         "leave it None")
  if per_head_projection is not None and not isinstance(per_head_projection, (bool, np.bool_)):
    raise ValueError(f"per_head_projection must be None, True or False, got {per_head_projection!r}")
  if role == "none" and per_head_projection:
    raise ValueError(f"per_head_projection=True: kernel {kernel!r} uses no projection to make per head")
  core.checks.check_window(window)
  core.checks.check_positive_int("qk_head_dim", qk_head_dim, optional=True)
  if decode and not causal:
    raise ValueError("decode=True needs causal=True: decoding is autoregressive")


def layer_projection(key, kernel, num_features, projection, per_head_projection, heads: int, qk_dim: int):
  """The initial projection a layer stores for ``kernel`` (None if it uses none).

  Random kernels: [M, D], or [H, M, D] with each head an independent draw.
  Learned kernels: the identity, [D, D] or [H, D, D].
  """
  role = projection_role(kernel)
  if role == "none":
    return None
  lead = (heads,) if per_head(kernel, per_head_projection) else ()
  if role == "learned":
    return jnp.broadcast_to(jnp.eye(qk_dim, dtype=jnp.float32), lead + (qk_dim, qk_dim))
  num_features = DEFAULT_NUM_FEATURES if num_features is None else num_features
  draw = lambda k: draw_projection(k, projection_kind(projection), num_features, qk_dim)
  return _per_head_draws(draw, key, lead)


def projection_kind(projection) -> str:
  """The projection kind a layer draws (``DEFAULT_PROJECTION`` when not given)."""
  return DEFAULT_PROJECTION if projection is None else projection


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


def keeps_statistic(kernel, causal: bool) -> bool:
  """Whether a layer keeps a running statistic: causal, with a data-dependent kernel (FAVOR++, FAVOR#)."""
  return causal and is_data_dependent(kernel)


def is_data_dependent(kernel) -> bool:
  """Whether ``kernel`` takes a statistic of the data (FAVOR++'s ρ): causal layers keep a running one."""
  kern = core.get_kernel(kernel)
  return isinstance(kern, core.kernels.Kernel) and kern.data_dependent


def redraw_due(step, every: int):
  """True on the steps where an ``every``-step redraw schedule draws new features (never if 0).

  Works on a traced ``step``, so a jitted train step compiles once.
  """
  if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 0:
    raise ValueError(f"redraw every must be a non-negative int, got {every!r}")
  if every == 0:
    return jnp.asarray(False)
  return (jnp.asarray(step) % every) == 0


def key_mask_from_flax(mask, key) -> Array | None:
  """A Flax attention mask that only masks keys, as ``key_mask`` [batch..., Lk]; anything else raises.

  FAVOR never forms the [Lq, Lk] weights, so it can honour exactly the masks
  that remove keys for every query and head: shape [batch..., 1, 1, Lk].
  """
  if mask is None:
    return None
  batch, lk = key.shape[:-3], key.shape[-3]
  ok = mask.ndim >= 3 and mask.shape[-1] == lk and mask.shape[-2] == 1 and mask.shape[-3] == 1
  if ok:
    try:
      ok = jnp.broadcast_shapes(mask.shape[:-3], batch) == tuple(batch)  # no batch dims beyond the input's
    except ValueError:
      ok = False
  if not ok:
    raise ValueError(
        f"FAVOR attention honours only key-padding masks of shape [batch..., 1, 1, Lk] = "
        f"{batch + (1, 1, lk)}; got mask shape {mask.shape}. Pass a padding mask such as "
        "`pad[..., None, None, :]` (or nn.make_attention_mask(jnp.ones(pad.shape[:-1] + (1,)), pad)); "
        "for causal attention build the layer with causal=True (make_attention_fn: causal=True or "
        "is_causal=True), not a causal mask.")
  return jnp.broadcast_to(mask[..., 0, 0, :].astype(bool), batch + (lk,))


def padding_masks(mask, inputs_q, inputs_k, key, query_mask=None, query=None) -> tuple[Array | None, Array | None]:
  """(key_mask, query_mask) of a Flax ``mask`` (``key_mask_from_flax``) and the call's ``query_mask``
  [batch..., Lq] (False: a padded query; checked against ``query``). Not given: in self-attention (keys from
  the queries' input: ``inputs_k is inputs_q`` after ``check_inputs``) the key padding is the queries'
  padding too; in cross-attention every query counts. A data-dependent kernel's statistic leaves the padded
  queries out, so the real rows do not depend on how much padding follows."""
  key_mask = key_mask_from_flax(mask, key)
  if query_mask is not None:
    core.checks.check_key_mask(query_mask, query.shape, "query_mask")
    return key_mask, jnp.broadcast_to(query_mask, query.shape[:-2])
  return key_mask, (key_mask if inputs_k is inputs_q else None)


def check_inputs(inputs_q, inputs_k, inputs_v):
  """(inputs_q, inputs_k, inputs_v) as Flax's attention reads them: keys default to the queries, values to
  the keys; values without keys are refused, as Flax refuses them."""
  if inputs_k is None and inputs_v is not None:
    raise ValueError("inputs_v given with inputs_k=None: pass the keys' input as inputs_k too (the same array "
                     "for both if keys and values come from one input; Flax refuses this as well)")
  inputs_k = inputs_q if inputs_k is None else inputs_k
  return inputs_q, inputs_k, inputs_k if inputs_v is None else inputs_v


def resolve_deterministic(dropout_rate, own, given) -> bool:
  """The call's ``deterministic`` (``given``, else the layer's ``own``; neither: True). With
  ``dropout_rate`` > 0 one must be set, as Flax asks: FAVOR attention has no weights to drop, so True runs
  without dropout and False is refused (``check_dropout``)."""
  value = own if given is None else given
  if value is None:
    if dropout_rate:
      raise ValueError(f"dropout_rate={dropout_rate} needs deterministic, given to the layer or the call (as "
                       "Flax's attention asks): True runs without dropout; False is refused, FAVOR attention "
                       "has no attention weights to drop")
    value = True
  check_dropout(dropout_rate, value)
  return bool(value)


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


RHO_MOMENTUM = 0.99  # the running statistic's weight on its past, where rho_momentum is not given


def rho_momentum(rho_momentum, kernel, causal: bool) -> float | None:
  """The momentum of the layer's running statistic: ``RHO_MOMENTUM`` if not given. Only causal layers of a
  data-dependent kernel (FAVOR++, FAVOR#) keep one; a value given to any other layer is refused, not
  ignored (None there)."""
  keeps = keeps_statistic(kernel, causal)
  if rho_momentum is None:
    return RHO_MOMENTUM if keeps else None
  if not keeps:
    raise ValueError(f"rho_momentum={rho_momentum!r} weighs a running statistic, which only a causal layer of "
                     f"a data-dependent kernel keeps (one of {core.kernels.data_dependent_names()}); this layer "
                     f"(kernel={kernel!r}, causal={causal}) keeps none: drop rho_momentum")
  if isinstance(rho_momentum, bool) or not isinstance(rho_momentum, numbers.Real) or not 0 <= rho_momentum <= 1:
    raise ValueError(f"rho_momentum must be a float in [0, 1] (the running statistic's weight on its past), "
                     f"got {rho_momentum!r}")
  return rho_momentum


def check_dropout(dropout_rate, deterministic) -> None:
  if dropout_rate and not deterministic:
    raise ValueError(
        f"attention dropout (dropout_rate={dropout_rate}) is not supported by FAVOR attention: "
        "there are no explicit attention weights to drop. Use dropout_rate=0.0 (or "
        "deterministic=True) and put dropout on the attention output instead.")


def precision_scope(precision):
  """Honours Flax's ``precision`` argument as JAX's default matmul precision for the call."""
  if precision is None:
    return contextlib.nullcontext()
  if isinstance(precision, jax.lax.Precision):
    precision = {"DEFAULT": "default", "HIGH": "high", "HIGHEST": "highest"}[precision.name]
  if not isinstance(precision, str):
    raise ValueError(f"precision must be None, a jax.lax.Precision or a string, got {precision!r}")
  return jax.default_matmul_precision(precision)


def _statistic_of(kernel, query, key, key_mask, query_mask=None):
  return core.get_kernel(kernel).compute_statistic(query, key, key_mask, query_mask)


def initial_statistic(kernel, heads: int, qk_dim: int):
  """Zeros shaped like ``kernel``'s statistic of one sequence (FAVOR++'s ρ: [H]); zero ρ is FAVOR+."""
  return jnp.zeros(core.get_kernel(kernel).statistic_shape((1, 1, heads, qk_dim))[1:], jnp.float32)


def updated_statistic(kernel, running, query, key, key_mask, momentum: float, query_mask=None):
  """Exponential moving average of ``kernel``'s statistic with this batch's mean one (no gradient; over the
  unmasked keys and the queries of ``query_mask``).

  The kernel record computes the statistic per batch element; its mean over the batch elements that hold a
  real query and an unmasked key keeps the running value's shape (FAVOR++'s ρ: [H]). An element that is all
  padding has no statistic and is left out (it would pull the mean towards 0); a batch of such elements
  leaves the running value as it was.
  """
  batch_stat = jax.lax.stop_gradient(_statistic_of(kernel, query, key, key_mask, query_mask))
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


def check_qk_transform(qk_transform, *, decode) -> None:
  """A layer's ``qk_transform``: None or a callable ``(query, key) -> (query, key)``, and not with decode."""
  if qk_transform is None:
    return
  if not callable(qk_transform):
    raise TypeError(f"qk_transform must be a callable (query, key) -> (query, key), got {type(qk_transform).__name__}")
  if decode:
    raise ValueError("qk_transform with decode=True is not supported: the transform does not see "
                     "the positions of decoded tokens")


def transform_qk(qk_transform, query, key):
  """``qk_transform(query, key)``, checked: a pair of floating arrays with the shapes it was given, none of a
  narrower dtype (rounding them silently would change the output); the pair unchanged when ``qk_transform``
  is None."""
  if qk_transform is None:
    return query, key
  out = qk_transform(query, key)
  if not isinstance(out, (tuple, list)) or len(out) != 2:
    got = f"{type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
    raise TypeError(f"qk_transform must return a pair (query, key), got {got}")
  for name, given, new in zip(("query", "key"), (query, key), out):
    dtype = getattr(new, "dtype", None)
    if dtype is None or not hasattr(new, "shape") or not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"qk_transform must return floating arrays; its {name} is {type(new).__name__}"
                      + ("" if dtype is None else f" of dtype {dtype}"))
    if tuple(new.shape) != tuple(given.shape):
      raise ValueError(f"qk_transform must keep the shapes it is given; its {name} has shape "
                       f"{tuple(new.shape)}, needs {tuple(given.shape)}")
    if jnp.finfo(dtype).eps > jnp.finfo(given.dtype).eps:  # a wider dtype is taken (features are float32)
      raise TypeError(f"qk_transform must not round what it is given to a narrower dtype; its {name} is "
                      f"{jnp.dtype(dtype).name}, given {jnp.dtype(given.dtype).name}")
  return tuple(out)


def check_sequence_parallel(mesh, sequence_axis, *, causal_method, decode, window, batch_axis=None) -> None:
  """A layer's ``mesh``/``sequence_axis``: both or neither, and nothing the sequence-parallel pass ignores."""
  if (mesh is None) != (sequence_axis is None):
    raise ValueError("sequence-parallel attention needs both mesh and sequence_axis (or neither)")
  if sequence_axis is None:
    if batch_axis is not None:
      raise ValueError(f"batch_axis={batch_axis!r} splits the batch of sequence-parallel attention: it needs "
                       "mesh and sequence_axis too (or drop batch_axis)")
    return
  check_causal_method(causal_method, "sequence_axis (sequence-parallel attention)")
  if decode:
    raise ValueError("decode=True is token by token; it cannot be sequence-parallel (drop sequence_axis)")
  if window:
    raise ValueError(f"window={window}: hybrid attention is not sequence-parallel (drop sequence_axis "
                     "or use window=0)")


def attend(query, key, value, projection, *, window: int = 0, causal_method: str = "auto", mesh=None,
           sequence_axis: str | None = None, batch_axis: str | None = None, query_mask=None, **kwargs):
  """``core.favor_attention``, or ``core.hybrid_attention`` (exact softmax within ``window``) if window > 0,
  or with ``sequence_axis`` ``parallel.sequence_parallel_attention`` over ``mesh`` (FAVOR++'s ρ, if not
  given, from the whole batch and sequence: XLA reduces it across devices). Its callers have checked
  ``causal_method`` against the window and the mesh (``check_favor_args``, ``check_sequence_parallel``,
  ``make_attention_fn``)."""
  if sequence_axis is not None:
    if kwargs.get("rho") is None and is_data_dependent(kwargs.get("kernel", "positive")):
      kwargs["rho"] = _statistic_of(kwargs["kernel"], query, key, kwargs.get("key_mask"), query_mask)
    return parallel.sequence_parallel_attention(query, key, value, projection, mesh=mesh, axis_name=sequence_axis,
                                                batch_axis=batch_axis, **kwargs)
  if window:
    return core.hybrid_attention(query, key, value, projection, window=window, query_mask=query_mask, **kwargs)
  return core.favor_attention(query, key, value, projection, causal_method=causal_method, query_mask=query_mask,
                              **kwargs)


def check_causal_method(causal_method, only_chunked_because: str | None = None) -> None:
  """A known causal method; where only the XLA chunked pass runs (hybrid, sequence-parallel, decoding),
  "auto" or "chunked" only: another choice would be ignored there."""
  core.checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS)
  if only_chunked_because and causal_method not in ("auto", "chunked"):
    raise ValueError(f"causal_method={causal_method!r} cannot apply with {only_chunked_because}, which runs the "
                     "XLA chunked pass: use causal_method='auto' or 'chunked'")


def make_attention_fn(
    projection: Float[Array, "M D"] | Float[Array, "H M D"] | None,
    *,
    kernel="positive",
    causal: bool = False,
    rho=None,
    chunk_size: int = 64,
    window: int = 0,
    causal_method: str = "auto",
) -> Callable[..., Array]:
  """An ``attention_fn`` computing :func:`favor_attention` with a fixed ``projection``.

  Pass it to ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)`` or
  ``flax.nnx.MultiHeadAttention(attention_fn=...)``. ``projection``: [M, D]
  shared by the heads, [H, M, D] one per head, or None for a kernel that uses
  none (``taylor``, ``elu_plus_one``). ``window`` > 0: exact softmax for keys
  within ``window`` positions and the kernel's estimate for the rest
  (:func:`core.hybrid_attention`). ``causal_method``: as in
  :func:`core.favor_attention` ("auto": fused Pallas kernels on a GPU where
  they apply). Key-padding masks are
  honoured (no query padding is known here: a data-dependent kernel's statistic
  averages over every query, padded ones included; the layers leave them out);
  ``causal=True`` here or ``is_causal=True`` from NNX gives causal
  attention (Flax's own decode cache passes one query against the cached keys
  under a causal mask: decode through it with ``causal=False`` and no window);
  full masks, ``bias``, attention dropout, ``sow_weights`` and
  unknown keywords with a non-default value raise instead of being ignored.
  """
  core.get_kernel(kernel)  # unknown names fail here, not at the first call
  core.checks.check_bool("causal", causal)
  core.checks.check_window(window)
  check_causal_method(causal_method, "window > 0 (hybrid attention)" if window else None)

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                   dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                   force_fp32_for_softmax=False, qk_attn_weights_einsum=None,
                   attn_weights_value_einsum=None, is_causal=False, **unknown):
    del broadcast_dropout, dropout_rng, force_fp32_for_softmax  # f32 inside always
    if bias is not None:
      raise ValueError("FAVOR attention cannot add a bias to attention logits it never forms; got bias "
                       f"of shape {getattr(bias, 'shape', None)}. Drop the bias or use softmax attention.")
    if module is not None:
      raise ValueError("sow_weights is not supported: FAVOR attention never forms attention weights")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
      raise ValueError("custom attention-weight einsums (qk_attn_weights_einsum / "
                       "attn_weights_value_einsum) do not apply to FAVOR attention")
    bad = {k: v for k, v in unknown.items() if v is not None and v is not False}
    if bad:
      raise ValueError(f"FAVOR attention_fn cannot honour the keyword arguments {sorted(bad)}")
    check_dropout(dropout_rate, deterministic)
    core.checks.check_bool("is_causal", is_causal)
    causal_now = bool(causal or is_causal)
    if (causal_now or window) and query.shape[-3] != key.shape[-3]:
      raise ValueError(
          f"{'causal attention' if causal_now else f'window={window}'} needs as many queries as keys, "
          f"got {query.shape[-3]} queries and {key.shape[-3]} keys. Decoding with Flax's own cache (decode=True) "
          "passes one query against the cached keys with a mask that is already causal: decode with an "
          "attention_fn made with causal=False (and window=0), or use favor_jax's FavorAttention layers, "
          "whose decode keeps a constant-size state.")
    with precision_scope(precision):
      out = attend(query, key, value, projection, window=window, kernel=kernel,
                   causal=causal_now, key_mask=key_mask_from_flax(mask, key), rho=rho,
                   chunk_size=chunk_size, causal_method=causal_method)
    return out if dtype is None else out.astype(dtype)

  return attention_fn


def distillation_loss(
    query: Float[Array, "... L H D"],
    key: Float[Array, "... L H D"],
    feature_map: Float[Array, "M D"] | Float[Array, "H M D"],
    *,
    kernel="hedgehog",
    causal: bool = False,
    key_mask: Bool[Array, "... L"] | None = None,
    query_mask: Bool[Array, "... L"] | None = None,
    rho: Float[Array, "... H"] | Float[Array, "... H D+1"] | None = None,
) -> Float[Array, ""]:
  """Hedgehog's distillation loss (Zhang et al. 2024): the cross-entropy of each row of the kernel's
  attention weights against softmax's,

      −mean over rows (batch, head, query) of Σ_j softmax_ij · log A_ij,
      A = core.attention_weights(query, key, feature_map, kernel=kernel),

  over the rows that see at least one key and whose query is not padding (``query_mask`` False: left out of
  the mean and of a data-dependent kernel's statistic, whatever it holds). Both sides are taken in log
  domain (softmax's too), so a teacher weight below float32's range still counts: where the student gives
  a key weight exactly 0 and the teacher does not, the loss is +inf, as in float64. Non-finite inputs follow
  the rule of every attention function: a non-finite query, or an unmasked non-finite key a row may see,
  makes that row's cross-entropy NaN, and so the loss (its gradient then NaN too); a padded query or a
  masked key is absent whatever it holds. ``query`` and ``key`` (a trained
  softmax layer's, on real inputs: NNX ``layer.query(x)``, ``layer.key(x)``;
  Linen ``apply(..., capture_intermediates=True)``) are held fixed: only
  ``feature_map`` gets a gradient, so ``jax.grad`` with respect to it drives a
  plain optax loop; the fitted map is then the hedgehog layer's ``feature_map``
  parameter. The loss minus softmax's entropy is the mean KL divergence, ≥ 0,
  0 when the weights match. log A is taken in log domain (a weight below float32's
  range keeps its log), so the kernel's weights must be positive: kernels whose
  weights can be 0 or negative (``relu``, ``trigonometric``) are refused. ``rho``: a
  data-dependent kernel's statistic, as in :func:`core.attention_weights`.
  """
  if kernel == "softmax":
    raise ValueError("kernel must be a feature map to fit to softmax, got 'softmax'")
  record = core.get_kernel(kernel)
  if isinstance(record, core.kernels.Kernel) and not record.positive_weights:
    raise ValueError(f"kernel {record.name!r} has weights that can be 0 or negative, where the cross-entropy "
                     "against softmax is infinite or undefined: distil a kernel with positive weights")
  core.checks.check_key_mask(query_mask, query.shape, "query_mask")
  query, key = jax.lax.stop_gradient(query), jax.lax.stop_gradient(key)
  if query_mask is not None:  # a padded query's values (NaN included) reach neither the loss nor its gradient
    query = jnp.where(query_mask[..., None, None], query, jnp.zeros((), query.dtype))
  log_target = jax.lax.stop_gradient(
      core.attention_weights(query, key, kernel="softmax", causal=causal, key_mask=key_mask, log=True))
  log_weights = core.attention_weights(query, key, feature_map, kernel=kernel, causal=causal, key_mask=key_mask,
                                       rho=rho, query_mask=query_mask, log=True)
  rows = jnp.any(~jnp.isneginf(log_target), axis=-1)  # [..., H, L]: sees a key (a NaN row included: NaN loss)
  if query_mask is not None:
    rows = rows & jnp.expand_dims(query_mask, -2)
  seen = rows[..., None] & ~jnp.isneginf(log_target)  # the keys a row weighs (NaN ones too)
  # t·log A, with t = e^{log t} > 0 and log A = −inf (a key the student drops) giving −inf, not 0·(−inf).
  dropped = seen & jnp.isneginf(log_weights) & ~jnp.isnan(log_target)
  terms = jnp.exp(jnp.where(seen, log_target, 0.0)) * jnp.where(seen & ~dropped, log_weights, 0.0)
  cross = -jnp.sum(jnp.where(dropped, -jnp.inf, jnp.where(seen, terms, 0.0)), axis=-1)
  return jnp.sum(jnp.where(rows, cross, 0.0)) / jnp.maximum(jnp.sum(rows), 1)
