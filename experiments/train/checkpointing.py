"""A run directory's checkpoints (the newest that restores, damaged steps moved aside), the config it was
started with, and the lock that keeps a second command out of it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time

import jax
import orbax.checkpoint as ocp

from experiments.configs import common
from experiments.train import paths
from experiments.train.config_checks import unused_fields
from experiments.train.steps import TrainState


def _reason(error: Exception, width: int = 160) -> str:
  text = " ".join(str(error).split())
  return f"{type(error).__name__}: {text[:width]}{'…' if len(text) > width else ''}"


ITEM = "default"  # the directory of a step that holds the state (orbax's name for a manager's single item)


def open_checkpoints(directory: str, state: TrainState, progress,
                     check_resume=lambda newest_step: None) -> tuple[ocp.CheckpointManager, TrainState]:
  """The checkpoint manager of ``directory`` and the newest checkpoint that restores (else ``state``).

  ``check_resume(newest step)`` runs before anything is restored when ``directory`` holds a checkpoint (so a
  config that cannot resume there is named before orbax compares array shapes). A step that does not restore
  (a truncated, zeroed or missing file, a missing item directory) is skipped and, once an older step restores, moved to
  ``directory/damaged/``: orbax saves no step at or before its newest one, so left in place it would keep the
  resumed run from checkpointing. If no step restores, nothing is moved and a ValueError names the directory.
  """
  directory = paths.absolute(directory)  # a local path, or a gs:// URL (orbax writes both)
  checkpoints = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2))
  steps = checkpoints.all_steps()
  if steps:
    check_resume(max(steps))
  restore = lambda step: checkpoints.restore(step, args=ocp.args.StandardRestore(state))
  found = newest_that_restores(directory, steps, restore, progress, "into this config's training state")
  if found is None:
    return checkpoints, state
  _, restored, damaged = found
  if damaged:
    options = ocp.CheckpointManagerOptions(todelete_subdir="damaged")  # moved aside, not deleted
    mover = ocp.CheckpointManager(directory, options=options)
    for bad, _ in damaged:
      mover.delete(bad)
      progress(f"deleted the damaged checkpoint at step {bad} (orbax moves nothing aside on a bucket)"
               if paths.is_url(directory) else
               f"moved the damaged checkpoint at step {bad} to {os.path.join(directory, 'damaged')}")
    checkpoints.reload()
  progress(f"resumed from the checkpoint at step {int(restored.step)}")
  return checkpoints, restored


def newest_that_restores(directory: str, steps, restore, progress=lambda message: None,
                         into: str = "") -> tuple[int, object, list[tuple[int, str]]] | None:
  """The rule training's resume and generation share: (step, ``restore(step)``, [(damaged step, why)]) of the
  newest of ``steps`` (checkpoints in ``directory``) that restores, each newer one that does not (a truncated,
  zeroed or missing file, a missing item directory) skipped and named to ``progress``; None without steps.

  Raises:
    ValueError: naming ``directory`` and each step's reason, when steps exist and none restores (``into``: what
      they were restored into, for the message).
  """
  damaged = []
  for step in sorted(steps, reverse=True):
    try:
      if not paths.is_dir(os.path.join(directory, str(step), ITEM)):  # orbax's restore of such a step leaves
        raise FileNotFoundError(f"its item directory {ITEM}/ is missing")  # the manager failing every other one
      restored = restore(step)
    except Exception as e:  # orbax and tensorstore raise many types (JSON, tree structure, data loss, ...)
      damaged.append((step, _reason(e)))
      progress(f"the checkpoint at step {step} cannot be restored, skipping it ({damaged[-1][1]})")
      continue
    return step, restored, damaged
  if damaged:
    reasons = "; ".join(f"step {s}: {r}" for s, r in damaged)
    raise ValueError(f"no checkpoint in {directory} can be restored{' ' + into if into else ''} ({reasons}). If "
                     "its files are damaged or were written by another config, move or delete that directory to "
                     "start the run over.")
  return None


# Fields a resumed run may change: when it logs, evaluates, checkpoints and stops, and its mesh (orbax reshards
# a checkpoint onto any mesh). A study's own fields (its variants, the config file) are not the run's. Every
# other field decides what the run computes, so a run directory resumes only under the config it started with.
MAY_CHANGE_ON_RESUME = ("train.stop_after", "train.log_every", "train.eval_every", "train.checkpoint_every", "mesh")
NOT_OF_THE_RUN = ("experiment", "config_name", "quick", "variants", "only")
RUN_CONFIG = "run_config.json"  # in the run directory: the fields it was started with
TOKENIZER = "tokenizer.json"  # in the run directory: a copy of data.tokenizer, the one generation decodes with


def run_fields(config, resume: bool = True) -> dict:
  """{dotted field: value} of what ``config`` computes (JSON values: tuples read back as lists): not the
  study's fields, those the run does not read (``unused_fields``), nor (``resume``) those a resume may change."""
  flat = common.flat_fields(config.to_dict())
  skip = (MAY_CHANGE_ON_RESUME if resume else ()) + NOT_OF_THE_RUN
  unused = unused_fields(config)
  kept = {k: v for k, v in flat.items()
          if k not in unused and not any(k == s or k.startswith(s + ".") for s in skip)}
  return json.loads(json.dumps(kept, default=str))


def record_run_config(workdir: str, config) -> None:
  """Writes ``workdir/RUN_CONFIG``: the fields a resume is checked against (process 0 only)."""
  if jax.process_index() == 0:
    paths.write_text(os.path.join(workdir, RUN_CONFIG), json.dumps(run_fields(config), indent=1))


def record_tokenizer(workdir: str, config, fresh: bool) -> None:
  """Keeps ``data.tokenizer`` in the run (``workdir/TOKENIZER``, process 0), so that generation encodes and decodes
  with the tokenizer the run trained with wherever the original goes: copied on a ``fresh`` start; on a resume,
  a ValueError unless the file is the same (its path may change, not its content)."""
  source = config.data.get("tokenizer", "")
  if not source:
    return
  with open(source) as f:
    content = f.read()
  target = os.path.join(workdir, TOKENIZER)
  if not fresh and paths.exists(target):
    if paths.read_text(target) != content:
      raise ValueError(f"data.tokenizer={source!r} is not the tokenizer {workdir} was trained with ({target}): "
                       "a resumed run keeps its tokenizer; give that file, or another run directory")
    return
  if jax.process_index() == 0:
    paths.write_text(target, content)  # whole or not at all (paths.write_text)


def check_resumed_config(workdir: str, config, step: int) -> None:
  """A run whose checkpoints reach ``step`` > 0 goes on only under the config it was started with
  (``RUN_CONFIG``): otherwise the numbers of the finished steps would be reported as this config's."""
  path = os.path.join(workdir, RUN_CONFIG)
  restart = f"give another run directory, or delete {workdir} to start this run over"
  if not paths.exists(path):
    raise ValueError(f"{workdir} holds checkpoints (step {step}) but no {RUN_CONFIG} (written by an older "
                     f"version), so this config cannot be checked against the one it ran: {restart}")
  stored = json.loads(paths.read_text(path))
  now = run_fields(config)
  changed = [f"{k}: {stored.get(k, '(absent)')!r} -> {now.get(k, '(absent)')!r}"
             for k in sorted(stored.keys() | now.keys()) if stored.get(k, "(absent)") != now.get(k, "(absent)")]
  if changed:
    raise ValueError(f"{workdir} holds a run (checkpoint at step {step}) started with another config; resuming "
                     f"would report its steps as this config's. Changed: {'; '.join(changed)}. Only "
                     f"{', '.join(MAY_CHANGE_ON_RESUME)} may change on resume: {restart}")


@contextlib.contextmanager
def run_lock(workdir: str, progress=print):
  """Holds ``workdir/.lock`` (an exclusive flock, released when the process ends, however it ends) while a run
  trains there, so that a second command on the same run directory stops instead of interleaving its metrics and
  checkpoints with the first's; the file is removed when the run ends (a killed run leaves it, unlocked).
  Process 0 only: a cluster's processes share the directory by design.

  On a bucket (a ``gs://`` run directory) there is no lock: an object store has no advisory lock, and a killed
  run's record could not be told from a live one's. ``.lock`` then records who writes (pid, host, time) and
  is removed at the end; a command that finds one says whose it is (``progress``) and goes on. Run one command
  per run directory on a bucket."""
  if jax.process_index() != 0:
    yield
    return
  path = os.path.join(workdir, ".lock")
  if paths.is_url(workdir):
    with _recorded(path, workdir, progress):
      yield
    return
  with _locked(path, workdir) as f:
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    try:
      yield
    finally:
      os.remove(path)  # still locked: a command that opened it before finds it gone and opens a new one
      fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _recorded(path: str, workdir: str, progress):
  """``run_lock`` on a bucket: the holder's record written at the start and removed at the end, a record found
  there reported."""
  if paths.exists(path):
    holder = paths.read_text(path).strip() or "an unnamed command"
    progress(f"warning: {path} says {holder} is writing {workdir} (a bucket has no lock: if that command still "
             "runs, stop one of the two; a killed run leaves this record behind)")
  paths.write_text(path, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
  try:
    yield
  finally:
    paths.remove(path)


def _locked(path: str, workdir: str):
  """``path`` opened and exclusively locked, or a ValueError naming its holder. A file its holder removed
  between this open and this lock is not the lock any more: opened again."""
  while True:
    f = open(path, "a+")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      f.seek(0)
      holder = f.read().strip() or "another process"
      f.close()
      raise ValueError(f"{workdir} is being written by another command ({holder}): wait for it to end, or give "
                       "another work directory") from e
    try:
      if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
        return f
    except FileNotFoundError:
      pass
    f.close()
