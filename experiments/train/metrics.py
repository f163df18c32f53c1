"""A run's evaluation and its ``metrics.jsonl``, and the stop on a non-finite loss."""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
from jax.sharding import Mesh

from experiments.train import paths
from experiments.train.sharding import put_batch
from experiments.train.steps import TrainState, metric_sums


def held_out_bytes(batches, token_bytes) -> float:
  """The bytes of text the targets of ``batches`` stand for, each as its weight counts it (the denominator of
  bits per byte); nan where ``token_bytes`` is None (unknown)."""
  if token_bytes is None:
    return float("nan")
  return float(sum((np.asarray(b.weights, np.float64) * token_bytes[np.asarray(b.targets)]).sum() for b in batches))


def lm_metrics(loss_sum: float, weight_sum: float, num_bytes: float, byte_vocab: bool = False) -> dict:
  """A language model's held-out metrics from its summed cross-entropy (nats) over ``weight_sum`` target tokens
  that stand for ``num_bytes`` bytes of text (nan: unknown): ``eval_bits_per_token``, ``eval_perplexity``
  (e^(nats per token)), ``eval_bits_per_byte`` = bits per token × tokens / bytes where the bytes are known, and
  (``byte_vocab``: a token is a byte) ``eval_bpc``, the same bits per byte under the name the byte-level studies
  report."""
  nats = loss_sum / weight_sum
  out = dict(eval_bits_per_token=nats / math.log(2), eval_perplexity=math.exp(min(nats, 700.0)))
  if math.isfinite(num_bytes) and num_bytes > 0:
    out["eval_bits_per_byte"] = out["eval_bits_per_token"] * weight_sum / num_bytes
  if byte_vocab:
    out["eval_bpc"] = out["eval_bits_per_token"]
  return out


def make_eval(model, task, mesh: Mesh):
  """``evaluate(state, final=False) -> {eval_loss, eval_accuracy (, a language model's metrics)}`` over the
  task's held-out batches; ``final``: also over each of ``task.length_evals`` (``eval_loss_at_L``, ... for its
  length L: the model trained at the task's length, run at another without retraining). A language model
  (``task.metric`` not accuracy) adds :func:`lm_metrics`: bits per token, perplexity, and bits per byte where
  ``task.token_bytes`` gives each id's bytes."""
  @jax.jit
  def eval_sums(params, favor, batch):
    packed = {} if batch.segment_ids is None else {"segment_ids": batch.segment_ids}
    return metric_sums(model.apply({"params": params, "favor": favor}, batch.tokens, **packed), batch)

  data = mesh.shape["data"]
  # Placed once: the held-out set never changes. A batch the data axis does not divide (a short last
  # batch) runs replicated.
  place = lambda held_out: [put_batch(b, mesh, len(b.tokens) % data == 0) for b in held_out]
  token_bytes = getattr(task, "token_bytes", None)
  sizes = lambda held_out: held_out_bytes(held_out, token_bytes)  # on the host, once: the set never changes
  batches = (place(task.eval_batches), sizes(task.eval_batches))
  at_length = [(length, (place(held_out), sizes(held_out))) for length, held_out in task.length_evals]

  def metrics(state, held_out, suffix=""):
    placed, num_bytes = held_out
    total = sum(np.asarray(eval_sums(state.params, state.favor, b), np.float64) for b in placed)
    out = dict(eval_loss=total[0] / total[2], eval_accuracy=total[1] / total[2])
    if task.metric != "eval_accuracy":
      out.update(lm_metrics(total[0], total[2], num_bytes, byte_vocab=task.metric == "eval_bpc"))
    return {k + suffix: v for k, v in out.items()}

  def evaluate(state: TrainState, final: bool = False) -> dict:
    out = metrics(state, batches)
    for length, held_out in at_length if final else ():
      out.update(metrics(state, held_out, f"_at_{length}"))
    return out

  return evaluate


class MetricsLog:
  """``metrics.jsonl``: one JSON record per line; on resume, records after the restored step are dropped. On a
  bucket the object is rewritten whole at each record (an object cannot be appended to)."""

  def __init__(self, path: str, keep_through: int):
    self.path, self.records, self.writer = path, [], None
    for line in paths.read_text(path).splitlines() if paths.exists(path) else ():
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
    paths.write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))  # whole: others may be reading
    self.writer = _tensorboard(os.path.dirname(path))

  def write(self, record: dict) -> None:
    self.records.append(record)
    if jax.process_index() != 0:
      return
    if paths.is_url(self.path):  # an object is written whole
      paths.write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
    else:
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if self.writer is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, float):
          self.writer.add_scalar(k, v, record["step"])


def _tensorboard(logdir):
  """A tensorboardX writer into ``logdir`` (a local path, or gs:// through google-cloud-storage, which tensorboardX
  uploads each event file with) when tensorboardX is installed (``pip install "favor_jax[tensorboard]"``), else
  None: the scalars of metrics.jsonl, viewed with ``tensorboard --logdir=WORKDIR``."""
  try:
    from tensorboardX import SummaryWriter  # optional
  except ImportError:
    return None
  return SummaryWriter(logdir)


def raise_if_nonfinite(state: TrainState) -> None:
  """FloatingPointError naming the first step whose loss was not finite, if any."""
  bad = int(state.nonfinite_step)
  if bad >= 0:
    raise FloatingPointError(f"non-finite loss at step {bad}: stopping (lower train.lr, check the inputs, "
                             "or use train.clip_norm > 0)")


def checked_eval(metrics: dict, step: int) -> dict:
  """``metrics`` of an evaluation, or FloatingPointError when its loss is not finite (the parameters are not)."""
  if not math.isfinite(metrics["eval_loss"]):
    raise FloatingPointError(f"non-finite eval loss at step {step}: the parameters are not finite; stopping "
                             "(lower train.lr, check train.b1/b2, or use train.clip_norm > 0)")
  return metrics
