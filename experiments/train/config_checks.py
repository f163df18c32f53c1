"""A training config's checks: every field's value, before any data or compilation, and which fields a run
reads (so that a command-line value no run reads stops the command)."""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp

from experiments import tasks
from experiments.train import models
from favor_jax.layers.settings import projection_role


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


def _count(name: str, value, zero: str) -> None:
  """``value`` is an int >= 0 (not a bool); ``zero`` says what 0 means."""
  _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
         f"{name} must be an int >= 0 (0: {zero}), got {value!r}")


def check_config(config) -> None:
  """Rejects bad values with a message naming the field, before any data or compilation."""
  a, m, t = config.attention, config.model, config.train
  _check(a.type in models.ATTENTION_TYPES,
         f"attention.type must be one of {models.ATTENTION_TYPES}, got {a.type!r}")
  for name, value in (("model.d_model", m.d_model), ("model.num_layers", m.num_layers),
                      ("model.num_heads", m.num_heads), ("model.mlp_dim", m.mlp_dim),
                      ("train.steps", t.steps), ("train.batch_size", t.batch_size),
                      ("train.log_every", t.log_every), ("train.eval_every", t.eval_every),
                      ("train.checkpoint_every", t.checkpoint_every)):
    tasks.positive_int(name, value)
  _count("model.short_conv", m.short_conv, "no short convolution")
  for name, value, allowed in (("model.dtype", m.dtype, models.DTYPES),
                                ("model.param_dtype", m.param_dtype, models.PARAM_DTYPES),
                                ("model.remat", m.remat, models.REMAT)):
    _check(value in allowed, f"{name} must be one of {allowed}, got {value!r}")
  tasks.positive_int("train.grad_accum_steps", t.grad_accum_steps)
  _check(m.positions in models.POSITIONS,
         f"model.positions must be one of {models.POSITIONS}, got {m.positions!r}")
  _check(m.d_model % m.num_heads == 0,
         f"model.d_model {m.d_model} must be divisible by model.num_heads {m.num_heads}")
  _check(m.positions != "rotary" or (m.d_model // m.num_heads) % 2 == 0,
         "rotary positions need an even head dim")
  _check(isinstance(t.seed, int) and not isinstance(t.seed, bool) and 0 <= t.seed < 2**63 - 1,
         f"train.seed must be an int >= 0 (it seeds the parameters, projections and data stream), got {t.seed!r}")
  _check(t.lr > 0 and math.isfinite(t.lr), f"train.lr must be a finite number > 0, got {t.lr}")
  _check(isinstance(t.warmup_steps, int) and 0 <= t.warmup_steps < t.steps,
         f"train.warmup_steps must be an int in [0, train.steps={t.steps}), got {t.warmup_steps!r}")
  _check(t.clip_norm >= 0 and t.weight_decay >= 0, "train.clip_norm and train.weight_decay must be >= 0")
  _check(isinstance(a.redraw_every, int) and a.redraw_every >= 0,
         f"attention.redraw_every must be a non-negative int (0 = never), got {a.redraw_every!r}")
  # FAVOR's fields are checked for softmax runs too: a command-line value applies to every variant of a sweep.
  # The config holds num_features and qk_head_dim (0: the model's head dim) whatever the kernel; the library's
  # rules (kernel, projection, window, chunk size, how they combine) run once, building the layers' settings.
  _check(a.get("qk_map", "none") in models.QK_MAPS,
         f"attention.qk_map must be one of {models.QK_MAPS}, got {a.get('qk_map')!r}")
  tasks.positive_int("attention.num_features", a.num_features)
  _count("attention.qk_head_dim", a.qk_head_dim, "the model's head dim")
  models.favor_settings(config, tasks.is_causal(config.task))
  _check(a.type == "favor" or a.qk_head_dim == 0,
         f"attention.qk_head_dim={a.qk_head_dim} is for FAVOR layers; softmax attention uses the model's head dim")
  relative = ("data.pack", config.data.get("pack", False)), ("data.eval_lengths", config.data.get("eval_lengths", ()))
  for name, value in relative:  # packed rows hold documents at every offset; other lengths run past max_len
    _check(not value or m.positions in models.ANY_LENGTH,
           f"{name}={value!r} needs relative positions (model.positions in {models.ANY_LENGTH}): learned absolute "
           "positions are tied to the offset in the row and cannot run past the training length")
  _check(not config.data.get("pack", False) or m.short_conv == 0,
         f"data.pack=True with model.short_conv={m.short_conv}: the short convolution would mix the last "
         "characters of one document into the next (set model.short_conv=0)")
  _check(m.positions != "rotary" or a.qk_head_dim % 2 == 0,
         f"rotary positions need an even attention.qk_head_dim, got {a.qk_head_dim}")
  _check(a.redraw_every == 0 or "attention.redraw_every" not in unused_fields(config),
         f"attention.redraw_every={a.redraw_every} has nothing to redraw: "
         f"{unused_fields(config).get('attention.redraw_every')}")
  rate = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1
  _check(rate(t.b1) and rate(t.b2),
         f"train.b1 and train.b2 (AdamW's decay rates) must be floats in [0, 1), got {t.b1!r}, {t.b2!r}")
  _check(0 <= t.final_lr_fraction <= 1,
         f"train.final_lr_fraction must be in [0, 1] (of train.lr), got {t.final_lr_fraction!r}")
  mesh = config.mesh
  if mesh.data != -1:  # -1: every device (the data axis's size is known once the devices are)
    tasks.positive_int("mesh.data (or -1: every device)", mesh.data)
  tasks.positive_int("mesh.sequence", mesh.sequence)
  check_batch_split(t, mesh.data if mesh.data != -1 else 1)
  _check(mesh.sequence == 1 or a.type == "favor",
         f"mesh.sequence={mesh.sequence} (sequence parallelism) needs attention.type='favor', got {a.type!r}")
  _check(isinstance(t.stop_after, int) and 0 <= t.stop_after <= t.steps,
         f"train.stop_after must be an int in [0, train.steps={t.steps}] (0 = run to the end), "
         f"got {t.stop_after!r}")
  tasks.check_data(config)


def check_decodes(config) -> None:
  """A causal LM's configuration can be sampled: the model ``experiments.generate`` decodes with (its key-value
  cache or its FAVOR layers' state) is traced for one of its blocks, init on one token then one decode step
  (shapes only: nothing is computed), so a configuration that trains but cannot decode is refused when training
  starts, not after the whole run. Classifiers (no sampling) are not traced. Not part of :func:`check_config`:
  tracing a model may start JAX's backend, and a multi-host run must call ``jax.distributed.initialize`` first
  (``experiments.main`` checks every config before that); ``training.train`` and a sweep's ``run`` call it.

  Raises:
    ValueError: naming the configuration and the decoder's own error.
  """
  if not tasks.is_causal(config.task):
    return
  one_block = copy.deepcopy(config)
  with one_block.unlocked():
    one_block.model.num_layers = 1  # every block is built alike: one shows whether they decode
  model = models.make_model(one_block, 2, 0, 2, decode=True, cache_len=2)

  def init_and_step(key, tokens_B1):
    variables = model.init(key, tokens_B1)
    return model.apply(variables, tokens_B1, mutable=["cache"])

  try:
    # Abstract arguments: a concrete key or array would start JAX's backend, and a multi-host run must call
    # jax.distributed.initialize before that (experiments/main.py checks the config first).
    jax.eval_shape(init_and_step, jax.ShapeDtypeStruct((2,), jnp.uint32), jax.ShapeDtypeStruct((1, 1), jnp.int32))
  except (ValueError, TypeError) as e:
    raise ValueError(f"attention.type={config.attention.type!r} with these settings trains but cannot be sampled "
                     f"(experiments.generate decodes it token by token): {e}") from None


def check_batch_split(t, data: int, resolved: str = "") -> None:
  """A ValueError unless ``t.batch_size`` (the train block) splits into ``t.grad_accum_steps`` microbatches over
  ``data`` devices; ``resolved``: where ``data`` came from (``mesh.data=-1``'s device count)."""
  _check(t.batch_size % (data * t.grad_accum_steps) == 0,
         f"train.batch_size {t.batch_size} must be divisible by mesh.data {data} × train.grad_accum_steps "
         f"{t.grad_accum_steps} (each microbatch is split over the data axis{resolved})")


def unused_fields(config) -> dict:
  """{dotted field: why this run does not read it}: the config file's labels, ``mesh.fsdp`` without a data
  axis, FAVOR's fields under softmax attention, the
  random projection's (``num_features``, ``projection``, ``redraw_every``) for a kernel without one,
  ``control_variate`` without a window, ``chunk_size`` where nothing is chunked (a classifier's bidirectional
  attention without a window); softmax
  reads ``attention.forget_gate`` and ``attention.alibi``."""
  unused = {k: "a label of the config file, not read by the run" for k in ("quick", "config_name", "experiment")
            if k in config}
  if config.mesh.data == 1:
    unused["mesh.fsdp"] = "mesh.data is 1: no data axis to split parameters over"
  unused.update(tasks.unused_data(config))
  a = config.attention
  if a.type != "favor":  # softmax reads its type and the gates
    return {**unused, **{f"attention.{k}": "softmax attention has no FAVOR fields" for k in a
                         if k not in ("type", "forget_gate", "alibi")}}
  if projection_role(a.kernel) != "random":
    why = f"kernel {a.kernel!r} has no random projection"
    unused.update({f"attention.{k}": why for k in ("num_features", "projection", "redraw_every")})
  if not a.window and "control_variate" in a:
    unused["attention.control_variate"] = "attention.window is 0: the control variate corrects a hybrid's window"
  if not a.window and not tasks.is_causal(config.task):
    unused["attention.chunk_size"] = f"task {config.task!r} attends both ways and attention.window is 0: no chunks"
  return unused


def check_overrides_used(runs, overrides: dict) -> None:
  """Stops on a command-line value that no run reads: ``runs`` is [(name, field prefix, training config)]
  (prefix "" for a sweep's runs, "model." for a study's captured model)."""
  for field, value in overrides.items():
    why = {}
    for name, prefix, c in runs:
      if field.startswith(prefix):
        reason = unused_fields(c).get(field[len(prefix):])
        if reason is None:
          break  # read by this run
        why[name] = reason
    else:
      if why:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in why.items())
        raise ValueError(f"--config.{field}={value!r} is read by none of the runs ({reasons}): drop it, or "
                         "select runs that read it (--config.only=NAMES, or set the fields they need)")
