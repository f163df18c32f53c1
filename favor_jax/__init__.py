"""favor_jax: Performer-style random-feature attention (FAVOR+ and successors) in JAX."""

from importlib import metadata as _metadata

from favor_jax import core
from favor_jax.core import (
    favor_attention,
    iid_gaussian_projection,
    linear_attention,
    orthogonal_projection,
    simplex_projection,
    softmax_attention,
)

__all__ = [
    "core",
    "favor_attention",
    "iid_gaussian_projection",
    "linear_attention",
    "orthogonal_projection",
    "simplex_projection",
    "softmax_attention",
]


try:
  __version__ = _metadata.version("favor_jax")  # the installed distribution's version
except _metadata.PackageNotFoundError:  # a checkout used without installing it (PYTHONPATH)
  __version__ = "0+unknown"
