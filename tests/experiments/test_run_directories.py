"""Run directories anywhere orbax can write (issue 52): a local path or a ``gs://`` URL through one path layer
(``experiments.train.paths``); ``gs://`` without its package refused by name before anything trains; any other
scheme an error, never a local folder named after it.

The bucket here is in-process and needs no network: fsspec's ``gs`` protocol (what ``etils.epath`` writes a
``gs://`` path through when gcsfs is installed) is a directory-backed filesystem registered for the test, and
orbax's TensorStore writes the same bucket's arrays through TensorStore's ``file`` driver instead of its GCS
driver (``gcs_utils.get_kvstore_for_gcs``), its bucket-type query (hierarchical namespace) answered "no". So
every file the run writes goes through the URL: nothing lands in a local ``gs:`` folder.
"""

import importlib
import json
import os

import numpy as np
import pytest
from etils.epath import backend as epath_backend
from etils.epath import gpath as epath_gpath
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.path import gcs_utils

from experiments import generate, main
from experiments.configs import common, text
from experiments.train import metrics, paths, training

TIMING = set(training.TIMING_FIELDS)


# --- the path layer's checks (fast) -------------------------------------------------------------------------


def test_gs_without_its_package_is_refused_by_name_and_no_local_folder_is_made(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(paths, "installed", lambda module: False)  # as on a machine without gcsfs
  with pytest.raises(ValueError, match=r"--workdir=gs://my-bucket/lm_base is a gs:// URL, but gcsfs, "
                                       r"google-cloud-storage are not installed: pip install \"favor_jax\[gcs\]\""):
    paths.check_workdir("gs://my-bucket/lm_base")
  with pytest.raises(ValueError, match="gcsfs"):  # experiments.generate reads a run through the same check
    generate.run("gs://my-bucket/lm_base/run", ["x"], 1)
  assert os.listdir(tmp_path) == []  # today's bug: ./gs:/my-bucket/lm_base


def test_main_refuses_a_gs_workdir_without_its_package_before_training(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(paths, "installed", lambda module: module != "gcsfs")
  trained = []
  monkeypatch.setattr(training, "train", lambda *a, **k: trained.append(a))
  with pytest.raises(ValueError, match=r"--workdir=gs://b/run is a gs:// URL, but gcsfs is not installed"):
    main.run(_config(tmp_path), "gs://b/run")
  assert not trained and os.listdir(tmp_path) == ["a.txt"]


@pytest.mark.parametrize("url", ["memory://runs/a", "s3://bucket/run", "hf://x/y", "gs:/bucket/run", "c:/x"])
def test_a_scheme_nothing_writes_to_is_an_error_never_a_local_folder(tmp_path, monkeypatch, url):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=r"--workdir=.*(not one a run directory can use|looks like a URL)"):
    paths.check_workdir(url)
  assert os.listdir(tmp_path) == []


def test_urls_keep_their_scheme_where_a_local_path_is_made_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert paths.absolute("gs://b/study/run") == "gs://b/study/run"
  assert paths.parent("gs://b/study/run") == "gs://b/study" and paths.parent("gs://b/run") == "gs://b"
  assert paths.absolute("runs/a") == str(tmp_path / "runs" / "a")
  assert paths.parent("runs/a") == str(tmp_path / "runs")
  assert paths.check_workdir("runs/a") == "runs/a" and (tmp_path / "runs" / "a").is_dir()


# --- a whole run in an in-process bucket (slow) -------------------------------------------------------------


class _Bucket(DirFileSystem):
  """``gs://BUCKET/PATH`` as ``ROOT/BUCKET/PATH`` on the local disk: what gcsfs would be, without the network."""

  protocol = ("gs", "gcs")
  root = ""
  cachable = False

  def __init__(self, *args, **kwargs):
    del args, kwargs  # epath passes gcsfs's options (finalize_on_close)
    super().__init__(path=self.root, fs=LocalFileSystem())


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """The root folder of the in-process ``gs://`` (see the module's docstring); the test runs in an empty folder."""
  root = tmp_path / "bucket_store"
  root.mkdir()
  monkeypatch.setattr(_Bucket, "root", str(root))
  for name in _Bucket.protocol:
    monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, name, _Bucket)
  monkeypatch.setattr(paths, "missing_packages", lambda scheme: [])
  monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)

  def kvstore(ckpt_path):
    name, inside = gcs_utils.parse_gcs_path(ckpt_path, add_trailing_slash=False)
    return {"driver": "file", "path": str(root / name / inside)}

  monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", kvstore)
  # Where TensorFlow or tensorboardX is installed they would write gs:// through their own clients (the network).
  monkeypatch.setattr(epath_gpath, "_is_tf_installed", lambda: False)
  monkeypatch.setattr(metrics, "_tensorboard", lambda logdir: None)
  epath_backend.fsspec_backend._get_filesystem.cache_clear()
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  yield root
  epath_backend.fsspec_backend._get_filesystem.cache_clear()
  assert os.listdir(cwd) == []  # nothing written to a local folder named after the URL


def _config(tmp_path, **fields):
  """The text config shrunk to seconds on a local corpus: 1 × 32, FAVOR+ with a forget gate, 4 steps."""
  corpus = tmp_path / "a.txt"
  if not corpus.exists():
    words = np.random.default_rng(0).choice(["the", "king", "speaks", "to", "a", "fool"], 800)
    corpus.write_text(" ".join(words) + "\n")
  config = text.get_config("quick")
  config.data.update(path=str(corpus), seq_len=32, num_eval_batches=1)
  config.model.update(d_model=32, num_layers=1, num_heads=2, mlp_dim=64)
  config.attention.update(num_features=16, window=0, chunk_size=8)
  config.train.update(steps=4, batch_size=8, warmup_steps=1, log_every=1, eval_every=2, checkpoint_every=2)
  return common.set_fields(config, fields)


def _records(text_):
  return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in text_.splitlines()]


@pytest.mark.slow
def test_a_gs_run_directory_trains_resumes_and_generates_like_a_local_one(tmp_path, bucket, capsys):
  local = tmp_path / "local"
  main.run(_config(tmp_path), str(local))  # the reference: the same study in a local folder, uninterrupted
  with pytest.raises(training.Stopped):
    main.run(_config(tmp_path, **{"train.stop_after": 2}), "gs://runs/study")
  store = bucket / "runs" / "study"
  assert (store / "run" / "checkpoints" / "2").is_dir() and not (store / "run" / ".lock").exists()
  # A record another command left (a bucket has no lock): said, not obeyed.
  (store / "run" / ".lock").write_text("pid 1 on elsewhere since then\n")
  capsys.readouterr()
  main.run(_config(tmp_path), "gs://runs/study")
  out = capsys.readouterr().out
  assert "resumed from the checkpoint at step 2" in out
  assert "warning: gs://runs/study/run/.lock says pid 1 on elsewhere" in out
  for name in ("config.json", "results.json", "summary.md", "curves.png", "state.png", "run/metrics.jsonl",
               "run/run_config.json", "run/loss.png", "run/checkpoints/4/default"):
    assert (store / name).exists(), name
  assert not (store / "run" / ".lock").exists()  # removed at the end
  assert (_records((store / "run" / "metrics.jsonl").read_text())
          == _records((local / "run" / "metrics.jsonl").read_text()))  # resumed exactly, every record once
  assert json.loads((store / "results.json").read_text())[0]["eval_loss"] == pytest.approx(
      json.loads((local / "results.json").read_text())[0]["eval_loss"], rel=1e-6)
  sample = generate.run("gs://runs/study/run", ["the king "], 12, temperature=0.0)
  assert sample == generate.run(str(local / "run"), ["the king "], 12, temperature=0.0) and len(sample[0]) > 0
