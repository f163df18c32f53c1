"""FAVOR# with SADERFs: unbiased for any statistic; the closed-form statistic minimises the paper's objective
and beats FAVOR+ and FAVOR++ where queries and keys differ in scale per coordinate; causal use never looks
ahead; large inputs give finite outputs and gradients equal to the explicit form."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import kernels


def _anisotropic(d, length, sigma, spread=1.0, heads=1, batch=1, seed=0):
  """q ~ N(0, σ²S²), k ~ N(0, σ²S⁻²), S = diag(e^{−spread} … e^{spread}): the logits qᵀk are those of
  S = I, but the norms FAVOR+/FAVOR++ pay for are larger."""
  rng = np.random.default_rng(seed)
  s = np.exp(np.linspace(-spread, spread, d))
  q = rng.standard_normal((batch, length, heads, d)) * sigma * s
  k = rng.standard_normal((batch, length, heads, d)) * sigma / s
  return jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)


def _qkv(length=12, heads=2, d=8, scale=1.0, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q, k, v = (jax.random.normal(kk, (2, length, heads, d)) for kk in ks)
  tilt = jnp.exp(jnp.linspace(-0.7, 0.7, d))  # Ψ far from I
  return q * tilt * scale, k / tilt * scale, v


def _explicit(q, k, v, proj, rho, causal):
  """Σ_j A_tj v_j / Σ_j A_tj with A_tj = Σ_f φ(q_t)_f ψ(k_j)_f, as a softmax over the pairs (j, f) of the
  logits log φ(q_t)_f + log ψ(k_j)_f (float32, differentiable; no attention algorithm of ours)."""
  fq, fk = kernels.saderf.log_features(q, k, proj, rho=rho)
  logits = fq.log[:, :, None] + fk.log[:, None]  # [B, t, j, H, F]
  if causal:
    allowed = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))[None, :, :, None, None]
    logits = jnp.where(allowed, logits, -jnp.inf)
  logits = jnp.moveaxis(logits, 3, 1)  # [B, H, t, j, F]
  weights = jax.nn.softmax(logits.reshape(logits.shape[:3] + (-1,)), axis=-1).reshape(logits.shape)
  return jnp.einsum("bhtjf,bjhd->bthd", weights, v.astype(jnp.float32))


# --- The statistic ---------------------------------------------------------------------------------


def test_statistic_matches_brute_force_over_pairs():
  rng = np.random.default_rng(1)
  d = 4
  q = rng.standard_normal((2, 5, 3, d)) * np.array([0.3, 1.0, 2.0, 0.7])
  k = rng.standard_normal((2, 7, 3, d)) * np.array([1.5, 1.0, 0.4, 0.7]) + 0.2
  mask = rng.random((2, 7)) > 0.3
  got = np.asarray(kernels.saderf_statistic(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                            jnp.asarray(mask)), np.float64)
  assert got.shape == (2, 3, d + 1)
  x, y = q * d ** -0.25, k * d ** -0.25
  for b in range(2):
    for h in range(3):
      xs, ys = x[b, :, h], y[b, mask[b], h]
      psi = (np.mean(ys ** 2, 0) / np.mean(xs ** 2, 0)) ** 0.25  # Ψ_l = (Σ_j y_l² / Σ_i x_l²)^{1/4}
      rho = np.mean([np.sum((psi * xi + yj / psi) ** 2) for xi in xs for yj in ys]) / d
      np.testing.assert_allclose(got[b, h, :d], np.log(psi), atol=1e-5)
      np.testing.assert_allclose(got[b, h, d], rho, rtol=1e-5)


def _mean_log_second_moment(log_psi, a, x, y):
  """The paper's objective for one feature: mean over pairs of log E_ω[(φ(x)ψ(y))²], from the DERF
  variance formula with A = a·I, B = √(1−4a)·Ψ^{±1}, C = −B²/2 (brute force over all pairs)."""
  d = x.shape[-1]
  u, w = x * np.exp(log_psi), y * np.exp(-log_psi)
  s = np.sum((u[:, None] + w[None]) ** 2, -1)
  per_pair = (d * np.log(1 - 4 * a) - d / 2 * np.log(1 - 8 * a) + 2 * (1 - 4 * a) / (1 - 8 * a) * s
              - np.sum(u * u, -1)[:, None] - np.sum(w * w, -1)[None])
  return per_pair.mean()


def test_closed_form_statistic_minimises_the_papers_objective():
  d = 6
  q, k = _anisotropic(d, 20, sigma=0.8, spread=1.2, seed=3)
  stat = np.asarray(kernels.saderf_statistic(q, k), np.float64)[0, 0]
  log_psi, rho = stat[:d], stat[d]
  a = (1 - 2 * rho - math.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16  # FAVOR++'s A* for the rescaled pairs
  x, y = (np.asarray(z, np.float64)[0, :, 0] * d ** -0.25 for z in (q, k))
  params = np.append(log_psi, a)
  f = lambda p: _mean_log_second_moment(p[:d], p[d], x, y)
  best = f(params)
  eps = 1e-5
  grad = np.array([(f(params + eps * e) - f(params - eps * e)) / (2 * eps) for e in np.eye(d + 1)])
  assert np.max(np.abs(grad)) < 1e-3, grad  # a stationary point (float32 statistic)...
  rng = np.random.default_rng(0)
  for _ in range(50):  # ...and the minimum, nearby and farther off
    step = rng.standard_normal(d + 1) * rng.choice([0.02, 0.3])
    step[d] = min(step[d], 0.1 - a)  # keep A < 1/8
    assert f(params + step) > best
  assert f(np.append(np.zeros(d), a)) > best + 0.5  # FAVOR++ (Ψ = I) is clearly worse here


# --- Unbiasedness and variance ------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("both_sides", "m", "draws"))
def _pair_estimates(q, k, rho, *, both_sides=False, m=8, draws=6000):
  """φ(q)ᵀψ(k) for every (query, key, head), one row per iid Gaussian projection: [draws, Lq, Lk, H].

  ``both_sides``: a wrong FAVOR# with Ψ applied to keys too (instead of Ψ⁻¹), from ``rho``.
  """
  def one(key):
    w = core.iid_gaussian_projection(key, m, q.shape[-1])
    if both_sides:
      psi = jnp.exp(rho[:, None, :, :-1])
      fq, fk = kernels.optimal_positive(q * psi, k * psi, w, stabilize=False, rho=rho[..., -1])
    else:
      fq, fk = kernels.saderf(q, k, w, stabilize=False, rho=rho)
    return jnp.einsum("blhf,bshf->lsh", fq, fk)

  return jax.vmap(one)(jax.random.split(jax.random.PRNGKey(1), draws))


def _unbiased(est, q, k, z=5.0):
  exact = np.exp(np.einsum("blhd,bshd->lsh", q, k) / math.sqrt(q.shape[-1]))
  err = np.abs(est.mean(0) - exact)
  stderr = est.std(0) / math.sqrt(len(est))
  return bool(np.all(err < z * stderr + 1e-4 * exact)), (err / stderr).max()


def test_unbiased_with_the_data_statistic_and_any_other():
  q, k = _anisotropic(4, 3, sigma=0.6, heads=2, seed=2)
  stat = kernels.saderf_statistic(q, k)
  for rho in (None, stat.at[..., :4].multiply(0.5), jnp.full((1, 2, 5), 0.4)):  # any Ψ > 0, any ρ ≥ 0
    ok, worst = _unbiased(np.asarray(_pair_estimates(q, k, rho), np.float64), *map(np.asarray, (q, k)))
    assert ok, worst
  # The check has teeth: Ψ on both sides (instead of Ψ and Ψ⁻¹) is biased.
  est = np.asarray(_pair_estimates(q, k, stat, both_sides=True), np.float64)
  assert not _unbiased(est, *map(np.asarray, (q, k)))[0]


@functools.partial(jax.jit, static_argnames=("name", "m", "draws"))
def _sampled_weights(q, k, rho, *, name, m, draws):
  """Row-normalised weights Â for iid Gaussian projections, the same draws for every kernel."""
  def one(key):
    extra = {} if rho is None else {"rho": rho}
    fq, fk = kernels.KERNELS[name](q, k, core.iid_gaussian_projection(key, m, q.shape[-1]), **extra)
    a = jnp.einsum("bqhf,bkhf->bhqk", fq, fk)
    return a / a.sum(-1, keepdims=True)

  return jax.vmap(one)(jax.random.split(jax.random.PRNGKey(1), draws))


def _attention_rel_mse(name, q, k, rho=None, m=16, draws=100):
  """Mean over draws of ‖Â − P‖²/‖P‖², P the exact softmax weights."""
  x, y = (np.asarray(z, np.float64) for z in (q, k))
  logits = np.einsum("bqhd,bkhd->bhqk", x, y) / math.sqrt(q.shape[-1])
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  est = np.asarray(_sampled_weights(q, k, rho, name=name, m=m, draws=draws), np.float64)
  return np.mean(np.sum((est - p) ** 2, axis=(-2, -1)) / np.sum(p ** 2, axis=(-2, -1)))


def test_attention_error_below_favor_plus_and_favor_plus_plus():
  d = 16
  q, k = _anisotropic(d, 32, sigma=0.5)
  stat = kernels.saderf_statistic(q, k)
  err = {n: _attention_rel_mse(n, q, k) for n in ("positive", "optimal_positive")}
  err["saderf"] = _attention_rel_mse("saderf", q, k, stat)
  assert err["saderf"] < 0.5 * min(err["positive"], err["optimal_positive"]), err
  # Another Ψ (inverted, squared, square-rooted) is worse: the closed form, not any rescaling, wins.
  for power in (-1.0, 2.0, 0.5):
    wrong = _attention_rel_mse("saderf", q, k, stat.at[..., :d].multiply(power))
    assert wrong > 1.2 * err["saderf"], (power, wrong, err)
  # Where queries and keys have one scale, Ψ ≈ I: FAVOR# is FAVOR++ up to noise.
  q, k = _anisotropic(d, 32, sigma=0.5, spread=0.0)
  same = [_attention_rel_mse("optimal_positive", q, k),
          _attention_rel_mse("saderf", q, k, kernels.saderf_statistic(q, k))]
  assert same[1] < 1.15 * same[0], same


def test_invariant_to_opposite_per_coordinate_scalings():
  # q → S q, k → S⁻¹ k leaves every logit unchanged; the closed-form Ψ absorbs S exactly.
  q, k, _ = _qkv()
  s = jnp.exp(jax.random.uniform(jax.random.PRNGKey(3), (2, 8), minval=-1.5, maxval=1.5))  # per head
  w = core.orthogonal_projection(jax.random.PRNGKey(0), 16, 8)
  logs = jax.jit(lambda name, q, k: [f.log for f in kernels.KERNELS[name].log_features(q, k, w)],
                 static_argnums=0)
  for f, g in zip(logs("saderf", q, k), logs("saderf", q * s, k / s)):
    np.testing.assert_allclose(g, f, atol=2e-4 * np.max(np.abs(f)))
  # FAVOR++ is not invariant: the test is not vacuous.
  moved = logs("optimal_positive", q * s, k / s)[0] - logs("optimal_positive", q, k)[0]
  assert np.max(np.abs(moved)) > 0.1


def test_identity_rescaling_is_favor_plus_plus():
  q, k, _ = _qkv()
  w = core.orthogonal_projection(jax.random.PRNGKey(0), 16, 8)
  rho = jnp.array([[0.3, 1.2], [0.0, 2.0]])
  stat = jnp.concatenate([jnp.zeros((2, 2, 8)), rho[..., None]], -1)
  for f, g in zip(kernels.saderf(q, k, w, rho=stat, stabilize=False),
                  kernels.optimal_positive(q, k, w, rho=rho, stabilize=False)):
    np.testing.assert_allclose(f, g, rtol=1e-6)


# --- Attention: causal use, numerics, per-head projections ------------------------------------------------


@pytest.mark.parametrize("method", ["chunked", "scan"])
def test_causal_needs_the_statistic_and_never_looks_ahead(method):
  q, k, v = _qkv()
  w = core.orthogonal_projection(jax.random.PRNGKey(0), 16, 8)
  fa = functools.partial(core.favor_attention, kernel="saderf", causal=True, causal_method=method,
                         chunk_size=4)
  with pytest.raises(ValueError, match="saderf takes its statistic rho from the whole sequence"):
    fa(q, k, v, w)
  fa = jax.jit(fa)
  with pytest.raises(ValueError, match="future keys"):
    kernels.saderf(q, k, w, causal=True)
  stat = kernels.saderf_statistic(q[:, :5], k[:, :5])  # e.g. from a prefix, or a running average
  out = fa(q, k, v, w, rho=stat)
  np.testing.assert_allclose(out, _explicit(q, k, v, w, stat, causal=True), atol=1e-5)
  for t in (0, 6, 10):
    moved = fa(q, k.at[:, t + 1].multiply(100.0), v.at[:, t + 1].multiply(-3.0), w, rho=stat)
    # A statistic from the whole sequence would move by far more than rounding (a key ×100).
    np.testing.assert_allclose(moved[:, :t + 1], out[:, :t + 1], rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(moved[:, t + 1] - out[:, t + 1])) > 1e-3
  if method == "scan":  # decoding token by token with the statistic gives the same outputs
    state = core.favor_decode_init(q[:, :1], v[:, :1], w, kernel="saderf")
    step = jax.jit(functools.partial(core.favor_decode_step, kernel="saderf"))
    steps = []
    for t in range(q.shape[1]):
      state, o = step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], w, rho=stat)
      steps.append(o)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), out, atol=1e-5)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_large_inputs_give_finite_outputs_and_gradients_equal_to_the_explicit_form(dtype, causal):
  q, k, v = (x.astype(dtype) for x in _qkv(scale=20.0))
  w = core.orthogonal_projection(jax.random.PRNGKey(0), 16, 8)
  stat = kernels.saderf_statistic(q, k) if causal else None  # bidirectional: computed inside
  ct = jnp.cos(jnp.arange(v.size, dtype=jnp.float32).reshape(v.shape))
  favor = lambda q, k, v: core.favor_attention(q, k, v, w, kernel="saderf", causal=causal, rho=stat)
  loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * ct))
  out = jax.jit(favor)(q, k, v)
  want = _explicit(q, k, v, w, stat, causal)
  assert out.dtype == dtype and np.all(np.isfinite(np.asarray(out, np.float32)))
  tol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=tol * np.max(np.abs(want)))
  grads = jax.jit(jax.grad(loss(favor), argnums=(0, 1, 2)))(q, k, v)
  want_grads = jax.grad(loss(lambda *a: _explicit(*a, w, stat, causal)), argnums=(0, 1, 2))(q, k, v)
  # Saturated rows (one key takes all the weight) have q, k gradients ~0: compare on the loss's scale.
  scale = max(np.max(np.abs(np.asarray(g, np.float32))) for g in want_grads)
  for g, gw in zip(grads, want_grads):
    g, gw = np.asarray(g, np.float32), np.asarray(gw, np.float32)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, gw, atol=tol * scale)


def test_statistic_is_held_constant_under_grad():
  # Ψ and A only pick the estimator (any of them is unbiased), as FAVOR++ holds ρ constant.
  q, k, v = _qkv()
  w = core.orthogonal_projection(jax.random.PRNGKey(0), 16, 8)
  stat = kernels.saderf_statistic(q, k)

  def grads(rho):
    loss = lambda q, k: jnp.sum(core.favor_attention(q, k, v, w, kernel="saderf", rho=rho) * jnp.sin(v))
    return jax.grad(loss, argnums=(0, 1))(q, k)

  for g, want in zip(grads(None), grads(stat)):
    np.testing.assert_allclose(g, want, atol=1e-5 * np.max(np.abs(want)))


def test_raw_features_give_the_explicit_weights_at_small_scale():
  q, k, v = _qkv(scale=0.5)
  w = core.orthogonal_projection(jax.random.PRNGKey(0), 16, 8)
  fq, fk = (np.asarray(f, np.float64) for f in kernels.saderf(q, k, w, stabilize=False))
  a = np.einsum("bthf,bjhf->bhtj", fq, fk)
  want = np.einsum("bhtj,bjhd->bthd", a / a.sum(-1, keepdims=True), np.asarray(v, np.float64))
  np.testing.assert_allclose(core.favor_attention(q, k, v, w, kernel="saderf"), want, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_per_head_projection_equals_each_head_alone(causal):
  q, k, v = _qkv()
  w = jnp.stack([core.orthogonal_projection(jax.random.PRNGKey(i), 16, 8) for i in range(2)])  # [H, M, D]
  stat = kernels.saderf_statistic(q, k) if causal else None
  fa = jax.jit(functools.partial(core.favor_attention, kernel="saderf", causal=causal))
  out = fa(q, k, v, w, rho=stat)
  for h in range(2):
    alone = fa(q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h:h + 1], w[h],
               rho=None if stat is None else stat[:, h:h + 1])
    np.testing.assert_allclose(out[:, :, h:h + 1], alone, atol=1e-6)


def test_bad_statistic_values_raise_or_give_nan_in_their_row():
  q, k, v = _qkv()
  w = core.orthogonal_projection(jax.random.PRNGKey(0), 16, 8)
  runs = {c: jax.jit(lambda r, c=c: core.favor_attention(q, k, v, w, kernel="saderf", causal=c, rho=r))
          for c in (False, True)}
  for where, value in [(0, np.nan), (3, np.inf), (8, -0.5), (8, np.nan)]:  # log Ψ NaN, ∞; ρ < 0, NaN
    stat = kernels.saderf_statistic(q, k).at[1, 0, where].set(value)
    with pytest.raises(ValueError, match=r"rho \(saderf's statistic .*finite log Ψ.*ρ >= 0"):
      kernels.saderf(q, k, w, rho=stat)
    for causal, run in runs.items():
      with pytest.raises(ValueError, match=r"rho \(saderf's statistic"):
        core.favor_attention(q, k, v, w, kernel="saderf", causal=causal, rho=stat)
      bad = np.isnan(np.asarray(run(stat)))  # traced: NaN in that (batch, head), never silent zeros
      assert bad[1, :, 0].all() and not bad[0].any() and not bad[1, :, 1].any(), (where, value, causal)


def test_statistic_of_the_wrong_shape_is_refused():
  q, k, v = _qkv()
  w = core.orthogonal_projection(jax.random.PRNGKey(0), 16, 8)
  for shape in [(2,), (2, 2), (2, 2, 8), (3, 2, 9)]:  # a FAVOR++ ρ [..., H] or a wrong D+1
    with pytest.raises(ValueError, match="rho must broadcast to saderf's statistic shape"):
      core.favor_attention(q, k, v, w, kernel="saderf", causal=True, rho=jnp.ones(shape))
    with pytest.raises(ValueError, match=r"must broadcast to \[\.\.\., H, D\+1\] = \(2, 2, 9\)"):
      kernels.saderf(q, k, w, rho=jnp.ones(shape))
