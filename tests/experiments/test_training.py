"""Training experiments: tasks, model, train step, config checks, checkpoints that resume exactly."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import main, tasks
from experiments.configs import backward_compat as backward_compat_config
from experiments.configs import common
from experiments.configs import listops as listops_config
from experiments.configs import mqar as mqar_config
from experiments.configs import tiny as tiny_config
from experiments.tasks import listops, mqar, shakespeare
from experiments.train import models, sweep, training

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXCERPT = os.path.join(REPO, "tests", "data", "shakespeare")


def tiny(config=None, **fields):
  """A seconds-sized MQAR config (or ``config`` shrunk) with dotted-field overrides."""
  config = tiny_config.shrink(config) if config is not None else tiny_config.get_config()
  return common.set_fields(config, fields)


# --- tasks -------------------------------------------------------------------------------------------


def test_mqar_answers_are_the_values_bound_to_the_queried_keys():
  b = mqar.sample(np.random.default_rng(0), 16, 64, 6, 128, 0.01, random_non_queries=False)
  assert b.tokens.shape == b.targets.shape == b.weights.shape == (16, 64)
  for tokens, targets, weights in zip(b.tokens, b.targets, b.weights):
    binding = dict(zip(tokens[0:12:2], tokens[1:12:2]))
    assert len(binding) == 6 and all(1 <= k < 64 <= v < 128 for k, v in binding.items())
    answer_positions = np.flatnonzero(weights)
    assert len(answer_positions) == 6 and answer_positions.min() >= 12
    queried = tokens[answer_positions]
    assert sorted(queried) == sorted(binding)  # every key queried exactly once
    assert all(targets[p] == binding[tokens[p]] for p in answer_positions)


def test_mqar_stream_is_a_pure_function_of_position():
  config = tiny()
  a, b = tasks.make_task(config), tasks.make_task(config)
  np.testing.assert_array_equal(a.train_batch(7).tokens, b.train_batch(7).tokens)
  assert not np.array_equal(a.train_batch(7).tokens, a.train_batch(8).tokens)
  assert not np.array_equal(a.train_batch(0).tokens, a.eval_batches[0].tokens)


def _evaluate_listops(ids):
  """An evaluator independent of the generator: a stack machine over the token ids."""
  names = {v: k for k, v in listops.VOCAB.items()}
  stack = []
  for token in (names[i] for i in ids if i):
    if token == "]":
      args = []
      while not isinstance(stack[-1], str):
        args.append(stack.pop())
      stack.append(listops.apply(stack.pop(), args[::-1]))
    else:
      stack.append(int(token) if token.isdigit() else token)
  assert len(stack) == 1
  return stack[0]


def test_listops_labels_match_an_independent_evaluator():
  data = listops_config.get_config("quick").data
  tokens_NL, labels_N = listops.dataset(3, 64, data)
  lengths = (tokens_NL > 0).sum(1)
  assert lengths.min() >= data.min_length and lengths.max() <= data.max_length
  assert [_evaluate_listops(row) for row in tokens_NL] == list(labels_N)
  assert len(set(labels_N)) > 3
  assert listops.apply("[MED", [1, 2, 7, 9]) == 4 and listops.apply("[SM", [7, 8]) == 5


def test_shakespeare_splits_by_play_and_checks_the_archive_hash(tmp_path):
  config = tiny(mqar_config.get_config())
  config.task = "shakespeare"
  config.data = shakespeare_data(seq_len=32)
  task = tasks.make_task(config)
  valid = open(os.path.join(EXCERPT, "tempest.txt"), "rb").read()
  for b in task.eval_batches:
    for row in b.tokens:
      assert bytes(row.astype(np.uint8)) in valid
  np.testing.assert_array_equal(b.targets[:, :-1], b.tokens[:, 1:])
  (tmp_path / shakespeare.ARCHIVE).write_bytes(b"not the archive")
  with pytest.raises(ValueError, match="sha256"):
    shakespeare.fetch(str(tmp_path))


def shakespeare_data(seq_len):
  import ml_collections
  return ml_collections.ConfigDict(dict(seq_len=seq_len, text_dir=EXCERPT, valid_plays=("tempest",),
                                        num_eval_batches=2))


# --- model -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["softmax", "favor"])
@pytest.mark.parametrize("positions,short_conv", [("learned", 0), ("rotary", 0), ("rotary", 4)])
def test_language_model_is_causal(attention, positions, short_conv):
  config = tiny(**{"attention.type": attention, "model.positions": positions, "model.short_conv": short_conv})
  model = models.make_model(config, vocab_size=64, num_classes=0, max_len=32)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 32), 1, 64)
  variables = jax.jit(model.init)(jax.random.PRNGKey(1), tokens)
  changed = tokens.at[:, 20:].set((tokens[:, 20:] + 7) % 64)
  apply = jax.jit(model.apply)
  a, b = apply(variables, tokens), apply(variables, changed)
  np.testing.assert_allclose(a[:, :20], b[:, :20], atol=1e-6)
  assert np.abs(a[:, 20:] - b[:, 20:]).max() > 1e-3


def test_softmax_and_favor_models_share_the_parameter_tree():
  shapes = {}
  for attention in ("softmax", "favor"):
    model = models.make_model(tiny(**{"attention.type": attention}), 64, 0, 32)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32))
    shapes[attention] = jax.tree.map(lambda x: x.shape, variables["params"])
  assert shapes["softmax"] == shapes["favor"]


@pytest.mark.slow
def test_classifier_is_unchanged_by_extra_padding():
  config = tiny(**{"attention.type": "favor"})
  model = models.make_model(config, vocab_size=16, num_classes=10, max_len=32)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 24), 1, 16).at[:, 10:].set(0)
  variables = jax.jit(model.init)(jax.random.PRNGKey(1), tokens)
  apply = jax.jit(model.apply)
  out = apply(variables, tokens)
  assert out.shape == (2, 10)
  padded = jnp.pad(tokens, ((0, 0), (0, 8)))
  np.testing.assert_allclose(apply(variables, padded), out, atol=1e-5)
  assert np.abs(apply(variables, tokens.at[:, 3].set(9)) - out).max() > 1e-4


# --- training ----------------------------------------------------------------------------------------

# Losses on batch 0 of tiny() with FAVOR (jax 0.10.2, CPU, f32): before and after one AdamW step.
GOLDEN_LOSSES = (4.883197, 4.452366)


@pytest.mark.slow
def test_one_train_step_golden_value():
  config = tiny(**{"attention.type": "favor"})
  task = tasks.make_task(config)
  model = models.make_model(config, task.vocab_size, task.num_classes, task.max_len)
  optimizer = training.make_optimizer(config.train)
  state = training.init_state(config, model, task, optimizer)
  state = training.make_train_step(model, optimizer, 0, jax.random.PRNGKey(9))(state, task.train_batch(0))
  assert int(state.step) == 1 and int(state.data_position) == 1 and int(state.nonfinite_step) == -1
  before = np.asarray(state.sums_3)
  assert before[2] == 8 * 4  # 8 sequences × 4 answers
  logits = jax.jit(model.apply)({"params": state.params, "favor": state.favor}, task.train_batch(0).tokens)
  after = np.asarray(training.metric_sums(logits, task.train_batch(0)))
  losses = (before[0] / before[2], after[0] / after[2])
  assert abs(losses[0] - np.log(64)) < 1.0  # an untrained model is near uniform over the vocabulary
  assert losses[1] < losses[0]  # the step descends on its own batch
  np.testing.assert_allclose(losses, GOLDEN_LOSSES, rtol=1e-4)


@pytest.mark.slow
def test_redraw_follows_the_schedule():
  config = tiny(**{"attention.type": "favor", "attention.redraw_every": 2})
  task = tasks.make_task(config)
  model = models.make_model(config, task.vocab_size, task.num_classes, task.max_len)
  optimizer = training.make_optimizer(config.train)
  state = training.init_state(config, model, task, optimizer)
  step = training.make_train_step(model, optimizer, 2, jax.random.PRNGKey(9))
  projections = [state.favor["block_0"]["attention"]["projection"]]
  for i in range(4):
    state = step(state, task.train_batch(i))
    projections.append(state.favor["block_0"]["attention"]["projection"])
  changed = [not np.array_equal(a, b) for a, b in zip(projections, projections[1:])]
  assert changed == [True, False, True, False]  # redrawn before steps 1 and 3 (step counter 0 and 2)


@pytest.mark.slow
def test_causal_favor_plus_plus_keeps_a_running_rho():
  config = tiny(**{"attention.type": "favor", "attention.kernel": "optimal_positive"})
  task = tasks.make_task(config)
  model = models.make_model(config, task.vocab_size, task.num_classes, task.max_len)
  optimizer = training.make_optimizer(config.train)
  state = training.init_state(config, model, task, optimizer)
  rho0 = np.asarray(state.favor["block_0"]["attention"]["rho"])
  state = training.make_train_step(model, optimizer, 0, jax.random.PRNGKey(9))(state, task.train_batch(0))
  rho1 = np.asarray(state.favor["block_0"]["attention"]["rho"])
  np.testing.assert_array_equal(rho0, 0.0)
  assert np.all(rho1 > 0)


# --- config checks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,message", [
    ("attention.type", "linear", "attention.type must be one of"),
    ("train.steps", -5, "train.steps must be a positive int"),
    ("attention.num_features", 0, "attention.num_features must be a positive int"),
    ("attention.kernel", "gaussian", "attention.kernel must be one of"),
    ("attention.redraw_every", -1, "attention.redraw_every must be a non-negative int"),
    ("model.num_heads", 3, "must be divisible by model.num_heads"),
    ("model.short_conv", -1, "model.short_conv must be an int >= 0"),
    ("data.num_kv_pairs", 20, "leaves no room"),
])
def test_bad_config_values_are_rejected_before_anything_runs(field, value, message, tmp_path, monkeypatch):
  config = tiny(**{"attention.type": "favor"})
  section, leaf = field.split(".")
  config[section][leaf] = value
  monkeypatch.setattr(training, "make_train_step", lambda *a: pytest.fail("compiled despite a bad config"))
  monkeypatch.setattr(tasks, "make_task", lambda *a: pytest.fail("built data despite a bad config"))
  with pytest.raises(ValueError, match=message):
    main.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run" / "run").exists()


def test_softmax_with_redraw_is_rejected_and_bad_variants_are_caught_up_front(tmp_path):
  with pytest.raises(ValueError, match="attention.redraw_every=10 has nothing to redraw: softmax attention"):
    training.check_config(tiny(**{"attention.redraw_every": 10}))
  config = tiny()
  config.variants = (("good", {}), ("bad", {"attention.num_features": -3, "attention.type": "favor"}))
  with pytest.raises(ValueError, match="attention.num_features"):
    sweep.run(config, print, str(tmp_path))
  assert not (tmp_path / "good").exists()  # nothing trained before the bad variant was found
  config.variants = (("typo", {"attention.num_feature": 3}),)
  with pytest.raises(ValueError, match="not a config field"):
    sweep.variant_configs(config)


@pytest.mark.slow
def test_nonfinite_loss_stops_with_the_step(tmp_path):
  config = tiny(**{"train.lr": 1e30, "train.clip_norm": 0.0, "train.log_every": 1})
  with pytest.raises(FloatingPointError, match=r"non-finite loss at step \d+"):
    training.train(config, str(tmp_path), progress=lambda m: None)


# --- kill and resume ---------------------------------------------------------------------------------


def _command(workdir, *overrides):
  return [sys.executable, "-m", "experiments.main", "--config=experiments/configs/mqar.py",
          f"--workdir={workdir}",
          "--config.data.seq_len=32", "--config.data.num_kv_pairs=4", "--config.data.vocab_size=64",
          "--config.data.num_eval_batches=1", "--config.model.d_model=32", "--config.model.num_layers=1",
          "--config.attention.chunk_size=8",
          "--config.train.steps=40", "--config.train.batch_size=4", "--config.train.warmup_steps=5",
          "--config.train.log_every=3", "--config.train.eval_every=10", "--config.train.checkpoint_every=4",
          "--config.only=favor_redraw", "--config.attention.num_features=8",
          "--config.variants=(('favor_redraw', {'attention.type': 'favor', 'attention.redraw_every': 7}),)",
          *overrides]


def _metrics(workdir):
  with open(os.path.join(workdir, "favor_redraw", "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in training.TIMING_FIELDS} for line in f]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_metrics(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  reference, resumed = tmp_path / "reference", tmp_path / "resumed"
  subprocess.run(_command(reference), cwd=REPO, env=env, check=True, capture_output=True)
  config = json.load(open(reference / "config.json"))["config"]
  assert config["train"]["steps"] == 40 and config["attention"]["num_features"] == 8  # overrides applied
  assert config["quick"] is False  # config.json records which version ran
  proc = subprocess.Popen(_command(resumed), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  metrics = resumed / "favor_redraw" / "metrics.jsonl"
  deadline = time.time() + 120
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and sum(1 for _ in open(metrics)) >= 8:  # past a few checkpoints
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_at = _metrics(resumed)[-1]["step"]
  assert 0 < killed_at < 40
  subprocess.run(_command(resumed), cwd=REPO, env=env, check=True, capture_output=True)
  assert _metrics(resumed) == _metrics(reference)


# --- studies -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_backward_compat_swaps_attention_under_the_same_weights(tmp_path):
  config = tiny(backward_compat_config.get_config())
  config.data = shakespeare_data(seq_len=32)
  config.finetune.update(steps=2, warmup_steps=1, eval_every=1)
  config.variants = (("favor_positive", {}), ("softmax_control", {"attention.type": "softmax"}))
  favor, control = main.run(config, str(tmp_path))
  assert favor["pretrain_steps"] == 6 and favor["finetune_steps"] == 2
  # the control keeps softmax attention: right after the "swap" it is the pretrained model exactly
  assert control["after_swap_eval_loss"] == control["softmax_eval_loss"]
  assert favor["after_swap_eval_loss"] != favor["softmax_eval_loss"]
  assert np.isfinite(favor["after_finetune_eval_loss"])
  assert os.path.exists(tmp_path / "backward_compat.png") and os.path.exists(tmp_path / "summary.md")


@pytest.mark.slow
def test_quick_version_yields_to_command_line_overrides(tmp_path):
  overrides = {"train.steps": 3, "data.num_train": 16, "data.num_eval": 8, "model.d_model": 16,
               "only": "favor_positive", "train.warmup_steps": 1}
  config = common.set_fields(listops_config.get_config("quick"), overrides)  # --config=listops.py:quick ...
  records = main.run(config, str(tmp_path), overrides)
  assert [r["name"] for r in records] == ["favor_positive"] and records[0]["steps"] == 3
  saved = json.load(open(tmp_path / "config.json"))["config"]
  assert saved["data"]["max_length"] == 96 and saved["model"]["d_model"] == 16  # quick size + overrides
  assert saved["quick"] is True


def _cli(workdir, config_arg, *flags):
  cmd = [sys.executable, "-m", "experiments.main", f"--config={config_arg}", f"--workdir={workdir}", *flags]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_quick_flag_and_quick_argument_run_the_same_config(tmp_path):
  small = {"only": "softmax", "train.steps": 2, "train.warmup_steps": 1, "model.d_model": 16,
           "model.num_layers": 1, "data.seq_len": 32, "data.num_kv_pairs": 4}
  flags = [f"--config.{field}={value}" for field, value in small.items()]
  by_arg = _cli(tmp_path / "arg", "experiments/configs/mqar.py:quick", *flags)
  by_flag = _cli(tmp_path / "flag", "experiments/configs/mqar.py", "--config.quick=True", *flags)
  assert by_arg.returncode == 0 and by_flag.returncode == 0, by_arg.stderr[-2000:] + by_flag.stderr[-2000:]
  configs = [json.load(open(tmp_path / d / "config.json"))["config"] for d in ("arg", "flag")]
  assert configs[0] == configs[1]
  expected = common.set_fields(mqar_config.get_config("quick"), small).to_dict()
  assert configs[0] == json.loads(json.dumps(expected))  # the quick sizes, then the command line
  assert configs[0]["quick"] is True and configs[0]["train"]["batch_size"] == 32  # quick: 32, full: 64


def test_quick_that_cannot_take_effect_stops(tmp_path, monkeypatch):
  monkeypatch.setattr(tasks, "make_task", lambda *a: pytest.fail("built data despite a bad config"))
  changed = mqar_config.get_config()
  changed.model.d_model = 16  # changed in code, not on the command line: no full version to rebuild from
  changed.quick = True
  with pytest.raises(ValueError, match=r"config.quick=True, but .* none of the values of mqar.py's quick"):
    main.run(changed, str(tmp_path / "changed"))
  undo = common.set_fields(mqar_config.get_config("quick"), {"quick": False})
  with pytest.raises(ValueError, match=r"--config.quick=False would not undo --config=mqar.py:quick"):
    main.run(undo, str(tmp_path / "undo"), {"quick": False})
  with pytest.raises(ValueError, match=r"takes 'quick' or nothing after ':'.*got 'fast'"):
    mqar_config.get_config("fast")
  assert not os.listdir(tmp_path)  # stopped before anything was written


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mqar", "listops", "shakespeare", "quickstart", "backward_compat", "tiny"])
def test_every_training_config_and_variant_passes_the_checks(name):
  import importlib
  module = importlib.import_module(f"experiments.configs.{name}")
  for config in (module.get_config(), module.get_config("quick")):
    assert sweep.variant_configs(config)  # each variant checked; raises on a bad field or value


@pytest.mark.slow
def test_quickstart_quick_version_runs_on_the_excerpt(tmp_path):
  from experiments.configs import quickstart
  overrides = {"data.text_dir": EXCERPT, "data.valid_plays": ("tempest",), "data.seq_len": 32,
               "model.d_model": 32, "model.num_layers": 1}
  config = common.set_fields(quickstart.get_config("quick"), overrides)
  records = main.run(config, str(tmp_path), overrides)
  assert [r["name"] for r in records] == ["softmax", "favor_positive"]
  assert all(np.isfinite(r["eval_bpc"]) and r["eval_bpc"] < 8 for r in records)  # learnt in 20 steps
  assert "eval_bpc ratio run / softmax" in open(tmp_path / "summary.md").read()
