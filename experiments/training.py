"""One training run: optax from the config, a jitted pure train step, evaluation, metrics and checkpoints.

Resuming is exact: the checkpoint holds the whole :class:`TrainState` (params,
optimizer state, FAVOR projections and running statistics, step, data
position, the metric sums of the current logging window), batches are a pure
function of their position, and redraws a pure function of the step; so
rerunning the same command after a kill writes the same ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import socket
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import models, tasks
from experiments.configs import common
from favor_jax import core, layers
from favor_jax.layers import linen as favor_linen

TIMING_FIELDS = ("elapsed_s", "steps_per_s")  # the only metrics that differ between identical runs
# tqdm's meter, its rate in steps/s
PROGRESS = "{l_bar}{bar:24}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}]"


class TrainState(NamedTuple):
  step: Any  # int32 []: optimizer steps taken
  data_position: Any  # int32 []: training batches consumed
  params: Any
  favor: Any  # FAVOR projections and running statistics ({} for softmax)
  opt_state: Any
  sums_3: Any  # f32 [3]: Σ w·loss, Σ w·correct, Σ w over the current logging window
  nonfinite_step: Any  # int32 []: first step whose loss was not finite, -1 if none


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


def _count(name: str, value, zero: str) -> None:
  """``value`` is an int >= 0 (not a bool); ``zero`` says what 0 means."""
  _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
         f"{name} must be an int >= 0 (0: {zero}), got {value!r}")


def check_config(config) -> None:
  """Rejects bad values with a message naming the field, before any data or compilation."""
  a, m, t = config.attention, config.model, config.train
  _check(a.type in models.ATTENTION_TYPES,
         f"attention.type must be one of {models.ATTENTION_TYPES}, got {a.type!r}")
  for name, value in (("model.d_model", m.d_model), ("model.num_layers", m.num_layers),
                      ("model.num_heads", m.num_heads), ("model.mlp_dim", m.mlp_dim),
                      ("train.steps", t.steps), ("train.batch_size", t.batch_size),
                      ("train.log_every", t.log_every), ("train.eval_every", t.eval_every),
                      ("train.checkpoint_every", t.checkpoint_every)):
    tasks.positive_int(name, value)
  _count("model.short_conv", m.short_conv, "no short convolution")
  _check(m.positions in models.POSITIONS,
         f"model.positions must be one of {models.POSITIONS}, got {m.positions!r}")
  _check(m.d_model % m.num_heads == 0,
         f"model.d_model {m.d_model} must be divisible by model.num_heads {m.num_heads}")
  _check(m.positions != "rotary" or (m.d_model // m.num_heads) % 2 == 0,
         "rotary positions need an even head dim")
  _check(isinstance(t.seed, int) and not isinstance(t.seed, bool) and 0 <= t.seed < 2**63 - 1,
         f"train.seed must be an int >= 0 (it seeds the parameters, projections and data stream), got {t.seed!r}")
  _check(t.lr > 0 and math.isfinite(t.lr), f"train.lr must be a finite number > 0, got {t.lr}")
  _check(isinstance(t.warmup_steps, int) and 0 <= t.warmup_steps < t.steps,
         f"train.warmup_steps must be an int in [0, train.steps={t.steps}), got {t.warmup_steps!r}")
  _check(t.clip_norm >= 0 and t.weight_decay >= 0, "train.clip_norm and train.weight_decay must be >= 0")
  _check(isinstance(a.redraw_every, int) and a.redraw_every >= 0,
         f"attention.redraw_every must be a non-negative int (0 = never), got {a.redraw_every!r}")
  # FAVOR's fields are checked for softmax runs too: a command-line value applies to every variant of a sweep.
  _check(a.kernel in core.KERNELS,
         f"attention.kernel must be one of {sorted(core.KERNELS)}, got {a.kernel!r}")
  _check(a.projection in layers.PROJECTIONS,
         f"attention.projection must be one of {layers.PROJECTIONS}, got {a.projection!r}")
  tasks.positive_int("attention.num_features", a.num_features)
  _count("attention.window", a.window, "no exact window")
  tasks.positive_int("attention.chunk_size", a.chunk_size)
  _count("attention.qk_head_dim", a.qk_head_dim, "the model's head dim")
  _check(a.type == "favor" or a.qk_head_dim == 0,
         f"attention.qk_head_dim={a.qk_head_dim} is for FAVOR layers; softmax attention uses the model's head dim")
  _check(m.positions != "rotary" or a.qk_head_dim % 2 == 0,
         f"rotary positions need an even attention.qk_head_dim, got {a.qk_head_dim}")
  _check(a.redraw_every == 0 or "attention.redraw_every" not in unused_fields(config),
         f"attention.redraw_every={a.redraw_every} has nothing to redraw: "
         f"{unused_fields(config).get('attention.redraw_every')}")
  rate = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1
  _check(rate(t.b1) and rate(t.b2),
         f"train.b1 and train.b2 (AdamW's decay rates) must be floats in [0, 1), got {t.b1!r}, {t.b2!r}")
  _check(0 <= t.final_lr_fraction <= 1,
         f"train.final_lr_fraction must be in [0, 1] (of train.lr), got {t.final_lr_fraction!r}")
  mesh = config.mesh
  for name in ("data", "sequence"):
    tasks.positive_int(f"mesh.{name}", mesh[name])
  _check(t.batch_size % mesh.data == 0,
         f"train.batch_size {t.batch_size} must be divisible by mesh.data {mesh.data}")
  _check(mesh.sequence == 1 or a.type == "favor",
         f"mesh.sequence={mesh.sequence} (sequence parallelism) needs attention.type='favor', got {a.type!r}")
  _check(isinstance(t.stop_after, int) and 0 <= t.stop_after <= t.steps,
         f"train.stop_after must be an int in [0, train.steps={t.steps}] (0 = run to the end), "
         f"got {t.stop_after!r}")
  tasks.check_data(config)


def unused_fields(config) -> dict:
  """{dotted field: why this run does not read it}: the config file's labels, ``mesh.fsdp`` without a data
  axis, FAVOR's fields under softmax attention, the
  random projection's (``num_features``, ``projection``, ``redraw_every``) for a kernel without one,
  ``chunk_size`` where nothing is chunked (a classifier's bidirectional attention without a window)."""
  unused = {k: "a label of the config file, not read by the run" for k in ("quick", "config_name", "experiment")
            if k in config}
  if config.mesh.data == 1:
    unused["mesh.fsdp"] = "mesh.data is 1: no data axis to split parameters over"
  a = config.attention
  if a.type != "favor":
    return {**unused, **{f"attention.{k}": "softmax attention has no FAVOR fields" for k in a if k != "type"}}
  if layers.projection_role(a.kernel) != "random":
    why = f"kernel {a.kernel!r} has no random projection"
    unused.update({f"attention.{k}": why for k in ("num_features", "projection", "redraw_every")})
  if not a.window and not tasks.is_causal(config.task):
    unused["attention.chunk_size"] = f"task {config.task!r} attends both ways and attention.window is 0: no chunks"
  return unused


def check_overrides_used(runs, overrides: dict) -> None:
  """Stops on a command-line value that no run reads: ``runs`` is [(name, field prefix, training config)]
  (prefix "" for a sweep's runs, "model." for a study's captured model)."""
  for field, value in overrides.items():
    why = {}
    for name, prefix, c in runs:
      if field.startswith(prefix):
        reason = unused_fields(c).get(field[len(prefix):])
        if reason is None:
          break  # read by this run
        why[name] = reason
    else:
      if why:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in why.items())
        raise ValueError(f"--config.{field}={value!r} is read by none of the runs ({reasons}): drop it, or "
                         "select runs that read it (--config.only=NAMES, or set the fields they need)")


def make_mesh(m) -> Mesh:
  """A ("data", "sequence") mesh over the first data·sequence devices (all of them under several processes);
  checked against what exists."""
  needed = m.data * m.sequence
  if needed > jax.device_count():
    raise ValueError(f"mesh.data × mesh.sequence = {needed} devices, but only {jax.device_count()} exist")
  if jax.process_count() > 1 and needed != jax.device_count():  # a process outside the mesh would idle
    raise ValueError(f"mesh.data × mesh.sequence = {needed} devices, but {jax.process_count()} processes "
                     f"need a mesh over all {jax.device_count()} devices (each process holds part of it)")
  devices = np.asarray(jax.devices()[:needed]).reshape(m.data, m.sequence)
  return Mesh(devices, ("data", "sequence"), axis_types=(AxisType.Auto, AxisType.Auto))


def state_shardings(state, mesh: Mesh, fsdp: bool):
  """Replicated leaves, or (``fsdp``) each leaf split over "data" along its largest divisible axis."""
  data = mesh.shape["data"]

  def spec(x):
    shape = np.shape(x)
    if fsdp and data > 1:
      for axis in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if shape[axis] % data == 0:
          return NamedSharding(mesh, P(*([None] * axis + ["data"])))
    return NamedSharding(mesh, P())

  shardings = jax.tree.map(spec, state)
  if isinstance(state, TrainState):  # the metric sums are read every log window: one copy on every device
    shardings = shardings._replace(sums_3=NamedSharding(mesh, P()))
  return shardings


def place(tree, shardings):
  """``tree`` as global arrays laid out by ``shardings`` (a matching tree, or one sharding for every leaf):
  every process holds the same values and places only the shards its devices hold. Not ``jax.device_put``:
  with one device per process (jax 0.10.2) its replicated arrays report broken shards to orbax."""
  def put(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  if isinstance(shardings, NamedSharding):
    return jax.tree.map(lambda x: put(x, shardings), tree)
  return jax.tree.map(put, tree, shardings)


def put_batch(batch: tasks.Batch, mesh: Mesh, split: bool = True) -> tasks.Batch:
  """The global batch as arrays split over "data" (else replicated); every process computes the same
  batch (a pure function of its position) and places its shards."""
  return place(batch, NamedSharding(mesh, P("data") if split else P()))


def make_optimizer(t) -> optax.GradientTransformation:
  """AdamW with linear warmup then cosine decay to ``final_lr_fraction``·lr, after global-norm clipping."""
  clip = optax.clip_by_global_norm(t.clip_norm) if t.clip_norm > 0 else optax.identity()
  return optax.chain(clip, optax.adamw(make_lr(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay))


def make_lr(t) -> optax.Schedule:
  """Linear warmup from lr/warmup_steps (not 0: the first step must move) to lr, then cosine decay."""
  start = t.lr / max(t.warmup_steps, 1)
  return optax.warmup_cosine_decay_schedule(start, t.lr, t.warmup_steps, t.steps, t.lr * t.final_lr_fraction)


def metric_sums(logits, batch) -> jax.Array:
  """[Σ w·cross-entropy, Σ w·[argmax correct], Σ w] in f32."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch.targets)
  correct = (jnp.argmax(logits, -1) == batch.targets).astype(jnp.float32)
  w = batch.weights
  return jnp.stack([(ce * w).sum(), (correct * w).sum(), w.sum()])


@functools.partial(jax.jit, static_argnums=0)  # one compilation per model (equal models hash equal)
def _init_variables(model, key, tokens):
  return model.init(key, tokens)  # eagerly, a FAVOR model's init dispatches op by op: several times slower


def init_state(config, model, task, optimizer, params=None) -> TrainState:
  """A fresh state; ``params`` (e.g. a softmax model's) replace the initial ones when given."""
  init_key = jax.random.PRNGKey(config.train.seed)
  variables = _init_variables(model, init_key, jnp.zeros((1, task.max_len), jnp.int32))
  if params is not None:
    if jax.tree.structure(params) != jax.tree.structure(variables["params"]):
      raise ValueError("params do not match the model's parameter tree")
    variables = {**variables, "params": params}
  return TrainState(jnp.int32(0), jnp.int32(0), variables["params"], variables.get("favor", {}),
                    optimizer.init(variables["params"]), jnp.zeros(3, jnp.float32), jnp.int32(-1))


def make_train_step(model, optimizer, redraw_every: int, redraw_key, shardings=None):
  """The jitted step; ``shardings`` = (state shardings, batch sharding) pins the layout on a mesh."""
  def train_step(state: TrainState, batch: tasks.Batch):
    favor = state.favor
    if favor:  # a new projection before the steps where the schedule says so (pure in the step)
      due = layers.redraw_due(state.step, redraw_every)
      favor = favor_linen.redraw({"favor": favor}, jax.random.fold_in(redraw_key, state.step), due)["favor"]

    def loss_fn(params):
      logits, updated = model.apply({"params": params, "favor": favor}, batch.tokens, train=True,
                                    mutable=["favor"])
      sums = metric_sums(logits, batch)
      return sums[0] / jnp.maximum(sums[2], 1.0), (sums, updated.get("favor", favor))

    (loss, (sums, favor)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    nonfinite = (state.nonfinite_step < 0) & ~jnp.isfinite(loss)
    return TrainState(state.step + 1, state.data_position + 1, optax.apply_updates(state.params, updates),
                      favor, opt_state, state.sums_3 + sums,
                      jnp.where(nonfinite, state.step + 1, state.nonfinite_step))

  if shardings is None:
    return jax.jit(train_step)
  return jax.jit(train_step, in_shardings=shardings, out_shardings=shardings[0])


def make_eval(model, task, mesh: Mesh):
  @jax.jit
  def eval_sums(params, favor, batch):
    return metric_sums(model.apply({"params": params, "favor": favor}, batch.tokens), batch)

  data = mesh.shape["data"]
  # Placed once: the held-out set never changes. A batch the data axis does not divide (a short last
  # batch) runs replicated.
  batches = [put_batch(b, mesh, len(b.tokens) % data == 0) for b in task.eval_batches]

  def evaluate(state: TrainState) -> dict:
    total = sum(np.asarray(eval_sums(state.params, state.favor, b), np.float64) for b in batches)
    out = dict(eval_loss=total[0] / total[2], eval_accuracy=total[1] / total[2])
    if task.metric == "eval_bpc":
      out["eval_bpc"] = out["eval_loss"] / math.log(2)
    return out

  return evaluate


class MetricsLog:
  """``metrics.jsonl``: one JSON record per line; on resume, records after the restored step are dropped."""

  def __init__(self, path: str, keep_through: int):
    self.path, self.records, self.writer = path, [], None
    if os.path.exists(path):
      with open(path) as f:
        for line in f:
          try:
            record = json.loads(line)
          except json.JSONDecodeError:  # a line cut short by a kill
            continue
          if record["step"] <= keep_through:
            self.records.append(record)
    if jax.process_index() != 0:  # multi-host: every process computes the metrics, process 0 writes them
      return
    if keep_through > 0 and not any(r["kind"] == "eval" and r["step"] == 0 for r in self.records):
      # The study reports from these records (best eval accuracy, curves): resumed without them, its numbers
      # would be those of the steps after the checkpoint only.
      raise ValueError(f"{path} lacks the records of the steps through {keep_through}, which the checkpoint "
                       "holds (missing, or cut: no evaluation at step 0): restore it, or delete "
                       f"{os.path.dirname(path)} to start the run over")
    with open(path + ".tmp", "w") as f:  # replaced whole: the other processes may be reading it
      f.writelines(json.dumps(r) + "\n" for r in self.records)
    os.replace(path + ".tmp", path)
    self.writer = _tensorboard(os.path.dirname(path))

  def write(self, record: dict) -> None:
    self.records.append(record)
    if jax.process_index() != 0:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self.writer is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, float):
          self.writer.add_scalar(k, v, record["step"])


def _tensorboard(logdir):
  try:
    from tensorboardX import SummaryWriter  # optional
  except ImportError:
    return None
  return SummaryWriter(logdir)


def _raise_if_nonfinite(state: TrainState) -> None:
  bad = int(state.nonfinite_step)
  if bad >= 0:
    raise FloatingPointError(f"non-finite loss at step {bad}: stopping (lower train.lr, check the inputs, "
                             "or use train.clip_norm > 0)")


def _checked_eval(metrics: dict, step: int) -> dict:
  """``metrics`` of an evaluation, or FloatingPointError when its loss is not finite (the parameters are not)."""
  if not math.isfinite(metrics["eval_loss"]):
    raise FloatingPointError(f"non-finite eval loss at step {step}: the parameters are not finite; stopping "
                             "(lower train.lr, check train.b1/b2, or use train.clip_norm > 0)")
  return metrics


def _reason(error: Exception, width: int = 160) -> str:
  text = " ".join(str(error).split())
  return f"{type(error).__name__}: {text[:width]}{'…' if len(text) > width else ''}"


def open_checkpoints(directory: str, state: TrainState, progress,
                     check_resume=lambda newest_step: None) -> tuple[ocp.CheckpointManager, TrainState]:
  """The checkpoint manager of ``directory`` and the newest checkpoint that restores (else ``state``).

  ``check_resume(newest step)`` runs before anything is restored when ``directory`` holds a checkpoint (so a
  config that cannot resume there is named before orbax compares array shapes). A step that does not restore
  (a truncated, zeroed or missing file) is skipped and, once an older step restores, moved to
  ``directory/damaged/``: orbax saves no step at or before its newest one, so left in place it would keep the
  resumed run from checkpointing. If no step restores, nothing is moved and a ValueError names the directory.
  """
  directory = os.path.abspath(directory)
  checkpoints = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2))
  damaged, steps = [], sorted(checkpoints.all_steps(), reverse=True)
  if steps:
    check_resume(steps[0])
  for step in steps:
    try:
      restored = checkpoints.restore(step, args=ocp.args.StandardRestore(state))
    except Exception as e:  # orbax and tensorstore raise many types (JSON, tree structure, data loss, ...)
      damaged.append((step, _reason(e)))
      progress(f"the checkpoint at step {step} cannot be restored, skipping it ({damaged[-1][1]})")
      continue
    if damaged:
      options = ocp.CheckpointManagerOptions(todelete_subdir="damaged")  # moved aside, not deleted
      mover = ocp.CheckpointManager(directory, options=options)
      for bad, _ in damaged:
        mover.delete(bad)
        progress(f"moved the damaged checkpoint at step {bad} to {os.path.join(directory, 'damaged')}")
      checkpoints.reload()
    progress(f"resumed from the checkpoint at step {int(restored.step)}")
    return checkpoints, restored
  if damaged:
    reasons = "; ".join(f"step {s}: {r}" for s, r in damaged)
    raise ValueError(f"no checkpoint in {directory} can be restored into this config's training state "
                     f"({reasons}). If its files are damaged or were written by another config, move or "
                     "delete that directory to start the run over.")
  return checkpoints, state


# Fields a resumed run may change: when it logs, evaluates, checkpoints and stops, and its mesh (orbax reshards
# a checkpoint onto any mesh). A study's own fields (its variants, the config file) are not the run's. Every
# other field decides what the run computes, so a run directory resumes only under the config it started with.
MAY_CHANGE_ON_RESUME = ("train.stop_after", "train.log_every", "train.eval_every", "train.checkpoint_every", "mesh")
NOT_OF_THE_RUN = ("experiment", "config_name", "quick", "variants", "only")
RUN_CONFIG = "run_config.json"  # in the run directory: the fields it was started with


def run_fields(config, resume: bool = True) -> dict:
  """{dotted field: value} of what ``config`` computes (JSON values: tuples read back as lists): not the
  study's fields, those the run does not read (``unused_fields``), nor (``resume``) those a resume may change."""
  flat = common.flat_fields(config.to_dict())
  skip = (MAY_CHANGE_ON_RESUME if resume else ()) + NOT_OF_THE_RUN
  unused = unused_fields(config)
  kept = {k: v for k, v in flat.items()
          if k not in unused and not any(k == s or k.startswith(s + ".") for s in skip)}
  return json.loads(json.dumps(kept, default=str))


def check_resumed_config(workdir: str, config, step: int) -> None:
  """A run whose checkpoints reach ``step`` > 0 goes on only under the config it was started with
  (``RUN_CONFIG``): otherwise the numbers of the finished steps would be reported as this config's."""
  path = os.path.join(workdir, RUN_CONFIG)
  restart = f"give another run directory, or delete {workdir} to start this run over"
  if not os.path.exists(path):
    raise ValueError(f"{workdir} holds checkpoints (step {step}) but no {RUN_CONFIG} (written by an older "
                     f"version), so this config cannot be checked against the one it ran: {restart}")
  with open(path) as f:
    stored = json.load(f)
  now = run_fields(config)
  changed = [f"{k}: {stored.get(k, '(absent)')!r} -> {now.get(k, '(absent)')!r}"
             for k in sorted(stored.keys() | now.keys()) if stored.get(k, "(absent)") != now.get(k, "(absent)")]
  if changed:
    raise ValueError(f"{workdir} holds a run (checkpoint at step {step}) started with another config; resuming "
                     f"would report its steps as this config's. Changed: {'; '.join(changed)}. Only "
                     f"{', '.join(MAY_CHANGE_ON_RESUME)} may change on resume: {restart}")


class Stopped(Exception):
  """``train.stop_after`` ended runs before ``train.steps`` (each with a checkpoint): their metrics are of an
  unfinished model, so no study reports them. ``runs``: (run directory, step reached, train.steps)."""

  def __init__(self, runs: list[tuple[str, int, int]]):
    self.runs = runs
    done = ", ".join(f"{d} at step {step} of {steps}" for d, step, steps in runs)
    super().__init__(f"stopped by train.stop_after: {done}. Rerun the same command (train.stop_after=0 or a "
                     "later step) to resume; results are written once every run has finished")


class Setup(NamedTuple):
  """What a run of ``config`` works with, before any checkpoint is read."""
  mesh: Mesh
  task: tasks.Task
  model: models.Transformer
  optimizer: optax.GradientTransformation
  state: TrainState  # fresh (``init_params`` when given), placed on ``mesh``
  shardings: Any  # the state's shardings


def build(config, init_params=None, progress=lambda message: None) -> Setup:
  """The mesh, task, model, optimiser and fresh placed state of ``config`` (the first part of ``train``)."""
  mesh = make_mesh(config.mesh)
  progress(f"building the {config.task} task (fetching its data if not cached)")
  task = tasks.make_task(config)
  progress("initialising the model and optimiser")
  model = models.make_model(config, task.vocab_size, task.num_classes, task.max_len, mesh)
  optimizer = make_optimizer(config.train)
  state = init_state(config, model, task, optimizer, init_params)
  shardings = state_shardings(state, mesh, config.mesh.fsdp)
  return Setup(mesh, task, model, optimizer, place(state, shardings), shardings)


def train(config, workdir: str, progress=print, init_params=None) -> tuple[list[dict], TrainState]:
  """Trains (or resumes) one configuration in ``workdir``; returns the metric records and the final state,
  or raises ``Stopped`` where ``train.stop_after`` ends it before ``train.steps``.

  On ``make_mesh(config.mesh)``: the batch is split over "data", the state is
  replicated (or FSDP-split over "data"), FAVOR layers split the sequence over
  "sequence". A checkpoint restores onto any mesh (orbax reshards it), under any number of processes:
  several (``mesh.distributed``) run this together, over one mesh of all their devices; each process places
  its shards of every batch, all write their shards of each checkpoint, and process 0 writes the metrics.
  """
  check_config(config)
  common.check_workdir(workdir, "the run directory")
  with run_lock(workdir):
    return _train(config, workdir, progress, init_params)


@contextlib.contextmanager
def run_lock(workdir: str):
  """Holds ``workdir/.lock`` (an exclusive flock, released when the process ends, however it ends) while a run
  trains there, so that a second command on the same run directory stops instead of interleaving its metrics and
  checkpoints with the first's. Process 0 only: a cluster's processes share the directory by design."""
  if jax.process_index() != 0:
    yield
    return
  path = os.path.join(workdir, ".lock")
  with open(path, "a+") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      f.seek(0)
      holder = f.read().strip() or "another process"
      raise ValueError(f"{workdir} is being written by another command ({holder}): wait for it to end, or give "
                       "another work directory") from e
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _train(config, workdir: str, progress, init_params) -> tuple[list[dict], TrainState]:
  """:func:`train` under its run directory's lock."""
  t = config.train
  end = t.stop_after or t.steps
  mesh, task, model, optimizer, state, shardings = build(config, init_params, progress)
  checkpoints, state = open_checkpoints(os.path.join(workdir, "checkpoints"), state, progress,
                                       check_resume=lambda newest: check_resumed_config(workdir, config, newest))
  step, position = int(state.step), int(state.data_position)
  if step == 0 and jax.process_index() == 0:  # a fresh start (a record of a run that never checkpointed is replaced)
    with open(os.path.join(workdir, RUN_CONFIG), "w") as f:
      json.dump(run_fields(config), f, indent=1)
  # Resumed: the records through the restored step. A fresh start keeps none (those of a run that never
  # checkpointed, whatever its config, would sit beside this run's).
  log = MetricsLog(os.path.join(workdir, "metrics.jsonl"), keep_through=step if step > 0 else -1)
  redraw_key = jax.random.PRNGKey(t.seed + 1)  # redraws: a key of their own
  train_step = make_train_step(model, optimizer, config.attention.redraw_every, redraw_key,
                               (shardings, NamedSharding(mesh, P("data"))))
  evaluate = make_eval(model, task, mesh)
  lr = make_lr(t)
  if step == 0:
    progress("compiling and running the evaluation at step 0")
    log.write(dict(kind="eval", step=0, **_checked_eval(evaluate(state), 0)))
  if step < end:
    progress(f"compiling the train step (step {step + 1} of {t.steps})")
  start, start_step = time.time(), step
  while step < end:
    state = train_step(state, put_batch(task.train_batch(position), mesh))
    step, position = step + 1, position + 1
    timing = lambda: dict(elapsed_s=time.time() - start,
                          steps_per_s=(step - start_step) / (time.time() - start))
    if step % t.log_every == 0 or step == t.steps:
      _raise_if_nonfinite(state)
      sums = np.asarray(state.sums_3, np.float64)
      state = state._replace(sums_3=place(np.zeros(3, np.float32), shardings.sums_3))
      log.write(dict(kind="train", step=step, train_loss=sums[0] / sums[2], train_accuracy=sums[1] / sums[2],
                     lr=float(lr(step - 1)), **timing()))
      record = log.records[-1]  # ETA from this process's rate (a resumed run restarts the clock)
      meter = tqdm.tqdm.format_meter(step, t.steps, record["elapsed_s"], rate=record["steps_per_s"],
                                     unit=" steps", ascii=" #", bar_format=PROGRESS)
      progress(f"{meter} loss {record['train_loss']:.4f}")
    if step % t.eval_every == 0 or step == t.steps:
      log.write(dict(kind="eval", step=step, **_checked_eval(evaluate(state), step), **timing()))
    if step % t.checkpoint_every == 0 or step == end:
      _raise_if_nonfinite(state)
      checkpoints.save(step, args=ocp.args.StandardSave(state))
  checkpoints.wait_until_finished()
  if step < t.steps:
    raise Stopped([(workdir, step, t.steps)])
  return log.records, state
