"""One training run: optax from the config, a jitted pure train step, evaluation, metrics and checkpoints.

Resuming is exact: the checkpoint holds the whole :class:`TrainState` (params,
optimizer state, FAVOR projections and running statistics, step, data
position, the metric sums of the current logging window), batches are a pure
function of their position, and redraws a pure function of the step; so
rerunning the same command after a kill writes the same ``metrics.jsonl``. SIGTERM or SIGINT (a preemption,
Ctrl-C) during the loop saves a checkpoint at the end of the current step, then raises :class:`Preempted`.

The pieces live in modules of their own: ``config_checks`` (the config's checks), ``steps`` (the state and
the train step), ``sharding`` (mesh and placement), ``metrics`` (evaluation and ``metrics.jsonl``) and
``checkpointing`` (checkpoints, the run's config record and its lock); this module runs the loop.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import tasks
from experiments.train import flops, models, paths
from experiments.train.checkpointing import (
  MAY_CHANGE_ON_RESUME,
  NOT_OF_THE_RUN,
  RUN_CONFIG,
  check_resumed_config,
  open_checkpoints,
  record_run_config,
  record_tokenizer,
  run_fields,
  run_lock,
)
from experiments.train.config_checks import (
    _count,
    check_batch_split,
    check_config,
    check_decodes,
    check_overrides_used,
    unused_fields,
)
from experiments.train.metrics import MetricsLog, checked_eval, make_eval, raise_if_nonfinite
from experiments.train.sharding import idle_devices, make_mesh, place, put_batch, state_shardings
from experiments.train.steps import TrainState, init_state, make_lr, make_optimizer, make_train_step, metric_sums

__all__ = ["MAY_CHANGE_ON_RESUME", "NOT_OF_THE_RUN", "RUN_CONFIG", "TIMING_FIELDS", "Preempted", "Setup", "Stopped",
           "TrainState",
           "_count", "build", "check_config", "check_decodes", "check_overrides_used", "check_resumed_config",
           "init_state",
           "make_eval", "make_lr", "make_optimizer", "make_train_step", "metric_sums", "open_checkpoints",
           "record_run_config", "run_fields", "run_lock", "train", "unused_fields"]

# the only metrics that differ between identical runs
TIMING_FIELDS = ("elapsed_s", "steps_per_s", "window_steps_per_s", "tokens_per_s", "ceiling_flops_per_s",
                 *flops.MFU_FIELDS)
# tqdm's meter, its rate in steps/s
PROGRESS = "{l_bar}{bar:24}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}]"


class Stopped(Exception):
  """``train.stop_after`` ended runs before ``train.steps`` (each with a checkpoint): their metrics are of an
  unfinished model, so no study reports them. ``runs``: (run directory, step reached, train.steps)."""

  def __init__(self, runs: list[tuple[str, int, int]]):
    self.runs = runs
    done = ", ".join(f"{d} at step {step} of {steps}" for d, step, steps in runs)
    super().__init__(f"stopped by train.stop_after: {done}. Rerun the same command (train.stop_after=0 or a "
                     "later step) to resume; results are written once every run has finished")


class Preempted(Exception):
  """A SIGTERM or SIGINT stopped a run after saving a checkpoint at ``step``; rerunning the command resumes it
  exactly. ``signum``: the signal (an entry point exits with 128 + it, as the signal's own exit would)."""

  def __init__(self, workdir: str, step: int, signum: int):
    self.workdir, self.step, self.signum = workdir, step, signum
    super().__init__(f"{signal.Signals(signum).name}: saved a checkpoint of {workdir} at step {step}; rerun the "
                     "same command to resume")


@contextlib.contextmanager
def _signals_caught():
  """Within: SIGTERM and SIGINT are recorded (``caught[0]``: the first one's number, else None) instead of
  ending the process; the handlers before are restored after. Off the main thread (where Python cannot set
  handlers) nothing is caught."""
  caught = [None]
  if threading.current_thread() is not threading.main_thread():
    yield caught
    return

  def record(signum, frame):
    del frame
    caught[0] = caught[0] or signum

  before = {s: signal.signal(s, record) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield caught
  finally:
    for s, handler in before.items():
      signal.signal(s, handler)


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
  if config.mesh.data == -1:
    data = mesh.shape["data"]
    check_batch_split(config.train, data, f" of {data} devices: mesh.data=-1 takes every device")
  idle = idle_devices(mesh, config.mesh)
  if idle:
    progress(idle[0].upper() + idle[1:])
  progress(f"building the {config.task} task (fetching its data if not cached)")
  task = tasks.make_task(config)
  if task.split:
    progress(f"held-out set: {task.split}")
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
  check_decodes(config)  # a model that trains but cannot be sampled stops here, not after its run
  workdir = paths.check_workdir(workdir, "the run directory")  # a local path, or a gs:// URL
  with run_lock(workdir, progress):
    return _train(config, workdir, progress, init_params)


def _train(config, workdir: str, progress, init_params) -> tuple[list[dict], TrainState]:
  """:func:`train` under its run directory's lock."""
  t = config.train
  end = t.stop_after or t.steps
  mesh, task, model, optimizer, state, shardings = build(config, init_params, progress)
  checkpoints, state = open_checkpoints(os.path.join(workdir, "checkpoints"), state, progress,
                                       check_resume=lambda newest: check_resumed_config(workdir, config, newest))
  step, position = int(state.step), int(state.data_position)
  if step == 0:  # a fresh start (a record of a run that never checkpointed is replaced)
    record_run_config(workdir, config)
  record_tokenizer(workdir, config, fresh=step == 0)
  # Resumed: the records through the restored step. A fresh start keeps none (those of a run that never
  # checkpointed, whatever its config, would sit beside this run's).
  log = MetricsLog(os.path.join(workdir, "metrics.jsonl"), keep_through=step if step > 0 else -1)
  redraw_key = jax.random.PRNGKey(t.seed + 1)  # redraws: a key of their own
  train_step = make_train_step(model, optimizer, config.attention.redraw_every, redraw_key,
                               (shardings, NamedSharding(mesh, P("data"))), t.grad_accum_steps)
  evaluate = make_eval(model, task, mesh)
  lr = make_lr(t)
  if step == 0:
    progress("compiling and running the evaluation at step 0")
    log.write(dict(kind="eval", step=0, **checked_eval(evaluate(state), 0)))
  if step < end:
    progress(f"compiling the train step (step {step + 1} of {t.steps})")
  shape = task.train_batch(position).tokens.shape  # [B, L] of every training batch
  cost = flops.flops_per_token(config, task.vocab_size, shape[1])
  cost_half = flops.flops_per_token(config, task.vocab_size, shape[1], convention="half")  # MaxText's convention
  ceiling = flops.device_peak(config.model.dtype, list(mesh.devices.flat))
  counted = dict(flops_per_token=cost["train"], ceiling_flops_per_s=ceiling.flops_per_s, ceiling_kind=ceiling.kind,
                 ceiling=ceiling.source)
  if cost_half["train"] != cost["train"]:
    counted["flops_per_token_causal_half"] = cost_half["train"]
  start, start_step = time.time(), step
  timing = lambda: dict(elapsed_s=time.time() - start, steps_per_s=(step - start_step) / (time.time() - start))
  # Throughput over each logging window, without the time of evaluations and checkpoint saves in it (the first
  # window of a process holds the train step's compilation).
  window = dict(start=start, step=step, paused=0.0)

  def throughput():
    seconds = time.time() - window["start"] - window["paused"]
    steps_per_s = (step - window["step"]) / seconds
    tokens_per_s = steps_per_s * shape[0] * shape[1]
    window.update(start=time.time(), step=step, paused=0.0)
    return dict(window_steps_per_s=steps_per_s, tokens_per_s=tokens_per_s,
                **flops.utilisation(tokens_per_s, cost, cost_half, ceiling))

  @contextlib.contextmanager
  def paused():
    begun = time.time()
    yield
    window["paused"] += time.time() - begun

  # The next batch is built on a thread while the step runs (a pure function of its position, so the same).
  with _signals_caught() as caught, concurrent.futures.ThreadPoolExecutor(1) as loader:
    upcoming = loader.submit(task.train_batch, position)
    while step < end:
      batch = upcoming.result()
      upcoming = loader.submit(task.train_batch, position + 1)
      state = train_step(state, put_batch(batch, mesh))
      step, position = step + 1, position + 1
      if step % t.log_every == 0 or step == t.steps:
        raise_if_nonfinite(state)
        sums = np.asarray(state.sums_3, np.float64)
        state = state._replace(sums_3=place(np.zeros(3, np.float32), shardings.sums_3))
        log.write(dict(kind="train", step=step, train_loss=sums[0] / sums[2], train_accuracy=sums[1] / sums[2],
                       lr=float(lr(step - 1)), **timing(), **throughput(), **counted,
                       devices=int(mesh.devices.size), devices_present=jax.device_count()))
        record = log.records[-1]  # ETA from this process's rate (a resumed run restarts the clock)
        meter = tqdm.tqdm.format_meter(step, t.steps, record["elapsed_s"], rate=record["steps_per_s"],
                                       unit=" steps", ascii=" #", bar_format=PROGRESS)
        progress(f"{meter} loss {record['train_loss']:.4f}, {record['tokens_per_s']:,.0f} tokens/s, "
                 f"{flops.describe_utilisation(record)}")
      if step % t.eval_every == 0 or step == t.steps:
        with paused():
            log.write(dict(kind="eval", step=step, **checked_eval(evaluate(state, final=step == t.steps), step),
                         **timing()))
      if step % t.checkpoint_every == 0 or step == end or caught[0]:
        raise_if_nonfinite(state)
        if checkpoints.latest_step() != step:
          with paused():
            checkpoints.save(step, args=ocp.args.StandardSave(state))
      if caught[0] and step < end:
        checkpoints.wait_until_finished()
        raise Preempted(workdir, step, caught[0])
    checkpoints.wait_until_finished()
  if step < t.steps:
    raise Stopped([(workdir, step, t.steps)])
  return log.records, state
