"""Every device used, or a word why not: ``mesh.data = -1`` takes all the devices; a smaller mesh is reported at
the start and in the summary. On 8 forced CPU devices, in a subprocess (the device count is fixed at start)."""

import json
import os
import subprocess
import sys

import ml_collections
import pytest

from experiments import local_cluster
from experiments.configs import common, tiny
from experiments.train import sharding, training

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import json, sys
import jax
from experiments import main
from experiments.configs import common, tiny
from experiments.train import sharding
out = {"devices": jax.device_count()}
for name, data in (("one", 1), ("all", -1)):
  config = common.set_fields(tiny.get_config(), {"mesh.data": data, "train.steps": 2, "train.log_every": 1,
                                                 "train.eval_every": 2, "train.checkpoint_every": 2,
                                                 "train.warmup_steps": 1})
  records = main.run(config, f"{sys.argv[1]}/{name}")
  out[name] = {k: records[0][k] for k in ("devices", "devices_present")}
config = tiny.get_config()
config.mesh.update(data=-1, sequence=3)
try:
  sharding.make_mesh(config.mesh)
except ValueError as e:
  out["sequence_3"] = str(e)
config.mesh.update(data=-1, sequence=2)
out["sequence_2"] = dict(sharding.make_mesh(config.mesh).shape)
print("RESULT " + json.dumps(out))
"""


def test_mesh_shape_of_minus_one_is_every_device_the_sequence_axis_leaves():
  mesh = lambda data, sequence: ml_collections.ConfigDict(dict(data=data, sequence=sequence))
  assert sharding.mesh_shape(mesh(-1, 1), 8) == (8, 1) and sharding.mesh_shape(mesh(-1, 4), 8) == (2, 4)
  assert sharding.mesh_shape(mesh(2, 2), 8) == (2, 2)  # a smaller mesh is allowed (and reported)
  with pytest.raises(ValueError, match="mesh.sequence=3 does not divide the 8 devices"):
    sharding.mesh_shape(mesh(-1, 3), 8)
  with pytest.raises(ValueError, match="= 16 devices, but only 8 exist"):
    sharding.mesh_shape(mesh(4, 4), 8)
  training.check_config(common.set_fields(tiny.get_config(), {"mesh.data": -1}))
  for bad in (0, -2):
    with pytest.raises(ValueError, match=rf"mesh.data \(or -1: every device\) must be a positive int, got {bad}"):
      training.check_config(common.set_fields(tiny.get_config(), {"mesh.data": bad}))


@pytest.mark.slow  # a subprocess that trains twice (a few steps of the tiny config)
def test_mesh_data_minus_one_takes_every_device_and_a_smaller_mesh_is_reported(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": local_cluster.xla_flags(8), "PYTHONPATH": REPO}
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.split("RESULT ", 1)[1])
  assert result["devices"] == 8
  assert result["one"] == {"devices": 1, "devices_present": 8}
  assert result["all"] == {"devices": 8, "devices_present": 8}
  # Said at the start (the progress line) and in the summary, for the small mesh only.
  assert "uses 1 of the 8 devices present (mesh.data=1 × mesh.sequence=1); 7 stay idle" in proc.stdout
  assert proc.stdout.count("devices present") == 2  # the start line and the summary, of the run on one device
  assert "Idle devices: run trained on 1 of the 8 devices" in (tmp_path / "one" / "summary.md").read_text()
  assert "Idle devices" not in (tmp_path / "all" / "summary.md").read_text()
  # -1 with a sequence axis: the devices it leaves, or an error naming both fields where it does not divide them.
  assert result["sequence_2"] == {"data": 4, "sequence": 2}
  assert "mesh.data=-1" in result["sequence_3"] and "mesh.sequence=3" in result["sequence_3"]
