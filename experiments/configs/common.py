"""Fields every training config shares (model, attention, optimiser, logging); each config overrides some.

Also the rules every study shares: the quick version, dotted overrides, variants (the work directory's are
``experiments.train.paths.check_workdir``'s).
"""

import re

import ml_collections


def is_quick(arg) -> bool:
  """Whether ``get_config(arg)`` is asked for the quick version: ``arg`` is the text after ':' in
  ``--config=FILE.py:quick`` (ml_collections passes it to ``get_config``), None without one."""
  if arg is None or arg == "":
    return False
  if arg == "quick":
    return True
  raise ValueError(f"a config file takes 'quick' or nothing after ':' (--config=FILE.py:quick), got {arg!r}")


def set_fields(config, fields: dict, what: str = "override"):
  """Sets dotted fields (``{"train.lr": 1e-3}``) in place; a name that is not a field raises."""
  for field, value in dict(fields).items():
    parent, _, leaf = field.rpartition(".")
    node = config
    for part in filter(None, parent.split(".")):
      if part not in node:
        raise ValueError(f"{what} {field!r} is not a config field")
      node = node[part]
    if leaf not in node:
      raise ValueError(f"{what} {field!r} is not a config field")
    if isinstance(node[leaf], ml_collections.ConfigDict):  # a whole block: its other fields would be lost
      raise ValueError(f"{what} {field!r} with {value!r}, but {field} is a block of fields: set each one by its "
                       f"dotted name ({field}.NAME)")
    node[leaf] = value
  return config


def flat_fields(tree: dict, prefix: str = "") -> dict:
  """{"dotted.field": value} of a nested dict (a ConfigDict's ``to_dict()``)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(flat_fields(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def with_seeds(variants, seeds) -> tuple:
  """Each (name, fields) variant once per seed: the first seed as given, seed s as "NAME_seedS" with
  ``train.seed`` = s (for means over seeds, ``experiments.train.sweep.mean_over_seeds``)."""
  return tuple((name, fields) if i == 0 else (f"{name}_seed{seed}", {**fields, "train.seed": seed})
               for name, fields in variants for i, seed in enumerate(seeds))


def seedless(name: str) -> str:
  """A run's variant name without the seed suffix :func:`with_seeds` gives it ("NAME_seedS" -> "NAME")."""
  return re.sub(r"_seed\d+$", "", name)


def favor_variant(kernel: str, **attention) -> dict:
  """A variant's fields for FAVOR attention with ``kernel`` and other ``attention.*`` fields:
  ``favor_variant("taylor", qk_head_dim=16)``."""
  return {"attention.type": "favor", "attention.kernel": kernel, **{f"attention.{k}": v for k, v in attention.items()}}


def cluster_fields(mesh) -> dict:
  """``mesh``'s cluster fields that are set (coordinator_address, num_processes, process_id), the others
  being left to auto-detection."""
  address, count, index = (mesh.get(k) for k in ("coordinator_address", "num_processes", "process_id"))
  return {k: v for k, v in (("coordinator_address", address or None), ("num_processes", count or None),
                            ("process_id", None if index in (None, -1) else index)) if v is not None}


def selected_variants(config) -> list[tuple[str, dict]]:
  """``config.variants`` filtered by ``config.only`` (names checked); no variants = one run named "run"."""
  variants = list(config.variants) or [("run", {})]
  names = [name for name, _ in variants]
  if len(set(names)) != len(names):
    raise ValueError(f"variants must have distinct names, got {names}")
  only = [n for n in config.only.split(",") if n]
  unknown = sorted(set(only) - set(names))
  if unknown:
    raise ValueError(f"config.only names {unknown}, not among the variants {names}")
  return [(name, dict(fields)) for name, fields in variants if not only or name in only]


def _overlap(a: str, b: str) -> bool:
  """Whether setting dotted field ``a`` and setting ``b`` touch the same value."""
  return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def check_overrides_read(unread: dict, overrides: dict) -> None:
  """Stops on a command-line value that the study will not read: ``unread`` is {dotted field: why} (a field
  covers the fields under it)."""
  for field, value in overrides.items():
    for name, why in unread.items():
      if field == name or field.startswith(name + "."):
        raise ValueError(f"--config.{field}={value!r} is read by nothing this run does ({why}): drop it, or "
                         "set the fields that make it apply")


def check_overrides(config, overrides: dict) -> None:
  """Stops when a command-line value would be replaced by a variant that is to run.

  A variant's fields are set after the command line's, so an override of a
  field that a selected variant sets to another value would be lost; an
  override of a field no selected variant sets applies to every variant.
  """
  if "variants" not in config or not overrides:
    return
  clashes = {}
  for name, fields in selected_variants(config):
    for field, value in overrides.items():
      for vfield, vvalue in fields.items():
        if _overlap(field, vfield) and (field != vfield or vvalue != value):
          clashes.setdefault(f"--config.{field}={value}", []).append(f"{name} ({vfield}={vvalue!r})")
  if clashes:
    lines = [f"{flag} would be replaced by variant{'s' * (len(names) > 1)} {', '.join(names)}"
             for flag, names in clashes.items()]
    raise ValueError("command-line values conflict with the config's variants, which set the same fields:\n  "
                     + "\n  ".join(lines) + "\nRun only variants that leave the field alone "
                     "(--config.only=NAMES), give the runs you want (--config.variants=...), or edit the "
                     "variants in the config file.")


def training_config(name: str, task: str, quick: bool) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.experiment = "train"  # experiments.main runs experiments.train.sweep: one training run per variant
  config.config_name = name  # the config file's module (experiments.configs.NAME)
  config.task = task  # experiments.tasks: "mqar", "listops" or "shakespeare"
  config.quick = quick  # True: the quick version (FILE.py:quick); set on the full one, asks for it
  config.data = ml_collections.ConfigDict()  # the task's own fields (see the config file)

  config.model = ml_collections.ConfigDict()
  config.model.d_model = 128  # residual width
  config.model.num_layers = 2  # pre-norm Transformer blocks
  config.model.num_heads = 4  # attention heads; head dim = d_model / num_heads
  config.model.num_kv_heads = 0  # grouped-query attention: key/value heads, dividing num_heads (0 = num_heads)
  config.model.mlp_dim = 256  # hidden width of each block's GELU MLP
  config.model.positions = "rotary"  # "learned" (absolute embeddings), "rotary" (applied to q, k) or "none"
  config.model.short_conv = 0  # > 0: each block opens with a residual causal depthwise conv this wide (Based)
  config.model.dtype = "float32"  # compute dtype: "float32" or "bfloat16" (logits, loss, optimiser: float32)
  config.model.param_dtype = "float32"  # parameters' dtype (and so AdamW's moments): "float32"
  config.model.remat = "none"  # "block": recompute each block's activations in the backward pass (memory)

  config.attention = ml_collections.ConfigDict()
  config.attention.type = "softmax"  # "softmax" (Flax's attention) or "favor" (favor_jax FavorAttention)
  config.attention.kernel = "positive"  # FAVOR feature map, a name in favor_jax.core.KERNELS
  config.attention.num_features = 64  # M random features per head
  config.attention.projection = "orthogonal"  # "iid", "orthogonal" or "simplex"
  config.attention.redraw_every = 0  # draw a new projection every this many steps (0 = never)
  config.attention.chunk_size = 64  # causal FAVOR: tokens per chunk of the chunked prefix sum
  config.attention.window = 0  # > 0: exact attention over the nearest `window` keys, the kernel beyond
  config.attention.qk_head_dim = 0  # FAVOR: query/key head dim (0 = the model's; Based: 16 with taylor)
  config.attention.forget_gate = False  # causal LMs: a learned per-head forget gate (FoX), softmax or FAVOR
  config.attention.alibi = False  # causal LMs: ALiBi's fixed per-head gate (log f = -slope), softmax or FAVOR
  # > 0 with a window: the hybrid's control variate beta (core.hybrid_attention's control_variate), 0 = plain
  config.attention.control_variate = 0.0
  # FAVOR: a learned map of q, k before the features: "none", "bounded" (RFA: unit-norm q, k times a learned
  # per-head temperature) or "learned" (a per-head [D, D] matrix, the identity at init)
  config.attention.qk_map = "none"

  config.train = ml_collections.ConfigDict()
  config.train.seed = 0  # parameters, projection draws and the data stream
  config.train.steps = 1000  # optimiser steps
  config.train.batch_size = 32  # sequences per step
  config.train.grad_accum_steps = 1  # microbatches per step: their gradients are summed into one update
  config.train.lr = 1e-3  # peak AdamW learning rate
  config.train.warmup_steps = 100  # linear warmup from lr/warmup_steps to lr, then cosine decay
  config.train.final_lr_fraction = 0.1  # learning rate at the last step, as a fraction of lr
  config.train.b1 = 0.9  # AdamW β1
  config.train.b2 = 0.98  # AdamW β2
  config.train.weight_decay = 0.01  # AdamW decoupled weight decay
  config.train.clip_norm = 1.0  # global gradient-norm clip (0 = off)
  config.train.log_every = 50  # steps between train-loss records (mean over the window)
  config.train.eval_every = 200  # steps between evaluations on the held-out set
  config.train.checkpoint_every = 200  # steps between orbax checkpoints (resume from the latest)
  config.train.stop_after = 0  # stop (with a checkpoint) after this step (preemptible jobs); 0 = train.steps

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = 1  # devices on the "data" axis: the batch is split over them (-1: every device present)
  config.mesh.sequence = 1  # devices on the "sequence" axis: FAVOR layers split the sequence over them
  config.mesh.fsdp = False  # also split parameters and optimiser state over "data" (for large models)
  config.mesh.distributed = False  # call jax.distributed.initialize() first (multi-host launches)
  # An explicit cluster (experiments.local_cluster sets them); unset, jax.distributed.initialize() detects
  # the cluster from its environment (TPU VMs, SLURM, Open MPI, ...). Each needs mesh.distributed=True.
  config.mesh.coordinator_address = ""  # "host:port" of process 0's coordinator ("" = auto-detect)
  config.mesh.num_processes = 0  # processes in the cluster (0 = auto-detect)
  config.mesh.process_id = -1  # this process's index in [0, mesh.num_processes) (-1 = auto-detect)

  # Sweep: (name, {dotted field: value}) per run, each in workdir/name; () = one run named "run".
  config.variants = ()
  config.only = ""  # comma-separated variant names to run (empty = all)
  return config
