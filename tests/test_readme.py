"""Every ```python block of README.md runs as written, each on its own, as a reader would paste it; the Quick
start's first block (which CI runs outside the repository with only the wheel installed) needs nothing but
favor_jax and JAX. docs/*.md: tests/test_docs.py."""

import ast
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs each (where, code) block in a fresh namespace (imports are shared, so this is one JAX start-up, not one
# per block), naming the page and line a failing block starts on.
RUNNER = textwrap.dedent("""
    import json, sys, traceback
    for where, code in json.loads(sys.stdin.read()):
      try:
        exec(compile(code, f"python block at {where}", "exec"), {"__name__": "__main__"})
      except BaseException:
        traceback.print_exc()
        sys.exit(f"{where}: the python block fails")
""")


def python_blocks(text):
  """(line of the block's first code line, code) for every ```python fence."""
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
          for m in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)]


def run_blocks(blocks, timeout=900):
  """Runs [(where, code)] in one fresh interpreter (RUNNER) in the repository root; its completed process."""
  return subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


def quick_start(text):
  """The first ```python block under the heading "## Quick start" (None if there is none)."""
  section = re.search(r"^## Quick start\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
  blocks = python_blocks(section.group(1)) if section else []
  return blocks[0][1] if blocks else None


def test_python_blocks_are_found():
  text = "intro\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
  assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = 2\nz = 3\n")]


def test_quick_start_is_found():
  text = "# t\n```python\na = 0\n```\n## Quick start\ntext\n```python\nb = 1\n```\n```python\nc = 2\n```\n## Next\n"
  assert quick_start(text) == "b = 1\n"
  assert quick_start("# t\n## Install\n```python\na = 0\n```\n") is None


def test_quick_start_needs_only_favor_jax_and_jax():
  code = quick_start((ROOT / "README.md").read_text())
  assert code is not None, "README.md has no ```python block under '## Quick start'"
  imported = set()
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, ast.Import):
      imported |= {alias.name.split(".")[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      imported.add(node.module.split(".")[0])
  stdlib = set(sys.stdlib_module_names)
  assert imported - stdlib <= {"favor_jax", "jax"}, imported - stdlib


@pytest.mark.slow
def test_every_readme_python_block_runs():
  blocks = [(f"README.md:{line}", code) for line, code in python_blocks((ROOT / "README.md").read_text())]
  assert len(blocks) >= 2, blocks  # the quick start: core, Flax
  out = run_blocks(blocks)
  assert out.returncode == 0, out.stderr[-4000:]
