"""Trains a byte-level BPE tokenizer on your corpus and writes the token file the text task trains on.

    python -m experiments.tokenize --corpus=PATH --vocab_size=N --out=DIR

PATH is a file or a folder (its files, recursively, in sorted order, hidden ones skipped: the text task's rule),
each file one document, read as bytes. Writes DIR/tokenizer.json (HuggingFace ``tokenizers``' file),
DIR/tokens.npy (the ids of every document, each followed by the end-of-document id 0; uint16, or uint32 for a
vocabulary beyond 65,536) and DIR/tokens.json (what was read and written), then prints the command that trains
on them. The tokenizer is learned on the whole corpus, held-out part included (as GPT-2's was); any bytes encode
(see ``experiments/tasks/tokenizer.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from absl import app, flags

from experiments.tasks import text, tokenizer

TOKENS, TOKENIZER, RECORD = "tokens.npy", "tokenizer.json", "tokens.json"


def define_flags() -> None:
  """The command's flags."""
  flags.DEFINE_string("corpus", None, "a file or a folder of files (each one document, read as bytes)")
  flags.DEFINE_integer("vocab_size", None, "the tokenizer's vocabulary (>= 257: the 256 bytes, an end-of-document "
                       "id, merges)")
  flags.DEFINE_string("out", None, "the folder for tokenizer.json, tokens.npy and tokens.json")
  flags.DEFINE_integer("min_frequency", 2, "a merge is learned only from a pair seen at least this often")
  flags.mark_flags_as_required(["corpus", "vocab_size", "out"])


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def run(corpus: str, vocab_size: int, out: str, min_frequency: int = 2, progress=lambda message: None) -> dict:
  """Learns the tokenizer on ``corpus`` and writes ``out``/{tokenizer.json, tokens.npy, tokens.json}.

  Args:
    corpus: a file or a folder of files (``experiments.tasks.text.files``' rule), each one document.
    vocab_size: the vocabulary asked for (the corpus may hold fewer merges: tokens.json records the size).
    out: the folder to write (created; files of these names in it are replaced).
    min_frequency: the fewest occurrences of a pair that is merged.
    progress: called with a line of text at each stage.

  Returns:
    The record written to tokens.json (files, bytes, tokens, vocabulary, the training command).

  Raises:
    ValueError: for a corpus that is not a file or folder with files, or a bad ``vocab_size``.
  """
  found = text.files(corpus)
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f"--out={out!r} is a file, not a folder")
  start = time.time()
  progress(f"learning a {vocab_size}-id byte-level BPE on {len(found)} file(s) of {corpus}")
  learned = tokenizer.train((_read(p) for p in found.values()), vocab_size, min_frequency)
  vocab = learned.get_vocab_size()
  dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
  progress(f"encoding the corpus ({vocab} ids)")
  ids, size = [], 0
  for path in found.values():
    document = _read(path)
    size += len(document)
    ids.append(np.asarray(tokenizer.encode(learned, document) + [0], dtype))
  tokens = np.concatenate(ids)
  os.makedirs(out, exist_ok=True)
  learned.save(os.path.join(out, TOKENIZER))
  np.save(os.path.join(out, TOKENS), tokens)
  command = (f"python -m experiments.main --config=experiments/configs/text.py --workdir=WORKDIR "
             f"--config.data.token_file={os.path.join(out, TOKENS)} --config.data.tokenizer="
             f"{os.path.join(out, TOKENIZER)} --config.data.document_separator=0")
  record = dict(corpus=os.path.abspath(corpus), files=len(found), bytes=size, tokens=int(len(tokens)),
                documents=len(found), vocab_size=vocab, vocab_size_asked=vocab_size, dtype=np.dtype(dtype).name,
                bytes_per_token=size / max(1, len(tokens) - len(found)), end_of_document_id=0,
                seconds=time.time() - start, train_command=command)
  with open(os.path.join(out, RECORD), "w") as f:
    json.dump(record, f, indent=1)
  return record


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    record = run(f.corpus, f.vocab_size, f.out, f.min_frequency, progress=lambda m: print(m, flush=True))
  except (ValueError, ImportError) as e:
    sys.exit(f"error: {e}")
  print(f"wrote {f.out}/{{{TOKENIZER}, {TOKENS}, {RECORD}}}: {record['tokens']:,} tokens of {record['bytes']:,} "
        f"bytes ({record['bytes_per_token']:.2f} bytes per token), vocabulary {record['vocab_size']}")
  print(f"train on them:\n  {record['train_command']}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
