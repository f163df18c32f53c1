"""The text task's inputs, as a user gets them wrong: empty and negative-id token files, a folder filtered by
``data.glob`` (issue 52)."""

import numpy as np
import pytest

from experiments import tasks
from experiments.configs import common, text
from experiments.train import training


def _tiny(**fields):
  config = text.get_config("quick")
  config.data.update(seq_len=16, num_eval_batches=1)
  config.train.update(batch_size=4)
  return common.set_fields(config, fields)


@pytest.mark.parametrize("kind", ["npy", "raw"])
def test_an_empty_token_file_is_named_with_its_field(tmp_path, kind):
  path = tmp_path / f"empty.{'npy' if kind == 'npy' else 'bin'}"
  if kind == "npy":
    np.save(path, np.zeros(0, np.int32))
  else:
    path.write_bytes(b"")
  fields = {"data.token_file": str(path)} | ({"data.vocab_size": 100} if kind == "raw" else {})
  with pytest.raises(ValueError, match=rf"data.token_file='{path}'.*(empty|no tokens)"):
    tasks.make_task(_tiny(**fields))


def test_a_negative_id_is_named_with_the_field_the_file_and_its_position(tmp_path):
  path = tmp_path / "tokens.npy"
  tokens = np.arange(200, dtype=np.int32)
  tokens[[37, 90]] = [-1, -3]
  np.save(path, tokens)
  with pytest.raises(ValueError, match=rf"data.token_file='{path}' holds the negative id -3 \(first at index 90\)"):
    tasks.make_task(_tiny(**{"data.token_file": str(path)}))


def test_data_glob_keeps_the_matching_files_of_a_folder(tmp_path):
  (tmp_path / "sub").mkdir()
  texts = {"a.txt": b"alpha " * 40, "sub/b.txt": b"beta " * 40}
  for name, body in texts.items():
    (tmp_path / name).write_bytes(body)
  (tmp_path / "c.pyc").write_bytes(b"\x00\xff" * 300)
  (tmp_path / "sub" / "d.pyc").write_bytes(b"\x01\xfe" * 300)
  assert sorted(tasks.text.files(str(tmp_path), "*.txt")) == ["a.txt", "sub/b.txt"]
  assert sorted(tasks.text.files(str(tmp_path))) == ["a.txt", "c.pyc", "sub/b.txt", "sub/d.pyc"]
  task = tasks.make_task(_tiny(**{"data.path": str(tmp_path), "data.glob": "*.txt", "data.pack": False}))
  expected = set(b"".join(texts.values()))
  seen = set(np.asarray(task.train_batch(0).tokens).ravel().tolist())
  seen |= set(np.asarray(task.eval_batches[0].tokens).ravel().tolist())
  assert seen <= expected  # no byte of the .pyc files (they hold 0x00, 0xff, 0x01, 0xfe)
  with pytest.raises(ValueError, match=r"holds no files matching data.glob='\*.md'"):
    tasks.make_task(_tiny(**{"data.path": str(tmp_path), "data.glob": "*.md"}))
  assert "data.glob" in training.unused_fields(_tiny(**{"data.token_file": "t.npy"}))
