"""A roofline cost model of causal attention: FLOPs and HBM bytes per token of causal FAVOR+ (the XLA chunked
pass, the fused kernels) and of flash attention, as functions of L, D, M and the chunk C; PREDICTED times on
TPU v5e, v5p and an H200 from their published peak rates, and the H200 measurements beside them.

    python -m experiments.studies.cost_model                      # writes experiments/results/cost_model/
    python -m experiments.studies.cost_model --out /tmp/cost      # elsewhere

Counts are per token and per head, forward pass, matrix products only (2 FLOPs per multiply-add; the
exponentials and maxima, O(M + C) per token, are left out). Bytes: what must cross HBM at least, inputs in
``bytes_in`` bytes (bfloat16: 2), the passes' float32 intermediates in 4. A prediction is the roofline
max(FLOPs / peak FLOP/s, bytes / HBM bandwidth); forward + backward takes 3× the forward's FLOPs and bytes
(FAVOR: the backward's products are twice the forward's) and 3.5× flash attention's FLOPs (its backward
recomputes the scores: 2.5× the forward). These are PREDICTIONS (an ideal chip running every product at its
peak), not measurements; the ratio measured / predicted says how far a pass is from its roofline.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]  # experiments/
RESULTS = ROOT / "results"

# Published peak rates: dense bfloat16 matrix FLOP/s and HBM bytes/s per chip.
# TPU v5e: 197 TFLOP/s bf16, 819 GB/s (https://cloud.google.com/tpu/docs/v5e, "System architecture").
# TPU v5p: 459 TFLOP/s bf16, 2765 GB/s (https://cloud.google.com/tpu/docs/v5p, "System architecture").
# H200 SXM: 989 TFLOP/s bf16 dense (1979 with 2:4 sparsity), 4.8 TB/s
#   (https://www.nvidia.com/en-us/data-center/h200/, datasheet table).
CHIPS = {
    "tpu_v5e": dict(flops=197e12, hbm=819e9),
    "tpu_v5p": dict(flops=459e12, hbm=2765e9),
    "h200": dict(flops=989e12, hbm=4.8e12),
}
# The configuration of the H200 speed studies (experiments/results/speed_h200_bf16, pallas_h200_bf16).
STUDY = dict(batch=1, heads=8, head_dim=64, num_features=256, chunk=64, bytes_in=2)
LENGTHS = (16384, 131072)
F32 = 4


def favor_flops(d: int, m: int, c: int) -> float:
  """Causal FAVOR+ per token and head (XLA chunked and fused alike: the same products): features of q and k
  (2·D·M each), the chunk's scores (2·C·M) and their product with [v, 1] (2·C·(D+1)), the chunk's state
  update and the row's read-out of the state before it (2·M·(D+1) each)."""
  return 4 * d * m + 2 * c * m + 2 * c * (d + 1) + 4 * m * (d + 1)


def flash_flops(length: int, d: int, causal: bool = True) -> float:
  """Flash attention per token and head: q·k and the weights' product with v over the keys a row sees
  (L/2 on average when causal; flash kernels skip the blocks above the diagonal)."""
  keys = length / 2 if causal else length
  return 4 * keys * d


def exact_full_flops(length: int, d: int) -> float:
  """XLA's exact attention, which forms the whole L×L product even when causal (4·L·D per token)."""
  return flash_flops(length, d, causal=False)


def favor_xla_bytes(d: int, m: int, c: int, b: int) -> float:
  """The XLA chunked pass: q, k, v in and the output out (4·D·b); both sides' features written and read back
  in float32 (16·M); the chunk's [C] scores per row (8·C); one [M, D+1] float32 state per chunk, written and
  read (8·M·(D+1)/C)."""
  return 4 * d * b + 4 * F32 * m + 2 * F32 * c + 2 * F32 * m * (d + 1) / c


def favor_fused_bytes(d: int, m: int, c: int, b: int) -> float:
  """The fused kernels: q, k read for the features (2·D·b), their float32 logs written (8·M) and read by the
  state and output kernels (12·M); v read by both (2·D·b); one state per chunk written and read; numerator,
  denominator and row scale written and read by the division (8·(D+2)); the output written (D·b)."""
  return 5 * d * b + 5 * F32 * m + 2 * F32 * m * (d + 1) / c + 2 * F32 * (d + 2)


def flash_bytes(d: int, b: int) -> float:
  """Flash attention: q, k, v read and the output written once (4·D·b); re-reads of k and v by later query
  blocks are assumed served from on-chip memory (a lower bound; on an H200 one head's k, v at L = 128k,
  32 MB, fit its 50 MB L2)."""
  return 4 * d * b


def per_token(method: str, length: int, d: int, m: int, c: int, b: int) -> tuple[float, float]:
  """(FLOPs, bytes) per token and head of one causal forward pass."""
  if method == "flash":
    return flash_flops(length, d), flash_bytes(d, b)
  if method == "favor_xla":
    return favor_flops(d, m, c), favor_xla_bytes(d, m, c, b)
  if method == "favor_fused":
    return favor_flops(d, m, c), favor_fused_bytes(d, m, c, b)
  raise ValueError(f"method must be one of flash, favor_xla, favor_fused; got {method!r}")


BACKWARD = {"flash": (3.5, 3.0), "favor_xla": (3.0, 3.0), "favor_fused": (3.0, 3.0)}  # fwd+bwd / fwd: FLOPs, bytes


def predict(method: str, chip: str, length: int, *, batch: int, heads: int, head_dim: int, num_features: int,
            chunk: int, bytes_in: int, passes: str = "fwd") -> dict:
  """The roofline time (s) of one causal call [batch, length, heads, head_dim] and which bound sets it."""
  flops, nbytes = per_token(method, length, head_dim, num_features, chunk, bytes_in)
  if passes == "fwd_bwd":
    flops, nbytes = flops * BACKWARD[method][0], nbytes * BACKWARD[method][1]
  tokens = batch * heads * length
  compute, memory = tokens * flops / CHIPS[chip]["flops"], tokens * nbytes / CHIPS[chip]["hbm"]
  return dict(method=method, chip=chip, seq_len=length, passes=passes, flops_per_token=flops,
              bytes_per_token=nbytes, predicted_s=max(compute, memory),
              bound="compute" if compute >= memory else "memory")


def crossover(method: str, chip: str, passes: str = "fwd", **shape) -> int | None:
  """The shortest L (on a grid of 2^(k/8)) from which ``method`` is predicted faster than flash attention."""
  for k in range(8 * 8, 8 * 24 + 1):  # L = 256 .. 16M
    length = int(round(2 ** (k / 8)))
    ours = predict(method, chip, length, passes=passes, **shape)["predicted_s"]
    if ours < predict("flash", chip, length, passes=passes, **shape)["predicted_s"]:
      return length
  return None


MEASURED = {"flash": "jax_dot_product_attention", "favor_xla": "favor", "favor_fused": "favor_pallas"}


def measurements(results: pathlib.Path = RESULTS) -> dict:
  """{(method, L, pass): median seconds} of the H200 bfloat16 studies of 2026-11-30 (causal rows)."""
  out = {}
  for path in (results / "speed_h200_bf16" / "results.json", results / "pallas_h200_bf16" / "speed_long_results.json"):
    if not path.exists():
      continue
    for r in json.loads(path.read_text()):
      ours = {v: k for k, v in MEASURED.items()}.get(r["method"])
      if ours and r["causal"] and r.get("status") == "ok":
        out[(ours, r["seq_len"], r["pass"])] = r["median_s"]
  return out


def table(shape: dict = STUDY, results: pathlib.Path = RESULTS) -> dict:
  """Every prediction (chips × methods × L × passes), the crossovers, and the H200 measurements beside."""
  measured = measurements(results)
  rows = []
  for chip in CHIPS:
    for method in ("flash", "favor_xla", "favor_fused"):
      for passes in ("fwd", "fwd_bwd"):
        for length in LENGTHS:
          row = predict(method, chip, length, passes=passes, **shape)
          seen = measured.get((method, length, passes)) if chip == "h200" else None
          row.update(measured_s=seen, measured_over_predicted=None if seen is None else seen / row["predicted_s"])
          rows.append(row)
  cross = [dict(chip=chip, method=method, passes=passes, crossover_len=crossover(method, chip, passes, **shape))
           for chip in CHIPS for method in ("favor_xla", "favor_fused") for passes in ("fwd", "fwd_bwd")]
  return dict(label="PREDICTIONS (roofline of published peaks); measured_s: H200 bf16, 2026-11-30", shape=shape,
              chips=CHIPS, rows=rows, crossovers=cross)


def markdown(t: dict) -> str:
  s = t["shape"]
  lines = [f"PREDICTIONS: roofline max(FLOPs/peak, bytes/HBM) of causal attention, B={s['batch']} H={s['heads']} "
           f"D={s['head_dim']} M={s['num_features']} C={s['chunk']}, bfloat16 inputs; measured: H200, 2026-11-30.", "",
           "| chip | method | pass | L | FLOP/token/head | bytes/token/head | bound | predicted (ms) | measured (ms) "
           "| measured/predicted |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in t["rows"]:
    seen = "" if r["measured_s"] is None else f"{1e3 * r['measured_s']:.3f}"
    ratio = "" if r["measured_over_predicted"] is None else f"{r['measured_over_predicted']:.1f}×"
    lines.append(f"| {r['chip']} | {r['method']} | {r['passes']} | {r['seq_len']} | {r['flops_per_token']:.3g} | "
                 f"{r['bytes_per_token']:.3g} | {r['bound']} | {1e3 * r['predicted_s']:.3f} | {seen} | {ratio} |")
  lines += ["", "| chip | method | pass | predicted crossover L (faster than flash from) |",
            "| --- | --- | --- | --- |"]
  for c in t["crossovers"]:
    lines.append(f"| {c['chip']} | {c['method']} | {c['passes']} | {c['crossover_len'] or 'none ≤ 16M'} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=str(RESULTS / "cost_model"), help="directory for cost_model.json/.md")
  out = pathlib.Path(parser.parse_args(argv).out)
  out.mkdir(parents=True, exist_ok=True)
  t = table()
  (out / "cost_model.json").write_text(json.dumps(t, indent=1))
  (out / "cost_model.md").write_text(markdown(t))
  print(markdown(t))
  assert math.isfinite(sum(r["predicted_s"] for r in t["rows"]))


if __name__ == "__main__":
  main()
