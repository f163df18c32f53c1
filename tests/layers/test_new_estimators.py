"""The layers with the estimators beyond FAVOR+: every kernel of ``core.KERNELS``, per-head and learned
projections, hybrid windows, a smaller query/key head dim, decoding and Hedgehog distillation; each
against the core function called with the layer's own params, exact softmax, or an explicit formula."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from favor_jax import core, layers
from favor_jax.layers import linen as flin
from favor_jax.layers import nnx as fnnx

B, L, F, H = 2, 9, 16, 2
D = F // H  # head dim 8
M = 16
DENSE = ("query", "key", "value", "out")


def _x(seed=0, length=L):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, length, F))


def _role(kernel):
  """What the layer must keep for ``kernel``, read off the core's kernel record."""
  kern = core.KERNELS[kernel]
  return "learned" if kern.learned else "random" if kern.needs_projection else "none"


def _sizes(kernel):
  """num_features for kernels that draw a projection; none for the others (they refuse it)."""
  return {"num_features": M} if _role(kernel) == "random" else {}


def _qkv(params, x):
  dense = lambda name: jnp.einsum("blf,fhd->blhd", x, params[name]["kernel"]) + params[name]["bias"]
  return dense("query"), dense("key"), dense("value")


def _out(params, attended):
  return jnp.einsum("blhd,hdf->blf", attended, params["out"]["kernel"]) + params["out"]["bias"]


def _nnx_params(layer):
  return {name: {"kernel": getattr(layer, name).kernel[...], "bias": getattr(layer, name).bias[...]}
          for name in DENSE}


_nnx_apply = nnx.jit(lambda m, x: m(x))  # an NNX layer's call, one program per layer and shape


def _nnx_layer(kernel="positive", **kw):
  return fnnx.FavorAttention(H, F, kernel=kernel, rngs=nnx.Rngs(0), **{"decode": False, **kw})


def _init(layer, *inputs):
  """layer.init, jitted (one compile beats op-by-op tracing of the init pass); applies run eagerly."""
  return jax.jit(layer.init)(jax.random.PRNGKey(0), *inputs)


_redraw = jax.jit(flin.redraw)  # one trace for every call below (the projection kind is a traced index)


def _identity(*lead):
  return np.broadcast_to(np.eye(D, dtype=np.float32), lead + (D, D))


# --- every kernel of the registry --------------------------------------------------------------------

def _linen_run(kernel, x, **kw):
  layer = flin.FavorAttention(num_heads=H, kernel=kernel, **kw)
  out, variables = jax.jit(layer.init_with_output)(jax.random.PRNGKey(0), x)
  role = _role(kernel)
  if role == "random":
    projection = variables["favor"]["projection"]
  else:
    assert "favor" not in variables  # nothing drawn
    projection = variables["params"].get("feature_map")
  return out, variables["params"], projection


def _nnx_run(kernel, x, **kw):
  layer = _nnx_layer(kernel, **kw)
  projection = layer._projection()
  if _role(kernel) != "random":
    assert layer.projection is None
  return _nnx_apply(layer, x), _nnx_params(layer), projection


RUN = {"linen": _linen_run, "nnx": _nnx_run}


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("kernel", sorted(core.KERNELS))
@pytest.mark.parametrize("api", sorted(RUN))
def test_every_core_kernel_runs_in_the_layers_as_core_does_with_the_layers_own_params(api, kernel):
  x = _x()
  got, params, projection = RUN[api](kernel, x, **_sizes(kernel))
  role = _role(kernel)
  if role == "none":
    assert projection is None
  elif role == "learned":
    np.testing.assert_array_equal(projection, _identity(H))  # per head, the identity at init
  else:
    assert projection.shape == (M, D)
  q, k, v = _qkv(params, x)
  want = _out(params, jax.jit(lambda q, k, v, p: core.favor_attention(q, k, v, p, kernel=kernel))(q, k, v, projection))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_arguments_a_kernel_cannot_use_are_refused_by_name():
  x = _x()
  init = lambda **kw: flin.FavorAttention(num_heads=H, **kw).init(jax.random.PRNGKey(0), x)
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  cases = [
      (dict(kernel="taylor", num_features=16), r"kernel 'taylor' uses no projection.*got num_features=16"),
      (dict(kernel="elu_plus_one", num_features=256), r"got num_features=256"),
      (dict(kernel="taylor", projection="iid"), r"got projection='iid'"),
      (dict(kernel="hedgehog", num_features=8), r"kernel 'hedgehog' learns its feature map.*num_features=8"),
      (dict(kernel="taylor", per_head_projection=True), r"per_head_projection=True: kernel 'taylor'"),
      (dict(per_head_projection="yes"), r"per_head_projection must be None, True or False, got 'yes'"),
      (dict(kernel="favor_sharp"), r"unknown kernel 'favor_sharp'"),
      (dict(num_features=0), r"num_features must be a positive int or None, got 0"),
      (dict(window=-1), r"window must be an int >= 0.*got -1"),
      (dict(window=True), r"window must be an int >= 0.*got True"),
      (dict(window=2.0), r"window must be an int >= 0.*got 2.0"),
      (dict(qk_head_dim=0), r"qk_head_dim must be a positive int or None, got 0"),
      (dict(window=2, decode=True), r"decode=True needs causal=True"),
      (dict(window=2, mesh=mesh, sequence_axis="seq"), r"window=2: hybrid attention is not sequence-parallel"),
      (dict(mesh=mesh), r"needs both mesh and sequence_axis \(or neither\)"),
      (dict(sequence_axis="seq"), r"needs both mesh and sequence_axis \(or neither\)"),
      (dict(causal=True, decode=True, mesh=mesh, sequence_axis="seq"), r"decode=True is token by token"),
      (dict(causal=True, causal_method="scan", mesh=mesh, sequence_axis="seq"),
       r"causal_method='scan' cannot apply with sequence_axis"),
  ]
  for kwargs, message in cases:  # Linen checks at init, NNX at construction
    with pytest.raises(ValueError, match=message):
      init(**kwargs)
    with pytest.raises(ValueError, match=message):
      _nnx_layer(**kwargs)
  flip = lambda q, k: (q, k[..., ::-1])
  with pytest.raises(ValueError, match=r"qk_transform with decode=True must take the tokens. positions"):
    init(causal=True, decode=True, qk_transform=flip)
  with pytest.raises(ValueError, match=r"qk_transform with decode=True must take the tokens. positions"):
    _nnx_layer(causal=True, decode=True, qk_transform=flip)
  with pytest.raises(ValueError, match=r"qk_transform with decode=True must take the tokens. positions"):
    _nnx_layer(causal=True, qk_transform=flip)(x, decode=True)  # decode asked for at call time
  with pytest.raises(TypeError, match=r"qk_transform must be a callable .*got str"):
    init(qk_transform="rotary")
  with pytest.raises(TypeError, match=r"qk_transform must be a callable .*got str"):
    _nnx_layer(qk_transform="rotary")
  bad_transforms = [(lambda q, k: (q, k, k), TypeError, r"must return a pair \(query, key\), got tuple of 3"),
                    (lambda q, k: None, TypeError, r"must return a pair \(query, key\), got NoneType"),
                    (lambda q, k: (q[:, :4], k), ValueError, r"its query has shape \(2, 4, 2, 8\), needs \(2, 9"),
                    (lambda q, k: (q, k[..., :4]), ValueError, r"its key has shape \(2, 9, 2, 4\), needs"),
                    (lambda q, k: (q, k.astype(jnp.int32)), TypeError, r"floating arrays; its key is .* int32"),
                    (lambda q, k: (q.astype(jnp.bfloat16), k), TypeError,
                     r"narrower dtype; its query is bfloat16, given float32")]
  for transform, error, message in bad_transforms:  # checked where it is called: Linen's init, NNX's call
    with pytest.raises(error, match="qk_transform .*" + message):
      init(qk_transform=transform)
    with pytest.raises(error, match="qk_transform .*" + message):
      _nnx_layer(qk_transform=transform)(x)
  widen = lambda q, k: (q.astype(jnp.float32), k.astype(jnp.float32))  # a bfloat16 layer's transform in float32
  assert init(qk_transform=widen, dtype=jnp.bfloat16)  # is taken: nothing is rounded
  layer = _nnx_layer(causal=True, mesh=mesh, sequence_axis="seq")  # decode asked for at call time
  with pytest.raises(ValueError, match=r"decode=True is token by token; it cannot be sequence-parallel"):
    layer(x, decode=True)
  with pytest.raises(ValueError, match=r"window must be an int >= 0.*got -3"):
    layers.make_attention_fn(None, kernel="taylor", window=-3)
  with pytest.raises(ValueError, match="init_cache: decoding needs causal=True"):
    _nnx_layer(num_features=M).init_cache(x.shape)


# --- qk_transform -------------------------------------------------------------------------------------

@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("api", sorted(RUN))
def test_qk_transform_reaches_the_features_in_both_layers(api, causal):
  """A transform of (query, key) is what the features see: a zeroed key gives every key the same feature
  vector, so the output is the (prefix) mean of the values, whatever the random features; and any transform
  equals core's attention of the transformed projections with the layer's own params."""
  x = _x()
  shift = lambda q, k: (2.0 * q + 0.1, k[..., ::-1])  # reverses each head's key dims
  zero_key = lambda q, k: (q, 0.0 * k)
  for transform in (shift, zero_key):
    got, params, projection = RUN[api]("positive", x, num_features=M, causal=causal, qk_transform=transform)
    q, k, v = _qkv(params, x)
    favor = jax.jit(functools.partial(core.favor_attention, causal=causal))
    want = _out(params, favor(*transform(q, k), v, projection))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  count = jnp.arange(1, L + 1)[None, :, None, None]
  mean_v = jnp.cumsum(v, axis=1) / count if causal else jnp.broadcast_to(v.mean(1, keepdims=True), v.shape)
  np.testing.assert_allclose(got, _out(params, mean_v), rtol=1e-5, atol=1e-5)


# --- per-head projections ----------------------------------------------------------------------------

@jax.jit
def _each_head_alone(q, k, v, projection):
  heads = [core.favor_attention(q[..., h:h + 1, :], k[..., h:h + 1, :], v[..., h:h + 1, :], projection[h])
           for h in range(H)]
  return jnp.concatenate(heads, axis=-2)


def _assert_independent_orthogonal_heads(projection, old=None):
  """[H, 6, D] with 6 ≤ D: each head's rows are exactly orthogonal (one orthogonal block), heads differ."""
  assert projection.shape == (H, 6, D)
  assert not np.allclose(projection[0], projection[1])
  if old is not None:
    assert not np.allclose(projection, old)
  for p in np.asarray(projection):
    gram = p @ p.T
    np.testing.assert_allclose(gram - np.diag(np.diag(gram)), 0.0, atol=1e-4)


def test_linen_per_head_projection_equals_each_head_alone_and_redraws_per_head():
  x = _x()
  layer = flin.FavorAttention(num_heads=H, num_features=6, per_head_projection=True)
  variables = _init(layer, x)
  p = variables["favor"]["projection"]
  _assert_independent_orthogonal_heads(p)
  q, k, v = _qkv(variables["params"], x)
  want = _out(variables["params"], _each_head_alone(q, k, v, p))
  np.testing.assert_allclose(jax.jit(layer.apply)(variables, x), want, rtol=1e-5, atol=1e-5)
  new = _redraw(variables, jax.random.PRNGKey(5))
  _assert_independent_orthogonal_heads(new["favor"]["projection"], old=p)
  np.testing.assert_array_equal(_redraw(variables, jax.random.PRNGKey(5))["favor"]["projection"],
                                new["favor"]["projection"])
  np.testing.assert_array_equal(_redraw(variables, jax.random.PRNGKey(5), due=False)["favor"]["projection"],
                                p)
  with_favor = lambda proj: {**variables, "favor": {**variables["favor"], "projection": proj}}
  with pytest.raises(ValueError, match=r"shape \[M, D\] or \[H, M, D\], got \(1, 2, 6, 8\)"):
    _redraw(with_favor(jnp.ones((1, H, 6, D))), jax.random.PRNGKey(5))
  with pytest.raises(ValueError, match=r"favor/projection must have shape \(2, 6, 8\), got \(6, 8\)"):
    layer.apply(with_favor(jnp.ones((6, D))), x)


def test_nnx_per_head_projection_equals_each_head_alone_and_redraws_per_head():
  x = _x()
  layer = _nnx_layer(num_features=6, per_head_projection=True, projection="simplex")
  p = np.asarray(layer.projection[...])
  assert p.shape == (H, 6, D) and not np.allclose(p[0], p[1])
  params = _nnx_params(layer)
  q, k, v = _qkv(params, x)
  got = _nnx_apply(layer, x)
  np.testing.assert_allclose(got, _out(params, _each_head_alone(q, k, v, p)), rtol=1e-5, atol=1e-5)
  layer.redraw(jax.random.PRNGKey(3), due=False)
  np.testing.assert_array_equal(layer.projection[...], p)
  fnnx.redraw(layer, jax.random.PRNGKey(3))
  fresh = np.asarray(layer.projection[...])
  assert fresh.shape == (H, 6, D) and not np.allclose(fresh, p) and not np.allclose(fresh[0], fresh[1])
  # simplex rows within one head: pairwise cosine −1/(D−1)
  unit = fresh / np.linalg.norm(fresh, axis=-1, keepdims=True)
  cos = np.einsum("hmd,hnd->hmn", unit, unit)[:, ~np.eye(6, dtype=bool)]
  np.testing.assert_allclose(cos, -1 / (D - 1), atol=1e-5)
  layer.projection.set_value(jnp.ones((6, D)))
  with pytest.raises(ValueError, match=r"projection must have shape \(2, 6, 8\).*got \(6, 8\)"):
    layer.redraw(jax.random.PRNGKey(4))


# --- learned feature map (Hedgehog) ------------------------------------------------------------------

def test_linen_hedgehog_feature_map_is_a_trained_identity_initialised_param_never_redrawn():
  x = _x()
  layer = flin.FavorAttention(num_heads=H, kernel="hedgehog")
  variables = _init(layer, x)
  assert set(variables) == {"params"}
  np.testing.assert_array_equal(variables["params"]["feature_map"], _identity(H))
  w = variables["params"]["feature_map"] + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (H, D, D))
  params = {**variables["params"], "feature_map": w}
  q, k, v = _qkv(params, x)
  want = _out(params, core.favor_attention(q, k, v, w, kernel="hedgehog"))
  np.testing.assert_allclose(layer.apply({"params": params}, x), want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="no 'favor' collection.*hedgehog"):
    _redraw(variables, jax.random.PRNGKey(0))
  shared = flin.FavorAttention(num_heads=H, kernel="hedgehog", per_head_projection=False)
  np.testing.assert_array_equal(_init(shared, x)["params"]["feature_map"], _identity())
  with pytest.raises(ValueError, match=r"params/feature_map must have shape \(8, 8\), got \(2, 8, 8\)"):
    shared.apply({"params": params}, x)


def test_nnx_hedgehog_feature_map_is_an_optimised_param_and_redraw_leaves_it():
  x = _x()
  layer = _nnx_layer("hedgehog")
  assert layer.projection is None
  np.testing.assert_array_equal(layer.feature_map[...], _identity(H))
  assert "feature_map" in nnx.state(layer, nnx.Param)
  optimizer = nnx.Optimizer(layer, optax.sgd(0.1), wrt=nnx.Param)
  optimizer.update(layer, nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(layer))
  assert not np.allclose(layer.feature_map[...], _identity(H))
  with pytest.raises(ValueError, match="no random projection to redraw.*feature_map is trained"):
    layer.redraw(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match=r"no FavorAttention layer with a random projection.*'hedgehog'"):
    fnnx.redraw(layer, jax.random.PRNGKey(0))


# --- hybrid windows ----------------------------------------------------------------------------------

def test_linen_window_is_core_hybrid_and_a_full_window_is_flax_softmax_attention():
  x = _x() * 0.7
  layer = lambda window, causal=True: flin.FavorAttention(num_heads=H, num_features=M, window=window,
                                                          causal=causal)
  apply = lambda window, causal=True: jax.jit(layer(window, causal).apply)(variables, x)
  variables = _init(layer(3), x)
  params, projection = variables["params"], variables["favor"]["projection"]
  q, k, v = _qkv(params, x)
  hybrid = jax.jit(functools.partial(core.hybrid_attention, window=3, causal=True))
  want = _out(params, hybrid(q, k, v, projection))
  np.testing.assert_allclose(apply(3), want, rtol=1e-5, atol=1e-5)
  mha = nn.MultiHeadDotProductAttention(num_heads=H)
  exact = jax.jit(mha.apply)({"params": params}, x, mask=nn.make_causal_mask(x[..., 0]))
  np.testing.assert_allclose(apply(L), exact, rtol=1e-5, atol=1e-5)
  # bidirectional: |t − j| < L covers every key
  np.testing.assert_allclose(apply(L, causal=False), jax.jit(mha.apply)({"params": params}, x),
                             rtol=1e-5, atol=1e-5)
  fn = layers.make_attention_fn(projection, causal=True, window=L)  # the drop-in attention_fn in Flax's module
  np.testing.assert_allclose(jax.jit(nn.MultiHeadDotProductAttention(num_heads=H, attention_fn=fn).apply)(
      {"params": params}, x), exact, rtol=1e-5, atol=1e-5)


def test_nnx_full_window_is_flax_softmax_attention():
  x = _x() * 0.7
  mha = nnx.MultiHeadAttention(H, F, decode=False, rngs=nnx.Rngs(0))
  for window in (L, 3):
    layer = _nnx_layer("taylor", window=window, causal=True)
    nnx.update(layer, nnx.state(mha, nnx.Param))
    exact = nnx.jit(lambda m, x, mask: m(x, mask=mask))(mha, x, nn.make_causal_mask(x[..., 0]))
    got = _nnx_apply(layer, x)
    if window == L:
      np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
    else:
      q, k, v = _qkv(_nnx_params(layer), x)
      hybrid = jax.jit(functools.partial(core.hybrid_attention, window=3, kernel="taylor", causal=True))(q, k, v, None)
      np.testing.assert_allclose(got, _out(_nnx_params(layer), hybrid), rtol=1e-5, atol=1e-5)
      assert not np.allclose(got, exact, atol=1e-3)


# --- query/key head dim below the value head dim (Based) -----------------------------------------------

def _taylor_reference(params, x):
  """The explicit quadratic form, float64: w_tj = 1 + s + s²/2, s = q_t·k_j/√d_qk, j ≤ t; rows normalised."""
  q, k, v = (np.asarray(a, np.float64) for a in _qkv(params, x))
  s = np.einsum("bthd,bjhd->bhtj", q, k) / np.sqrt(q.shape[-1])
  w = (1 + s + s * s / 2) * np.tril(np.ones((x.shape[1],) * 2))
  attended = np.einsum("bhtj,bjhd->bthd", w / w.sum(-1, keepdims=True), v)
  return np.asarray(_out(params, jnp.asarray(attended, jnp.float32)))


def test_taylor_with_a_smaller_query_key_head_dim_equals_the_explicit_quadratic_form():
  x = _x()
  layer = flin.FavorAttention(num_heads=H, kernel="taylor", qk_head_dim=4, causal=True)
  variables = _init(layer, x)
  params = variables["params"]
  assert params["query"]["kernel"].shape == params["key"]["kernel"].shape == (F, H, 4)
  assert params["value"]["kernel"].shape == (F, H, D) and params["out"]["kernel"].shape == (H, D, F)
  np.testing.assert_allclose(layer.apply(variables, x), _taylor_reference(params, x), rtol=1e-5, atol=1e-5)
  nnx_layer = _nnx_layer("taylor", qk_head_dim=4, causal=True, normalize_qk=True)
  assert nnx_layer.query.kernel.shape == nnx_layer.key.kernel.shape == (F, H, 4)
  assert nnx_layer.value.kernel.shape == (F, H, D) and nnx_layer.query_ln.scale.shape == (4,)
  nnx_layer.normalize_qk = False  # the reference has no LayerNorm
  want = _taylor_reference(_nnx_params(nnx_layer), x)
  np.testing.assert_allclose(nnx_layer(x), want, rtol=1e-5, atol=1e-5)


# --- decoding ----------------------------------------------------------------------------------------

# Each API decodes one constant-size recurrent state and one hybrid (window) state; between them every new
# kernel, per-head projections and Dv ≠ D.
LINEN_DECODE = {
    "taylor_qk4": dict(kernel="taylor", qk_head_dim=4),
    "per_head_window": dict(num_features=M, per_head_projection=True, window=3),
}
NNX_DECODE = {
    "hedgehog": dict(kernel="hedgehog"),
    "saderf_window": dict(kernel="saderf", num_features=M, window=2),
}
PROMPT, LENGTH = 4, 7


def _pieces(x):
  return (x[:, :PROMPT], *(x[:, t:t + 1] for t in range(PROMPT, x.shape[1])))


@pytest.mark.parametrize("case", sorted(LINEN_DECODE))
def test_linen_decoding_token_by_token_equals_the_causal_layer(case):
  kw = LINEN_DECODE[case]
  x = _x(length=LENGTH)
  full_layer = flin.FavorAttention(num_heads=H, causal=True, **kw)
  full, variables = jax.jit(full_layer.init_with_output)(jax.random.PRNGKey(0), x)
  decoder = flin.FavorAttention(num_heads=H, causal=True, decode=True, **kw)
  cache = _init(decoder, x[:, :1])["cache"]
  if kw.get("window"):
    qk = kw.get("qk_head_dim", D)
    assert cache["keys"].shape == (B, kw["window"], H, qk) and cache["values"].shape == (B, kw["window"], H, D)
  outs = []
  step = jax.jit(functools.partial(decoder.apply, mutable=["cache"]))
  for piece in _pieces(x):
    out, mutated = step({**variables, "cache": cache}, piece)
    cache = mutated["cache"]
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("case", sorted(NNX_DECODE))
def test_nnx_decoding_token_by_token_equals_the_causal_layer(case):
  x = _x(length=LENGTH)
  layer = _nnx_layer(causal=True, **NNX_DECODE[case])
  if "hedgehog" in case:
    layer.feature_map[...] += 0.3 * jax.random.normal(jax.random.PRNGKey(1), (H, D, D))
  full = _nnx_apply(layer, x)
  layer.init_cache(x.shape)
  step = nnx.jit(lambda m, x: m(x, decode=True))  # the decode state and its index update in place
  outs = [step(layer, piece) for piece in _pieces(x)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)


# --- running statistic of a data-dependent kernel ------------------------------------------------------

def test_causal_saderf_keeps_a_running_statistic_shaped_by_its_record_and_never_looks_ahead():
  x = _x()
  layer = flin.FavorAttention(num_heads=H, num_features=M, kernel="saderf", causal=True, rho_momentum=0.9)
  variables = _init(layer, x)
  np.testing.assert_array_equal(variables["favor"]["rho"], np.zeros((H, D + 1)))  # log Ψ per coordinate, ρ
  train = functools.partial(layer.apply, deterministic=False, mutable=["favor"])
  out, mutated = train(variables, x)
  q, k, _ = _qkv(variables["params"], x)
  want = 0.1 * core.kernels.saderf_statistic(q, k).mean(0)
  np.testing.assert_allclose(mutated["favor"]["rho"], want, rtol=1e-5, atol=1e-7)
  later, _ = train(variables, x.at[:, 5:].set(100.0))
  np.testing.assert_allclose(later[:, :5], out[:, :5], rtol=1e-6, atol=1e-6)

  nnx_layer = _nnx_layer("saderf", num_features=M, causal=True, rho_momentum=0.9)
  np.testing.assert_array_equal(nnx_layer.statistic[...], np.zeros((H, D + 1)))
  nnx_layer(x, deterministic=False)
  q, k, _ = _qkv(_nnx_params(nnx_layer), x)
  np.testing.assert_allclose(nnx_layer.statistic[...], 0.1 * core.kernels.saderf_statistic(q, k).mean(0),
                             rtol=1e-5, atol=1e-7)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("api", sorted(RUN))
def test_padded_self_attention_of_a_data_dependent_kernel_gives_the_unpadded_rows(api):
  """A bidirectional FAVOR++/FAVOR# layer on a padded batch (junk in the padding, a Flax key-padding mask):
  its real rows equal the same layer's on the unpadded sequences, as softmax's would (self-attention: the
  padding mask is the queries' too, left out of the statistic). A causal layer's running statistic takes
  this batch's statistic over real queries and keys alone."""
  real = 6
  x = _x()
  padded = x.at[:, real:].set(40.0)
  mask = jnp.broadcast_to(jnp.arange(L) < real, (B, L))[:, None, None, :]
  for kernel in core.kernels.data_dependent_names():
    if api == "linen":
      layer = flin.FavorAttention(num_heads=H, num_features=M, kernel=kernel)
      variables, apply = _init(layer, x), jax.jit(layer.apply)
      got, want = apply(variables, padded, mask=mask), apply(variables, x[:, :real])
    else:
      layer = _nnx_layer(kernel, num_features=M)
      run = nnx.jit(lambda m, x, mask: m(x, mask=mask))
      got, want = run(layer, padded, mask), run(layer, x[:, :real], None)
    np.testing.assert_allclose(got[:, :real], want, atol=1e-5, err_msg=kernel)
  if api == "linen":
    layer = flin.FavorAttention(num_heads=H, num_features=M, kernel="saderf", causal=True, rho_momentum=0.5)
    variables = _init(layer, x)
    train = jax.jit(functools.partial(layer.apply, variables, deterministic=False, mutable=["favor"]))
    stat, want = (train(padded, mask=mask)[1]["favor"]["rho"], train(x[:, :real])[1]["favor"]["rho"])
  else:
    layer, twin = (_nnx_layer("saderf", num_features=M, causal=True, rho_momentum=0.5) for _ in range(2))
    train = nnx.jit(lambda m, x, mask: m(x, mask=mask, deterministic=False))
    train(layer, padded, mask)
    train(twin, x[:, :real], None)
    stat, want = layer.statistic[...], twin.statistic[...]
  np.testing.assert_allclose(stat, want, rtol=1e-5, atol=1e-7)


@functools.cache
def _linen_momentum_layer(kernel, dtype):
  """A causal Linen layer with ρ momentum 0.5: its init and its training apply, jitted once per kernel and
  dtype (the scales share the programs)."""
  layer = flin.FavorAttention(num_heads=H, num_features=M, kernel=kernel, causal=True, rho_momentum=0.5, dtype=dtype)
  return jax.jit(layer.init), jax.jit(functools.partial(layer.apply, deterministic=False, mutable=["favor"]))


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale", [1.0, 20.0])
@pytest.mark.parametrize("api", sorted(RUN))
def test_a_batch_element_of_padding_alone_leaves_the_running_statistic_alone(api, scale, dtype):
  """An element with no real token has no statistic: it counted as 0 in the batch mean (halving ρ here);
  the running value is 0.5·old + 0.5·(mean over the real elements), and a batch of padding keeps it.
  Inputs ×1 and ×20; a bfloat16 layer against the statistic of its own rounded q and k."""
  x = scale * _x()
  tol = dict(rtol=1e-5, atol=1e-7) if dtype == "float32" else dict(rtol=1e-2, atol=1e-4)
  batch = jnp.concatenate([x, 40.0 * jnp.ones_like(x)])  # B real elements, then B of padding (junk)
  real_B = jnp.arange(2 * B) < B
  mask = jnp.broadcast_to(real_B[:, None], (2 * B, L))[:, None, None, :]
  nothing = jnp.zeros_like(mask)  # a batch of padding only
  for kernel in core.kernels.data_dependent_names():
    if api == "linen":
      init, train = _linen_momentum_layer(kernel, dtype)
      variables = init(jax.random.PRNGKey(0), x)
      params = variables["params"]
      first = train(variables, batch, mask=mask)[1]["favor"]["rho"]
      kept = {**variables, "favor": {**variables["favor"], "rho": first}}
      again = train(kept, batch, mask=nothing)[1]["favor"]["rho"]
    else:
      layer = _nnx_layer(kernel, num_features=M, causal=True, rho_momentum=0.5, dtype=dtype)
      params = _nnx_params(layer)
      train = nnx.jit(lambda m, x, mask: m(x, mask=mask, deterministic=False))
      train(layer, batch, mask)
      first = layer.statistic[...]
      train(layer, batch, nothing)
      again = layer.statistic[...]
    q, k, _ = _qkv(jax.tree.map(lambda p: p.astype(dtype), params), x.astype(dtype))  # as the layer rounds them
    want = 0.5 * core.get_kernel(kernel).compute_statistic(q.astype(jnp.float32), k.astype(jnp.float32)).mean(0)
    np.testing.assert_allclose(first, want, **tol, err_msg=kernel)
    np.testing.assert_array_equal(again, first)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("api", sorted(RUN))
def test_padded_cross_attention_takes_the_query_padding_as_query_mask(api):
  """Cross-attention: the keys' padding comes in ``mask``, the queries' in ``query_mask``; the real rows of
  a bidirectional FAVOR++/FAVOR# layer then equal those of the unpadded queries and keys (without
  ``query_mask`` the padded queries' junk enters the statistic, as the first check shows). A bad
  ``query_mask`` is refused by name."""
  real_q, real_k = 5, 7
  xq, xk = _x(length=12), _x(seed=3)  # 12 queries, 9 keys
  padded_q, padded_k = xq.at[:, real_q:].set(40.0), xk.at[:, real_k:].set(-40.0)
  key_mask = jnp.broadcast_to(jnp.arange(9) < real_k, (B, 9))[:, None, None, :]
  query_mask = jnp.broadcast_to(jnp.arange(12) < real_q, (B, 12))
  for kernel in core.kernels.data_dependent_names():
    if api == "linen":
      layer = flin.FavorAttention(num_heads=H, num_features=M, kernel=kernel)
      variables = layer.init(jax.random.PRNGKey(0), xq, xk)
      call = jax.jit(lambda *a, **kw: layer.apply(variables, *a, **kw))
    else:
      call = _nnx_layer(kernel, num_features=M)
    want = call(xq[:, :real_q], xk[:, :real_k])
    unmasked = call(padded_q, padded_k, mask=key_mask)
    assert not np.allclose(unmasked[:, :real_q], want, atol=1e-3), kernel
    got = call(padded_q, padded_k, mask=key_mask, query_mask=query_mask)
    np.testing.assert_allclose(got[:, :real_q], want, atol=1e-5, err_msg=kernel)
  with pytest.raises(ValueError, match=r"query_mask must have shape \(2, 12\)"):
    call(padded_q, padded_k, mask=key_mask, query_mask=query_mask[:, :9])
  with pytest.raises(TypeError, match="query_mask must be a boolean array"):
    call(padded_q, padded_k, mask=key_mask, query_mask=query_mask.astype(jnp.int32))


# --- Hedgehog distillation ---------------------------------------------------------------------------

def _weights_reference(q, k, w):
  """Softmax weights and Hedgehog's, explicit in float64: φ(x) = [softmax(Wx), softmax(−Wx)] per head."""
  q, k, w = (np.asarray(a, np.float64) for a in (q, k, w))
  logits = np.einsum("bthd,bjhd->bhtj", q, k) / np.sqrt(q.shape[-1])
  soft = np.exp(logits - logits.max(-1, keepdims=True))
  soft /= soft.sum(-1, keepdims=True)

  def phi(z):
    wz = np.einsum("hmd,blhd->blhm", w, z)
    e, f = np.exp(wz - wz.max(-1, keepdims=True)), np.exp(-wz - (-wz).max(-1, keepdims=True))
    return np.concatenate([e / e.sum(-1, keepdims=True), f / f.sum(-1, keepdims=True)], -1)

  a = np.einsum("bthf,bjhf->bhtj", phi(q), phi(k))
  return soft, a / a.sum(-1, keepdims=True)


_TX = optax.adam(0.05)


@jax.jit
def _distill_step(q, k, w, state):
  """One plain optax step on the feature map alone."""
  loss, g = jax.value_and_grad(layers.distillation_loss, argnums=2)(q, k, w)
  updates, state = _TX.update(g, state, w)
  return optax.apply_updates(w, updates), state, loss


def _distill(q, k, w, steps=31):
  state, losses = _TX.init(w), []
  for _ in range(steps):
    w, state, loss = _distill_step(q, k, w, state)
    losses.append(float(loss))
  return w, losses


def test_distillation_loss_is_the_row_cross_entropy_and_an_optax_loop_brings_hedgehog_to_softmax():
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  q, k = (2.0 * jax.random.normal(key, (B, L, H, D)) for key in keys)
  w = jnp.asarray(_identity(H))
  soft, hedge = _weights_reference(q, k, w)
  kl = lambda w: float(np.mean(np.sum(soft * (np.log(soft) - np.log(_weights_reference(q, k, w)[1])), -1)))

  grads = jax.jit(jax.grad(layers.distillation_loss, argnums=(0, 1, 2)))(q, k, w)
  np.testing.assert_array_equal(grads[0], 0.0)  # q and k are the teacher's: held fixed
  np.testing.assert_array_equal(grads[1], 0.0)
  assert np.abs(grads[2]).max() > 0

  trained, losses = _distill(q, k, w)
  np.testing.assert_allclose(losses[0], -np.mean(np.sum(soft * np.log(hedge), -1)), rtol=1e-5)
  assert losses[-1] < losses[0] - 0.05, losses
  assert kl(trained) < 0.7 * kl(w), (kl(w), kl(trained))


def test_converting_a_softmax_layer_to_hedgehog_by_distillation_moves_its_output_towards_softmax():
  x = _x() * 3.0
  mha = nnx.MultiHeadAttention(H, F, decode=False, rngs=nnx.Rngs(0))
  exact = mha(x)
  layer = _nnx_layer("hedgehog")
  nnx.update(layer, nnx.state(mha, nnx.Param))  # the softmax model's weights; feature_map stays the identity
  error = lambda: float(jnp.mean((layer(x) - exact) ** 2))
  before = error()
  layer.feature_map[...], _ = _distill(mha.query(x), mha.key(x), layer.feature_map[...])
  assert error() < 0.5 * before, (before, error())


def test_distillation_loss_honours_causal_and_key_mask_and_refuses_softmax():
  q, k = (jax.random.normal(key, (B, L, H, D)) for key in jax.random.split(jax.random.PRNGKey(1), 2))
  w = jnp.asarray(_identity(H))
  ce = lambda s, h: -np.sum(s * np.log(h), -1)
  masked = layers.distillation_loss(q, k, w, key_mask=jnp.broadcast_to(jnp.arange(L) < 6, (B, L)))
  np.testing.assert_allclose(masked, np.mean(ce(*_weights_reference(q, k[:, :6], w))), rtol=1e-5)
  causal = layers.distillation_loss(q, k, w, causal=True)
  rows = [ce(*_weights_reference(q[:, t:t + 1], k[:, :t + 1], w)) for t in range(L)]
  np.testing.assert_allclose(causal, np.mean(np.stack(rows)), rtol=1e-5)
  with pytest.raises(ValueError, match="kernel must be a feature map to fit to softmax, got 'softmax'"):
    layers.distillation_loss(q, k, w, kernel="softmax")


@functools.cache
def _jitted_distillation(causal):
  """(loss, value_and_grad over the map) of ``layers.distillation_loss``, jitted once per ``causal`` for the
  cases of a test (eagerly, each of its operations compiles on its own)."""
  loss = lambda q, k, w, kernel="hedgehog", query_mask=None: layers.distillation_loss(
      q, k, w, causal=causal, kernel=kernel, query_mask=query_mask)
  return (jax.jit(loss, static_argnames="kernel"),
          jax.jit(jax.value_and_grad(loss, argnums=2), static_argnames="kernel"))


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("scale", [1.0, 20.0])
@pytest.mark.parametrize("causal", [False, True])
def test_distillation_loss_leaves_padded_queries_out(causal, scale):
  """query_mask: the padded rows (×100 and NaN here) are out of the mean (float64 reference on the real
  queries), of the gradient (finite, as without them) and of a data-dependent kernel's statistic."""
  q, k = (scale * jax.random.normal(key, (B, L, H, D)) for key in jax.random.split(jax.random.PRNGKey(4), 2))
  w, real = jnp.asarray(_identity(H)), 5
  query_mask = jnp.broadcast_to(jnp.arange(L) < real, (B, L))
  padded = jnp.where(query_mask[..., None, None], q, 100.0 * q).at[0, -1, 0, 0].set(jnp.nan)
  ce = lambda s, h: -np.sum(s * np.log(h), -1)
  rows = ([ce(*_weights_reference(q[:, t:t + 1], k[:, :t + 1], w)) for t in range(real)] if causal
          else [ce(*_weights_reference(q[:, :real], k, w))])
  loss, value_and_grad = _jitted_distillation(causal)
  got, grad = value_and_grad(padded, k, w, query_mask=query_mask)
  np.testing.assert_allclose(got, np.mean(np.concatenate(rows, axis=-1)), rtol=1e-5)
  # Without padding (causal: the keys the real queries see; bidirectional: every key).
  keys = k[:, :real] if causal else k
  np.testing.assert_allclose(grad, value_and_grad(q[:, :real], keys, w)[1], rtol=1e-4, atol=1e-7)
  if not causal:  # the statistic of FAVOR++ / FAVOR# from the real queries alone
    for name in ("optimal_positive", "saderf"):
      proj = core.orthogonal_projection(jax.random.PRNGKey(5), 16, D)
      np.testing.assert_allclose(loss(padded, k, proj, kernel=name, query_mask=query_mask),
                                 loss(q[:, :real], k, proj, kernel=name), rtol=1e-5)
  with pytest.raises(TypeError, match="query_mask must be a boolean array"):
    loss(q, k, w, query_mask=query_mask.astype(jnp.int32))


def test_distillation_loss_keeps_weights_below_float32s_range_and_refuses_signed_kernels():
  """×10 inputs: FAVOR+'s weights of far keys fall below float32's range (log A down to ~−300), and log A
  taken after the weights gave inf (audit); in log domain it equals a float64 reference. Kernels whose
  weights can be 0 or negative have no cross-entropy against softmax and are refused."""
  q, k = (10.0 * jax.random.normal(key, (B, L, H, D)) for key in jax.random.split(jax.random.PRNGKey(2), 2))
  w = core.orthogonal_projection(jax.random.PRNGKey(3), 16, D)
  x, y, w64 = (np.asarray(a, np.float64) for a in (q * D**-0.25, k * D**-0.25, w))
  log_phi = lambda z: np.einsum("md,blhd->blhm", w64, z) - 0.5 * np.sum(z * z, -1, keepdims=True)
  terms = log_phi(x)[:, :, None] + log_phi(y)[:, None]  # [B, t, j, H, M]
  peak = terms.max(-1, keepdims=True)
  log_a = (peak[..., 0] + np.log(np.exp(terms - peak).sum(-1))).transpose(0, 3, 1, 2)  # [B, H, t, j]
  log_a = log_a - np.logaddexp.reduce(log_a, axis=-1, keepdims=True)
  logits = np.einsum("bthd,bjhd->bhtj", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(D)
  soft = np.exp(logits - logits.max(-1, keepdims=True))
  soft /= soft.sum(-1, keepdims=True)
  assert np.min(log_a) < -200  # far below float32's smallest weight (e^-103)
  want = np.mean(-np.sum(soft * log_a, -1))
  got = layers.distillation_loss(q, k, w, kernel="positive")
  np.testing.assert_allclose(got, want, rtol=1e-4)
  np.testing.assert_allclose(core.attention_weights(q, k, w, kernel="positive", log=True), log_a,
                             atol=1e-3 * np.max(np.abs(log_a)))
  for name in ("relu", "trigonometric"):
    with pytest.raises(ValueError, match=f"kernel '{name}' has weights that can be 0 or negative"):
      layers.distillation_loss(q, k, w, kernel=name)
