"""Model FLOPs per token of a training config, the devices' peak, and model FLOPs utilisation (MFU).

One token's forward pass, counted as multiply-adds × 2 (the formulas are in docs/training.md):

- per block: the projections ``2·d·(2·H·d_qk + d)`` (q, k, v), ``2·d²`` (out), the MLP ``4·d·F``, a forget
  gate ``2·d·H``, a short convolution ``2·K·d``;
- per block, attention itself per head: softmax ``4·L·D_h`` (QKᵀ and AV over all L keys, as XLA computes a
  causal product); a random-feature kernel ``4·M·d_qk`` for the features of q and k (``2·F`` for a kernel
  without a projection), ``4·F·(D_h + 1)`` for the state's update and read-out, a causal chunk of C tokens'
  masked product ``2·C·(F + D_h + 1)``, an exact window of W keys ``2·W·(d_qk + D_h)``;
- the head ``2·d·V`` (a language model's; a classifier's pooled head is per sequence, left out).

A train step is three forward passes' worth (the backward pass two): ``train = 3 × forward``; remat's
recomputation is not counted (model FLOPs, not hardware FLOPs). MFU = tokens/s × train FLOPs per token /
(peak FLOP/s per device × devices).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from experiments import tasks
from favor_jax import core
from favor_jax.layers.settings import projection_role

# Dense bfloat16 peak FLOP/s per chip, from the vendors' data sheets (H100/H200: SXM, without sparsity). Keys
# are matched against ``jax.Device.device_kind`` (e.g. "TPU v5 lite" is a v5e).
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,  # v5p reports "TPU v5"
    "H100": 989e12,
    "H200": 989e12,
}
CPU_MATMUL_SIZE = 1024  # n of the n×n matmul timed for a CPU's ceiling


def feature_map(config) -> tuple[int | None, int]:
  """(rows of the config's FAVOR feature map: M for a random projection, the head dim for a learned map, None
  without one; F, the features per head: M for FAVOR+, 2M for hyperbolic, 1 + d + d(d+1)/2 for Taylor, 2·D for
  Hedgehog). Softmax: (None, 0)."""
  a = config.attention
  if a.type != "favor":
    return None, 0
  qk_dim = a.qk_head_dim or config.model.d_model // config.model.num_heads
  role = projection_role(a.kernel)
  rows = a.num_features if role == "random" else qk_dim if role == "learned" else None
  return rows, core.kernels.num_features(a.kernel, rows, qk_dim)


def attention_flops_per_token(config, seq_len: int) -> int:
  """Forward FLOPs of one layer's attention (its core, not its projections) per token, all heads."""
  m, a = config.model, config.attention
  heads, head_dim = m.num_heads, m.d_model // m.num_heads
  causal = tasks.is_causal(config.task)
  if a.type == "softmax":
    return heads * 4 * seq_len * head_dim
  qk_dim = a.qk_head_dim or head_dim
  rows, features = feature_map(config)
  per_head = 2 * 2 * rows * qk_dim if rows else 2 * features  # φ(q), φ(k): a projection, or the products
  per_head += 2 * 2 * features * (head_dim + 1)  # the state's update and read-out
  if causal:
    per_head += 2 * a.chunk_size * (features + head_dim + 1)  # the masked product inside a chunk
  if a.window:
    per_head += 2 * a.window * (qk_dim + head_dim)
  return heads * per_head


def flops_per_token(config, vocab_size: int, seq_len: int) -> dict:
  """{"forward", "train"}: model FLOPs of one token of a ``seq_len`` sequence under ``config`` (module doc)."""
  m, a = config.model, config.attention
  d, heads = m.d_model, m.num_heads
  qk_dim = (a.qk_head_dim or d // heads) if a.type == "favor" else d // heads
  block = 2 * d * (2 * heads * qk_dim + d) + 2 * d * d + 4 * d * m.mlp_dim
  block += 2 * d * heads * bool(a.get("forget_gate", False)) + 2 * m.short_conv * d
  block += attention_flops_per_token(config, seq_len)
  forward = m.num_layers * block + (2 * d * vocab_size if tasks.is_causal(config.task) else 0)
  return dict(forward=forward, train=3 * forward)


def peak_flops(device: jax.Device) -> float | None:
  """The table's peak FLOP/s of ``device``'s kind, None when it has none."""
  kind = device.device_kind
  for name in sorted(PEAK_FLOPS, key=len, reverse=True):  # "TPU v5 lite" before "TPU v5"
    if name.lower() in kind.lower():
      return PEAK_FLOPS[name]
  return None


@functools.cache
def matmul_ceiling(dtype: str) -> float:
  """FLOP/s of a jitted ``CPU_MATMUL_SIZE``² matmul in ``dtype`` on the default device, best of 5 (once per
  process and dtype): a CPU's same-run ceiling, which it has no table entry for."""
  n = CPU_MATMUL_SIZE
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.dtype(dtype))
  matmul = jax.jit(jnp.matmul)
  jax.block_until_ready(matmul(a, a))
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, a))
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best


def device_peak(dtype: str, devices: list | None = None) -> tuple[float, str]:
  """(peak FLOP/s of ``devices`` together (default: all), where it comes from): the table's entry for their kind
  times their number; else (a CPU, or a kind the table lacks) the measured matmul ceiling in ``dtype``, once
  (a CPU's devices, forced or not, share its cores, and one matmul already uses them all)."""
  devices = jax.devices() if devices is None else devices
  peak = peak_flops(devices[0])
  if peak is not None:
    return peak * len(devices), f"{devices[0].device_kind} table peak x {len(devices)}"
  return matmul_ceiling(dtype), f"measured {dtype} {CPU_MATMUL_SIZE}x{CPU_MATMUL_SIZE} matmul ceiling"
