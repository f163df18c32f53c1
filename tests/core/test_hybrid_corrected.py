"""Small exact windows (1–8 keys, gated or not) and the control-variate hybrid (issue 53) against an explicit
float64 form built from ``tests/core/float64_weights.py`` (nothing of favor_jax), and the corrected hybrid's
unbiasedness for the gated softmax weights by Monte Carlo."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import features as features_lib
from favor_jax.core import gates as gates_lib
from favor_jax.core import hybrid as hybrid_lib
from favor_jax.core import kernels
from tests.core.float64_weights import log_pair_weights

B, L, H, D, DV, M = 2, 24, 2, 8, 3, 16


def _qkv(seed=0, length=L):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(ks[0], (B, length, H, D)), jax.random.normal(ks[1], (B, length, H, D)),
          jax.random.normal(ks[2], (B, length, H, DV)))


def _proj():
  return core.orthogonal_projection(jax.random.PRNGKey(5), M, D)


def _log_gate(length=L):
  """log f [B, L, H], f in (0.05, 1): finite, so the float64 decay below is a plain difference of sums."""
  f = np.random.default_rng(3).uniform(0.05, 1.0, (B, length, H))
  return jnp.asarray(np.log(f), jnp.float32)


def _explicit(q, k, v, proj, *, window, log_gate=None, beta=0.0, mask=None):
  """Causal hybrid in float64 from the papers' formulas: the weight of key j ≤ t is e^{q·k/√d} (exact, j within
  the window) corrected to (1 + β)·e^{q·k/√d} − β·φ(q)ᵀφ(k), or φ(q)ᵀφ(k) beyond it, times e^{Σ_{j<l≤t} log f_l};
  normalised over the unmasked keys j ≤ t. Each row's weights are taken relative to its largest log weight
  (a common factor the normalisation cancels), so inputs ×20 do not overflow float64. Returns the output
  [B, t, H, Dv]."""
  exact, kernel = log_pair_weights("softmax", q, k)[0], log_pair_weights("positive", q, k, proj)[0]  # [B, H, t, j]
  t, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
  near = (t - j >= 0) & (t - j < window)
  if log_gate is not None:
    c = np.cumsum(np.moveaxis(np.asarray(log_gate, np.float64), 2, 1), -1)  # [B, H, L]
    decay = np.where(t >= j, c[..., :, None] - c[..., None, :], 0.0)
    exact, kernel = exact + decay, kernel + decay
  allowed = (t >= j) & (True if mask is None else np.asarray(mask)[:, None, None, :])
  used = np.where(near, np.maximum(exact, kernel), kernel)  # the log weights a row's terms are made of
  peak = np.max(np.where(allowed, used, -np.inf), -1, keepdims=True)
  peak = np.where(np.isfinite(peak), peak, 0.0)
  exact, kernel = np.exp(exact - peak), np.exp(kernel - peak)
  w = np.where(allowed, np.where(near, (1 + beta) * exact - beta * kernel, kernel), 0.0)
  den = w.sum(-1, keepdims=True)
  return np.einsum("bhtj,bjhe->bthe", w / np.where(den == 0, 1.0, den), np.asarray(v, np.float64))


def _f32(x):
  """The rounded inputs, exactly, for the float64 form."""
  return x.astype(jnp.float32)


def _atol(dtype):
  """float32: a few float32 roundings; bfloat16: the output's own rounding, 2^-8 of values ~1."""
  return 5e-5 if dtype == jnp.float32 else 2e-2


@functools.cache
def _hybrid(window, chunk, beta):
  return jax.jit(lambda q, k, v, proj, g, mask: core.hybrid_attention(
      q, k, v, proj, window=window, causal=True, chunk_size=chunk, log_gate=g, key_mask=mask,
      control_variate=beta))


@pytest.mark.slow
@pytest.mark.parametrize("window", range(1, 9))
def test_small_windows_equal_the_explicit_float64_form(window):
  """Windows of 1 (the query's own key) to 8, gated and not, masked and not, chunks shorter and longer than
  the window: the exact part and the kernel's part meet where the float64 form says."""
  q, k, v = _qkv(window)
  proj = _proj()
  mask = jax.random.bernoulli(jax.random.PRNGKey(9), 0.8, (B, L)).at[:, 0].set(True)
  for gated in (False, True):
    g = _log_gate() if gated else None
    for chunk, m in ((4, None), (16, mask)):
      got = np.asarray(_hybrid(window, chunk, None)(q, k, v, proj, g, m), np.float64)
      want = _explicit(q, k, v, proj, window=window, log_gate=g, mask=m)
      np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"gated={gated} chunk={chunk}")
  # and the window matters: the plain kernel's output differs from it
  assert np.abs(_explicit(q, k, v, proj, window=0) - _explicit(q, k, v, proj, window=window)).max() > 1e-3


@pytest.mark.slow(default_tier_covers=())  # the default tier: the first case
@pytest.mark.parametrize("beta,dtype", [(0.3, jnp.float32), (-0.5, jnp.float32), (0.3, jnp.bfloat16)],
                         ids=["0.3-f32", "-0.5-f32", "0.3-bf16"])
def test_the_control_variate_hybrid_equals_the_explicit_float64_form(beta, dtype):
  """Windows of 1 to 6, chunks shorter and longer, gated and not, inputs ×0.6 to ×20 in float32 and bfloat16,
  against the float64 form at the same rounded inputs."""
  q0, k0, v0 = _qkv(1)
  proj = _proj()
  atol = _atol(dtype)
  for scale in (0.6, 4.0, 20.0):
    q, k, v = (scale * q0).astype(dtype), (scale * k0).astype(dtype), v0.astype(dtype)
    for window, chunk in ((1, 4), (4, 4), (6, 16)):
      for g in (None, _log_gate()):
        got = np.asarray(_hybrid(window, chunk, beta)(q, k, v, proj, g, None), np.float64)
        want = _explicit(_f32(q), _f32(k), _f32(v), proj, window=window, log_gate=g, beta=beta)
        np.testing.assert_allclose(got, want, atol=atol, err_msg=f"scale={scale} window={window} gated={g is not None}")


def test_a_per_head_coefficient_is_each_head_with_its_own():
  q, k, v = (0.6 * x for x in _qkv(2))
  proj, g = _proj(), _log_gate()
  both = jax.jit(lambda *a: core.hybrid_attention(*a, window=3, causal=True, log_gate=g, control_variate=jnp.array(
      [0.2, -0.4])))(q, k, v, proj)  # jitted: eagerly, each of the hybrid's operations compiles on its own
  for h, beta in enumerate((0.2, -0.4)):
    want = _explicit(q, k, v, proj, window=3, log_gate=g, beta=beta)
    np.testing.assert_allclose(np.asarray(both)[:, :, h], want[:, :, h], atol=5e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_decoding_with_the_control_variate_equals_the_explicit_float64_form(dtype):
  """A prompt of 5 tokens then one token a step, gated and not, β shared or per head, inputs ×1 to ×20 in
  float32 and bfloat16: each row is (1 + β)·(exact window) + (features beyond) − β·(features over the window),
  normalised, as the float64 form at the same rounded inputs."""
  q0, k0, v0 = _qkv(1, length=9)
  proj, g = _proj(), _log_gate(9)
  step = jax.jit(lambda state, q, k, v, g, beta: core.favor_decode_step(state, q, k, v, proj, window=4, log_gate=g,
                                                                        control_variate=beta))
  atol = _atol(dtype)
  for scale in (0.6, 4.0, 20.0):
    q, k, v = (scale * q0).astype(dtype), (scale * k0).astype(dtype), v0.astype(dtype)
    for beta, gate in ((jnp.float32(0.3), None), (jnp.array([0.2, -0.4]), g)):
      cut = lambda x, a, b: None if x is None else x[:, a:b]
      empty = core.favor_decode_init(q[:, :1], v[:, :1], proj, window=4)
      state, out = step(empty, *(cut(x, 0, 5) for x in (q, k, v, gate)), beta)  # a prompt of 5
      outs = [out]
      for t in range(5, 9):
        state, out = step(state, *(cut(x, t, t + 1) for x in (q, k, v, gate)), beta)
        outs.append(out)
      got = np.asarray(jnp.concatenate(outs, axis=1), np.float64)
      for h, b in enumerate(np.broadcast_to(np.asarray(beta), (H,))):
        want = _explicit(_f32(q), _f32(k), _f32(v), proj, window=4, log_gate=gate, beta=float(b))
        np.testing.assert_allclose(got[:, :, h], want[:, :, h], atol=atol,
                                   err_msg=f"scale={scale} beta={b} gated={gate is not None}")
  with pytest.raises(ValueError, match="needs window > 0"):
    core.favor_decode_step(core.favor_decode_init(q[:, :1], v[:, :1], proj), q[:, :1], k[:, :1], v[:, :1], proj,
                           control_variate=0.5)


def test_the_control_variate_limits_are_the_plain_hybrid_and_favor():
  q, k, v = _qkv(3)
  proj, g = _proj(), _log_gate()
  # jitted: eagerly, each of the hybrid's operations compiles on its own
  hybrid = lambda **kw: jax.jit(lambda q, k, v, proj, g: core.hybrid_attention(
      q, k, v, proj, window=4, causal=True, chunk_size=8, log_gate=g, **kw))
  favor = jax.jit(lambda q, k, v, proj, g: core.favor_attention(q, k, v, proj, causal=True, chunk_size=8, log_gate=g))
  np.testing.assert_allclose(hybrid(control_variate=-1.0)(q, k, v, proj, g), favor(q, k, v, proj, g), atol=2e-6)
  plain = hybrid()(q, k, v, proj, g)
  for off in (None, 0, 0.0):
    np.testing.assert_array_equal(hybrid(control_variate=off)(q, k, v, proj, g), plain)


def _products_outside_loops(jaxpr) -> int:
  """dot_generals of ``jaxpr`` (and the jaxprs it calls) that no ``scan`` runs: products of a separate pass."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      continue
    count += eqn.primitive.name == "dot_general"
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else [param]:
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's own
        if hasattr(sub, "eqns"):
          count += _products_outside_loops(sub)
  return count


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_a_window_no_longer_than_a_chunk_runs_inside_the_chunked_pass(gated):
  """Causal, window ≤ chunk: every product, the exact window's included, runs in the chunked pass's loop over
  blocks (no separate pass over the sequence); with a control variate too. A window longer than the chunk has
  its own blocked pass beside it (the check has teeth)."""
  q, k, v = _qkv(4, length=64)
  proj, g = _proj(), (_log_gate(length=64) if gated else None)
  program = lambda window, **kw: jax.make_jaxpr(lambda q, k, v: core.hybrid_attention(
      q, k, v, proj, window=window, causal=True, chunk_size=8, log_gate=g, **kw))(q, k, v).jaxpr
  for window in (1, 8):
    assert _products_outside_loops(program(window)) == 0, window
  assert _products_outside_loops(program(4, control_variate=0.5)) == 0
  assert _products_outside_loops(program(9)) > 0


@pytest.mark.slow
def test_the_control_variate_hybrid_is_unbiased_for_the_gated_softmax_weights():
  """E over ω of each unnormalised weight (one-hot values: the numerator times e^{its scale}) is
  e^{q·k/√d + Σ log f}, inside the window (where the estimate is (1 + β)·w − β·ŵ) and beyond it."""
  length, draws, window, beta = 7, 3000, 3, 0.5
  q, k, _ = (0.8 * x[:1, :length] for x in _qkv(4))
  v = jnp.broadcast_to(jnp.eye(length)[None, :, None], (1, length, H, length))  # value j = e_j
  g = jnp.log(jnp.asarray([[1.0, 0.8, 0.3, 0.9, 0.05, 0.6, 0.7]]))[..., None] * jnp.ones((1, 1, H))
  gates = gates_lib.prepare(g, None, q, True)
  mask = jnp.ones((1, length), bool)

  def one(key):
    proj = core.iid_gaussian_projection(key, 8, D)
    features = features_lib.of_kernel(kernels.KERNELS["positive"], proj, None, True)
    num, _, scale = hybrid_lib.hybrid(features, q, k, v, mask, window, True, 4, gates, jnp.float32(beta),
                                      with_scale=True)
    return num * jnp.exp(scale)[..., None]  # [1, t, H, j]

  est = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(1), draws)), np.float64)[:, 0]
  c = np.cumsum(np.asarray(g[0], np.float64), 0)  # [L, H]
  t, j = np.arange(length)[:, None], np.arange(length)[None, :]
  logits = np.einsum("thd,jhd->tjh", np.asarray(q[0], np.float64), np.asarray(k[0], np.float64)) / math.sqrt(D)
  decay = np.where((t >= j)[..., None], c[:, None] - c[None, :], -np.inf)  # [t, j, H]
  exact = np.moveaxis(np.exp(logits + decay), 1, 2)  # [t, H, j]
  mean, stderr = est.mean(0), est.std(0) / math.sqrt(draws)
  err = np.abs(mean - exact)
  assert np.all(err < 5 * stderr + 1e-5 * exact + 1e-12), (err / np.maximum(stderr, 1e-30)).max()
  near = np.moveaxis(np.broadcast_to(((t - j >= 0) & (t - j < window))[..., None], exact.shape[:1] + (length, H)),
                     1, 2)
  assert np.all(stderr[near] > 0)  # the window's weights are estimated too (β ≠ 0), not exact
  # and the check has teeth: the correction without its known mean (−β·Ŝ_W alone) is biased inside the window
  biased = est - np.where(near, beta * exact, 0.0)
  assert np.any(np.abs(biased.mean(0) - exact) > 5 * stderr + 1e-3)


def test_bad_control_variates_are_refused():
  q, k, v = _qkv(length=8)
  proj = _proj()
  with pytest.raises(ValueError, match="needs window > 0"):
    core.hybrid_attention(q, k, v, proj, window=0, control_variate=0.5)
  with pytest.raises(ValueError, match="finite"):
    core.hybrid_attention(q, k, v, proj, window=2, control_variate=float("nan"))
  with pytest.raises(ValueError, match=r"shape \(\) or \[H\]"):
    core.hybrid_attention(q, k, v, proj, window=2, control_variate=jnp.ones(H + 1))
  for bad in ("0.5", True, jnp.ones(H, jnp.int32)):
    with pytest.raises(TypeError, match="control_variate must be a real number"):
      core.hybrid_attention(q, k, v, proj, window=2, control_variate=bad)
