"""A roofline cost model of causal attention: FLOPs and HBM bytes per token of causal FAVOR+ (the XLA chunked
pass, the fused kernels) and of flash attention, as functions of L, D, M and the chunk C; PREDICTED times on
TPU v5e, v5p and an H200 from their published peak rates, and the H200 measurements beside them.

    python -m experiments.studies.cost_model                      # the table, into experiments/results/cost_model/
    python -m experiments.studies.cost_model --export=fused_v2    # first read this checkout's kernels (a new row)
    python -m experiments.studies.cost_model --out /tmp/cost      # elsewhere

FLOPs come from the one counting module (``experiments.train.flops``: matrix products, 2 per multiply-add;
forward + backward as what runs: 3× the forward for FAVOR, 3.5× for flash attention, whose backward recomputes
the scores). Bytes: flash attention and the XLA chunked pass by formula (``experiments.train.flops``: what must
cross HBM at least); the fused kernels **read from their compiled programs**: ``favor_attention(...,
causal_method="pallas")`` and its gradient are exported for TPU from this machine (``jax.export`` with
``platforms=["tpu"]`` on abstract inputs, nothing allocated), and ``program_traffic`` adds up what crosses HBM:
every kernel's (Mosaic/Triton custom call's) operands and results, and the XLA arrays around them (each array
that crosses between XLA and a kernel or the program's edge written once and read once; XLA fusing the rest).
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
KERNEL_TARGETS = ("tpu_custom_call", "mosaic_gpu", "__gpu$xla.gpu.triton", "triton_kernel_call")


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


# --- bytes read from exported programs ---------------------------------------------------------------------------


def _tensor_bytes(t) -> int:
  """Bytes of an MLIR ranked tensor type (booleans as one byte each, as XLA stores them)."""
  from jax._src.lib.mlir import ir
  shaped = ir.RankedTensorType(t)
  width = shaped.element_type.width if hasattr(shaped.element_type, "width") else 32
  return math.prod(shaped.shape) * max(1, width // 8)


class _Array:
  """One array of the program (an SSA value after calls and taken branches are followed): its type, bytes, who
  wrote it ("arg", "kernel", "xla") and who reads it."""

  def __init__(self, type_, producer: str):
    self.type, self.bytes, self.producer, self.readers = str(type_), _tensor_bytes(type_), producer, set()


def _kernel_count(regions, funcs, seen=()) -> tuple[int, int]:
  """(kernel calls, operations) in ``regions`` with calls followed: how a branch is chosen."""
  kernels = ops = 0
  for region in regions:
    for block in region.blocks:
      for inner in block.operations:
        inner = inner.operation
        ops += 1
        if inner.name == "stablehlo.custom_call" and _target(inner) in KERNEL_TARGETS:
          kernels += 1
        callee = _callee(inner)
        if callee is not None and callee not in seen:
          k, o = _kernel_count(funcs[callee].regions, funcs, seen + (callee,))
          kernels, ops = kernels + k, ops + o
        elif inner.regions and inner.name != "stablehlo.while":
          k, o = _kernel_count(inner.regions, funcs, seen)
          kernels, ops = kernels + k, ops + o
  return kernels, ops


def _target(op) -> str:
  from jax._src.lib.mlir import ir
  return ir.StringAttr(op.attributes["call_target_name"]).value


def _callee(op) -> str | None:
  from jax._src.lib.mlir import ir
  return ir.FlatSymbolRefAttr(op.attributes["callee"]).value if op.name == "func.call" else None


def program_traffic(mlir_text: str, kernel_targets=KERNEL_TARGETS, large: int | None = None) -> dict:
  """What an exported program moves through HBM, read from its StableHLO text (``Exported.mlir_module()``).

  Calls are followed into their functions; of a conditional, the branch that runs the most kernels (among equals
  the one of fewest operations: the fast path, not a fallback) is taken; a while loop is one XLA operation (its
  body is not entered: a kernel inside a loop is not counted). Every kernel (a custom call whose target is in
  ``kernel_targets``) reads its operands and writes its results; XLA, fusing everything between kernels, writes
  each array a kernel or the program's output takes from it, and reads each array (a program input, a kernel's
  result) it takes, once.

  Args:
    mlir_text: the module's text.
    kernel_targets: custom-call targets that are kernels.
    large: list the arrays of at least this many elements (None: none listed).

  Returns:
    dict(kernels=[dict(target, operands, results, bytes)], kernel_bytes, xla_bytes, total_bytes, large_arrays).
  """
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib.mlir import ir

  with jax_mlir.make_ir_context():
    module = ir.Module.parse(mlir_text)
    funcs = {ir.StringAttr(op.attributes["sym_name"]).value: op.operation for op in module.body.operations
             if op.operation.name == "func.func"}
    main = funcs["main"]
    arrays, kernels = [], []

    def new(value, producer):
      if value.type.typeid != ir.RankedTensorType.static_typeid:  # tokens and the like move nothing
        return None
      a = _Array(value.type, producer)
      arrays.append(a)
      return a

    def run(block, env) -> list:
      """Walks ``block`` with ``env`` (its values → _Array); returns its terminator's arrays."""
      for op in block.operations:
        op = op.operation
        ins = [env.get(v) for v in op.operands]
        if op.name in ("func.return", "stablehlo.return"):
          return ins
        callee = _callee(op)
        if callee is not None:
          body = funcs[callee].regions[0].blocks[0]
          outs = run(body, dict(zip(body.arguments, ins)))
        elif op.name in ("stablehlo.case", "stablehlo.if"):
          counts_ = [_kernel_count([r], funcs) for r in op.regions]
          best = min(range(len(op.regions)), key=lambda i: (-counts_[i][0], counts_[i][1]))
          for a in ins:
            if a is not None:
              a.readers.add("xla")
          outs = run(op.regions[best].blocks[0], env)  # a branch sees the values around it
        elif op.name == "stablehlo.custom_call" and _target(op) in kernel_targets:
          for a in ins:
            if a is not None:
              a.readers.add("kernel")
          outs = [new(r, "kernel") for r in op.results]
          kernels.append(dict(target=_target(op), operands=[a.type for a in ins if a is not None],
                              results=[a.type for a in outs if a is not None],
                              bytes=sum(a.bytes for a in ins + outs if a is not None)))
        else:
          for a in ins:
            if a is not None:
              a.readers.add("xla")
          outs = [new(r, "xla") for r in op.results]
        env.update(zip(op.results, outs))
      return []

    body = main.regions[0].blocks[0]
    env = {arg: new(arg, "arg") for arg in body.arguments}
    for a in run(body, env):
      if a is not None:
        a.readers.add("output")
  written = sum(a.bytes for a in arrays if a.producer == "xla" and a.readers & {"kernel", "output"})
  read = sum(a.bytes for a in arrays if a.producer in ("arg", "kernel") and "xla" in a.readers)
  kernel_bytes = sum(k["bytes"] for k in kernels)
  out = dict(kernels=kernels, kernel_bytes=kernel_bytes, xla_bytes=written + read,
             total_bytes=kernel_bytes + written + read)
  if large is not None:
    sizes = lambda t: math.prod(int(x) for x in re.findall(r"(\d+)x", t))
    out["large_arrays"] = sorted({a.type for a in arrays if sizes(a.type) >= large}, key=sizes, reverse=True)
  return out


def export_traffic(length: int, *, batch: int, heads: int, head_dim: int, num_features: int,
                   platform: str = "tpu", **options) -> dict:
  """Exports ``favor_attention(q, k, v, projection, causal=True, causal_method="pallas", **options)`` on bfloat16
  abstract inputs [batch, length, heads, head_dim] for ``platform``, forward and gradient (of Σ out², w.r.t. q, k,
  v), and reads their traffic (``program_traffic``), per token and head.

  Returns:
    {"fwd", "fwd_bwd"}: each dict(kernel, xla, total bytes per token and head, kernels, large_arrays).
  """
  import jax
  import jax.numpy as jnp

  from favor_jax import core

  shape = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.bfloat16)
  proj = jax.ShapeDtypeStruct((num_features, head_dim), jnp.float32)
  fwd = lambda q, k, v, p: core.favor_attention(q, k, v, p, causal=True, causal_method="pallas", **options)
  grad = jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
  tokens = batch * length * heads
  out = {}
  for passes, fn in (("fwd", fwd), ("fwd_bwd", grad)):
    text = jax.export.export(jax.jit(fn), platforms=[platform])(shape, shape, shape, proj).mlir_module()
    t = program_traffic(text, large=tokens * num_features // 2)
    out[passes] = dict(kernel_bytes_per_token=t["kernel_bytes"] / tokens, xla_bytes_per_token=t["xla_bytes"] / tokens,
                       bytes_per_token=t["total_bytes"] / tokens, kernels=t["kernels"],
                       large_arrays=t["large_arrays"])
  return out


def export_design(label: str, lengths=LENGTHS, shape: dict = EXPORT) -> dict:
  """Every length's ``export_traffic`` of this checkout's kernels, labelled (with the commit it was read at)."""
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    commit = "unknown"
  return dict(label=label, commit=commit, shape=shape, platform="tpu",
              lengths={str(n): export_traffic(n, **shape) for n in lengths})


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
            chunk: int, bytes_in: int, passes: str = "fwd", design: dict | None = None) -> dict:
  """The roofline time (s) of one causal call [batch, length, heads, head_dim] and which bound sets it.
  ``design`` (an ``export_design`` record, method "favor_fused"): its bytes read from the exported programs at
  ``length`` (the nearest exported length's bytes per token), instead of the formula's."""
  flops, nbytes = per_token(method, length, head_dim, num_features, chunk, bytes_in)
  if passes == "fwd_bwd":
    flops, nbytes = flops * BACKWARD[method][0], nbytes * BACKWARD[method][1]
  if design is not None:
    near = min(design["lengths"], key=lambda n: abs(math.log(int(n) / length)))
    nbytes = design["lengths"][near][passes]["bytes_per_token"]
  tokens = batch * heads * length
  compute, memory = tokens * flops / CHIPS[chip]["flops"], tokens * nbytes / CHIPS[chip]["hbm"]
  return dict(method=method if design is None else f"favor_fused [{design['label']}]", chip=chip, seq_len=length,
              passes=passes, flops_per_token=flops, bytes_per_token=nbytes, predicted_s=max(compute, memory),
              bound="compute" if compute >= memory else "memory")


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
  return dict(label="PREDICTIONS (roofline of published peaks); measured_s: H200 bf16, 2026-11-30", shape=shape,
              chips=CHIPS, designs={k: dict(commit=d["commit"], shape=d["shape"], platform=d["platform"])
                                    for k, d in exported.items()}, rows=rows, crossovers=cross)


OLD_DESIGN = "features from XLA"  # the label of exported_features_from_xla.json


def markdown(t: dict) -> str:
  s = t["shape"]
  lines = [f"PREDICTIONS: roofline max(FLOPs/peak, bytes/HBM) of causal attention, B={s['batch']} H={s['heads']} "
           f"D={s['head_dim']} M={s['num_features']} C={s['chunk']}, bfloat16 inputs; measured: H200, 2026-11-30. "
           "favor_fused: bytes by formula; favor_fused [design]: bytes read from that design's programs exported "
           "for TPU (" + "; ".join(f"{k}: commit {d['commit']}" for k, d in t.get("designs", {}).items()) + ").",
           "", "| chip | method | pass | L | FLOP/token/head | bytes/token/head | bound | predicted (ms) "
           "| measured (ms) | measured/predicted |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
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
