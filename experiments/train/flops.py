"""Every count of the project in one place: FLOPs (and modelled HBM bytes) of attention per token and head, model
FLOPs per token of a training config, the accelerators' published peaks, and model FLOPs utilisation (MFU).

The training loop (MFU), the speed study (GFLOP/s) and the cost model (roofline predictions) all count here.

**Attention, per token and head, forward** (2 FLOPs per multiply-add; matrix products only):

- exact (softmax) attention: ``4·L·D`` (QKᵀ and AV over all L keys). Causal products are counted **as
  computed**: XLA's exact attention (ours, ``jax.nn.dot_product_attention`` on a CPU) forms the whole L×L
  product and masks it, so it counts whole; flash and splash kernels (cuDNN, jax's TPU kernels) skip the blocks
  above the diagonal: ``2·L·D``. That is convention ``"whole"``. MaxText
  (``maxtext_utils.calculate_tflops_training_per_device``: ``causal_attention_flops = noncausal / 2``) and the
  flash-attention benchmarks count a causal product's kept half only; convention ``"half"`` does so for every
  causal mask (softmax's L×L, a chunk's C×C, a causal window's blocks), and the training loop records both.
- a random-feature kernel (FAVOR and relatives), F features from ``rows`` projection rows (M for a random
  projection, the q/k head dim for a learned map, none for Taylor-like maps: ``2·F`` for their products):
  features of q and k ``4·rows·d_qk``; the state's update and read-out ``4·F·(D + 1)``; causal chunks of C
  tokens (chunked and fused passes): the masked product inside a chunk ``2·C·(F + D + 1)``, whole; a hybrid's
  exact window of W keys: query blocks of ``max(W, 32)`` against their own and the previous block (causal;
  and the next, bidirectional) ``2·context·(d_qk + D)``; a bidirectional hybrid runs the causal pass both
  ways (features and state twice).

**Backward**: model FLOPs count a forward + backward as 3 forwards (the backward's products are twice the
forward's; remat's or a kernel's recomputation is not counted): MFU and the speed study's GFLOP/s use this.
The cost model predicts time, so it counts what runs (``HARDWARE_FWD_BWD``): flash attention recomputes its
scores in the backward (3.5 forwards: FlashAttention-2's count).

**Bytes** (the cost model's HBM traffic per token and head, what must cross HBM at least): ``flash_bytes``,
``favor_xla_bytes``, ``favor_fused_bytes`` below; the fused kernels' bytes are also read from their exported
programs (``experiments/studies/cost_model.py``).

**A training config**, one token's forward pass: per block the projections ``2·d·(2·H·d_qk + d)`` (q, k, v),
``2·d²`` (out), the MLP ``4·d·F_mlp``, a forget gate ``2·d·H``, a short convolution ``2·K·d``, and attention as
above for all heads; the head ``2·d·V`` (a language model's; a classifier's pooled head is per sequence, left
out). A train step is ``3 × forward``. MFU = tokens/s × train FLOPs per token / ceiling, where the ceiling is
the devices' **published peak** (``ACCELERATORS``) or, for a device the table lacks (a CPU, a new chip), a
**measured matmul** ceiling, recorded as such: ``mfu_vs_measured_matmul``, never ``mfu`` (docs/training.md).
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from experiments import tasks
from favor_jax import core
from favor_jax.core import hybrid
from favor_jax.layers.settings import projection_role

CONVENTIONS = ("whole", "half")  # how a causal mask's products are counted (module doc)
PUBLISHED, MEASURED = "published peak", "measured matmul"  # the two kinds of ceiling MFU is taken against


class Accelerator(NamedTuple):
  """Published per-chip rates: dense (no sparsity) matrix FLOP/s in bfloat16 and in float32 as XLA runs a
  float32 matrix product at default precision, and HBM bytes/s."""
  bfloat16: float
  float32: float
  hbm: float


# Keys are matched (longest first, case-insensitive) as substrings of ``jax.Device.device_kind``: "TPU v5 lite" is
# a v5e, "TPU v5" a v5p, "TPU v6 lite" a v6e (Trillium), "NVIDIA H100 80GB HBM3" an H100 SXM, "NVIDIA H100 PCIe"
# a PCIe card. Float32 on a TPU: Google publishes no float32 rate; XLA's default precision runs a float32 matrix
# product as one bfloat16 pass of the MXU, so the bfloat16 peak is its ceiling (precision="highest" takes several
# passes: MFU then reads low, never high). Float32 on an NVIDIA GPU: XLA's default precision uses TF32 tensor
# cores (Ampere and later); the dense TF32 rate is the ceiling (plain FP32 on CUDA cores is 13-15x lower).
ACCELERATORS = {
    # Cloud TPU docs, "TPU v4" system architecture: 275 TFLOP/s bf16 per chip, 1200 GB/s HBM2.
    "TPU v4": Accelerator(275e12, 275e12, 1200e9),
    # Cloud TPU docs, "TPU v5e" system architecture: 197 TFLOP/s bf16 per chip, 819 GB/s HBM2e.
    "TPU v5 lite": Accelerator(197e12, 197e12, 819e9),
    "TPU v5e": Accelerator(197e12, 197e12, 819e9),
    # Cloud TPU docs, "TPU v5p" system architecture: 459 TFLOP/s bf16 per chip, 2765 GB/s HBM2e.
    "TPU v5p": Accelerator(459e12, 459e12, 2765e9),
    "TPU v5": Accelerator(459e12, 459e12, 2765e9),  # v5p reports "TPU v5"
    # Cloud TPU docs, "TPU v6e" (Trillium) system architecture: 918 TFLOP/s bf16 per chip, 1640 GB/s HBM.
    "TPU v6 lite": Accelerator(918e12, 918e12, 1640e9),
    "TPU v6e": Accelerator(918e12, 918e12, 1640e9),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense (624 with sparsity), TF32 156
    # dense, 2039 GB/s HBM2e (the 40GB and PCIe cards have the same rates, 1555-1935 GB/s).
    "A100": Accelerator(312e12, 156e12, 2039e9),
    # NVIDIA H100 datasheet, H100 SXM: BF16 1979 TFLOPS with sparsity, 989 dense; TF32 989 / 494.5; 3.35 TB/s.
    "H100": Accelerator(989e12, 494.5e12, 3.35e12),
    # NVIDIA H100 datasheet, H100 PCIe: BF16 1513 TFLOPS with sparsity, 756 dense; TF32 756 / 378; 2.0 TB/s.
    "H100 PCIe": Accelerator(756e12, 378e12, 2.0e12),
    # NVIDIA H100 datasheet, H100 NVL: BF16 1671 TFLOPS with sparsity, 835 dense; TF32 835 / 417.5; 3.9 TB/s.
    "H100 NVL": Accelerator(835e12, 417.5e12, 3.9e12),
    # NVIDIA H200 datasheet, H200 SXM: BF16 1979 TFLOPS with sparsity, 989 dense; TF32 989 / 494.5; 4.8 TB/s.
    # (A GH200 reports "NVIDIA GH200 ...": its GPU has the same tensor-core rates.)
    "H200": Accelerator(989e12, 494.5e12, 4.8e12),
    # NVIDIA HGX B200 datasheet (per GPU): FP16/BF16 4.5 PFLOPS with sparsity, 2.25 dense; TF32 2.2 / 1.1;
    # 8 TB/s HBM3e.
    "B200": Accelerator(2.25e15, 1.1e15, 8e12),
}
# Dense bfloat16 peak FLOP/s per chip by device kind (``ACCELERATORS``' bfloat16 column).
PEAK_FLOPS = {kind: chip.bfloat16 for kind, chip in ACCELERATORS.items()}
CPU_MATMUL_SIZE = 1024  # n of the n×n matmul timed for a CPU's ceiling
ACCELERATOR_MATMUL_SIZE = 8192  # ... and for an accelerator the table lacks (a 1024² product leaves one idle)


def _check_convention(convention: str) -> None:
  if convention not in CONVENTIONS:
    raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")


# --- attention per token and head, forward -----------------------------------------------------------------------


def softmax_flops(length: int, head_dim: int, *, causal: bool, skips_masked: bool = False,
                  convention: str = "whole") -> float:
  """Exact attention's forward FLOPs per token and head: ``4·L·D`` (QKᵀ and AV over all L keys), halved for a
  causal call by a kernel that skips the blocks above the diagonal (``skips_masked``: flash, splash, cuDNN) or
  under the ``"half"`` convention (module doc)."""
  _check_convention(convention)
  full = 4 * length * head_dim
  return full / 2 if causal and (skips_masked or convention == "half") else full


def feature_rows(kernel, num_features: int, qk_dim: int) -> int | None:
  """Rows of ``kernel``'s projection: ``num_features`` (M) for a random projection, ``qk_dim`` for a learned map,
  None for a map without one (Taylor, ReLU of the inputs, ...)."""
  role = projection_role(kernel)
  return num_features if role == "random" else qk_dim if role == "learned" else None


def favor_flops(head_dim: int, features: int, *, rows: int | None, qk_dim: int | None = None, causal: bool,
                chunk: int | None = None, window: int = 0, convention: str = "whole") -> float:
  """A random-feature method's forward FLOPs per token and head (module doc).

  Args:
    head_dim: D, the value head dim.
    features: F, features per head.
    rows: the projection's rows (``feature_rows``), None for a map without a projection.
    qk_dim: the query/key head dim (None: ``head_dim``).
    causal: causal attention.
    chunk: C of a pass that computes the masked product inside chunks (``causal_method`` "chunked" or
      "pallas"); None for the per-token scan or materialised prefix states.
    window: > 0: hybrid attention with an exact window of this many keys.
    convention: ``"whole"`` (as computed) or ``"half"`` (a causal mask's kept half).

  Returns:
    FLOPs per token and head.
  """
  _check_convention(convention)
  dq = qk_dim or head_dim
  half = 0.5 if convention == "half" else 1.0
  passes = 2 if window and not causal else 1  # a bidirectional hybrid runs the causal pass both ways
  per_pass = (2 * 2 * rows * dq if rows else 2 * features) + 2 * 2 * features * (head_dim + 1)
  if chunk and (causal or window):  # every chunked pass is causal inside
    per_pass += half * 2 * chunk * (features + head_dim + 1)
  total = passes * per_pass
  if window:
    block = max(window, hybrid.LOCAL_BLOCK)  # the exact part's query blocks
    total += (half * 2 * block if causal else 3 * block) * 2 * (dq + head_dim)
  return total


# Forward + backward over forward. Model FLOPs (MFU, the speed study): 3 for every method. What runs (the cost
# model's time): flash attention's backward recomputes the scores (2.5 forwards); FAVOR's products twice.
MODEL_FWD_BWD = 3.0
HARDWARE_FWD_BWD = {"flash": 3.5, "favor_xla": 3.0, "favor_fused": 3.0}


# --- bytes per token and head, forward (the cost model's HBM traffic) ---------------------------------------------

F32 = 4  # bytes of the passes' float32 intermediates


def flash_bytes(head_dim: int, bytes_in: int) -> float:
  """Flash attention: q, k, v read and the output written once (4·D·b); re-reads of k and v by later query
  blocks are assumed served from on-chip memory (a lower bound; on an H200 one head's k, v at L = 128k,
  32 MB, fit its 50 MB L2)."""
  return 4 * head_dim * bytes_in


def favor_xla_bytes(head_dim: int, num_features: int, chunk: int, bytes_in: int) -> float:
  """The XLA chunked pass: q, k, v in and the output out (4·D·b); both sides' features written and read back
  in float32 (16·M); the chunk's [C] scores per row (8·C); one [M, D+1] float32 state per chunk, written and
  read (8·M·(D+1)/C)."""
  d, m, c = head_dim, num_features, chunk
  return 4 * d * bytes_in + 4 * F32 * m + 2 * F32 * c + 2 * F32 * m * (d + 1) / c


def favor_fused_bytes(head_dim: int, num_features: int, chunk: int, bytes_in: int) -> float:
  """The fused kernels of the design with features from XLA, by formula: q, k read for the features (2·D·b),
  their float32 logs written (8·M) and read by the state and output kernels (12·M); v read by both (2·D·b); one
  state per chunk written and read; numerator, denominator and row scale written and read by the division
  (8·(D+2)); the output written (D·b). The cost model reads the kernels' real traffic from their programs."""
  d, m, c = head_dim, num_features, chunk
  return 5 * d * bytes_in + 5 * F32 * m + 2 * F32 * m * (d + 1) / c + 2 * F32 * (d + 2)


# --- a training config ----------------------------------------------------------------------------------------


def feature_map(config) -> tuple[int | None, int]:
  """(rows of the config's FAVOR feature map: M for a random projection, the head dim for a learned map, None
  without one; F, the features per head: M for FAVOR+, 2M for hyperbolic, 1 + d + d(d+1)/2 for Taylor, 2·D for
  Hedgehog). Softmax: (None, 0)."""
  a = config.attention
  if a.type != "favor":
    return None, 0
  qk_dim = a.qk_head_dim or config.model.d_model // config.model.num_heads
  rows = feature_rows(a.kernel, a.num_features, qk_dim)
  return rows, core.kernels.num_features(a.kernel, rows, qk_dim)


def attention_flops_per_token(config, seq_len: int, convention: str = "whole") -> float:
  """Forward FLOPs of one layer's attention (its core, not its projections) per token, all heads: softmax as
  XLA computes it (``models`` runs ``core.softmax_attention``), FAVOR through its chunked pass."""
  m, a = config.model, config.attention
  heads, head_dim = m.num_heads, m.d_model // m.num_heads
  causal = tasks.is_causal(config.task)
  if a.type == "softmax":
    return heads * softmax_flops(seq_len, head_dim, causal=causal, convention=convention)
  rows, features = feature_map(config)
  return heads * favor_flops(head_dim, features, rows=rows, qk_dim=a.qk_head_dim or None, causal=causal,
                             chunk=a.chunk_size, window=a.window, convention=convention)


def flops_per_token(config, vocab_size: int, seq_len: int, convention: str = "whole") -> dict:
  """{"forward", "train"}: model FLOPs of one token of a ``seq_len`` sequence under ``config`` (module doc)."""
  m, a = config.model, config.attention
  d, heads = m.d_model, m.num_heads
  qk_dim = (a.qk_head_dim or d // heads) if a.type == "favor" else d // heads
  block = 2 * d * (2 * heads * qk_dim + d) + 2 * d * d + 4 * d * m.mlp_dim
  block += 2 * d * heads * bool(a.get("forget_gate", False)) + 2 * m.short_conv * d
  block += attention_flops_per_token(config, seq_len, convention)
  forward = m.num_layers * block + (2 * d * vocab_size if tasks.is_causal(config.task) else 0)
  return dict(forward=forward, train=MODEL_FWD_BWD * forward)


# --- ceilings and MFU ------------------------------------------------------------------------------------------


def accelerator(device) -> Accelerator | None:
  """The table's entry for ``device``'s kind, None when it has none."""
  kind = device.device_kind.lower()
  for name in sorted(ACCELERATORS, key=len, reverse=True):  # "TPU v5 lite" before "TPU v5"
    if name.lower() in kind:
      return ACCELERATORS[name]
  return None


def peak_flops(device, dtype: str = "bfloat16") -> float | None:
  """The table's published peak FLOP/s of ``device``'s kind in ``dtype`` (float16 at bfloat16's rate), None when
  the table has no entry for the kind or the dtype."""
  chip = accelerator(device)
  column = {"bfloat16": "bfloat16", "float16": "bfloat16", "float32": "float32"}.get(str(jnp.dtype(dtype)))
  return None if chip is None or column is None else getattr(chip, column)


@functools.cache
def matmul_ceiling(dtype: str, size: int = CPU_MATMUL_SIZE) -> float:
  """FLOP/s of a jitted ``size``² matmul in ``dtype`` on the default device, best of 5 (once per process, dtype
  and size): the same-run ceiling of a device the table lacks."""
  n = size
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.dtype(dtype))
  matmul = jax.jit(jnp.matmul)
  jax.block_until_ready(matmul(a, a))
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, a))
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best


class Ceiling(NamedTuple):
  """What MFU is taken against: ``flops_per_s`` of all the devices together, its ``kind`` (``PUBLISHED`` or
  ``MEASURED``) and ``source`` (where the number comes from, in words)."""
  flops_per_s: float
  kind: str
  source: str


def device_peak(dtype: str, devices: list | None = None) -> Ceiling:
  """The ceiling of ``devices`` together (default: all) in ``dtype``: the table's published peak for their kind
  times their number; else (a CPU, a kind or dtype the table lacks) a matmul ceiling measured once on the default
  device (a CPU's devices, forced or not, share its cores, and one matmul already uses them all; on an
  accelerator it is one chip's, times their number), labelled ``MEASURED``."""
  devices = jax.devices() if devices is None else devices
  peak = peak_flops(devices[0], dtype)
  if peak is not None:
    return Ceiling(peak * len(devices), PUBLISHED, f"{devices[0].device_kind} published {dtype} peak x {len(devices)}")
  if devices[0].platform == "cpu":
    n, count = CPU_MATMUL_SIZE, 1
  else:
    n, count = ACCELERATOR_MATMUL_SIZE, len(devices)
  return Ceiling(matmul_ceiling(dtype, n) * count, MEASURED,
                 f"{devices[0].device_kind}: no published peak in the table; measured {dtype} {n}x{n} matmul"
                 + (f" x {count}" if count > 1 else ""))


def utilisation(tokens_per_s: float, cost: dict, cost_half: dict, ceiling: Ceiling) -> dict:
  """The record of a throughput against ``ceiling``: ``mfu`` against a published peak, ``mfu_vs_measured_matmul``
  against a measured one (never a figure that reads as MFU against the chip's peak), the same under the ``"half"``
  convention (``..._causal_half``) where it differs, and the ceiling's value and kind.

  Args:
    tokens_per_s: trained tokens per second.
    cost: ``flops_per_token(...)`` (convention ``"whole"``).
    cost_half: ``flops_per_token(..., convention="half")``.
    ceiling: ``device_peak(...)``.

  Returns:
    {name: value} for metrics.jsonl.
  """
  name = "mfu" if ceiling.kind == PUBLISHED else "mfu_vs_measured_matmul"
  out = {name: tokens_per_s * cost["train"] / ceiling.flops_per_s}
  if cost_half["train"] != cost["train"]:
    out[name + "_causal_half"] = tokens_per_s * cost_half["train"] / ceiling.flops_per_s
  return out


MFU_FIELDS = ("mfu", "mfu_vs_measured_matmul", "mfu_causal_half", "mfu_vs_measured_matmul_causal_half")


def describe_utilisation(record: dict) -> str:
  """A metrics record's utilisation in words: "MFU 41.2%" against a published peak, "46.0% of a measured matmul"
  against a measured ceiling, with the figure under the other convention for causal products beside."""
  if "mfu" in record:
    text = f"MFU {record['mfu']:.1%}"
  elif "mfu_vs_measured_matmul" in record:
    text = f"{record['mfu_vs_measured_matmul']:.1%} of a measured matmul (no published peak)"
  else:
    return ""
  half = record.get("mfu_causal_half", record.get("mfu_vs_measured_matmul_causal_half"))
  return text + ("" if half is None else f" ({half:.1%} counting causal products' kept half)")
