"""Run directories anywhere orbax can write: one path layer (``etils.epath``, orbax's own) for everything a run
keeps — checkpoints, ``metrics.jsonl``, ``run_config.json``, ``config.json``, ``results.json``, ``summary.md``,
plots and the lock.

A run directory is a local path or a ``gs://bucket/path`` URL (Google Cloud Storage: orbax writes its
checkpoints there through TensorStore's GCS driver, everything else goes through ``etils.epath``). A ``gs://``
directory needs ``gcsfs`` (``pip install "favor_jax[gcs]"``, or ``etils[epath-gcs]``; it brings
``google-cloud-storage``, which orbax reads a bucket's checkpoint steps with): without it the command stops,
naming the package and the directory, before anything trains. Any other scheme (``s3://``, ``hf://``,
``memory://``, a typo) is an error: orbax's checkpoints go to local paths and ``gs://`` only, and a URL is never
taken for a local folder name.

On a bucket nothing is appended in place (an object is written whole: ``metrics.jsonl`` is rewritten at each
record) and nothing is locked: an object store has no advisory lock, so a ``.lock`` object only records who is
writing, and a second command on the same directory is warned, not stopped (``checkpointing.run_lock``).
"""

from __future__ import annotations

import importlib.util
import io
import os
import posixpath
import re
import tempfile

from etils import epath

# URL schemes a run directory may use: {scheme: [(module, the pip package that provides it)]}. Orbax's
# checkpoints (TensorStore) go to local paths and gs:// only.
SCHEMES = {"gs": [("gcsfs", "gcsfs"), ("google.cloud.storage", "google-cloud-storage")]}
INSTALL = {"gs": 'pip install "favor_jax[gcs]" (or: pip install gcsfs)'}


def scheme(path) -> str | None:
  """The URL scheme of ``path`` (``"gs"`` of ``gs://b/x``), None for a local path."""
  head, sep, _ = os.fspath(path).partition("://")
  return head if sep and head and "/" not in head else None


def is_url(path) -> bool:
  """Whether ``path`` is a URL (``scheme://...``), not a local path."""
  return scheme(path) is not None


def installed(module: str) -> bool:
  """Whether ``module`` (dotted) can be imported."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # a parent package is missing
    return False


def missing_packages(url_scheme: str) -> list[str]:
  """The pip packages a ``url_scheme://`` run directory needs that are not installed."""
  return [package for module, package in SCHEMES.get(url_scheme, []) if not installed(module)]


def check(path, what: str = "--workdir") -> str:
  """``path`` as the run's directory: a local path made absolute, or a URL of a scheme this layer writes to
  whose packages are installed.

  Args:
    path: a local path or a URL (``gs://bucket/run``).
    what: the flag or field that gave it, for the error message.

  Returns:
    The absolute local path, or the URL without a trailing slash.

  Raises:
    ValueError: for a scheme nothing here writes to, a ``gs://`` URL without its package (both named), or a
      relative path that starts like a URL (``gs:/bucket``: a slash missing).
  """
  text = os.fspath(path)
  url_scheme = scheme(text)
  if url_scheme is None:
    typo = re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", text)
    if typo:  # gs:/bucket/run: a URL with a slash missing would be a local folder "gs:"
      raise ValueError(f"{what}={text} looks like a URL with a slash missing ({typo[0]}//...): give the URL, or "
                       f"./{text} for a local folder of that name")
    return os.path.abspath(text)
  if url_scheme not in SCHEMES:
    supported = ", ".join(f"{s}://" for s in SCHEMES)
    raise ValueError(f"{what}={text}: the scheme {url_scheme}:// is not one a run directory can use (orbax "
                     f"checkpoints to local paths and {supported} only): give a local path or a {supported} URL")
  missing = missing_packages(url_scheme)
  if missing:
    raise ValueError(f"{what}={text} is a {url_scheme}:// URL, but {', '.join(missing)} "
                     f"{'is' if len(missing) == 1 else 'are'} not installed: {INSTALL[url_scheme]}, then rerun")
  bucket = text.split("://", 1)[1].split("/", 1)[0]
  if not bucket:
    raise ValueError(f"{what}={text} names no bucket: give {url_scheme}://BUCKET/PATH")
  return text.rstrip("/")


def check_workdir(path, what: str = "--workdir") -> str:
  """Creates the run (or study) directory ``path`` if needed and checks that it can be written to.

  Args:
    path: a local path, or a URL of a scheme this module writes to (``gs://bucket/run``, its package installed).
    what: the flag or field that gave it, for the error message.

  Returns:
    ``path`` as given for a local one; a URL without its trailing slash, once a probe object has been written
    and removed there (the bucket and the credentials checked before anything trains).

  Raises:
    ValueError: naming ``what``: not a path, a file, not writable, a scheme nothing here writes to (never taken
      for a local folder), or a ``gs://`` URL without its package.
  """
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise ValueError(f"{what} must be a directory path, got {path!r}")
  path = os.fspath(path)
  checked = check(path, what)  # a scheme nothing writes to, or a gs:// URL without its package: stops here
  if is_url(path):
    path = checked
    probe = f"{path}/.write_test"
    try:
      makedirs(path)
      write_text(probe, "")
      remove(probe)
    except Exception as e:  # fsspec backends raise their own types (auth, permission, network)
      raise ValueError(f"{what}={path} cannot be written to ({type(e).__name__}: {e}): check the bucket's "
                       "name and your credentials (gcloud auth application-default login)") from e
    return path
  ancestor = os.path.abspath(path)
  while not os.path.exists(ancestor):
    ancestor = os.path.dirname(ancestor)
  if not os.path.isdir(ancestor):
    where = "" if ancestor == os.path.abspath(path) else f" lies under {ancestor}, which"
    raise ValueError(f"{what}={path}{where} is a file, not a directory: give a directory (one that does "
                     "not exist yet is created)")
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):  # writing a file is the test that holds for ACLs, mounts and root
      pass
  except OSError as e:
    problem = "is not writable" if os.path.isdir(path) else "cannot be created"
    raise ValueError(f"{what}={path} {problem} ({e.strerror}): give a directory you can write to") from e
  return path


def path(p) -> epath.Path:
  """``p`` (a local path or a URL) as an ``epath.Path``; a local one made absolute."""
  return epath.Path(p if is_url(p) else os.path.abspath(os.fspath(p)))


def absolute(p) -> str:
  """A local path made absolute; a URL as it is (``os.path.abspath`` would make ``gs://b`` a folder ``gs:``)."""
  return os.fspath(p) if is_url(p) else os.path.abspath(os.fspath(p))


def parent(p) -> str:
  """The directory above ``p`` (a URL's stays a URL, and a bucket is its own top)."""
  p = absolute(p)
  if is_url(p):
    head, rest = p.split("://", 1)
    return f"{head}://{posixpath.dirname(rest.rstrip('/')) or rest}"
  return os.path.dirname(p)


def exists(p) -> bool:
  return path(p).exists()


def is_dir(p) -> bool:
  return path(p).is_dir()


def makedirs(p) -> None:
  path(p).mkdir(parents=True, exist_ok=True)


def read_text(p) -> str:
  return path(p).read_text()


def write_text(p, text: str) -> None:
  """Writes ``p`` whole: locally through a temporary file and a rename (a reader sees the old file or the new,
  never a part); on a bucket as one object (its upload is atomic)."""
  if is_url(p):
    path(p).write_text(text)
    return
  tmp = os.fspath(p) + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, p)


def write_bytes(p, data: bytes) -> None:
  path(p).write_bytes(data)


def remove(p) -> None:
  """Removes the file ``p`` if it is there."""
  path(p).unlink(missing_ok=True)


def save_figure(fig, p, **savefig) -> None:
  """``fig.savefig`` to ``p``: directly for a local path, through memory for a URL (matplotlib writes files)."""
  if not is_url(p):
    fig.savefig(p, **savefig)
    return
  buffer = io.BytesIO()
  fig.savefig(buffer, format=posixpath.splitext(os.fspath(p))[1].lstrip(".") or "png", **savefig)
  write_bytes(p, buffer.getvalue())
