"""Training a language model on your data (issue 47): the text task over a file, a folder and a token file,
gradient accumulation, bfloat16, the FLOPs count, SIGTERM's checkpoint and exact resume, lm_base.py:quick."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import tasks
from experiments.configs import common, lm_base, text
from experiments.train import flops, models, steps, training

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ("the", "king", "queen", "speaks", "to", "a", "fool", "and", "his", "crown", "falls", "now")


def _prose(seed: int, words: int) -> bytes:
  """Lines of words from a small vocabulary: text a tiny model learns something of in a few dozen steps."""
  rng = np.random.default_rng(seed)
  chosen = rng.choice(len(WORDS), words)
  return (" ".join(WORDS[i] for i in chosen) + "\n").encode()


def _tiny(path="", **fields):
  """The text config shrunk to seconds: 1 × 32, windows of 32 bytes, FAVOR+ with a forget gate."""
  config = text.get_config("quick")
  config.data.update(path=str(path), seq_len=32, num_eval_batches=1)
  config.model.update(d_model=32, num_layers=1, num_heads=2, mlp_dim=64)
  config.attention.update(num_features=16, window=0, chunk_size=8)
  config.train.update(steps=6, batch_size=8, warmup_steps=1, log_every=2, eval_every=6, checkpoint_every=6)
  return common.set_fields(config, fields)


# --- the text task ------------------------------------------------------------------------------------------


def _occurs(row: np.ndarray, corpus: np.ndarray) -> bool:
  """Whether ``row`` is a contiguous run of ``corpus`` (brute force: the independent reference)."""
  view = np.lib.stride_tricks.sliding_window_view(corpus, len(row))
  return bool((view == row).all(-1).any())


def test_a_folder_is_split_by_file_and_packed_by_file(tmp_path):
  for i, name in enumerate(("a.txt", "b.txt", "held.txt")):
    (tmp_path / name).write_bytes(_prose(i, 60))
  task = tasks.make_task(_tiny(tmp_path, **{"data.valid_files": ("held.txt",)}))
  held = np.frombuffer((tmp_path / "held.txt").read_bytes(), np.uint8)
  train = np.frombuffer((tmp_path / "a.txt").read_bytes() + (tmp_path / "b.txt").read_bytes(), np.uint8)
  assert task.vocab_size == 256 and "held.txt" in task.split
  for b in task.eval_batches:  # held-out windows come from the held-out file only
    assert all(_occurs(np.append(r, t[-1]), held) for r, t in zip(b.tokens, b.targets))
  crossing = [p for p in range(20) if task.train_batch(p).segment_ids.any()]
  assert crossing  # some windows reach into b.txt
  batch = task.train_batch(crossing[0])
  np.testing.assert_array_equal(batch.targets[:, :-1], batch.tokens[:, 1:])
  boundary = len((tmp_path / "a.txt").read_bytes())  # a.txt's bytes, then b.txt's: one document each
  for row, seg, w, t in zip(batch.tokens, batch.segment_ids, batch.weights, batch.targets):
    full = np.append(row, t[-1])
    assert _occurs(full, train)
    starts = [o for o in range(len(train) - len(full) + 1) if (train[o:o + len(full)] == full).all()]
    expected = (np.arange(len(full)) + starts[0] >= boundary).astype(int)
    np.testing.assert_array_equal(seg != seg[0], expected[:-1] != expected[0])  # a new id where b.txt begins
    np.testing.assert_array_equal(w, (expected[1:] == expected[:-1]).astype(np.float32))
  # (seed, position) alone decides a batch
  again = tasks.make_task(_tiny(tmp_path, **{"data.valid_files": ("held.txt",)}))
  np.testing.assert_array_equal(again.train_batch(crossing[0]).tokens, batch.tokens)
  assert not np.array_equal(task.train_batch(crossing[0] + 1).tokens, batch.tokens)


def test_one_file_holds_out_its_last_fraction(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_bytes(_prose(0, 400))
  task = tasks.make_task(_tiny(path, **{"data.valid_fraction": 0.25, "data.pack": False}))
  corpus = np.frombuffer(path.read_bytes(), np.uint8)
  cut = len(corpus) - int(len(corpus) * 0.25)
  assert all(_occurs(np.append(r, t[-1]), corpus[cut:]) for b in task.eval_batches for r, t in zip(b.tokens, b.targets))
  for position in range(5):
    b = task.train_batch(position)
    assert b.segment_ids is None
    assert all(_occurs(np.append(r, t[-1]), corpus[:cut]) for r, t in zip(b.tokens, b.targets))


@pytest.mark.parametrize("kind", ["npy", "uint32"])
def test_a_token_file_gives_windows_of_its_tokens(tmp_path, kind):
  tokens = np.random.default_rng(1).integers(0, 1000, 5000).astype(np.uint32)
  tokens[::97] = 7  # an end-of-document id
  path = tmp_path / ("tokens.npy" if kind == "npy" else "tokens.bin")
  np.save(path, tokens) if kind == "npy" else tokens.astype("<u4").tofile(path)
  fields = {"data.path": "", "data.token_file": str(path), "data.document_separator": 7, "data.valid_fraction": 0.1}
  if kind == "uint32":
    fields.update({"data.token_dtype": "uint32", "data.vocab_size": 1000})
  task = tasks.make_task(_tiny(**fields))
  assert task.vocab_size == (1000 if kind == "uint32" else int(tokens.max()) + 1)
  cut = len(tokens) - 500
  b = task.train_batch(0)
  for row, target, seg, w in zip(b.tokens, b.targets, b.segment_ids, b.weights):
    full = np.append(row, target[-1])
    assert _occurs(full, tokens[:cut])
    ends = np.cumsum(np.append(0, full[:-1] == 7))  # a document ends after each 7
    np.testing.assert_array_equal(seg != seg[0], ends[:-1] != ends[0])
    np.testing.assert_array_equal(w, (ends[1:] == ends[:-1]).astype(np.float32))
  assert all(_occurs(np.append(r, t[-1]), tokens[cut:]) for r, t in zip(task.eval_batches[0].tokens,
                                                                         task.eval_batches[0].targets))


def test_bad_text_input_names_the_field(tmp_path):
  raw = tmp_path / "t.bin"
  np.arange(100, dtype="<u2").tofile(raw)
  with pytest.raises(ValueError, match="data.vocab_size"):
    tasks.make_task(_tiny(**{"data.token_file": str(raw)}))
  with pytest.raises(ValueError, match="outside data.vocab_size=50"):
    tasks.make_task(_tiny(**{"data.token_file": str(raw), "data.vocab_size": 50}))
  with pytest.raises(ValueError, match="give one of them"):
    tasks.make_task(_tiny(tmp_path, **{"data.token_file": str(raw)}))
  (tmp_path / "a.txt").write_bytes(b"x" * 200)
  with pytest.raises(ValueError, match=r"data.valid_files names \['nope.txt'\]"):
    tasks.make_task(_tiny(tmp_path, **{"data.valid_files": ("nope.txt",)}))
  with pytest.raises(ValueError, match="data.token_dtype"):
    training.check_config(_tiny(tmp_path, **{"data.token_dtype": "int8"}))


# --- the train step -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_four_microbatches_give_the_whole_batch_gradient(tmp_path):
  """SGD with lr 1 moves the parameters by minus the gradient: 4 microbatches' update equals the gradient of the
  whole batch's weighted mean loss, computed directly (the packed batch's weights differ between microbatches,
  so an average of microbatch means would not)."""
  (tmp_path / "a.txt").write_bytes(_prose(0, 300))
  (tmp_path / "b.txt").write_bytes(_prose(1, 300))
  config = _tiny(tmp_path, **{"data.valid_fraction": 0.3})
  task = tasks.make_task(config)
  model = models.make_model(config, task.vocab_size, 0, task.max_len)
  state = steps.init_state(config, model, task, optax.sgd(1.0))
  batch = task.train_batch(1)
  # Loss weights of 0 and 1 (as packing's boundaries give), more of them 0 in some microbatches than others.
  weights = (np.random.default_rng(0).random(batch.weights.shape) < np.linspace(0.2, 0.9, 8)[:, None])
  batch = batch._replace(weights=(weights * batch.weights).astype(np.float32))
  assert len(set(batch.weights.reshape(2, 4, -1).swapaxes(0, 1).sum((1, 2)))) == 4  # microbatch i: rows i, i + 4
  favor = state.favor

  def mean_loss(params):
    logits = model.apply({"params": params, "favor": favor}, batch.tokens, segment_ids=batch.segment_ids)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets)
    return (ce * batch.weights).sum() / batch.weights.sum()

  expected = jax.jit(jax.grad(mean_loss))(state.params)
  step = steps.make_train_step(model, optax.sgd(1.0), 0, jax.random.PRNGKey(0), accum_steps=4)
  moved = jax.tree.map(lambda a, b: a - b, state.params, step(state, batch).params)
  for got, want in zip(jax.tree.leaves(moved), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-7)


@pytest.mark.slow
def test_remat_changes_no_gradient(tmp_path):
  (tmp_path / "a.txt").write_bytes(_prose(0, 300))
  config = _tiny(tmp_path)
  task = tasks.make_task(config)
  batch = task.train_batch(0)
  updated = []
  for remat in ("none", "block"):
    config.model.remat = remat
    model = models.make_model(config, task.vocab_size, 0, task.max_len)
    state = steps.init_state(config, model, task, optax.sgd(1.0))
    updated.append(steps.make_train_step(model, optax.sgd(1.0), 0, jax.random.PRNGKey(0))(state, batch).params)
  for a, b in zip(*map(jax.tree.leaves, updated)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_bfloat16_trains_within_a_few_percent_of_float32(tmp_path):
  (tmp_path / "a.txt").write_bytes(_prose(0, 2000))
  losses = {}
  for dtype in ("float32", "bfloat16"):
    config = _tiny(tmp_path / "a.txt", **{"model.dtype": dtype, "train.steps": 40, "train.eval_every": 40,
                                "train.log_every": 20, "train.checkpoint_every": 40, "train.lr": 3e-3})
    records, state = training.train(config, str(tmp_path / dtype), progress=lambda m: None)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))  # parameters stay float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.opt_state) if hasattr(x, "dtype")
               and jnp.issubdtype(x.dtype, jnp.floating))
    losses[dtype] = [r["eval_loss"] for r in records if r["kind"] == "eval"]
  assert losses["float32"][-1] < 0.8 * losses["float32"][0]  # it learned something
  assert losses["bfloat16"][-1] != losses["float32"][-1]  # the dtype took effect
  assert abs(losses["bfloat16"][-1] / losses["float32"][-1] - 1) < 0.03, losses


@pytest.mark.slow
def test_bfloat16_computes_in_bfloat16_with_float32_logits(tmp_path):
  (tmp_path / "a.txt").write_bytes(_prose(0, 300))
  config = _tiny(tmp_path, **{"model.dtype": "bfloat16"})
  model = models.make_model(config, 256, 0, 32)
  tokens = jnp.zeros((1, 32), jnp.int32)
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)
  logits, inter = jax.jit(lambda v, x: model.apply(v, x, capture_intermediates=True))(variables, tokens)
  assert inter["intermediates"]["block_0"]["mlp_in"]["__call__"][0].dtype == jnp.bfloat16
  assert logits.dtype == jnp.float32


# --- FLOPs and MFU --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["softmax", "favor"])
def test_flops_per_token_match_the_compiled_forward_pass(attention):
  """The formula against XLA's own count of the compiled forward pass (matmul-heavy sizes, where elementwise
  work is a small share)."""
  config = _tiny(**{"attention.type": attention, "model.d_model": 256, "model.num_heads": 4, "model.mlp_dim": 1024,
                    "attention.forget_gate": False, "data.pack": False, "attention.num_features": 64,
                    "attention.chunk_size": 32})
  length, batch = 128, 2
  model = models.make_model(config, 256, 0, length)
  tokens = jnp.zeros((batch, length), jnp.int32)
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)
  counted = jax.jit(model.apply).lower(variables, tokens).compile().cost_analysis()
  counted = counted[0] if isinstance(counted, list) else counted
  formula = flops.flops_per_token(config, 256, length)["forward"] * batch * length
  assert 0.97 < counted["flops"] / formula < 1.06, (counted["flops"], formula)  # 1.012 and 1.021 measured


# --- preemption -------------------------------------------------------------------------------------------------


def _run_command(workdir, token_file, steps):
  fields = dict(token_file=token_file, vocab_size=64, token_dtype="uint16", seq_len=32, num_eval_batches=1)
  flags = [f"--config.data.{k}={v}" for k, v in fields.items()]
  flags += [f"--config.model.{k}={v}" for k, v in dict(d_model=32, num_layers=1, num_heads=2, mlp_dim=64).items()]
  flags += [f"--config.attention.{k}={v}" for k, v in dict(num_features=16, window=0, chunk_size=8).items()]
  flags += [f"--config.train.{k}={v}" for k, v in dict(steps=steps, batch_size=4, warmup_steps=1, log_every=1,
                                                        eval_every=steps, checkpoint_every=steps).items()]
  return [sys.executable, "-m", "experiments.main", "--config=experiments/configs/text.py", f"--workdir={workdir}",
          *flags]


def _losses(workdir):
  with open(os.path.join(workdir, "run", "metrics.jsonl")) as f:
    return [(r["step"], r.get("train_loss"), r.get("eval_loss")) for r in map(json.loads, f)]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_resumed_run_is_the_same(tmp_path):
  """A token-file run sent SIGTERM mid-run exits 143 with a checkpoint at the step it reached (none other is due);
  rerun, it finishes with the losses of an uninterrupted run."""
  token_file = tmp_path / "tokens.bin"
  np.random.default_rng(0).integers(0, 64, 20000).astype("<u2").tofile(token_file)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  steps_ = 300  # far more than run before the signal lands (it is sent at the first train record)
  reference, resumed = tmp_path / "reference", tmp_path / "resumed"
  proc = subprocess.Popen(_run_command(resumed, token_file, steps_), cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  metrics = resumed / "run" / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and any('"train"' in line for line in open(metrics)):
      break
    time.sleep(0.02)
  proc.send_signal(signal.SIGTERM)
  output = proc.communicate(timeout=120)[0]
  assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
  saved = sorted(int(d) for d in os.listdir(resumed / "run" / "checkpoints") if d.isdigit())
  stopped_at = _losses(resumed)[-1][0]
  assert saved == [stopped_at] and 0 < stopped_at < steps_, (saved, stopped_at)
  assert f"SIGTERM: saved a checkpoint of {resumed / 'run'} at step {stopped_at}" in output
  done = subprocess.run(_run_command(resumed, token_file, steps_), cwd=REPO, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  subprocess.run(_run_command(reference, token_file, steps_), cwd=REPO, env=env, check=True, capture_output=True)
  assert _losses(resumed) == _losses(reference)
  assert len(_losses(reference)) == steps_ + 2  # a train record per step, evaluations at 0 and the end


# --- lm_base.py ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lm_base_quick_trains_and_reports_throughput(tmp_path):
  (tmp_path / "a.txt").write_bytes(_prose(0, 600))
  config = lm_base.get_config("quick")
  config.data.path = str(tmp_path / "a.txt")
  training.check_config(config)
  records, state = training.train(config, str(tmp_path / "run"), progress=lambda m: None)
  trains = [r for r in records if r["kind"] == "train"]
  final = [r for r in records if r["kind"] == "eval"][-1]
  assert len(trains) == 2 and all(math.isfinite(r["train_loss"]) for r in trains)
  # a CPU has no published peak: the fraction is of a measured matmul, named and labelled so
  mfu = "mfu" if jax.devices()[0].platform != "cpu" else "mfu_vs_measured_matmul"
  assert all(r["tokens_per_s"] > 0 and 0 < r[mfu] < 1 and r["ceiling_flops_per_s"] > 0 for r in trains)
  assert all(r["ceiling_kind"] == (flops.PUBLISHED if mfu == "mfu" else flops.MEASURED) for r in trains)
  assert trains[0]["flops_per_token"] == flops.flops_per_token(config, 256, 64)["train"]
  assert math.isfinite(final["eval_loss_at_128"])  # the long-context evaluation


@pytest.mark.slow
def test_lm_base_is_the_size_its_docstring_says():
  config = lm_base.get_config()
  training.check_config(config.copy_and_resolve_references())
  model = models.make_model(config, 256, 0, config.data.seq_len)
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))
  assert 84e6 < count < 87e6  # "85M parameters with bytes"
  assert (config.model.d_model, config.model.num_layers, config.model.dtype) == (768, 12, "bfloat16")
  assert 4096 <= config.data.seq_len <= 8192 and config.mesh.data == -1 and config.mesh.fsdp  # every chip
