"""What a compiled program moves through HBM, read from its exported StableHLO: the kernels' (Mosaic or Triton
custom calls') operands and results, and the XLA arrays around them; and the matrix products it computes, read
from its jaxpr (the kernels' bodies times their grids). The cost model's bytes and FLOPs of the fused kernels
(``experiments/studies/cost_model.py``) come from here.

    from experiments.studies import programs
    programs.export_traffic(16384, batch=2, heads=8, head_dim=64, num_features=256)   # bytes per token and head
"""

from __future__ import annotations

import math
import re

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import mlir as jax_mlir
from jaxlib.mlir import ir

from favor_jax import core

KERNEL_TARGETS = ("tpu_custom_call", "mosaic_gpu", "__gpu$xla.gpu.triton", "triton_kernel_call")
# The programs are read, never run elsewhere: kernels without jax.export's compatibility guarantee (Triton's) pass.
ACCEPTED = [jax.export.DisabledSafetyCheck.custom_call(target) for target in KERNEL_TARGETS]


def _tensor_bytes(t) -> int:
  """Bytes of an MLIR ranked tensor type (booleans as one byte each, as XLA stores them)."""
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
  return ir.StringAttr(op.attributes["call_target_name"]).value


def _callee(op) -> str | None:
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


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def _compiler(eqn) -> str:
  """Which compiler a ``pallas_call`` is for: "tpu" (Mosaic), "cuda" (Triton or Mosaic GPU), "" otherwise."""
  module = type(eqn.params.get("compiler_params")).__module__.lower()
  if "mosaic" in module and "gpu" not in module:
    return "tpu"
  return "cuda" if "triton" in module or "gpu" in module else ""


def jaxpr_flops(jaxpr, platform: str = "tpu", in_kernel: bool = False) -> dict:
  """The matrix products of a traced program (``jax.make_jaxpr(fn)(...).jaxpr``), 2 FLOPs per multiply-add.

  A ``pallas_call``'s body counts once per grid step; a scan's body once per step; of a conditional, the branch
  with ``platform``'s kernels if one has them (``lax.platform_dependent``), else the branch with the most kernels
  (among equals the one of fewest operations: the fast path, as ``program_traffic`` takes it); a while loop's body
  has no static trip count and is left out, its products reported in ``uncounted`` (and its kernels' grid steps
  not counted in ``steps``).

  Args:
    jaxpr: the program.
    platform: "tpu" or "cuda": whose kernels a platform choice takes.
    in_kernel: count every product as a kernel's (inside a ``pallas_call``).

  Returns:
    dict(kernel, xla: FLOPs inside kernels and outside them; kernels: pallas calls; ops: equations; uncounted;
    steps: the grid steps the kernels run, each call's grid size times the scans around it).
  """
  out = dict(kernel=0.0, xla=0.0, kernels=0, ops=0, uncounted=0.0, steps=0)

  def add(part, times=1):
    for key in out:
      out[key] += part[key] * (times if key in ("kernel", "xla", "uncounted", "steps") else 1)

  for eqn in jaxpr.eqns:
    out["ops"] += 1
    name = eqn.primitive.name
    if name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      out["kernel" if in_kernel else "xla"] += (2 * math.prod(eqn.outvars[0].aval.shape)
                                                * math.prod(lhs[i] for i in contract))
    elif name == "pallas_call":
      body = jaxpr_flops(eqn.params["jaxpr"], platform, True)
      out["kernels"] += 1
      add(dict(body, steps=1), math.prod(eqn.params["grid_mapping"].grid))  # a body holds no kernel of its own
    elif name == "cond":
      branches = [b.jaxpr for b in eqn.params["branches"]]
      ours = [any(e.primitive.name == "pallas_call" and _compiler(e) == platform for e in _eqns(b)) for b in branches]
      parts = [jaxpr_flops(b, platform, in_kernel) for b in branches]
      best = ours.index(True) if any(ours) else min(range(len(parts)), key=lambda i: (-parts[i]["kernels"],
                                                                                      parts[i]["ops"]))
      add(parts[best])
    elif name == "scan":
      add(jaxpr_flops(eqn.params["jaxpr"].jaxpr, platform, in_kernel), eqn.params["length"])
    elif name == "while":
      body = jaxpr_flops(eqn.params["body_jaxpr"].jaxpr, platform, in_kernel)
      out["uncounted"] += body["kernel"] + body["xla"] + body["uncounted"]
      out["kernels"] += body["kernels"]
    else:
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        add(jaxpr_flops(sub, platform, in_kernel))
  return out


def export_traffic(length: int, *, batch: int, heads: int, head_dim: int, num_features: int, platform: str = "tpu",
                   gated: bool = False, packed: bool = False) -> dict:
  """Exports ``favor_attention(q, k, v, projection, causal=True, causal_method="pallas")`` and its gradient (of
  Σ out², w.r.t. q, k, v) for ``platform`` on abstract bfloat16 inputs (nothing is allocated), and reads their
  traffic (``program_traffic``).

  Args:
    length: L.
    batch: B.
    heads: H.
    head_dim: D (of q, k and v).
    num_features: M, rows of the float32 projection.
    platform: what ``jax.export`` lowers for ("tpu": Mosaic kernels; "cuda": Triton).
    gated: with a float32 ``log_gate`` [B, L, H].
    packed: with int32 ``segment_ids`` [B, L].

  Returns:
    {"fwd", "fwd_bwd"}: each dict(kernel_bytes_per_token, xla_bytes_per_token, bytes_per_token,
    kernel_flops_per_token, flops_per_token (the program's matrix products, ``jaxpr_flops``; all per token and
    head), uncounted_flops (inside while loops), grid_steps_per_token (the kernels' grid steps, ``jaxpr_flops``),
    kernels, large_arrays (of at least B·L·H·M/2 elements)).
  """
  shape = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.bfloat16)
  extra = dict(log_gate=jax.ShapeDtypeStruct((batch, length, heads), jnp.float32) if gated else None,
               segment_ids=jax.ShapeDtypeStruct((batch, length), jnp.int32) if packed else None)
  extra = {k: v for k, v in extra.items() if v is not None}
  fwd = lambda q, k, v, p, kw: core.favor_attention(q, k, v, p, causal=True, causal_method="pallas", **kw)
  grad = jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
  abstract = (shape, shape, shape, jax.ShapeDtypeStruct((num_features, head_dim), jnp.float32), extra)
  tokens = batch * length * heads
  out = {}
  for passes, fn in (("fwd", fwd), ("fwd_bwd", grad)):
    text = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=ACCEPTED)(*abstract).mlir_module()
    t = program_traffic(text, large=tokens * num_features // 2)
    f = jaxpr_flops(jax.make_jaxpr(fn)(*abstract).jaxpr, platform)
    out[passes] = dict(kernel_bytes_per_token=t["kernel_bytes"] / tokens, xla_bytes_per_token=t["xla_bytes"] / tokens,
                       bytes_per_token=t["total_bytes"] / tokens, kernel_flops_per_token=f["kernel"] / tokens,
                       flops_per_token=(f["kernel"] + f["xla"]) / tokens, uncounted_flops=f["uncounted"],
                       grid_steps_per_token=f["steps"] / tokens,
                       kernels=t["kernels"], large_arrays=t["large_arrays"])
  return out
