"""Flax wrappers over :mod:`favor_jax.core`: no math of their own.

- :func:`make_attention_fn` — a drop-in ``attention_fn`` for
  ``flax.linen.MultiHeadDotProductAttention`` and ``flax.nnx.MultiHeadAttention``.
- :mod:`favor_jax.layers.linen` / :mod:`favor_jax.layers.nnx` — ``FavorAttention``
  modules that own their projection, redraw it and decode token by token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from favor_jax import core

__all__ = ["make_attention_fn", "draw_projection", "redraw_due", "PROJECTIONS"]

PROJECTIONS = tuple(core.PROJECTIONS)  # the order that a layer's stored projection_kind indexes
draw_projection = core.draw_projection
draw_projection_by_index = core.draw_projection_by_index


def check_favor_args(*, num_features, kernel, projection, causal, decode) -> None:
  """The checks every FavorAttention layer (Linen and NNX) makes of its FAVOR arguments."""
  if projection not in PROJECTIONS:
    raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
  if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features <= 0:
    raise ValueError(f"num_features must be a positive int, got {num_features!r}")
  core.get_kernel(kernel)
  if decode and not causal:
    raise ValueError("decode=True needs causal=True: decoding is autoregressive")


def is_data_dependent(kernel) -> bool:
  """Whether ``kernel`` takes a statistic of the data (FAVOR++'s ρ): causal layers keep a running one."""
  kern = core.get_kernel(kernel)
  return isinstance(kern, core.kernels.Kernel) and kern.data_dependent


def redraw_due(step, every: int):
  """True on the steps where an ``every``-step redraw schedule draws new features (never if 0).

  Works on a traced ``step``, so a jitted train step compiles once.
  """
  if not isinstance(every, int) or every < 0:
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
      jnp.broadcast_shapes(mask.shape[:-3], batch)
    except ValueError:
      ok = False
  if not ok:
    raise ValueError(
        f"FAVOR attention honours only key-padding masks of shape [batch..., 1, 1, Lk] = "
        f"{batch + (1, 1, lk)}; got mask shape {mask.shape}. Pass a padding mask such as "
        "`pad[..., None, None, :]` (or nn.make_attention_mask(jnp.ones(pad.shape[:-1] + (1,)), pad)); "
        "for causal attention use causal=True / is_causal=True, not a causal mask.")
  return jnp.broadcast_to(mask[..., 0, 0, :].astype(bool), batch + (lk,))


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


def updated_rho(running, query, key, key_mask, momentum: float):
  """Exponential moving average of FAVOR++'s ρ [H] with this batch's mean ρ (no gradient)."""
  batch_rho = jax.lax.stop_gradient(core.oprf_rho(query, key, key_mask))
  batch_rho = batch_rho.reshape((-1, batch_rho.shape[-1])).mean(0)
  return momentum * running + (1 - momentum) * batch_rho


def make_attention_fn(
    projection: Float[Array, "M D"] | None,
    *,
    kernel="positive",
    causal: bool = False,
    rho=None,
    chunk_size: int = 64,
) -> Callable[..., Array]:
  """An ``attention_fn`` computing :func:`favor_attention` with a fixed ``projection``.

  Pass it to ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)`` or
  ``flax.nnx.MultiHeadAttention(attention_fn=...)``. Key-padding masks are
  honoured; ``causal=True`` here or ``is_causal=True`` from NNX gives causal
  attention; full masks, ``bias``, attention dropout, ``sow_weights`` and
  unknown keywords with a non-default value raise instead of being ignored.
  """
  core.get_kernel(kernel)  # unknown names fail here, not at the first call

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
    with precision_scope(precision):
      out = core.favor_attention(query, key, value, projection, kernel=kernel,
                                 causal=bool(causal or is_causal),
                                 key_mask=key_mask_from_flax(mask, key), rho=rho, chunk_size=chunk_size)
    return out if dtype is None else out.astype(dtype)

  return attention_fn
