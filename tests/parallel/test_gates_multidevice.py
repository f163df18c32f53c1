"""Runs gate_cases.py in its own process with 8 forced CPU devices (the rest of the suite keeps 1)."""

import os
import subprocess
import sys

from experiments import local_cluster

HERE = os.path.dirname(os.path.abspath(__file__))


def test_gated_and_packed_cases_on_8_forced_cpu_devices():
  env = {**os.environ, "XLA_FLAGS": local_cluster.xla_flags(8), "JAX_PLATFORMS": "cpu"}  # keeps conftest's flags
  result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           os.path.join(HERE, "gate_cases.py")],
                          cwd=os.path.dirname(os.path.dirname(HERE)), env=env, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
