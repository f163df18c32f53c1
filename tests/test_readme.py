"""Every ```python block of README.md runs as written, each on its own, as a reader would paste it."""

import json
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs each block in a fresh namespace (imports are shared, so this is one JAX start-up, not one per block),
# naming the README line a failing block starts on.
RUNNER = textwrap.dedent("""
    import json, sys, traceback
    for line, code in json.loads(sys.stdin.read()):
      try:
        exec(compile(code, f"README.md block at line {line}", "exec"), {"__name__": "__main__"})
      except BaseException:
        traceback.print_exc()
        sys.exit(f"README.md: the python block at line {line} fails")
""")


def python_blocks(text):
  """(line of the block's first code line, code) for every ```python fence."""
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
          for m in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)]


def test_python_blocks_are_found():
  text = "intro\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
  assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = 2\nz = 3\n")]


def test_every_readme_python_block_runs():
  blocks = python_blocks((ROOT / "README.md").read_text())
  assert len(blocks) >= 4, blocks  # quick start, make_attention_fn, Linen, NNX
  out = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
