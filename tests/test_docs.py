"""The documentation builds with warnings as errors, lists every public name, and its code runs.

- ``sphinx-build -W`` (in a subprocess, into a temporary directory): a renamed function, a broken
  cross-reference or a docstring Sphinx cannot read fails the test, naming each warning.
- Every name in the ``__all__`` of ``favor_jax.core``, ``favor_jax.core.kernels``, ``favor_jax.layers`` (and its
  ``linen`` and ``nnx`` modules) and ``favor_jax.parallel`` is an object of the built API reference.
- Every ```python block of docs/*.md runs, each in a fresh namespace (README.md's blocks: tests/test_readme.py;
  a docs block identical to one of them is not run twice). A block that cannot run here (8 devices, a long
  run) is marked on the line before its fence with ``<!-- no test: REASON -->``, shown in the page source.
"""

import html
import importlib
import inspect
import pathlib
import re
import subprocess
import sys
import zlib

import pytest

from tests.test_readme import python_blocks, run_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PUBLIC = ("favor_jax.core", "favor_jax.core.kernels", "favor_jax.layers", "favor_jax.layers.linen",
          "favor_jax.layers.nnx", "favor_jax.parallel")
SKIP = re.compile(r"<!-- no test: (.+?) -->\n```python\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """(return code, warnings, output directory) of a strict HTML build of docs/."""
  out = tmp_path_factory.mktemp("docs_html")
  run = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
  return run.returncode, run.stderr, out


@pytest.mark.slow
def test_docs_build_with_warnings_as_errors(built):
  code, warnings, _ = built
  assert code == 0, f"sphinx-build -W failed:\n{warnings[-6000:]}"


def inventory(path: pathlib.Path) -> set[str]:
  """The object names of a Sphinx ``objects.inv`` (format 2: four header lines, then zlib-compressed lines
  ``name domain:role priority uri display``)."""
  data = path.read_bytes()
  body = data.split(b"\n", 4)[4]
  return {line.split(" ", 1)[0] for line in zlib.decompress(body).decode().splitlines() if line.strip()}


def resolve(dotted: str):
  """The object a dotted name names (its longest importable module prefix, then attributes); None if none."""
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    try:
      for attr in parts[cut:]:
        obj = getattr(obj, attr)
    except AttributeError:
      return None
    return obj
  return None


@pytest.mark.slow
def test_api_reference_lists_every_public_name(built):
  """Each public name is documented under its own module's path, or the same object under another public
  module's (``favor_jax.core`` re-exports ``KERNELS`` and ``get_kernel`` of ``favor_jax.core.kernels``)."""
  _, _, out = built
  documented = inventory(out / "objects.inv")
  objects = {id(obj) for name in documented if name.startswith("favor_jax.") and (obj := resolve(name)) is not None}
  missing = [f"{module}.{name}" for module in PUBLIC for name in importlib.import_module(module).__all__
             if f"{module}.{name}" not in documented
             and id(getattr(importlib.import_module(module), name)) not in objects]
  assert not missing, f"public names missing from docs/api/*.md: {missing}"


def broken_local_links(out: pathlib.Path) -> list[str]:
  """``page: href`` of every relative href/src of the built HTML pages whose file, or whose #anchor (an id
  on the target page), does not exist (query strings dropped; the theme's _static templates skipped)."""
  ids, broken = {}, []
  for page in sorted(out.rglob("*.html")):
    if "_static" in page.relative_to(out).parts:
      continue
    for href in re.findall(r'(?:href|src)="([^"]+)"', page.read_text(errors="replace")):
      href = html.unescape(href)
      if re.match(r"^[a-z][a-z0-9+.-]*:|^//", href):
        continue
      path, _, anchor = href.partition("#")
      target = (page.parent / path.split("?")[0]).resolve() if path else page
      if not target.exists():
        broken.append(f"{page.relative_to(out)}: {href}")
      elif anchor and target.suffix == ".html":
        if target not in ids:
          ids[target] = set(re.findall(r'\bid="([^"]+)"', target.read_text(errors="replace")))
        if anchor not in ids[target]:
          broken.append(f"{page.relative_to(out)}: {href}")
  return broken


@pytest.mark.slow
def test_built_pages_have_no_broken_local_links(built):
  """Every relative link of the built site resolves, [source] and [docs] links of viewcode included (a source
  module documented under two module paths once gave links to anchors that do not exist)."""
  _, _, out = built
  assert broken_local_links(out) == []


def test_broken_local_links_are_found(tmp_path):
  (tmp_path / "a.html").write_text('<p id="x"></p><a href="b.html#y">b</a><a href="a.html#x">a</a>'
                                   '<a href="https://example.org/">e</a><a href="c.html">c</a>')
  (tmp_path / "b.html").write_text('<p id="z"></p>')
  assert broken_local_links(tmp_path) == ["a.html: b.html#y", "a.html: c.html"]


@pytest.mark.slow
def test_math_and_types_read_as_written(built):
  """Math is served from the built site (MathJax in _static, no CDN: it renders offline); the shape legend of
  favor_jax.core is a block, not one paragraph; jaxtyping annotations show ``Array``, not JAX's private path."""
  _, _, out = built
  index = (out / "index.html").read_text()
  scripts = re.findall(r'<script[^>]*src="([^"]*mathjax[^"]*)"', index, flags=re.I)
  assert scripts and all(not re.match(r"^[a-z]+:|^//", s) and (out / s.split("?")[0]).exists() for s in scripts)
  assert list((out / "_static" / "mathjax").rglob("*.woff")), "MathJax's fonts are not served locally"
  core = (out / "api" / "core.html").read_text()
  assert "jaxlib" not in core and "jaxlib" not in (out / "api" / "layers.html").read_text()
  legend = re.search(r"<table.*?</table>", core[core.find("Shape letters"):], flags=re.S)
  assert legend and re.search(r"<td><p>L</p></td>\s*<td><p>sequence length", legend.group(0)), "legend not a table"


def repeated_sentences(doc: str) -> list[str]:
  """The sentences (or clauses ending in ``.``, ``:`` or ``;``) of six words or more that ``doc`` says twice."""
  parts = [s for s in re.split(r"(?<=[.:;])\s+", " ".join(doc.split())) if len(s.split()) >= 6]
  return sorted({s for s in parts if parts.count(s) > 1})


def test_no_public_docstring_says_a_sentence_twice():
  """A paragraph left behind by an edit (linear_attention's and hybrid_attention's once said theirs twice)."""
  assert repeated_sentences("Rows with a zero denominator return 0. Features are used as given. Rows with a "
                            "zero denominator return 0.") == ["Rows with a zero denominator return 0."]
  repeats = {f"{module}.{name}": found for module in PUBLIC for name in importlib.import_module(module).__all__
             if (found := repeated_sentences(inspect.getdoc(getattr(importlib.import_module(module), name)) or ""))}
  assert repeats == {}


def test_resolve_names_objects():
  import favor_jax.core
  assert resolve("favor_jax.core.favor_attention") is favor_jax.core.favor_attention
  assert resolve("favor_jax.core.kernels.KERNELS") is favor_jax.core.KERNELS
  assert resolve("favor_jax.core.no_such_name") is None


def test_inventory_reads_names(tmp_path):
  lines = b"favor_jax.core py:module 0 api/core.html#module-$ -\nfavor_jax.core.KERNELS py:data 1 api/core.html#$ -\n"
  (tmp_path / "objects.inv").write_bytes(b"# Sphinx inventory version 2\n# Project: p\n# Version: \n"
                                         b"# The remainder of this file is compressed using zlib.\n"
                                         + zlib.compress(lines))
  assert inventory(tmp_path / "objects.inv") == {"favor_jax.core", "favor_jax.core.KERNELS"}


def docs_blocks():
  """(page:line, code) of every ```python block of docs/*.md not marked ``no test`` and not a README block."""
  readme = {code for _, code in python_blocks((ROOT / "README.md").read_text())}
  blocks = []
  for page in sorted(DOCS.rglob("*.md")):
    if "_build" in page.parts:
      continue
    text = page.read_text()
    skipped = {text.count("\n", 0, m.end()) + 1 for m in SKIP.finditer(text)}
    blocks += [(f"{page.relative_to(ROOT)}:{line}", code) for line, code in python_blocks(text)
               if line not in skipped and code not in readme]
  return blocks


def test_skip_marker_is_read():
  text = "a\n<!-- no test: needs 8 devices -->\n```python\nx = 1\n```\n```python\ny = 2\n```\n"
  assert {text.count("\n", 0, m.end()) + 1 for m in SKIP.finditer(text)} == {4}
  assert [line for line, _ in python_blocks(text)] == [4, 7]


@pytest.mark.slow
def test_every_docs_python_block_runs():
  blocks = docs_blocks()
  assert len(blocks) >= 4, blocks  # flax layers (Linen, NNX, distillation), decoding
  out = run_blocks(blocks)
  assert out.returncode == 0, out.stderr[-4000:]
