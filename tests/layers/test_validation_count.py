"""Each FAVOR argument of a layer is checked once: building a layer (Linen: its first call) and calling it once
runs every check of its settings exactly once; the layer's call checks none of them again (the core function
it calls checks its own arguments at its public boundary, once, which is not counted here)."""

import collections
import contextlib
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from favor_jax import core
from favor_jax.layers import linen as flin
from favor_jax.layers import nnx as fnnx
from favor_jax.layers import settings

B, L, H, F, M = 1, 8, 2, 8, 4
# Every check FavorSettings.build runs, one per argument (or per rule tying arguments together).
CHECKS = ("check_flags", "check_kernel", "check_causal_method", "check_projection_fields", "check_sizes",
          "check_decode", "check_sequence_parallel", "check_qk_transform", "resolve_rho_momentum")
# The core primitives those checks use, with the argument each call checks (its name, where it takes one).
CORE = ("check_bool", "check_causal_method", "check_window", "check_positive_int")


@contextlib.contextmanager
def counted():
  """{check: calls} of the settings' checks, and {(core check, argument): calls made from favor_jax.layers}."""
  layer_calls, core_calls = collections.Counter(), collections.Counter()

  def from_layers(name, original):
    def wrapper(*args, **kwargs):
      caller = sys._getframe(1).f_globals.get("__name__", "")
      if caller.startswith("favor_jax.layers"):
        core_calls[name, args[0] if name in ("check_bool", "check_positive_int") else None] += 1
      return original(*args, **kwargs)
    return wrapper

  def counting(name, original):
    def wrapper(*args, **kwargs):
      layer_calls[name] += 1
      return original(*args, **kwargs)
    return wrapper

  with contextlib.ExitStack() as stack:
    for name in CHECKS:
      stack.enter_context(mock.patch.object(settings, name, counting(name, getattr(settings, name))))
    for name in CORE:
      stack.enter_context(mock.patch.object(core.checks, name, from_layers(name, getattr(core.checks, name))))
    yield layer_calls, core_calls


def assert_once(layer_calls, core_calls):
  assert dict(layer_calls) == {name: 1 for name in CHECKS}
  want = {("check_bool", "causal"): 1, ("check_bool", "decode"): 1, ("check_causal_method", None): 1,
          ("check_window", None): 1, ("check_positive_int", "num_features"): 1,
          ("check_positive_int", "chunk_size"): 1, ("check_positive_int", "qk_head_dim"): 1}
  assert dict(core_calls) == want


KINDS = [dict(kernel="positive", causal=False), dict(kernel="optimal_positive", causal=True, chunk_size=4)]


@pytest.mark.parametrize("kw", KINDS, ids=lambda kw: kw["kernel"])
def test_a_linen_layer_checks_each_argument_once(kw):
  x = jax.random.normal(jax.random.PRNGKey(0), (B, L, F))
  layer = flin.FavorAttention(num_heads=H, num_features=M, **kw)
  with counted() as (layer_calls, core_calls):
    variables = jax.jit(layer.init)(jax.random.PRNGKey(1), x)  # Flax builds its own instance, calls it once
  assert_once(layer_calls, core_calls)
  with counted() as (layer_calls, core_calls):
    apply = lambda v, x: layer.apply(v, x, deterministic=False, mutable=["favor"])  # another instance, one call
    out, _ = jax.jit(apply)(variables, x)
  assert out.shape == x.shape
  assert_once(layer_calls, core_calls)


@pytest.mark.parametrize("kw", KINDS, ids=lambda kw: kw["kernel"])
def test_an_nnx_layer_checks_each_argument_once(kw):
  x = jax.random.normal(jax.random.PRNGKey(0), (B, L, F))
  with counted() as (layer_calls, core_calls):
    layer = fnnx.FavorAttention(H, F, num_features=M, decode=False, rngs=nnx.Rngs(0), **kw)
    out = layer(x, deterministic=False)
    out = out + layer(jnp.flip(x, -2), deterministic=False)  # a second call checks nothing again
  assert out.shape == x.shape
  assert_once(layer_calls, core_calls)


def test_a_bad_argument_is_named_before_any_call():
  with counted() as (layer_calls, _):
    with pytest.raises(ValueError, match=r"window must be an int >= 0.*got -1"):
      fnnx.FavorAttention(H, F, window=-1, rngs=nnx.Rngs(0))
  assert layer_calls["check_sizes"] == 1 and layer_calls["check_decode"] == 0  # stopped at the first bad rule
