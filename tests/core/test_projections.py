import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core

PROJECTIONS = [core.iid_gaussian_projection, core.orthogonal_projection, core.simplex_projection]


@pytest.mark.parametrize("make", PROJECTIONS)
@pytest.mark.parametrize("m,d", [(16, 8), (20, 8), (5, 8)])
def test_shape_dtype_and_key_determinism(make, m, d):
  key = jax.random.PRNGKey(0)
  w = make(key, m, d)
  assert w.shape == (m, d) and w.dtype == jnp.float32
  np.testing.assert_array_equal(w, make(key, m, d))
  assert not np.allclose(w, make(jax.random.PRNGKey(1), m, d))
  assert make(key, m, d, dtype=jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("make", PROJECTIONS)
def test_rows_are_marginally_standard_normal(make):
  # E[ω ωᵀ] = I and E[‖ω‖²] = d: needed for unbiased exponential features.
  d = 6
  w = jax.vmap(lambda k: make(k, 12, d))(jax.random.split(jax.random.PRNGKey(3), 4000))
  w = np.asarray(w).reshape(-1, d)
  np.testing.assert_allclose(w.T @ w / len(w), np.eye(d), atol=0.05)
  np.testing.assert_allclose(np.mean(w, 0), 0, atol=0.03)


def test_orthogonal_blocks_are_orthogonal_with_chi_or_fixed_norms():
  d = 8
  w = np.asarray(core.orthogonal_projection(jax.random.PRNGKey(0), 20, d))
  for block in (w[:8], w[8:16], w[16:]):
    dirs = block / np.linalg.norm(block, axis=1, keepdims=True)
    np.testing.assert_allclose(dirs @ dirs.T, np.eye(len(block)), atol=1e-5)
  assert np.std(np.linalg.norm(w, axis=1)) > 0.1  # χ_d norms vary
  fixed = np.asarray(core.orthogonal_projection(jax.random.PRNGKey(0), 20, d, norms="fixed"))
  np.testing.assert_allclose(np.linalg.norm(fixed, axis=1), np.sqrt(d), rtol=1e-5)


def test_orthogonal_directions_are_haar_not_raw_qr():
  # Raw Householder QR makes Q[0, 0] = -|a11|/‖a1‖ < 0 always; Haar directions are sign-symmetric.
  d = 4
  w = jax.vmap(lambda k: core.orthogonal_projection(k, d, d, norms="fixed"))(
      jax.random.split(jax.random.PRNGKey(7), 2000))
  first = np.asarray(w[:, :, 0]).ravel()
  assert 0.45 < np.mean(first > 0) < 0.55
  raw = np.linalg.qr(np.random.default_rng(0).standard_normal((2000, d, d)))[0]
  assert abs(np.mean(raw[:, 0, 0] > 0) - 0.5) > 0.3  # the check above would catch raw QR


def test_simplex_blocks_have_simplex_geometry():
  d = 6
  w = np.asarray(core.simplex_projection(jax.random.PRNGKey(0), 14, d))
  for block in (w[:6], w[6:12]):
    dirs = block / np.linalg.norm(block, axis=1, keepdims=True)
    cos = dirs @ dirs.T
    np.testing.assert_allclose(cos[~np.eye(d, dtype=bool)], -1 / (d - 1), atol=1e-5)
  assert np.std(np.linalg.norm(w, axis=1)) > 0.1


@pytest.mark.parametrize("make", PROJECTIONS)
def test_bad_sizes(make):
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="num_features must be positive, got 0"):
    make(key, 0, 4)
  with pytest.raises(ValueError, match="dim must be positive"):
    make(key, 4, -1)
  with pytest.raises(TypeError, match=r"num_features must be an int \(Python or NumPy\), got float"):
    make(key, 4.0, 4)
  np.testing.assert_array_equal(make(key, np.int64(4), np.int32(4)), make(key, 4, 4))


def test_bad_norms():
  with pytest.raises(ValueError, match="norms must be"):
    core.orthogonal_projection(jax.random.PRNGKey(0), 4, 4, norms="unit")
