import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

# Files led by tests that run for minutes in processes of their own: scheduled first (with
# --no-loadscope-reorder, pyproject.toml), so that neither xdist worker is left running one of them alone at
# the end while the other idles.
FIRST = ("tests/parallel/test_multidevice.py", "tests/experiments/test_multihost.py",
         "tests/experiments/test_experiments.py", "tests/experiments/test_quality_study.py",
         "tests/experiments/test_training.py")
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
# Tests check results, not speed, on small shapes: most of their time is XLA compiling many small programs.
# LLVM's optimisation level changes how fast the machine code runs, not what it computes (XLA's own graph
# passes, fusion and buffer assignment, still run): on this suite's programs it cuts compilation time by a
# third. Set for the test run only (a level the caller chose is kept); experiments and benchmarks never see it.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def pytest_configure(config):
  """One persistent compilation cache for the run, shared by both workers and every process a test starts
  (they inherit the variable): a program another test already compiled is read back, not compiled again.
  A fresh directory per run (removed at the end), so no run reads another's; a cache the caller set is kept."""
  if hasattr(config, "workerinput"):  # an xdist worker: its controller set the variables before starting it
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_backend_optimization_level" not in flags:  # read when JAX starts its backend: not yet
    os.environ["XLA_FLAGS"] = " ".join([flags, *FAST_COMPILE]).strip()
  if CACHE_ENV not in os.environ:
    os.environ[CACHE_ENV] = config._favor_cache = tempfile.mkdtemp(prefix="favor_jax_compilation_cache_")
  jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])  # this process read it at import


def pytest_unconfigure(config):
  if getattr(config, "_favor_cache", None):
    shutil.rmtree(config._favor_cache, ignore_errors=True)
    del os.environ[CACHE_ENV]


def pytest_collection_modifyitems(items):
  first = lambda item: next((i for i, f in enumerate(FIRST) if item.nodeid.startswith(f + "::")), len(FIRST))
  items.sort(key=first)  # stable: the rest keep their order


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Runs a core test both without and under jax.jit (static kwargs via closure)."""
  if request.param:
    return lambda f, **static: jax.jit(lambda *a: f(*a, **static))
  return lambda f, **static: (lambda *a: f(*a, **static))
