"""A layer's forget gate: FoX's learned per-head gate from the layer's input and ALiBi's fixed one.

The gate biases attention by the decay between key and query, ``w_tj ∝ κ(q_t, k_j)·Π_{j<l≤t} f_l`` (the core
functions' ``log_gate``). A layer builds it here from what it owns; the math is core's.

References:
  Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate" (ICLR).
  Press et al. 2022, "Train Short, Test Long: Attention with Linear Biases Enables Input Length Extrapolation".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from favor_jax import core

# The learned gate's bias at init. f = σ(b) = σ(5) ≈ 0.9933, log f ≈ −0.0067 per token: a key 128 tokens back
# keeps e^{−0.86} ≈ 0.42 of its weight, so at init the layer is close to ungated attention over a short
# training window while the gate still has a gradient (d log f / db = 1 − f ≈ 0.0067, which Adam's per-parameter
# scale makes a normal-sized step). The gate's weight starts at zero, so every position starts at this gate.
FORGET_GATE_BIAS = 5.0


def forget_gate_init(dtype=jnp.float32):
  """(kernel_init, bias_init) of the gate's dense map [features] -> [H]: zero weight, bias ``FORGET_GATE_BIAS``."""
  return jax.nn.initializers.zeros, jax.nn.initializers.constant(FORGET_GATE_BIAS, dtype)


def layer_log_gate(logit_BLH: Float[Array, "... L H"] | None, alibi: bool, shape: tuple[int, ...]) -> Array | None:
  """The log gate [..., L, H] (float32) a layer passes to core, or None for an ungated layer.

  Args:
    logit_BLH: the learned gate's pre-activation x·w_h + b_h (``forget_gate=True``), else None: its
      log f = log σ(logit) (FoX's parameterisation).
    alibi: add ALiBi's fixed per-head log f = −m_h (``core.alibi_slopes``).
    shape: the query's [..., L, H] (what the gate is broadcast to).

  Returns:
    The sum of the asked gates' log f, or None when neither is asked.
  """
  if logit_BLH is None and not alibi:
    return None
  log_f = jnp.zeros(shape, jnp.float32)
  if logit_BLH is not None:
    log_f = log_f + jax.nn.log_sigmoid(logit_BLH.astype(jnp.float32))
  if alibi:
    log_f = log_f - jnp.asarray(core.alibi_slopes(shape[-1]))
  return log_f


def gate_kwargs(log_gate, segment_ids) -> dict:
  """The core functions' ``log_gate``/``segment_ids`` keywords, only those given (an ungated, unpacked call
  passes neither)."""
  return {k: v for k, v in (("log_gate", log_gate), ("segment_ids", segment_ids)) if v is not None}
