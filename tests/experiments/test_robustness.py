"""The experiments under misuse: conflicting or unread overrides, bad values, bad work directories, damaged
checkpoints."""

import copy
import errno
import glob
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

from experiments import main, tasks
from experiments.configs import activations as activations_config
from experiments.configs import backward_compat as backward_compat_config
from experiments.configs import common
from experiments.configs import listops as listops_config
from experiments.configs import mqar as mqar_config
from experiments.configs import quickstart as quickstart_config
from experiments.configs import shakespeare as shakespeare_config
from experiments.configs import tiny as tiny_config
from experiments.studies import timing
from experiments.train import sweep, training

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def nothing_trains(monkeypatch):
  monkeypatch.setattr(training, "make_train_step", lambda *a, **k: pytest.fail("compiled despite bad input"))
  monkeypatch.setattr(tasks, "make_task", lambda *a, **k: pytest.fail("built data despite bad input"))


def command_line(config, overrides):
  """``config`` as ``--config.FIELD=VALUE`` flags leave it (config_flags sets them, then main.run gets the
  config locked: no field may be added or deleted)."""
  config = common.set_fields(config, overrides)
  config.lock()
  return config, overrides


# --- command-line overrides and variants -----------------------------------------------------------------


@pytest.mark.slow
def test_cli_override_that_a_variant_replaces_stops_the_command(tmp_path):
  cmd = [sys.executable, "-m", "experiments.main", "--config=experiments/configs/mqar.py",
         f"--workdir={tmp_path / 'out'}", "--config.attention.num_features=0"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
  assert out.returncode != 0
  assert "--config.attention.num_features=0 would be replaced by variants positive_m64" in out.stderr
  assert "--config.only" in out.stderr  # says how to proceed
  assert not (tmp_path / "out").exists()  # stopped before anything was written


@pytest.mark.parametrize("version", ["full", "mqar.py:quick", "--config.quick=True"])
def test_override_of_a_field_a_selected_variant_sets_stops(version, tmp_path, nothing_trains):
  config = mqar_config.get_config("quick" if version == "mqar.py:quick" else None)
  quick = {"quick": True} if version == "--config.quick=True" else {}  # runs the quick version's variants
  config, overrides = command_line(config, {**quick, "attention.kernel": "bogus"})
  with pytest.raises(ValueError, match=r"--config.attention.kernel=bogus would be replaced by variants? "
                                       r"positive_m64 \(attention.kernel='positive'\)") as stopped:
    main.run(config, str(tmp_path), overrides)
  assert ("hyperbolic_m64" in str(stopped.value)) == (version == "full")  # quick runs softmax, positive_m64


def test_override_no_variant_sets_is_checked_even_where_only_softmax_runs(tmp_path, nothing_trains):
  config, overrides = command_line(shakespeare_config.get_config(),
                                   {"only": "softmax", "attention.num_features": 0})
  with pytest.raises(ValueError, match="attention.num_features must be a positive int, got 0"):
    main.run(config, str(tmp_path), overrides)


def test_override_wins_over_every_variant_that_leaves_the_field_alone():
  config = mqar_config.get_config("quick")
  overrides = {"train.lr": 0.01, "attention.kernel": "positive", "attention.chunk_size": 16}
  common.set_fields(config, overrides)
  common.check_overrides(config, overrides)  # positive_m64 sets attention.kernel to the same value: no clash
  runs = sweep.variant_configs(config)
  assert [name for name, _ in runs] == ["softmax", "positive_m64"]
  assert all(c.train.lr == 0.01 and c.attention.chunk_size == 16 for _, c in runs)
  softmax_only = {"only": "softmax", "attention.num_features": 8}
  common.check_overrides(common.set_fields(copy.deepcopy(config), softmax_only), softmax_only)
  with pytest.raises(ValueError, match="attention.num_features=8 would be replaced by variant positive_m64"):
    common.check_overrides(config, {"attention.num_features": 8})


# --- the work directory ------------------------------------------------------------------------------------


def test_workdir_that_is_a_file_is_named(tmp_path, nothing_trains):
  path = tmp_path / "results.txt"
  path.write_text("not a directory")
  with pytest.raises(ValueError, match=r"--workdir=.*results.txt is a file, not a directory"):
    main.run(tiny_config.get_config(), str(path))
  with pytest.raises(ValueError, match=r"--workdir=.*results.txt/run lies under .*results.txt, which is a"):
    main.run(tiny_config.get_config(), str(path / "run"))
  assert path.read_text() == "not a directory"


def test_read_only_workdir_is_named(tmp_path, monkeypatch, nothing_trains):
  """chmod does not stop root (the tests' usual user), so for root the refusal of a read-only mount is
  simulated at the one call that writes into the directory."""
  read_only = tmp_path / "read_only"
  read_only.mkdir()
  read_only.chmod(0o555)
  if os.geteuid() == 0:
    real = tempfile.TemporaryFile

    def refuse(*args, dir=None, **kwargs):
      if dir is not None and os.path.samefile(dir, read_only):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
      return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
  with pytest.raises(ValueError, match=r"--workdir=.*read_only is not writable \(.+\)"):
    main.run(tiny_config.get_config(), str(read_only))


# --- progress and damaged checkpoints --------------------------------------------------------------------


def tiny_favor():
  config = tiny_config.get_config()
  config.attention.type, config.attention.redraw_every = "favor", 2  # projections in the checkpoint too
  return config  # 6 steps, checkpoints at 2, 4, 6 (orbax keeps the last two)


def without_timing(records):
  return [{k: v for k, v in r.items() if k not in training.TIMING_FIELDS} for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run: (its directory, its progress messages, its records, its final state)."""
  workdir = str(tmp_path_factory.mktemp("reference") / "run")
  messages = []
  records, state = training.train(tiny_favor(), workdir, progress=messages.append)
  return workdir, messages, records, state


@pytest.mark.slow
def test_progress_says_what_happens_before_the_first_step(reference):
  _, messages, _, _ = reference
  meter = r"\| \d+/6 \[[\d:]+<[\d:]+, +[\d.]+ steps/s\] loss"  # step/total [elapsed<ETA, steps/s]
  bars = [i for i, m in enumerate(messages) if re.search(meter, m)]
  assert len(bars) == 3, messages  # train records at steps 2, 4, 6
  assert messages[bars[-1]].startswith("100%|" + "#" * 24 + "| 6/6"), messages
  before = " | ".join(messages[:bars[0]])
  for phrase in ("building the mqar task", "initialising the model", "evaluation at step 0",
                 "compiling the train step"):
    assert phrase in before, before


def damage(path, how):
  if how == "truncate":
    os.truncate(path, os.path.getsize(path) // 2)
  elif how == "zero":
    with open(path, "r+b") as f:
      f.write(bytes(os.path.getsize(path)))
  elif os.path.isdir(path):
    shutil.rmtree(path)
  else:
    os.remove(path)


# Files whose damage orbax notices (the others in a step are copies it does not read back), and the step's
# item directory (its loss failed every step's restore after it).
DAMAGE = [("truncate", "default/d/*"), ("zero", "default/manifest.ocdbt"), ("delete", "default/_METADATA"),
          ("delete", "default")]


@pytest.mark.slow
@pytest.mark.parametrize("how,pattern", DAMAGE)
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(how, pattern, reference, tmp_path):
  ref_dir, _, ref_records, ref_state = reference
  workdir = str(tmp_path / "run")
  shutil.copytree(ref_dir, workdir)
  checkpoints = os.path.join(workdir, "checkpoints")
  assert sorted(os.listdir(checkpoints)) == ["4", "6"]
  (target,) = glob.glob(os.path.join(checkpoints, "6", pattern))
  damage(target, how)
  messages = []
  records, state = training.train(tiny_favor(), workdir, progress=messages.append)
  text = "\n".join(messages)
  assert "the checkpoint at step 6 cannot be restored, skipping it" in text
  assert "resumed from the checkpoint at step 4" in text
  assert without_timing(records) == without_timing(ref_records)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert without_timing(map(json.loads, f)) == without_timing(ref_records)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_array_equal(a, b)
  assert os.path.isdir(os.path.join(checkpoints, "damaged", "6"))
  messages.clear()
  training.train(tiny_favor(), workdir, progress=messages.append)  # the rewritten step 6 restores
  assert "resumed from the checkpoint at step 6" in messages and "cannot be restored" not in "".join(messages)


@pytest.mark.slow
def test_no_intact_checkpoint_stops_naming_the_directory(reference, tmp_path):
  ref_dir, _, _, _ = reference
  workdir = str(tmp_path / "run")
  shutil.copytree(ref_dir, workdir)
  checkpoints = os.path.join(workdir, "checkpoints")
  for step in ("4", "6"):
    damage(os.path.join(checkpoints, step, "default", "_METADATA"), "zero")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    metrics = f.read()
  expected = rf"no checkpoint in {re.escape(checkpoints)} can be restored .*step 6: .*step 4: "
  with pytest.raises(ValueError, match=expected):
    training.train(tiny_favor(), workdir, progress=lambda m: None)
  assert sorted(os.listdir(checkpoints)) == ["4", "6"]  # nothing moved or deleted
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert f.read() == metrics


def test_a_finished_run_leaves_no_lock_file(reference):
  workdir, _, _, _ = reference
  assert os.path.isdir(workdir) and not os.path.exists(os.path.join(workdir, ".lock"))


@pytest.mark.slow
def test_a_stopped_run_writes_no_results_and_a_fresh_start_keeps_no_old_records(reference, tmp_path):
  """train.stop_after: the command names where each run stopped and writes no results.json or summary.md
  (an unfinished model's numbers under train.steps). A run directory whose run never checkpointed (killed
  before its first checkpoint, here: stopped, checkpoints removed) starts over with no record of the old
  run: rerun under another seed, its metrics are exactly the uninterrupted run's."""
  _, _, ref_records, _ = reference
  workdir, run_dir = tmp_path / "study", tmp_path / "study" / "run"
  stopped = common.set_fields(tiny_favor(), {"train.stop_after": 2, "train.seed": 5})
  with pytest.raises(training.Stopped, match=rf"{re.escape(str(run_dir))} at step 2 of 6\. Rerun"):
    main.run(stopped, str(workdir))
  assert not (workdir / "results.json").exists() and not (workdir / "summary.md").exists()
  assert [r["step"] for r in map(json.loads, open(run_dir / "metrics.jsonl"))] == [0, 2]
  shutil.rmtree(run_dir / "checkpoints")
  main.run(tiny_favor(), str(workdir))
  with open(run_dir / "metrics.jsonl") as f:
    assert without_timing(map(json.loads, f)) == without_timing(ref_records)
  (result,) = json.load(open(workdir / "results.json"))
  assert result["steps"] == 6 and result["eval_loss"] == ref_records[-1]["eval_loss"]


# --- a run directory resumes only under the config it started with ---------------------------------------


@pytest.mark.slow
def test_resume_under_another_config_stops_naming_each_changed_field(reference, tmp_path):
  """A finished run resumed with another kernel or learning rate would report its numbers as the new
  config's; only when to log, evaluate, checkpoint or stop (and the mesh) may change."""
  ref_dir, _, ref_records, _ = reference
  workdir = str(tmp_path / "run")
  shutil.copytree(ref_dir, workdir)
  changed = tiny_favor()
  changed.attention.kernel, changed.train.lr = "relu", 0.5
  with pytest.raises(ValueError, match=r"started with another config.*attention.kernel: 'positive' -> 'relu'; "
                                       r"train.lr: 0.003 -> 0.5.* delete .*run to start this run over"):
    training.train(changed, workdir, progress=lambda m: None)
  changed = tiny_favor()  # other parameter shapes: named before orbax compares the arrays
  features = tiny_favor().attention.num_features
  changed.attention.num_features = 2 * features
  with pytest.raises(ValueError, match=rf"started with another config.*attention.num_features: {features} -> "
                                       rf"{2 * features}\. Only"):
    training.train(changed, workdir, progress=lambda m: None)
  cadence = tiny_favor()
  cadence.train.update(log_every=3, eval_every=6, checkpoint_every=3)
  messages = []
  records, _ = training.train(cadence, workdir, progress=messages.append)
  assert "resumed from the checkpoint at step 6" in messages
  assert without_timing(records) == without_timing(ref_records)  # nothing trained again
  os.remove(os.path.join(workdir, training.RUN_CONFIG))
  with pytest.raises(ValueError, match=r"holds checkpoints \(step 6\) but no run_config.json"):
    training.train(tiny_favor(), workdir, progress=lambda m: None)


def test_run_fields_leave_out_what_the_run_does_not_read():
  softmax = tiny_config.get_config()
  other = common.set_fields(copy.deepcopy(softmax), {"attention.kernel": "relu", "attention.num_features": 7,
                                                     "train.log_every": 3, "only": "x"})
  assert training.run_fields(other) == training.run_fields(softmax)
  assert training.run_fields(common.set_fields(other, {"train.seed": 1})) != training.run_fields(softmax)


# --- every command-line value is read by a run ------------------------------------------------------------


@pytest.mark.parametrize("config,overrides,reason", [
    (tiny_config.get_config, {"attention.window": 4}, "run: softmax attention has no FAVOR fields"),
    (tiny_config.get_config, {"attention.type": "favor", "attention.kernel": "taylor", "attention.num_features": 7},
     "run: kernel 'taylor' has no random projection"),
    (lambda: mqar_config.get_config("quick"), {"only": "softmax", "attention.projection": "iid"},
     "softmax: softmax attention"),
    (lambda: activations_config.get_config("quick"), {"model.attention.kernel": "relu"},
     "model: softmax attention has no FAVOR fields"),
    (lambda: listops_config.get_config("quick"), {"only": "favor_positive", "attention.chunk_size": 16},
     "favor_positive: task 'listops' attends both ways and attention.window is 0: no chunks"),
])
def test_a_command_line_value_no_run_reads_stops_the_command(config, overrides, reason, tmp_path, nothing_trains):
  config, overrides = command_line(config(), overrides)
  field, value = list(overrides.items())[-1]
  with pytest.raises(ValueError, match=rf"--config.{re.escape(field)}={re.escape(repr(value))} is read by none "
                                       rf"of the runs \({re.escape(reason)}"):
    main.run(config, str(tmp_path / "out"), overrides)
  assert not (tmp_path / "out").exists()


def test_a_value_some_runs_read_applies_to_them():
  config, overrides = command_line(quickstart_config.get_config("quick"), {"attention.num_features": 32})
  training.check_overrides_used(sweep.runs(config), overrides)  # favor_positive reads it
  assert [c.attention.num_features for _, c in sweep.variant_configs(config)] == [32, 32]
  config, overrides = command_line(listops_config.get_config("quick"),
                                   {"only": "favor_positive,favor_positive_window", "attention.chunk_size": 16})
  training.check_overrides_used(sweep.runs(config), overrides)  # the window's kernel part is chunked


def test_redraws_are_refused_where_nothing_is_drawn():
  for fields in ({"attention.redraw_every": 5}, {"attention.type": "favor", "attention.kernel": "hedgehog",
                                                 "attention.redraw_every": 5}):
    with pytest.raises(ValueError, match="attention.redraw_every=5 has nothing to redraw"):
      training.check_config(common.set_fields(tiny_config.get_config(), fields))


def test_a_variant_turned_into_another_by_the_command_line_stops():
  """The softmax variant sets its type, so --config.attention.type=favor clashes with it; variants that
  would compute the same config under two names are refused."""
  config, overrides = command_line(quickstart_config.get_config("quick"), {"attention.type": "favor"})
  with pytest.raises(ValueError, match=r"attention.type=favor would be replaced by variant softmax"):
    common.check_overrides(config, overrides)
  config = tiny_config.get_config()
  config.attention.type = "favor"
  config.variants = (("favor_positive", {}), ("positive_again", {"attention.kernel": "positive"}))
  with pytest.raises(ValueError, match="variants 'favor_positive' and 'positive_again' would run the same config"):
    sweep.variant_configs(config)


@pytest.mark.parametrize("fields,message", [
    ({"train.b1": 1.5}, r"train.b1 and train.b2 .* must be floats in \[0, 1\), got 1.5, 0.98"),
    ({"train.b2": -2.0}, r"got 0.9, -2.0"),
    ({"train.final_lr_fraction": -3.0}, r"train.final_lr_fraction must be in \[0, 1\]"),
])
def test_optimiser_fields_out_of_range_are_named(fields, message):
  with pytest.raises(ValueError, match=message):
    training.check_config(common.set_fields(tiny_config.get_config(), fields))


@pytest.mark.slow
def test_a_non_finite_evaluation_stops_the_run(tmp_path, monkeypatch):
  monkeypatch.setattr(training, "make_eval", lambda *a: (lambda state: {"eval_loss": float("nan")}))
  with pytest.raises(FloatingPointError, match="non-finite eval loss at step 0"):
    training.train(tiny_config.get_config(), str(tmp_path / "run"), progress=lambda m: None)


# --- the studies' own fields ------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    ({"estimators": ("favor+", "favr++")}, r"config.estimators must name one or more of .*unknown: \['favr\+\+'\]"),
    ({"features": ()}, "config.features must list at least one"),
    ({"fit_steps": 0}, "config.fit_steps must be a positive int"),
    ({"fit_batches": 5, "measure_batches": 4}, r"fit_batches \+ measure_batches = 9, but .* held-out set has 8"),
    ({"model.attention.type": "favor"}, "model.attention.type must be 'softmax'"),
    ({"model.only": "softmax"}, "model.variants and model.only must be empty"),
    ({"model.mesh.distributed": True, "model.mesh.num_processes": 2},
     r"model.mesh asks for a multi-process cluster .*'num_processes': 2.*config.model_dir"),
])
def test_activations_fields_are_checked_before_the_model_trains(fields, message, tmp_path, nothing_trains):
  config, overrides = command_line(activations_config.get_config("quick"), fields)
  with pytest.raises(ValueError, match=message):
    main.run(config, str(tmp_path / "out"), overrides)


@pytest.mark.parametrize("fields,message", [
    ({"finetune.steps": 0}, "finetune.steps must be a positive int"),
    ({"finetune.eval_every": 0}, "finetune.eval_every must be a positive int"),
    ({"finetune.lr": -1.0}, "finetune.lr must be > 0"),
    ({"finetune.distill_steps": -5}, "finetune.distill_steps must be an int >= 0"),
    ({"finetune.distill_lr": -1.0}, "finetune.distill_lr must be > 0"),
    ({"finetune.distill_batches": 0}, "finetune.distill_batches must be a positive int"),
    ({"finetune.warmup_steps": 50, "finetune.steps": 2}, "finetune.warmup_steps must be < finetune.steps=2"),
    ({"finetune.distill_objective": "kl"},
     r"finetune.distill_objective must be one of \('cross_entropy', 'output_mse'\), got 'kl'"),
    ({"finetune.distill_decay": True},
     "variant 'favor_positive': finetune.distill_decay=True .* needs attention.type='favor' with attention.forget"),
])
def test_backward_compat_finetune_fields_are_named(fields, message, tmp_path, nothing_trains):
  config, overrides = command_line(backward_compat_config.get_config("quick"), fields)
  with pytest.raises(ValueError, match=message):
    main.run(config, str(tmp_path / "out"), overrides)


@pytest.mark.parametrize("fields,message", [
    ({"kernels": ("hedgehog",)}, "config.kernels: 'hedgehog' has a learned map, which a random draw does not"),
    ({"kernels": ("positive", "bogus")}, r"config.kernels must hold names in \[.*\], got 'bogus'"),
    ({"projections": ("gaussian",)}, r"config.projections must hold one or more of \('iid', 'orthogonal'"),
    ({"num_draws": 1}, "config.num_draws must be an int >= 2"),
    ({"num_features": (32, 0)}, "config.num_features must be a positive int, got 0"),
])
def test_approximation_sweeps_are_checked_before_anything_is_measured(fields, message, monkeypatch):
  from experiments.studies import approximation
  monkeypatch.setattr(approximation, "measure", lambda *a, **k: pytest.fail("measured despite bad input"))
  config = common.set_fields(importlib.import_module("experiments.configs.approximation").get_config("quick"),
                             fields)
  with pytest.raises(ValueError, match=message):
    approximation.run(config, progress=lambda m: None)


@pytest.mark.parametrize("study", ["speed", "blocks", "sequence_parallel"])
@pytest.mark.parametrize("fields,message", [
    ({"passes": ("fw",)}, r"config.passes must be a tuple of one or more of \('fwd', 'fwd_bwd'\), got \('fw',\)"),
    ({"passes": ()}, "config.passes must be"),
    ({"repeats": 0}, "config.repeats must be an int >= 1"),
])
def test_benchmark_passes_and_repeats_are_checked_before_anything_runs(study, fields, message, tmp_path,
                                                                       monkeypatch):
  module = importlib.import_module(f"experiments.studies.{study}")
  for timed in (module, importlib.import_module("experiments.studies.speed")):
    monkeypatch.setattr(timed, "median_seconds", lambda *a, **k: pytest.fail("timed despite bad input"),
                        raising=False)
  config = common.set_fields(importlib.import_module(f"experiments.configs.{study}").get_config("quick"), fields)
  with pytest.raises(ValueError, match=message):
    module.run(config, progress=lambda m: None, workdir=str(tmp_path))


@pytest.mark.parametrize("fields,message", [
    ({"xla_chunks": (0, 16)}, "config.xla_chunks must be a positive int, got 0"),
    ({"pallas_chunks": (24,)}, "config.pallas_chunks / config.block_fs: .*power of two >= 16, got 24"),
    ({"block_fs": (8,)}, "block_f must be a power of two >= 16, got 8"),
])
def test_block_sweep_choices_are_checked_up_front(fields, message, monkeypatch):
  from experiments.configs import blocks as blocks_config
  from experiments.studies import blocks
  monkeypatch.setattr(blocks.speed, "median_seconds", lambda *a, **k: pytest.fail("timed despite bad input"))
  with pytest.raises(ValueError, match=message):
    blocks.run(common.set_fields(blocks_config.get_config("quick"), fields), progress=lambda m: None)


# --- every config as the command line gives it; unread study fields; bad benchmark values ------------------

CONFIG_FILES = sorted(f[:-3] for f in os.listdir(os.path.join(REPO, "experiments", "configs"))
                      if f.endswith(".py") and f not in ("__init__.py", "common.py"))


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIG_FILES)
@pytest.mark.parametrize("arg", [None, "quick"])
def test_every_config_passes_its_checks_locked_as_the_command_line_gives_it(name, arg, nothing_trains):
  """config_flags locks the config: a study that adds or deletes a field fails from the command line only
  (backward_compat's pretraining config did). ``main.prepare`` runs every check that needs no computation."""
  config, _ = command_line(importlib.import_module(f"experiments.configs.{name}").get_config(arg), {})
  main.prepare(config, {})
  if config.experiment in ("speed", "blocks", "peers", "sequence_parallel", "tradeoff"):
    timing.check_sizes(config)  # the benchmarks' size fields, checked when their run starts


@pytest.mark.parametrize("config_name,overrides,why", [
    ("activations", {"estimators": ("favor+", "hyperbolic"), "fit_steps": 3}, "no fitted estimator"),
    ("activations", {"estimators": ("hedgehog (fitted)",), "num_draws": 5}, "no randomly drawn estimator"),
    ("activations", {"model.quick": False}, "a label of the config file"),
    ("approximation", {"kernels": ("taylor",), "num_draws": 9}, "no kernel in config.kernels=('taylor',) takes"),
    ("blocks", {"pallas_chunks": (), "num_warps": (2,)}, "config.pallas_chunks is empty"),
    ("speed", {"methods": ("softmax",), "scan_max_len": 5}, "'favor_scan' is not in config.methods"),
    ("peers", {"causal": (False,), "causal_seq_lens": (64,)}, "True is not in config.causal"),
    ("peers", {"causal": (True,), "seq_lens": (64,)}, "False is not in config.causal"),
    ("backward_compat", {"finetune.distill_steps": 7}, "no selected variant has a learned feature map"),
    ("tiny", {"mesh.fsdp": True}, "mesh.data is 1"),
])
def test_a_study_field_the_config_leaves_unread_stops_the_command(config_name, overrides, why, nothing_trains):
  module = importlib.import_module(f"experiments.configs.{config_name}")
  config, overrides = command_line(module.get_config("quick"), overrides)
  field, value = list(overrides.items())[-1]
  with pytest.raises(ValueError, match=rf"--config.{re.escape(field)}={re.escape(repr(value))} is read by "
                                       rf"(nothing this run does|none of the runs) \(.*{re.escape(why)}"):
    main.prepare(config, overrides)


def test_the_same_fields_apply_where_the_config_reads_them(nothing_trains):
  for config_name, overrides in [("activations", {"fit_steps": 3}), ("speed", {"scan_max_len": 5}),
                                 ("backward_compat", {"only": "hedgehog", "finetune.distill_steps": 7}),
                                 ("blocks", {"num_warps": (2,)})]:
    module = importlib.import_module(f"experiments.configs.{config_name}")
    config, overrides = command_line(module.get_config("quick"), overrides)
    main.prepare(config, overrides)


def test_a_task_without_its_data_fields_is_named(nothing_trains):
  config, overrides = command_line(tiny_config.get_config(), {"task": "listops"})
  with pytest.raises(ValueError, match=r"task 'listops' reads a data field this config lacks .*max_depth"):
    main.prepare(config, overrides)


@pytest.mark.parametrize("field", ["experiment", "config_name"])
def test_the_config_files_labels_cannot_be_overridden(field, nothing_trains):
  config, overrides = command_line(tiny_config.get_config(), {field: "speed"})
  with pytest.raises(ValueError, match=rf"--config.{field}='speed' cannot take effect"):
    main.prepare(config, overrides)


@pytest.mark.parametrize("config_name,overrides,message", [
    ("speed", {"heads": 0}, r"config.heads must be an int >= 1, got 0"),
    ("speed", {"causal": (2,)}, r"config.causal must be a tuple of one or more of True, False, got \(2,\)"),
    ("speed", {"causal": ()}, r"config.causal must be a tuple of one or more"),
    ("speed", {"seq_lens": (-64,)}, r"config.seq_lens must be a tuple of ints >= 1"),
    ("speed", {"dtype": "foo"}, r"config.dtype must be one of"),
    ("speed", {"scan_max_len": -5}, r"config.scan_max_len must be an int >= 0"),
    ("blocks", {"batch": 0}, r"config.batch must be an int >= 1"),
    ("blocks", {"seq_lens": ()}, r"config.seq_lens must be a tuple of ints >= 1 \(one or more\)"),
    ("sequence_parallel", {"devices": 0}, r"config.devices must be an int >= 1"),
    ("sequence_parallel", {"causal": ()}, r"config.causal must be a tuple of one or more"),
    ("tradeoff", {"timing_steps": -3}, r"config.timing_steps must be an int >= 1"),
    ("tradeoff", {"long_length": -5}, r"config.long_length must be an int >= 0"),
    ("approximation", {"settings": ()}, r"config.settings must list at least one"),
    ("approximation", {"settings": (("seed", 64, 32),)}, r"config.settings must hold \(name, sequence length"),
    ("approximation", {"settings": (("seed", 64, 32, "big"),)}, r"input scale must be a finite number > 0"),
    ("approximation", {"seed": -1}, r"config.seed must be an int >= 0"),
    ("activations", {"estimators": ("hyperbolic",), "features": (1,)}, r"estimator 'hyperbolic' needs F >= 2"),
])
def test_bad_study_values_are_named_before_anything_runs(config_name, overrides, message, tmp_path, monkeypatch,
                                                         nothing_trains):
  """Each stops the command naming the field, before a computation (the study's first step fails the test)."""
  import jax.random

  module = importlib.import_module(f"experiments.configs.{config_name}")
  config, overrides = command_line(module.get_config("quick"), overrides)
  monkeypatch.setattr(jax.random, "normal", lambda *a, **k: pytest.fail("computed despite bad input"))
  monkeypatch.setattr(jax.random, "PRNGKey", lambda *a, **k: pytest.fail("computed despite bad input"))
  with pytest.raises(ValueError, match=message):
    main.run(config, str(tmp_path / "out"), overrides)
