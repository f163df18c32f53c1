"""Under jax.jit, an argument that chooses the computation's structure but was traced says how to mark it static."""

import ast
import functools
import re

import jax
import numpy as np
import pytest

from favor_jax import core

Q, K, V = jax.random.normal(jax.random.PRNGKey(0), (3, 1, 8, 2, 4))
W = core.orthogonal_projection(jax.random.PRNGKey(1), 8, 4)


@pytest.mark.parametrize("fn, name, kwargs, error", [
    (core.favor_attention, "causal", dict(causal=True), TypeError),
    (core.favor_attention, "chunk_size", dict(chunk_size=16), ValueError),
    (core.hybrid_attention, "window", dict(window=2), ValueError),
    (core.hybrid_attention, "causal", dict(window=2, causal=True), TypeError),
])
def test_traced_structural_argument_names_static_argnames(fn, name, kwargs, error):
  with pytest.raises(error, match=rf"jax\.jit traced {name} because it was not marked static") as info:
    jax.jit(fn)(Q, K, V, W, **kwargs)
  message = str(info.value)
  assert "static_argnames" in message and "functools.partial" in message
  assert all(arg in message for arg in core.checks.STATIC_ARGNAMES)


def test_the_suggested_static_argnames_run_and_match_eager():
  """The example the message gives is valid jax.jit usage and computes what the eager call computes."""
  with pytest.raises(TypeError) as info:
    jax.jit(core.favor_attention)(Q, K, V, W, causal=True)
  names = ast.literal_eval(re.search(r"static_argnames=(\([^)]*\))", str(info.value)).group(1))
  jitted = jax.jit(core.favor_attention, static_argnames=names)
  got = jitted(Q, K, V, W, causal=True, kernel="relu", causal_method="scan", chunk_size=4)
  want = core.favor_attention(Q, K, V, W, causal=True, kernel="relu", causal_method="scan", chunk_size=4)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  bound = jax.jit(functools.partial(core.favor_attention, causal=True, kernel="relu"))
  np.testing.assert_allclose(bound(Q, K, V, W), core.favor_attention(Q, K, V, W, causal=True, kernel="relu"),
                             rtol=1e-5, atol=1e-6)


def test_a_wrong_python_value_is_not_told_about_jit():
  with pytest.raises(TypeError, match="causal must be a bool") as info:
    core.favor_attention(Q, K, V, W, causal="yes")
  assert "static_argnames" not in str(info.value)
  with pytest.raises(ValueError, match="chunk_size must be a positive int") as info:
    core.favor_attention(Q, K, V, W, causal=True, chunk_size=0)
  assert "static_argnames" not in str(info.value)
