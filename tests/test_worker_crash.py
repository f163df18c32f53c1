"""The suite's own xdist setup (tests/conftest.py) after a worker crash: the test that was running when the
worker died runs again on a fresh worker and that run decides; finished files are not rerun; a plain failure
is not rerun; the run ends (xdist 3.8's file scheduler hung there)."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

CRASH_ONCE = """
import ctypes, os

def test_{name}_before():
  pass

def test_{name}_crashes_once():
  mark = os.path.join(os.path.dirname(__file__), "{name}.ran")
  if not os.path.exists(mark):
    open(mark, "w").close()
    ctypes.string_at(0)  # a segfault: the worker process dies

def test_{name}_after():
  pass
"""


@pytest.mark.slow
def test_a_crashed_test_runs_again_on_a_fresh_worker_and_the_run_ends(tmp_path):
  shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  (tmp_path / "test_a.py").write_text(CRASH_ONCE.format(name="a"))
  (tmp_path / "test_b.py").write_text("def test_b1():\n  pass\n\ndef test_b2():\n  assert 1 == 2\n")
  (tmp_path / "test_c.py").write_text(CRASH_ONCE.format(name="c"))
  (tmp_path / "test_d.py").write_text("def test_d1():\n  pass\n")
  run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
                        "-p", "no:cacheprovider", "test_a.py", "test_b.py", "test_c.py", "test_d.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
  summary = run.stdout.strip().splitlines()[-1]
  assert run.returncode == 1, run.stdout[-3000:]
  # 9 tests, each counted once (b2 fails and is not rerun), and one rerun per crash.
  assert "1 failed, 8 passed, 2 rerun" in summary, run.stdout[-3000:]
  assert run.stdout.count("crashed while running") == 2 and "(ran again on a fresh worker" in run.stdout
