"""Runs ``experiments.main`` as a cluster of N JAX processes on this machine, each with K CPU devices.

    python -m experiments.local_cluster --processes=2 --devices_per_process=2 -- \
        --config=experiments/configs/tiny.py --workdir=/tmp/tiny2 --config.mesh.data=4

Everything after ``--`` is experiments.main's command line, given to every
process unchanged plus the cluster: ``--config.mesh.distributed=True
--config.mesh.coordinator_address=127.0.0.1:PORT`` (a free loopback port)
``--config.mesh.num_processes=N --config.mesh.process_id=I``. Each process
gets ``XLA_FLAGS=--xla_force_host_platform_device_count=K``,
``JAX_PLATFORMS=cpu`` and gloo CPU collectives, so the N·K devices form one
global mesh, as the hosts of a TPU slice or a GPU cluster do; the
coordinator listens on 127.0.0.1 only. Process 0's
output is streamed here; the others' go to ``process_I.log`` files in a
temporary directory, whose tail is printed if that process fails. When any
process exits with an error (or is killed), the rest are stopped (SIGTERM,
then SIGKILL after a few seconds) and this command exits with that process's
status (128 + N for signal N); on Linux the processes also die with the
launcher itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_PROCESSES = flags.DEFINE_integer("processes", 2, "JAX processes to start")
_DEVICES = flags.DEFINE_integer("devices_per_process", 1, "forced CPU devices in each process")
_GRACE_S = 3.0  # how long a process stopped with SIGTERM has before SIGKILL


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def xla_flags(devices: int) -> str:
  """This process's ``XLA_FLAGS`` with K forced CPU devices: other flags kept, an earlier device count replaced."""
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
    raise ValueError(f"devices must be an int >= 1, got {devices!r}")
  name = "--xla_force_host_platform_device_count"
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] != name]
  return " ".join(kept + [f"{name}={devices}"])


def process_env(devices: int, port: int) -> dict:
  """The environment of every process: K CPU devices, gloo collectives, everything on the loopback."""
  return {**os.environ, "XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu",
          "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
          "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}"}  # not every interface, JAX's default


CLUSTER_FIELDS = ("mesh.distributed", "mesh.coordinator_address", "mesh.num_processes", "mesh.process_id")


def commands(processes: int, port: int, main_args: list[str]) -> list[list[str]]:
  """experiments.main's command line for each process: ``main_args`` plus the cluster's config fields, which
  ``main_args`` must leave to the launcher (a ValueError names one given). Without ``--config`` in
  ``main_args`` a ValueError says so (the cluster's fields would be refused as unknown flags first)."""
  if not any(arg == "--config" or arg.startswith("--config=") for arg in main_args):
    raise ValueError(f"no --config among experiments.main's arguments {main_args}: give them after '--', e.g. "
                     "python -m experiments.local_cluster --processes=2 -- --config=experiments/configs/tiny.py "
                     "--workdir=DIR")
  for arg in main_args:
    name = arg.split("=", 1)[0].removeprefix("--").removeprefix("no").removeprefix("config.")
    if arg.startswith("--") and name in CLUSTER_FIELDS:
      raise ValueError(f"{arg!r}: local_cluster sets --config.{name} for each process itself (from --processes "
                       "and a free port): leave it out")
  cluster = ["--config.mesh.distributed=True", f"--config.mesh.coordinator_address=127.0.0.1:{port}",
             f"--config.mesh.num_processes={processes}"]
  return [[sys.executable, "-m", "experiments.main", *main_args, *cluster, f"--config.mesh.process_id={i}"]
          for i in range(processes)]


def _die_with_launcher() -> None:
  """Linux: the process gets SIGKILL when the launcher dies, even by SIGKILL, so no cluster is orphaned."""
  try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
  except (OSError, AttributeError):  # not Linux: stopped by the launcher's cleanup only
    pass


def stop(procs: list[subprocess.Popen]) -> None:
  """SIGTERM to every process still running, SIGKILL to those left after the grace period."""
  for p in procs:
    if p.poll() is None:
      p.terminate()
  deadline = time.time() + _GRACE_S
  for p in procs:
    try:
      p.wait(max(deadline - time.time(), 0.01))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def _tail(path: str, lines: int = 40) -> str:
  with open(path, errors="replace") as f:
    return "".join(f.readlines()[-lines:])


def launch(processes: int, devices: int, main_args: list[str]) -> int:
  """Starts the cluster and waits; 0 when every process succeeded, else the first failure's exit status."""
  if type(processes) is not int or processes < 1:
    raise ValueError(f"--processes must be an int >= 1, got {processes!r}")
  if type(devices) is not int or devices < 1:
    raise ValueError(f"--devices_per_process must be an int >= 1, got {devices!r}")
  port = free_port()
  cmds = commands(processes, port, main_args)  # a bad command line stops here, before anything is made
  env, logdir = process_env(devices, port), tempfile.mkdtemp(prefix="local_cluster_")
  procs, logs = [], []
  try:
    for i, cmd in enumerate(cmds):
      if i == 0:
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_launcher))
      else:
        logs.append(os.path.join(logdir, f"process_{i}.log"))
        with open(logs[-1], "wb") as log:
          procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        preexec_fn=_die_with_launcher))
      print(f"local_cluster: process {i} started (pid {procs[-1].pid})", file=sys.stderr, flush=True)
    while True:
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        index, code = failed[0]
        print(f"local_cluster: process {index} exited with status {code}; stopping the others",
              file=sys.stderr, flush=True)
        if index > 0:
          log = logs[index - 1]
          print(f"--- the end of {log} ---\n{_tail(log)}", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code  # killed by signal S: 128 + S, as shells report it
      if all(c == 0 for c in codes):
        return 0
      time.sleep(0.05)
  finally:
    stop(procs)


def main(argv):
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # runs the cleanup in launch
  try:
    sys.exit(launch(_PROCESSES.value, _DEVICES.value, argv[1:]))
  except ValueError as e:  # a bad command line: the message, not a traceback
    sys.exit(f"local_cluster: {e}")


if __name__ == "__main__":
  app.run(main)
