"""favor_jax.core: pure functions for random-feature attention (no Flax, explicit PRNG keys)."""

from favor_jax.core import kernels
from favor_jax.core.attention import (
    favor_attention,
    favor_decode_init,
    favor_decode_step,
    linear_attention,
    softmax_attention,
)
from favor_jax.core.causal import RecurrentState
from favor_jax.core.kernels import KERNELS, get_kernel, oprf_rho
from favor_jax.core.projections import (
    iid_gaussian_projection,
    orthogonal_projection,
    simplex_projection,
)

__all__ = [
    "favor_attention",
    "favor_decode_init",
    "favor_decode_step",
    "get_kernel",
    "iid_gaussian_projection",
    "kernels",
    "KERNELS",
    "linear_attention",
    "oprf_rho",
    "RecurrentState",
    "orthogonal_projection",
    "simplex_projection",
    "softmax_attention",
]
