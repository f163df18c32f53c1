"""The bidirectional pass: every query against all unmasked keys, in cache-sized blocks.

Keys are folded into the [F, E] state ``state.BLOCK`` at a time (rescaled as
the per-feature key maximum grows), then the state is read ``BLOCK`` queries at
a time; heads are a batch dimension inside a block, so every product is a
plain batched matrix product and no [L, H, F] array is formed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from favor_jax.core import state as state_lib
from favor_jax.core.features import head_major
from favor_jax.core.state import RecurrentState


def bidirectional(features, q, k, v, mask, axis_name=None, divide: bool = False):
  """Σ over all unmasked keys; per-feature key scale μ_f = max_j log φ(k_j)_f.

  Returns (numerator [N, Lq, H, Dv], denominator [N, Lq, H]), both scaled by the
  same per-row factor; ``divide``: the output num/den [N, Lq, H, Dv] only
  (``state.divide``, per query block). Feature maps that need the whole sequence at once
  (``features.whole_sequence``) get one block. ``axis_name``: the keys are
  split along the sequence over this mesh axis (inside ``shard_map``): one
  ``pmax`` of μ and one ``psum`` of the rescaled Σφ(k)[v, 1]ᵀ make every
  device's state the full one.
  """
  n, length, h = q.shape[:3]
  if features.whole_sequence:  # both sides' features from one call, one block
    fq_all, fk_all = head_major(features, q, k)
    state = state_lib.add_keys(state_lib.initial_state(features, q, k, v), fk_all, v, mask)
    block = max(length, 1)
    query_features = lambda start, size: fq_all
  else:
    state = state_lib.key_state(features, k, v, mask)
    block = max(min(state_lib.BLOCK, length), 1)
    query_features = lambda start, size: head_major(features, state_lib.cut(q, start, size), k[:, :0])[0]
  if axis_name is not None:
    top = state_lib.finite_or_zero(jax.lax.stop_gradient(jax.lax.pmax(state.mu, axis_name)))
    state = RecurrentState(top, jax.lax.psum(state.s * jnp.exp(state.mu - top)[..., None], axis_name))

  def read(start, size):  # one block of query rows, L-major: [N, l, H, ...]
    y_NlHE = jnp.swapaxes(state_lib.read_out(query_features(start, size), state), 1, 2)
    num, den = y_NlHE[..., :-1], y_NlHE[..., -1]
    return (state_lib.divide(num, den),) if divide else (num, den)

  # Query blocks are independent: a map, whose outputs are stacked (a carried output buffer
  # would make the backward pass copy it once per block).
  full, rest = divmod(length, block)
  ys = jax.lax.map(jax.checkpoint(lambda i: read(i * block, block)), jnp.arange(full))  # [b, N, l, H, ...]
  ys = [jnp.moveaxis(y, 0, 1).reshape((n, full * block) + y.shape[3:]) for y in ys]
  if rest:
    ys = [jnp.concatenate(pair, axis=1) for pair in zip(ys, read(full * block, rest))]
  return ys[0] if divide else tuple(ys)
