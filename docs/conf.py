"""Sphinx configuration of favor_jax's documentation (Sphinx + MyST, as jax, flax and optax build theirs).

Build (warnings are errors, as in ``tests/test_docs.py``)::

  pip install -e ".[docs]"
  sphinx-build -W --keep-going -b html docs docs/_build/html
"""

import pathlib
import posixpath
import re
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the checkout's favor_jax, installed or not

project = "favor_jax"
author = "the favor_jax authors"
copyright = "2026, the favor_jax authors"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_nb",  # Markdown pages (MyST) and the tutorial notebooks, rendered with their stored outputs
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # Google-style Args:/Returns:/Raises: sections
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax 3 served from _static/mathjax (no CDN): math renders offline
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "README.md", "**.ipynb_checkpoints", "jupyter_execute"]
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# The tests execute the notebooks (tests/test_notebooks*.py); the docs show what they stored.
nb_execution_mode = "off"

# A reference to one of our own names (written in full, ``favor_jax.…``) must resolve; references to other
# libraries' types (jax.Array, jaxtyping's Float[...], flax) are not checked (no intersphinx: builds offline).
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!favor_jax\.).*")]

autosummary_generate = False  # the API pages list every name themselves (tests/test_docs.py checks they are all there)
autodoc_default_options = {"members": False, "undoc-members": False}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# jaxtyping's Float[Array, "..."] as written in the signatures (not Float[jaxlib._jax.Array, ...]).
autodoc_type_aliases = {"Array": "jax.Array"}
autodoc_typehints_format = "short"  # other types by their name (Array, Callable), not their module path
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "sphinx_book_theme"
html_title = "favor_jax"
html_theme_options = {"repository_url": "https://github.com/favor-jax/favor_jax", "use_repository_button": False,
                      "show_toc_level": 2}
html_static_path = []


def _copy_tutorials() -> None:
  """Every notebook under notebooks/ into docs/tutorials/ (ignored by git), so the toctree's glob finds the
  ones that exist when the docs are built; a notebook removed from notebooks/ is removed here too."""
  out = DOCS / "tutorials"
  out.mkdir(exist_ok=True)
  wanted = {p.name: p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}
  for old in out.glob("*.ipynb"):
    if old.name not in wanted:
      old.unlink()
  for name, path in wanted.items():
    if not (out / name).exists() or (out / name).read_bytes() != path.read_bytes():
      shutil.copyfile(path, out / name)


_copy_tutorials()


def _short_array_types(app, what, name, obj, options, lines) -> None:
  """Attribute types that napoleon writes from annotations (``jax.jaxlib._jax.Array``, JAX's implementation
  path) as ``jax.Array``, shown as ``Array``; runs after napoleon (priority 900)."""
  for i, line in enumerate(lines):
    lines[i] = re.sub(r"(?<![\w.~])(?:jax\.)?jaxlib\._jax\.Array\b", "~jax.Array", line)


def _fix_viewcode_backlinks(app, pagename, templatename, context, doctree) -> None:
  """The "[docs]" links of a highlighted source page (viewcode) to the object's entry in the API pages.

  viewcode builds each link as ``<first documented module path of this source module>.<name>``: for a source
  module whose objects are documented under two paths (``favor_jax.core.oprf_rho`` and
  ``favor_jax.core.kernels.check_rho``, both in ``core/statistics.py``) some links name an anchor that does not
  exist. Each link is pointed at the documented object of that page whose name is ``<module>.<name>``.
  """
  if not pagename.startswith("_modules/") or "body" not in context:
    return
  domain = app.env.get_domain("py")
  modules = set(domain.modules)

  def fix(match):
    name, href = match.group(1), match.group(2)
    path, _, anchor = href.partition("#")
    page = posixpath.normpath(posixpath.join(posixpath.dirname(pagename), path))
    page = page[: -len(".html")] if page.endswith(".html") else page
    if anchor in domain.objects and domain.objects[anchor].docname == page:
      return match.group(0)
    found = [full for full, entry in domain.objects.items()
             if entry.docname == page and full.endswith("." + name) and full[: -len(name) - 1] in modules]
    if len(found) != 1:
      return match.group(0)
    return match.group(0).replace(href, f"{path}#{domain.objects[found[0]].node_id}")

  context["body"] = re.sub(r'<div class="viewcode-block" id="([^"]+)">\n<a class="viewcode-back" href="([^"]+)">',
                           fix, context["body"])


def setup(app):
  """The two hooks above."""
  app.connect("autodoc-process-docstring", _short_array_types, priority=900)
  app.connect("html-page-context", _fix_viewcode_backlinks)
