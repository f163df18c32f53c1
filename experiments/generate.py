"""Samples text from a trained causal LM: a run directory's newest checkpoint and the config it was trained with.

    python -m experiments.generate --workdir=RUN --prompt=TEXT [--prompt=TEXT ...] --max_new_tokens=N \
        [--temperature=1.0] [--top_k=0] [--seed=0]

RUN is one run's directory (a study's ``WORKDIR/RUN_NAME``, holding ``checkpoints/`` and ``run_config.json``;
the study's ``config.json`` is read from RUN or the directory above). Each ``--prompt`` is one sequence of the
batch (UTF-8 bytes: a byte-level model's vocabulary). FAVOR models decode through their layers' constant-size
state, softmax models through a key-value cache. Prints each prompt with its continuation.
"""

from __future__ import annotations

from absl import app, flags

from experiments.train import generation


def define_flags() -> None:
  """The command's flags (defined when it runs as a program: ``experiments.main`` defines its own --workdir)."""
  flags.DEFINE_string("workdir", None, "a run's directory (checkpoints/, run_config.json)")
  flags.DEFINE_multi_string("prompt", None, "a prompt (repeat the flag for a batch of prompts)")
  flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate after each prompt")
  flags.DEFINE_float("temperature", 1.0, "softmax temperature (0: the most likely token)")
  flags.DEFINE_integer("top_k", 0, "sample among the k most likely tokens (0: all)")
  flags.DEFINE_integer("seed", 0, "the sampling seed")
  flags.mark_flags_as_required(["workdir", "prompt"])

def run(workdir: str, prompts: list[str], max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
        seed: int = 0) -> list[str]:
  """The continuation of each prompt (text), sampled from the run in ``workdir``.

  Args:
    workdir: the run's directory.
    prompts: the prompts, one sequence each.
    max_new_tokens: tokens (bytes) to generate after each prompt.
    temperature: softmax temperature (0: greedy).
    top_k: sample among this many most likely tokens (0: all).
    seed: the sampling seed.

  Returns:
    The generated text of each prompt (bytes that are not UTF-8 shown as U+FFFD).

  Raises:
    ValueError: for a directory without a run, a model whose vocabulary is not bytes, or a bad argument.
  """
  config, variables, _ = generation.load_run(workdir)
  vocab = variables["params"]["embed"]["embedding"].shape[0]
  tokens = [generation.encode(p, vocab) for p in prompts]
  new = generation.generate(config, variables, tokens, max_new_tokens, seed=seed, temperature=temperature,
                            top_k=top_k)
  return [generation.decode(t) for t in new]


def main(argv):
  del argv
  f = flags.FLAGS
  texts = run(f.workdir, f.prompt, f.max_new_tokens, temperature=f.temperature, top_k=f.top_k, seed=f.seed)
  for prompt, text in zip(f.prompt, texts):
    print(f"--- {prompt!r}\n{prompt}{text}", flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
