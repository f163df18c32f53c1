"""Every ``python -m experiments.main`` command of README.md and the docs pages (docs/*.md) is accepted as
written, and each one that writes into experiments/results/ would run what the committed results there ran."""

import copy
import json
import pathlib
import re
import shlex

import pytest
from absl import flags
from ml_collections import config_flags

from experiments import main
from experiments.configs import common
from experiments.train import training

ROOT = pathlib.Path(__file__).resolve().parents[2]


def experiment_commands(text):
  """[argument list] of every ``python -m experiments.main`` command in ``text``: continued lines joined,
  ``# comments`` dropped, a command quoted inside another's argument (``--command="cd x && python -m …"``)
  taken up to its closing quote."""
  text = re.sub(r"\\\n\s*", " ", text)
  out = []
  for m in re.finditer(r"python -m experiments\.main ([^\n`]*)", text):
    line = m.group(1).split(" && ")[0]
    try:
      out.append(shlex.split(line, comments=True))
    except ValueError:  # the unmatched closing quote of an enclosing argument
      out.append(shlex.split(line.rstrip().removesuffix('"'), comments=True))
  return out


def test_experiment_commands_are_found():
  text = ("Run\n\n    pip install -e . && python -m experiments.main --config=a.py --workdir=DIR   # a comment\n"
          "`python -m experiments.main --config=b.py:quick \"--config.methods=('x','y')\"` and\n"
          "    XLA_FLAGS=--n=8 python -m experiments.main \\\n        --config=c.py --config.only=p,q\n"
          "    ssh --command=\"cd r && python -m experiments.main --config=d.py --config.mesh.data=32\"\n")
  assert experiment_commands(text) == [
      ["--config=a.py", "--workdir=DIR"], ["--config=b.py:quick", "--config.methods=('x','y')"],
      ["--config=c.py", "--config.only=p,q"], ["--config=d.py", "--config.mesh.data=32"]]


def parse(args):
  """(config, overrides, workdir) as ``experiments.main`` gets them from ``args`` (config_flags, locked)."""
  values = flags.FlagValues()
  config = config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=["main"] + args)
  flags.DEFINE_string("workdir", None, "", flag_values=values)
  assert not main.repeated_fields(["main"] + args), args  # main stops on a field given twice
  values(["main"] + args)
  return config.value, main.command_line_overrides(values), values["workdir"].value


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the front page and the guide pages
COMMANDS = experiment_commands("\n".join(page.read_text() for page in PAGES))
# A results directory may name the command that wrote it in its own README.md, where README.md's command for the
# same config writes elsewhere (the main job: --workdir=workdir/showcase there).
OWN_COMMANDS = [args for path in sorted((ROOT / "experiments/results").glob("*/README.md"))
                for args in experiment_commands(path.read_text())
                if f"--workdir={path.parent.relative_to(ROOT)}" in args]


def test_pages_have_their_experiment_commands():
  assert len(COMMANDS) >= 20, COMMANDS  # main job, each study, the estimator runs, clusters, speed tables


@pytest.mark.slow
@pytest.mark.parametrize("args", COMMANDS + OWN_COMMANDS, ids=lambda args: " ".join(args)[:90])
def test_readme_experiment_command_is_accepted(args):
  config, overrides, _ = parse(args)
  main.prepare(config, overrides)  # every check made before a run starts: fields, values, overrides read


def runs(config, study) -> dict:
  """{run name: the fields that run computes} of a training study."""
  return {name: training.run_fields(c, resume=False) for name, _, c in study.runs(config)}


# (arguments, work directory) of the commands writing committed results, each command parsed once here.
RESULTS = [(args, workdir) for args in COMMANDS + OWN_COMMANDS
           if (workdir := parse(args)[2]).startswith("experiments/results/")]


@pytest.mark.slow
@pytest.mark.parametrize("args,workdir", RESULTS, ids=[workdir for _, workdir in RESULTS])
def test_committed_results_come_from_their_readme_command(args, workdir):
  config, overrides, _ = parse(args)
  config, study = main.prepare(config, overrides)
  saved = json.loads((ROOT / workdir / "config.json").read_text())["config"]
  now = common.flat_fields(json.loads(json.dumps(config.to_dict(), default=str)))
  then = common.flat_fields(saved)
  assert set(then) <= set(now), f"fields the command can no longer set: {sorted(set(then) - set(now))}"
  # Fields added since the results were committed are not in `then` (their defaults are the old behaviour:
  # off); the variants' spelling changed (a variant names its attention.type now): what they run is compared
  # below.
  rest = lambda field: field.rpartition(".")[2] not in ("variants", "only")
  assert {f: v for f, v in then.items() if rest(f)} == {f: now[f] for f in then if rest(f)}
  if hasattr(study, "runs"):
    old = copy.deepcopy(config)
    old.unlock()
    # A nested training config's variants (activations' model) are not what its one run computes.
    nested_variants = lambda field: "." in field and not rest(field)
    common.set_fields(old, {f: v for f, v in then.items() if not nested_variants(f)})
    assert runs(old, study) == runs(config, study)


def test_every_committed_result_has_its_readme_command():
  written = {workdir.rstrip("/") for _, workdir in RESULTS}
  for path in sorted((ROOT / "experiments/results").glob("*/config.json")):
    name = str(path.parent.relative_to(ROOT))
    own = path.parent / "README.md"  # a GPU run's directory says how it was made (experiments/gpu_check.sh)
    assert name in written or (own.exists() and "experiments/gpu_check.sh" in own.read_text()), (
        f"{name} holds committed results that no README command (README.md's or its own) writes")


def test_the_main_command_is_the_showcase():
  """README.md names the main job as one line that installs and runs it (the form the docs quote)."""
  text = (ROOT / "README.md").read_text()
  main_command = ('pip install -e ".[experiments]" && python -m experiments.main '
                  '--config=experiments/configs/showcase.py --workdir=workdir/showcase')
  if "configs/showcase.py" not in text:
    pytest.skip("README.md does not name the showcase yet (the docs rewrite adds it)")
  assert main_command in text
