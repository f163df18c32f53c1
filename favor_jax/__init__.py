"""favor_jax: Performer-style random-feature attention (FAVOR+ and successors) in JAX."""

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
__version__ = "0.1.0"
