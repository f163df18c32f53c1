"""Training tasks: generated (MQAR, ListOps) or real text (your files or token array: ``text``; Shakespeare),
each a :class:`Task`.

Every batch is a pure function of the config's seed and its position in the
stream, so a run resumed from a checkpoint (which stores the position) sees
exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

TASKS = ("mqar", "listops", "shakespeare", "text")


class Batch(NamedTuple):
  tokens: np.ndarray  # [B, L] int32 model inputs (0 = padding for classifiers)
  targets: np.ndarray  # [B, L] next tokens (LM) or [B] class labels
  weights: np.ndarray  # same shape as targets: 1 where the loss counts, else 0
  segment_ids: np.ndarray | None = None  # [B, L] int32 packed documents' ids (data.pack); None: unpacked


class Task(NamedTuple):
  name: str
  vocab_size: int
  num_classes: int  # 0: causal language model; else an encoder classifier over this many classes
  # the headline evaluation metric: "eval_accuracy", or a language model's "eval_bpc" (bits per byte of a byte
  # vocabulary), "eval_bits_per_byte" (a tokenizer's) or "eval_bits_per_token" (ids whose bytes are unknown)
  metric: str
  max_len: int
  train_batch: Callable[[int], Batch]  # position in the training stream -> batch
  eval_batches: list[Batch]  # the fixed held-out set
  # ((L, batches), ...): held-out sets at other lengths than training's (length extrapolation), evaluated at
  # the end of training (metrics ``eval_*_at_L``)
  length_evals: tuple = ()
  split: str = ""  # how the held-out set was chosen, in words ("" where it is generated)
  # int64 [vocab_size]: the bytes of text each token id stands for (a language model's held-out bits per byte);
  # None where unknown (a token file without its tokenizer) or not text
  token_bytes: np.ndarray | None = None


def stream_rng(seed: int, stream: int, position: int) -> np.random.Generator:
  """An independent generator for (seed, stream, position): 0 = training batches, 1 = evaluation."""
  return np.random.default_rng([seed, stream, position])


def _module(task: str):
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")
  return importlib.import_module(f"experiments.tasks.{task}")


def make_task(config) -> Task:
  return _module(config.task).make_task(config.data, batch_size=config.train.batch_size, seed=config.train.seed)


def is_causal(task: str) -> bool:
  """Whether ``task`` trains a causal language model (``Task.num_classes`` 0) rather than a classifier."""
  return _module(task).NUM_CLASSES == 0


def check_data(config) -> None:
  """Rejects bad ``config.data`` values with a message naming the field (before anything is built), and a
  ``config.data`` that lacks the task's fields (the task changed without its data block)."""
  module = _module(config.task)
  try:
    module.check_data(config.data)
  except (KeyError, AttributeError) as e:
    raise ValueError(f"task {config.task!r} reads a data field this config lacks ({e}): a task's data block "
                     f"comes with its config file; run experiments/configs/{config.task}.py instead") from None


def unused_data(config) -> dict:
  """{"data.FIELD": why the task does not read it under this config} (a task without the rule: {})."""
  rule = getattr(_module(config.task), "unused_data", None)
  return {} if rule is None else {f"data.{k}": why for k, why in rule(config.data).items()}


def positive_int(name: str, value) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
