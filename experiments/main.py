"""The one entry point for every experiment: an ml_collections config file and a work directory.

    python -m experiments.main --config=experiments/configs/NAME.py[:quick] --workdir=DIR \
        [--config.FIELD=VALUE ...]

DIR is a local path or a ``gs://BUCKET/PATH`` URL (with ``pip install -e ".[gcs]"``; ``experiments.train.paths``).
``NAME.py:quick`` runs the config's quick version (its ``get_config("quick")``);
``--config.quick=True`` asks for the same. Writes DIR/config.json (the config
as run, ``quick`` included), DIR/results.json (a list of flat records),
DIR/summary.md and the study's *.png plots; training studies also write one
subdirectory per run (metrics.jsonl, checkpoints/, loss.png) and resume from
it when rerun. A command that ``train.stop_after`` ends before ``train.steps``
checkpoints its runs and writes no results.json or summary.md (they would be
an unfinished model's numbers); it names where each run stopped and exits 0,
and rerunning it resumes them. A --config.FIELD value applies to every variant of a sweep; one
that a variant to run sets to another value stops the command, naming both.

Several processes (``mesh.distributed=True``: a TPU slice, a SLURM job, or
``experiments.local_cluster`` on one machine) each run this same command;
``jax.distributed.initialize`` joins them, with the cluster taken from the
``mesh.coordinator_address``, ``mesh.num_processes`` and ``mesh.process_id``
fields where set and detected from the environment otherwise. Every process
trains; process 0 alone writes config.json, results.json, summary.md, the
study's plots and metrics.jsonl, while orbax has every process write its
shards into the one checkpoint directory.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from experiments.configs import common
from experiments.train import paths

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file")
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for config.json, results.json, summary.md, plots: a "
                               "local path or gs://BUCKET/PATH (with gcsfs installed)")
flags.mark_flags_as_required(["config", "workdir"])

# config.experiment -> module with run(config, progress, workdir), summarize(records, config),
# plot(records, config, workdir)
STUDIES = {
    "approximation": "experiments.studies.approximation",
    "precision": "experiments.studies.precision",
    "activations": "experiments.studies.activations",
    "tradeoff": "experiments.studies.tradeoff",
    "speed": "experiments.studies.speed",
    "blocks": "experiments.studies.blocks",
    "peers": "experiments.studies.peers",
    "train": "experiments.train.sweep",
    "backward_compat": "experiments.studies.backward_compat",
    "sequence_parallel": "experiments.studies.sequence_parallel",
    "showcase": "experiments.studies.showcase",
    "decode": "experiments.studies.decode",
}


def machine() -> dict:
  return dict(date=time.strftime("%Y-%m-%d"), platform=platform.platform(), cpu_count=os.cpu_count(),
              jax=jax.__version__, backend=jax.default_backend(),
              devices=sorted({d.device_kind for d in jax.devices()}))


def resolve_quick(config, overrides: dict):
  """The config to run, given ``config.quick``.

  ``FILE.py:quick`` is the quick version already. ``quick=True`` set on FILE's full version
  (``--config.quick=True``) asks for it: FILE's ``get_config("quick")`` with the same command-line values.
  Where ``quick`` could not take effect it stops: ``quick=True`` on a config that holds none of the quick
  version's values and differs from FILE's full version beyond the command line (nothing to rebuild it
  from), or ``--config.quick=False`` on the quick version.
  """
  name = config.get("config_name", config.experiment)
  module = importlib.import_module(f"experiments.configs.{name}")
  full, quick = (common.flat_fields(common.set_fields(module.get_config(arg), overrides).to_dict())
                 for arg in (None, "quick"))
  given = common.flat_fields(config.to_dict())
  for fields in (full, quick, given):
    fields.pop("quick", None)
  differ = sorted(k for k in full.keys() | quick.keys() if full.get(k) != quick.get(k))
  if config.get("quick") and given == full:
    return common.set_fields(module.get_config("quick"), overrides)
  if config.get("quick") and differ and all(given.get(k) == full.get(k) for k in differ):
    raise ValueError(f"config.quick=True, but the config holds none of the values of {name}.py's quick "
                     f"version ({', '.join(differ)}) and differs from its full version beyond the command "
                     f"line, so the quick version cannot be built from it: start from get_config('quick')")
  if overrides.get("quick") is False and differ and given == quick:
    raise ValueError(f"--config.quick=False would not undo --config={name}.py:quick (its values stay): "
                     "drop ':quick' to run the full version")
  return config


# Fields naming the config file itself: a value on the command line would relabel the run, not change it.
LABELS = {"experiment": "the study is the config file's: pass that study's --config file instead",
          "config_name": "it names the config file (its quick version is rebuilt from it): pass another --config"}


def prepare(config, overrides=None):
  """(config to run, study module), every check that needs no computation made: ``overrides`` (dotted fields,
  the command line's, already set in ``config``) apply to every variant, one that a variant to run sets to
  another value stops, and so does one that nothing the study runs would read."""
  overrides = dict(overrides or {})
  for field, why in LABELS.items():
    if field in overrides:
      raise ValueError(f"--config.{field}={overrides[field]!r} cannot take effect: {why}")
  if config.experiment not in STUDIES:
    raise ValueError(f"unknown experiment {config.experiment!r}; choose one of {sorted(STUDIES)}")
  config = resolve_quick(config, overrides)
  overrides.pop("quick", None)  # taken into account by resolve_quick
  common.check_overrides(config, overrides)
  study = importlib.import_module(STUDIES[config.experiment])
  if hasattr(study, "runs"):  # a training study: every run checked, and each command-line value read by one
    from experiments.train import training
    training.check_overrides_used(study.runs(config), overrides)
  if hasattr(study, "unread"):  # {field: why} the study's own fields this config leaves unread
    common.check_overrides_read(study.unread(config), overrides)
  return config, study


def run(config, workdir, overrides=None) -> list[dict]:
  """Runs ``config``'s study (checked by :func:`prepare` first)."""
  config, study = prepare(config, overrides)
  cluster = cluster_arguments(config.mesh) if config.get("mesh") is not None else None
  workdir = paths.check_workdir(workdir)
  if cluster is not None and config.mesh.distributed:
    try:
      jax.distributed.initialize(**cluster)  # multi-host: the rest of the cluster from the environment
    except ValueError as e:  # e.g. "coordinator_address should be defined": no cluster detected, none given
      raise ValueError(f"mesh.distributed=True, but jax.distributed.initialize({cluster}) found no cluster ({e}): "
                       "run on a cluster JAX detects (TPU VMs, SLURM, ...), give mesh.coordinator_address, "
                       "mesh.num_processes and mesh.process_id, or leave mesh.distributed False") from e
  writer = jax.process_index() == 0  # multi-host: every process runs the study, process 0 writes its files
  # config.json describes results.json: a directory that holds results keeps its config.json until new results
  # replace both (a rerun that stops, is refused or crashes must not relabel the results already there).
  if writer and not paths.exists(os.path.join(workdir, "results.json")):
    write_config(config, workdir)
  start = time.time()
  records = study.run(config, progress=lambda msg: print(f"[{time.time() - start:7.1f}s] {msg}", flush=True),
                      workdir=workdir)
  summary = study.summarize(records, config)
  summary += f"\nMachine: {machine()}\n"
  if writer:
    write_config(config, workdir)
    paths.write_text(os.path.join(workdir, "results.json"), json.dumps(records, indent=1))
    paths.write_text(os.path.join(workdir, "summary.md"), summary)
    for path in study.plot(records, config, workdir):
      print("wrote", path)
  print(summary)
  return records


def write_config(config, workdir: str) -> None:
  """``workdir/config.json``: the config as run and this machine, replaced whole."""
  paths.write_text(os.path.join(workdir, "config.json"),
                   json.dumps(dict(config=config.to_dict(), machine=machine()), indent=1, default=str))


def cluster_arguments(mesh) -> dict:
  """``jax.distributed.initialize``'s arguments from ``mesh``'s cluster fields, the set ones (the rest are
  detected from the environment); a ValueError for a bad value, or one set without ``mesh.distributed``."""
  address, count, index = (mesh.get(k) for k in ("coordinator_address", "num_processes", "process_id"))
  given = common.cluster_fields(mesh)
  if given and not mesh.distributed:
    named = ", ".join(f"mesh.{k}={v!r}" for k, v in given.items())
    raise ValueError(f"{named} describe a multi-process cluster, but mesh.distributed is False: "
                     "set --config.mesh.distributed=True as well")
  host, _, port = str(address or "").rpartition(":")
  if address and not (isinstance(address, str) and host and port.isdigit() and 0 < int(port) < 65536):
    raise ValueError(f"mesh.coordinator_address must be 'host:port' (e.g. '127.0.0.1:1234'), got {address!r}")
  if count is not None and (type(count) is not int or count < 0):
    raise ValueError(f"mesh.num_processes must be an int >= 1 (0 = auto-detect), got {count!r}")
  if index is not None and (type(index) is not int or index < -1 or (count and index >= count)):
    needs = f"in [0, mesh.num_processes={count})" if count else ">= 0"
    raise ValueError(f"mesh.process_id must be an int {needs} (-1 = auto-detect), got {index!r}")
  return given


def command_line_overrides(flag_values=flags.FLAGS) -> dict:
  """{dotted field: value} of every ``--config.FIELD`` given: ml_collections' own record. Not absl's
  ``present`` count, which a tuple flag gets from its number of items, so ``--config.FIELD=()`` read as not
  given (its value set, but no check saw it, and ``--config.quick=True`` rebuilt the config without it)."""
  return dict(config_flags.get_override_values(flag_values["config"]))


def repeated_fields(argv) -> list[str]:
  """The ``--config.FIELD`` flags (and ``--config``, ``--workdir``) given more than once (absl keeps a
  field's last value, but joins a tuple's): each must be given once."""
  names = []
  for arg in argv[1:]:
    if arg == "--":
      break
    name = arg.split("=", 1)[0].replace("--noconfig.", "--config.", 1)
    if name.startswith("--config.") or name in ("--config", "--workdir"):
      names.append(name)
  return sorted({n for n in names if names.count(n) > 1})


def parse_flags(argv):
  """absl's flag parsing, where a ``--config.FIELD`` naming no field of the config, or one given twice, ends
  the command with a message (for the former ml_collections' own, and its suggestion), not a traceback."""
  twice = repeated_fields(argv)
  if twice:
    sys.exit(f"error: {', '.join(twice)} given more than once (absl would join a tuple's values and keep any "
             "other flag's last one): give each once")
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:  # ml_collections: a field (or a parent field) that does not exist
    given = " ".join(a for a in argv[1:] if a.startswith("--config."))
    inner = e.args[0] if e.args else e  # a KeyError's message, or (a leaf) one wrapped in AttributeError
    text = str(inner.args[0] if isinstance(inner, KeyError) and inner.args else inner)
    sys.exit(f"error: a --config.FIELD names no field of the config: {' '.join(text.split())} (given: {given})")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  overrides = command_line_overrides()
  from experiments.train import training
  try:
    run(_CONFIG.value, _WORKDIR.value, overrides)
  except training.Stopped as e:  # a stop asked for: no results (they would be of unfinished models), exit 0
    print(e, flush=True)
  except training.Preempted as e:  # SIGTERM/SIGINT: a checkpoint saved; the exit status the signal would give
    print(e, flush=True)
    sys.exit(128 + e.signum)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
