"""One measurement in a fresh process: its own peak memory, nothing left over from earlier cases.

A study calls ``spawn(module, job)``; ``module`` runs ``child_main(measure)``
under ``if __name__ == "__main__"`` and prints ``measure(job)`` as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status_bytes(key: str) -> int:
  with open("/proc/self/status") as f:
    return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


def reset_peak_rss() -> int:
  """Sets VmHWM to the current RSS (Linux ≥ 4.0) and returns that RSS in bytes."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  return _status_bytes("VmRSS")


def peak_rss() -> int:
  """Peak RSS in bytes since the process started or since ``reset_peak_rss``.

  VmHWM, not ``ru_maxrss``: Linux carries ru_maxrss over from the parent across fork/exec.
  """
  return _status_bytes("VmHWM")


def spawn(module: str, job: dict, env: dict | None = None) -> dict:
  """Runs ``python -m module JOB_JSON`` in the repository root; returns the last line it prints, parsed.

  Raises ``subprocess.CalledProcessError`` when the child fails (the OOM killer included: returncode −9).
  """
  out = subprocess.run([sys.executable, "-m", module, json.dumps(job)], capture_output=True, text=True,
                       check=True, cwd=ROOT, env={**os.environ, **(env or {})})
  return json.loads(out.stdout.strip().splitlines()[-1])


def child_main(measure) -> None:
  print(json.dumps(measure(json.loads(sys.argv[1]))), flush=True)
