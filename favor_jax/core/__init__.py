"""favor_jax.core: pure functions for random-feature attention (no Flax, explicit PRNG keys).

Modules: ``projections`` (ω and their registry), ``kernels`` (feature maps, one
record each) and ``statistics`` (the data-dependent kernels' statistics),
``attention`` (the public attention functions), ``weights`` (explicit weights).
One call's path: ``attention`` → ``inputs`` (checks of ``checks``, the batch
flattened, non-finite inputs: the envelope around the algorithm) → ``features``
(the kernel resolved into a ``Features`` record) → the algorithm:
``bidirectional``, ``causal`` (``causal_method`` chosen in one place) over
``causal_xla`` (XLA passes) and ``fused`` (Pallas), or ``hybrid`` (local exact +
global kernel) → ``state`` (the log-domain state of keys, its read-out and the
guarded division) → the output, back through ``inputs``. ``precision`` puts the
call's ``precision`` argument in force for every dot of the call, forward and backward.

Shape letters, used in names inside the math (``phi_q_NHlF``) and in the
jaxtyping annotations of public signatures:

======  ==========================================================
letter  meaning
======  ==========================================================
B       batch (any number of leading dims, ``...``)
N       the batch dims flattened into one
L       sequence length (Lq queries, Lk keys)
l       length of one block or step
H       heads
D       head dim of query and key
Dv      head dim of value
E       Dv + 1 (value and a column of ones: the denominator)
M       projection rows (ω)
F       features per head (``Kernel.num_features``)
Fm      width of the log part of features (F or 1)
C       chunk size; c chunks in a block
P       devices along a mesh axis
======  ==========================================================

Kernels (``kernels.KERNELS``, one record each): FAVOR+ positive and hyperbolic
features (Choromanski et al. 2021), trigonometric (random Fourier) features,
OPRF — optimal positive random features, FAVOR++ (Likhosherstov et al. 2022) —,
FAVOR#'s dense-exponential features (``saderf``, Likhosherstov et al. 2023),
second-order Taylor features (Based, Arora et al. 2024), Hedgehog's learned
map (Zhang et al. 2024), ReLU features and elu+1. ``hybrid_attention`` adds an
exact local window to any of them (Scatterbrain, Chen et al. 2021).
"""

from favor_jax.core import kernels
from favor_jax.core.attention import (
    favor_attention,
    hybrid_attention,
    linear_attention,
    softmax_attention,
)
from favor_jax.core.decode import favor_decode_init, favor_decode_step
from favor_jax.core.gates import alibi_log_gate, alibi_slopes
from favor_jax.core.hybrid import HybridState
from favor_jax.core.kernels import KERNELS, get_kernel, oprf_rho, saderf_statistic
from favor_jax.core.projections import (
    PROJECTIONS,
    draw_projection,
    draw_projection_by_index,
    iid_gaussian_projection,
    orthogonal_projection,
    simplex_projection,
)
from favor_jax.core.records import Kernel, LogFeatures
from favor_jax.core.state import RecurrentState
from favor_jax.core.weights import attention_weights

__all__ = [
    "alibi_log_gate",
    "alibi_slopes",
    "attention_weights",
    "HybridState",
    "hybrid_attention",
    "PROJECTIONS",
    "draw_projection",
    "draw_projection_by_index",
    "favor_attention",
    "favor_decode_init",
    "favor_decode_step",
    "get_kernel",
    "iid_gaussian_projection",
    "kernels",
    "Kernel",
    "KERNELS",
    "linear_attention",
    "LogFeatures",
    "oprf_rho",
    "RecurrentState",
    "saderf_statistic",
    "orthogonal_projection",
    "simplex_projection",
    "softmax_attention",
]
