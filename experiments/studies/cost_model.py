"""A roofline cost model of causal attention: FLOPs and HBM bytes per token of causal FAVOR+ (the XLA chunked
pass, the fused kernels) and of flash attention, as functions of L, D, M and the chunk C; PREDICTED times on
TPU v5e, v5p and an H200 from their published peak rates, and the H200 measurements beside them.

    python -m experiments.studies.cost_model                      # the table, into experiments/results/cost_model/
    python -m experiments.studies.cost_model --export=fused_v2    # first read this checkout's kernels (a new row)
    python -m experiments.studies.cost_model --out /tmp/cost      # elsewhere

FLOPs come from the one counting module (``experiments.train.flops``: matrix products, 2 per multiply-add;
forward + backward as what runs: 3× the forward for FAVOR, 3.5× for flash attention, whose backward recomputes
the scores). Bytes: flash attention and the XLA chunked pass by formula (``experiments.train.flops``: what must
cross HBM at least). The fused kernels are also **read from their compiled programs** (``experiments/studies/
programs.py``): ``favor_attention(..., causal_method="pallas")`` and its gradient are exported for TPU and CUDA
from this machine (``jax.export`` on abstract inputs, nothing allocated); ``program_traffic`` adds up what crosses
HBM — every kernel's (Mosaic/Triton custom call's) operands and results, and the XLA arrays around them (each
array that crosses between XLA and a kernel or the program's edge written once and read once; XLA fusing the
rest) — and ``jaxpr_flops`` the products the program computes (a kernel's body times its grid: padding and
recomputation included).
Each export is kept as ``exported_<label>.json`` beside the table, so a new kernel design adds a row and the
old design's row stays (``exported_features_from_xla.json``: the design whose features XLA computes). A
prediction is the roofline max(FLOPs / peak FLOP/s, bytes / HBM bandwidth) of an ideal chip: PREDICTIONS, not
measurements; measured / predicted says how far a pass is from its roofline.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import subprocess

from experiments.studies.programs import export_traffic
from experiments.train import flops as counts

ROOT = pathlib.Path(__file__).resolve().parents[1]  # experiments/
RESULTS = ROOT / "results"

# Published peak rates per chip (dense bfloat16 matrix FLOP/s, HBM bytes/s): experiments/train/flops.py's table,
# with its sources.
CHIPS = {name: dict(flops=counts.ACCELERATORS[kind].bfloat16, hbm=counts.ACCELERATORS[kind].hbm)
         for name, kind in (("tpu_v5e", "TPU v5e"), ("tpu_v5p", "TPU v5p"), ("h200", "H200"))}
# The configuration of the H200 speed studies (experiments/results/speed_h200_bf16, pallas_h200_bf16).
STUDY = dict(batch=1, heads=8, head_dim=64, num_features=256, chunk=64, bytes_in=2)
LENGTHS = (4096, 16384, 65536, 131072)
# The exported programs: the acceptance geometry of issue 51 (bfloat16 q, k, v; an orthogonal [M, D] projection).
EXPORT = dict(batch=2, heads=8, head_dim=64, num_features=256)


def favor_flops(d: int, m: int, c: int) -> float:
  """Causal FAVOR+ per token and head (XLA chunked and fused alike: the same products): features of q and k
  (2·D·M each), the chunk's scores (2·C·M) and their product with [v, 1] (2·C·(D+1)), the chunk's state
  update and the row's read-out of the state before it (2·M·(D+1) each)."""
  return counts.favor_flops(d, m, rows=m, causal=True, chunk=c)


def flash_flops(length: int, d: int, causal: bool = True) -> float:
  """Flash attention per token and head: q·k and the weights' product with v over the keys a row sees
  (L/2 on average when causal; flash kernels skip the blocks above the diagonal)."""
  return counts.softmax_flops(length, d, causal=causal, skips_masked=True)


def exact_full_flops(length: int, d: int) -> float:
  """XLA's exact attention, which forms the whole L×L product even when causal (4·L·D per token)."""
  return counts.softmax_flops(length, d, causal=True)


def export_design(label: str, lengths=LENGTHS, shape: dict = EXPORT, progress=print) -> dict:
  """This checkout's fused kernels read from their exported programs, labelled with the commit they were read at:
  ``lengths`` (L → ``export_traffic``) for TPU, ``cuda`` the same for an NVIDIA GPU (the H200 rows use it), and
  ``variants`` (gated, packed) for TPU at L=16384."""
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    commit = "unknown"
  read = lambda n, **kw: progress(f"exporting L={n} {kw or ''}") or export_traffic(n, **shape, **kw)
  return dict(label=label, commit=commit, shape=shape, platform="tpu",
              lengths={str(n): read(n) for n in lengths}, cuda={str(n): read(n, platform="cuda") for n in lengths},
              variants={name: read(16384, **{name: True}) for name in ("gated", "packed")})


GPU_CHIPS = ("h200",)  # chips whose exported bytes are the CUDA programs'


def designs(results: pathlib.Path = RESULTS / "cost_model") -> dict:
  """{label: design} of every ``exported_*.json`` in ``results``."""
  found = {}
  for path in sorted(results.glob("exported_*.json")):
    d = json.loads(path.read_text())
    found[d["label"]] = d
  return found


def _slug(label: str) -> str:
  return re.sub(r"[^a-z0-9_.-]+", "_", label.lower()).strip("_") or "design"


# --- predictions --------------------------------------------------------------------------------------------------


def favor_xla_bytes(d: int, m: int, c: int, b: int) -> float:
  return counts.favor_xla_bytes(d, m, c, b)


def favor_fused_bytes(d: int, m: int, c: int, b: int) -> float:
  return counts.favor_fused_bytes(d, m, c, b)


def flash_bytes(d: int, b: int) -> float:
  return counts.flash_bytes(d, b)


def per_token(method: str, length: int, d: int, m: int, c: int, b: int) -> tuple[float, float]:
  """(FLOPs, bytes) per token and head of one causal forward pass, by formula."""
  if method == "flash":
    return flash_flops(length, d), flash_bytes(d, b)
  if method == "favor_xla":
    return favor_flops(d, m, c), favor_xla_bytes(d, m, c, b)
  if method == "favor_fused":
    return favor_flops(d, m, c), favor_fused_bytes(d, m, c, b)
  raise ValueError(f"method must be one of flash, favor_xla, favor_fused; got {method!r}")


BACKWARD = {method: (flops, 3.0) for method, flops in counts.HARDWARE_FWD_BWD.items()}  # fwd+bwd / fwd: FLOPs, bytes


def predict(method: str, chip: str, length: int, *, batch: int, heads: int, head_dim: int, num_features: int,
            chunk: int, bytes_in: int, passes: str = "fwd", design: dict | None = None,
            step_overhead_s: float = 0.0) -> dict:
  """The roofline time (s) of one causal call [batch, length, heads, head_dim] and which bound sets it.
  ``design`` (an ``export_design`` record, method "favor_fused"): its bytes and FLOPs read from the exported
  programs at ``length`` (the nearest exported length's, per token; CUDA's for a GPU), instead of the formulas'.
  ``step_overhead_s``: a fixed time per grid step of a design's TPU kernels (their grid steps read from its
  programs; a TensorCore runs them one after another), added to the roofline; 0 by default (not known here)."""
  flops, nbytes = per_token(method, length, head_dim, num_features, chunk, bytes_in)
  if passes == "fwd_bwd":
    flops, nbytes = flops * BACKWARD[method][0], nbytes * BACKWARD[method][1]
  steps = None
  if design is not None:
    programs = design.get("cuda") or design["lengths"] if chip in GPU_CHIPS else design["lengths"]
    near = min(programs, key=lambda n: abs(math.log(int(n) / length)))
    read = programs[near][passes]
    nbytes, flops = read["bytes_per_token"], read.get("flops_per_token", flops)  # the products it computes
    steps = None if chip in GPU_CHIPS else read.get("grid_steps_per_token")
  tokens = batch * heads * length
  compute, memory = tokens * flops / CHIPS[chip]["flops"], tokens * nbytes / CHIPS[chip]["hbm"]
  overhead = tokens * (steps or 0.0) * step_overhead_s
  return dict(method=method if design is None else f"favor_fused [{design['label']}]", chip=chip, seq_len=length,
              passes=passes, flops_per_token=flops, bytes_per_token=nbytes, grid_steps_per_token=steps,
              predicted_s=max(compute, memory) + overhead, bound="compute" if compute >= memory else "memory")


def step_overhead_margin(chip: str, design: dict, passes: str, length: int = 16384, speedup: float = 1.0,
                         **shape) -> float | None:
  """The fixed time per grid step (s) of ``design``'s TPU kernels at which its prediction at ``length`` falls to
  ``speedup``× flash attention's (flash's own steps counted free: a bound in flash's favour); None where the
  design's programs give no grid steps (a GPU, or an export from before they were read); negative where the
  roofline alone is already slower."""
  ours = predict("favor_fused", chip, length, passes=passes, design=design, **shape)
  if not ours["grid_steps_per_token"]:
    return None
  flash = predict("flash", chip, length, passes=passes, **shape)["predicted_s"]
  steps = shape["batch"] * shape["heads"] * length * ours["grid_steps_per_token"]
  return (flash / speedup - ours["predicted_s"]) / steps


def crossover(method: str, chip: str, passes: str = "fwd", design: dict | None = None, **shape) -> int | None:
  """The shortest L (on a grid of 2^(k/8)) from which ``method`` is predicted faster than flash attention."""
  for k in range(8 * 8, 8 * 24 + 1):  # L = 256 .. 16M
    length = int(round(2 ** (k / 8)))
    ours = predict(method, chip, length, passes=passes, design=design, **shape)["predicted_s"]
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


def table(shape: dict = STUDY, results: pathlib.Path = RESULTS, exported: dict | None = None) -> dict:
  """Every prediction (chips × methods × L × passes), the crossovers, and the H200 measurements beside; a row per
  exported design (``designs``) beside the formulas' rows."""
  measured = measurements(results)
  exported = designs(results / "cost_model") if exported is None else exported
  methods = [("flash", None), ("favor_xla", None), ("favor_fused", None)]
  methods += [("favor_fused", d) for d in exported.values()]
  rows = []
  for chip in CHIPS:
    for method, design in methods:
      for passes in ("fwd", "fwd_bwd"):
        for length in LENGTHS:
          row = predict(method, chip, length, passes=passes, design=design, **shape)
          # the H200 timings were of the design with features from XLA (2026-11-30)
          timed = design is None or design["label"] == OLD_DESIGN
          seen = measured.get((method, length, passes)) if chip == "h200" and timed else None
          row.update(measured_s=seen, measured_over_predicted=None if seen is None else seen / row["predicted_s"])
          rows.append(row)
  cross = [dict(chip=chip, method=predict(method, chip, 1024, design=design, **shape)["method"], passes=passes,
                crossover_len=crossover(method, chip, passes, design=design, **shape))
           for chip in CHIPS for method, design in methods[1:] for passes in ("fwd", "fwd_bwd")]
  margin = lambda chip, d, passes, k: step_overhead_margin(chip, d, passes, speedup=k, **shape)
  margins = [dict(chip=chip, method=predict("favor_fused", chip, 1024, design=d, **shape)["method"], passes=passes,
                  seq_len=16384, **{f"step_overhead_s_at_{k}x": margin(chip, d, passes, k) for k in (3, 1)})
             for chip in CHIPS if chip not in GPU_CHIPS for d in exported.values() for passes in ("fwd", "fwd_bwd")]
  return dict(label="PREDICTIONS (roofline of published peaks); measured_s: H200 bf16, 2026-11-30", shape=shape,
              step_overhead_margins=[m for m in margins if m["step_overhead_s_at_1x"] is not None],
              chips=CHIPS, designs={k: dict(commit=d["commit"], shape=d["shape"], platform=d["platform"],
                                            read=_read(d)) for k, d in exported.items()}, rows=rows, crossovers=cross)


def _read(design: dict, length: str = "16384") -> list[dict]:
  """What a design's programs move at ``length``, per program read: the rows of the markdown's designs table."""
  programs = [("tpu", design["lengths"]), ("cuda", design.get("cuda", {}))]
  programs += [(f"tpu {name}", {length: read}) for name, read in design.get("variants", {}).items()]
  return [dict(program=name, passes=passes, kernels=len(r["kernels"]), kernel_bytes=r["kernel_bytes_per_token"],
               xla_bytes=r["xla_bytes_per_token"], bytes=r["bytes_per_token"], large_arrays=r["large_arrays"],
               kernel_flops=r.get("kernel_flops_per_token"), flops=r.get("flops_per_token"),
               operand_types=sorted({t.rpartition("x")[2].rstrip(">") for k in r["kernels"] for t in k["operands"]}))
          for name, by_length in programs if length in by_length for passes, r in by_length[length].items()]


OLD_DESIGN = "features from XLA"  # the label of exported_features_from_xla.json


def markdown(t: dict) -> str:
  s = t["shape"]
  lines = [f"PREDICTIONS: roofline max(FLOPs/peak, bytes/HBM) of causal attention, B={s['batch']} H={s['heads']} "
           f"D={s['head_dim']} M={s['num_features']} C={s['chunk']}, bfloat16 inputs; measured: H200, 2026-11-30. "
           "favor_fused: bytes by formula; favor_fused [design]: bytes read from that design's programs exported "
           "for TPU (for the H200: for CUDA) ("
           + "; ".join(f"{k}: commit {d['commit']}" for k, d in t.get("designs", {}).items()) + ").",
           "", "| chip | method | pass | L | FLOP/token/head | bytes/token/head | bound | predicted (ms) "
           "| measured (ms) | measured/predicted |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in t["rows"]:
    seen = "" if r["measured_s"] is None else f"{1e3 * r['measured_s']:.3f}"
    ratio = "" if r["measured_over_predicted"] is None else f"{r['measured_over_predicted']:.1f}×"
    lines.append(f"| {r['chip']} | {r['method']} | {r['passes']} | {r['seq_len']} | {r['flops_per_token']:.3g} | "
                 f"{r['bytes_per_token']:.3g} | {r['bound']} | {1e3 * r['predicted_s']:.3f} | {seen} | {ratio} |")
  for label, d in t.get("designs", {}).items():
    lines += ["", f"Design [{label}] (commit {d['commit']}), read from its exported programs at L=16384, bytes per "
              "token and head; large arrays: at least B·L·H·M/2 elements anywhere in the program.", "",
              "| program | pass | kernels | kernel operand dtypes | kernel bytes | XLA bytes | total | kernel FLOPs "
              "| FLOPs | large arrays |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['program']} | {r['passes']} | {r['kernels']} | {', '.join(r['operand_types'])} | "
              f"{r['kernel_bytes']:.0f} | {r['xla_bytes']:.0f} | {r['bytes']:.0f} | {r.get('kernel_flops', 0):.3g} | "
              f"{r.get('flops', 0):.3g} | {', '.join(r['large_arrays'])} |" for r in d.get("read", [])]
  if t.get("step_overhead_margins"):
    lines += ["", "Per-grid-step overhead (the roofline counts none): the fixed time per grid step of the fused TPU "
              "kernels (their steps read from the exported programs, run one after another) at which the prediction "
              "at L=16384 falls to 3× flash attention's speed, and to flash attention's time (flash's own grid steps "
              "counted free).", "", "| chip | method | pass | µs per step for 3× flash | µs per step for 1× flash |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {m['chip']} | {m['method']} | {m['passes']} | {1e6 * m['step_overhead_s_at_3x']:.2f} | "
              f"{1e6 * m['step_overhead_s_at_1x']:.2f} |" for m in t["step_overhead_margins"]]
  lines += ["", "| chip | method | pass | predicted crossover L (faster than flash from) |",
            "| --- | --- | --- | --- |"]
  for c in t["crossovers"]:
    lines.append(f"| {c['chip']} | {c['method']} | {c['passes']} | {c['crossover_len'] or 'none ≤ 16M'} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=str(RESULTS / "cost_model"), help="directory for cost_model.json/.md")
  parser.add_argument("--export", default=None, metavar="LABEL",
                      help="first export this checkout's fused kernels for TPU and keep their traffic as "
                           "exported_LABEL.json (a row of the table)")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  if args.export:
    design = export_design(args.export)
    (out / f"exported_{_slug(args.export)}.json").write_text(json.dumps(design, indent=1))
  exported = designs(RESULTS / "cost_model")
  exported.update(designs(out))
  t = table(exported=exported)
  (out / "cost_model.json").write_text(json.dumps(t, indent=1))
  (out / "cost_model.md").write_text(markdown(t))
  print(markdown(t))
  assert math.isfinite(sum(r["predicted_s"] for r in t["rows"]))


if __name__ == "__main__":
  main()
