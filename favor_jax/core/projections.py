"""Random projections ω ∈ R^{M×D} for random-feature attention: iid, orthogonal, simplex, and their registry.

Every projection here has rows whose *marginal* law is N(0, I_D) (except
``orthogonal_projection(norms="fixed")``), which is what makes the exponential
feature maps in :mod:`favor_jax.core.kernels` unbiased. Rows inside a block of
D are coupled (orthogonal or simplex directions) to reduce variance.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

__all__ = ["iid_gaussian_projection", "orthogonal_projection", "simplex_projection", "PROJECTIONS",
           "draw_projection", "draw_projection_by_index"]


def _check_sizes(num_features, dim):
  for name, value in (("num_features", num_features), ("dim", dim)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise TypeError(f"{name} must be an int (Python or NumPy), got {type(value).__name__}")
    if value <= 0:
      raise ValueError(f"{name} must be positive, got {value}")


def _haar_orthogonal(key: PRNGKeyArray, num_blocks: int, dim: int) -> Float[Array, "n D D"]:
  """Haar-distributed orthogonal matrices (Mezzadri 2007).

  QR of a Gaussian matrix is Haar only after fixing the signs so that
  diag(R) > 0; LAPACK's raw Q is not (its first column always has a negative
  first entry, for instance).
  """
  g_nDD = jax.random.normal(key, (num_blocks, dim, dim), jnp.float32)
  q_nDD, r_nDD = jnp.linalg.qr(g_nDD)
  sign_nD = jnp.sign(jnp.diagonal(r_nDD, axis1=-2, axis2=-1))
  sign_nD = jnp.where(sign_nD == 0, 1.0, sign_nD)
  return q_nDD * sign_nD[:, None, :]


def _chi_norms(key: PRNGKeyArray, num_features: int, dim: int) -> Float[Array, " M"]:
  """Norms of independent N(0, I_dim) vectors: χ_dim-distributed."""
  return jnp.linalg.norm(jax.random.normal(key, (num_features, dim), jnp.float32), axis=-1)


def iid_gaussian_projection(
    key: PRNGKeyArray, num_features: int, dim: int, dtype=jnp.float32
) -> Float[Array, "M D"]:
  """Draws an [M, D] projection with independent rows ω_i ~ N(0, I_D).

  Args:
    key: PRNG key.
    num_features: M, the number of rows (random features per head).
    dim: D, the head dim of query and key.
    dtype: dtype of the result (drawn in float32, then cast).

  Returns:
    The projection ω, shape [M, D].

  Raises:
    TypeError: if ``num_features`` or ``dim`` is not an int (a bool is refused).
    ValueError: if ``num_features`` or ``dim`` is not positive.

  References:
    Choromanski et al. 2021, "Rethinking Attention with Performers" (ICLR).
  """
  _check_sizes(num_features, dim)
  return jax.random.normal(key, (num_features, dim), jnp.float32).astype(dtype)


def orthogonal_projection(
    key: PRNGKeyArray, num_features: int, dim: int, *, norms: str = "chi", dtype=jnp.float32
) -> Float[Array, "M D"]:
  """Draws an [M, D] projection of orthogonal random features (ORF, the "OR" of FAVOR+).

  Rows come in blocks of D exactly orthogonal, Haar-uniform directions
  (independent blocks; the last one truncated; Haar via sign-corrected QR,
  Mezzadri 2007). ``norms="chi"`` scales each row by an independent χ_D norm,
  so every row is marginally N(0, I_D) and the exponential kernels stay
  unbiased. ``norms="fixed"`` sets every norm to √D: lower variance in
  practice, but *biased* for the exponential kernels.

  Args:
    key: PRNG key.
    num_features: M, the number of rows (random features per head).
    dim: D, the head dim of query and key.
    norms: ``"chi"`` (independent χ_D row norms: unbiased) or ``"fixed"``
      (every norm √D: biased for the exponential kernels).
    dtype: dtype of the result (drawn in float32, then cast).

  Returns:
    The projection ω, shape [M, D].

  Raises:
    TypeError: if ``num_features`` or ``dim`` is not an int (a bool is refused).
    ValueError: if ``num_features`` or ``dim`` is not positive, or ``norms`` is
      neither ``"chi"`` nor ``"fixed"``.

  References:
    Yu et al. 2016, "Orthogonal Random Features" (NeurIPS).
    Choromanski et al. 2021, "Rethinking Attention with Performers" (ICLR).
  """
  _check_sizes(num_features, dim)
  if norms not in ("chi", "fixed"):
    raise ValueError(f"norms must be 'chi' or 'fixed', got {norms!r}")
  key_dir, key_norm = jax.random.split(key)
  num_blocks = -(-num_features // dim)
  dirs_MD = _haar_orthogonal(key_dir, num_blocks, dim).reshape(num_blocks * dim, dim)[:num_features]
  if norms == "chi":
    norms_M = _chi_norms(key_norm, num_features, dim)
  else:
    norms_M = jnp.full((num_features,), jnp.sqrt(float(dim)), jnp.float32)
  return (dirs_MD * norms_M[:, None]).astype(dtype)


def simplex_projection(
    key: PRNGKeyArray, num_features: int, dim: int, dtype=jnp.float32
) -> Float[Array, "M D"]:
  """Draws an [M, D] projection of simplex random features.

  In each block of D rows the unit directions are the D vertices of a regular
  simplex centred at the origin (pairwise cosine −1/(D−1)), turned by an
  independent Haar rotation, then scaled by independent χ_D norms. Each row is
  marginally N(0, I_D), so the exponential kernels stay unbiased.

  Args:
    key: PRNG key.
    num_features: M, the number of rows (random features per head).
    dim: D, the head dim of query and key (at least 2).
    dtype: dtype of the result (drawn in float32, then cast).

  Returns:
    The projection ω, shape [M, D].

  Raises:
    TypeError: if ``num_features`` or ``dim`` is not an int (a bool is refused).
    ValueError: if ``num_features`` or ``dim`` is not positive, or ``dim < 2``.

  References:
    Reid et al. 2023, "Simplex Random Features" (ICML).
  """
  _check_sizes(num_features, dim)
  if dim < 2:
    raise ValueError(f"simplex_projection needs dim >= 2, got dim={dim}")
  key_rot, key_norm = jax.random.split(key)
  num_blocks = -(-num_features // dim)
  # Centred basis vectors e_i − 1/D, normalised: pairwise cosine −1/(D−1).
  simplex_DD = jnp.eye(dim, dtype=jnp.float32) - 1.0 / dim
  simplex_DD = simplex_DD / jnp.linalg.norm(simplex_DD, axis=-1, keepdims=True)
  rot_nDD = _haar_orthogonal(key_rot, num_blocks, dim)
  dirs_nDD = jnp.einsum("ij,nkj->nik", simplex_DD, rot_nDD)  # rows R s_i
  dirs_MD = dirs_nDD.reshape(num_blocks * dim, dim)[:num_features]
  norms_M = _chi_norms(key_norm, num_features, dim)
  return (dirs_MD * norms_M[:, None]).astype(dtype)


PROJECTIONS = {
    "iid": iid_gaussian_projection,
    "orthogonal": orthogonal_projection,
    "simplex": simplex_projection,
}


def draw_projection(key: PRNGKeyArray, kind: str, num_features: int, dim: int) -> Float[Array, "M D"]:
  """Draws a fresh [M, D] projection of the kind named ``kind``.

  Args:
    key: PRNG key.
    kind: a name in ``PROJECTIONS``: ``"iid"``, ``"orthogonal"`` or ``"simplex"``.
    num_features: M, the number of rows.
    dim: D, the head dim of query and key.

  Returns:
    The projection ω, shape [M, D], float32.

  Raises:
    ValueError: if ``kind`` is not in ``PROJECTIONS``, or the sizes are invalid
      (as the projection function raises).
    TypeError: if ``num_features`` or ``dim`` is not an int.
  """
  if kind not in PROJECTIONS:
    raise ValueError(f"projection must be one of {tuple(PROJECTIONS)}, got {kind!r}")
  return PROJECTIONS[kind](key, num_features, dim)


def draw_projection_by_index(key: PRNGKeyArray, kind_index, num_features: int, dim: int) -> Float[Array, "M D"]:
  """Draws a projection as :func:`draw_projection` does, its kind given by a (possibly traced) index.

  The branch is chosen with ``jax.lax.switch``, so a layer can keep the kind as
  an integer in its state and redraw inside ``jit``.

  Args:
    key: PRNG key.
    kind_index: int or int32 scalar array, an index into ``tuple(PROJECTIONS)``
      (0 ``"iid"``, 1 ``"orthogonal"``, 2 ``"simplex"``); ``lax.switch`` clamps
      an index out of range.
    num_features: M, the number of rows.
    dim: D, the head dim of query and key.

  Returns:
    The projection ω, shape [M, D], float32.

  Raises:
    TypeError: if ``num_features`` or ``dim`` is not an int.
    ValueError: if ``num_features`` or ``dim`` is not positive (or ``dim < 2``
      where the simplex branch is traced).
  """
  branches = [lambda k, draw=draw: draw(k, num_features, dim) for draw in PROJECTIONS.values()]
  return jax.lax.switch(kind_index, branches, key)
