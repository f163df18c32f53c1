"""Every relative link and every repository path named in docs/, notebooks/, the results' READMEs and README.md
exists (a renamed test file or a moved section leaves a reader with a dead end). The built site's own links:
tests/test_docs.py."""

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A repository path named in prose: one of these folders, then a path (not part of a longer path or word).
PATH = re.compile(r"(?<![\w/.-])((?:favor_jax|tests|experiments|docs|notebooks|\.ci)/[\w./-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # Markdown links and images
PLACEHOLDER = re.compile(r"[*{}<>]|\bDIR\b|\bNAME\b")  # a pattern or a command's argument, not one file
BUILT = ("docs/_build",)  # written by the docs build the text tells the reader to run


def documents():
  """(path, text) of each page: docs/**/*.md (not the build or the copied tutorials), the notebooks' cells,
  experiments/results/*/README*, README.md."""
  for page in sorted((ROOT / "docs").rglob("*.md")):
    if not {"_build", "tutorials"} & set(page.relative_to(ROOT / "docs").parts):
      yield page, page.read_text()
  for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
    yield notebook, "\n".join("".join(cell["source"]) for cell in json.loads(notebook.read_text())["cells"])
  for readme in sorted((ROOT / "experiments" / "results").glob("*/README*")):
    yield readme, readme.read_text()
  yield ROOT / "README.md", (ROOT / "README.md").read_text()


def dead_ends(page: pathlib.Path, text: str) -> list[str]:
  """The relative links of ``text`` (resolved from ``page``'s folder) and the repository paths it names
  (resolved from the root) that do not exist."""
  dead = []
  for target in LINK.findall(text):
    if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", target) and not (page.parent / target.split("#")[0]).exists():
      dead.append(f"link {target}")
  for path in PATH.findall(text):
    path = path.rstrip(".")
    if not PLACEHOLDER.search(path) and not path.startswith(BUILT) and not (ROOT / path).exists():
      dead.append(f"path {path}")
  return dead


def test_dead_ends_are_found():
  page = ROOT / "docs" / "index.md"
  text = ("[ok](speed.md#gpu) [gone](nowhere.md) ![img](../experiments/results/showcase_cpu/showcase.png) "
          "[web](https://example.org/x.md) [here](#top) `tests/test_links.py`, `tests/core/test_gone.py`. "
          "`experiments/results/DIR/` `docs/*.md` a/tests/x.py")
  assert dead_ends(page, text) == ["link nowhere.md", "path tests/core/test_gone.py"]


def test_every_link_and_path_named_exists():
  dead = {str(page.relative_to(ROOT)): found for page, text in documents() if (found := dead_ends(page, text))}
  assert dead == {}
  assert len(list(documents())) > 20  # the pages were read
