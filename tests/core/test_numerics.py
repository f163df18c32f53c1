"""Numerical trust: every causal method equals an explicit float64 form at input scales ×1 to ×20, and its
gradients the explicit form's; non-finite inputs give NaN exactly where exact attention depends on them;
invalid ρ never gives zeros."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import kernels

B, L, H, D, M = 2, 70, 2, 8, 16
SCALES = (1.0, 4.0, 7.0, 20.0)
METHODS = ("chunked", "scan", "cumsum")


def _qkv(seed=0, length=L, batch=B):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return tuple(jax.random.normal(kk, (batch, length, H, D)) for kk in ks)


def _proj(seed=5, name=None):
  """An orthogonal [M, D] projection; None for kernel ``name`` if its record takes none."""
  if name is not None and not kernels.KERNELS[name].takes_projection:
    return None
  return core.orthogonal_projection(jax.random.PRNGKey(seed), M, D)


def _mask(seed=9, length=L):
  # ~25% of keys masked, and key 0 of example 1 masked (its first query sees nothing).
  return jax.random.bernoulli(jax.random.PRNGKey(seed), 0.75, (B, length)).at[1, 0].set(False)


def explicit(name, q, k, v, proj, rho, mask, causal, xp=np):
  """The normalised quadratic form Σ_j A_tj v_j / Σ_j A_tj with A_tj = Σ_f φ(q_t)_f φ(k_j)_f, in float64,
  in log space per row (the kernel supplies log φ; nothing of the attention algorithms is used).
  ``xp=jnp``: the same form in float32 JAX, differentiable (each row's largest term held constant, a
  factor that cancels), the reference for gradients.

  Returns (output [B, L, H, Dv], conditioning [B, L, H] = Σ|terms| / |Σ terms| of the denominator).
  """
  extra = {} if rho is None else {"rho": rho}
  fq, fk = kernels.KERNELS[name].log_features(q, k, proj, **extra)
  real, hold = (jnp.float32, jax.lax.stop_gradient) if xp is jnp else (np.float64, lambda x: x)
  as_real = lambda x, like: xp.ones(like.shape[:-1] + (1,), real) if x is None else xp.asarray(x, real)
  lq, lk = as_real(fq.log, q), as_real(fk.log, k)
  mq, mk = as_real(fq.mult, q), as_real(fk.mult, k)
  logits = lq[:, :, None] + lk[:, None, :]  # [B, t, j, H, F]
  allowed = xp.asarray(mask)[:, None, :, None, None] & xp.ones(logits.shape, bool)
  if causal:
    allowed &= xp.tril(xp.ones((q.shape[1], k.shape[1]), bool))[None, :, :, None, None]
  peak = hold(xp.max(xp.where(allowed, logits, -xp.inf), axis=(2, 4), keepdims=True))
  peak = xp.where(xp.isfinite(peak), peak, 0.0)
  terms = xp.where(allowed, xp.exp(xp.where(allowed, logits - peak, 0.0)), 0.0) * mq[:, :, None] * mk[:, None]
  a = terms.sum(-1)  # [B, t, j, H]
  den = a.sum(2)
  num = xp.einsum("btjh,bjhd->bthd", a, xp.asarray(v, real))
  empty = xp.abs(den) == 0
  out = xp.where(empty[..., None], 0.0, num / xp.where(empty, 1.0, den)[..., None])
  cond = xp.abs(terms).sum((2, 4)) / xp.maximum(xp.abs(den), xp.finfo(real).tiny)
  return out, xp.where(empty, 1.0, cond)


def _rho(name, q, k, mask):
  kern = kernels.KERNELS[name]
  return kern.compute_statistic(q, k, mask) if kern.data_dependent else None


@functools.cache
def _favor(name, causal, method, chunk_size):
  return jax.jit(lambda q, k, v, proj, rho, mask: core.favor_attention(
      q, k, v, proj, kernel=name, causal=causal, causal_method=method, chunk_size=chunk_size,
      key_mask=mask, rho=rho))


def _tolerance(dtype, scale):
  # float32: log-features of size ~scale² lose ~1e-7 of their value when shifted; bfloat16 and float16:
  # their inputs are exact in the reference, their output rounding is 2^-8 (2^-11).
  return (2e-2 if jnp.dtype(dtype).itemsize < 4 else 1e-5 * max(scale, 1.0) ** 2)


@pytest.mark.slow(default_tier_covers=("name", "dtype"))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_every_causal_method_equals_the_explicit_form_at_every_scale(name, dtype):
  """The reported failure: chunked returned exact-zero rows from ×4 (FAVOR++ ×3) where scan did not."""
  q0, k0, v = _qkv()
  proj = _proj(name=name)
  for scale in SCALES:
    if name == "trigonometric" and scale > 4:
      continue  # exp(‖x‖²/2)·sin: the f32 sines of arguments ~10² are noise; see the conditioning filter
    q, k = (scale * x for x in (q0, k0))
    q, k, vv = (x.astype(dtype) for x in (q, k, v))
    for masked in (False, True):
      mask = _mask() if masked else jnp.ones((B, L), bool)
      rho = _rho(name, q, k, mask)
      want, cond = explicit(name, q, k, vv, proj, rho, mask, causal=True)
      rows = cond < 10  # trigonometric rows whose denominator cancels are ill-posed in any precision
      for method in METHODS:
        for chunk in ((16, L) if method == "chunked" else (16,)):
          got = np.asarray(_favor(name, True, method, chunk)(q, k, vv, proj, rho, mask), np.float64)
          assert got.dtype == np.float64 and not np.any(np.isnan(got)), (scale, method)
          err = np.max(np.abs(got - want)[rows])
          assert err <= _tolerance(dtype, scale) * 10 * np.max(np.abs(want)), \
              f"{name} {method} chunk={chunk} scale={scale} masked={masked}: max error {err}"
          if name != "trigonometric":  # a zero row where the reference is not zero is the silent failure
            assert not np.any(np.all(got == 0, -1) & ~np.all(want == 0, -1)), (scale, method, chunk)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_bidirectional_equals_the_explicit_form_at_every_scale(name, dtype):
  q0, k0, v = _qkv()
  proj = _proj(name=name)
  for scale in SCALES:
    if name == "trigonometric" and scale > 4:
      continue  # as in the causal test: f32 sines of arguments ~10² are noise
    q, k, vv = (x.astype(dtype) for x in (scale * q0, scale * k0, v))
    for masked in (False, True):
      mask = _mask() if masked else jnp.ones((B, L), bool)
      rho = _rho(name, q, k, mask)
      f32 = lambda x: x.astype(jnp.float32)  # the rounded inputs, exactly; features from them in float32+
      want, cond = explicit(name, f32(q), f32(k), f32(vv), proj, rho, mask, causal=False)
      rows = cond < 10  # trigonometric rows whose denominator cancels are ill-posed in any precision
      got = np.asarray(_favor(name, False, "chunked", 64)(q, k, vv, proj, rho, mask), np.float64)
      err = np.max(np.abs(got - want)[rows])
      assert err <= _tolerance(dtype, scale) * 10 * np.max(np.abs(want)), f"scale {scale} masked {masked}: {err}"
      if name != "trigonometric":  # a zero row where the reference is not zero is the silent failure
        assert not np.any(np.all(got == 0, -1) & ~np.all(want == 0, -1)), (scale, masked)


def test_chunked_gradients_equal_scan_gradients_at_large_scale():
  q0, k0, v = _qkv(length=40)
  proj = _proj()
  weights = jnp.cos(jnp.arange(v.size).reshape(v.shape))

  def loss(method, q, k, v):
    out = core.favor_attention(q, k, v, proj, causal=True, causal_method=method, chunk_size=8)
    return jnp.sum(out * weights)

  for scale in (1.0, 7.0, 20.0):
    q, k = scale * q0, scale * k0
    want = jax.jit(jax.grad(functools.partial(loss, "scan"), argnums=(0, 1, 2)))(q, k, v)
    got = jax.jit(jax.grad(functools.partial(loss, "chunked"), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):
      assert np.all(np.isfinite(g))
      np.testing.assert_allclose(g, w, atol=1e-4 * np.max(np.abs(w)) + 1e-6, err_msg=f"scale {scale}")


GRAD_CASES = [(True, m) for m in METHODS] + [(False, "chunked")]


@functools.cache
def _explicit_grad(name, causal, wrt):
  """The gradient of Σ weights · (explicit float32 form): one program per kernel and direction, which every
  causal method's case compares against (compiled once, not once per method)."""
  def ref_loss(q, k, v, proj, rho, mask, weights):
    return jnp.sum(weights * explicit(name, q, k, v, proj, rho, mask, causal, xp=jnp)[0])
  return jax.jit(jax.grad(ref_loss, argnums=wrt))


@pytest.mark.slow(default_tier_covers=("name", "method"))
@pytest.mark.parametrize("causal,method", GRAD_CASES, ids=[f"{'causal' if c else 'bi'}-{m}" for c, m in GRAD_CASES])
@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_every_kernels_gradients_equal_the_explicit_forms_at_every_scale(name, causal, method):
  """Gradients of q, k, v and the projection, ×1 to ×20, a quarter of the keys masked, float32 and bfloat16
  inputs, against ``jax.grad`` of the explicit form (float32, per row in log space) at the same rounded
  inputs; a given statistic held constant. bfloat16 on the chunked pass (the default) and bidirectionally."""
  length = 40
  q0, k0, v = _qkv(length=length)
  proj = _proj(name=name)
  mask = _mask(length=length)
  weights = jnp.cos(jnp.arange(v.size).reshape(v.shape))
  wrt = (0, 1, 2) if proj is None else (0, 1, 2, 3)

  def loss(q, k, v, proj, rho):
    out = core.favor_attention(q, k, v, proj, kernel=name, causal=causal, causal_method=method, chunk_size=8,
                               key_mask=mask, rho=rho)
    assert out.dtype == q.dtype
    return jnp.sum(weights * out.astype(jnp.float32))

  got_fn = jax.jit(jax.grad(loss, argnums=wrt))
  want_fn = functools.partial(_explicit_grad(name, causal, wrt), mask=mask, weights=weights)
  dtypes = (jnp.float32, jnp.bfloat16) if method == "chunked" else (jnp.float32,)
  for dtype in dtypes:
    for scale in (1.0, 4.0, 20.0):
      if name == "trigonometric" and scale > 4:
        continue  # as in the output tests: f32 sines of arguments ~10² are noise
      # Relative to the argument's largest entry (measured 2026-12-03: ≤ 4e-4 at every scale, ≤ 2e-5 at ×1),
      # plus, in float32, a floor: an output's rounding (~eps·|v|) times a log feature's derivative, ∝ scale
      # for q and k and ∝ scale² for the projection (FAVOR++'s B ∝ scale, A ∝ scale²); the whole error
      # where the exact gradient nearly vanishes. FAVOR# ×20 is such a case: its random features put each
      # query's weight on one key, so the keys' largest gradient is 1.4e-3 (softmax's 26 on these inputs),
      # and both float32 forms are ~1e-5 off a float64 one: 1.5 eps·scale·max|v| (q, k) and 2.1 eps·scale²·max|v|
      # (projection). Bfloat16: outputs and gradients are rounded to 2^-8 (measured ≤ 9.5e-3), against the
      # float32 form.
      rtol = 2e-2 if dtype == jnp.bfloat16 else 1e-4 * min(scale**2, 10.0)
      unit = 0.0 if dtype == jnp.bfloat16 else 8 * float(jnp.finfo(jnp.float32).eps) * float(jnp.max(abs(v)))
      q, k, vv = (x.astype(dtype) for x in (scale * q0, scale * k0, v))
      rho = _rho(name, q, k, mask)
      f32 = lambda x: x.astype(jnp.float32)
      got = got_fn(q, k, vv, proj, rho)
      want = want_fn(f32(q), f32(k), f32(vv), proj, rho)
      for i, g, w in zip(wrt, got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(g)) and np.max(np.abs(w)) > 0
        err = np.max(np.abs(g - w))
        assert err <= rtol * np.max(np.abs(w)) + unit * scale ** (2 if i == 3 else 1), \
            f"{dtype.__name__} scale {scale} argument {i}: error {err}, largest entry {np.max(np.abs(w))}"


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("length,chunk,at,masked,dtype", [(32, 32, 20, False, jnp.float32),
                                                          (32, 32, 20, False, jnp.bfloat16),
                                                          (100, 16, 90, True, jnp.float32)])
def test_chunked_takes_the_per_token_path_when_needed(length, chunk, at, masked, dtype):
  """Keys ×20 (log features spread over hundreds of e-folds) and one of ordinary size late in a chunk:
  the one-product form is unsafe for the rows before it (their terms against the chunk's key maximum fall
  below float32's range) and the block is computed per token, equal to the explicit form. (100, 16, 90):
  two blocks of 4 chunks, both per token, so the first one's state flows into the second and its
  gradients flow back through that state.
  """
  q, k, v = _qkv(length=length)
  proj = _proj()
  k = (20.0 * k).at[:, at].set(k[:, at])
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  tol = _tolerance(dtype, 1.0)  # float32: 1e-5 (absolute below), bfloat16: 2e-2 of the largest output
  mask = _mask(length=length) if masked else jnp.ones((B, length), bool)
  got = jax.jit(lambda q, k, v: core.favor_attention(q, k, v, proj, causal=True, key_mask=mask,
                                                     chunk_size=chunk))(q, k, v)
  want, _ = explicit("positive", q, k, v, proj, None, mask, causal=True)
  atol = tol if dtype == jnp.float32 else tol * np.max(np.abs(want))
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol)
  # Its gradients (the per-token pass's own VJP, recomputed group by group) are the scan's, also those
  # of the projection.
  weights = jnp.cos(jnp.arange(v.size).reshape(v.shape))
  loss = lambda method, q, k, v, proj: jnp.sum(weights * core.favor_attention(
      q, k, v, proj, causal=True, key_mask=mask, causal_method=method, chunk_size=chunk).astype(jnp.float32))
  want = jax.jit(jax.grad(functools.partial(loss, "scan"), argnums=(0, 1, 2, 3)))(q, k, v, proj)
  got = jax.jit(jax.grad(functools.partial(loss, "chunked"), argnums=(0, 1, 2, 3)))(q, k, v, proj)
  grad_tol = 1e-4 if dtype == jnp.float32 else tol  # bfloat16: both gradients are rounded to 2^-8
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.max(np.abs(w)) > 0
    np.testing.assert_allclose(g, w, atol=grad_tol * np.max(np.abs(w)) + 1e-6)


# --- non-finite inputs -----------------------------------------------------------------------

def _with_nan(x, t, value=jnp.nan):
  return x.at[0, t, 1, 3].set(value)


ALL_CAUSAL = [(True, m) for m in METHODS] + [(False, "chunked")]


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal,method", ALL_CAUSAL)
@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("value", [jnp.nan, jnp.inf])
def test_non_finite_input_gives_nan_exactly_where_exact_attention_depends_on_it(causal, method, where,
                                                                                value):
  q, k, v = _qkv(length=48)
  proj = _proj()
  t = 40  # late in a chunk of 16: earlier rows of the chunk must not change
  args = dict(query=q, key=k, value=v)
  args[where] = _with_nan(args[where], t, value)
  attend = jax.jit(functools.partial(core.favor_attention, projection=proj, causal=causal, causal_method=method,
                                     chunk_size=16))
  got = np.asarray(attend(**args))
  exact = np.asarray(core.softmax_attention(**args, causal=causal))
  clean_args = dict(args)
  clean_args[where] = _with_nan(args[where], t, 0.0)
  clean = np.asarray(attend(**clean_args))
  nan_rows = np.isnan(got).any(-1)
  # Which rows: those of the exact reference (which attends the same keys), same head only.
  np.testing.assert_array_equal(nan_rows, np.isnan(exact).any(-1))
  want_rows = np.zeros_like(nan_rows)
  if where == "query":
    want_rows[0, t, 1] = True
  else:
    want_rows[0, t if causal else 0:, 1] = True
  np.testing.assert_array_equal(nan_rows, want_rows)
  assert np.all(np.isnan(got[nan_rows]))  # every entry of such a row, never a 0
  np.testing.assert_allclose(got[~nan_rows], clean[~nan_rows], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal,method", ALL_CAUSAL)
def test_masked_non_finite_keys_are_absent(causal, method):
  q, k, v = _qkv(length=48)
  proj = _proj()
  mask = jnp.ones((B, 48), bool).at[0, 40].set(False)
  attend = jax.jit(functools.partial(core.favor_attention, projection=proj, causal=causal, causal_method=method,
                                     chunk_size=16, key_mask=mask))
  got = attend(q, _with_nan(k, 40, jnp.inf), _with_nan(v, 40))
  np.testing.assert_allclose(got, attend(q, k, v), rtol=1e-5, atol=1e-6)
  ref = core.softmax_attention(q, _with_nan(k, 40, jnp.inf), _with_nan(v, 40), causal=causal, key_mask=mask)
  assert np.all(np.isfinite(ref))


def test_gradients_of_rows_before_a_non_finite_key_are_unaffected():
  q, k, v = _qkv(length=48)
  proj = _proj()
  weights = jnp.sin(jnp.arange(48 * H * D).reshape(1, 48, H, D))

  def loss(k, v):
    out = core.favor_attention(q, k, v, proj, causal=True, chunk_size=16)
    return jnp.sum(out[:, :40] * weights[:, :40])

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  g_bad = grad(_with_nan(k, 40), _with_nan(v, 40))
  g_clean = grad(_with_nan(k, 40, 0.0), _with_nan(v, 40, 0.0))
  for a, b in zip(g_bad, g_clean):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  # A loss that includes the NaN rows is NaN.
  assert np.isnan(jnp.sum(core.favor_attention(q, _with_nan(k, 40), v, proj, causal=True)))


@pytest.mark.slow
def test_decode_after_a_non_finite_key_is_nan_and_before_it_is_not():
  q, k, v = _qkv(length=12)
  proj = _proj()
  k = _with_nan(k, 7)
  state = core.favor_decode_init(q[:, :1], v[:, :1], proj)
  outs = []
  for t in range(12):
    state, y = core.favor_decode_step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], proj)
    outs.append(y)
  out = np.asarray(jnp.concatenate(outs, 1))
  np.testing.assert_array_equal(np.isnan(out).any(-1)[0, :, 1], np.arange(12) >= 7)
  assert not np.isnan(out[1]).any() and not np.isnan(out[:, :, 0]).any()
  full = core.favor_attention(q, k, v, proj, causal=True)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(full))
  # A prompt holding the bad key poisons the state it returns.
  state, _ = core.favor_decode_step(core.favor_decode_init(q[:, :1], v[:, :1], proj), q[:, :9], k[:, :9],
                                    v[:, :9], proj)
  _, y = core.favor_decode_step(state, q[:, 9:10], k[:, 9:10], v[:, 9:10], proj)
  assert np.isnan(y[0, :, 1]).all() and not np.isnan(y[1]).any()


# --- FAVOR++'s statistic -------------------------------------------------------------------------

@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf])
def test_invalid_rho_raises_eagerly_and_gives_nan_under_jit(bad):
  q, k, v = _qkv(length=20)
  proj = _proj()
  rho = jnp.array([0.5, bad])
  for causal in (False, True):
    with pytest.raises(ValueError, match="rho must be finite and >= 0"):
      core.favor_attention(q, k, v, proj, kernel="optimal_positive", rho=rho, causal=causal)
    out = jax.jit(lambda r: core.favor_attention(q, k, v, proj, kernel="optimal_positive", rho=r,
                                                 causal=causal))(rho)
    assert np.isnan(out[:, :, 1]).all() and np.isfinite(out[:, :, 0]).all()


@pytest.mark.parametrize("rho", [30.0, 100.0, 1e4])
def test_large_rho_stays_correct(rho):
  """Large valid ρ (A* ≈ −ρ/4): features differ by hundreds of e-folds per projection row."""
  q, k, v = _qkv()
  proj = _proj()
  mask = _mask()
  rho = jnp.full((B, H), rho)
  for causal in (True, False):
    want, _ = explicit("optimal_positive", q, k, v, proj, rho, mask, causal=causal)
    for method in (METHODS if causal else ("chunked",)):
      got = _favor("optimal_positive", causal, method, 16)(q, k, v, proj, rho, mask)
      np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"causal={causal} {method}")


# --- degenerate inputs, as the docstrings say ---------------------------------------------------

def test_zero_projection_gives_what_the_docstring_says():
  q, k, v = _qkv(length=10)
  zero = jnp.zeros((M, D))
  # positive features of a zero projection: φ(x) ∝ exp(−‖x‖²/2), weights ∝ exp(−‖k‖²/(2√d)).
  w_j = np.exp(-np.sum(np.float64(k) ** 2, -1) / (2 * np.sqrt(D)))  # [B, L, H]
  want = np.einsum("bjh,bjhd->bhd", w_j, np.float64(v)) / w_j.sum(1)[..., None]
  got = core.favor_attention(q, k, v, zero)
  np.testing.assert_allclose(got, np.broadcast_to(want[:, None], got.shape), rtol=1e-5, atol=1e-6)
  # relu features of a zero projection are all 0: no key is attended, every row is 0.
  assert np.all(core.favor_attention(q, k, v, zero, kernel="relu") == 0)


@pytest.mark.slow
def test_a_feature_no_key_has_never_sets_a_rows_scale():
  """A Kernel record whose log-features are −∞ for one feature in every key (a pruned feature, the log of an
  exact zero): that feature adds nothing, and must not scale the row's real terms below float32's range.
  It did (read_out and the chunked pass took μ_f = −∞ as 0): every row 0 at ×20 on every path."""
  def pruned_log_features(query, key, projection):
    fq, fk = kernels.positive.log_features(query, key, projection)
    return fq, kernels.LogFeatures(fk.log.at[..., 0].set(-jnp.inf), None)

  pruned = kernels.Kernel("pruned_positive", pruned_log_features, lambda m, d: m, estimates_softmax=False)
  q, k, v = (20.0 * x for x in _qkv(length=12, batch=1))
  v = v / 20.0
  proj = _proj()
  fq, fk = pruned_log_features(q, k, proj)
  la = np.asarray(fq.log, np.float64)[:, :, None] + np.asarray(fk.log, np.float64)[:, None]  # [B, t, j, H, F]
  la = np.log(np.sum(np.exp(la - la.max(-1, keepdims=True)), -1)) + la.max(-1)  # [B, t, j, H]
  for causal in (True, False):
    if causal:
      la_c = np.where(np.tril(np.ones((12, 12), bool))[None, :, :, None], la, -np.inf)
    else:
      la_c = la
    w = np.exp(la_c - la_c.max(2, keepdims=True))
    want = np.einsum("btjh,bjhd->bthd", w, np.asarray(v, np.float64)) / w.sum(2)[..., None]
    for method in (METHODS if causal else ("auto",)):
      got = np.asarray(jax.jit(lambda q, k, v: core.favor_attention(
          q, k, v, proj, kernel=pruned, causal=causal, causal_method=method, chunk_size=4))(q, k, v), np.float64)
      np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"{causal} {method}")
  state = core.favor_decode_init(q[:, :1], v[:, :1], proj, kernel=pruned)
  step = jax.jit(lambda state, q, k, v: core.favor_decode_step(state, q, k, v, proj, kernel=pruned))
  for t in range(12):
    state, y = step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
  want_last = np.einsum("bjh,bjhd->bhd", np.exp(la[:, -1] - la[:, -1].max(1, keepdims=True)), np.asarray(v, np.float64))
  want_last /= np.exp(la[:, -1] - la[:, -1].max(1, keepdims=True)).sum(1)[..., None]
  np.testing.assert_allclose(np.asarray(y[:, 0], np.float64), want_last, rtol=1e-3, atol=1e-4)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [0, 4])
def test_decoding_equals_the_explicit_form_at_every_scale(window, dtype):
  """A prompt (19 tokens, chunks of 8) then tokens one at a time, masked keys among both, for the positive,
  FAVOR++ and FAVOR# kernels at ×1 to ×20: every row is the explicit form's (window > 0: against the
  full hybrid pass, itself tested against its own explicit form; the decoded rows must equal it)."""
  q0, k0, v = _qkv(length=26)
  mask = _mask(length=26)
  for name in ("positive", "optimal_positive", "saderf"):
    proj = _proj(name=name)
    decode = jax.jit(lambda state, q, k, v, mask, rho, chunk_size: core.favor_decode_step(
        state, q, k, v, proj, kernel=name, window=window, key_mask=mask, chunk_size=chunk_size,
        **({} if rho is None else {"rho": rho})), static_argnames="chunk_size")
    hybrid = jax.jit(lambda q, k, v, extra: core.hybrid_attention(  # compiled once per kernel, not per scale
        q, k, v, proj, kernel=name, window=window, causal=True, key_mask=mask, **extra))
    for scale in SCALES:
      q, k, vv = (x.astype(dtype) for x in (scale * q0, scale * k0, v))
      rho = _rho(name, q, k, mask)
      extra = {} if rho is None else {"rho": rho}
      if window:
        want = np.asarray(hybrid(q, k, vv, extra), np.float64)
      else:
        want = explicit(name, q, k, vv, proj, rho, mask, causal=True)[0]
      state = core.favor_decode_init(q[:, :1], vv[:, :1], proj, kernel=name, window=window)
      state, prompt = decode(state, q[:, :19], k[:, :19], vv[:, :19], mask[:, :19], rho, chunk_size=8)
      outs = [prompt]
      for t in range(19, 26):
        token = lambda x: x[:, t:t + 1]
        state, out = decode(state, token(q), token(k), token(vv), token(mask), rho, chunk_size=64)
        outs.append(out)
      got = np.asarray(jnp.concatenate(outs, axis=1), np.float64)
      assert got.dtype == np.float64 and not np.any(np.isnan(got))
      tol = 1e-5 if window and dtype == jnp.float32 else _tolerance(dtype, scale) * 10
      err = np.max(np.abs(got - want))
      assert err <= tol * np.max(np.abs(want)), f"{name} scale={scale}: max error {err}"
      assert not np.any(np.all(got == 0, -1) & ~np.all(want == 0, -1)), (name, scale)
