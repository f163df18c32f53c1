import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from favor_jax import core, layers
from favor_jax.layers import nnx as fnnx

B, L, F, H = 2, 11, 16, 2


def _x(seed=0, length=L):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, length, F))


def _proj(m=32):
  return core.orthogonal_projection(jax.random.PRNGKey(1), m, F // H)


def test_attention_fn_in_nnx_mha_honours_mask_and_is_causal():
  x = _x()
  proj = _proj()
  mha = nnx.MultiHeadAttention(H, F, attention_fn=layers.make_attention_fn(proj), decode=False,
                               rngs=nnx.Rngs(0))
  favor = fnnx.FavorAttention(H, F, num_features=32, decode=False, rngs=nnx.Rngs(0))
  favor.projection[...] = proj
  nnx.update(favor, nnx.state(mha, nnx.Param))
  keep = 6
  pad = jnp.broadcast_to(jnp.arange(L) < keep, (B, L))
  masked = mha(x, mask=pad[:, None, None, :])
  np.testing.assert_allclose(masked, mha(x, x[:, :keep]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(masked, favor(x, mask=pad[:, None, None, :]), rtol=1e-5, atol=1e-6)
  causal = fnnx.FavorAttention(H, F, num_features=32, causal=True, decode=False, rngs=nnx.Rngs(0))
  causal.projection[...] = proj
  nnx.update(causal, nnx.state(mha, nnx.Param))
  np.testing.assert_allclose(mha(x, is_causal=True), causal(x), rtol=1e-5, atol=1e-6)


def test_softmax_params_load_and_favor_approaches_softmax():
  x = _x() * 0.5
  mha = nnx.MultiHeadAttention(H, F, decode=False, rngs=nnx.Rngs(0))
  exact = mha(x)
  errors = []
  for m in (8, 128, 2048):
    favor = fnnx.FavorAttention(H, F, num_features=m, decode=False, rngs=nnx.Rngs(m))
    assert jax.tree_util.tree_structure(nnx.state(favor, nnx.Param)) == \
        jax.tree_util.tree_structure(nnx.state(mha, nnx.Param))
    nnx.update(favor, nnx.state(mha, nnx.Param))
    errors.append(float(jnp.mean((favor(x) - exact) ** 2)))
  assert errors[0] > errors[1] > errors[2], errors


class TwoLayers(nnx.Module):
  def __init__(self, rngs, decode=False):
    self.layers = nnx.List([fnnx.FavorAttention(H, F, num_features=16, causal=True, chunk_size=4,
                                                decode=decode, rngs=rngs) for _ in range(2)])

  def __call__(self, x):
    for layer in self.layers:
      x = x + layer(x)
    return x


def test_projection_is_state_not_param_and_layers_are_independent():
  model = TwoLayers(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  assert not any("projection" in str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])
  p0, p1 = (l.projection[...] for l in model.layers)
  assert not np.allclose(p0, p1)
  x = _x()
  out = model(x)
  np.testing.assert_array_equal(out, model(x))
  fnnx.redraw(model, jax.random.PRNGKey(3))
  q0 = np.asarray(model.layers[0].projection[...])
  assert not np.allclose(q0, p0) and not np.allclose(out, model(x))
  other = TwoLayers(nnx.Rngs(0))
  fnnx.redraw(other, jax.random.PRNGKey(3))
  np.testing.assert_array_equal(other.layers[0].projection[...], q0)  # same key, same projection


def test_jitted_train_step_with_redraw_compiles_once_and_optimizer_skips_projection():
  model = TwoLayers(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x = _x()

  @nnx.jit
  @chex.assert_max_traces(n=1)
  def step(model, optimizer, step, key):
    fnnx.redraw(model, key, due=layers.redraw_due(step, 2))
    before = model.layers[0].projection[...]
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss, before

  seen = []
  for i in range(5):
    _, before = step(model, optimizer, i, jax.random.PRNGKey(i))
    np.testing.assert_array_equal(before, model.layers[0].projection[...])  # not trained
    seen.append(np.asarray(before))
  changed = [not np.array_equal(seen[i], seen[i - 1]) for i in range(1, 5)]
  assert changed == [False, True, False, True]


def test_decode_prompt_then_tokens_equals_causal_forward():
  x = _x(length=13)
  model = TwoLayers(nnx.Rngs(0))
  full = model(x)
  for layer in model.layers:
    layer.init_cache(x.shape)
  outs = [model.layers and _decode(model, x[:, :9])]
  for t in range(9, 13):
    outs.append(_decode(model, x[:, t:t + 1]))
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)


def _decode(model, x):
  for layer in model.layers:
    x = x + layer(x, decode=True)
  return x


def test_bad_configurations():
  with pytest.raises(ValueError, match="do not pass attention_fn"):
    fnnx.FavorAttention(H, F, attention_fn=lambda *a, **k: None, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=2"):
    fnnx.FavorAttention(H, F, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="decode=True needs causal=True"):
    fnnx.FavorAttention(H, F, decode=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="projection must be one of"):
    fnnx.FavorAttention(H, F, projection="gauss", rngs=nnx.Rngs(0))
  layer = fnnx.FavorAttention(H, F, causal=True, decode=False, num_features=8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="init_cache"):
    layer(_x()[:, :1], decode=True)
  with pytest.raises(ValueError, match="causal attention needs equal query and key lengths"):
    layer(_x(), _x()[:, :4])
  with pytest.raises(ValueError, match="causal_method='scan' cannot apply with decode=True"):
    fnnx.FavorAttention(H, F, causal=True, decode=True, causal_method="scan", num_features=8, rngs=nnx.Rngs(0))
  scan_layer = fnnx.FavorAttention(H, F, causal=True, decode=False, causal_method="scan", num_features=8,
                                   rngs=nnx.Rngs(0))
  scan_layer.init_cache((B, 4, F))
  with pytest.raises(ValueError, match="causal_method='scan' cannot apply with decode=True"):
    scan_layer(_x()[:, :1], decode=True)  # decode asked for at call time
  with pytest.raises(ValueError, match="attention dropout"):
    fnnx.FavorAttention(H, F, dropout_rate=0.1, decode=False, rngs=nnx.Rngs(0))(_x(), deterministic=False)
