"""Multi-query associative recall (MQAR), as defined by Zoology (Arora et al. 2023, arXiv:2312.04927).

A sequence starts with ``num_kv_pairs`` key-value pairs (keys from
[1, vocab/2), values from [vocab/2, vocab), all distinct within a sequence);
the rest of the sequence queries every key once more, each at an even offset
drawn without replacement from a power law p(g) ∝ g^(power_a - 1). The target
after a queried key is its value; only those positions count in the loss and
the accuracy. ``random_non_queries`` fills the remaining positions with random
tokens instead of 0.
"""

from __future__ import annotations

import numpy as np

from experiments.tasks import Batch, Task, positive_int, stream_rng

NUM_CLASSES = 0  # a causal language model (next-token targets)


def check_data(data) -> None:
  for name in ("seq_len", "num_kv_pairs", "vocab_size", "num_eval_batches"):
    positive_int(f"data.{name}", data[name])
  if data.seq_len % 2:
    raise ValueError(f"data.seq_len must be even, got {data.seq_len}")
  if 4 * data.num_kv_pairs > data.seq_len:
    raise ValueError(f"data.seq_len {data.seq_len} leaves no room for {data.num_kv_pairs} pairs and their "
                     f"queries: need seq_len >= 4 * num_kv_pairs = {4 * data.num_kv_pairs}")
  if data.vocab_size // 2 - 1 < data.num_kv_pairs:
    raise ValueError(f"data.vocab_size {data.vocab_size} has fewer than num_kv_pairs={data.num_kv_pairs} "
                     "distinct keys in [1, vocab_size / 2)")
  if not 0 < data.power_a < float("inf"):
    raise ValueError(f"data.power_a must be a finite number > 0, got {data.power_a}")


def sample(rng: np.random.Generator, batch_size: int, seq_len: int, num_kv_pairs: int, vocab_size: int,
           power_a: float, random_non_queries: bool) -> Batch:
  """One MQAR batch; ``targets`` are the next tokens, ``weights`` 1 at the answers only."""
  n = num_kv_pairs
  half = vocab_size // 2
  keys_BN = 1 + np.argsort(rng.random((batch_size, half - 1)), axis=1)[:, :n]
  values_BN = half + np.argsort(rng.random((batch_size, vocab_size - half)), axis=1)[:, :n]
  space = (seq_len - 2 * n) // 2
  log_p = np.log(power_a) + (power_a - 1) * np.log(np.arange(1, space + 1))
  gumbel = -np.log(-np.log(rng.random((batch_size, space))))
  gaps_BN = np.argsort(-(log_p + gumbel), axis=1)[:, :n]  # Gumbel top-k: n slots drawn without replacement
  example_BL = np.zeros((batch_size, seq_len + 1), np.int64)
  example_BL[:, 0:2 * n:2], example_BL[:, 1:2 * n:2] = keys_BN, values_BN
  rows = np.arange(batch_size)[:, None]
  example_BL[rows, 2 * n + 2 * gaps_BN] = keys_BN
  example_BL[rows, 2 * n + 2 * gaps_BN + 1] = values_BN
  answer_BL = np.zeros_like(example_BL, bool)
  answer_BL[rows, 2 * n + 2 * gaps_BN + 1] = True
  tokens, targets, weights = example_BL[:, :-1], example_BL[:, 1:], answer_BL[:, 1:]
  if random_non_queries:
    tokens = np.where(tokens == 0, rng.integers(0, vocab_size, tokens.shape), tokens)
  return Batch(tokens.astype(np.int32), targets.astype(np.int32), weights.astype(np.float32))


def make_task(data, batch_size: int, seed: int) -> Task:
  check_data(data)
  draw = lambda rng: sample(rng, batch_size, data.seq_len, data.num_kv_pairs, data.vocab_size,
                            data.power_a, data.random_non_queries)
  return Task(name="mqar", vocab_size=data.vocab_size, num_classes=NUM_CLASSES, metric="eval_accuracy",
              max_len=data.seq_len,
              train_batch=lambda position: draw(stream_rng(seed, 0, position)),
              eval_batches=[draw(stream_rng(seed, 1, i)) for i in range(data.num_eval_batches)])
