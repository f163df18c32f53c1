"""Runs multidevice_cases.py in its own process with 8 forced CPU devices (the rest of the suite keeps 1)."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_multidevice_cases_on_8_forced_cpu_devices():
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"  # keeps conftest's
  env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           os.path.join(HERE, "multidevice_cases.py")],
                          cwd=os.path.dirname(os.path.dirname(HERE)), env=env, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
