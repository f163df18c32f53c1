"""The package's structure: no import cycle, no attributes set on functions, no source file over 400 lines, and
the public names of ``favor_jax.core``, ``favor_jax.layers``, ``favor_jax.parallel`` unchanged."""

import ast
import importlib
import inspect
import pathlib
import pkgutil
import subprocess
import sys

import pytest

import favor_jax

ROOT = pathlib.Path(favor_jax.__file__).parent
MAX_LINES = 400

# The public names as of main b1d2658 (before issue 38's restructuring), written out, not read from the code.
PUBLIC = {
    "favor_jax.core": [
        "HybridState", "KERNELS", "PROJECTIONS", "RecurrentState", "alibi_log_gate", "alibi_slopes",
        "attention_weights", "draw_projection", "draw_projection_by_index", "favor_attention", "favor_decode_init",
        "favor_decode_step", "get_kernel",
        "hybrid_attention", "iid_gaussian_projection", "kernels", "linear_attention", "oprf_rho",
        "orthogonal_projection", "saderf_statistic", "simplex_projection", "softmax_attention",
    ],
    "favor_jax.layers": ["PROJECTIONS", "distillation_loss", "draw_projection", "make_attention_fn", "redraw_due"],
    "favor_jax.parallel": ["communication_bytes", "sequence_parallel_attention"],
}


def _module_names() -> list[str]:
  return ["favor_jax"] + sorted(m.name for m in pkgutil.walk_packages(favor_jax.__path__, "favor_jax."))


def _source(name: str) -> pathlib.Path:
  parts = name.split(".")[1:]
  path = ROOT.joinpath(*parts)
  return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _sources() -> list[pathlib.Path]:
  return sorted(ROOT.rglob("*.py"))


def _imports(name: str, modules: set[str]) -> set[str]:
  """The favor_jax modules ``name`` imports anywhere in its source (function-local imports included).

  ``from package import x`` is an edge to the submodule x where x is one, else to the package; the parent
  packages Python initialises on the way are not edges (a submodule may import its siblings).
  """
  path = _source(name)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  edges = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      edges.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
  return {e for e in edges if e in modules and e != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of ``graph`` (module -> modules it imports), or None."""
  state = {}

  def visit(node, path):
    state[node] = "open"
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt, path + [nxt])
        if found:
          return found
    state[node] = "done"
    return None

  for start in sorted(graph):
    if start not in state:
      found = visit(start, [start])
      if found:
        return found
  return None


def test_the_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_the_source():
  modules = set(_module_names())
  graph = {name: _imports(name, modules) for name in modules}
  assert graph["favor_jax.core.attention"], "the import graph must see the core's own imports"
  assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


# One process imports each module first in turn: the package's modules are dropped from ``sys.modules`` before
# each import (JAX and the rest stay loaded), so every module starts the package's import as in a fresh process.
_IMPORT_EACH_FIRST = """
import importlib, sys, traceback
failed = []
package = sys.argv[1]
for name in sys.argv[2:]:
  for loaded in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
    del sys.modules[loaded]
  try:
    importlib.import_module(name)
  except Exception:
    failed.append(name + ":\\n" + traceback.format_exc()[-1500:])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first():
  """Imported before anything else of the package: a module in a cycle meets its partner half-initialised."""
  command = [sys.executable, "-c", _IMPORT_EACH_FIRST, "favor_jax", *_module_names()]
  done = subprocess.run(command, capture_output=True, text=True)
  assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


def test_importing_first_finds_a_cycle(tmp_path):
  """The check above fails on a real cycle (two modules importing each other's names at import time)."""
  pkg = tmp_path / "favor_jax_cycle_probe"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from favor_jax_cycle_probe.b import B\nA = 1\n")
  (pkg / "b.py").write_text("from favor_jax_cycle_probe.a import A\nB = 2\n")
  probe = [sys.executable, "-c", _IMPORT_EACH_FIRST, "favor_jax_cycle_probe", "favor_jax_cycle_probe.a"]
  done = subprocess.run(probe, capture_output=True, text=True, cwd=tmp_path)
  assert done.returncode == 1 and "ImportError" in done.stdout, done.stdout + done.stderr


def _function_attribute_writes(text: str, filename: str = "<source>") -> list[str]:
  """``line: f.attr`` for every attribute set on a function the source defines (``f.attr = …``, ``f.attr += …``,
  ``setattr(f, …)``), wherever it is set."""
  tree = ast.parse(text, filename)
  functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
  found = []
  for node in ast.walk(tree):
    targets = []
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
      targets = [node.target]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
      targets = [ast.Attribute(node.args[0], "<setattr>")]
    for t in targets:
      if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in functions:
        found.append(f"{node.lineno}: {t.value.id}.{t.attr}")
  return found


def test_the_source_scan_finds_attributes_set_on_functions():
  text = ("def f():\n  def g():\n    pass\n  g.layout_free = True\n  return g\n"
          "f.whole_sequence = False\nsetattr(f, 'x', 1)\nclass C:\n  pass\nC.y = 1\nobj = C()\nobj.z = 2\n")
  assert sorted(_function_attribute_writes(text)) == ["4: g.layout_free", "6: f.whole_sequence", "7: f.<setattr>"]


def test_no_function_has_attributes_assigned_in_the_source():
  found = [f"{path.relative_to(ROOT.parent)}:{hit}" for path in _sources()
           for hit in _function_attribute_writes(path.read_text(), str(path))]
  assert not found, "attributes set on functions:\n" + "\n".join(found)


# What functools.wraps leaves on a function's __dict__.
ALLOWED_FUNCTION_ATTRIBUTES = {"__wrapped__"}


@pytest.mark.parametrize("name", _module_names())
def test_no_function_has_attributes_at_runtime(name):
  module = importlib.import_module(name)
  found = [f"{key}: {sorted(vars(obj))}" for key, obj in vars(module).items()
           if inspect.isfunction(obj) and obj.__module__ == name and set(vars(obj)) - ALLOWED_FUNCTION_ATTRIBUTES]
  assert not found, f"functions of {name} with attributes: {found}"


def test_no_source_file_over_400_lines():
  long = {str(p.relative_to(ROOT.parent)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not long, f"source files over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_names_unchanged(name):
  module = importlib.import_module(name)
  names = getattr(module, "__all__", None)
  if names is None:
    names = [n for n in dir(module) if not n.startswith("_")]
  assert sorted(names) == sorted(PUBLIC[name])
  for public in names:
    assert hasattr(module, public), f"{name}.__all__ names {public}, which it lacks"


# experiments/: which of its packages each package may import (the layers point down: configs and tasks import
# nothing above them, the training stack never imports a study). Top-level modules (main.py, the entry points)
# may import any of them.
EXPERIMENTS = ROOT.parent / "experiments"
EXPERIMENT_LAYERS = {
    "configs": {"configs"},
    "tasks": {"tasks"},
    "train": {"configs", "tasks", "train"},
    "studies": {"configs", "tasks", "train", "studies"},
}


def _experiment_imports(text: str, filename: str = "<source>") -> set[str]:
  """The ``experiments`` packages (``train``, ``tasks``, …; ``""`` for a top-level module) a source imports anywhere,
  function-local imports included."""
  found = set()
  for node in ast.walk(ast.parse(text, filename)):
    modules = []
    if isinstance(node, ast.Import):
      modules = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      modules = ([f"{node.module}.{alias.name}" for alias in node.names] if node.module == "experiments"
                 else [node.module])
    for module in modules:
      parts = module.split(".")
      if parts[0] == "experiments" and len(parts) > 1:
        found.add(parts[1] if (EXPERIMENTS / parts[1]).is_dir() else "")
  return found


def _experiment_layer_breaks() -> list[str]:
  """``path: package`` for every import of an ``experiments`` package its layer may not import."""
  found = []
  for layer, allowed in EXPERIMENT_LAYERS.items():
    for path in sorted((EXPERIMENTS / layer).rglob("*.py")):
      for package in sorted(_experiment_imports(path.read_text(), str(path)) - allowed):
        found.append(f"{path.relative_to(ROOT.parent)}: experiments.{package or '<top-level module>'}")
  return found


def test_the_experiments_import_scan_sees_each_form():
  text = ("from experiments import tasks, main\nfrom experiments.train import models\n"
          "import experiments.studies.speed\ndef f():\n  from experiments.configs import common\n")
  assert _experiment_imports(text) == {"tasks", "", "train", "studies", "configs"}


def test_experiments_imports_point_down():
  """A study may import the training stack; the training stack, the tasks and the configs never import upward."""
  assert set(EXPERIMENT_LAYERS) <= {p.name for p in EXPERIMENTS.iterdir() if (p / "__init__.py").exists()}
  assert _experiment_imports((EXPERIMENTS / "train" / "training.py").read_text()) >= {"train", "tasks"}
  breaks = _experiment_layer_breaks()
  assert not breaks, "imports against experiments/' layers:\n" + "\n".join(breaks)
