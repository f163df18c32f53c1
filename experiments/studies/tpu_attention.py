"""jax's TPU attention kernels as methods of the speed study (``experiments/studies/speed.py``): flash attention
(``jax.experimental.pallas.ops.tpu.flash_attention``) and splash attention (``...tpu.splash_attention``), in
favor_jax's layout q, k, v [B, L, H, D]. Off a TPU (``experiments/tpu_check.sh``'s dry run) they run in
Pallas's TPU interpreter, slowly: the dry run checks that the study runs, not its times."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as flash_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib


def _off_tpu(fn):
  """``fn`` (q, k, v) -> out as it runs here: itself on a TPU; elsewhere with every pallas_call traced under
  Pallas's TPU interpreter, forward and backward (the interpreter is chosen where a kernel is traced, and a
  backward is traced outside the forward's call: each is traced again inside the context)."""
  if jax.default_backend() == "tpu":
    return fn

  @jax.custom_vjp
  def run(q, k, v):
    with pltpu.force_tpu_interpret_mode():
      return fn(q, k, v)

  def fwd(q, k, v):
    return run(q, k, v), (q, k, v)

  def bwd(res, ct):
    with pltpu.force_tpu_interpret_mode():
      return jax.vjp(fn, *res)[1](ct)

  run.defvjp(fwd, bwd)
  return run


def _heads_first(x):
  return jnp.swapaxes(x, 1, 2)  # [B, L, H, D] <-> [B, H, L, D]


def flash(q, k, v, p, causal):
  """jax's TPU flash attention (blocks of up to 512 rows, its defaults otherwise); ``p`` unused."""
  del p
  length = q.shape[1]
  block = min(512, length)
  sizes = flash_lib.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1,
                               block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block,
                               block_q_dkv=block, block_k_major_dq=block, block_k_dq=block, block_q_dq=block)
  attend = lambda q, k, v: flash_lib.flash_attention(q, k, v, causal=causal, sm_scale=1 / math.sqrt(q.shape[-1]),
                                                      block_sizes=sizes)
  return _heads_first(_off_tpu(attend)(*map(_heads_first, (q, k, v))))


def splash(q, k, v, p, causal):
  """jax's TPU splash attention (block-sparse: a causal mask skips the blocks above the diagonal); ``p`` unused."""
  del p
  _, length, heads, d = q.shape
  block = min(512, length)
  one = mask_lib.CausalMask((length, length)) if causal else mask_lib.FullMask((length, length))
  sizes = splash_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  interpret = jax.default_backend() != "tpu"
  kernel = splash_lib.make_splash_mha(mask_lib.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1,
                                      q_seq_shards=1, interpret=interpret)
  q = q / math.sqrt(d)  # splash takes the scale in q
  out = jax.vmap(kernel)(*map(_heads_first, (q, k, v)))
  return _heads_first(out)


METHODS = {"tpu_flash_attention": flash, "tpu_splash_attention": splash}
