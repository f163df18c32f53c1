"""The one counting module (experiments/train/flops.py): its attention counts against the matrix products of the
programs they describe, its peak table, and MFU's labelling: a ceiling that is not a published peak never reads as
MFU against the chip's peak."""

import math

import jax
import jax.extend
import jax.numpy as jnp
import pytest

from experiments.configs import tiny as tiny_config
from experiments.train import flops, sweep
from favor_jax import core


def _dot_flops(jaxpr) -> float:
  """2·(output size)·(contracted size) summed over the dot_generals of ``jaxpr`` (scan bodies times their
  length; of a cond's branches the costlier)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
    elif eqn.primitive.name == "cond":
      total += max(_dot_flops(branch.jaxpr) for branch in eqn.params["branches"])
    elif eqn.primitive.name == "scan":
      total += eqn.params["length"] * _dot_flops(eqn.params["jaxpr"].jaxpr)
    else:
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        total += _dot_flops(sub)
  return total


@pytest.mark.parametrize("causal", [True, False])
def test_a_hybrid_window_counts_the_blocks_it_computes(causal):
  """The exact window's blocks (own and previous; and next, bidirectional) and a bidirectional hybrid's two
  causal passes, as the products in hybrid_attention's program."""
  b, length, h, d, m, window, chunk = 1, 128, 2, 16, 16, 32, 16
  q = jnp.zeros((b, length, h, d))
  fn = lambda q, p: core.hybrid_attention(q, q, q, p, window=window, causal=causal, chunk_size=chunk)
  counted = _dot_flops(jax.make_jaxpr(fn)(q, jnp.zeros((m, d))).jaxpr)
  formula = flops.favor_flops(d, m, rows=m, causal=causal, chunk=chunk, window=window)
  assert counted == pytest.approx(b * h * length * formula, rel=0.02)


def test_the_half_convention_halves_causal_masks_only():
  assert flops.softmax_flops(256, 64, causal=True, convention="half") == 4 * 256 * 64 / 2  # MaxText's count
  assert flops.softmax_flops(256, 64, causal=False, convention="half") == 4 * 256 * 64
  whole = flops.favor_flops(64, 256, rows=256, causal=True, chunk=64)
  half = flops.favor_flops(64, 256, rows=256, causal=True, chunk=64, convention="half")
  assert whole - half == 64 * (256 + 64 + 1)  # half of the chunk's 2·C·(F + D + 1)
  with pytest.raises(ValueError, match="convention must be one of"):
    flops.softmax_flops(256, 64, causal=True, convention="quarter")


class _Device:
  platform = "gpu"

  def __init__(self, kind):
    self.device_kind = kind


# Dense (no sparsity) rates from the vendors' data sheets, bfloat16 and float32 (TF32 on NVIDIA; the bfloat16 MXU
# pass on a TPU at XLA's default precision).
PUBLISHED_PEAKS = {"TPU v4": (275e12, 275e12), "TPU v5 lite": (197e12, 197e12), "TPU v5": (459e12, 459e12),
                   "TPU v5p": (459e12, 459e12), "TPU v6 lite": (918e12, 918e12),
                   "NVIDIA A100-SXM4-80GB": (312e12, 156e12), "NVIDIA H100 80GB HBM3": (989e12, 494.5e12),
                   "NVIDIA H100 PCIe": (756e12, 378e12), "NVIDIA H200": (989e12, 494.5e12),
                   "NVIDIA B200": (2.25e15, 1.1e15)}


@pytest.mark.parametrize("kind", sorted(PUBLISHED_PEAKS))
def test_the_peak_table_covers_the_chips_in_both_dtypes(kind):
  bf16, f32 = PUBLISHED_PEAKS[kind]
  assert flops.peak_flops(_Device(kind), "bfloat16") == bf16 and flops.peak_flops(_Device(kind), "float32") == f32
  ceiling = flops.device_peak("bfloat16", [_Device(kind)] * 4)
  assert ceiling == (4 * bf16, flops.PUBLISHED, f"{kind} published bfloat16 peak x 4")


def test_mfu_against_an_unknown_device_records_its_ceiling_value_and_kind(monkeypatch):
  monkeypatch.setattr(flops, "matmul_ceiling", lambda dtype, n: {(8192, "bfloat16"): 5e13}[(n, dtype)])
  ceiling = flops.device_peak("bfloat16", [_Device("NVIDIA Z9000")] * 2)
  assert ceiling.flops_per_s == 2 * 5e13 and ceiling.kind == flops.MEASURED and "no published peak" in ceiling.source
  cost, half = dict(train=1e9), dict(train=0.75e9)
  record = flops.utilisation(1e4, cost, half, ceiling)
  assert record == {"mfu_vs_measured_matmul": 1e13 / 1e14, "mfu_vs_measured_matmul_causal_half": 0.75e13 / 1e14}
  assert "of a measured matmul" in flops.describe_utilisation(record)
  published = flops.utilisation(1e4, cost, cost, flops.device_peak("bfloat16", [_Device("NVIDIA H200")]))
  assert published == {"mfu": 1e13 / 989e12}  # the two conventions agree: one figure


def test_the_cpu_ceiling_is_measured_and_says_so():
  ceiling = flops.device_peak("float32", jax.devices("cpu")[:1])
  assert ceiling.kind == flops.MEASURED and "1024x1024 matmul" in ceiling.source and 1e8 < ceiling.flops_per_s < 1e14


def test_the_summary_reports_one_window_and_labels_a_measured_ceiling():
  """steps/s, tokens/s and MFU from the same logging window (not the whole run's steps/s, which holds the
  compilation); a measured ceiling's value and kind in the note and its column labelled."""
  config = tiny_config.get_config()
  train = dict(kind="train", step=10, train_loss=1.0, steps_per_s=1.0, window_steps_per_s=2.5, tokens_per_s=5e3,
               flops_per_token=1e6, mfu_vs_measured_matmul=0.25, mfu_vs_measured_matmul_causal_half=0.2,
               ceiling="cpu: no published peak in the table; measured float32 1024x1024 matmul",
               ceiling_kind=flops.MEASURED, ceiling_flops_per_s=2e10)
  evaluation = dict(kind="eval", step=10, eval_loss=1.0, eval_accuracy=0.5)
  record = sweep.final_record("mine", config, [evaluation, train])
  assert record["steps_per_s"] == 2.5
  text = sweep.summarize([record], config)
  row = next(line for line in text.splitlines() if line.startswith("| mine |"))
  assert row.endswith("| 2.50 | 5,000 | 25.00% of matmul |")
  assert "measured float32 1024x1024 matmul: 0.02 TFLOP/s (measured matmul)" in text
  assert "the last logging window's rates" in text and "mine 20.00%" in text
