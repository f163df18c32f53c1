"""A drop-in ``attention_fn`` for Flax's own multi-head attention modules (Linen and NNX)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxtyping import Array, Float

from favor_jax import core
from favor_jax.core import precision as precision_lib
from favor_jax.layers.attend import attend
from favor_jax.layers.gates import layer_log_gate
from favor_jax.layers.inputs import check_dropout, key_mask_from_flax
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
    alibi: bool = False,
    forget_gate: bool = False,
) -> Callable[..., Array]:
  """Makes an ``attention_fn`` computing :func:`~favor_jax.core.favor_attention` with a fixed projection.

  Pass it to ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)`` or
  ``flax.nnx.MultiHeadAttention(attention_fn=...)``. Key-padding masks are honoured (no query padding is
  known here: a data-dependent kernel's statistic averages over every query, padded ones included; the
  layers leave them out). Flax's own decode cache passes one query against the cached keys under a causal
  mask: decode through it with ``causal=False`` and no window.

  Args:
    projection: ω, [M, D] shared by the heads, [H, M, D] one per head, or None for a kernel that uses none
      (``taylor``, ``elu_plus_one``).
    kernel: a name in ``core.KERNELS`` or a :class:`~favor_jax.core.kernels.Kernel` record, as in
      :func:`~favor_jax.core.favor_attention`.
    causal: causal attention at every call (NNX's ``is_causal=True`` also asks for it at a call).
    rho: a data-dependent kernel's statistic, as in :func:`~favor_jax.core.favor_attention`.
    chunk_size: C, the chunk length of the causal pass.
    window: W ≥ 0; > 0: exact softmax for keys within W positions and the kernel's estimate for the rest
      (:func:`~favor_jax.core.hybrid_attention`).
    causal_method: as in :func:`~favor_jax.core.favor_attention` (``"auto"``: fused Pallas kernels on a GPU
      where they apply).
    alibi: ALiBi's fixed per-head forget gate (log f = −m_h, ``core.alibi_slopes``), causal attention only
      (``causal=True``, or ``is_causal=True`` at the call; a bidirectional call raises).
    forget_gate: refused when True: the learned gate is a function of the layer's input, which an
      ``attention_fn`` never sees (use ``FavorAttention(..., forget_gate=True)``). Packed documents cannot
      pass either: Flax gives an ``attention_fn`` no segment ids, and a segment mask [batch, 1, L, L] is a full
      mask, refused like any other (use ``FavorAttention``'s ``segment_ids``).

  Returns:
    ``attention_fn(query, key, value, bias=None, mask=None, ...)`` with Flax's signature: query
    [..., Lq, H, D], key [..., Lk, H, D], value [..., Lk, H, Dv] to the output [..., Lq, H, Dv] (in ``dtype``
    when given); its ``precision`` (Flax's module passes its own) is that of every dot of the
    attention, as in :func:`~favor_jax.core.favor_attention`.

  Raises:
    ValueError: here, for ``forget_gate=True`` or an invalid setting (as ``FavorSettings.build`` checks:
      kernel, ``chunk_size``, ``window``, ``causal_method``, ``alibi``); at a call, for a ``bias``,
      ``sow_weights`` (``module``), custom weight einsums, attention dropout, an unknown keyword with a
      non-default value, a full mask it cannot read as key padding, causal/window attention with Lq ≠ Lk,
      or ``alibi`` in bidirectional attention.
    TypeError: here or at a call, for a non-bool ``causal`` or ``is_causal``.
  """
  if forget_gate is not False:
    raise ValueError(f"forget_gate={forget_gate!r}: make_attention_fn cannot learn a forget gate, which is a "
                     "function of the layer's input and Flax's attention_fn is given only the query, key and value; "
                     "use favor_jax.layers' FavorAttention(..., forget_gate=True) (alibi=True works here)")
  # Checked here, once, not at each call; NNX may still ask for causal attention at the call (is_causal).
  settings = FavorSettings.build(kernel=kernel, causal=causal, chunk_size=chunk_size, window=window,
                                 causal_method=causal_method, alibi=alibi, causal_at_call=True)

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
    if alibi and not causal_now:
      raise ValueError("alibi=True needs causal attention (a forget gate decays the keys before a query): make "
                       "the attention_fn with causal=True or call it with is_causal=True")
    log_gate = layer_log_gate(None, alibi, query.shape[:-1])
    # Flax's precision of this call (its projections take it too) for every dot of the attention core.
    call_settings = dataclasses.replace(settings, precision=precision_lib.check(precision))
    out = attend(query, key, value, projection, call_settings, causal=causal_now,
                 key_mask=key_mask_from_flax(mask, key), rho=rho, log_gate=log_gate)
    return out if dtype is None else out.astype(dtype)

  return attention_fn
