"""Sampling from a trained causal LM: a run directory's config and newest checkpoint, the decoding model, the loop.

FAVOR models decode through their layers' constant-size state (``FavorAttention(decode=True)``); softmax models
through a key-value cache (``models.SoftmaxAttention``) of the longest sequence's length. Prompts of different
lengths share one batch: the common prefix is one prompt call, then every row takes one token per step, its
prompt's while it lasts, then a sampled one, so every row's positions are the same and nothing is padded.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from experiments.configs import common
from experiments.train import models, paths
from experiments.train.checkpointing import ITEM, RUN_CONFIG, TOKENIZER, newest_that_restores

BYTES = 256  # a vocabulary of this size is bytes (without a tokenizer): a prompt's bytes are its tokens
# Positive temperatures below this (float32's smallest normal number) sample as temperature 0, the most likely
# token: 1/temperature is beyond float32's range (and the temperature itself rounds to 0 below ~7e-46).
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


def load_run(workdir: str, progress=lambda message: None) -> tuple[ml_collections.ConfigDict, dict, int]:
  """(config, variables {"params", "favor"}, step) of the run in ``workdir``: its study's ``config.json``
  (in ``workdir`` or the directory above, as ``experiments.main`` writes it) with the run's own fields
  (``run_config.json``) set over it, and its newest checkpoint that restores (training's rule,
  ``checkpointing.newest_that_restores``: each newer one that does not is named to ``progress`` and skipped,
  nothing moved).

  Raises:
    ValueError: if ``workdir`` holds no checkpoint (or none that restores), or no config.json beside or above it.
  """
  workdir = paths.check(workdir)  # a local path made absolute, or a gs:// URL (its package installed)
  directory = os.path.join(workdir, "checkpoints")
  steps = ocp.CheckpointManager(directory).all_steps() if paths.is_dir(directory) else []
  if not steps:
    raise ValueError(f"--workdir={workdir} holds no checkpoint (checkpoints/STEP): give a run's directory, the "
                     "one with checkpoints/ and run_config.json (a study's WORKDIR/RUN_NAME)")
  found = [p for p in (os.path.join(workdir, "config.json"), os.path.join(paths.parent(workdir), "config.json"))
           if paths.exists(p)]
  if not found:
    raise ValueError(f"no config.json in {workdir} or the directory above it (experiments.main writes it): the "
                     "run's model cannot be rebuilt without it")
  config = ml_collections.ConfigDict(json.loads(paths.read_text(found[0]))["config"])
  run_config = os.path.join(workdir, RUN_CONFIG)
  if paths.exists(run_config):
    common.set_fields(config, json.loads(paths.read_text(run_config)), what=f"{RUN_CONFIG} field")
  restore = lambda step: ocp.StandardCheckpointer().restore(os.path.join(directory, str(step), ITEM))
  step, restored, _ = newest_that_restores(directory, steps, restore, progress)
  state = restored if isinstance(restored, dict) else dict(enumerate(restored))
  pick = lambda name, i: state[name] if name in state else state[str(i)] if str(i) in state else state[i]
  return config, {"params": pick("params", 2), "favor": pick("favor", 3) or {}}, step


def decoder(config, variables: dict, cache_len: int) -> models.Transformer:
  """The run's causal LM built to decode (softmax: a key-value cache of ``cache_len`` positions); its vocabulary
  and learned positions read off ``variables``' embeddings."""
  params = variables["params"]
  vocab = params["embed"]["embedding"].shape[0]
  max_len = params["position"]["embedding"].shape[0] if "position" in params else cache_len
  if cache_len > max_len:
    raise ValueError(f"the run's model has learned positions for {max_len} tokens; prompt + max_new_tokens needs "
                     f"{cache_len}: shorten them (rotary or no positions run at any length)")
  return models.make_model(config, vocab, 0, max_len, decode=True, cache_len=cache_len)


def empty_cache(model: models.Transformer, batch: int) -> dict:
  """The ``cache`` collection of ``model`` (a decoder) for ``batch`` sequences, before any token."""
  return _init_cache(model, batch)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_cache(model, batch):
  return model.init(jax.random.PRNGKey(0), jnp.zeros((batch, 1), jnp.int32))["cache"]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode_step(model, variables, cache, tokens_Bl):
  """(logits [B, l, vocab] in float32, new cache): the model continued by ``tokens_Bl`` from ``cache``."""
  logits, mutated = model.apply({**variables, "cache": cache}, tokens_Bl, mutable=["cache"])
  return logits.astype(jnp.float32), mutated["cache"]


def sample(logits_BV, key, temperature: float, top_k: int):
  """One token per row: argmax for ``temperature`` 0 (and below ``MIN_TEMPERATURE``), else from
  softmax(logits / temperature) over the ``top_k`` most likely tokens (0: all). The logits are shifted by their
  maximum before the division, so no quotient overflows: the most likely tokens get 0, the rest at most 0."""
  if temperature < MIN_TEMPERATURE:
    return jnp.argmax(logits_BV, -1).astype(jnp.int32)
  logits_BV = (logits_BV - logits_BV.max(-1, keepdims=True)) / temperature
  if top_k:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV).astype(jnp.int32)


def check_sampling(max_new_tokens, temperature, top_k, vocab: int) -> None:
  """ValueError naming ``max_new_tokens`` (an int >= 1), ``temperature`` (>= 0) or ``top_k`` (0..vocab)."""
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  number = isinstance(temperature, (int, float, np.integer, np.floating)) and not isinstance(temperature, bool)
  if not number or not 0 <= temperature < np.inf:
    raise ValueError(f"temperature must be a finite number >= 0 (0, or below {MIN_TEMPERATURE:.3g}: the most likely "
                     f"token), got {temperature!r}")
  if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= vocab:
    raise ValueError(f"top_k must be an int in [0, {vocab}] (0: every token), got {top_k!r}")


def generate(config, variables: dict, prompts: list[list[int]], max_new_tokens: int, *, seed: int = 0,
             temperature: float = 1.0, top_k: int = 0) -> list[list[int]]:
  """``max_new_tokens`` tokens after each prompt (token ids), sampled from the run's model by decoding.

  Args:
    config: the run's training config.
    variables: its ``params`` and ``favor`` (:func:`load_run`).
    prompts: one list of token ids (one or more) per sequence.
    max_new_tokens: tokens to generate per prompt.
    seed: the sampling key's seed (the same seed, prompts and model give the same tokens).
    temperature: softmax temperature (0: greedy).
    top_k: sample among this many most likely tokens (0: all).

  Returns:
    The new tokens of each prompt.

  Raises:
    ValueError: for an empty prompt, a token outside the vocabulary, or a bad sampling argument (named).
  """
  vocab = variables["params"]["embed"]["embedding"].shape[0]
  check_sampling(max_new_tokens, temperature, top_k, vocab)
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token (an empty prompt has nothing to continue)")
  if any(not 0 <= t < vocab for p in prompts for t in p):
    raise ValueError(f"prompt tokens must be ids in [0, {vocab})")
  longest, shortest = max(map(len, prompts)), min(map(len, prompts))
  model = decoder(config, variables, longest + max_new_tokens)
  cache = empty_cache(model, len(prompts))
  fed = np.zeros((len(prompts), longest + max_new_tokens), np.int32)  # each row: prompt, then its samples
  for row, p in enumerate(prompts):
    fed[row, :len(p)] = p
  logits, cache = decode_step(model, variables, cache, jnp.asarray(fed[:, :shortest]))
  key = jax.random.PRNGKey(seed)
  lengths = np.array([len(p) for p in prompts])
  for t in range(shortest, longest + max_new_tokens):
    drawn = np.asarray(sample(logits[:, -1], jax.random.fold_in(key, t), temperature, top_k))
    fed[:, t] = np.where(t < lengths, fed[:, t], drawn)  # the prompt's token while it lasts
    if t + 1 < longest + max_new_tokens:
      logits, cache = decode_step(model, variables, cache, jnp.asarray(fed[:, t:t + 1]))
  return [fed[row, n:n + max_new_tokens].tolist() for row, n in enumerate(lengths)]


def load_tokenizer(workdir: str, config):
  """The tokenizer the run in ``workdir`` trained with: its copy (``TOKENIZER``, kept by training), else the file
  ``data.tokenizer`` names where it still exists; None for a run without one (bytes, or bare token ids)."""
  from experiments.tasks import tokenizer
  kept = os.path.join(workdir, TOKENIZER)
  if paths.exists(kept):  # read through the path layer: the run directory may be on a bucket
    return tokenizer.load(kept, field=f"the run's tokenizer ({TOKENIZER})", text=paths.read_text(kept))
  named = config.data.get("tokenizer", "") if "data" in config else ""
  return tokenizer.load(named) if named and os.path.isfile(named) else None


def encode(text: str | bytes, vocab: int, tokenizer=None) -> list[int]:
  """``text`` as token ids: with the run's ``tokenizer``, its ids; else, for a byte vocabulary, its bytes; else a
  ValueError. Any bytes encode: a str is taken as UTF-8 with ``surrogateescape`` (how Python reads a command
  line's bytes that are not UTF-8), so those bytes come back as themselves."""
  data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")
  if tokenizer is not None:
    from experiments.tasks import tokenizer as tokenizers
    ids = tokenizers.encode(tokenizer, data)
    if ids and max(ids) >= vocab:
      raise ValueError(f"the tokenizer's ids reach {max(ids)}, beyond the run's vocabulary of {vocab}: not the "
                       "tokenizer this run trained with")
    return ids
  if vocab != BYTES:
    raise ValueError(f"this run's vocabulary has {vocab} ids, not {BYTES} bytes, and the run holds no tokenizer "
                     f"({TOKENIZER}, data.tokenizer): a text prompt has no tokens in it; give token ids (--prompt_ids)")
  return list(data)


def decode_bytes(tokens: list[int], tokenizer=None) -> bytes:
  """The bytes ``tokens`` stand for: the tokenizer's (a special token: its name), else byte tokens themselves;
  ids a byte vocabulary lacks (a token-id run without its tokenizer) shown as ``<id>``."""
  if tokenizer is not None:
    from experiments.tasks import tokenizer as tokenizers
    return tokenizers.decode(tokenizer, tokens)
  return b"".join(bytes([t]) if 0 <= t < BYTES else f"<{t}>".encode() for t in tokens)


def decode(tokens: list[int], tokenizer=None) -> str:
  """``tokens`` as text (:func:`decode_bytes`; bytes that are not UTF-8 shown as U+FFFD)."""
  return decode_bytes(tokens, tokenizer).decode("utf-8", errors="replace")
