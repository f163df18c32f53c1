"""Runs README.md's quick start as a reader would: the first ```python block under "## Quick start", written
to a fresh temporary directory and run there by this interpreter in isolated mode (-I: neither PYTHONPATH nor
the current directory on sys.path), so only the installed package can be imported; it checks that favor_jax
does not come from the repository that holds README.md.

    python .ci/quickstart.py [README.md]
"""

import pathlib
import re
import subprocess
import sys
import tempfile


def quick_start(text: str) -> str:
  """The first ```python block between the "## Quick start" heading and the next "## " heading."""
  section = re.search(r"^## Quick start\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
  if section is None:
    raise SystemExit("README.md has no '## Quick start' section")
  block = re.search(r"^```python\n(.*?)^```", section.group(1), re.M | re.S)
  if block is None:
    raise SystemExit("README.md's Quick start section has no ```python block")
  return block.group(1)


def main(readme: str = "README.md") -> None:
  code = quick_start(pathlib.Path(readme).read_text())
  repository = pathlib.Path(readme).resolve().parent
  with tempfile.TemporaryDirectory() as tmp:
    script = pathlib.Path(tmp) / "quick_start.py"
    check = ("import favor_jax, pathlib, sys\n"
             f"assert not pathlib.Path(favor_jax.__file__).resolve().is_relative_to({str(repository)!r}), "
             "f'favor_jax imported from the repository ({favor_jax.__file__}), not the installed wheel'\n"
             "print('favor_jax', favor_jax.__version__, 'from', pathlib.Path(favor_jax.__file__).parent)\n")
    script.write_text(check + code)
    print(f"running README.md's quick start ({len(code.splitlines())} lines) in {tmp}", flush=True)
    subprocess.run([sys.executable, "-I", str(script)], cwd=tmp, check=True)
  print("quick start: ok")


if __name__ == "__main__":
  main(*sys.argv[1:])
