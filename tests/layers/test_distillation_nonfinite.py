"""distillation_loss keeps the non-finite rule (a row that depends on a non-finite input makes the loss NaN;
rows that do not are as without it), equals the float64 log-domain cross-entropy at ×1..×20, and keeps its
infinities."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core, layers
from tests.core import float64_weights

L, H, D, M = 24, 2, 8, 16
T = 9


def _inputs(name, scale=1.0, batch=2, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q, k = (0.5 * scale * jax.random.normal(kk, (batch, L, H, D)) for kk in ks[:2])
  if name in ("elu_plus_one", "taylor"):
    w = None
  elif name == "hedgehog":
    w = jnp.broadcast_to(jnp.eye(M, D), (H, M, D)) + 0.3 * jax.random.normal(ks[2], (H, M, D))
  else:
    w = core.orthogonal_projection(ks[2], M, D)
  return q, k, w


def _loss(name, causal, **kw):
  return jax.jit(functools.partial(layers.distillation_loss, kernel=name, causal=causal, **kw))


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["hedgehog", "positive"])
def test_non_finite_input_gives_nan_loss_exactly_where_the_rule_says(name, causal):
  """The pattern of favor_attention's NaN test, for the loss: a non-finite query or unmasked key makes it
  NaN (main: a finite loss with its row dropped, a finite loss with a NaN gradient, or +inf); with the rows
  that depend on it left out (query_mask), loss and gradient are those of the inputs with the entry set to 0."""
  q, k, w = _inputs(name)
  for where in ("query", "key"):
    for value in (jnp.nan, jnp.inf):
      args = dict(query=q, key=k)
      clean = dict(args)
      args[where] = args[where].at[0, T, 1, 3].set(value)
      clean[where] = clean[where].at[0, T, 1, 3].set(0.0)
      loss = _loss(name, causal)
      assert np.isnan(float(loss(**args, feature_map=w))), (where, value)
      # The rows that may depend on it: its own (query), or t ≥ T (causal) / all (key) of example 0.
      depends = np.zeros((2, L), bool)
      if where == "query":
        depends[0, T] = True
      else:
        depends[0, T if causal else 0:] = True
      query_mask = jnp.asarray(~depends)
      masked = _loss(name, causal, query_mask=query_mask)
      got, grad = jax.value_and_grad(lambda w, a: masked(**a, feature_map=w))(w, args)
      want, want_grad = jax.value_and_grad(lambda w, a: masked(**a, feature_map=w))(w, clean)
      assert np.isfinite(float(got)) and np.all(np.isfinite(np.asarray(grad)))
      np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
      np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)


def test_masked_non_finite_key_and_padded_query_are_absent():
  q, k, w = _inputs("hedgehog")
  key_mask = jnp.ones((2, L), bool).at[0, T].set(False)
  query_mask = jnp.ones((2, L), bool).at[1, 3].set(False)
  loss = _loss("hedgehog", True, key_mask=key_mask, query_mask=query_mask)
  bad_q, bad_k = q.at[1, 3].set(jnp.nan), k.at[0, T].set(jnp.inf)
  got, grad = jax.value_and_grad(lambda w: loss(bad_q, bad_k, w))(w)
  want, want_grad = jax.value_and_grad(lambda w: loss(q, k, w))(w)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


def _float64_loss(name, q, k, w, causal, statistic=None):
  """−mean over rows of Σ_j t_j·log A_j with both sides' log weights in float64 (float64_weights)."""
  arrays = [None if x is None else np.asarray(x) for x in (q, k, w)]
  log_t, _ = float64_weights.log_weights("softmax", *arrays[:2], causal=causal)
  log_a, _ = float64_weights.log_weights(name, *arrays, causal=causal, statistic=statistic)
  with np.errstate(invalid="ignore"):
    terms = np.where(np.isneginf(log_t), 0.0, np.exp(log_t) * log_a)
  return -np.mean(np.sum(terms, -1))


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["positive", "hedgehog", "elu_plus_one", "taylor", "optimal_positive", "saderf"])
def test_loss_equals_the_float64_cross_entropy_at_x1_to_x20(name, causal):
  """Both sides in log domain: a teacher weight below float32's range (×20: e^{−1000}) weighs a finite log
  weight, as in float64. (The audit's float64 value +inf at ×20, causal, positive came from weights taken
  in linear domain, where exp underflows in float64 too.)"""
  for scale in (1.0, 4.0, 7.0, 20.0):
    q, k, w = _inputs(name, scale)
    rho = None
    if name in ("optimal_positive", "saderf"):
      rho = core.get_kernel(name).compute_statistic(q, k)
    got = float(_loss(name, causal)(q, k, w, rho=rho))
    want = _float64_loss(name, q, k, w, causal, None if rho is None else np.asarray(rho))
    assert np.isfinite(got) and np.isfinite(want)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5, err_msg=f"x{scale}")


def test_a_key_the_student_weighs_zero_gives_infinite_loss():
  """The cross-entropy's infinity is kept: a student (a feature map given as a callable) whose weight is
  exactly 0 for a key softmax weighs gives +inf, not a finite number."""
  q, k, w = _inputs("positive")

  def zero_for_some(q, k, projection, *, stabilize=True):
    one_hot = lambda x: jax.nn.one_hot(jnp.argmax(x @ projection.T, -1), projection.shape[0])
    return one_hot(q), one_hot(k)

  loss = layers.distillation_loss(q, k, w, kernel=zero_for_some)
  assert np.isposinf(float(loss))
