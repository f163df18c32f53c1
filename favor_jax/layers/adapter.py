"""A drop-in ``attention_fn`` for Flax's own multi-head attention modules (Linen and NNX)."""

from __future__ import annotations

from collections.abc import Callable

from jaxtyping import Array, Float

from favor_jax import core
from favor_jax.layers.attend import attend
from favor_jax.layers.inputs import check_dropout, key_mask_from_flax, precision_scope
from favor_jax.layers.settings import FavorSettings


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
  # Checked here, once, not at each call; NNX may still ask for causal attention at the call (is_causal).
  settings = FavorSettings.build(kernel=kernel, causal=causal, chunk_size=chunk_size, window=window,
                                 causal_method=causal_method, causal_at_call=True)

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
      out = attend(query, key, value, projection, settings, causal=causal_now,
                   key_mask=key_mask_from_flax(mask, key), rho=rho)
    return out if dtype is None else out.astype(dtype)

  return attention_fn
