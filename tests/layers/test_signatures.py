"""Both layers show their constructor arguments to ``inspect.signature`` (help(), IDEs, the API page)."""

import dataclasses
import inspect

import jax.numpy as jnp
import pytest
from flax import nnx

from favor_jax.layers import linen
from favor_jax.layers import nnx as favor_nnx
from favor_jax.layers.settings import FavorSettings

SETTINGS = [f.name for f in dataclasses.fields(FavorSettings)]


@pytest.mark.parametrize("layer", [linen.FavorAttention, favor_nnx.FavorAttention], ids=["linen", "nnx"])
def test_signature_lists_every_setting(layer):
  params = inspect.signature(layer).parameters
  assert not [p for p in params.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)], params
  assert [name for name in SETTINGS if name not in params] == []
  assert {"num_heads", "dtype", "param_dtype", "dropout_rate", "precision"} <= set(params)


def test_nnx_signature_names_only_what_the_constructor_takes():
  """Every argument shown, passed at its shown default, is accepted (the shown names are the real ones)."""
  sig = inspect.signature(favor_nnx.FavorAttention)
  assert list(sig.parameters)[:4] == ["num_heads", "in_features", "qkv_features", "out_features"]
  assert "attention_fn" not in sig.parameters  # refused by the constructor, so not shown
  kwargs = {p.name: p.default for p in sig.parameters.values() if p.default is not p.empty}
  layer = favor_nnx.FavorAttention(2, 8, rngs=nnx.Rngs(0), **kwargs)
  assert layer(jnp.ones((1, 4, 8))).shape == (1, 4, 8)
  assert "num_features" in inspect.getdoc(favor_nnx.FavorAttention)
