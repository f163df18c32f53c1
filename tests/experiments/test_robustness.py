"""The training plumbing under misuse: conflicting overrides, bad work directories, damaged checkpoints."""

import copy
import errno
import glob
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

from experiments import main, sweep, tasks, training
from experiments.configs import common
from experiments.configs import mqar as mqar_config
from experiments.configs import shakespeare as shakespeare_config
from experiments.configs import tiny as tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def nothing_trains(monkeypatch):
  monkeypatch.setattr(training, "make_train_step", lambda *a, **k: pytest.fail("compiled despite bad input"))
  monkeypatch.setattr(tasks, "make_task", lambda *a, **k: pytest.fail("built data despite bad input"))


def command_line(config, overrides):
  """``config`` as ``--config.FIELD=VALUE`` flags leave it (config_flags sets them before main.run)."""
  return common.set_fields(config, overrides), overrides


# --- command-line overrides and variants -----------------------------------------------------------------


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
  else:
    os.remove(path)


# Files whose damage orbax notices (the others in a step are copies it does not read back).
DAMAGE = [("truncate", "default/d/*"), ("zero", "default/manifest.ocdbt"), ("delete", "default/_METADATA")]


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
