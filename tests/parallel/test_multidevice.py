"""Runs each *_cases.py here in its own process with 8 forced CPU devices (the rest of the suite keeps 1):
multidevice_cases.py (sequence- and data-parallel attention, layers, training) and gate_cases.py (forget gates
and packed segments across devices)."""

import os
import subprocess
import sys

import pytest

from experiments import local_cluster

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
@pytest.mark.parametrize("cases", ["multidevice_cases.py", "gate_cases.py"])
def test_cases_on_8_forced_cpu_devices(cases):
  env = {**os.environ, "XLA_FLAGS": local_cluster.xla_flags(8), "JAX_PLATFORMS": "cpu"}  # keeps conftest's flags
  result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           os.path.join(HERE, cases)],
                          cwd=os.path.dirname(os.path.dirname(HERE)), env=env, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
