"""Degenerate or mismatched inputs to the core functions stop with a ValueError/TypeError that names the
argument, instead of an obscure crash, an empty result or a silent broadcast."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core, parallel

B, L, H, D, M = 2, 12, 2, 8, 16


def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape, np.float32)


def _qkv(batch=B, length=L, heads=H, dim=D, dv=D, lk=None):
  lk = length if lk is None else lk
  batch = batch if isinstance(batch, tuple) else (batch,)
  return (_normal(0, (*batch, length, heads, dim)), _normal(1, (*batch, lk, heads, dim)),
          _normal(2, (*batch, lk, heads, dv)))


def _proj(dim=D, features=M):
  return _normal(5, (features, dim))


def _favor(q, k, v, causal, **kw):
  return core.favor_attention(q, k, v, _proj(q.shape[-1]), causal=causal, **kw)


def _linear(q, k, v, causal, **kw):
  relu = lambda x: jnp.maximum(x, 0) + 1e-3  # features used as given: any positive map
  return core.linear_attention(relu(q), relu(k), v, causal=causal, **kw)


def _softmax(q, k, v, causal, **kw):
  return core.softmax_attention(q, k, v, causal=causal, **kw)


ATTENTIONS = {"favor": _favor, "linear": _linear, "softmax": _softmax}


# --- empty axes --------------------------------------------------------------------------------------

EMPTY = [  # (inputs, causal, expected message); linear_attention says query_features / key_features
    (dict(length=0), False, r"query(_features)? has length 0 \(shape \(2, 0, 2, 8\)\)"),
    (dict(lk=0), False, r"key(_features)? has length 0 \(shape \(2, 0, 2, 8\)\)"),
    (dict(length=0), True, r"query(_features)? has length 0 \(shape \(2, 0, 2, 8\)\)"),
    (dict(dim=0), False, r"query(_features)? and key(_features)? have head_dim 0 .*\(2, 12, 2, 0\)"),
    (dict(dim=0), True, r"query(_features)? and key(_features)? have head_dim 0 .*\(2, 12, 2, 0\)"),
    (dict(dv=0), False, r"value must have shape .*Dv >= 1.*got \(2, 12, 2, 0\)"),
    (dict(dv=0), True, r"value must have shape .*Dv >= 1.*got \(2, 12, 2, 0\)"),
]


@pytest.mark.parametrize("which", sorted(ATTENTIONS))
@pytest.mark.parametrize("shapes,causal,message", EMPTY,
                         ids=[f"{sorted(s)[0]}-{'causal' if c else 'full'}" for s, c, _ in EMPTY])
def test_an_empty_axis_is_a_clear_value_error(which, shapes, causal, message):
  q, k, v = _qkv(**shapes)
  with pytest.raises(ValueError, match=message):
    ATTENTIONS[which](q, k, v, causal)


def test_empty_inputs_to_decode_are_clear_value_errors():
  q, k, v = _qkv(length=1)
  proj = _proj()
  state = core.favor_decode_init(q, v, proj)
  with pytest.raises(ValueError, match=r"query has length 0 \(shape \(2, 0, 2, 8\)\)"):
    core.favor_decode_step(state, q[:, :0], k[:, :0], v[:, :0], proj)
  with pytest.raises(ValueError, match=r"value must have shape .*Dv >= 1"):
    core.favor_decode_step(state, q, k, v[..., :0], proj)
  with pytest.raises(ValueError, match=r"value must have shape .*Dv >= 1"):
    core.favor_decode_init(q, v[..., :0], proj)
  with pytest.raises(ValueError, match="query and key have head_dim 0"):
    core.favor_decode_init(q[..., :0], v, _proj(0))


# --- decode state that does not fit the step's inputs ------------------------------------------------

STEP_MISMATCH = {  # the step's inputs differ from those the state was made for, in one size
    "batch": dict(batch=3),
    "heads": dict(heads=3),
    "value_dim": dict(dv=5),
    "features": dict(features=24),
    "batch_1_state_batch_2_step": dict(state_batch=1),
    # The same number of sequences in another layout: each would silently continue another's state.
    "batch_2x3_state_batch_3x2_step": dict(state_batch=(2, 3), batch=(3, 2)),
    "batch_2x3_state_batch_6_step": dict(state_batch=(2, 3), batch=6),
    "batch_6_state_batch_2x3_step": dict(state_batch=6, batch=(2, 3)),
}


@pytest.mark.parametrize("prompt", [1, 5], ids=["token", "prompt"])
@pytest.mark.parametrize("case", sorted(STEP_MISMATCH))
def test_a_decode_state_of_other_sizes_is_refused_naming_its_shapes(case, prompt):
  change = dict(STEP_MISMATCH[case])
  state_batch = change.pop("state_batch", B)
  q0, _, v0 = _qkv(batch=state_batch, length=1)
  state = core.favor_decode_init(q0, v0, _proj())
  features = change.pop("features", M)
  q, k, v = _qkv(length=prompt, **change)
  got = re.escape(str([x.shape for x in state]))
  with pytest.raises(ValueError, match=rf"state is a RecurrentState with shapes {got}; these inputs need"):
    core.favor_decode_step(state, q, k, v, _proj(features=features))
  # The sizes the state was made for are accepted (the check refuses mismatches only).
  q, k, v = _qkv(batch=state_batch, length=prompt)
  jax.eval_shape(functools.partial(core.favor_decode_step, projection=_proj()), state, q, k, v)


# --- arguments that were ignored or wrongly refused ---------------------------------------------------

@pytest.mark.parametrize("which", ["favor", "linear"])
def test_an_unknown_causal_method_is_refused_even_when_not_causal(which):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"unknown causal_method 'blocked'; choose one of"):
    ATTENTIONS[which](q, k, v, False, causal_method="blocked")


@pytest.mark.parametrize("which", ["favor", "linear"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_bool_chunk_size_is_refused(which, causal):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="chunk_size must be a positive int, got True"):
    ATTENTIONS[which](q, k, v, causal, chunk_size=True)


def test_a_bool_chunk_size_is_refused_by_decode():
  q, k, v = _qkv()
  proj = _proj()
  state = core.favor_decode_init(q[:, :1], v[:, :1], proj)
  with pytest.raises(ValueError, match="chunk_size must be a positive int, got True"):
    core.favor_decode_step(state, q, k, v, proj, chunk_size=True)


CAUSAL_CALLS = {
    **ATTENTIONS,
    "hybrid": lambda q, k, v, causal: core.hybrid_attention(q, k, v, _proj(), window=3, causal=causal),
    "weights": lambda q, k, v, causal: core.attention_weights(q, k, _proj(), kernel="positive", causal=causal),
    "sequence_parallel": lambda q, k, v, causal: parallel.sequence_parallel_attention(
        q, k, v, _proj(), mesh=jax.make_mesh((1,), ("seq",)), axis_name="seq", causal=causal),
}


@pytest.mark.parametrize("which", sorted(CAUSAL_CALLS))
@pytest.mark.parametrize("causal", ["False", 1, None, np.array(True), jnp.array(False)])
def test_causal_that_is_not_a_bool_is_refused(which, causal):
  """"False" read by its truth value ran causal attention; an array could not choose the pass (and under
  sequence parallelism failed as an unhashable static argument, naming nothing)."""
  q, k, v = _qkv()
  with pytest.raises(TypeError, match=re.escape(f"causal must be a bool (True or False), got {causal!r}")):
    CAUSAL_CALLS[which](q, k, v, causal)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("which", sorted(CAUSAL_CALLS))
def test_a_numpy_bool_causal_is_a_bool(which):
  q, k, v = _qkv()
  np.testing.assert_array_equal(CAUSAL_CALLS[which](q, k, v, np.bool_(True)), CAUSAL_CALLS[which](q, k, v, True))


@pytest.mark.parametrize("argument", ["query", "key", "value"])
@pytest.mark.parametrize("bad", [[[1.0]], 1.0])
def test_inputs_that_are_not_arrays_are_named(argument, bad):
  q, k, v = _qkv()
  args = dict(query=q, key=k, value=v) | {argument: bad}
  for attend in (core.softmax_attention, functools.partial(core.favor_attention, projection=_proj())):
    with pytest.raises(TypeError, match=re.escape(f"{argument} must be an array (jax or NumPy), got "
                                                  f"{type(bad).__name__}")):
      attend(**args)


def test_communication_bytes_refuses_sizes_it_cannot_count():
  sizes = dict(batch=1, heads=8, num_features=256, value_dim=64, devices=8, causal=True)
  assert parallel.communication_bytes(**sizes) == 7 * 8 * 256 * 66 * 4  # 7 other devices' (μ, S)
  for field, bad in [("devices", 0), ("batch", -1), ("devices", 2.5), ("heads", True), ("bytes_per_number", 0)]:
    with pytest.raises(ValueError, match=re.escape(f"{field} must be a positive int, got {bad!r}")):
      parallel.communication_bytes(**(sizes | {field: bad}))
  with pytest.raises(TypeError, match="causal must be a bool"):
    parallel.communication_bytes(**(sizes | {"causal": "no"}))


def _program(f, *args, **kwargs):
  """The traced computation (jaxpr) as text: equal programs give bit-identical results."""
  return str(jax.make_jaxpr(functools.partial(f, **kwargs))(*args))


@pytest.mark.parametrize("which", ["favor", "linear"])
def test_a_numpy_integer_chunk_size_is_an_int(which):
  q, k, v = _qkv()
  program = lambda chunk: _program(ATTENTIONS[which], q, k, v, causal=True, chunk_size=chunk)
  assert program(np.int64(5)) == program(5) != program(6)


def test_a_numpy_integer_chunk_size_is_an_int_in_decode_and_sequence_parallel():
  q, k, v = _qkv()
  proj = _proj()
  state = core.favor_decode_init(q[:, :1], v[:, :1], proj)
  decode = lambda chunk: _program(core.favor_decode_step, state, q, k, v, projection=proj, chunk_size=chunk)
  assert decode(np.int64(5)) == decode(5) != decode(6)
  mesh = jax.make_mesh((1,), ("seq",))
  split = lambda chunk: _program(parallel.sequence_parallel_attention, q, k, v, projection=proj, mesh=mesh,
                                 axis_name="seq", causal=True, chunk_size=chunk)
  assert split(np.int64(5)) == split(5) != split(6)
  with pytest.raises(ValueError, match="chunk_size must be a positive int, got True"):
    split(True)


def test_kernel_projection_and_statistic_misuse_name_the_argument():
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="unknown kernel"):
    core.favor_attention(q, q, q, jnp.ones((4, 8)), kernel=["positive"])
  with pytest.raises(ValueError, match=r"needs a projection \[num_features, 8\] or \[2, num_features, 8\], got None"):
    core.kernels.positive(q, q, None)
  with pytest.raises(ValueError, match="query has length 0"):
    core.oprf_rho(q[:, :0], q)


@pytest.mark.parametrize("kernel", ["optimal_positive", "saderf"])
def test_sequence_parallel_refuses_a_bad_statistic_and_misnamed_axes_as_core_does(kernel):
  """A concrete statistic out of range raises the kernel's own error before the compiled shard_map (where it
  would be traced and come back as NaN rows); batch_axis errors name batch_axis."""
  q, k, v = _qkv()
  proj = _proj()
  mesh = jax.make_mesh((1, 1), ("data", "seq"))
  stat = core.get_kernel(kernel).compute_statistic(q, k)
  split = functools.partial(parallel.sequence_parallel_attention, q, k, v, proj, mesh=mesh, axis_name="seq",
                            kernel=kernel, causal=True)
  for bad in (-jnp.ones_like(stat), jnp.full_like(stat, jnp.nan)):
    with pytest.raises(ValueError, match=r"rho") as raised:
      split(rho=bad)
    with pytest.raises(ValueError) as in_core:
      core.favor_attention(q, k, v, proj, kernel=kernel, causal=True, rho=bad)
    assert str(raised.value) == str(in_core.value)
  np.testing.assert_allclose(split(rho=stat, batch_axis="data"),  # a valid statistic still runs
                             core.favor_attention(q, k, v, proj, kernel=kernel, causal=True, rho=stat),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"batch_axis 'model' is not an axis of the mesh; its axes are"):
    split(rho=stat, batch_axis="model")
  with pytest.raises(ValueError, match=r"batch_axis 0 is not an axis of the mesh"):
    split(rho=stat, batch_axis=0)
  with pytest.raises(ValueError, match=r"batch_axis must differ from axis_name .*got 'seq' for both"):
    split(rho=stat, batch_axis="seq")


@pytest.mark.parametrize("window", [0, 3])
def test_a_decode_state_of_other_dtypes_is_refused(window):
  """A cache cast as a whole (to bfloat16, or its running max to int) decoded on with wrong numbers (audit:
  19% off for an int running max); the state is float32 whatever the inputs."""
  q, k, v = _qkv(length=5)
  state, _ = core.favor_decode_step(core.favor_decode_init(q, v, _proj(), window=window), q, k, v, _proj(),
                                    window=window)
  step = functools.partial(core.favor_decode_step, projection=_proj(), window=window)
  q1, k1, v1 = (x[:, :1] for x in (q, k, v))
  assert step(state, q1, k1, v1)[1].shape == v1.shape  # as made: taken
  floats = lambda s, dtype: jax.tree_util.tree_map(lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x, s)
  with pytest.raises(TypeError, match=r"state has leaves of dtypes \[.*bfloat16.*\]; favor_decode_init makes"):
    step(floats(state, jnp.bfloat16), q1, k1, v1)
  inner = state if window == 0 else state.recurrent
  bad_mu = inner._replace(mu=inner.mu.astype(jnp.int32))
  with pytest.raises(TypeError, match=r"int32.*do not cast it"):
    step(bad_mu if window == 0 else state._replace(recurrent=bad_mu), q1, k1, v1)
