"""A decode state per key/value head (grouped-query attention) where that is exact, in core and both layers.

With keys whose features and gates are the same for a group's query heads (a projection shared by all heads,
no statistic of the data, gates per key/value head or none), one state per key/value head is read by the
group's query heads: decoding a prompt then one token at a time must give the full causal pass (the keys and
values repeated to the query heads), and the state must be 1/group the bytes of one per query head. Where it
is not exact, the layers keep a state per query head and say why; core refuses it by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from favor_jax import core
from favor_jax.layers import linen as flin
from favor_jax.layers import nnx as fnnx
from tests.layers.test_gqa_rotary_decode import rope  # rotary positions: decoding must place each token

B, L, F, H, M = 2, 10, 16, 4, 16
PROMPT = 6  # a prompt over two chunks of 4 (per query head, one head kept per group), then one token at a time
HEADED = ("mu", "s", "keys", "values", "decay")  # the state's leaves with a head axis


def _jiggle(params, scale=0.3):
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
  return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _bytes(tree, names):
  """Bytes of the leaves whose last key is in ``names`` (with ``names`` None: of the others)."""
  total = 0
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    name = getattr(path[-1], "key", getattr(path[-1], "name", None))
    if (name in HEADED) == (names == HEADED):
      total += x.size * x.dtype.itemsize
  return total


def _linen_decode(layer_args, x):
  layer = flin.FavorAttention(**layer_args)
  variables = jax.jit(layer.init)(jax.random.PRNGKey(1), x)
  variables = {**variables, "params": _jiggle(variables["params"])}
  full = jax.jit(layer.apply)(variables, x)
  decoder = flin.FavorAttention(**layer_args, decode=True)
  cache = jax.jit(decoder.init)(jax.random.PRNGKey(1), x[:, :1])["cache"]
  step = jax.jit(lambda v, x: decoder.apply(v, x, mutable=["cache"]))
  outs = []
  for lo, hi in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, L)]:
    out, mutated = step({**variables, "cache": cache}, x[:, lo:hi])
    cache = mutated["cache"]
    outs.append(out)
  return jnp.concatenate(outs, 1), full, cache, decoder


@pytest.mark.parametrize("kv_heads, window", [(1, 0), pytest.param(2, 3, marks=pytest.mark.slow)])
def test_linen_state_per_kv_head_decodes_the_full_pass_in_1_over_group_the_bytes(kv_heads, window):
  x = jax.random.normal(jax.random.PRNGKey(0), (B, L, F))
  args = dict(num_heads=H, num_features=M, causal=True, chunk_size=4, qk_transform=rope, window=window)
  got, full, cache, decoder = _linen_decode({**args, "num_kv_heads": kv_heads}, x)
  np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-5)
  assert decoder.clone().kv_state == (True, "")
  assert (cache["keys"].shape[2] if window else cache["s"].shape[1]) == kv_heads  # [B, W, Hkv, D]; [B, Hkv, F, Dv+1]
  per_query_head = jax.eval_shape(flin.FavorAttention(**args, decode=True).init, jax.random.PRNGKey(1),
                                  x[:, :1])["cache"]
  assert _bytes(per_query_head, HEADED) == (H // kv_heads) * _bytes(cache, HEADED)
  assert _bytes(per_query_head, None) == _bytes(cache, None)  # the segment id, index, window's slot flags


def test_nnx_state_per_kv_head_decodes_the_full_pass_in_1_over_group_the_bytes():
  x = jax.random.normal(jax.random.PRNGKey(0), (B, L, F))
  make = lambda kv: fnnx.FavorAttention(H, F, num_features=M, causal=True, chunk_size=4, qk_transform=rope,
                                        num_kv_heads=kv, decode=False, rngs=nnx.Rngs(1))
  layer = make(2)
  nnx.update(layer, _jiggle(nnx.state(layer, nnx.Param)))
  assert layer.kv_state == (True, "")
  full = nnx.jit(lambda m, x: m(x))(layer, x)
  layer.init_cache(x.shape)
  step = nnx.jit(lambda m, x: m(x, decode=True))
  outs = [step(layer, x[:, :PROMPT])] + [step(layer, x[:, t:t + 1]) for t in range(PROMPT, L)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)
  mha = make(None)
  mha.init_cache(x.shape)
  grouped, per_query_head = nnx.state(layer, nnx.Cache), nnx.state(mha, nnx.Cache)
  assert layer.decode_state.get_value().s.shape[1] == 2
  assert _bytes(per_query_head, HEADED) == 2 * _bytes(grouped, HEADED) > 0


@pytest.mark.parametrize("fields, why", [
    (dict(forget_gate=True), "forget gate is per query head"),
    (dict(alibi=True), "ALiBi's slopes are per query head"),
    (dict(per_head_projection=True), "projection is per query head"),
    (dict(kernel="optimal_positive"), "takes a statistic of the data per query head"),
])
def test_where_not_exact_the_layers_keep_a_state_per_query_head_and_say_why(fields, why):
  x = jnp.ones((1, 3, F))
  layer = flin.FavorAttention(num_heads=H, num_kv_heads=2, num_features=M, causal=True, decode=True, **fields)
  exact, reason = layer.clone().kv_state
  assert not exact and why in reason
  cache = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x[:, :1])["cache"]
  assert cache["s"].shape[1] == H
  nnx_layer = fnnx.FavorAttention(H, F, num_kv_heads=2, num_features=M, causal=True, decode=False,
                                  rngs=nnx.Rngs(0), **fields)
  assert not nnx_layer.kv_state[0] and why in nnx_layer.kv_state[1]
  nnx_layer.init_cache(x.shape)
  assert nnx_layer.decode_state.get_value().s.shape[1] == H


Q = jax.random.normal(jax.random.PRNGKey(1), (B, L, H, 8))
K = jax.random.normal(jax.random.PRNGKey(2), (B, L, 2, 8))
V = jax.random.normal(jax.random.PRNGKey(3), (B, L, 2, 8))
GATE = jax.nn.log_sigmoid(2.0 + jax.random.normal(jax.random.PRNGKey(4), (B, L, 2)))  # per key/value head
PROJECTION = jax.random.normal(jax.random.PRNGKey(5), (M, 8))


@pytest.mark.parametrize("kernel, projection", [("positive", PROJECTION),
                                                pytest.param("elu_plus_one", None, marks=pytest.mark.slow)])
def test_core_grouped_decode_with_gates_per_kv_head_equals_the_full_pass_on_repeated_heads(kernel, projection):
  rep = lambda x: jnp.repeat(x, H // 2, axis=-1 if x.ndim == 3 else -2)
  full = jax.jit(lambda q, k, v, g: core.favor_attention(q, k, v, projection, kernel=kernel, causal=True,
                                                        log_gate=g))(Q, rep(K), rep(V), rep(GATE))
  state = core.favor_decode_init(Q[:, :1], V[:, :1], projection, kernel=kernel)
  assert state.s.shape[-3] == 2 and state.mu.shape[-2] == 2
  step = jax.jit(lambda state, lo, hi: core.favor_decode_step(
      state, Q[:, lo:hi], K[:, lo:hi], V[:, lo:hi], projection, kernel=kernel, chunk_size=2, log_gate=GATE[:, lo:hi]),
      static_argnums=(1, 2))
  state, first = step(state, 0, 4)
  outs = [first]
  one = jax.jit(lambda state, t: core.favor_decode_step(
      state, *(jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1) for x in (Q, K, V)), projection, kernel=kernel,
      log_gate=jax.lax.dynamic_slice_in_dim(GATE, t, 1, axis=1)))
  for t in range(4, L):
    state, out = one(state, t)
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_core_refuses_a_state_per_kv_head_where_it_is_not_exact():
  state = core.favor_decode_init(Q[:, :1], V[:, :1], PROJECTION)
  one = lambda **kw: core.favor_decode_step(state, Q[:, :1], K[:, :1], V[:, :1], kw.pop("projection", PROJECTION),
                                            **kw)
  with pytest.raises(ValueError, match=r"log_gate has 4 heads .* one gate per key/value head"):
    one(log_gate=jnp.zeros((B, 1, H)))
  with pytest.raises(ValueError, match=r"projection has shape \(4, 16, 8\), one per query head"):
    one(projection=jnp.stack([PROJECTION] * H))
  with pytest.raises(ValueError, match=r"kernel 'optimal_positive' takes a statistic of the data"):
    core.favor_decode_init(Q[:, :1], V[:, :1], PROJECTION, kernel="optimal_positive")
  with pytest.raises(ValueError, match=r"value has 3 heads and query 4: .* must divide"):
    core.favor_decode_init(Q[:, :1], jnp.zeros((B, 1, 3, 8)), PROJECTION)
  with pytest.raises(ValueError, match=r"state is a RecurrentState with shapes"):  # a state per query head
    core.favor_decode_step(core.favor_decode_init(Q[:, :1], Q[:, :1], PROJECTION), Q[:, :1], K[:, :1], V[:, :1],
                           PROJECTION)
