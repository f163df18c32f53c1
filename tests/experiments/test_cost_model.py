"""The cost model (experiments/studies/cost_model.py): its FLOP formulas against a direct count of the matrix products
in the programs they describe (walked in the jaxpr: every dot_general, times its loop's trip count, the
costlier branch of a cond), its reader of exported programs against a count by hand and by the types' text, and
the table it writes."""

import json
import math
import re

import jax
import jax.extend
import jax.numpy as jnp
import pytest

from experiments.studies import cost_model, programs
from favor_jax import core
from favor_jax.core.fused import tpu as fused_tpu


def _dot_flops(jaxpr) -> float:
  """2·(output size)·(contracted size) summed over the dot_generals of ``jaxpr`` (scan bodies times their
  length; of a cond's branches the costlier)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
    elif name == "cond":
      total += max(_dot_flops(branch.jaxpr) for branch in eqn.params["branches"])
    elif name == "scan":
      total += eqn.params["length"] * _dot_flops(eqn.params["jaxpr"].jaxpr)
    else:
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        total += _dot_flops(sub)
  return total


@pytest.mark.parametrize("d, m, chunk", [(16, 32, 16), (32, 16, 32)])
def test_favor_flops_equal_the_products_of_the_chunked_pass(d, m, chunk):
  b, length, h = 1, 4 * chunk, 2
  q = k = v = jnp.zeros((b, length, h, d))
  proj = jnp.zeros((m, d))
  fn = lambda q, k, v, p: core.favor_attention(q, k, v, p, causal=True, causal_method="chunked", chunk_size=chunk)
  counted = _dot_flops(jax.make_jaxpr(fn)(q, k, v, proj).jaxpr)
  assert counted == pytest.approx(b * h * length * cost_model.favor_flops(d, m, chunk), rel=1e-6)


def test_exact_flops_equal_the_products_of_softmax_attention():
  b, length, h, d = 1, 48, 2, 16
  q = jnp.zeros((b, length, h, d))
  counted = _dot_flops(jax.make_jaxpr(lambda q: core.softmax_attention(q, q, q, causal=True))(q).jaxpr)
  assert counted == pytest.approx(b * h * length * cost_model.exact_full_flops(length, d), rel=1e-6)
  assert cost_model.flash_flops(length, d) == cost_model.exact_full_flops(length, d) / 2  # causal blocks skipped


def test_the_table_is_a_roofline_with_its_crossovers_and_the_h200_measurements(tmp_path):
  cost_model.main(["--out", str(tmp_path)])
  t = json.loads((tmp_path / "cost_model.json").read_text())
  assert "PREDICTIONS" in t["label"] and "PREDICTIONS" in (tmp_path / "cost_model.md").read_text()
  for r in t["rows"]:
    chip = cost_model.CHIPS[r["chip"]]
    tokens = 8 * r["seq_len"]
    assert r["predicted_s"] == pytest.approx(max(tokens * r["flops_per_token"] / chip["flops"],
                                                 tokens * r["bytes_per_token"] / chip["hbm"]))
  measured = [r for r in t["rows"] if r["measured_s"] is not None]
  assert {r["chip"] for r in measured} == {"h200"} and len(measured) >= 8
  shape = cost_model.STUDY
  designs = {f"favor_fused [{label}]": d for label, d in cost_model.designs().items()}
  assert cost_model.OLD_DESIGN in cost_model.designs()  # the design whose features XLA computes keeps its row
  assert {r["method"] for r in t["rows"]} >= {"flash", "favor_xla", "favor_fused"} | set(designs)
  for c in t["crossovers"]:  # faster from the crossover on, slower just below it
    length, design = c["crossover_len"], designs.get(c["method"])
    method = "favor_fused" if design else c["method"]
    faster = lambda n: (cost_model.predict(method, c["chip"], n, passes=c["passes"], design=design,
                                           **shape)["predicted_s"]
                        < cost_model.predict("flash", c["chip"], n, passes=c["passes"], **shape)["predicted_s"])
    assert faster(length) and faster(4 * length) and not faster(int(length / 1.1))
  assert t["step_overhead_margins"] and {m["chip"] for m in t["step_overhead_margins"]} == {"tpu_v5e", "tpu_v5p"}
  for m in t["step_overhead_margins"]:  # at the margin, the prediction with that overhead per step is flash's / k
    flash = cost_model.predict("flash", m["chip"], 16384, passes=m["passes"], **shape)["predicted_s"]
    for k in (3, 1):
      at = cost_model.predict("favor_fused", m["chip"], 16384, passes=m["passes"], design=designs[m["method"]],
                              step_overhead_s=m[f"step_overhead_s_at_{k}x"], **shape)["predicted_s"]
      assert at == pytest.approx(flash / k)


# --- the reader of exported programs ------------------------------------------------------------------------------


def _type_bytes(text: str) -> int:
  """Bytes of ``tensor<4x8xf32>`` read from its text: the independent reference for the reader's MLIR types."""
  *dims, dtype = re.fullmatch(r"tensor<(.*)>", text).group(1).split("x")
  return math.prod(int(n) for n in dims) * {"f32": 4, "bf16": 2, "i32": 4, "i1": 1}[dtype]


def test_program_traffic_counts_the_kernels_and_the_arrays_xla_moves_around_them():
  """A hand-built program: XLA features in a called function, a kernel, a second kernel in the costlier branch of
  a cond, a fallback cond whose cheap branch passes the kernel's result on. Expected bytes counted by hand."""
  kernel = lambda *a: jax.ffi.ffi_call("tpu_custom_call", jax.ShapeDtypeStruct((4, 8), jnp.float32))(*a)

  @jax.jit
  def features(x, p):  # a call: XLA reads x (4·8·2 = 64 B) and p (8·8·4 = 256 B)
    return x.astype(jnp.float32) @ p

  def program(x, p, flag):
    y = kernel(features(x, p), x)  # XLA writes the features (128 B); the kernel reads 128 + 64, writes 128
    y = jax.lax.cond(flag > 0, lambda y: kernel(y), lambda y: y + 0.0, y)  # the kernel's branch: reads 128, writes 128
    return jax.lax.cond(jnp.all(y > -1), lambda y: y, lambda y: jnp.sin(y) * 2 + jnp.cos(y), y) + 1.0

  abstract = (jax.ShapeDtypeStruct((4, 8), jnp.bfloat16), jax.ShapeDtypeStruct((8, 8), jnp.float32),
              jax.ShapeDtypeStruct((), jnp.int32))
  t = programs.program_traffic(jax.jit(program).lower(*abstract).as_text(), large=64)
  assert [k["operands"] for k in t["kernels"]] == [["tensor<4x8xf32>", "tensor<4x8xbf16>"], ["tensor<4x8xf32>"]]
  assert t["kernel_bytes"] == (128 + 64 + 128) + (128 + 128)
  # XLA: reads x, p, flag (4 B) and the second kernel's result (for the fallback's test and the + 1); writes the
  # features and the output
  assert t["xla_bytes"] == 64 + 256 + 4 + 128 + 128 + 128
  assert t["total_bytes"] == t["kernel_bytes"] + t["xla_bytes"] and t["large_arrays"] == ["tensor<8x8xf32>"]


@pytest.mark.slow
def test_the_exported_fused_kernels_traffic_is_their_operands_and_results():
  """``favor_attention(..., causal_method="pallas")`` exported for TPU at a small shape (whatever its kernels'
  design): kernels in both programs, each kernel's bytes the sum of its types' bytes, the gradient program moving
  more than the forward, and per-token bytes that do not depend on L (the linear pass's traffic is O(L); a
  row's constant terms, the projection it reads and its per-row gradient, are amortised to a few percent from
  L=512 at this small shape)."""
  shape = dict(batch=1, heads=2, head_dim=16, num_features=32)
  short, long = (programs.export_traffic(n, **shape) for n in (512, 1024))
  for passes in ("fwd", "fwd_bwd"):
    kernels = short[passes]["kernels"]
    assert kernels and all(k["bytes"] == sum(map(_type_bytes, k["operands"] + k["results"])) for k in kernels)
    tokens = shape["batch"] * shape["heads"] * 512
    assert short[passes]["kernel_bytes_per_token"] == sum(k["bytes"] for k in kernels) / tokens
    assert short[passes]["bytes_per_token"] == pytest.approx(long[passes]["bytes_per_token"], rel=0.05)
    assert short[passes]["flops_per_token"] >= short[passes]["kernel_flops_per_token"] > 0
    # grid steps (read from the jaxpr): each Mosaic call of the program (read from its StableHLO) walks every
    # sequence-head row's L/C chunks once, C = 128 rows when compiled for TPU, S of them per step (L=512: 4
    # chunks, one step; L=1024: 8, two steps of four)
    c = fused_tpu.chunk_rows(64, interpret=False)
    for n, read in ((512, short), (1024, long)):
      steps = shape["batch"] * shape["heads"] * (n // c) // fused_tpu.step_chunks(n // c)
      assert read[passes]["grid_steps_per_token"] * shape["batch"] * shape["heads"] * n == len(kernels) * steps
      assert steps == shape["batch"] * shape["heads"] * n // 512  # four chunks of 128 rows per step
  assert short["fwd_bwd"]["kernel_bytes_per_token"] > short["fwd"]["kernel_bytes_per_token"]


def test_jaxpr_flops_counts_a_kernel_body_per_grid_step_and_the_platforms_branch():
  """A Pallas kernel of one [8, 16]·[16, 8] product per grid step on a grid of 3, beside an XLA product; a
  conditional's branches: the fallback's products are not the fast path's."""
  from jax.experimental import pallas as pl

  def body(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] @ y_ref[...]

  kernel = pl.pallas_call(body, grid=(3,), in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0)),
                                                    pl.BlockSpec((16, 8), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((8, 8), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((24, 8), jnp.float32), interpret=True)

  def program(x, y):
    out = kernel(x, y) @ jnp.ones((8, 4))  # XLA: 2·24·8·4
    return jax.lax.cond(jnp.all(out > 0), lambda o: o, lambda o: o @ jnp.ones((4, 4)), out)  # the fallback: 2·24·4·4

  abstract = (jax.ShapeDtypeStruct((24, 16), jnp.float32), jax.ShapeDtypeStruct((16, 8), jnp.float32))
  counted = programs.jaxpr_flops(jax.make_jaxpr(program)(*abstract).jaxpr)
  assert counted["kernel"] == 3 * 2 * 8 * 16 * 8 and counted["xla"] == 2 * 24 * 8 * 4 and counted["kernels"] == 1
  assert counted["steps"] == 3  # the kernel's grid
  repeated = lambda x, y: jax.lax.scan(lambda c, _: (c, kernel(x, y)), None, length=4)[1]
  assert programs.jaxpr_flops(jax.make_jaxpr(repeated)(*abstract).jaxpr)["steps"] == 4 * 3  # a scan's steps times
