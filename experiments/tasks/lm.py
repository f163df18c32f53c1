"""Language-model windows over a corpus: the one rule the text task and Shakespeare share.

A :class:`Corpus` is a token array (memory-mapped or not: windows read only
their own tokens) and the offsets where its documents start. A training batch
is ``batch_size`` windows at offsets drawn from ``stream_rng(seed, 0,
position)``, so it is a pure function of (seed, position) and any batch can be
built alone (a resumed run sees the batches an uninterrupted one would); the
held-out set is evenly spaced windows over the held-out corpus, the same for
every run. Packed (``data.pack``): a window carries each token's document as
its segment id (no attention across a boundary), and a target in the next
document carries no loss.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from experiments.tasks import Batch, Task, stream_rng

BYTES = np.ones(256, np.int64)  # a byte vocabulary's bytes per token (``lm_task``'s default)


class Corpus(NamedTuple):
  tokens: np.ndarray  # [N] token ids (any int dtype; np.memmap allowed)
  starts: np.ndarray  # int64 [documents]: sorted offsets where documents start, the first 0


def windows(corpus: Corpus, offsets, length: int, pack: bool) -> Batch:
  """The batch of ``length``-token windows (inputs and next-token targets) starting at ``offsets``."""
  idx_BL = np.asarray(offsets, np.int64)[:, None] + np.arange(length + 1)
  chunk_BL = np.asarray(corpus.tokens[idx_BL]).astype(np.int32)
  if not pack:
    return Batch(chunk_BL[:, :-1], chunk_BL[:, 1:], np.ones((len(idx_BL), length), np.float32))
  doc_BL = (np.searchsorted(corpus.starts, idx_BL, side="right") - 1).astype(np.int32)  # the document's index
  weights_BL = (doc_BL[:, 1:] == doc_BL[:, :-1]).astype(np.float32)
  return Batch(chunk_BL[:, :-1], chunk_BL[:, 1:], weights_BL, doc_BL[:, :-1])


def lm_task(name: str, vocab_size: int, train: Corpus, valid: Corpus, data, batch_size: int, seed: int,
            split: str = "", token_bytes: np.ndarray | None = BYTES) -> Task:
  """A causal LM task over ``train`` and ``valid``: ``data.seq_len``-token training windows at random offsets,
  ``data.num_eval_batches`` batches of evenly spaced held-out windows, held-out sets at ``data.eval_lengths``
  (as many tokens each), packed by ``data.pack``.

  ``token_bytes``: the bytes of text each id stands for (:data:`BYTES`: the ids are bytes; None: unknown). The
  headline metric: bits per byte (``eval_bpc`` for a byte vocabulary, where a token is a byte; else
  ``eval_bits_per_byte``), or bits per token (``eval_bits_per_token``) where the bytes are unknown."""
  if token_bytes is BYTES:
    metric = "eval_bpc"
  else:
    metric = "eval_bits_per_token" if token_bytes is None else "eval_bits_per_byte"
  if token_bytes is not None and len(token_bytes) != vocab_size:
    raise ValueError(f"token_bytes has {len(token_bytes)} entries for a vocabulary of {vocab_size}")
  pack, lengths = data.get("pack", False), tuple(data.get("eval_lengths", ()))
  longest = max((data.seq_len,) + lengths)
  if min(len(train.tokens), len(valid.tokens)) < longest + 1:
    raise ValueError(f"data.seq_len {data.seq_len} or data.eval_lengths {lengths} needs {longest + 1} tokens, but the "
                     f"training part has {len(train.tokens)} and the held-out part {len(valid.tokens)}")

  def train_batch(position):
    offsets = stream_rng(seed, 0, position).integers(0, len(train.tokens) - data.seq_len, batch_size)
    return windows(train, offsets, data.seq_len, pack)

  def held_out(length):
    count = max(1, data.num_eval_batches * batch_size * data.seq_len // length)
    offsets = np.linspace(0, len(valid.tokens) - length - 1, count).astype(np.int64)
    return [windows(valid, offsets[i:i + batch_size], length, pack) for i in range(0, count, batch_size)]

  return Task(name=name, vocab_size=vocab_size, num_classes=0, metric=metric, max_len=longest,
              train_batch=train_batch, eval_batches=held_out(data.seq_len),
              length_evals=tuple((length, held_out(length)) for length in lengths), split=split,
              token_bytes=None if token_bytes is None else np.asarray(token_bytes, np.int64))


def join(parts: list[bytes], separator: bytes = b"") -> Corpus:
  """The corpus of byte strings ``parts``, one document each; ``separator`` after each but the last belongs to
  the document before it."""
  parts = [p + (separator if i < len(parts) - 1 else b"") for i, p in enumerate(parts)]
  starts = np.concatenate([[0], np.cumsum([len(p) for p in parts[:-1]], dtype=np.int64)]).astype(np.int64)
  return Corpus(np.frombuffer(b"".join(parts), np.uint8), starts)
