"""Forget gates, packed batches and length extrapolation in the training stack (issue 40)."""

import json
import os

import jax
import numpy as np
import pytest

from experiments import main, tasks
from experiments.configs import common
from experiments.configs import forgetting as forgetting_config
from experiments.configs import listops as listops_config
from experiments.configs import tradeoff as tradeoff_config
from experiments.tasks import shakespeare
from experiments.train import models, steps, training

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXCERPT = os.path.join(REPO, "tests", "data", "shakespeare")


def quick(**fields):
  config = forgetting_config.get_config("quick")
  config.data.update(text_dir=EXCERPT, valid_plays=("tempest",))
  return common.set_fields(config, fields)


def test_packed_windows_carry_the_play_as_segment_and_skip_the_crossing_target():
  data = quick().data
  data.update(seq_len=64, eval_lengths=(256,))
  task = shakespeare.make_task(data, batch_size=64, seed=0)
  texts = shakespeare.plays(EXCERPT)
  first = texts[[n for n in texts if n != "tempest"][0]] + b"\n\n"  # the separator belongs to the play before
  crossing = 0
  for position in range(30):
    b = task.train_batch(position)
    assert b.segment_ids.shape == b.tokens.shape and set(np.unique(b.segment_ids)) <= {0, 1}
    for row, w, s in zip(b.tokens, b.weights, b.segment_ids):
      cut = np.flatnonzero(s[1:] != s[:-1])  # the weight is 0 exactly on the target in another play
      assert np.flatnonzero(w == 0).tolist() == cut.tolist()
      ones = np.flatnonzero(s == 0)  # the first play's characters are its text's
      if len(ones) and len(cut):
        assert bytes(row[ones].astype(np.uint8)) == first[-len(ones):]
      crossing += len(cut)
  assert crossing > 0  # the excerpt's plays are short enough for some windows to cross a boundary
  assert task.max_len == 256 and [n for n, _ in task.length_evals] == [256]
  (length, held_out), = task.length_evals
  assert all(b.tokens.shape[1] == 256 for b in held_out)
  assert sum(b.tokens.size for b in held_out) == sum(b.tokens.size for b in task.eval_batches)


def _model_and_state(config, max_len):
  model = models.make_model(config, 256, 0, max_len)
  optimizer = training.make_optimizer(config.train)
  task = tasks.Task("t", 256, 0, "eval_bpc", max_len, None, [])
  return model, optimizer, training.init_state(config, model, task, optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("attention,positions", [
    ({"attention.type": "softmax", "attention.forget_gate": True}, "rotary"),
    (common.favor_variant("positive", forget_gate=True, num_features=16), "none"),
    (common.favor_variant("hedgehog", forget_gate=True, alibi=True), "none")])
def test_a_train_step_on_a_packed_batch_is_the_mean_of_the_unpacked_ones(attention, positions):
  config = quick(**attention, **{"model.positions": positions, "train.clip_norm": 0.0})
  n = 8  # two documents of n tokens each (n + 1 with their last target)
  docs = np.random.default_rng(0).integers(1, 256, (2, n + 1)).astype(np.int32)
  packed = tasks.Batch(docs[:, :-1].reshape(1, 2 * n), docs[:, 1:].reshape(1, 2 * n),
                       np.ones((1, 2 * n), np.float32), np.repeat(np.array([[0, 1]], np.int32), n, axis=1))
  apart = tasks.Batch(docs[:, :-1], docs[:, 1:], np.ones((2, n), np.float32), np.zeros((2, n), np.int32))
  model, optimizer, state = _model_and_state(config, 2 * n)
  step = steps.make_train_step(model, optimizer, 0, jax.random.PRNGKey(1))
  after_packed, after_apart = step(state, packed), step(state, apart)
  np.testing.assert_allclose(after_packed.sums_3[0] / 2 / n, after_apart.sums_3[0] / 2 / n, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(after_packed.params), jax.tree.leaves(after_apart.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # and a boundary matters: the same row read as one document gives another step
  joined = step(state, packed._replace(segment_ids=np.zeros((1, 2 * n), np.int32)))
  assert not np.allclose(joined.sums_3[0], after_packed.sums_3[0], rtol=1e-6)


def test_forget_gate_on_a_bidirectional_task_stops_naming_the_field():
  for field in ("attention.forget_gate", "attention.alibi"):
    config = common.set_fields(listops_config.get_config("quick"), {field: True})
    with pytest.raises(ValueError, match=f"{field}=True needs causal attention"):
      training.check_config(config)


@pytest.mark.parametrize("fields,match", [
    ({"model.positions": "learned"}, "data.pack=True needs relative positions"),
    ({"model.positions": "learned", "data.pack": False}, r"data.eval_lengths=\(64,\) needs relative positions"),
    ({"model.short_conv": 4}, "data.pack=True with model.short_conv=4"),
    ({"data.eval_lengths": (64, 0)}, r"data.eval_lengths\[i\] must be a positive int")])
def test_packing_and_extrapolation_checks_name_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    training.check_config(quick(**fields))


@pytest.mark.slow
def test_softmax_reads_the_gate_fields_and_a_gate_changes_the_model():
  config = quick(**{"attention.type": "softmax", "attention.forget_gate": True})
  assert "attention.forget_gate" not in training.unused_fields(config)
  assert "attention.alibi" not in training.unused_fields(config)
  assert "attention.kernel" in training.unused_fields(config)
  params = _model_and_state(config, 32)[2].params
  assert "forget_gate" in params["block_0"]["attention"]


@pytest.mark.slow
def test_quick_study_trains_and_reports_bpc_at_longer_lengths(tmp_path):
  config = quick()
  records = main.run(config, str(tmp_path))
  assert [r["name"] for r in records] == ["softmax_forget_gate", "favor_positive_forget_gate"]
  for r in records:
    assert r["forget_gate"] and r["pack"] and r["positions"] == "none"
    assert np.isfinite(r["eval_bpc"]) and np.isfinite(r["eval_bpc_at_64"])
  summary = (tmp_path / "summary.md").read_text()
  assert "## Length extrapolation" in summary and "| at 64 |" in summary
  assert "softmax + forget gate" in summary
  with open(tmp_path / "favor_positive_forget_gate" / "metrics.jsonl") as f:
    evals = [json.loads(line) for line in f if '"eval"' in line]
  assert "eval_bpc_at_64" in evals[-1] and all("eval_bpc_at_64" not in e for e in evals[:-1])
  # The trade-off figure places the gated runs (no positions: the same parameters run at its long length).
  placed = tradeoff_config.get_config("quick")
  placed.studies = (("forgetting", str(tmp_path)),)
  timed = main.run(placed, str(tmp_path / "tradeoff"))
  assert [(r["name"], r["value"]) for r in timed] == [(r["name"], r["eval_bpc"]) for r in records]
  assert all(r["steps_per_s"] > 0 and r["long_step_s"] > 0 for r in timed)
