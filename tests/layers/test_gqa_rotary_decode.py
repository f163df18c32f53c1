"""Grouped-query attention (num_kv_heads) and rotary positions while decoding, in the Linen and NNX layers.

Decoding a prompt then one token at a time must give the full causal pass's outputs with rotary positions
(the transform told each decoded token's position), GQA, a forget gate and an exact window; a GQA layer must
equal the full-head layer whose key/value maps are the grouped ones repeated.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from favor_jax.layers import linen as flin
from favor_jax.layers import nnx as fnnx

B, L, F, H, KV, M = 2, 11, 16, 4, 2, 16
PROMPT = 7  # a prompt of 7 tokens spans two chunks of 4, then 4 tokens one at a time


def rope(query, key, positions=None):
  """Rotary embedding of feature pairs (i, i + D/2) at angle position·10000^(-2i/D) (positions: 0..L-1)."""
  def rotate(x):
    half = x.shape[-1] // 2
    pos = jnp.arange(x.shape[-3]) if positions is None else positions
    angle = pos[:, None].astype(jnp.float32) * 10000.0 ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
  return rotate(query), rotate(key)


def _x(length=L):
  return jax.random.normal(jax.random.PRNGKey(0), (B, length, F))


def _jiggle(params, scale=0.3):
  """Every parameter moved at random, so the forget gate (zero weight at init) varies along the sequence."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
  return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


LAYER = dict(num_heads=H, num_kv_heads=KV, num_features=M, causal=True, chunk_size=4, qk_transform=rope,
             forget_gate=True)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("window", [0, 3])
def test_linen_decode_equals_full_pass_with_rotary_gqa_and_gate(window):
  x = _x()
  layer = flin.FavorAttention(**LAYER, window=window)
  variables = jax.jit(layer.init)(jax.random.PRNGKey(1), x)
  variables = {**variables, "params": _jiggle(variables["params"])}
  assert variables["params"]["key"]["kernel"].shape == (F, KV, F // H)
  full = jax.jit(layer.apply)(variables, x)
  decoder = flin.FavorAttention(**LAYER, window=window, decode=True)
  cache = jax.jit(decoder.init)(jax.random.PRNGKey(1), x[:, :1])["cache"]
  step = jax.jit(lambda v, x: decoder.apply(v, x, mutable=["cache"]))
  outs = []
  for lo, hi in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, L)]:
    out, mut = step({**variables, "cache": cache}, x[:, lo:hi])
    cache = mut["cache"]
    outs.append(out)
  assert int(cache["index"]) == L
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)
  cache_at_0 = {**cache, "index": jnp.zeros((), jnp.int32)}  # a wrong position must show
  wrong, _ = step({**variables, "cache": cache_at_0}, x[:, L - 1:])
  assert not np.allclose(wrong, outs[-1], atol=1e-3)


def test_nnx_decode_equals_full_pass_with_rotary_gqa_and_gate():
  x = _x()
  layer = fnnx.FavorAttention(H, F, **{k: v for k, v in LAYER.items() if k != "num_heads"}, window=3,
                              decode=False, rngs=nnx.Rngs(1))
  nnx.update(layer, _jiggle(nnx.state(layer, nnx.Param)))
  assert layer.key.kernel[...].shape == (F, KV, F // H)
  full = nnx.jit(lambda m, x: m(x))(layer, x)
  layer.init_cache(x.shape)
  step = nnx.jit(lambda m, x: m(x, decode=True))  # the decode state and its index update in place
  outs = [step(layer, x[:, :PROMPT])]
  outs += [step(layer, x[:, t:t + 1]) for t in range(PROMPT, L)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)
  assert int(layer.decode_index[...]) == L


def test_gqa_equals_full_heads_with_repeated_key_value_maps():
  """Query head h reads key/value head h // (H / KV): the layer with those maps repeated to H heads agrees."""
  x = _x()
  plain = dict(num_heads=H, num_features=M, causal=True, chunk_size=4)
  gqa = flin.FavorAttention(**plain, num_kv_heads=KV)
  variables = jax.jit(gqa.init)(jax.random.PRNGKey(1), x)
  variables = {**variables, "params": _jiggle(variables["params"])}
  repeated = jax.tree.map(lambda a: jnp.repeat(a, H // KV, axis=-2),  # kernel [F, KV, D], bias [KV, D]
                          {n: variables["params"][n] for n in ("key", "value")})
  full_heads = {**variables, "params": {**variables["params"], **repeated}}
  np.testing.assert_allclose(jax.jit(gqa.apply)(variables, x),
                             jax.jit(flin.FavorAttention(**plain).apply)(full_heads, x),
                             rtol=1e-5, atol=1e-6)
  layer = fnnx.FavorAttention(H, F, num_features=M, causal=True, num_kv_heads=KV, decode=False, rngs=nnx.Rngs(2))
  assert layer.value.kernel[...].shape == (F, KV, F // H) and nnx.jit(lambda m, x: m(x))(layer, x).shape == x.shape


def test_bad_num_kv_heads_and_position_blind_transforms_are_refused():
  x = _x()
  for bad, message in [(3, r"num_kv_heads=3 must divide num_heads=4"),
                       (0, r"num_kv_heads must be a positive int, got 0")]:
    with pytest.raises(ValueError, match=message):
      flin.FavorAttention(num_heads=H, num_kv_heads=bad).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=message):
      fnnx.FavorAttention(H, F, num_kv_heads=bad, rngs=nnx.Rngs(0))
  blind = lambda q, k: rope(q, k)
  with pytest.raises(ValueError, match=r"qk_transform with decode=True must take the tokens' positions"):
    flin.FavorAttention(num_heads=H, causal=True, decode=True, qk_transform=blind).init(jax.random.PRNGKey(0), x)
  layer = fnnx.FavorAttention(H, F, causal=True, qk_transform=blind, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"qk_transform with decode=True must take the tokens' positions"):
    layer(x, decode=True)
  decoder = flin.FavorAttention(num_heads=H, causal=True, decode=True, qk_transform=rope)
  params = decoder.init(jax.random.PRNGKey(0), x[:, :1])["params"]
  with pytest.raises(ValueError, match=r"needs the decode position: pass the 'cache' collection"):
    decoder.apply({"params": params, "favor": decoder.init(jax.random.PRNGKey(0), x[:, :1])["favor"]}, x[:, :1],
                  mutable=["cache"])
