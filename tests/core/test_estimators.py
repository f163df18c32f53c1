"""Taylor, Hedgehog, per-head projections, explicit weights and hybrid (local exact + global kernel)
attention, each against an independent float64 reference written out here."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import kernels

B, L, H, D, DV, M = 2, 40, 2, 8, 5, 16


def _qkv(seed=0, length=L, dv=DV, d=D):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(ks[0], (B, length, H, d)), jax.random.normal(ks[1], (B, length, H, d)),
          jax.random.normal(ks[2], (B, length, H, dv)))


def _mask(length=L):
  return jax.random.bernoulli(jax.random.PRNGKey(9), 0.75, (B, length)).at[1, 0].set(False)


@functools.cache
def _hybrid(name, causal, window, chunk=16):
  return jax.jit(lambda q, k, v, proj, mask, rho: core.hybrid_attention(
      q, k, v, proj, kernel=name, causal=causal, window=window, key_mask=mask, rho=rho, chunk_size=chunk))


_decode = jax.jit(core.favor_decode_step, static_argnames=("window", "kernel"))


def _proj(per_head=False, seed=5, m=M, d=D):
  if per_head:
    return jnp.stack([core.orthogonal_projection(jax.random.PRNGKey(seed + h), m, d) for h in range(H)])
  return core.orthogonal_projection(jax.random.PRNGKey(seed), m, d)


def _log_weights(name, q, k, proj, rho=None):
  """log |φ(q_t)ᵀφ(k_j)| and sign [B, H, t, j] in float64 from the kernel's own log-features."""
  extra = {} if rho is None else {"rho": rho}
  fq, fk = kernels.KERNELS[name].log_features(q, k, proj, **extra)
  f64 = lambda x, like: np.zeros(like.shape[:-1] + (1,)) if x is None else np.asarray(x, np.float64)
  lq, lk = f64(fq.log, q), f64(fk.log, k)
  mq = np.ones(lq.shape) if fq.mult is None else np.asarray(fq.mult, np.float64)
  mk = np.ones(lk.shape) if fk.mult is None else np.asarray(fk.mult, np.float64)
  logits = lq[:, :, None] + lk[:, None, :]  # [B, t, j, H, F]
  peak = logits.max(-1, keepdims=True)
  total = np.sum(np.exp(logits - peak) * mq[:, :, None] * mk[:, None], -1)
  return np.moveaxis(np.log(np.abs(total)) + peak[..., 0], 3, 1), np.moveaxis(np.sign(total), 3, 1)


def _reference(q, k, v, proj, *, name, window, causal, mask, rho=None):
  """Hybrid attention written out: exact exp(q·k/√d) within the window, the kernel elsewhere, in float64.

  window=None: kernel only; name=None: softmax only. Returns (weights [B, H, t, j], output [B, t, H, Dv]).
  """
  q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
  exact = np.einsum("bthd,bjhd->bhtj", q64, k64) / math.sqrt(q.shape[-1])
  if name is None:
    log_w, sign = exact, np.ones_like(exact)
  else:
    log_w, sign = _log_weights(name, q, k, proj, rho)
  t, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
  if window:
    near = ((t - j >= 0) & (t - j < window)) if causal else (np.abs(t - j) < window)
    log_w, sign = np.where(near, exact, log_w), np.where(near, 1.0, sign)
  allowed = np.asarray(mask)[:, None, None, :] & ((t >= j) if causal else True)
  log_w = np.where(allowed, log_w, -np.inf)
  peak = np.max(log_w, -1, keepdims=True)
  w = sign * np.exp(log_w - np.where(np.isfinite(peak), peak, 0.0))
  den = w.sum(-1, keepdims=True)
  weights = np.where(den == 0, 0.0, w / np.where(den == 0, 1.0, den))
  return weights, np.einsum("bhtj,bjhe->bthe", weights, np.asarray(v, np.float64))


# --- Taylor ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_projection", [False, True])
def test_taylor_features_give_the_second_order_taylor_polynomial_exactly(with_projection):
  q, k, _ = _qkv(d=16)
  proj = _proj(m=6, d=16) if with_projection else None
  fq, fk = kernels.taylor(q, k, proj, stabilize=False)
  width = 6 if with_projection else 16
  assert fq.shape[-1] == 1 + width + width * (width + 1) // 2 == kernels.num_features(
      "taylor", 6 if with_projection else None, 16)
  assert kernels.num_features("taylor", None, 16) == 153  # Based's q/k head dim
  x, y = (np.asarray(z, np.float64) / 16 ** 0.25 for z in (q, k))
  if with_projection:
    x, y = x @ np.asarray(proj, np.float64).T, y @ np.asarray(proj, np.float64).T
  s = np.einsum("bthd,bjhd->bhtj", x, y)
  want = 1 + s + s * s / 2
  np.testing.assert_allclose(np.einsum("bthf,bjhf->bhtj", fq, fk), want, rtol=1e-5, atol=2e-6 * want.max())


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("scale", [1.0, 20.0])
def test_taylor_weights_are_positive_so_outputs_are_convex_combinations(scale):
  q, k, v = _qkv()
  q, k = scale * q, scale * k
  for causal in (False, True):
    out = np.asarray(core.favor_attention(q, k, v, None, kernel="taylor", causal=causal, key_mask=_mask()))
    weights, want = _reference(q, k, v, None, name="taylor", window=0, causal=causal, mask=_mask())
    assert np.all(weights >= 0)
    vmin = np.min(np.where(np.asarray(_mask())[:, :, None, None], v, np.inf), axis=1, keepdims=True)
    vmax = np.max(np.where(np.asarray(_mask())[:, :, None, None], v, -np.inf), axis=1, keepdims=True)
    seen = np.any(weights > 0, -1).transpose(0, 2, 1)[..., None]
    assert np.all(~seen | ((out >= vmin - 1e-4) & (out <= vmax + 1e-4)))
    np.testing.assert_allclose(out, want, atol=2e-4 * scale)


# --- Hedgehog -------------------------------------------------------------------------------------

def test_hedgehog_features_are_the_two_softmaxes_of_the_learned_map():
  q, k, _ = _qkv()
  proj = _proj(per_head=True)
  fq, _ = kernels.hedgehog(q, k, proj, stabilize=False)
  wx = np.einsum("blhd,hmd->blhm", np.asarray(q, np.float64), np.asarray(proj, np.float64))
  soft = lambda z: np.exp(z - z.max(-1, keepdims=True)) / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
  np.testing.assert_allclose(fq, np.concatenate([soft(wx), soft(-wx)], -1), rtol=1e-5, atol=1e-7)
  assert fq.shape[-1] == kernels.num_features("hedgehog", M, D) == 2 * M
  assert kernels.hedgehog.learned and not kernels.hedgehog.estimates_softmax


# --- per-head projections ---------------------------------------------------------------------------

@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("name", ["positive", "optimal_positive", "hedgehog", "taylor"])
def test_per_head_projections_equal_each_head_alone(name):
  q, k, v = _qkv()
  proj = _proj(per_head=True, m=4 if name == "taylor" else M)
  mask = _mask()
  rho = jnp.full((B, H), 0.7) if name == "optimal_positive" else None
  head = lambda x, h: x[:, :, h:h + 1]
  for causal, window in ((False, 0), (True, 0), (True, 3)):
    got = _hybrid(name, causal, window)(q, k, v, proj, mask, rho)
    for h in range(H):
      alone = _hybrid(name, causal, window)(head(q, h), head(k, h), head(v, h), proj[h], mask,
                                            None if rho is None else rho[:, h:h + 1])
      np.testing.assert_allclose(head(got, h), alone, rtol=1e-5, atol=1e-5, err_msg=f"{causal} {window}")


def test_a_per_head_projection_of_the_wrong_head_count_is_refused():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="one matrix per head"):
    core.favor_attention(q, k, v, jnp.ones((H + 1, M, D)))


# --- explicit weights ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", [None, "positive", "optimal_positive", "taylor", "hedgehog"])
def test_attention_weights_equal_the_explicit_form(name):
  q, k, _ = _qkv()
  q, k = 4.0 * q, 4.0 * k
  mask = _mask()
  proj = None if name in (None, "taylor") else _proj()
  for causal, window in ((False, 0), (True, 0), (True, 5), (False, 5)):
    rho = core.oprf_rho(q, k, mask) if name == "optimal_positive" else None
    got = core.attention_weights(q, k, proj, kernel=name or "softmax", causal=causal, key_mask=mask,
                                 window=window if name else 0, rho=rho)
    want, _ = _reference(q, k, k[..., :1], proj, name=name, window=window if name else 0, causal=causal,
                         mask=mask, rho=rho)
    np.testing.assert_allclose(got, want, atol=1e-5)
    sums = np.asarray(got).sum(-1)
    sees = np.asarray(want).sum(-1) > 0
    np.testing.assert_allclose(sums[sees], 1.0, atol=1e-5)
    assert np.all(sums[~sees] == 0) and (~sees).any() == causal  # causal: example 1's first query sees none


# --- hybrid attention -------------------------------------------------------------------------------

def test_hybrid_limits_are_softmax_and_favor():
  q, k, v = _qkv()
  proj, mask = _proj(), _mask()
  for causal in (False, True):
    np.testing.assert_allclose(_hybrid("positive", causal, L)(q, k, v, proj, mask, None),
                               core.softmax_attention(q, k, v, causal=causal, key_mask=mask), atol=1e-6)
    np.testing.assert_allclose(
        _hybrid("positive", causal, 0)(q, k, v, proj, mask, None),
        jax.jit(functools.partial(core.favor_attention, causal=causal))(q, k, v, proj, key_mask=mask), atol=1e-6)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["positive", "optimal_positive", "taylor"])
def test_hybrid_equals_the_explicit_form_at_every_scale(name, dtype):
  q0, k0, v = _qkv()
  proj = None if name == "taylor" else _proj()
  for scale in (1.0, 7.0, 20.0):
    q, k, vv = (x.astype(dtype) for x in (scale * q0, scale * k0, v))
    for masked in (False, True):
      mask = _mask() if masked else jnp.ones((B, L), bool)
      for causal, window in ((True, 1), (True, 6), (False, 6)):
        rho = core.oprf_rho(q, k, mask) if name == "optimal_positive" else None
        _, want = _reference(q, k, vv, proj, name=name, window=window, causal=causal, mask=mask, rho=rho)
        got = np.asarray(_hybrid(name, causal, window, 16)(q, k, vv, proj, mask, rho), np.float64)
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5 * scale ** 2
        assert not np.isnan(got).any()
        assert np.max(np.abs(got - want)) <= tol * 10 * np.max(np.abs(want)), (scale, masked, causal, window)


def test_hybrid_causal_outputs_never_depend_on_later_keys():
  q, k, v = _qkv()
  proj = _proj()
  for name in ("positive", "taylor"):
    p = None if name == "taylor" else proj
    base = _hybrid(name, True, 4)(q, k, v, p, None, None)
    loud = _hybrid(name, True, 4)(q, k.at[:, 30].multiply(100.0), v.at[:, 30].multiply(100.0), p, None, None)
    np.testing.assert_allclose(loud[:, :30], base[:, :30], rtol=1e-5, atol=1e-6)
    assert not np.allclose(loud[:, 30:], base[:, 30:])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_hybrid_gradients_at_large_scale_equal_those_of_the_quadratic_form(dtype):
  q0, k0, v = _qkv(length=24)
  proj = _proj()
  cos = jnp.cos(jnp.arange(v.size).reshape(v.shape))

  def quadratic(q, k, v):  # the explicit weights in jnp (float32), for jax.grad
    fq, fk = kernels.positive(q, k, proj, stabilize=False)  # the raw estimator of exp(q·k/√d)
    logit = jnp.einsum("bthd,bjhd->bhtj", q, k) / math.sqrt(D)
    t, j = jnp.arange(24)[:, None], jnp.arange(24)[None, :]
    log_w = jnp.where((t - j >= 0) & (t - j < 3), logit, jnp.log(jnp.einsum("bthf,bjhf->bhtj", fq, fk)))
    w = jax.nn.softmax(jnp.where(t >= j, log_w, -jnp.inf), axis=-1)
    return jnp.einsum("bhtj,bjhe->bthe", w, v)

  hybrid = lambda q, k, v: core.hybrid_attention(q, k, v, proj, window=3, causal=True, chunk_size=8)
  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cos)
  grad = jax.jit(jax.grad(loss(hybrid), argnums=(0, 1, 2)))
  for scale in (1.0, 20.0):
    args = tuple(x.astype(dtype) for x in (scale * q0, scale * k0, v))
    got = grad(*args)
    if scale == 1.0 and dtype == jnp.float32:
      want = jax.grad(loss(quadratic), argnums=(0, 1, 2))(*args)
      for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4 * np.max(np.abs(w)))
    assert all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in got), (scale, dtype)


def _sizes(jaxpr):
  """Element counts of every value a jaxpr computes, inner jaxprs (scan, cond, remat) included."""
  for eqn in jaxpr.eqns:
    yield from (math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _sizes(inner)


def test_hybrid_has_no_quadratic_intermediate():
  length, window = 512, 8
  q, k, v = _qkv(length=length)
  for causal in (True, False):
    jaxpr = jax.make_jaxpr(lambda q, k, v: core.hybrid_attention(
        q, k, v, _proj(), window=window, causal=causal))(q, k, v)
    biggest = max(_sizes(jaxpr.jaxpr))
    assert biggest < B * H * length * length / 4, biggest
  quadratic = jax.make_jaxpr(lambda q, k: core.attention_weights(q, k, causal=True))(q, k)
  assert max(_sizes(quadratic.jaxpr)) >= B * H * length * length  # the check sees an [L, L] array


@pytest.mark.parametrize("where", ["key", "value"])
def test_hybrid_non_finite_inputs_give_nan_where_exact_attention_does(where):
  q, k, v = _qkv()
  args = dict(query=q, key=k, value=v)
  args[where] = args[where].at[0, 30, 1, 2].set(jnp.nan)
  for causal in (True, False):
    got = np.asarray(_hybrid("positive", causal, 4)(args["query"], args["key"], args["value"], _proj(), None,
                                                    None))
    exact = np.asarray(core.softmax_attention(**args, causal=causal))
    np.testing.assert_array_equal(np.isnan(got).any(-1), np.isnan(exact).any(-1))
    assert np.isnan(got).any() and np.all(np.isnan(got[np.isnan(got).any(-1)]))


# --- decoding with a window ---------------------------------------------------------------------

@pytest.mark.parametrize("per_head", [False, True])
def test_decode_with_a_window_equals_the_causal_pass(per_head):
  q, k, v = _qkv(length=20)
  proj, mask = _proj(per_head), _mask(20)
  window = 4
  full = _hybrid("positive", True, window)(q, k, v, proj, mask, None)
  state = core.favor_decode_init(q[:, :1], v[:, :1], proj, window=window)
  assert state.keys.shape == (B, window, H, D) and state.values.shape == (B, window, H, DV)
  assert state.recurrent.s.shape == (B, H, M, DV + 1)
  state, prompt = _decode(state, q[:, :7], k[:, :7], v[:, :7], proj, window=window,
                                         key_mask=mask[:, :7])
  outs = [prompt]
  for t in range(7, 20):
    state, y = _decode(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], proj, window=window,
                       key_mask=mask[:, t:t + 1])
    outs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-6)


def test_decode_with_a_window_after_a_non_finite_key_stays_nan():
  q, k, v = _qkv(length=12)
  proj = _proj()
  k = k.at[0, 5, 1, 0].set(jnp.inf)
  state = core.favor_decode_init(q[:, :1], v[:, :1], proj, window=3)
  outs = []
  for t in range(12):
    state, y = _decode(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], proj, window=3)
    outs.append(y)
  nan = np.isnan(np.asarray(jnp.concatenate(outs, 1))).any(-1)
  np.testing.assert_array_equal(nan[0, :, 1], np.arange(12) >= 5)
  assert not nan[1].any() and not nan[:, :, 0].any()


def test_bad_windows_and_states_are_refused():
  q, k, v = _qkv(length=8)
  proj = _proj()
  for bad in (-1, True, 1.5, "3"):
    with pytest.raises(ValueError, match="window must be an int >= 0"):
      core.hybrid_attention(q, k, v, proj, window=bad)
  with pytest.raises(ValueError, match="equal query and key lengths"):
    core.hybrid_attention(q, k[:, :5], v[:, :5], proj, window=2)
  state = core.favor_decode_init(q[:, :1], v[:, :1], proj, window=3)
  with pytest.raises(ValueError, match="HybridState"):
    core.favor_decode_step(state, q[:, :1], k[:, :1], v[:, :1], proj, window=4)
  with pytest.raises(ValueError, match="RecurrentState"):
    core.favor_decode_step(state, q[:, :1], k[:, :1], v[:, :1], proj)
