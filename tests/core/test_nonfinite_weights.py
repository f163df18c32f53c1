"""attention_weights keeps the non-finite rule of favor_attention (in both log modes), and its log mode
matches a float64 evaluation of each kernel's formula to float32's precision at input scales ×1 to ×20."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import kernels
from tests.core import float64_weights

EPS = float(np.finfo(np.float32).eps)
SCALES = (1.0, 4.0, 7.0, 20.0)
# Every kernel of KERNELS, and softmax.
NAMES = ("softmax",) + tuple(sorted(kernels.KERNELS))


def _inputs(name, batch, lq, lk, h, d, m, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = 0.5 * jax.random.normal(ks[0], (batch, lq, h, d))
  k = 0.5 * jax.random.normal(ks[1], (batch, lk, h, d))
  if name in ("softmax", "elu_plus_one", "taylor"):
    w = None
  elif name == "hedgehog":  # a trained map's shape: per head, near the identity
    w = jnp.broadcast_to(jnp.eye(m, d), (h, m, d)) + 0.3 * jax.random.normal(ks[2], (h, m, d))
  else:
    w = core.orthogonal_projection(ks[3], m, d)
  return q, k, w


def _weights(name, causal, log, **kw):
  return jax.jit(functools.partial(core.attention_weights, kernel=name, causal=causal, log=log, **kw))


def _statistic(name, q, k):
  """A causal data-dependent kernel's statistic (passed by the caller: here, the whole sequence's)."""
  return kernels.KERNELS[name].compute_statistic(q, k) if name in kernels.data_dependent_names() else None


# --- the NaN rule -----------------------------------------------------------------------------------

RULE_NAMES = ("softmax", "positive", "taylor", "hedgehog", "elu_plus_one", "saderf")


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("name", RULE_NAMES)
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_non_finite_input_gives_nan_exactly_where_exact_attention_depends_on_it(name, log, causal):
  """The pattern of favor_attention's test (tests/core/test_numerics.py) for the weights: a non-finite query
  gives NaN in its own row; a non-finite key in the rows that may see it (j ≤ t if causal), never earlier;
  every other row equals that of the same inputs with the entry set to 0."""
  q, k, w = _inputs(name, 1, 48, 48, 2, 8, 16)
  t = 5
  weights = _weights(name, causal, log)
  for where in ("query", "key"):
    for value in (jnp.nan, jnp.inf, -jnp.inf):
      args = dict(query=q, key=k)
      clean = dict(args)
      args[where] = args[where].at[0, t, 1, 3].set(value)
      clean[where] = clean[where].at[0, t, 1, 3].set(0.0)
      # A data-dependent kernel's statistic leaves non-finite rows out: the same one for both calls.
      rho = _statistic(name, *args.values())
      got = np.asarray(weights(**args, projection=w, rho=rho))
      want_rows = np.zeros(got.shape[:-1], bool)  # [B, H, Lq]
      if where == "query":
        want_rows[0, 1, t] = True
      else:
        want_rows[0, 1, t if causal else 0:] = True
      nan_rows = np.isnan(got).any(-1)
      np.testing.assert_array_equal(nan_rows, want_rows, err_msg=f"{where}={value}")
      assert np.all(np.isnan(got[nan_rows]))  # every entry of such a row, never a 0 or −inf
      # The exact reference (which attends the same keys) has NaN in the same rows.
      exact = np.asarray(core.softmax_attention(args["query"], args["key"], jnp.ones_like(k), causal=causal))
      np.testing.assert_array_equal(np.moveaxis(np.isnan(exact).any(-1), 1, 2), want_rows)
      other = np.asarray(weights(**clean, projection=w, rho=rho))
      np.testing.assert_allclose(got[~nan_rows], other[~nan_rows], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("log", [False, True])
def test_a_masked_non_finite_key_is_absent(log):
  q, k, w = _inputs("positive", 1, 20, 20, 2, 8, 16)
  mask = jnp.ones((1, 20), bool).at[0, 7].set(False)
  weights = _weights("positive", True, log, key_mask=mask)
  got = weights(q, k.at[0, 7].set(jnp.nan), w)
  np.testing.assert_allclose(got, weights(q, k, w), rtol=1e-6, atol=1e-7)


# --- log mode against float64 -----------------------------------------------------------------------

# (batch, Lq, Lk, heads, D, M): the audit's shape (L = 37, D = 16), item 1's, and Lq ≠ Lk.
SHAPES = [(2, 37, 37, 2, 16, 32), (1, 48, 48, 2, 8, 16), (1, 13, 29, 1, 4, 8)]


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", NAMES)
def test_log_weights_match_float64_to_float32_precision(name, shape):
  """|log A − log A₆₄| ≤ 16·eps·(1 + S) at ×1..×20 (S: the row's term scale, see float64_weights), and log A
  finite wherever log A₆₄ is, NaN where it is (trigonometric: a row with a negative weight)."""
  batch, lq, lk, h, d, m = shape
  cases = [(False, False)] + ([(True, True)] if lq == lk else [])  # (causal, with a key mask)
  for causal, masked in cases:
    mask = None
    if masked:
      mask = jax.random.bernoulli(jax.random.PRNGKey(2), 0.8, (batch, lk)).at[:, 0].set(True)
    weights = _weights(name, causal, True, key_mask=mask)
    for scale in SCALES:
      q, k, w = _inputs(name, batch, lq, lk, h, d, m)
      q, k = q * scale, k * scale
      rho = _statistic(name, q, k) if causal else None
      got = np.asarray(weights(q, k, w, rho=rho), np.float64)
      want, size = float64_weights.log_weights(name, *(None if x is None else np.asarray(x) for x in (q, k, w)),
                                               causal=causal, key_mask=mask)
      tol = 16 * EPS * (1 + size[..., None])
      finite = np.isfinite(want)
      msg = f"{name} causal={causal} masked={masked} x{scale}"
      np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=msg)
      np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=msg)
      err = np.abs(np.where(finite, got, 0.0) - np.where(finite, want, 0.0))  # non-finite entries compared above
      worst = np.max(err / np.broadcast_to(tol, err.shape))
      assert worst <= 1.0, f"{msg}: error {np.max(err):.3g} is {worst:.3g}× the bound"
