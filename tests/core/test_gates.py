"""Forget gates (issue 40): every causal method, kernel, hybrid and decode against an explicit float64 form of
the gated quadratic form written out here; gradients (also w.r.t. the gate); causality; Monte-Carlo unbiasedness;
bad inputs."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import causal_xla, kernels
from favor_jax.core import features as features_lib

B, L, H, D, M = 2, 40, 2, 8, 16
SCALES = (1.0, 7.0, 20.0)
METHODS = ("chunked", "scan", "cumsum")
GATE_VALUES = (1.0, 0.97, 0.5, 1e-3, 1e-30, 0.0)  # from no decay to a reset


def _qkv(seed=0, length=L):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return tuple(jax.random.normal(kk, (B, length, H, D)) for kk in ks)


def _proj(name="positive"):
  return core.orthogonal_projection(jax.random.PRNGKey(5), M, D) if kernels.KERNELS[name].takes_projection else None


def _mask(length=L):
  return jax.random.bernoulli(jax.random.PRNGKey(9), 0.75, (B, length)).at[1, 0].set(False)


def _log_gate(seed=3, length=L, values=GATE_VALUES):
  """log f [B, L, H] drawn from ``values`` (1 down to 1e-30 and exact zeros: log 0 = −∞)."""
  rng = np.random.default_rng(seed)
  p = np.asarray([0.3, 0.3, 0.2, 0.08, 0.06, 0.06][:len(values)])
  f = rng.choice(np.asarray(values), size=(B, length, H), p=p / p.sum())
  with np.errstate(divide="ignore"):
    return jnp.asarray(np.log(f), jnp.float32)


def _rho(name, q, k, mask):
  kern = kernels.KERNELS[name]
  return kern.compute_statistic(q, k, mask) if kern.data_dependent else None


def decay(log_gate, segment_ids=None, causal=True, xp=np):
  """[B, t, j, H]: Σ_{j<l≤t} log f_l for j ≤ t (−∞ for j > t when causal), −∞ across segments; written
  out as a masked sum over l (no running sums), float64 in NumPy, float32 (differentiable) in JAX."""
  length = log_gate.shape[1] if log_gate is not None else segment_ids.shape[1]
  t, j, l_ = np.meshgrid(np.arange(length), np.arange(length), np.arange(length), indexing="ij")
  between = (j < l_) & (l_ <= t)  # [t, j, l]
  real = np.float64 if xp is np else jnp.float32
  if log_gate is None:
    out = xp.zeros((B, length, length, H), real)
  else:
    g = xp.asarray(log_gate, real)
    out = xp.sum(xp.where(between[None, :, :, :, None], g[:, None, None, :, :], 0.0), axis=3)
  allowed = np.ones((B, length, length), bool)
  if causal:
    allowed &= np.tril(np.ones((length, length), bool))[None]
  if segment_ids is not None:  # same run of ids: equal ids and no change of id between them
    ids = np.asarray(segment_ids)
    change = np.concatenate([np.zeros((B, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    seg = np.cumsum(change, axis=1)
    allowed &= seg[:, :, None] == seg[:, None, :]
  return xp.where(xp.asarray(allowed)[..., None], out, -xp.inf)


def explicit(name, q, k, v, proj, rho, mask, bias, xp=np):
  """Σ_j A_tj v_j / Σ_j A_tj with A_tj = e^{bias_tj} Σ_f φ(q_t)_f φ(k_j)_f, from the kernel's log-features, in
  float64 (``xp=jnp``: float32 JAX, differentiable, each row's largest term held constant). name "softmax":
  A_tj = e^{q·k/√d + bias_tj}."""
  real, hold = (jnp.float32, jax.lax.stop_gradient) if xp is jnp else (np.float64, lambda x: x)
  if name == "softmax":
    logits = xp.einsum("bthd,bjhd->btjh", xp.asarray(q, real), xp.asarray(k, real))[..., None] / math.sqrt(D)
    mq = mk = xp.ones(q.shape[:2] + (H, 1), real)
  else:
    extra = {} if rho is None else {"rho": rho}
    fq, fk = kernels.KERNELS[name].log_features(q, k, proj, **extra)
    as_real = lambda x, like: xp.ones(like.shape[:-1] + (1,), real) if x is None else xp.asarray(x, real)
    lq, lk = as_real(fq.log, q), as_real(fk.log, k)
    mq, mk = as_real(fq.mult, q), as_real(fk.mult, k)
    logits = lq[:, :, None] + lk[:, None, :]  # [B, t, j, H, F]
  allowed = xp.asarray(mask)[:, None, :, None, None] & xp.isfinite(bias)[..., None] & xp.ones(logits.shape, bool)
  logits = logits + xp.where(xp.isfinite(bias), bias, 0.0)[..., None]
  peak = hold(xp.max(xp.where(allowed, logits, -xp.inf), axis=(2, 4), keepdims=True))
  peak = xp.where(xp.isfinite(peak), peak, 0.0)
  terms = xp.where(allowed, xp.exp(xp.where(allowed, logits - peak, 0.0)), 0.0) * mq[:, :, None] * mk[:, None]
  a = terms.sum(-1)
  den = a.sum(2)
  num = xp.einsum("btjh,bjhd->bthd", a, xp.asarray(v, real))
  empty = xp.abs(den) == 0
  out = xp.where(empty[..., None], 0.0, num / xp.where(empty, 1.0, den)[..., None])
  cond = xp.abs(terms).sum((2, 4)) / xp.maximum(xp.abs(den), xp.finfo(real).tiny)
  return out, xp.where(empty, 1.0, cond)


@functools.cache
def _favor(name, method, chunk=16):
  return jax.jit(lambda q, k, v, proj, rho, mask, g: core.favor_attention(
      q, k, v, proj, kernel=name, causal=True, causal_method=method, chunk_size=chunk, key_mask=mask, rho=rho,
      log_gate=g))


def _tolerance(dtype, scale):
  return 2e-2 if jnp.dtype(dtype).itemsize < 4 else 1e-5 * max(scale, 1.0) ** 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gated_softmax_equals_the_explicit_biased_softmax(dtype):
  q0, k0, v = _qkv()
  g = _log_gate()
  fn = jax.jit(lambda q, k, v, mask, g: core.softmax_attention(q, k, v, causal=True, key_mask=mask, log_gate=g))
  for scale in SCALES:
    q, k, vv = (x.astype(dtype) for x in (scale * q0, scale * k0, v))
    for mask in (jnp.ones((B, L), bool), _mask()):
      want, _ = explicit("softmax", q, k, vv, None, None, mask, decay(g))
      got = np.asarray(fn(q, k, vv, mask, g.astype(dtype)), np.float64)
      err = np.max(np.abs(got - want))
      assert err <= _tolerance(dtype, scale) * 10 * np.max(np.abs(want)), (scale, err)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_every_causal_method_equals_the_explicit_gated_form(name, dtype):
  q0, k0, v = _qkv()
  proj = _proj(name)
  g = _log_gate()
  bias = decay(g)
  for scale in SCALES:
    if name == "trigonometric" and scale > 4:
      continue  # f32 sines of arguments ~10² are noise (as in test_numerics)
    q, k, vv = (x.astype(dtype) for x in (scale * q0, scale * k0, v))
    for masked in (False, True):
      mask = _mask() if masked else jnp.ones((B, L), bool)
      rho = _rho(name, q, k, mask)
      want, cond = explicit(name, q, k, vv, proj, rho, mask, bias)
      rows = cond < 10
      for method in METHODS:
        got = np.asarray(_favor(name, method)(q, k, vv, proj, rho, mask, g), np.float64)
        assert not np.any(np.isnan(got)), (scale, method)
        err = np.max(np.abs(got - want)[rows])
        assert err <= _tolerance(dtype, scale) * 10 * np.max(np.abs(want)), \
            f"{name} {method} scale={scale} masked={masked}: max error {err}"
        if name != "trigonometric":
          assert not np.any(np.all(got == 0, -1) & ~np.all(want == 0, -1)), (scale, method)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("name", ["positive", "softmax"])
@pytest.mark.parametrize("scale", [1.0, 7.0])
def test_gradients_including_the_gate_equal_those_of_the_explicit_form(name, scale):
  q0, k0, v = _qkv()
  q, k = scale * q0, scale * k0
  g = _log_gate(values=(1.0, 0.97, 0.5, 1e-3, 1e-30)) + 0.0  # finite gates: the gradient exists everywhere
  g = g.at[0, 17, 1].set(-jnp.inf)  # and one reset
  proj = _proj()
  mask = _mask()
  cot = jax.random.normal(jax.random.PRNGKey(11), v.shape)

  def reference(q, k, v, g):
    return jnp.sum(explicit(name, q, k, v, proj, None, mask, decay(g, xp=jnp), xp=jnp)[0] * cot)

  want = jax.grad(reference, argnums=(0, 1, 2, 3))(q, k, v, g)
  methods = METHODS if name == "positive" else ("softmax",)
  for method in methods:
    def loss(q, k, v, g):
      if method == "softmax":
        out = core.softmax_attention(q, k, v, causal=True, key_mask=mask, log_gate=g)
      else:
        out = core.favor_attention(q, k, v, proj, causal=True, causal_method=method, chunk_size=16, key_mask=mask,
                                   log_gate=g)
      return jnp.sum(out * cot)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, g)
    for what, a, b in zip("qkvg", got, want):
      a, b = np.asarray(a), np.asarray(b)
      assert np.all(np.isfinite(a)), (method, what)
      np.testing.assert_allclose(a, b, atol=2e-4 * max(np.max(np.abs(b)), 1e-3), rtol=0,
                                 err_msg=f"{method} d/d{what}")


@pytest.mark.parametrize("method", METHODS)
def test_a_future_key_or_gate_changes_no_past_output(method):
  q, k, v = _qkv()
  g = _log_gate()
  t = 20  # inside a chunk of 8, which holds past and future keys
  fn = jax.jit(functools.partial(core.favor_attention, causal=True, causal_method=method, chunk_size=8))
  base = fn(q, k, v, _proj(), log_gate=g)
  moved = fn(q, k.at[:, t + 1].multiply(100.0), v.at[:, t + 1:].add(7.0), _proj(),
             log_gate=g.at[:, t + 1:].set(-50.0).at[:, t + 3].set(-jnp.inf))
  assert np.all(np.isfinite(moved))
  np.testing.assert_allclose(moved[:, :t + 1], base[:, :t + 1], rtol=1e-5, atol=1e-6)
  past = lambda g: jnp.sum(fn(q, k, v, _proj(), log_gate=g)[:, :t + 1] ** 2)
  grad_g = jax.grad(past)(g)
  assert np.all(np.asarray(grad_g[:, t + 1:]) == 0.0) and np.any(np.asarray(grad_g[:, :t + 1]) != 0.0)


def test_a_zero_gate_equals_a_fresh_start():
  """log f = −∞ at t: rows from t on equal the suffix run alone (a reset), every method."""
  q, k, v = _qkv()
  g = jnp.zeros((B, L, H)).at[:, 13].set(-jnp.inf)
  for method in METHODS:
    fn = jax.jit(functools.partial(core.favor_attention, causal=True, causal_method=method, chunk_size=8))
    out = fn(q, k, v, _proj(), log_gate=g)
    alone = fn(q[:, 13:], k[:, 13:], v[:, 13:], _proj())
    np.testing.assert_allclose(out[:, 13:], alone, rtol=1e-5, atol=1e-6)


def test_long_runs_of_small_gates_do_not_underflow():
  """Gates of 1e-30 for 300 steps (Π = 1e-9000): the state's log-scale carries them, the rows stay exact."""
  q, k, v = _qkv(length=300)
  g = jnp.full((B, 300, H), jnp.log(1e-30))
  out = jax.jit(functools.partial(core.favor_attention, causal=True, chunk_size=16))(q, k, v, _proj(), log_gate=g)
  # Every earlier key is e^{-69} below the newest: each row is its own value (to float32).
  np.testing.assert_allclose(out, v, rtol=1e-4, atol=1e-4)


def test_auto_picks_the_chunked_pass_for_gates_on_a_cpu():
  """"pallas" with gates is tested in tests/core/test_fused_tpu.py; "auto" traced on a CPU is the XLA pass."""
  q, k, v = _qkv()
  g = _log_gate()
  fn = lambda method: jax.jit(functools.partial(core.favor_attention, causal=True, causal_method=method,
                                                 chunk_size=16))(q, k, v, _proj(), log_gate=g)
  auto, chunked = fn("auto"), fn("chunked")
  np.testing.assert_array_equal(auto, chunked)


def test_the_gated_estimator_is_unbiased_for_the_gated_softmax_kernel():
  """E over ω of the unnormalised gated weight e^{Σ log f}·φ(q_t)ᵀφ(k_j) (the chunked pass's numerator with
  one-hot values, times its row scale) is e^{q·k/√d + Σ log f}."""
  length, draws = 6, 4000
  q, k, _ = (0.8 * x[:1, :length] for x in _qkv())
  v = jnp.broadcast_to(jnp.eye(length)[None, :, None], (1, length, H, length))  # value j = e_j
  g = jnp.log(jnp.asarray([[1.0, 0.8, 0.3, 0.9, 0.05, 0.6]]))[..., None] * jnp.ones((1, 1, H))
  mask = jnp.ones((1, length), bool)

  def one(key):
    proj = core.iid_gaussian_projection(key, 8, D)
    features = features_lib.of_kernel(kernels.KERNELS["positive"], proj, None, True)
    num, _, scale = causal_xla.chunked(features, q, k, v, mask, chunk_size=4, return_scale=True, gate=g)
    return num * jnp.exp(scale)[..., None]  # [1, t, H, j]

  est = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(1), draws)), np.float64)[:, 0]
  logits = np.einsum("thd,jhd->tjh", np.asarray(q[0], np.float64), np.asarray(k[0], np.float64)) / math.sqrt(D)
  exact = np.moveaxis(np.exp(logits + np.asarray(decay(g))[0]), 1, 2)  # [t, H, j]
  mean, stderr = est.mean(0), est.std(0) / math.sqrt(draws)
  err = np.abs(mean - exact)
  assert np.all(err < 5 * stderr + 1e-5 * exact + 1e-12), (err / np.maximum(stderr, 1e-30)).max()
  # and the check has teeth: the ungated weights are far off wherever a gate < 1 lies between
  ungated = np.moveaxis(np.exp(np.where(np.isfinite(np.asarray(decay(g))[0]), logits, -np.inf)), 1, 2)
  assert np.any(np.abs(mean - ungated) > 5 * stderr + 1e-3)


def test_alibi_slopes_are_press_et_al():
  np.testing.assert_allclose(core.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
  np.testing.assert_allclose(core.alibi_slopes(4), 2.0 ** (-2.0 * np.arange(1, 5)))
  # not a power of two: those of 8, then every other one of 16
  np.testing.assert_allclose(core.alibi_slopes(12), np.concatenate([2.0 ** -np.arange(1, 9),
                                                                    2.0 ** -(np.arange(1, 16, 2) / 2)[:4]]))
  gate = core.alibi_log_gate(8, 5)
  assert gate.shape == (5, 8) and np.all(gate == -core.alibi_slopes(8))
  # ALiBi's bias −m·(t − j) is what the gated softmax gives
  q, k, v = (x[:, :5, :1] for x in _qkv())
  out = core.softmax_attention(q, k, v, causal=True, log_gate=jnp.asarray(core.alibi_log_gate(1, 5)))
  logits = np.einsum("bthd,bjhd->bhtj", q, k) / math.sqrt(D) - core.alibi_slopes(1)[0] * (
      np.arange(5)[:, None] - np.arange(5)[None])
  logits = np.where(np.tril(np.ones((5, 5), bool)), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  np.testing.assert_allclose(out, np.einsum("bhtj,bjhd->bthd", w / w.sum(-1, keepdims=True), v), rtol=1e-5,
                             atol=1e-6)
  for bad in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match="num_heads"):
      core.alibi_slopes(bad)


def _press_slopes(n):
  """The slopes as the ALiBi paper's code builds them (Press et al. 2022, its get_slopes), recursively."""
  if math.log2(n).is_integer():
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start * start ** i for i in range(n)]
  low = 2 ** math.floor(math.log2(n))
  return _press_slopes(low) + _press_slopes(2 * low)[0::2][:n - low]


def test_alibi_slopes_keep_the_papers_interleaved_order():
  """Not steepest first for H not a power of two: the paper's order, which heads were trained with."""
  np.testing.assert_allclose(core.alibi_slopes(3), [2.0 ** -4, 2.0 ** -8, 2.0 ** -2], rtol=1e-7)
  for n in (1, 2, 3, 5, 6, 7, 12, 24, 40):
    np.testing.assert_allclose(core.alibi_slopes(n), _press_slopes(n), rtol=1e-6, err_msg=str(n))
  assert not np.all(np.diff(core.alibi_slopes(3)) < 0)  # what the docstring says: not monotone


@pytest.mark.parametrize("fn", ["softmax", "favor", "hybrid", "weights"])
def test_bad_gates_and_segment_ids_are_refused_naming_the_argument(fn):
  q, k, v = _qkv()
  call = {
      "softmax": lambda **kw: core.softmax_attention(q, k, v, **kw),
      "favor": lambda **kw: core.favor_attention(q, k, v, _proj(), **kw),
      "hybrid": lambda **kw: core.hybrid_attention(q, k, v, _proj(), window=3, **kw),
      "weights": lambda **kw: core.attention_weights(q, k, **kw),
  }[fn]
  g = jnp.zeros((B, L, H))
  with pytest.raises(ValueError, match="log_gate.*causal=False"):
    call(causal=False, log_gate=g)
  with pytest.raises(ValueError, match=r"log_gate must have shape \(2, 40, 2\)"):
    call(causal=True, log_gate=jnp.zeros((B, L, H + 1)))
  with pytest.raises(ValueError, match="log_gate must have shape"):
    call(causal=True, log_gate=jnp.zeros((B, L)))
  with pytest.raises(TypeError, match="log_gate must be a floating-point array"):
    call(causal=True, log_gate=jnp.zeros((B, L, H), jnp.int32))
  with pytest.raises(TypeError, match="segment_ids must be an integer array"):
    call(causal=True, segment_ids=jnp.zeros((B, L)))
  with pytest.raises(ValueError, match=r"segment_ids must have shape \(2, 40\)"):
    call(causal=False, segment_ids=jnp.zeros((B, L + 1), jnp.int32))
  jax.eval_shape(lambda g: call(causal=True, log_gate=g), g[0])  # [L, H] broadcasts over the batch


@pytest.mark.parametrize("bad", [np.nan, np.inf, 0.5])
def test_a_bad_gate_poisons_the_rows_that_may_see_it_and_no_earlier_one(bad):
  q, k, v = _qkv()
  t = 17
  g = jnp.zeros((B, L, H)).at[0, t, 1].set(bad).at[0, 30].set(-jnp.inf)
  for out in (jax.jit(functools.partial(core.favor_attention, causal=True, chunk_size=8))(q, k, v, _proj(), log_gate=g),
              jax.jit(functools.partial(core.softmax_attention, causal=True))(q, k, v, log_gate=g)):
    nan = np.isnan(np.asarray(out)).any(-1)
    want = np.zeros((B, L, H), bool)
    want[0, t:30, 1] = True  # from its position to the next reset, its head only
    np.testing.assert_array_equal(nan, want)


def _strong_gate_case(name, length=24):
  """q, k, v [B, length, H, D] and log gates decaying key 0 by up to e^-87 (≈ 1.6e-38, float32's smallest normal
  is 1.18e-38): head 0 by 87/8 per position over 1..8, head 1 by 87 at once at position 5. ReLU (identity
  projection): every query's features lie on coordinates 0-3, key 0's on all, the later keys' on 4-7 only, so
  every row but the first weighs key 0 alone and must return v_0 however far it decayed."""
  q, k, v = _qkv(seed=4, length=length)
  if name == "relu":
    half = jnp.arange(D) < D // 2
    q = jnp.where(half, jnp.abs(q) + 0.1, -jnp.abs(q))
    k = jnp.where(half, -jnp.abs(k), jnp.abs(k) + 0.1).at[:, 0].set(jnp.abs(k[:, 0]) + 0.1)
  g = jnp.zeros((B, length, H)).at[:, 1:9, 0].set(-87.0 / 8).at[:, 5, 1].set(-87.0)
  return q, k, v, g


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("name", ["relu", "trigonometric", "taylor"])
def test_strong_gates_down_to_the_smallest_normal_keep_every_row(name):
  """Issue 48: features that can be 0 (ReLU, Taylor's coordinates, the sines of trigonometric features) must not
  set a row's scale by a key it weighs 0; the rows whose only weighted key decayed by e^-87 keep it (no silent
  zero row), in every causal method, in decoding, and as attention_weights says, against float64."""
  q, k, v, g = _strong_gate_case(name)
  proj = jnp.eye(D) if name == "relu" else _proj(name)
  mask = jnp.ones((B, q.shape[1]), bool)
  want, cond = explicit(name, q, k, v, proj, None, mask, decay(g))
  rows = cond < 10
  if name == "relu":
    assert np.all(rows[:, 1:]) and np.allclose(want[:, 1:], np.asarray(v)[:, :1], rtol=1e-12)  # the case holds
  for method in METHODS:
    for scale in (1.0, 20.0) if name == "relu" else (1.0,):  # ReLU is homogeneous: the same rows at ×20
      got = np.asarray(_favor(name, method, 8)(scale * q, scale * k, v, proj, None, mask, g), np.float64)
      err = np.abs(got - want)[rows]
      assert np.max(err) <= 1e-4 * np.max(np.abs(want)), f"{name} {method} x{scale}: max error {np.max(err)}"
  state = core.favor_decode_init(q[:, :1], v[:, :1], proj, kernel=name)
  step = jax.jit(functools.partial(core.favor_decode_step, kernel=name))
  steps = []
  for t in range(q.shape[1]):
    state, out = step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], proj, log_gate=g[:, t:t + 1])
    steps.append(out)
  err = np.abs(np.asarray(jnp.concatenate(steps, axis=1), np.float64) - want)[rows]
  assert np.max(err) <= 1e-4 * np.max(np.abs(want)), f"{name} decode: max error {np.max(err)}"
  a = core.attention_weights(q, k, proj, kernel=name, causal=True, log_gate=g)  # [B, H, Lq, Lk]
  by_weights = np.einsum("bhtj,bjhd->bthd", np.asarray(a, np.float64), np.asarray(v, np.float64))
  assert np.max(np.abs(by_weights - want)[rows]) <= 1e-4 * np.max(np.abs(want)), name
