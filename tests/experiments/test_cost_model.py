"""The cost model (experiments/studies/cost_model.py): its FLOP formulas against a direct count of the matrix products
in the programs they describe (walked in the jaxpr: every dot_general, times its loop's trip count, the
costlier branch of a cond), and the table it writes."""

import json
import math

import jax
import jax.extend
import jax.numpy as jnp
import pytest

from experiments.studies import cost_model
from favor_jax import core


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
  for c in t["crossovers"]:  # faster from the crossover on, slower just below it
    length = c["crossover_len"]
    faster = lambda n: (cost_model.predict(c["method"], c["chip"], n, passes=c["passes"], **shape)["predicted_s"]
                        < cost_model.predict("flash", c["chip"], n, passes=c["passes"], **shape)["predicted_s"])
    assert faster(length) and faster(4 * length) and not faster(int(length / 1.1))
