"""Your own tokenizer: a byte-level BPE of HuggingFace ``tokenizers``, trained on your corpus, any bytes in and out.

The tokenizer is the library's (``models.BPE`` learned by ``trainers.BpeTrainer`` behind its ``ByteLevel``
pre-tokenizer and decoder: GPT-2's scheme); nothing here splits or merges text. What this module adds is the
edge the library's ``str`` interface leaves open: bytes that are not UTF-8. Each of the 256 bytes is a token of
the vocabulary (the trainer's initial alphabet), so a byte the library cannot take as text is encoded as its own
byte token, and every token decodes to the bytes it stands for (its characters in the byte alphabet, one byte
each) — :func:`token_bytes` counts them, which gives bits per byte for any held-out text.

``END_OF_DOCUMENT`` (id 0) is a special token: it ends each document of a token file
(``data.document_separator``), stands for no bytes of the text, and decodes to its name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import numpy as np

END_OF_DOCUMENT = "<|endoftext|>"  # id 0: ends each document of a token file; no bytes of the text
_INVALID = re.compile("([\udc80-\udcff]+)")  # bytes that are not UTF-8, as ``surrogateescape`` decodes them


def _library():
  try:
    import tokenizers
  except ImportError as e:  # an optional dependency: the experiments extra
    raise ImportError("your own tokenizer needs HuggingFace tokenizers: pip install 'favor_jax[experiments]' "
                      "(or pip install tokenizers)") from e
  return tokenizers


def byte_alphabet() -> dict[int, str]:
  """{byte: its character in the byte-level alphabet}: GPT-2's table (Radford et al. 2019, ``bytes_to_unicode``),
  the one ``tokenizers.pre_tokenizers.ByteLevel`` maps bytes with (tests check the two agree): printable bytes
  stand for themselves, the others for the characters from U+0100 on, in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  table, extra = {b: chr(b) for b in printable}, 0
  for b in range(256):
    if b not in table:
      table[b], extra = chr(256 + extra), extra + 1
  return dict(sorted(table.items()))


def pieces(data: bytes) -> list[str | int]:
  """``data`` cut into its UTF-8 runs (str) and, between them, the bytes that are not UTF-8 (int each)."""
  out: list[str | int] = []
  for i, part in enumerate(_INVALID.split(data.decode("utf-8", "surrogateescape"))):
    if i % 2:
      out += list(part.encode("utf-8", "surrogateescape"))
    elif part:
      out.append(part)
  return out


def train(documents: Iterable[bytes], vocab_size: int, min_frequency: int = 2):
  """A byte-level BPE tokenizer of ``vocab_size`` ids (fewer where the corpus has fewer merges), learned on the
  UTF-8 text of ``documents``; id 0 is ``END_OF_DOCUMENT``, the 256 bytes follow.

  Raises:
    ValueError: for a ``vocab_size`` below 257 (the end-of-document token and the 256 bytes) or an empty corpus.
  """
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
    raise ValueError(f"vocab_size must be an int >= 257 (the 256 bytes and {END_OF_DOCUMENT}), got {vocab_size!r}")
  lib = _library()
  tokenizer = lib.Tokenizer(lib.models.BPE())
  tokenizer.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)  # a text's bytes, nothing added
  tokenizer.decoder = lib.decoders.ByteLevel()
  trainer = lib.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                    special_tokens=[END_OF_DOCUMENT], show_progress=False,
                                    initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
  seen = [0]

  def texts():
    for document in documents:
      seen[0] += len(document)
      yield from (p for p in pieces(document) if isinstance(p, str))

  tokenizer.train_from_iterator(texts(), trainer=trainer)
  if not seen[0]:
    raise ValueError("the corpus is empty: a tokenizer needs text to learn from")
  return tokenizer


def load(path: str, field: str = "data.tokenizer", text: str | None = None):
  """The tokenizer JSON at ``path`` (``Tokenizer.save``'s file), or ``text`` read from it already (a run directory
  on a bucket), checked to be byte-level with every byte a token.

  Raises:
    ValueError: naming ``field`` and ``path`` for a missing or unreadable file, or a tokenizer that cannot encode
      every byte.
  """
  if text is None and not os.path.isfile(path):
    raise ValueError(f"{field}={path!r} is not a file (a tokenizer JSON, as experiments.tokenize writes it)")
  lib = _library()
  try:
    tokenizer = lib.Tokenizer.from_file(path) if text is None else lib.Tokenizer.from_str(text)
  except Exception as e:  # the library raises its own exception type for any bad file
    raise ValueError(f"{field}={path!r} is not a tokenizers JSON file ({type(e).__name__}: {e})") from None
  missing = [b for b, c in byte_alphabet().items() if tokenizer.token_to_id(c) is None]
  if missing:
    raise ValueError(f"{field}={path!r} lacks tokens for {len(missing)} of the 256 bytes (e.g. byte {missing[0]}): "
                     "not a byte-level tokenizer; make one with experiments.tokenize")
  return tokenizer


def _special(tokenizer) -> dict[int, str]:
  return {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


def token_bytes(tokenizer) -> np.ndarray:
  """int64 [vocab]: how many bytes of text each id stands for (a special token: 0)."""
  special = _special(tokenizer)
  return np.array([0 if i in special else len(tokenizer.id_to_token(i))
                   for i in range(tokenizer.get_vocab_size())], np.int64)


def encode(tokenizer, data: bytes) -> list[int]:
  """The ids of ``data``, any bytes: its UTF-8 runs through the tokenizer, each byte that is not UTF-8 its own
  byte token; text that spells a special token's name is text (its bytes' tokens), never the special id.
  Decoding them (:func:`decode`) gives ``data`` back."""
  alphabet = byte_alphabet()
  tokenizer.encode_special_tokens = True  # not saved in the JSON: set for every call
  parts = pieces(data)
  runs = iter(tokenizer.encode_batch([p for p in parts if isinstance(p, str)], add_special_tokens=False))
  ids: list[int] = []
  for p in parts:
    ids += next(runs).ids if isinstance(p, str) else [tokenizer.token_to_id(alphabet[p])]
  return ids


def decode(tokenizer, ids: Iterable[int]) -> bytes:
  """The bytes ``ids`` stand for (a special token: its name, e.g. ``END_OF_DOCUMENT``, as UTF-8; an id beyond the
  tokenizer's vocabulary, which a padded model vocabulary may sample: ``<id>``)."""
  special, inverse = _special(tokenizer), {c: b for b, c in byte_alphabet().items()}
  out = bytearray()
  for i in ids:
    i = int(i)
    if i in special:
      out += special[i].encode("utf-8")
    else:
      token = tokenizer.id_to_token(i)  # None: an id of a vocabulary padded beyond the tokenizer's
      out += f"<{i}>".encode() if token is None else bytes(inverse[c] for c in token)
  return bytes(out)
