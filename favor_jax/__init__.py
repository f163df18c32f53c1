"""favor_jax: Performer-style random-feature attention (FAVOR+ and successors) in JAX."""

from importlib import metadata as _metadata

from favor_jax import core
from favor_jax.core import (
    favor_attention,
    iid_gaussian_projection,
    linear_attention,
    orthogonal_projection,
    simplex_projection,
    softmax_attention,
)

__all__ = [
    "core",
    "favor_attention",
    "iid_gaussian_projection",
    "linear_attention",
    "orthogonal_projection",
    "simplex_projection",
    "softmax_attention",
]



def _version() -> str:
  """The installed distribution's version; from a checkout that is not installed (``PYTHONPATH``), the one in
  its pyproject.toml; "0+unknown" if neither is there."""
  try:
    return _metadata.version("favor_jax")
  except _metadata.PackageNotFoundError:
    import pathlib
    import re
    pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
    return found.group(1) if found else "0+unknown"


__version__ = _version()
