"""ListOps as in Long Range Arena (Tay et al. 2021; generator after Nangia & Bowman 2018).

Nested expressions over digits 0-9 with operators MAX, MIN, MED (median,
truncated to an int) and SM (sum mod 10); the label is the value (10 classes).
A node is an operator with probability 0.25 (always a digit at ``max_depth``),
with 2..``max_args`` arguments; expressions are redrawn until their token
count lies in [min_length, max_length]. LRA's full size is max_depth=10,
max_args=10, lengths 500-2000. Tokens: 0 padding, 1-10 digits, 11-14
operators, 15 the closing bracket (LRA drops the parentheses of its TSV form).
"""

from __future__ import annotations

import random

import numpy as np

from experiments.tasks import Batch, Task, positive_int, stream_rng

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
VOCAB = {**{str(d): d + 1 for d in range(10)}, **{op: 11 + i for i, op in enumerate(OPERATORS)}, "]": 15}
NODE_IS_OPERATOR_P = 0.25

NUM_CLASSES = 10  # the ten digits a ListOps expression evaluates to: an encoder classifier


def apply(op: str, args: list[int]) -> int:
  if op == "[MIN":
    return min(args)
  if op == "[MAX":
    return max(args)
  if op == "[MED":
    return int(np.median(args))
  return sum(args) % 10


def tree(rng: random.Random, depth: int, max_depth: int, max_args: int) -> tuple[list[str], int]:
  """(tokens, value) of one random expression."""
  if depth >= max_depth or rng.random() > NODE_IS_OPERATOR_P:
    digit = rng.randrange(10)
    return [str(digit)], digit
  children = [tree(rng, depth + 1, max_depth, max_args) for _ in range(rng.randint(2, max_args))]
  op = rng.choice(OPERATORS)
  return [op] + [t for tokens, _ in children for t in tokens] + ["]"], apply(op, [v for _, v in children])


def expression(rng: random.Random, data) -> tuple[list[str], int]:
  while True:
    tokens, value = tree(rng, 1, data.max_depth, data.max_args)
    if data.min_length <= len(tokens) <= data.max_length:
      return tokens, value


def dataset(seed: int, size: int, data) -> tuple[np.ndarray, np.ndarray]:
  """``size`` expressions as ([size, max_length] token ids, [size] labels)."""
  rng = random.Random(seed)
  tokens_NL = np.zeros((size, data.max_length), np.int32)
  labels_N = np.zeros((size,), np.int32)
  for i in range(size):
    tokens, labels_N[i] = expression(rng, data)
    tokens_NL[i, :len(tokens)] = [VOCAB[t] for t in tokens]
  return tokens_NL, labels_N


def check_data(data) -> None:
  for name in ("max_depth", "max_args", "min_length", "max_length", "num_train", "num_eval"):
    positive_int(f"data.{name}", data[name])
  if data.max_args < 2:
    raise ValueError(f"data.max_args must be >= 2, got {data.max_args}")
  if data.min_length > data.max_length:
    raise ValueError(f"data.min_length {data.min_length} exceeds data.max_length {data.max_length}")


def make_task(data, batch_size: int, seed: int) -> Task:
  check_data(data)
  train_tokens, train_labels = dataset(seed * 2, data.num_train, data)
  eval_tokens, eval_labels = dataset(seed * 2 + 1, data.num_eval, data)

  def train_batch(position):
    rows = stream_rng(seed, 0, position).integers(0, data.num_train, batch_size)
    return Batch(train_tokens[rows], train_labels[rows], np.ones(batch_size, np.float32))

  eval_batches = [Batch(eval_tokens[i:i + batch_size], eval_labels[i:i + batch_size],
                        np.ones(len(eval_labels[i:i + batch_size]), np.float32))
                  for i in range(0, data.num_eval, batch_size)]
  return Task(name="listops", vocab_size=len(VOCAB) + 1, num_classes=NUM_CLASSES, metric="eval_accuracy",
              max_len=data.max_length, train_batch=train_batch, eval_batches=eval_batches)
