"""The Triton kernels' inputs as rows (internal; used by :mod:`favor_jax.core.fused.gpu`): a call's arrays as
padded head-major rows [R, L(, W)], R = N·H (widths padded to powers of two, Triton's block shapes), its log
features or, where the kernels compute them, the rows of q and k and what else those kernels read
(:class:`OnChip`), in the order :func:`favor_jax.core.fused.gpu_bodies.on_chip` takes them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array

from favor_jax.core import inputs
from favor_jax.core.features import head_major
from favor_jax.core.fused import rows as fused_rows
from favor_jax.core.fused.gpu_bodies import NEG_INF
from favor_jax.core.state import parts


def pow2(n: int, least: int = 16) -> int:
  """The least power of two >= max(n, ``least``)."""
  return max(least, 1 << (int(n) - 1).bit_length())


class OnChip(NamedTuple):
  """What the kernels that compute the features read besides the rows of q and k [R, L, D'] (``Blocks.feature_map``):
  the projection rows p [G, F, D'] (G = 1 shared, H per head, R per row: FAVOR++'s B·ω), the log-normaliser
  fb [G', F] (G' = 1, or R: FAVOR++'s c), the biases [R, L] of the rows of q (−∞: padding) and of k (−∞:
  masked keys and padding), and u = (u_q, u_k) [R, D'], the rows' scales of q and k (FAVOR#: d^{-1/4}·Ψ and
  d^{-1/4}/Ψ) or None (both d^{-1/4}, ``Blocks.x_scale``)."""
  p: Array
  fb: Array
  q_bias: Array
  k_bias: Array
  u: tuple | None

  def x_spec(self, rows: int, seq: bool) -> pl.BlockSpec:
    """The BlockSpec of the rows of q or k: a whole row [L, D'] (``seq``: the sequential kernels, grid (row,
    feature block)) or one chunk's [C, D'] (grid (row, chunk))."""
    return pl.BlockSpec((None, rows, self.p.shape[-1]), (lambda i, j: (i, 0, 0)) if seq else (lambda i, c: (i, c, 0)))

  def ins(self, sides: str, rows: int, width: int, seq: bool) -> tuple[list, list]:
    """(BlockSpecs, arrays) of what a kernel reads after its own inputs: the projection rows and the
    normaliser (``width`` features: the sequential kernels read one feature block of them, the per-chunk ones
    all), then per side in ``sides`` ("q", "k", "qk") its bias (``rows``: L or C), then per side its scale."""
    g, gf, d = self.p.shape[0], self.fb.shape[0], self.p.shape[-1]
    block = (lambda j: j) if seq else (lambda j: 0)
    row = pl.BlockSpec((None, rows), (lambda i, j: (i, 0)) if seq else (lambda i, c: (i, c)))
    specs = [pl.BlockSpec((None, width, d), lambda i, j: (i % g, block(j), 0)),
             pl.BlockSpec((None, width), lambda i, j: (i % gf, block(j)))] + [row] * len(sides)
    arrays = [self.p, self.fb] + [{"q": self.q_bias, "k": self.k_bias}[s] for s in sides]
    if self.u is not None:
      specs += [pl.BlockSpec((None, d), lambda i, j: (i, 0))] * len(sides)
      arrays += [dict(zip("qk", self.u))[s] for s in sides]
    return specs, arrays


class Rows:
  """A call's rows for the Triton kernels: [N, L, H(, W)] -> [R, padded(, width)] (features and values
  padded to powers of two), the log features, the values, the gates, which rows see a key, and back."""

  def __init__(self, features, q, v, mask, gate, chunk: int):
    n, length, h = q.shape[:3]
    f = jax.eval_shape(lambda: head_major(features, q, q)[0].log).shape[-1]
    self.n, self.length, self.h, self.features, self.mask = n, length, h, features, mask
    self.padded, self.fp, self.ep = -(-length // chunk) * chunk, pow2(f), pow2(v.shape[-1])
    flags = jnp.broadcast_to(mask[:, :, None], (n, length, h))
    resets = jnp.zeros((n, length, h), bool) if gate is None else jnp.isneginf(gate)
    self.seen = self.of(inputs._seen_causal(flags, resets), False)  # a key no reset cut off
    self.gate = None if gate is None else self.gate_rows(gate)

  def of(self, x, value, width=None):  # [N, L, H(, W)] -> [R, padded(, width)]
    x = jnp.swapaxes(x, 1, 2).reshape((self.n * self.h, self.length) + x.shape[3:])
    widths = ((0, 0), (0, self.padded - self.length)) + (((0, width - x.shape[-1]),) if width else ())
    return jnp.pad(x, widths, constant_values=value)

  def log_rows(self, q, k):
    fq, fk = head_major(self.features, q, k)  # [N, H, L, F]
    log_q, _ = parts(fq)
    log_k, _ = parts(fk, self.mask[:, None, :, None])
    to_rows = lambda x: self.of(jnp.swapaxes(x.astype(jnp.float32), 1, 2), NEG_INF, self.fp)
    return to_rows(log_q), to_rows(log_k)

  def value_rows(self, v):
    return self.of(v, 0.0, self.ep)

  @staticmethod
  def projection(p_fb):
    """(p [G, F, D'], fb [G', F]) from ``fused.rows.projection_rows``' (p [G, F, D], fb [G', 1, F] or
    [1, F]): D' as :meth:`on_chip`'s rows."""
    p, fb = p_fb
    return jnp.pad(p, ((0, 0), (0, 0), (0, pow2(p.shape[-1]) - p.shape[-1]))), fb.reshape((-1, fb.shape[-1]))

  def on_chip(self, q, k, p, fb, scales=None):
    """(q rows, k rows [R, L, D'] in their dtype, the :class:`OnChip` inputs) given :meth:`projection` and the
    rows' scales [R, 1, D] or None (``fused.rows.on_chip_inputs``); D' is D padded with zeros to a power of
    two >= 16, Triton's block shapes (no product or norm changes)."""
    d = p.shape[-1]
    live = jnp.zeros((self.n, self.length, self.h), jnp.float32)
    keys = fused_rows.key_bias(self.mask, self.h)
    u = None if scales is None else tuple(jnp.pad(s[:, 0], ((0, 0), (0, d - s.shape[-1]))) for s in scales)
    return (self.of(q, 0.0, d), self.of(k, 0.0, d),
            OnChip(p, fb, self.of(live, NEG_INF), self.of(keys, NEG_INF), u))

  def gate_rows(self, gate):
    return self.of(gate.astype(jnp.float32), 0.0)

  def back(self, x):
    return jnp.swapaxes(x[:, :self.length].reshape((self.n, self.h, self.length) + x.shape[2:]), 1, 2)
