import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import kernels
from tests.core.test_attention import _explicit

D = 4
PROJ = {
    "iid": core.iid_gaussian_projection,
    "orthogonal": core.orthogonal_projection,
    "simplex": core.simplex_projection,
}


def _pairs():
  rng = np.random.default_rng(0)
  q = rng.standard_normal((1, 3, 2, D)) * 0.8  # [B, L, H, D]
  k = rng.standard_normal((1, 3, 2, D)) * 0.8
  return jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)


def _mc_estimates(feature_pair, make, num_draws=6000, m=8):
  """Per draw: φ(q)ᵀφ(k) for every (query, key, head); returns [draws, Lq, Lk, H]."""
  q, k = _pairs()

  def one(key):
    qf, kf = feature_pair(q, k, make(key, m, D))
    return jnp.einsum("blhf,bshf->lsh", qf, kf)

  return np.asarray(jax.vmap(one)(jax.random.split(jax.random.PRNGKey(1), num_draws)), np.float64)


def _assert_unbiased(est, q, k, z=5.0):
  exact = np.exp(np.einsum("blhd,bshd->lsh", q, k) / math.sqrt(D))
  err = np.abs(est.mean(0) - exact)
  stderr = est.std(0) / math.sqrt(len(est))
  assert np.all(err < z * stderr + 1e-4 * exact), (err / stderr).max()


@pytest.mark.parametrize("proj", list(PROJ))
@pytest.mark.parametrize("name", [n for n, k in kernels.KERNELS.items() if k.estimates_softmax])
def test_softmax_kernels_are_unbiased(name, proj):
  """Every kernel whose record claims E[φ(q)ᵀφ(k)] = exp(q·k/√d) meets the claim."""
  kern = kernels.KERNELS[name]
  extra = {kern.statistic: jnp.float32(0.7)} if kern.data_dependent else {}  # any fixed A is unbiased
  est = _mc_estimates(functools.partial(kern, stabilize=False, **extra), PROJ[proj])
  _assert_unbiased(est, *map(np.asarray, _pairs()))


def test_unbiasedness_check_catches_the_seed_estimator():
  # The seed article's φ: ω scaled by 1/√d, no d^{-1/4} on the inputs. Our check must reject it.
  def seed_features(q, k, w):
    w = w / math.sqrt(D)
    f = lambda x: jnp.exp(jnp.einsum("blhd,md->blhm", x, w) - 0.5 * jnp.sum(x * x, -1, keepdims=True))
    return f(q) / math.sqrt(w.shape[0]), f(k) / math.sqrt(w.shape[0])

  est = _mc_estimates(seed_features, core.iid_gaussian_projection)
  with pytest.raises(AssertionError):
    _assert_unbiased(est, *map(np.asarray, _pairs()))


def test_fixed_norm_orthogonal_is_biased_for_exponential_kernels():
  make = functools.partial(core.orthogonal_projection, norms="fixed")
  est = _mc_estimates(functools.partial(kernels.positive, stabilize=False), make)
  with pytest.raises(AssertionError):
    _assert_unbiased(est, *map(np.asarray, _pairs()))


@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_feature_shapes_and_stabilize_cancels(name, maybe_jit):
  q, k = _pairs()
  kern = kernels.KERNELS[name]
  w = core.orthogonal_projection(jax.random.PRNGKey(0), 6, D) if kern.takes_projection else None
  raw_q, raw_k = maybe_jit(kern, stabilize=False)(q, k, w)
  st_q, st_k = maybe_jit(kern, stabilize=True)(q, k, w)
  f = kern.num_features(6, D)  # the record's count is the shape its formula produces
  assert raw_q.shape == (1, 3, 2, f) and raw_k.shape == (1, 3, 2, f)
  if w is not None:
    assert kern(q, k, w[:4])[0].shape[-1] == kern.num_features(4, D)
  else:  # a projection it cannot use is refused, by the record and by every attention function
    for call in (lambda: kern(q, k, jnp.ones((6, D))), lambda: core.favor_attention(q, k, q, jnp.ones((6, D)),
                                                                                   kernel=name)):
      with pytest.raises(ValueError, match=f"kernel '{name}' takes no projection .*shape \\(6, {D}\\)"):
        call()
  # Stabilising rescales query rows and whole key sets: normalised attention weights are unchanged.
  norm = lambda a, b: (lambda s: s / s.sum(-1, keepdims=True))(jnp.einsum("blhf,bshf->bhls", a, b))
  np.testing.assert_allclose(norm(st_q, st_k), norm(raw_q, raw_k), rtol=1e-5, atol=1e-6)


def test_positive_features_are_positive_and_bounded_after_stabilizing():
  q, k = _pairs()
  w = core.iid_gaussian_projection(jax.random.PRNGKey(0), 32, D)
  for x in kernels.positive(q * 30, k * 30, w):
    assert jnp.all(x >= 0) and jnp.all(x <= 1.0) and jnp.all(jnp.isfinite(x))


def test_oprf_rho_matches_brute_force_mean_over_pairs():
  rng = np.random.default_rng(1)
  q = rng.standard_normal((2, 5, 3, D)).astype(np.float32)
  k = rng.standard_normal((2, 7, 3, D)).astype(np.float32)
  mask = rng.random((2, 7)) > 0.3
  x, y = q * D ** -0.25, k * D ** -0.25
  want = np.zeros((2, 3))
  for b in range(2):
    for h in range(3):
      ys = y[b, mask[b], h]
      want[b, h] = np.mean([np.sum((xi + yj) ** 2) for xi in x[b, :, h] for yj in ys]) / D
  np.testing.assert_allclose(kernels.oprf_rho(q, k, jnp.asarray(mask)), want, rtol=1e-5)


def test_oprf_closed_form_minimises_its_objective():
  # Objective: mean over pairs of log E[(φ(x)ᵀφ(y))²] per feature, A-dependent part:
  #   d·log(1−4A) − (d/2)·log(1−8A) + 2ρd(1−4A)/(1−8A).
  d = 16
  for rho in (0.05, 0.5, 3.0):
    a = np.linspace(-2.0, 0.124, 200001)
    obj = d * np.log(1 - 4 * a) - d / 2 * np.log(1 - 8 * a) + 2 * rho * d * (1 - 4 * a) / (1 - 8 * a)
    closed = (1 - 2 * rho - np.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16
    assert abs(a[np.argmin(obj)] - closed) < 1e-4


def test_optimal_positive_has_lower_variance_than_positive():
  q, k = _pairs()
  q, k = q * 1.5, k * 1.5
  var = {}
  for name in ("positive", "optimal_positive"):
    est = _mc_estimates(functools.partial(kernels.KERNELS[name], stabilize=False),
                        core.iid_gaussian_projection, num_draws=3000)
    var[name] = est.var(0).mean()
  assert var["optimal_positive"] < var["positive"]


def test_optimal_positive_refuses_to_look_ahead():
  q, k = _pairs()
  w = core.iid_gaussian_projection(jax.random.PRNGKey(0), 8, D)
  with pytest.raises(ValueError, match="future keys"):
    kernels.optimal_positive(q, k, w, causal=True)
  with pytest.raises(ValueError, match="rho must broadcast"):
    kernels.optimal_positive(q, k, w, rho=jnp.ones((5,)))


def test_get_kernel_and_bad_inputs():
  assert kernels.get_kernel("positive") is kernels.positive
  with pytest.raises(ValueError, match="unknown kernel 'softmax'"):
    kernels.get_kernel("softmax")
  q, k = _pairs()
  with pytest.raises(ValueError, match=r"projection must have shape \[num_features, 4\]"):
    kernels.positive(q, k, jnp.ones((8, 5)))
  with pytest.raises(TypeError, match="query must be a floating-point"):
    kernels.positive(q.astype(jnp.int32), k, jnp.ones((8, D)))


def test_a_kernel_record_names_the_keyword_of_its_statistic():
  """A new data-dependent kernel is its record: the statistic reaches its features under the record's
  ``statistic`` name (here "alpha"), whatever the attention functions call the argument (``rho``)."""
  renamed = dataclasses.replace(
      kernels.optimal_positive, name="optimal_positive_alpha", statistic="alpha",
      log_features=lambda q, k, w, alpha=None, **kw: kernels.optimal_positive.log_features(q, k, w, rho=alpha, **kw))
  ks = jax.random.split(jax.random.PRNGKey(3), 3)
  q, k, v = (0.8 * jax.random.normal(kk, (2, 9, 2, D)) for kk in ks)
  w = core.orthogonal_projection(jax.random.PRNGKey(4), 8, D)
  rho = jnp.array([0.3, 1.1])
  for causal in (False, True):
    calls = [functools.partial(core.favor_attention, causal=causal, causal_method=method, chunk_size=4)
             for method in ("chunked", "scan")]
    calls.append(functools.partial(core.hybrid_attention, causal=causal, window=2))
    for call in calls:
      run = lambda kernel: jax.jit(lambda *a: call(*a, kernel=kernel, rho=rho))(q, k, v, w)  # noqa: B023
      np.testing.assert_array_equal(run(renamed), run("optimal_positive"))
    weights = lambda kernel: jax.jit(lambda *a: core.attention_weights(*a, kernel=kernel, rho=rho, causal=causal))(
        q, k, w)  # noqa: B023
    np.testing.assert_array_equal(weights(renamed), weights("optimal_positive"))


def test_elu_plus_one_keeps_its_small_features_and_their_rows():
  """elu(x) + 1 = eˣ below 0: computed as elu then + 1 in float32 it was exactly 0 from x ≈ −17, and a
  query that negative got a zero row where the explicit form (float64) does not."""
  phi = lambda x: np.where(x > 0, x + 1.0, np.exp(x))  # the formula, in float64
  z = np.linspace(-120.0, 30.0, 301)
  q = jnp.asarray(z, jnp.float32).reshape(1, -1, 1, 1)
  want = phi(z)
  log_q = kernels.elu_plus_one.log_features(q, q, None)[0].log  # the features the attention passes use
  np.testing.assert_allclose(np.asarray(log_q, np.float64).ravel(), np.log(want), rtol=1e-6, atol=1e-7)
  fq, _ = kernels.elu_plus_one(q, q, stabilize=False)  # materialised: float32's range ends near e^-87
  normal = z > -80
  np.testing.assert_allclose(np.asarray(fq, np.float64).ravel()[normal], want[normal], rtol=1e-6, atol=0)
  grad = jax.vmap(jax.grad(lambda x: kernels.elu_plus_one(x, x, stabilize=False)[0].sum()))(q.reshape(-1, 1, 1, 1))
  np.testing.assert_allclose(np.asarray(grad, np.float64).ravel()[normal], np.where(z > 0, 1.0, np.exp(z))[normal],
                             rtol=1e-6)
  rng = np.random.default_rng(0)
  k, v = rng.standard_normal((2, 1, 6, 2, D))
  qs = rng.standard_normal((1, 6, 2, D))
  qs[0, 0] = -18.0 + 0.1 * np.arange(D)  # φ = e^{-18..-17.7}: was rounded to 0
  qs[0, 1] = -100.0 - np.arange(D)  # φ = e^{-100}: below float32's range unless kept in log domain
  for causal in (False, True):
    want = _explicit(phi(qs), phi(k), v, causal)
    for method in ("chunked", "scan"):
      got = core.favor_attention(*(jnp.asarray(x, jnp.float32) for x in (qs, k, v)), None, kernel="elu_plus_one",
                                 causal=causal, causal_method=method, chunk_size=4)
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
