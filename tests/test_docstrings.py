"""Every public function and class of the API reference has a Google-style docstring Sphinx can render.

Public: the functions and classes in the ``__all__`` of ``favor_jax.core``, ``favor_jax.core.kernels``,
``favor_jax.layers`` (and its ``linen`` and ``nnx`` modules) and ``favor_jax.parallel``, and the public
methods (and ``__call__``) the layers' classes define. A function's docstring has a one-line summary, an
``Args:`` section naming each of its parameters when it takes any, a ``Returns:`` section when it returns a
value, and a ``Raises:`` section when its own body raises; a class's has ``Args:`` or ``Attributes:``.
"""

import ast
import importlib
import inspect
import textwrap

import pytest

PUBLIC = ("favor_jax.core", "favor_jax.core.kernels", "favor_jax.layers", "favor_jax.layers.linen",
          "favor_jax.layers.nnx", "favor_jax.parallel")
METHODS_OF = ("favor_jax.layers.",)  # classes whose own public methods the API reference shows


def sections(doc: str) -> dict[str, str]:
  """The Google-style sections of a docstring by title (``Args``, ``Returns``, ...), each its body."""
  out, title = {}, None
  for line in inspect.cleandoc(doc).splitlines():
    stripped = line.rstrip()
    if stripped and not stripped[0].isspace() and stripped.endswith(":") and " " not in stripped[:-1]:
      title = stripped[:-1]
      out[title] = ""
    elif title is not None:
      if stripped and not stripped[0].isspace():
        title = None  # prose after a section ends it
      else:
        out[title] += line + "\n"
  return out


def _own_nodes(fn_node):
  """The AST nodes of a function's own body, nested functions, lambdas and classes left out."""
  stack = list(fn_node.body)
  while stack:
    node = stack.pop()
    yield node
    for child in ast.iter_child_nodes(node):
      if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
        stack.append(child)


def _function_node(fn):
  source = textwrap.dedent(inspect.getsource(fn))
  return next(n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def returns_value(fn) -> bool:
  """Whether ``fn`` returns a value: its annotation if it has one (``None``: no), else a ``return x``."""
  annotation = inspect.signature(fn).return_annotation
  if annotation is not inspect.Signature.empty:
    return annotation not in (None, "None")
  return any(isinstance(n, ast.Return) and n.value is not None for n in _own_nodes(_function_node(fn)))


def raises_itself(fn) -> bool:
  return any(isinstance(n, ast.Raise) for n in _own_nodes(_function_node(fn)))


def problems_of_function(name: str, fn) -> list[str]:
  doc = inspect.getdoc(fn)
  if not doc:
    return [f"{name}: no docstring"]
  found = sections(doc)
  out = []
  if not doc.splitlines()[0].strip():
    out.append(f"{name}: no one-line summary")
  params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
  if params:
    if "Args" not in found:
      out.append(f"{name}: takes {[p.name for p in params]} but has no Args: section")
    else:
      listed = {line.split(":", 1)[0].strip().lstrip("*") for line in found["Args"].splitlines()
                if ":" in line and line.startswith("  ") and not line.startswith("    ")}
      missing = [p.name for p in params if p.name not in listed]
      if missing:
        out.append(f"{name}: Args: does not name {missing}")
  if returns_value(fn) and "Returns" not in found and "Yields" not in found:
    out.append(f"{name}: returns a value but has no Returns: section")
  if raises_itself(fn) and "Raises" not in found:
    out.append(f"{name}: raises but has no Raises: section")
  return out


def public_objects():
  """(dotted name, object) of every public function and class, and the layers' classes' own methods."""
  seen, out = set(), []
  for module_name in PUBLIC:
    module = importlib.import_module(module_name)
    for name in module.__all__:
      obj = getattr(module, name)
      if not (inspect.isfunction(obj) or inspect.isclass(obj)) or id(obj) in seen:
        continue
      seen.add(id(obj))
      out.append((f"{module_name}.{name}", obj))
      if inspect.isclass(obj) and obj.__module__.startswith(METHODS_OF):
        for attr, member in vars(obj).items():
          if inspect.isfunction(member) and (attr == "__call__" or not attr.startswith("_")):
            out.append((f"{module_name}.{name}.{attr}", member))
  return out


@pytest.mark.parametrize("name,obj", public_objects(), ids=lambda x: x if isinstance(x, str) else "")
def test_public_docstring_has_its_sections(name, obj):
  if inspect.isclass(obj):
    doc = inspect.getdoc(obj) if obj.__doc__ else None
    assert doc, f"{name}: no docstring"
    found = sections(doc)
    assert "Args" in found or "Attributes" in found, f"{name}: a class needs an Args: or Attributes: section"
  else:
    problems = problems_of_function(name, obj)
    assert not problems, "\n".join(problems)


def test_public_objects_cover_the_api():
  names = {name for name, _ in public_objects()}
  assert {"favor_jax.core.favor_attention", "favor_jax.core.Kernel", "favor_jax.layers.linen.FavorAttention",
          "favor_jax.layers.nnx.FavorAttention.__call__", "favor_jax.parallel.sequence_parallel_attention"} <= names


def test_a_function_without_its_sections_is_caught():
  def bare(x, y=1):
    """Adds."""
    if x is None:
      raise ValueError("x")
    return x + y

  def good(x, *, y=1):
    """Adds.

    Args:
      x: a number.
      y: another.

    Returns:
      The sum.

    Raises:
      ValueError: if ``x`` is None.
    """
    if x is None:
      raise ValueError("x")
    return x + y

  def partial_args(x, y):
    """Adds.

    Args:
      x: a number; y: not a listed argument.

    Returns:
      The sum.
    """
    return x + y

  problems = problems_of_function("bare", bare)
  assert any("Args" in p for p in problems) and any("Returns" in p for p in problems)
  assert any("Raises" in p for p in problems)
  assert problems_of_function("good", good) == []
  assert problems_of_function("partial_args", partial_args) == ["partial_args: Args: does not name ['y']"]


def test_sections_reads_google_style():
  doc = "Summary.\n\nArgs:\n  a: one.\n    more of a.\n  b: two.\n\nReturns:\n  x.\n"
  found = sections(doc)
  assert set(found) == {"Args", "Returns"}
  assert "a: one." in found["Args"] and "b: two." in found["Args"]
