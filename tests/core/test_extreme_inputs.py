"""Extreme finite inputs: inside every kernel's range (statistics.MAX_SQ_NORM) attention is the float64 formula
rounded to float32, never a zero row; beyond it a row counts as non-finite (NaN where it is seen), never a
silent zero and never an error about a ``rho`` the caller did not pass. FAVOR#'s statistic: one outlier
moves the others by a bounded amount, and ordinary data get the paper's statistic."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import kernels, statistics
from tests.core import float64_weights

EPS = float(np.finfo(np.float32).eps)
RANGE = 2.0 ** 120  # the documented range, statistics.MAX_SQ_NORM: ‖q‖²/√d up to this
CLIP = 64.0  # statistics.CLIP, FAVOR#'s winsorising factor


def _in_range(z):
  """Per row, in float64: ‖z·d^{-1/4}‖² ≤ RANGE."""
  z = np.asarray(z, np.float64)
  return np.sum(z * z, -1) / np.sqrt(z.shape[-1]) <= RANGE
NAMES = tuple(sorted(kernels.KERNELS))
T = 20  # the extreme row


def _inputs(name, d=8, length=48, heads=2, m=16, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, k, v = (0.5 * jax.random.normal(kk, (1, length, heads, d)) for kk in ks[:3])
  if name in ("elu_plus_one", "taylor"):
    w = None
  elif name == "hedgehog":
    w = jnp.broadcast_to(jnp.eye(m, d), (heads, m, d))
  else:
    w = core.orthogonal_projection(ks[3], m, d)
  return q, k, v, w


def _statistic(name, q, k):
  return kernels.KERNELS[name].compute_statistic(q, k) if name in kernels.data_dependent_names() else None


def _attend(name, causal):
  return jax.jit(lambda q, k, v, w, rho: core.favor_attention(q, k, v, w, kernel=name, causal=causal, rho=rho))


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("d", [8, 16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_beyond_the_range_a_row_is_nan_where_seen_never_a_zero_row(name, causal, d):
  """One query or key ×1e19 / ×1e20 (‖x‖² beyond 2^120, or overflowing): NaN in the rows that depend on it,
  exactly as for a NaN input, every other row as with that row set to 0. Bidirectional FAVOR++/FAVOR#
  compute their statistic without it (no error about a rho)."""
  q, k, v, w = _inputs(name, d)
  attend = _attend(name, causal)
  for where in ("query", "key"):
    for scale in (1e19, 1e20):
      args = dict(q=q, k=k)
      args[where[0]] = args[where[0]].at[0, T].multiply(scale)
      assert not np.all(_in_range(args[where[0]])), "the row must be beyond the range"
      zeroed = dict(args)
      zeroed[where[0]] = zeroed[where[0]].at[0, T].set(0.0)
      rho = _statistic(name, **args)  # leaves the row out, as a NaN row: the same for both calls
      got = np.asarray(attend(args["q"], args["k"], v, w, rho))
      if not causal and name in kernels.data_dependent_names():  # its statistic computed inside
        np.testing.assert_array_equal(np.isnan(got), np.isnan(np.asarray(
            core.favor_attention(args["q"], args["k"], v, w, kernel=name))))
      want_rows = np.zeros(got.shape[:-1], bool)
      if where == "query":
        want_rows[0, T] = True
      else:
        want_rows[0, T if causal else 0:] = True
      nan_rows = np.isnan(got).any(-1)
      np.testing.assert_array_equal(nan_rows, want_rows, err_msg=f"{where} x{scale:g}")
      assert np.all(np.isnan(got[nan_rows]))
      assert np.all(np.abs(got[~nan_rows]).max(-1) > 0), "a zero row"
      other = np.asarray(attend(zeroed["q"], zeroed["k"], v, w, rho))
      np.testing.assert_allclose(got[~nan_rows], other[~nan_rows], rtol=1e-5, atol=1e-6)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_inside_the_range_outputs_and_log_weights_match_float64(name, causal):
  """One query or key ×1e3, ×1e9, ×1e17 (inside the range): favor_attention's output and attention_weights'
  log weights equal the float64 formula to float32's rounding of its terms (16·eps·(1 + S), S the row's term
  scale), finite wherever float64 is, and no row is zero where float64's is not. A data-dependent kernel's
  statistic is the one computed from the inputs, given to both sides."""
  q, k, v, w = _inputs(name)
  attend = _attend(name, causal)
  log_weights = jax.jit(functools.partial(core.attention_weights, kernel=name, causal=causal, log=True))
  for where in ("query", "key"):
    for scale in (1e3, 1e9, 1e17):
      args = dict(q=q, k=k)
      args[where[0]] = args[where[0]].at[0, T].multiply(scale)
      assert np.all(_in_range(args[where[0]]))
      rho = _statistic(name, **args)
      msg = f"{name} causal={causal} {where} x{scale:g}"
      want, size = float64_weights.log_weights(name, *(None if x is None else np.asarray(x) for x in (
          args["q"], args["k"], w)), causal=causal, statistic=None if rho is None else np.asarray(rho))
      tol = 16 * EPS * (1 + size)  # [B, H, Lq]
      got_log = np.asarray(log_weights(args["q"], args["k"], w, rho=rho), np.float64)
      # Trigonometric features are sines of ωx: once float32 rounds ωx by a radian (tol ≥ 1, ×1e9) they
      # are noise in float32 (the formula at rounded inputs), and a weight's sign with them.
      known = np.broadcast_to((tol < 1)[..., None] if name == "trigonometric" else True, want.shape)
      np.testing.assert_array_equal(np.isnan(got_log)[known], np.isnan(want)[known], err_msg=msg)
      np.testing.assert_array_equal(np.isfinite(got_log)[known], np.isfinite(want)[known], err_msg=msg)
      finite = np.isfinite(want)
      err = np.where(finite & np.isfinite(got_log), np.abs(got_log - np.where(finite, want, 0)), 0)
      assert np.all(err <= tol[..., None]), f"{msg}: log weights off by {err.max():.3g}"
      got = np.asarray(attend(args["q"], args["k"], v, w, rho), np.float64)
      if name in ("trigonometric", "relu"):  # weights that can be negative or 0: compared through log A only
        assert np.all(np.isfinite(got) | np.isnan(want).any(-1).transpose(0, 2, 1)[..., None]), msg
        continue
      a = np.exp(want)  # [B, H, Lq, Lk]
      ref = np.einsum("bhqk,bkhd->bqhd", a, np.asarray(v, np.float64))
      assert np.all(np.isfinite(got)), msg
      out_tol = (4 * tol.transpose(0, 2, 1) * np.max(np.abs(np.asarray(v)))) + 1e-6  # Σ_j A_j δ_j |v_j|
      assert np.all(np.abs(got - ref) <= out_tol[..., None]), f"{msg}: outputs off by {np.abs(got - ref).max():.3g}"


def test_favor_plus_plus_coefficient_is_finite_for_any_finite_statistic():
  """A* = (1 − 2ρ − √((2ρ+1)² + 8ρ))/16 overflowed (√ of ρ² > float32's max) from ρ ≈ 1e19: NaN everywhere."""
  q, k, v, w = _inputs("optimal_positive")
  for rho in (1e10, 1e20, 1e30):
    out = core.favor_attention(q, k, v, w, kernel="optimal_positive", rho=rho)
    assert np.all(np.isfinite(np.asarray(out))), rho


# --- FAVOR#'s statistic against one outlier ---------------------------------------------------------

def _plain_statistic(q, k):
  """The paper's statistic in float64, plain means: [B, H, D+1] (log Ψ, then ρ)."""
  d = q.shape[-1]
  x, y = (np.asarray(z, np.float64) * d ** -0.25 for z in (q, k))
  mx, my = (x * x).mean(1), (y * y).mean(1)
  floor = 1e-8 * np.mean(mx + my, -1, keepdims=True) + 1e-30
  log_psi = 0.25 * (np.log(my + floor) - np.log(mx + floor))
  psi = np.exp(log_psi)[:, None]
  pairs = (x * psi)[:, :, None] + (y / psi)[:, None, :]
  rho = np.mean(np.sum(pairs * pairs, -1), axis=(1, 2)) / d
  return np.concatenate([log_psi, rho[..., None]], -1)


@pytest.mark.parametrize("scale", [1.0, 4.0, 20.0])
def test_saderf_statistic_is_the_papers_on_ordinary_data(scale):
  """Gaussian rows (anisotropic, as FAVOR# is meant for): no value reaches the clip, the statistic is the
  plain-mean one of the paper to float32 rounding."""
  ks = jax.random.split(jax.random.PRNGKey(4), 2)
  sigma = jnp.exp(jnp.linspace(-1.0, 1.0, 16))
  q = scale * sigma * jax.random.normal(ks[0], (2, 64, 3, 16))
  k = scale * jax.random.normal(ks[1], (2, 64, 3, 16)) / sigma
  got = np.asarray(kernels.saderf_statistic(q, k), np.float64)
  want = _plain_statistic(q, k)
  np.testing.assert_allclose(got[..., :-1], want[..., :-1], rtol=0, atol=1e-5)
  np.testing.assert_allclose(got[..., -1], want[..., -1], rtol=1e-5)


def test_one_outlier_moves_saderf_statistic_and_other_rows_by_a_bounded_amount():
  """One query ×10..×1e8 (bidirectional): log Ψ_l moves by at most ¼·log(1 + CLIP·c_l/S_l) (c_l the cap's
  scale, S_l = Σ x_l² over the other rows; or the row's own share before, whichever is larger), and the
  other rows' outputs stay within 0.5 of their values without the outlier (main: up to 3.3, the statistic
  following the outlier)."""
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(kk, (1, 48, 2, 8)) for kk in ks[:3])
  w = core.orthogonal_projection(ks[3], 16, 8)
  attend = jax.jit(lambda q: core.favor_attention(q, k, v, w, kernel="saderf"))
  base, base_stat = np.asarray(attend(q)), np.asarray(kernels.saderf_statistic(q, k), np.float64)
  scaled = lambda z: np.asarray(z, np.float64)[0] * 8 ** -0.25  # [L, H, D]
  rest = np.sum(np.delete(scaled(q), 7, axis=0) ** 2, axis=0)  # Σ over the other rows of x_l²
  for scale in (1e1, 1e2, 1e4, 1e8):
    moved = q.at[0, 7].multiply(scale)
    x = scaled(moved)
    cap = CLIP * np.maximum(np.median(x * x, axis=0), np.median(np.sum(x * x, -1), axis=0)[:, None] / 8)
    # m_l = (rest + the row's clipped x_l²)/n, before: (rest + x_7l²)/n; log Ψ_l = ¼(log m^y_l − log m_l).
    bound = 0.25 * np.maximum(np.log1p(cap / rest), np.log1p(scaled(q)[7] ** 2 / rest))
    stat = np.asarray(kernels.saderf_statistic(moved, k), np.float64)
    assert np.all(np.abs(stat[0, :, :-1] - base_stat[0, :, :-1]) <= bound + 1e-5), scale
    others = np.delete(np.abs(np.asarray(attend(moved)) - base), 7, axis=1)
    assert others.max() < 0.5, (scale, others.max())


def test_the_range_and_the_clip_are_the_documented_ones():
  assert statistics.MAX_SQ_NORM == RANGE and statistics.CLIP == CLIP
  z = jnp.zeros((1, 3, 1, 4)).at[0, 1, 0, 0].set(1.05e18 * 4 ** 0.25).at[0, 2, 0, 0].set(1.2e18 * 4 ** 0.25)
  np.testing.assert_array_equal(np.asarray(statistics.in_range(z))[0, :, 0], [True, True, False])
  np.testing.assert_array_equal(_in_range(z)[0, :, 0], [True, True, False])
