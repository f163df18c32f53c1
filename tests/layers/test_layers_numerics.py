"""The Flax layers against an explicit float64 reference built from their own params, with query/key
kernels scaled so that q·k is large (where a causal pass can underflow to exact-zero rows); and the clear
errors the layers give for a decode cache or inputs that do not fit."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from favor_jax import core, layers
from favor_jax.core import kernels
from favor_jax.layers import linen as flin
from favor_jax.layers import nnx as fnnx

B, L, F, H, M = 2, 70, 32, 2, 32  # head_dim 16; L spans two of the default 64-token chunks
SCALES = (1.0, 7.0, 20.0)
DENSE = ("query", "key", "value", "out")


def _x(length=L, batch=B, seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (batch, length, F))


@functools.cache
def _base_variables():
  """Linen variables with random (non-zero) biases, so that the reference checks them too."""
  variables = jax.jit(flin.FavorAttention(num_heads=H, num_features=M).init)(jax.random.PRNGKey(1), _x())
  keys = iter(jax.random.split(jax.random.PRNGKey(2), len(DENSE)))
  params = {name: {**variables["params"][name],
                   "bias": 0.3 * jax.random.normal(next(keys), variables["params"][name]["bias"].shape)}
            for name in DENSE}
  return {"params": params, "favor": variables["favor"]}


def _scaled(params, scale):
  """Query and key kernels × scale: q and k (and so q·k) grow, values and output stay as they were."""
  return {name: {**p, "kernel": p["kernel"] * scale} if name in ("query", "key") else p
          for name, p in params.items()}


def _reference(params, projection, x):
  """Dense projections; the causal form Σ_{j≤t} A_tj v_j / Σ_{j≤t} A_tj, A_tj = Σ_f φ(q_t)_f φ(k_j)_f
  (positive features, log φ from the kernel, per-row max taken out, float64); the output dense."""
  f64 = lambda a: np.asarray(a, np.float64)
  p = {name: {k: f64(a) for k, a in leaves.items()} for name, leaves in params.items()}
  x = f64(x)
  dense = lambda name: np.einsum("blf,fhd->blhd", x, p[name]["kernel"]) + p[name]["bias"]
  q, k, v = dense("query"), dense("key"), dense("value")
  fq, fk = kernels.positive.log_features(jnp.float32(q), jnp.float32(k), projection)
  logits = f64(fq.log)[:, :, None] + f64(fk.log)[:, None, :]  # [B, t, j, H, M]
  past = np.tril(np.ones((x.shape[1], x.shape[1]), bool))[None, :, :, None, None]
  logits = np.where(past, logits, -np.inf)
  a = np.exp(logits - logits.max(axis=(2, 4), keepdims=True)).sum(-1)  # [B, t, j, H]
  attended = np.einsum("btjh,bjhd->bthd", a, v) / a.sum(2)[..., None]
  return np.einsum("bthd,hdf->btf", attended, p["out"]["kernel"]) + p["out"]["bias"]


def _check(got, want, bias, scale, what):
  """No row left at the bias alone (an attention row of zeros) and allclose to the reference."""
  got = np.asarray(got, np.float64)
  # float32 log-features of size ~scale² carry ~1e-7 relative error; measured error ≤ 2e-5·max|want|
  # at ×20, 2e-7 at ×1.
  atol = 1e-5 * max(scale, 1.0) ** 2 * np.max(np.abs(want))
  assert np.min(np.max(np.abs(want - bias), -1)) > 10 * atol  # so a zero attention row cannot pass
  zero_rows = np.all(got == np.asarray(bias), -1)
  assert not zero_rows.any(), f"{what} ×{scale}: {zero_rows.sum()} of {zero_rows.size} attention rows are 0"
  np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=f"{what} ×{scale}")


def _nnx_layer(params, projection, chunk_size=64, decode=False):
  layer = fnnx.FavorAttention(H, F, num_features=M, causal=True, chunk_size=chunk_size, decode=decode,
                              rngs=nnx.Rngs(0))
  for name in DENSE:
    getattr(layer, name).kernel[...] = params[name]["kernel"]
    getattr(layer, name).bias[...] = params[name]["bias"]
  layer.projection[...] = projection
  return layer


@functools.cache
def _linen_apply(chunk_size):
  return jax.jit(flin.FavorAttention(num_heads=H, num_features=M, causal=True, chunk_size=chunk_size).apply)


def _linen_forward(params, projection, x, chunk_size):
  favor = {**_base_variables()["favor"], "projection": projection}
  return _linen_apply(chunk_size)({"params": params, "favor": favor}, x)


@nnx.jit
def _nnx_call(layer, x):
  return layer(x)


def _nnx_forward(params, projection, x, chunk_size):
  return _nnx_call(_nnx_layer(params, projection, chunk_size), x)


FORWARD = {"linen": _linen_forward, "nnx": _nnx_forward}


@pytest.mark.parametrize("chunk_size", [64, L], ids=["chunks_of_64", "one_chunk"])
@pytest.mark.parametrize("api", sorted(FORWARD))
def test_causal_layer_equals_the_explicit_form_at_large_q_and_k(api, chunk_size):
  base = _base_variables()
  projection = base["favor"]["projection"]
  x = _x()
  for scale in SCALES:
    params = _scaled(base["params"], scale)
    got = FORWARD[api](params, projection, x, chunk_size)
    _check(got, _reference(params, projection, x), params["out"]["bias"], scale, api)


def test_drop_in_attention_fn_equals_the_explicit_form():
  """Flax's own MultiHeadDotProductAttention with ``make_attention_fn`` on the same params and projection."""
  base = _base_variables()
  projection = base["favor"]["projection"]
  x = _x()
  mha = nn.MultiHeadDotProductAttention(num_heads=H, attention_fn=layers.make_attention_fn(projection,
                                                                                           causal=True))
  got = jax.jit(mha.apply)({"params": base["params"]}, x)
  _check(got, _reference(base["params"], projection, x), base["params"]["out"]["bias"], 1.0, "attention_fn")


def _linen_decoder(num_features=M):
  return flin.FavorAttention(num_heads=H, num_features=num_features, causal=True, decode=True)


@functools.cache
def _decoder_variables(batch=B, num_features=M):
  """model.init(...) with decode=True: params, favor and the empty 'cache'."""
  return jax.jit(_linen_decoder(num_features).init)(jax.random.PRNGKey(0), _x(length=1, batch=batch))


def _linen_decode(params, projection, x, prompt):
  favor = {**_base_variables()["favor"], "projection": projection}
  variables = {**_decoder_variables(), "params": params, "favor": favor}
  apply = jax.jit(functools.partial(_linen_decoder().apply, mutable=["cache"]))
  outs = []
  for piece in (x[:, :prompt], *(x[:, t:t + 1] for t in range(prompt, x.shape[1]))):
    out, mutated = apply(variables, piece)
    variables = {**variables, **mutated}
    outs.append(out)
  return jnp.concatenate(outs, 1)


def _nnx_decode(params, projection, x, prompt):
  layer = _nnx_layer(params, projection, decode=True)
  layer.init_cache(x.shape)
  pieces = (x[:, :prompt], *(x[:, t:t + 1] for t in range(prompt, x.shape[1])))
  return jnp.concatenate([_nnx_call(layer, piece) for piece in pieces], 1)


DECODE = {"linen": _linen_decode, "nnx": _nnx_decode}


@pytest.mark.parametrize("api", sorted(DECODE))
def test_decoding_a_prompt_then_tokens_equals_the_explicit_form_at_large_q_and_k(api):
  base = _base_variables()
  projection = base["favor"]["projection"]
  x = _x(length=42)
  scale = 20.0
  params = _scaled(base["params"], scale)
  got = DECODE[api](params, projection, x, prompt=40)
  _check(got, _reference(params, projection, x), params["out"]["bias"], scale, f"{api} decode")


# --- clear errors ------------------------------------------------------------------------------------

def test_linen_decode_without_a_cache_is_refused():
  no_cache = {k: v for k, v in _decoder_variables().items() if k != "cache"}
  with pytest.raises(ValueError, match="decode=True needs the recurrent state.*'cache' collection"):
    _linen_decoder().apply(no_cache, _x(length=1), mutable=["cache"])


def test_linen_redraw_refuses_variables_holding_a_decode_cache():
  variables = _decoder_variables()
  assert variables["cache"]
  with pytest.raises(ValueError, match="variables hold a decode 'cache'"):
    flin.redraw(variables, jax.random.PRNGKey(3))
  # Without the cache the redraw goes through, and decoding starts again from an empty cache.
  fresh = flin.redraw({k: v for k, v in variables.items() if k != "cache"}, jax.random.PRNGKey(3))
  assert not np.allclose(fresh["favor"]["projection"], variables["favor"]["projection"])
  out, _ = _linen_decoder().apply({**fresh, "cache": variables["cache"]}, _x(length=1), mutable=["cache"])
  assert np.all(np.isfinite(out))


@pytest.mark.parametrize("mismatch", ["batch_1_cache_batch_2_inputs", "cache_of_other_num_features"])
def test_linen_decode_with_a_cache_of_other_sizes_is_refused(mismatch):
  variables = _decoder_variables()
  if mismatch == "batch_1_cache_batch_2_inputs":
    cache = _decoder_variables(batch=1)["cache"]
  else:
    cache = _decoder_variables(num_features=16)["cache"]
  for length in (1, 5):  # one token, and a prompt
    with pytest.raises(ValueError, match=r"state is a RecurrentState with shapes"):
      _linen_decoder().apply({**variables, "cache": cache}, _x(length=length), mutable=["cache"])


def test_nnx_init_cache_refuses_an_integer_dtype():
  layer = _nnx_layer(_base_variables()["params"], _base_variables()["favor"]["projection"], decode=True)
  with pytest.raises(TypeError, match="init_cache dtype must be a floating-point dtype.*int32"):
    layer.init_cache((B, L, F), dtype=jnp.int32)


def test_nnx_redraw_refuses_a_layer_holding_a_decode_cache():
  layer = _nnx_layer(_base_variables()["params"], _base_variables()["favor"]["projection"], decode=True)
  layer.init_cache((B, 1, F))
  before = np.asarray(layer.projection[...])
  with pytest.raises(ValueError, match="holds a decode cache.*clear_cache"):
    layer.redraw(jax.random.PRNGKey(3))
  with pytest.raises(ValueError, match="holds a decode cache"):
    fnnx.redraw(layer, jax.random.PRNGKey(3))
  np.testing.assert_array_equal(layer.projection[...], before)
  layer.clear_cache()
  fnnx.redraw(layer, jax.random.PRNGKey(3))
  assert not np.allclose(layer.projection[...], before)
  with pytest.raises(ValueError, match="init_cache"):
    layer(_x(length=1))  # the old state is gone: decoding needs a new one
  layer.init_cache((B, 1, F))
  assert np.all(np.isfinite(layer(_x(length=1))))


def test_nnx_redraw_of_a_model_with_one_cached_layer_changes_no_layer():
  """The refusal came after the layers before the cached one were redrawn: a half-redrawn model."""
  first = _nnx_layer(_base_variables()["params"], _base_variables()["favor"]["projection"], decode=True)
  second = _nnx_layer(_base_variables()["params"], _base_variables()["favor"]["projection"], decode=True)
  second.init_cache((B, 1, F))
  model = nnx.List([first, second])
  before = [np.asarray(m.projection[...]) for m in (first, second)]
  with pytest.raises(ValueError, match="holds a decode cache.*clear_cache"):
    fnnx.redraw(model, jax.random.PRNGKey(3))
  for m, b in zip((first, second), before):
    np.testing.assert_array_equal(m.projection[...], b)


def test_nnx_decode_with_a_batch_1_cache_and_batch_2_inputs_is_refused():
  layer = _nnx_layer(_base_variables()["params"], _base_variables()["favor"]["projection"], decode=True)
  layer.init_cache((1, 1, F))
  for length in (1, 5):
    with pytest.raises(ValueError, match=r"state is a RecurrentState with shapes"):
      layer(_x(length=length))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_an_empty_sequence_is_a_clear_error_in_the_layers(api, causal):
  x = _x(length=0)
  with pytest.raises(ValueError, match=r"query has length 0 \(shape \(2, 0, 2, 16\)\)"):
    if api == "linen":
      layer = flin.FavorAttention(num_heads=H, num_features=M, causal=causal)
      layer.apply(_base_variables(), x)
    else:
      fnnx.FavorAttention(H, F, num_features=M, causal=causal, decode=False, rngs=nnx.Rngs(0))(x)


# --- arguments the layers cannot honour are refused, not ignored (a hostile audit's findings) --------------


def _running(api, **kw):
  """A causal FAVOR++ layer (running ρ) of each API, with its variables (Linen) or itself (NNX)."""
  if api == "linen":
    layer = flin.FavorAttention(num_heads=H, num_features=M, causal=True, kernel="optimal_positive", **kw)
    return layer, layer.init(jax.random.PRNGKey(0), _x(length=8))
  return fnnx.FavorAttention(H, F, num_features=M, causal=True, kernel="optimal_positive", decode=False,
                             rngs=nnx.Rngs(0), **kw), None


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_decoding_in_training_mode_would_move_rho_under_the_cache_and_is_refused(api):
  """A decoded token in training mode updated ρ from that one token while the cache held states built with
  the earlier ρ (0.7 off the full causal pass, for outputs of size ~4); eval-mode decoding stays exact."""
  x = _x(length=6)
  if api == "linen":
    layer = flin.FavorAttention(num_heads=H, num_features=M, causal=True, kernel="optimal_positive", decode=True)
    variables = layer.init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="decoding with deterministic=False would update the running rho"):
      layer.apply(variables, x[:, :1], deterministic=False, mutable=["cache", "favor"])
    layer.apply(variables, x[:, :1], deterministic=True, mutable=["cache"])
  else:
    layer, _ = _running(api)
    layer(2 * x, deterministic=False)  # a non-zero ρ
    layer.init_cache(x.shape)
    with pytest.raises(ValueError, match="decoding with deterministic=False would update the running rho"):
      layer(x[:, :1], decode=True, deterministic=False)
    rho = np.asarray(layer.statistic.get_value())
    steps = [layer(x[:, t:t + 1], decode=True, deterministic=True) for t in range(6)]
    np.testing.assert_array_equal(layer.statistic.get_value(), rho)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), layer(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("momentum", [-0.5, 1.5, float("nan"), True, "0.9"])
def test_rho_momentum_outside_zero_one_is_refused_by_name(api, momentum):
  with pytest.raises(ValueError, match=r"rho_momentum must be a float in \[0, 1\]"):
    _running(api, rho_momentum=momentum)


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("kernel,causal", [("positive", True), ("optimal_positive", False), ("saderf", False)])
def test_rho_momentum_on_a_layer_without_a_running_statistic_is_refused(api, kernel, causal):
  """Only causal FAVOR++/FAVOR# layers keep a running statistic; elsewhere the momentum was ignored."""
  with pytest.raises(ValueError, match=rf"rho_momentum=0.5 .*kernel='{kernel}', causal={causal}\) keeps none"):
    if api == "linen":
      flin.FavorAttention(num_heads=H, num_features=M, kernel=kernel, causal=causal,
                          rho_momentum=0.5).init(jax.random.PRNGKey(0), _x(length=4))
    else:
      fnnx.FavorAttention(H, F, num_features=M, kernel=kernel, causal=causal, rho_momentum=0.5, decode=False,
                          rngs=nnx.Rngs(0))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_dropout_without_deterministic_anywhere_is_refused_as_flax_refuses_it(api):
  x = _x(length=5)
  if api == "linen":
    layer = flin.FavorAttention(num_heads=H, num_features=M, dropout_rate=0.5)
    variables = layer.init(jax.random.PRNGKey(0), x, deterministic=True)
    call = lambda **kw: layer.apply(variables, x, **kw)
  else:
    layer = fnnx.FavorAttention(H, F, num_features=M, dropout_rate=0.5, decode=False, rngs=nnx.Rngs(0))
    call = lambda **kw: layer(x, **kw)
  with pytest.raises(ValueError, match="dropout_rate=0.5 needs deterministic"):
    call()
  with pytest.raises(ValueError, match="attention dropout .* is not supported"):
    call(deterministic=False)
  assert np.all(np.isfinite(call(deterministic=True)))


def test_linen_training_mode_without_a_mutable_favor_collection_is_refused():
  """It skipped the ρ update silently: ρ stayed 0 (plain FAVOR+) for the whole run."""
  layer, variables = _running("linen")
  with pytest.raises(ValueError, match=r"pass mutable=\['favor'\]"):
    layer.apply(variables, _x(length=8), deterministic=False)
  _, updated = layer.apply(variables, _x(length=8), deterministic=False, mutable=["favor"])
  assert np.all(np.asarray(updated["favor"]["rho"]) > 0)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_values_without_keys_a_lone_batch_axis_and_a_mask_with_extra_dims_are_refused(api):
  x = _x(length=5)
  if api == "linen":
    make = lambda **kw: flin.FavorAttention(num_heads=H, num_features=M, **kw)
    variables = make().init(jax.random.PRNGKey(0), x)
    call = lambda *a, **kw: make().apply(variables, *a, **kw)
    with pytest.raises(ValueError, match="batch_axis='data' splits the batch .* needs mesh and sequence_axis"):
      make(batch_axis="data").init(jax.random.PRNGKey(0), x)
  else:
    layer = fnnx.FavorAttention(H, F, num_features=M, decode=False, rngs=nnx.Rngs(0))
    call = layer
    with pytest.raises(ValueError, match="batch_axis='data' splits the batch .* needs mesh and sequence_axis"):
      fnnx.FavorAttention(H, F, num_features=M, decode=False, batch_axis="data", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="is_causal=True on a layer built with causal=False"):
      layer(x, is_causal=True)
    with pytest.raises(ValueError, match="out_sharding and qkv_sharding are not supported"):
      layer(x, out_sharding=("data",))
  with pytest.raises(ValueError, match="inputs_v given with inputs_k=None"):
    call(x, None, 2 * x)
  with pytest.raises(ValueError, match=r"key-padding masks of shape \[batch..., 1, 1, Lk\]"):
    call(x, mask=jnp.ones((2, B, 1, 1, 5), bool))
  np.testing.assert_allclose(call(x, mask=jnp.ones((B, 1, 1, 5), bool)), call(x), rtol=1e-6)


# --- decoding through Flax's own cache; a cache of the other kind; argument types ---------------------------


def test_make_attention_fn_decodes_through_flax_cache_when_not_causal_and_says_so_when_causal():
  """Flax's decode cache gives the attention_fn one query against every cached key under a causal mask:
  causal=True (or a window) there failed on "equal query and key lengths", naming neither decoding nor the
  fix; causal=False decodes the causal model's outputs."""
  x = _x(length=6)
  w = core.orthogonal_projection(jax.random.PRNGKey(0), M, F // H)
  model = lambda fn, decode: nn.MultiHeadDotProductAttention(num_heads=H, attention_fn=fn, decode=decode)
  variables = model(layers.make_attention_fn(w, causal=True), False).init(jax.random.PRNGKey(2), x)
  full = model(layers.make_attention_fn(w, causal=True), False).apply(variables, x)
  for kw in (dict(causal=True), dict(window=2)):
    decoder = model(layers.make_attention_fn(w, **kw), True)
    cache = decoder.init(jax.random.PRNGKey(2), x)["cache"]
    with pytest.raises(ValueError, match=r"needs as many queries as keys, got 1 queries and 6 keys. Decoding with "
                                         r"Flax's own cache.*causal=False"):
      decoder.apply({**variables, "cache": cache}, x[:, :1], mutable=["cache"])
  decoder = model(layers.make_attention_fn(w, causal=False), True)
  cache = decoder.init(jax.random.PRNGKey(2), x)["cache"]
  for t in range(6):
    out, mutated = decoder.apply({**variables, "cache": cache}, x[:, t:t + 1], mutable=["cache"])
    cache = mutated["cache"]
    np.testing.assert_allclose(out[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_linen_cache_of_the_other_window_kind_is_named():
  """A window=0 cache given to a window > 0 decoder (or the reverse) was reported as no cache at all."""
  x = _x(length=1)
  make = lambda window: flin.FavorAttention(num_heads=H, num_features=M, causal=True, decode=True, window=window)
  for window, other in ((3, 0), (0, 3)):
    variables = make(window).init(jax.random.PRNGKey(0), x)
    cache = make(other).init(jax.random.PRNGKey(0), x)["cache"]
    kind = "window=0" if other == 0 else "window > 0"
    with pytest.raises(ValueError, match=f"the 'cache' collection holds a {kind} state .* this layer has "
                                         f"window={window}"):
      make(window).apply({**variables, "cache": cache}, x, mutable=["cache"])


def test_layer_arguments_are_read_by_type_not_by_truth():
  """is_causal="no" ran causal attention, per_head_projection=1 a per-head draw, redraw every True a redraw
  every step; NumPy integers were refused for sizes where chunk_size and window took them."""
  w = core.orthogonal_projection(jax.random.PRNGKey(0), M, F // H)
  q = jnp.ones((1, 4, H, F // H))
  with pytest.raises(TypeError, match=r"is_causal must be a bool \(True or False\), got 'no'"):
    layers.make_attention_fn(w)(q, q, q, is_causal="no")
  with pytest.raises(TypeError, match=r"causal must be a bool \(True or False\), got 'yes'"):
    layers.make_attention_fn(w, causal="yes")
  with pytest.raises(ValueError, match="per_head_projection must be None, True or False, got 1"):
    flin.FavorAttention(num_heads=H, per_head_projection=1).init(jax.random.PRNGKey(0), _x(length=4))
  with pytest.raises(ValueError, match="redraw every must be a non-negative int, got True"):
    layers.redraw_due(0, True)
  assert bool(layers.redraw_due(6, np.int64(3))) and not bool(layers.redraw_due(7, np.int64(3)))
  layer = flin.FavorAttention(num_heads=H, num_features=np.int64(8), qk_head_dim=np.int32(4), causal=True,
                              kernel="optimal_positive", rho_momentum=np.float32(0.5))
  variables = layer.init(jax.random.PRNGKey(0), _x(length=4))
  assert variables["favor"]["projection"].shape == (8, 4)
