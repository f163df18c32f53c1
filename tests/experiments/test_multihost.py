"""Training as a cluster of JAX processes on localhost (experiments.local_cluster): equal to one process.

Each launch is its own set of subprocesses (gloo collectives over loopback), bounded by a timeout and
killed whole (its process group) if it overruns. The cases share three launches (see ``runs``).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments import local_cluster, main
from experiments.configs import common
from experiments.configs import tiny as tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 240
CHECKPOINT = {"train.checkpoint_every": 6}  # the last step only: a checkpoint costs a barrier and a write
# 4 devices either way. "sequence": FAVOR layers split the sequence over all 4, across both processes (a
# causal all-gather between them); the rest use softmax attention, which compiles in a fraction of the time.
LAYOUTS = {"data": {"mesh.data": 4, **CHECKPOINT}, "fsdp": {"mesh.data": 4, "mesh.fsdp": True, **CHECKPOINT},
           "sequence": {"mesh.sequence": 4, "attention.type": "favor", **CHECKPOINT}}
SHARDED = {"mesh.data": 4, "mesh.fsdp": True}  # a checkpoint whose arrays are split across the processes
SINGLE = {"mesh.data": 1, **CHECKPOINT}
REFERENCE = {"fsdp": "data"}  # the 1-process run whose losses a 2-process layout must give


def _main_args(workdir, variants):
  return [f"--workdir={workdir}", "--config=experiments/configs/tiny.py", "--config.train.log_every=1",
          f"--config.variants={tuple(variants.items())!r}"]


def _env(workdir, **extra):
  # A compilation cache shared by the launches: the same program (fsdp's train step, say) compiles once.
  cache = os.path.join(os.path.dirname(workdir), "compilation_cache")
  return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": cache, **extra}


def _cluster(workdir, variants, devices=2, **popen):
  cmd = [sys.executable, "-m", "experiments.local_cluster", "--processes=2",
         f"--devices_per_process={devices}", "--", *_main_args(workdir, variants)]
  return subprocess.Popen(cmd, cwd=REPO, env=_env(workdir), start_new_session=True, **popen)


def _one_process(workdir, variants):
  """The reference: experiments.main itself (no cluster, no jax.distributed) on 4 forced devices."""
  env = _env(workdir, XLA_FLAGS=local_cluster.xla_flags(4))  # the device count local_cluster gives its 2 × 2
  cmd = [sys.executable, "-m", "experiments.main", *_main_args(workdir, variants)]
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)


def _end(process: subprocess.Popen) -> None:
  """SIGKILL to ``process`` and everything it started (its session's process group), if still there."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _output(process: subprocess.Popen) -> str:
  try:
    out, _ = process.communicate(timeout=TIMEOUT_S)
  finally:
    _end(process)
  assert process.returncode == 0, out[-6000:].decode(errors="replace")
  return out.decode(errors="replace")


def _records(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _losses(workdir, name):
  records = _records(os.path.join(workdir, name, "metrics.jsonl"))
  return np.array([[r["step"], r.get("train_loss", r.get("eval_loss"))] for r in records])


def _kill_process_1(launcher, logs, metrics, step):
  """SIGKILLs process 1 once ``metrics`` has a train record past ``step``; (launcher status, seconds it took
  to exit after the kill, whether process 0 was still alive then)."""
  deadline = time.time() + TIMEOUT_S
  while not (os.path.exists(metrics) and any(r["step"] > step for r in _records(metrics))):
    assert launcher.poll() is None and time.time() < deadline, (logs / "err").read_text()[-6000:]
    time.sleep(0.05)
  started = [line for line in (logs / "err").read_text().splitlines() if "local_cluster: process" in line]
  pids = [int(line.split("(pid ")[1].rstrip(")")) for line in started if "started" in line]
  os.kill(pids[1], signal.SIGKILL)
  killed = time.time()
  launcher.wait(timeout=60)
  seconds = time.time() - killed
  try:
    os.kill(pids[0], 0)
    alive = True
  except ProcessLookupError:
    alive = False
  return launcher.returncode, seconds, alive


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The runs of every launch: 2 processes × 2 devices train each layout and "killed" (process 1 is killed
  after step 2, with a checkpoint every step); 1 process trains the references, resumes "killed", and stops
  "to_two" after step 3, which 2 processes × 1 device resume."""
  two, one, logs = (tmp_path_factory.mktemp(name) for name in ("two_processes", "one_process", "logs"))
  with open(logs / "out", "wb") as out, open(logs / "err", "wb") as err:
    launcher = _cluster(two, {**LAYOUTS, "killed": {**SHARDED, "train.checkpoint_every": 1}}, stdout=out,
                        stderr=err)
    try:
      killed = _kill_process_1(launcher, logs, two / "killed" / "metrics.jsonl", step=2)
    finally:
      _end(launcher)
  os.rename(two / "killed", one / "killed")  # the same run directory, resumed by the next launch
  references = {name: LAYOUTS[name] for name in ("data", "sequence")}  # fsdp's losses are data's
  resumed = {"killed": _output(_one_process(one, {**references, "killed": SINGLE,
                                                  "to_two": {**SINGLE, "train.stop_after": 3}}))}
  os.rename(one / "to_two", two / "to_two")
  # one device per process, as on a GPU cluster: jax.device_put's replicated arrays broke orbax there
  resumed["to_two"] = _output(_cluster(two, {"to_two": {"mesh.data": 2, "mesh.fsdp": True, **CHECKPOINT}},
                                       devices=1, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
  return dict(two=two, one=one, killed=killed, resumed=resumed)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_processes_give_the_losses_of_one(runs, layout):
  cluster, reference = _losses(runs["two"], layout), _losses(runs["one"], REFERENCE.get(layout, layout))
  assert len(reference) == 9  # evaluations at steps 0, 3, 6 and 6 train records (log_every=1)
  np.testing.assert_array_equal(cluster[:, 0], reference[:, 0])
  np.testing.assert_allclose(cluster[:, 1], reference[:, 1], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("moved,resumed_at", [("killed", r"[1-5]"), ("to_two", r"3")])
def test_checkpoint_moves_between_two_processes_and_one(runs, moved, resumed_at):
  """killed: 2 processes, killed mid-run, resumed by 1; to_two: 1 process, stopped after step 3, then 2
  (FSDP over 2 devices: the losses of any data-parallel layout)."""
  assert re.search(rf"{moved} resumed from the checkpoint at step {resumed_at}\b", runs["resumed"][moved])
  resumed = _losses(runs["one" if moved == "killed" else "two"], moved)
  reference = _losses(runs["one"], "data")  # the same model and data, never interrupted
  np.testing.assert_array_equal(resumed[:, 0], reference[:, 0])
  np.testing.assert_allclose(resumed[:, 1], reference[:, 1], rtol=1e-5)


@pytest.mark.slow
def test_a_dead_process_stops_the_cluster_within_seconds(runs):
  status, seconds, process_0_alive = runs["killed"]
  assert status == 128 + signal.SIGKILL  # process 1's fate, as a shell reports it
  assert seconds < 10 and not process_0_alive  # process 0, left waiting in a collective, was stopped


@pytest.mark.slow
def test_process_0_alone_writes_the_run_files(runs):
  two = runs["two"]
  config = json.load(open(two / "config.json"))["config"]
  assert config["mesh"]["num_processes"] == 2 and config["mesh"]["distributed"] is True
  assert (two / "summary.md").exists() and (two / "curves.png").exists()
  assert len(_records(two / "data" / "metrics.jsonl")) == 9  # each record once
  assert not list(two.glob("*/metrics.jsonl.tmp"))


@pytest.mark.parametrize("fields,message", [
    ({"mesh.num_processes": 2}, r"mesh.num_processes=2 describe a multi-process cluster, but mesh.distr"),
    ({"mesh.distributed": True, "mesh.coordinator_address": "localhost"},
     r"mesh.coordinator_address must be 'host:port' .* got 'localhost'"),
    ({"mesh.distributed": True, "mesh.num_processes": -2}, r"mesh.num_processes must be an int >= 1 .*-2"),
    ({"mesh.distributed": True, "mesh.num_processes": 2, "mesh.process_id": 2},
     r"mesh.process_id must be an int in \[0, mesh.num_processes=2\) .* got 2"),
])
def test_bad_cluster_fields_stop_before_anything_is_written(tmp_path, fields, message):
  config = common.set_fields(tiny_config.get_config(), fields)
  with pytest.raises(ValueError, match=message):
    main.run(config, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_cluster_fields_reach_jax_distributed():
  config = common.set_fields(tiny_config.get_config(), {
      "mesh.distributed": True, "mesh.coordinator_address": "10.0.0.1:1234", "mesh.num_processes": 4,
      "mesh.process_id": 3})
  assert main.cluster_arguments(config.mesh) == dict(coordinator_address="10.0.0.1:1234", num_processes=4,
                                                     process_id=3)
  auto = common.set_fields(tiny_config.get_config(), {"mesh.distributed": True})
  assert main.cluster_arguments(auto.mesh) == {}  # TPU VMs, SLURM: jax.distributed detects the cluster


def test_forced_device_count_keeps_other_xla_flags_and_replaces_an_earlier_count(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8")
  assert local_cluster.xla_flags(2).split() == ["--xla_backend_optimization_level=0",
                                               "--xla_force_host_platform_device_count=2"]
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count_x=1")  # another flag, same prefix
  assert local_cluster.xla_flags(2).split() == ["--xla_force_host_platform_device_count_x=1",
                                               "--xla_force_host_platform_device_count=2"]
  monkeypatch.delenv("XLA_FLAGS")
  assert local_cluster.process_env(4, 1234)["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
  for bad in (0, -1, 2.5, True, "8"):
    with pytest.raises(ValueError, match=r"devices must be an int >= 1, got"):
      local_cluster.xla_flags(bad)


def test_local_cluster_refuses_a_cluster_field_on_its_command_line():
  """It appends the cluster's fields itself: a user's value (given before them) was replaced silently."""
  for arg in ("--config.mesh.num_processes=4", "--noconfig.mesh.distributed", "--config.mesh.process_id=1",
              "--config.mesh.coordinator_address=10.0.0.1:99"):
    with pytest.raises(ValueError, match=f"{arg!r}: local_cluster sets --config.mesh"):
      local_cluster.commands(2, 1234, ["--config=experiments/configs/tiny.py", arg])
  cmds = local_cluster.commands(2, 1234, ["--config=experiments/configs/tiny.py", "--config.mesh.data=2"])
  assert [c[-1] for c in cmds] == ["--config.mesh.process_id=0", "--config.mesh.process_id=1"]


@pytest.mark.slow
def test_local_cluster_names_a_missing_config():
  """Without ``-- --config=...`` the cluster's own fields were refused first: "Unknown command line flag
  'config.mesh.distributed'"."""
  for args in ([], ["--workdir=/tmp/run"], ["--config.mesh.data=2"]):
    with pytest.raises(ValueError, match=r"no --config among experiments.main's arguments"):
      local_cluster.commands(2, 1234, args)
  result = subprocess.run([sys.executable, "-m", "experiments.local_cluster", "--processes=2"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert "no --config among experiments.main's arguments" in result.stderr, result.stderr[-3000:]
  assert "Unknown command line flag" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_distributed_without_a_cluster_is_named(tmp_path):
  """mesh.distributed=True where JAX detects no cluster and none is given: JAX's bare "coordinator_address
  should be defined" now says which field asked for it and what to give."""
  # Its own process: jax.distributed.initialize must come before JAX's backend starts, which this one's has.
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TPU_", "MEGASCALE_"))}
  result = subprocess.run([sys.executable, "-m", "experiments.main", "--config=experiments/configs/tiny.py",
                           f"--workdir={tmp_path / 'out'}", "--config.mesh.distributed=True"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert re.search(r"mesh.distributed=True, but jax.distributed.initialize\(\{\}\) found no cluster "
                   r".*coordinator_address", result.stderr), result.stderr[-3000:]
