"""Sphinx configuration of favor_jax's documentation (Sphinx + MyST, as jax, flax and optax build theirs).

Build (warnings are errors, as in ``tests/test_docs.py``)::

  pip install -e ".[docs]"
  sphinx-build -W --keep-going -b html docs docs/_build/html
"""

import pathlib
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
