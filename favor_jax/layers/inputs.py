"""What a layer's call takes in: Flax's masks and arguments read as FAVOR honours them, and the q/k transform."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array

from favor_jax import core


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


def check_dropout(dropout_rate, deterministic) -> None:
  """Attention dropout is refused where it would apply (FAVOR forms no attention weights to drop)."""
  if dropout_rate and not deterministic:
    raise ValueError(
        f"attention dropout (dropout_rate={dropout_rate}) is not supported by FAVOR attention: "
        "there are no explicit attention weights to drop. Use dropout_rate=0.0 (or "
        "deterministic=True) and put dropout on the attention output instead.")


def transform_qk(qk_transform, query, key, positions=None):
  """``qk_transform(query, key)`` (decoding: ``qk_transform(query, key, positions=positions)``, [l] int32 the
  new tokens' absolute indices), checked: a pair of floating arrays with the shapes it was given, none of a
  narrower dtype (rounding them silently would change the output); the pair unchanged when ``qk_transform``
  is None."""
  if qk_transform is None:
    return query, key
  out = qk_transform(query, key) if positions is None else qk_transform(query, key, positions=positions)
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


def repeat_kv_heads(key, value, num_heads: int):
  """Grouped-query attention's keys and values [..., L, Hkv, D] repeated to the queries' ``num_heads``: query
  head h reads key/value head ``h // (num_heads // Hkv)`` (Flax NNX's grouping); unchanged when Hkv == H."""
  repeats = num_heads // key.shape[-2]
  if repeats == 1:
    return key, value
  return jnp.repeat(key, repeats, axis=-2), jnp.repeat(value, repeats, axis=-2)
