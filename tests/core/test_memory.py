"""What the forward + backward pass keeps: state-sized residuals per block, never the features of every token.

XLA's accounting of the compiled program (``memory_analysis``) is exact and deterministic, so this is a
property, not a timing: doubling L may add temporaries of the size of the inputs, not of the [N, L, H, F]
features (a pass that kept them for the backward, as the bidirectional one did, adds twice their size).
"""

import jax
import jax.numpy as jnp
import pytest

from favor_jax import core

H, D, M = 2, 16, 256  # F = M = 256 ≫ D: keeping the features would dominate everything else


def _temporaries(length, causal):
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(kk, (1, length, H, D)) for kk in ks[:3])
  projection = core.orthogonal_projection(ks[3], M, D)
  loss = lambda q, k, v: jnp.sum(core.favor_attention(q, k, v, projection, causal=causal) ** 2)
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_fwd_bwd_never_keeps_the_features_of_every_token(causal):
  length = 4096
  growth = _temporaries(2 * length, causal) - _temporaries(length, causal)
  features = length * H * M * 4  # float32 [1, L, H, F]
  inputs = 3 * length * H * D * 4
  assert growth < features / 2, (growth, features)
  assert growth < 4 * inputs, (growth, inputs)  # a few input-sized arrays (blocked copies, cotangents)
