import functools

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from favor_jax import core, layers
from favor_jax.layers import linen as flin

B, L, F, H = 2, 11, 16, 2  # features 16 -> head_dim 8
D = F // H


def _x(seed=0, length=L):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, length, F))


def _proj(m=32, seed=1):
  return core.orthogonal_projection(jax.random.PRNGKey(seed), m, F // H)


# --- drop-in attention_fn ----------------------------------------------------------------------

def test_attention_fn_in_linen_mha_honours_key_padding_mask():
  x = _x()
  mha = nn.MultiHeadDotProductAttention(num_heads=H, attention_fn=layers.make_attention_fn(_proj()))
  params = jax.jit(mha.init)(jax.random.PRNGKey(0), x)
  apply = jax.jit(mha.apply)
  keep = 7
  pad = jnp.broadcast_to(jnp.arange(L) < keep, (B, L))
  masked = apply(params, x, x, mask=pad[:, None, None, :])
  truncated = apply(params, x, x[:, :keep])  # cross-attention over the kept keys only
  np.testing.assert_allclose(masked, truncated, rtol=1e-5, atol=1e-5)
  assert not np.allclose(masked, apply(params, x))  # the mask changed something
  # Flax's helper with a [batch, 1] query side gives the same key-only mask.
  helper = nn.make_attention_mask(jnp.ones((B, 1)), pad)
  np.testing.assert_allclose(apply(params, x, mask=helper), masked, rtol=1e-6)


def test_attention_fn_refuses_what_it_cannot_honour():
  x = _x()
  fn = layers.make_attention_fn(_proj())
  q = jnp.ones((B, L, H, F // H))
  with pytest.raises(ValueError, match=r"only key-padding masks.*got mask shape \(2, 1, 11, 11\)"):
    fn(q, q, q, mask=nn.make_causal_mask(jnp.ones((B, L))))
  with pytest.raises(ValueError, match="bias"):
    fn(q, q, q, bias=jnp.zeros((B, H, L, L)))
  with pytest.raises(ValueError, match="attention dropout"):
    fn(q, q, q, dropout_rate=0.1, deterministic=False)
  with pytest.raises(ValueError, match=r"cannot honour the keyword arguments \['sinks'\]"):
    fn(q, q, q, sinks=jnp.ones(H))
  fn(q, q, q, dropout_rate=0.1, deterministic=True, out_sharding=None)  # off / None: fine
  with pytest.raises(ValueError, match="sow_weights"):
    nn.MultiHeadDotProductAttention(num_heads=H, attention_fn=fn).init(
        jax.random.PRNGKey(0), x, sow_weights=True)
  with pytest.raises(ValueError, match="unknown kernel"):
    layers.make_attention_fn(_proj(), kernel="softmax")


# --- FavorAttention ------------------------------------------------------------------------------

def test_softmax_params_load_unchanged_and_favor_approaches_softmax():
  x = _x() * 0.5
  mha = nn.MultiHeadDotProductAttention(num_heads=H)
  params = jax.jit(mha.init)(jax.random.PRNGKey(0), x)["params"]
  exact = jax.jit(mha.apply)({"params": params}, x)
  errors = []
  for m in (8, 128, 2048):
    favor = flin.FavorAttention(num_heads=H, num_features=m)
    init = jax.jit(favor.init)(jax.random.PRNGKey(m), x)
    assert jax.tree_util.tree_structure(init["params"]) == jax.tree_util.tree_structure(params)
    out = jax.jit(favor.apply)({"params": params, "favor": init["favor"]}, x)
    errors.append(float(jnp.mean((out - exact) ** 2)))
  assert errors[0] > errors[1] > errors[2], errors


class TwoLayers(nn.Module):
  @nn.compact
  def __call__(self, x, decode=False):
    for i in range(2):
      x = x + flin.FavorAttention(num_heads=H, num_features=16, causal=True, chunk_size=4, decode=decode,
                                  name=f"attn_{i}")(x)
    return x


def test_each_layer_owns_an_independent_projection_and_redraw_is_pure():
  x = _x()
  variables = jax.jit(TwoLayers().init)(jax.random.PRNGKey(0), x)
  p0, p1 = (variables["favor"][f"attn_{i}"]["projection"] for i in range(2))
  assert not np.allclose(p0, p1)
  new = flin.redraw(variables, jax.random.PRNGKey(5))
  again = flin.redraw(variables, jax.random.PRNGKey(5))
  chex.assert_trees_all_equal(new, again)  # same key, same projections
  assert not np.allclose(new["favor"]["attn_0"]["projection"], p0)
  assert not np.allclose(new["favor"]["attn_0"]["projection"], new["favor"]["attn_1"]["projection"])
  chex.assert_trees_all_equal(new["params"], variables["params"])
  apply = jax.jit(TwoLayers().apply)  # one program, not each operation compiled on its own
  out = apply(variables, x)
  np.testing.assert_array_equal(out, apply(variables, x))  # deterministic eval
  assert not np.allclose(out, apply(new, x))
  kept = flin.redraw(variables, jax.random.PRNGKey(5), due=False)
  chex.assert_trees_all_equal(kept, variables)


def test_redraw_of_frozen_variables_redraws_and_stays_frozen():
  """A FrozenDict of variables was passed through untouched (no layer redrawn, no error)."""
  x = _x()
  variables = jax.jit(TwoLayers().init)(jax.random.PRNGKey(0), x)
  frozen = flax.core.freeze(variables)
  new = flin.redraw(frozen, jax.random.PRNGKey(5))
  assert isinstance(new, flax.core.FrozenDict) and isinstance(new["favor"]["attn_0"], flax.core.FrozenDict)
  chex.assert_trees_all_equal(flax.core.unfreeze(new), flin.redraw(variables, jax.random.PRNGKey(5)))
  assert not np.allclose(new["favor"]["attn_0"]["projection"], variables["favor"]["attn_0"]["projection"])
  # A loop carry keeps its type: the redraw inside a fori_loop over frozen variables compiles.
  looped = jax.lax.fori_loop(0, 2, lambda i, v: flin.redraw(v, jax.random.PRNGKey(i)), frozen)
  assert isinstance(looped, flax.core.FrozenDict)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("per_head", [False, True])
def test_redraw_of_layers_stacked_by_nn_scan_draws_each_layer(per_head):
  """``nn.scan`` stacks each variable over the layers ([N, M, D], kinds [N]); the redraw failed on them
  (a branch index that is not a scalar). Each stacked layer gets its own orthogonal draw."""
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return x + flin.FavorAttention(num_heads=H, num_features=D, per_head_projection=per_head)(x), None

  stack = nn.scan(Block, variable_axes={"params": 0, "favor": 0}, split_rngs={"params": True}, length=3)()
  x = _x()
  variables = jax.jit(stack.init)(jax.random.PRNGKey(1), x, None)
  old = variables["favor"]["FavorAttention_0"]["projection"]
  new = flin.redraw(variables, jax.random.PRNGKey(5))["favor"]["FavorAttention_0"]["projection"]
  assert new.shape == old.shape == (3,) + ((H,) if per_head else ()) + (D, D)
  blocks = np.asarray(new, np.float64).reshape(-1, D, D)  # one [M = D, D] draw per layer (and head)
  for w in blocks:  # orthogonal rows (norms drawn as a Gaussian row's)
    gram = w @ w.T
    np.testing.assert_allclose(gram - np.diag(np.diag(gram)), 0.0, atol=1e-4 * np.max(np.diag(gram)))
  assert all(not np.allclose(blocks[i], blocks[j]) for i in range(len(blocks)) for j in range(i))
  assert not np.any(np.isclose(new, old).all(axis=(-2, -1)))
  jax.jit(stack.apply)({**variables, "favor": flin.redraw(variables, jax.random.PRNGKey(5))["favor"]}, x, None)


def test_jitted_train_step_with_redraw_schedule_compiles_once():
  x = _x()
  model = TwoLayers()
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
  tx = optax.adam(1e-3)
  opt_state = tx.init(variables["params"])

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, favor, opt_state, step, key):
    favor = flin.redraw({"favor": favor}, key, due=layers.redraw_due(step, 3))["favor"]
    loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p, "favor": favor}, x) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), favor, opt_state, loss

  params, favor = variables["params"], variables["favor"]
  seen = []
  for i in range(7):
    params, favor, opt_state, _ = step(params, favor, opt_state, i, jax.random.PRNGKey(i))
    seen.append(np.asarray(favor["attn_0"]["projection"]))
  changed = [not np.array_equal(seen[i], seen[i - 1]) for i in range(1, 7)]
  assert changed == [False, False, True, False, False, True]


def test_decode_prompt_then_tokens_equals_causal_forward():
  x = _x(length=13)
  model = TwoLayers()
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
  full = jax.jit(model.apply)(variables, x)
  cache = jax.jit(functools.partial(model.init, decode=True))(jax.random.PRNGKey(0), x[:, :1])["cache"]
  outs = []
  step = jax.jit(lambda v, x: model.apply(v, x, decode=True, mutable=["cache"]))  # one compilation per length
  out, mut = step({**variables, "cache": cache}, x[:, :9])
  outs.append(out)  # the 9-token prompt spans three chunks of 4
  for t in range(9, 13):
    out, mut = step({**variables, "cache": mut["cache"]}, x[:, t:t + 1])
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)
  assert mut["cache"]["attn_0"]["s"].shape == (B, H, 16, F // H + 1)  # O(1) in length


def test_causal_favor_plus_plus_keeps_running_rho_and_never_looks_ahead():
  x = _x()
  layer = flin.FavorAttention(num_heads=H, num_features=16, kernel="optimal_positive", causal=True)
  variables = jax.jit(layer.init)(jax.random.PRNGKey(0), x)
  np.testing.assert_array_equal(variables["favor"]["rho"], 0.0)
  train = jax.jit(functools.partial(layer.apply, deterministic=False, mutable=["favor"]))
  out, mut = train(variables, x)
  assert np.all(mut["favor"]["rho"] > 0)
  momentum_0 = flin.FavorAttention(num_heads=H, num_features=16, kernel="optimal_positive", causal=True,
                                   rho_momentum=0.0)  # ρ = this batch's statistic
  _, batch = jax.jit(functools.partial(momentum_0.apply, deterministic=False, mutable=["favor"]))(variables, x)
  np.testing.assert_allclose(mut["favor"]["rho"], 0.01 * batch["favor"]["rho"], rtol=1e-6)  # default 0.99
  later = x.at[:, 6:].set(100.0)
  out2, _ = train(variables, later)
  np.testing.assert_allclose(out2[:, :6], out[:, :6], rtol=1e-6, atol=1e-6)
  trained = {**variables, **mut}
  _, frozen = jax.jit(functools.partial(layer.apply, mutable=["favor"]))(trained, x)  # eval (deterministic): ρ stays
  np.testing.assert_array_equal(frozen["favor"]["rho"], mut["favor"]["rho"])


def test_bf16_compute():
  x = _x().astype(jnp.bfloat16)
  layer = flin.FavorAttention(num_heads=H, num_features=16, dtype=jnp.bfloat16, causal=True)
  variables = jax.jit(layer.init)(jax.random.PRNGKey(0), x)
  out = jax.jit(layer.apply)(variables, x)
  assert out.dtype == jnp.bfloat16 and variables["params"]["query"]["kernel"].dtype == jnp.float32
  assert np.all(np.isfinite(np.float32(out)))


def test_bad_configurations_and_inputs():
  x = _x()
  with pytest.raises(ValueError, match="causal attention needs equal query and key lengths"):
    flin.FavorAttention(num_heads=H, num_features=8, causal=True).init(jax.random.PRNGKey(0), x, x[:, :5])
  for method in ("scan", "cumsum", "pallas"):  # decoding runs the chunked pass and one-step recurrences only
    with pytest.raises(ValueError, match=f"causal_method='{method}' cannot apply with decode=True"):
      flin.FavorAttention(num_heads=H, num_features=8, causal=True, decode=True, causal_method=method).init(
          jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="only key-padding masks"):
    flin.FavorAttention(num_heads=H, num_features=8).init(jax.random.PRNGKey(0), x,
                                                          mask=nn.make_causal_mask(jnp.ones((B, L))))
  with pytest.raises(ValueError, match="attention dropout"):
    flin.FavorAttention(num_heads=H, num_features=8, dropout_rate=0.1).init(
        jax.random.PRNGKey(0), x, deterministic=False)
  with pytest.raises(ValueError, match="projection must be one of"):
    flin.FavorAttention(num_heads=H, projection="gaussian").init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="decode=True needs causal=True"):
    flin.FavorAttention(num_heads=H, decode=True).init(jax.random.PRNGKey(0), x)
  layer = flin.FavorAttention(num_heads=H, num_features=8)
  variables = layer.init(jax.random.PRNGKey(0), x)
  bad = {**variables, "favor": {**variables["favor"], "projection": jnp.ones((8, 3))}}
  with pytest.raises(ValueError, match=r"favor/projection must have shape \(8, 8\), got \(8, 3\)"):
    layer.apply(bad, x)
  with pytest.raises(ValueError, match="do not pass attention_fn"):
    flin.FavorAttention(num_heads=H, attention_fn=nn.dot_product_attention.__wrapped__
                        if hasattr(nn.dot_product_attention, "__wrapped__") else lambda *a, **k: None
                        ).init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="no 'favor' collection"):
    flin.redraw({"params": variables["params"]}, jax.random.PRNGKey(0))
