"""experiments/tpu_check.sh's CPU dry run (what it is wherever jax's backend is not a TPU): every stage runs
(the TPU tests collected, the speed study's five causal methods with jax's TPU flash and splash kernels in
Pallas's interpreter, the chunk sweep of both causal methods) and writes its results."""

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_dry_run_runs_every_stage_and_writes_its_results(tmp_path):
  env = {**os.environ, "TPU_CHECK_DRY_RUN": "1", "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(["bash", "experiments/tpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
  log = done.stdout + done.stderr
  assert done.returncode == 0 and "=== done" in log, log[-3000:]
  speed = json.loads((tmp_path / "speed" / "results.json").read_text())
  timed = {r["method"]: r["status"] for r in speed}
  exact = ("softmax", "tpu_flash_attention", "tpu_splash_attention")
  assert timed == dict.fromkeys(exact + ("favor", "favor_pallas"), "ok"), timed
  assert all(r["causal"] and r["median_s"] > 0 for r in speed)
  blocks = json.loads((tmp_path / "blocks" / "results.json").read_text())
  assert {(r["method"], r["status"]) for r in blocks} == {("chunked", "ok"), ("pallas", "ok")}, blocks
  assert (tmp_path / "speed" / "summary.md").exists() and (tmp_path / "blocks" / "summary.md").exists()
  assert "cpu" in (tmp_path / "machine.txt").read_text().lower()
