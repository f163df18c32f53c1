"""Attention transfer (issue 53): ``distillation_loss``'s output-MSE objective (LoLCATs) and learned per-head decay
against a hand-written float64 form (``tests/core/float64_weights.py``), and gradient descent on it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from favor_jax.layers import distillation_loss
from tests.core.float64_weights import log_pair_weights

B, L, H, D, DV = 2, 6, 2, 4, 3


def _toy(seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, k = (2.0 * jax.random.normal(kk, (B, L, H, D)) for kk in ks[:2])  # sharp softmax rows
  v = jax.random.normal(ks[2], (B, L, H, DV))
  w = jnp.broadcast_to(jnp.eye(D), (H, D, D)) + 0.1 * jax.random.normal(ks[3], (H, D, D))
  return q, k, v, w


def _normalised(log_w, causal):
  t, j = np.arange(L)[:, None], np.arange(L)[None, :]
  log_w = np.where((t >= j) if causal else True, log_w, -np.inf)
  a = np.exp(log_w - log_w.max(-1, keepdims=True))
  return a / a.sum(-1, keepdims=True)  # [B, H, t, j]


def _hand_mse(q, k, v, w, causal, log_decay=None):
  """mean over (batch, head, query) of ‖A v − S v‖², A the Hedgehog weights (times e^{(t − j)·log f_h}), S softmax."""
  log_a = log_pair_weights("hedgehog", q, k, w)[0]
  if log_decay is not None:
    gap = np.arange(L)[:, None] - np.arange(L)[None, :]
    log_a = log_a + np.asarray(log_decay, np.float64)[:, None, None] * np.maximum(gap, 0)
  a = _normalised(log_a, causal)
  s = _normalised(log_pair_weights("softmax", q, k)[0], causal)
  v64 = np.asarray(v, np.float64)
  diff = np.einsum("bhtj,bjhe->bhte", a - s, v64)
  return np.mean(np.sum(diff ** 2, -1))


@pytest.mark.parametrize("causal", [False, True])
def test_output_mse_equals_the_hand_computed_value(causal):
  q, k, v, w = _toy()
  got = distillation_loss(q, k, w, kernel="hedgehog", causal=causal, objective="output_mse", value=v)
  np.testing.assert_allclose(got, _hand_mse(q, k, v, w, causal), rtol=1e-4)
  assert got > 1e-3  # the toy's student is not the teacher
  if causal:
    decay = jnp.array([-0.3, -1.2])
    got = distillation_loss(q, k, w, kernel="hedgehog", causal=True, objective="output_mse", value=v,
                            log_decay=decay)
    np.testing.assert_allclose(got, _hand_mse(q, k, v, w, True, decay), rtol=1e-4)


def test_output_mse_of_softmax_own_weights_is_zero_and_a_window_covering_all_is_exact():
  q, k, v, w = _toy(1)
  loss = distillation_loss(q, k, w, kernel="hedgehog", causal=True, objective="output_mse", value=v, window=L)
  assert float(loss) < 1e-10


@pytest.mark.slow
def test_gradient_descent_on_the_output_mse_reduces_the_output_error():
  """Adam on the feature map and the per-head decay (θ, log f = −softplus(θ)): the output error against softmax
  (the hand-written float64 form) falls, and both parameters moved."""
  q, k, v, w0 = _toy(2)
  params = dict(w=w0, theta=jnp.full((H,), -3.0))
  loss = lambda p: distillation_loss(q, k, p["w"], kernel="hedgehog", causal=True, objective="output_mse", value=v,
                                     log_decay=-jax.nn.softplus(p["theta"]))
  opt = optax.adam(3e-2)
  state = opt.init(params)

  @jax.jit
  def step(p, s):
    g = jax.grad(loss)(p)
    u, s = opt.update(g, s)
    return optax.apply_updates(p, u), s

  for _ in range(150):
    params, state = step(params, state)
  before = _hand_mse(q, k, v, w0, True, -jax.nn.softplus(jnp.full((H,), -3.0)))
  after = _hand_mse(q, k, v, params["w"], True, -jax.nn.softplus(params["theta"]))
  assert after < 0.5 * before, (before, after)
  assert not np.allclose(params["theta"], -3.0)


def test_bad_objectives_values_and_decays_are_refused():
  q, k, v, w = _toy()
  with pytest.raises(ValueError, match="objective must be one of"):
    distillation_loss(q, k, w, objective="mse", value=v)
  with pytest.raises(ValueError, match="needs value"):
    distillation_loss(q, k, w, objective="output_mse")
  with pytest.raises(ValueError, match="takes no value"):
    distillation_loss(q, k, w, value=v)
  with pytest.raises(ValueError, match="needs causal=True"):
    distillation_loss(q, k, w, log_decay=jnp.zeros(H))
  with pytest.raises(ValueError, match=r"shape \[H\]"):
    distillation_loss(q, k, w, causal=True, log_decay=jnp.zeros(H + 1))
