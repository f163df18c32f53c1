"""Samples text from a trained causal LM: a run directory's newest checkpoint and the config it was trained with.

    python -m experiments.generate --workdir=RUN --prompt=TEXT [--prompt=TEXT ...] --max_new_tokens=N \
        [--temperature=1.0] [--top_k=0] [--seed=0]
    python -m experiments.generate --workdir=RUN --prompt_ids=1,2,3 [--prompt_ids=...] --max_new_tokens=N

RUN is one run's directory (a study's ``WORKDIR/RUN_NAME``, holding ``checkpoints/`` and ``run_config.json``;
the study's ``config.json`` is read from RUN or the directory above). Each ``--prompt`` or ``--prompt_ids`` is one
sequence of the batch: a text prompt is encoded with the tokenizer the run trained with (``tokenizer.json`` in RUN,
kept by training from ``data.tokenizer``), or is its bytes for a byte-level model (any bytes: a command line's bytes
that are not UTF-8 come through as themselves); ``--prompt_ids`` gives token ids directly. The newest checkpoint
that restores is used (training's rule: a damaged newer one is named and skipped). FAVOR models decode through
their layers' constant-size state, softmax models through a key-value cache. Prints each prompt with its
continuation (its bytes as they are); a user error prints one line, ``error: ...``, and exits 1.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

from experiments.train import generation


def define_flags() -> None:
  """The command's flags (defined when it runs as a program: ``experiments.main`` defines its own --workdir)."""
  flags.DEFINE_string("workdir", None, "a run's directory (checkpoints/, run_config.json)")
  flags.DEFINE_multi_string("prompt", None, "a text prompt (repeat the flag for a batch of prompts)")
  flags.DEFINE_multi_string("prompt_ids", None, "a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable)")
  flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate after each prompt")
  flags.DEFINE_float("temperature", 1.0, "softmax temperature (0, or below float32's smallest normal number: the "
                     "most likely token)")
  flags.DEFINE_integer("top_k", 0, "sample among the k most likely tokens (0: all)")
  flags.DEFINE_integer("seed", 0, "the sampling seed")
  flags.mark_flags_as_required(["workdir"])


def parse_ids(text: str) -> list[int]:
  """``"1,2,3"`` -> [1, 2, 3]; a ValueError naming ``--prompt_ids`` for anything else."""
  try:
    ids = [int(t) for t in text.split(",")]
  except ValueError:
    raise ValueError(f"--prompt_ids={text!r}: give comma-separated token ids, e.g. 1,2,3") from None
  return ids


def sample_run(workdir: str, prompts: list, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
               seed: int = 0, progress=lambda message: None) -> list[tuple[bytes, bytes]]:
  """(prompt, continuation) of each prompt, as bytes, sampled from the run in ``workdir``.

  Args:
    workdir: the run's directory.
    prompts: each a text (str or bytes: encoded with the run's tokenizer, or its bytes for a byte vocabulary) or
      a list of token ids.
    max_new_tokens: tokens to generate after each prompt.
    temperature: softmax temperature (0: greedy).
    top_k: sample among this many most likely tokens (0: all).
    seed: the sampling seed.
    progress: told of each damaged checkpoint skipped.

  Returns:
    Per prompt, the bytes of its tokens and of the generated ones (the tokenizer's, or the byte tokens; ids
    without bytes shown as ``<id>``).

  Raises:
    ValueError: for a directory without a run, a text prompt to a run without a tokenizer or byte vocabulary,
      or a bad argument.
  """
  config, variables, _ = generation.load_run(workdir, progress)
  vocab = variables["params"]["embed"]["embedding"].shape[0]
  tokenizer = generation.load_tokenizer(workdir, config)
  tokens = [list(p) if isinstance(p, list) else generation.encode(p, vocab, tokenizer) for p in prompts]
  new = generation.generate(config, variables, tokens, max_new_tokens, seed=seed, temperature=temperature,
                            top_k=top_k)
  return [(generation.decode_bytes(p, tokenizer), generation.decode_bytes(t, tokenizer)) for p, t in zip(tokens, new)]


def run(workdir: str, prompts: list, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
        seed: int = 0) -> list[str]:
  """The continuation of each prompt as text (:func:`sample_run`'s; bytes that are not UTF-8 shown as U+FFFD)."""
  return [new.decode("utf-8", errors="replace")
          for _, new in sample_run(workdir, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                                   seed=seed)]


def main(argv):
  del argv
  f = flags.FLAGS
  logging.set_verbosity(logging.ERROR)  # orbax logs each restore at INFO and WARNING
  say = lambda message: print(f"warning: {message}", file=sys.stderr, flush=True)
  try:
    if not f.prompt and not f.prompt_ids:
      raise ValueError("give a prompt: --prompt=TEXT or --prompt_ids=1,2,3 (either repeatable)")
    prompts = list(f.prompt or []) + [parse_ids(p) for p in f.prompt_ids or []]
    samples = sample_run(f.workdir, prompts, f.max_new_tokens, temperature=f.temperature, top_k=f.top_k,
                         seed=f.seed, progress=say)
  except (ValueError, ImportError) as e:  # the user's errors: one line, no traceback
    sys.exit(f"error: {' '.join(str(e).split())}")
  for given, (prompt, text) in zip(prompts, samples):
    sys.stdout.write(f"--- {given!r}\n")
    sys.stdout.flush()
    sys.stdout.buffer.write(prompt + text + b"\n")  # the bytes as they are (a terminal shows UTF-8 as text)
    sys.stdout.buffer.flush()


if __name__ == "__main__":
  define_flags()
  app.run(main)
