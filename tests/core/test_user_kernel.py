"""A feature map of one's own (issue 48): the contract (``core.Kernel``, ``core.LogFeatures``) exported, checked
once at trace time with errors that say what it wants, and a valid record equal to the explicit quadratic form
written out here in float64 in the core functions, decoding and a layer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import kernels, records
from favor_jax.layers import linen

B, L, H, D, M = 2, 12, 2, 4, 8


def _squared_relu(query, key, projection):
  """φ(x) = relu(ωx)² / √M: a positive map, κ(q, k) = Σ_m relu(ω_m q)² relu(ω_m k)² / M."""
  def feats(z):
    wz = jnp.einsum("...d,md->...m", z.astype(jnp.float32), projection)
    return core.LogFeatures(None, jnp.square(jax.nn.relu(wz)) / jnp.sqrt(projection.shape[0]))

  return feats(query), feats(key)


SQUARED_RELU = core.Kernel("squared_relu", _squared_relu, lambda m, d: m, estimates_softmax=False,
                           positive_weights=False)


def _inputs():
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(kk, (B, L, H, D)) for kk in ks[:3])
  return q, k, v, core.orthogonal_projection(ks[3], M, D)


def _explicit(q, k, v, w, causal):
  """Σ_j κ(q_t, k_j) v_j / Σ_j κ(q_t, k_j) in float64, κ written out from the formula (0 where Σ is 0)."""
  f = lambda z: np.maximum(np.einsum("blhd,md->blhm", np.asarray(z, np.float64), np.asarray(w, np.float64)), 0) ** 2
  a = np.einsum("bthm,bjhm->bhtj", f(q), f(k)) / M
  if causal:
    a = a * np.tril(np.ones((L, L)))
  den = a.sum(-1)
  num = np.einsum("bhtj,bjhd->bthd", a, np.asarray(v, np.float64))
  return num / np.where(den == 0, 1.0, den).transpose(0, 2, 1)[..., None]


def test_the_contract_is_exported_from_core():
  assert core.Kernel is records.Kernel is kernels.Kernel
  assert core.LogFeatures is records.LogFeatures is kernels.LogFeatures
  assert {"Kernel", "LogFeatures"} <= set(core.__all__)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal", [False, True])
def test_a_record_of_ones_own_equals_its_explicit_form_in_core_and_decoding(causal):
  q, k, v, w = _inputs()
  want = _explicit(q, k, v, w, causal)
  got = jax.jit(functools.partial(core.favor_attention, kernel=SQUARED_RELU, causal=causal))(q, k, v, w)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  a = core.attention_weights(q, k, w, kernel=SQUARED_RELU, causal=causal)
  np.testing.assert_allclose(np.einsum("bhtj,bjhd->bthd", a, v), want, rtol=2e-5, atol=2e-5)
  if causal:
    state = core.favor_decode_init(q[:, :1], v[:, :1], w, kernel=SQUARED_RELU)
    state, first = core.favor_decode_step(state, q[:, :5], k[:, :5], v[:, :5], w, kernel=SQUARED_RELU)
    _, rest = core.favor_decode_step(state, q[:, 5:], k[:, 5:], v[:, 5:], w, kernel=SQUARED_RELU)
    np.testing.assert_allclose(jnp.concatenate([first, rest], 1), want, rtol=2e-5, atol=2e-5)


def test_a_layer_takes_a_record_of_ones_own():
  x = jax.random.normal(jax.random.PRNGKey(1), (B, L, 8))
  layer = linen.FavorAttention(num_heads=H, qkv_features=8, kernel=SQUARED_RELU, num_features=M)
  variables = layer.init(jax.random.PRNGKey(2), x)
  out = layer.apply(variables, x)
  assert out.shape == x.shape and np.all(np.isfinite(out)) and np.any(out != 0)


def _record(log_features, num_features=lambda m, d: m):
  return core.Kernel("mine", log_features, num_features, estimates_softmax=False, positive_weights=False)


def _relu_parts(z, w):
  return jax.nn.relu(jnp.einsum("...d,md->...m", z, w))


CALLS = {
    "favor_attention": lambda kern, q, k, v, w: core.favor_attention(q, k, v, w, kernel=kern),
    "causal under jit": lambda kern, q, k, v, w: jax.jit(functools.partial(
        core.favor_attention, kernel=kern, causal=True))(q, k, v, w),
    "attention_weights": lambda kern, q, k, v, w: core.attention_weights(q, k, w, kernel=kern),
    "favor_decode_init": lambda kern, q, k, v, w: core.favor_decode_init(q[:, :1], v[:, :1], w, kernel=kern),
    "the record called": lambda kern, q, k, v, w: kern(q, k, w),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_plain_arrays_instead_of_log_features_are_a_type_error_saying_so(call):
  q, k, v, w = _inputs()
  plain = _record(lambda q, k, w: (_relu_parts(q, w), _relu_parts(k, w)))
  with pytest.raises(TypeError, match=r"'mine'.*must return a pair \(LogFeatures.*got tuple of 2: \(an array"):
    CALLS[call](plain, q, k, v, w)


def test_num_features_disagreeing_with_the_features_is_a_value_error_naming_both():
  q, k, v, w = _inputs()
  twice = _record(lambda q, k, w: tuple(core.LogFeatures(None, _relu_parts(z, w)) for z in (q, k)),
                  num_features=lambda m, d: 2 * m)
  with pytest.raises(ValueError, match=rf"num_features\({M}, {D}\) = {2 * M}, but its log_features return F = {M}"):
    core.favor_attention(q, k, v, w, kernel=twice)


@pytest.mark.parametrize("bad, error, match", [
    (lambda q, k, w: (core.LogFeatures(None, None),) * 2, TypeError, "log=None and mult=None"),
    (lambda q, k, w: tuple(core.LogFeatures(None, _relu_parts(z, w).astype(jnp.int32)) for z in (q, k)), TypeError,
     "query features' mult must be a floating array, got an array of shape .* and dtype int32"),
    (lambda q, k, w: tuple(core.LogFeatures(None, _relu_parts(z, w)[..., 0, :]) for z in (q, k)), ValueError,
     r"query features' mult must have shape \[\.\.\., L, H, F\]"),
    (lambda q, k, w: tuple(core.LogFeatures(jnp.zeros(z.shape[:-1] + (3,)), _relu_parts(z, w)) for z in (q, k)),
     ValueError, "log must have F = 8 entries .* or 1 .* got 3"),
    (lambda q, k, w: (core.LogFeatures(None, _relu_parts(q, w)), core.LogFeatures(None, _relu_parts(k, w)[..., :3])),
     ValueError, "query and key features must have one F, got 8 and 3"),
    (lambda q, k, w: [core.LogFeatures(None, _relu_parts(q, w))], TypeError, "got list of 1"),
], ids=["no parts", "int dtype", "no heads axis", "log width", "query and key F", "one LogFeatures"])
def test_each_breach_of_the_contract_names_what_it_wants(bad, error, match):
  q, k, v, w = _inputs()
  with pytest.raises(error, match=match):
    core.favor_attention(q, k, v, w, kernel=_record(bad), causal=True)
