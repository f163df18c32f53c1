"""The layers' ``causal_method``: the fused Pallas pass (interpreted here) inside Linen and NNX layers gives
the outputs and parameter gradients of the per-token scan through the same layer; choices a layer cannot
honour (hybrid windows, sequence-parallel, bidirectional attention, unknown names) stop with a clear error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from favor_jax import core, layers
from favor_jax.layers import linen as flin
from favor_jax.layers import nnx as fnnx

B, L, F, H, M = 2, 40, 32, 2, 16  # head_dim 16; three chunks of 16, the last partial


def _x():
  return 3.0 * jax.random.normal(jax.random.PRNGKey(0), (B, L, F))


def test_linen_layer_with_the_fused_pass_equals_the_scan_outputs_and_gradients():
  x = _x()
  make = lambda method: flin.FavorAttention(num_heads=H, num_features=M, causal=True, chunk_size=16,
                                            causal_method=method)
  variables = jax.jit(make("scan").init)(jax.random.PRNGKey(1), x)

  def loss(params, method):
    out = make(method).apply({**variables, "params": params}, x)
    return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

  value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)  # one program per method
  (_, want), g_want = value_and_grad(variables["params"], "scan")
  (_, got), g_got = value_and_grad(variables["params"], "pallas")
  np.testing.assert_allclose(got, want, atol=1e-5 * np.max(np.abs(want)))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree_util.tree_leaves(g_want)):
    np.testing.assert_allclose(a, b, atol=2e-5 * np.max(np.abs(b)), err_msg=jax.tree_util.keystr(path))


def test_nnx_layer_with_the_fused_pass_equals_the_scan():
  x = _x()
  make = lambda method: fnnx.FavorAttention(H, F, num_features=M, causal=True, chunk_size=16, causal_method=method,
                                            decode=False, rngs=nnx.Rngs(3))
  run = nnx.jit(lambda m, x: m(x))
  want, got = run(make("scan"), x), run(make("pallas"), x)  # same seed: same parameters and projection
  np.testing.assert_allclose(got, want, atol=1e-5 * np.max(np.abs(want)))


def test_layers_refuse_causal_methods_they_cannot_honour():
  with pytest.raises(ValueError, match="unknown causal_method 'fast'"):
    flin.FavorAttention(num_heads=H, causal=True, causal_method="fast").init(jax.random.PRNGKey(0), _x())
  with pytest.raises(ValueError, match="causal_method='pallas' cannot apply with window > 0"):
    fnnx.FavorAttention(H, F, causal=True, window=8, causal_method="pallas", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="causal_method='scan' cannot apply with window > 0"):
    layers.make_attention_fn(None, kernel="taylor", causal=True, window=4, causal_method="scan")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
  with pytest.raises(ValueError, match="cannot apply with sequence_axis"):
    flin.FavorAttention(num_heads=H, causal=True, mesh=mesh, sequence_axis="seq",
                        causal_method="pallas").init(jax.random.PRNGKey(0), _x())
  # bidirectional attention has no fused kernel: "pallas" there is refused, not run as the XLA pass
  no_fused = "causal_method='pallas' asks for the fused causal kernels; bidirectional attention"
  with pytest.raises(ValueError, match=no_fused):
    flin.FavorAttention(num_heads=H, causal_method="pallas").init(jax.random.PRNGKey(0), _x())
  with pytest.raises(ValueError, match=no_fused):
    fnnx.FavorAttention(H, F, causal_method="pallas", rngs=nnx.Rngs(0))
  proj = core.orthogonal_projection(jax.random.PRNGKey(1), M, F // H)
  qkv = jnp.reshape(_x()[:, :16], (B, 16, H, F // H))
  with pytest.raises(ValueError, match=no_fused):  # its direction is known at the call (NNX's is_causal)
    layers.make_attention_fn(proj, causal_method="pallas")(qkv, qkv, qkv)
  assert layers.make_attention_fn(proj, causal_method="pallas")(qkv, qkv, qkv, is_causal=True).shape == qkv.shape
