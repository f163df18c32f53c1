import gc
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

# Files led by tests that run for minutes in processes of their own: scheduled first (with
# --no-loadscope-reorder, pyproject.toml), so that neither xdist worker is left running one of them alone at
# the end while the other idles.
FIRST = ("tests/parallel/test_multidevice.py", "tests/test_notebooks.py", "tests/experiments/test_multihost.py",
         "tests/test_docs.py", "tests/test_structure.py",
         "tests/experiments/test_experiments.py", "tests/experiments/test_quality_study.py",
         "tests/experiments/test_training.py", "tests/experiments/test_lm_training.py",
         # then the longest of the rest (worker-seconds, --durations=0 on 2026-12-02 and 12-04), longest first: the run
         # ends on short files, not on one worker finishing a 3-minute file while the other idles
         "tests/core/test_attention.py", "tests/core/test_fused.py", "tests/core/test_numerics.py",
         "tests/core/test_precision.py", "tests/core/test_fused_tpu.py", "tests/experiments/test_generate.py",
         "tests/layers/test_new_estimators.py", "tests/test_export.py", "tests/core/test_user_kernel.py",
         "tests/layers/test_gqa_rotary_decode.py", "tests/experiments/test_tpu_check.py",
         "tests/core/test_estimators.py", "tests/layers/test_linen.py",
         "tests/test_readme.py")
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
# Tests check results, not speed, on small shapes: most of their time is XLA compiling many small programs.
# LLVM's optimisation level changes how fast the machine code runs, not what it computes (XLA's own graph
# passes, fusion and buffer assignment, still run): on this suite's programs it cuts compilation time by a
# third. Set for the test run only (a level the caller chose is kept); experiments and benchmarks never see it.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
# XLA's CPU backend emits each fusion through MLIR (its "fusion emitters") unless told to use its older LLVM
# emitter: the same fused HLO (its elementwise functions may round differently in the last bits), a third of
# the compilation time (measured 2026-12-02, jax 0.10.2: the four causal methods of one kernel 4.9 s → 1.6 s;
# `python -m pytest` 1323 s → 634 s on this project's 2-core machine). Only where this
# jaxlib knows the flag: XLA aborts the process on an unknown one, so a child process tries it first.
EMITTER = "--xla_cpu_use_fusion_emitters=false"
# XLA's CPU backend splits each program's LLVM module into up to 32 parts to compile them on several threads;
# a test worker compiles on one, so the split is pure overhead: one part is the same machine code, compiled in
# ~10% less time (measured 2026-12-05, jax 0.10.2: six causal gradient programs 1.7-2.8 s -> 1.5-1.6 s). Set, as
# the emitter flag is, where this jaxlib knows it.
ONE_PART = "--xla_cpu_parallel_codegen_split_count=1"
# Each lowered operation carries the Python frames that made it (for XLA's error messages and profiles): none
# for the test run (its errors are Python's own), 4% less time in tracing and lowering (tests/core/test_attention.py
# and test_gates.py: 183 s -> 172 s, 2026-12-05). Set for the test run only, and passed to the processes it starts.
LOCATIONS = "JAX_TRACEBACK_IN_LOCATIONS_LIMIT"
# Tracing and lowering allocate millions of short-lived Python objects (jaxprs, tracers, MLIR handles); at
# Python's default thresholds (700, 10, 10) the cyclic collector runs thousands of times per test file, each
# young-generation pass walking objects that die young anyway. Every test process collects less often: this
# one and each xdist worker (here), and the Python processes tests start (notebook kernels, training runs,
# clusters: a ``sitecustomize`` on their PYTHONPATH, see ``pytest_configure``). 8-11% less time in
# compile-bound tests (tests/core/test_gates.py and test_attention.py, 86 tests: 65-66 s -> 58-60 s; four
# training-run tests 96 s -> 88 s; the whole suite 999 s before, 905 s and 954 s after, this machine varying
# by that much from run to run; measured 2026-12-05, jax 0.10.2, 2 cores).
# Peak memory is unchanged (2.26 GB either way): the cycles are still collected, in larger batches.
GC_THRESHOLDS = (50_000, 20, 1000)
gc.set_threshold(*GC_THRESHOLDS)


def _xla_accepts(flag: str) -> bool:
  env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True).returncode == 0


def pytest_configure(config):
  """One persistent compilation cache for the run, shared by both workers and every process a test starts
  (they inherit the variable): a program another test already compiled is read back, not compiled again.
  A fresh directory per run (removed at the end), so no run reads another's; a cache the caller set is kept."""
  if hasattr(config, "workerinput"):  # an xdist worker: its controller set the variables before starting it
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_backend_optimization_level" not in flags:  # read when JAX starts its backend: not yet
    fast = list(FAST_COMPILE)
    known = [f for f in (EMITTER, ONE_PART) if f.split("=")[0] not in flags]
    if known and not _xla_accepts(" ".join(known)):  # one child process asks for both; where one is refused, each
      known = [f for f in known if _xla_accepts(f)]
    fast += known
    os.environ["XLA_FLAGS"] = " ".join([flags, *fast]).strip()
  if LOCATIONS not in os.environ:
    os.environ[LOCATIONS] = "0"
    jax.config.update("jax_traceback_in_locations_limit", 0)  # this process read the variable at import
  if CACHE_ENV not in os.environ:
    os.environ[CACHE_ENV] = config._favor_cache = tempfile.mkdtemp(prefix="favor_jax_compilation_cache_")
  jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])  # this process read it at import
  _children_collect_less_often(config)


def _children_collect_less_often(config):
  """Python imports ``sitecustomize`` at startup from its path: one in a directory of this run's own, put first
  on PYTHONPATH, gives every process a test starts the suite's GC thresholds. Not where a sitecustomize is
  already importable: the interpreter's own or the caller's PYTHONPATH's (this one would hide it), or this
  run's, in a pytest that a test starts."""
  if importlib.util.find_spec("sitecustomize") is not None:
    return
  site = tempfile.mkdtemp(prefix="favor_jax_test_site_")
  config._favor_site = (site, os.environ.get("PYTHONPATH"))  # removed, and PYTHONPATH restored, at the end
  with open(os.path.join(site, "sitecustomize.py"), "w") as f:
    f.write(f"import gc\ngc.set_threshold(*{GC_THRESHOLDS!r})  # tests/conftest.py: the suite's GC thresholds\n")
  os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, config._favor_site[1]]))


def pytest_sessionstart(session):
  session.config._favor_start = time.time()


def pytest_unconfigure(config):
  if getattr(config, "_favor_cache", None):
    shutil.rmtree(config._favor_cache, ignore_errors=True)
    del os.environ[CACHE_ENV]
  if getattr(config, "_favor_site", None):
    site, pythonpath = config._favor_site
    shutil.rmtree(site, ignore_errors=True)
    if pythonpath is None:
      del os.environ["PYTHONPATH"]
    else:
      os.environ["PYTHONPATH"] = pythonpath


CRASHED = set()  # tests whose worker died once (the controller's record)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  """An xdist worker died mid-test (seen in fresh-clone runs of 2026-12-01 and 12-02, the same test each time:
  a segfault inside XLA's CPU compiler once the worker reached the kernel's limit on memory mappings; see
  ``_release_compiled_programs``, which now keeps workers far below it). With ``--dist loadfile`` the
  replacement worker runs the test again; its first crash is reported as a rerun (listed, not a failure),
  so that run decides. A second crash of the same test fails it; failures that are not crashes are never
  rerun."""
  del sched
  if crashitem not in CRASHED:
    CRASHED.add(crashitem)
    report.outcome = "rerun"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """xdist's file scheduler, mended for a worker crash (pytest-xdist issues 784, 1323 and 1327, unreleased
  in 3.8): it requeued the files the dead worker had finished, as empty work no worker ever completes, and a
  worker handed a single test waited for a second one; either way the run hung after the crash. Here a
  finished file is dropped, and a worker gets work until it holds two tests or a shutdown."""
  if config.getvalue("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling

  class CrashSafeLoadFile(LoadFileScheduling):
    def remove_node(self, node):
      workload = self.assigned_work.get(node, {})
      for scope in [scope for scope, unit in workload.items() if all(unit.values())]:
        del workload[scope]  # finished: not requeued
      return super().remove_node(node)

    started = False  # the first distribution is done (it gives every worker two files itself)

    def schedule(self):
      super().schedule()
      self.started = self.collection is not None

    def _assign_work_unit(self, node):
      if node not in self.registered_collections:  # a replacement still collecting: its schedule() call comes
        return
      super()._assign_work_unit(node)
      if not self.started:
        return
      if not self.workqueue:  # nothing left to hand out: the node runs what it holds, then stops
        node.shutdown()
      elif self._pending_of(self.assigned_work[node]) < 2:  # a worker starts a test once it holds the next
        self._assign_work_unit(node)

  return CrashSafeLoadFile(config, log)


def pytest_report_teststatus(report):
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN", {"yellow": True})
  return None


# The suite's budget on this project's machine (2 quiet cores): the default tier in 5 minutes, the whole suite
# (CI's `-m "slow or not slow"`) in 15. Printed beside the measured time, never asserted: a busy machine is
# slower, and a timed assertion would fail there for nothing the code did.
BUDGET_S = {"not slow": 300, "slow or not slow": 900}


@pytest.hookimpl(trylast=True)  # after --durations's list of the slowest tests
def pytest_terminal_summary(terminalreporter, config):
  for report in terminalreporter.stats.get("rerun", []):
    terminalreporter.line(f"{report.longrepr} (ran again on a fresh worker; that run's result counts)")
  reports = [r for key in ("passed", "failed", "error", "skipped") for r in terminalreporter.stats.get(key, [])
             if hasattr(r, "duration")]
  tests = {r.nodeid for r in reports}
  if not tests:  # --collect-only, or nothing selected
    return
  in_tests = sum(r.duration for r in reports)  # setup, call and teardown of every test, all workers together
  wall = time.time() - config._favor_start
  tier = config.getoption("markexpr") or "slow or not slow"
  budget = BUDGET_S.get(tier)
  verdict = "" if budget is None else f"; budget {budget} s on 2 quiet cores{' (over it)' if wall > budget else ''}"
  terminalreporter.write_sep("=", f"suite time, tier -m {tier!r}: {len(tests)} tests, {wall:.0f} s wall, "
                                  f"{in_tests:.0f} s in tests over all workers{verdict}")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
  first = lambda item: next((i for i, f in enumerate(FIRST) if item.nodeid.startswith(f + "::")), len(FIRST))
  items.sort(key=first)  # stable: the rest keep their order
  _keep_covering_cases(items)


def _keep_covering_cases(items):
  """``@pytest.mark.slow(default_tier_covers=("name", "method"))`` on a parametrized test: its cases are slow
  (run by ``-m slow`` and the whole suite), except the fewest, chosen greedily in collection order, that take
  every value of each named argument at least once (with none named, the first case): those lose the mark and
  run in the default tier too. So
  the default tier checks every kernel and every method of such a test, and the full cross product runs with
  the rest of the slow tier; every case still runs in the whole suite, once."""
  groups = {}
  for item in items:
    mark = next((m for m in item.own_markers if m.name == "slow" and "default_tier_covers" in m.kwargs), None)
    if mark is not None and hasattr(item, "callspec"):
      groups.setdefault((item.path, item.originalname), (mark.kwargs["default_tier_covers"], []))[1].append(item)
  for names, cases in groups.values():
    values = lambda item: {(n, repr(item.callspec.params[n])) for n in names}
    missing = set().union(*(values(item) for item in cases))
    if not names:  # no argument named: one case, the first
      cases[0].own_markers[:] = [m for m in cases[0].own_markers if m.name != "slow"]
    while missing:
      best = max(cases, key=lambda item: len(values(item) & missing))  # the first of the best (max is stable)
      missing -= values(best)
      best.own_markers[:] = [m for m in best.own_markers if m.name != "slow"]


# Memory mappings a worker may hold when a test file ends and still start the next one: one file has added up to
# 27,391 (tests/core/test_numerics.py), so the worker stays under 25,000 + 27,391 ≈ 52,000, well below the
# kernel's limit of 65,530 (vm.max_map_count).
MAPPINGS_KEPT = 25_000


def _mappings() -> int | None:
  """This process's memory mappings (None where /proc is not there: not Linux)."""
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's compiled programs after a test file once the worker holds more than ``MAPPINGS_KEPT`` memory
  mappings (after every file where it cannot count them). Each program holds mappings of its machine code
  (measured: ~70 per jitted causal gradient, ~330 per eager causal call, all returned by ``jax.clear_caches``),
  and a worker that ran half of the suite reached Linux's limit (vm.max_map_count, 65,530: the core dump of the
  worker that crashed in XLA's compiler held 65,507 mappings), where the next mapping fails and the compiler
  segfaults. Below the threshold the programs stay, so the next file reuses what it shares with this one (the
  eager operations, the projections' draws) instead of compiling it again."""
  yield
  count = _mappings()
  if count is None or count > MAPPINGS_KEPT:
    jax.clear_caches()


@pytest.fixture
def run_bound_children(monkeypatch):
  """The processes this test starts compile at LLVM's optimisation level 1, not the suite's fast-compile flags
  (``FAST_COMPILE``): for children that run their programs for long (a notebook training for hundreds of steps),
  where the programs' speed outweighs their compile time. An optimisation level the caller chose is kept."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  if all(f in flags for f in FAST_COMPILE):
    monkeypatch.setenv("XLA_FLAGS", " ".join([f for f in flags if f not in FAST_COMPILE]
                                             + ["--xla_backend_optimization_level=1"]))


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Runs a core test both without and under jax.jit (static kwargs via closure): eagerly the core runs op by
  op, as a user's first call does; under jit, as a compiled model does."""
  if request.param:
    return lambda f, **static: jax.jit(lambda *a: f(*a, **static))
  return lambda f, **static: (lambda *a: f(*a, **static))
