"""The entry point under misuse, second part (test_robustness.py has the first): a rerun that stops keeps the
results' config, overrides read from ml_collections' record, a field given twice, fields a variant sets but its
run does not read, two commands on one run directory, a resume without its metrics, and the studies' own
repeats and plots."""

import json
import os

import pytest

from experiments import main
from experiments.configs import common
from experiments.configs import tiny as tiny_config
from experiments.train import training


@pytest.mark.slow
def test_refused_rerun_leaves_config_json_describing_the_results(tmp_path):
  """a rerun refused at resume (changed train.lr) must not relabel the finished results."""
  main.run(tiny_config.get_config(), str(tmp_path))
  before = json.loads((tmp_path / "config.json").read_text())["config"]
  changed = common.set_fields(tiny_config.get_config(), {"train.lr": 0.01})
  with pytest.raises(ValueError, match="train.lr: 0.003 -> 0.01"):
    main.run(changed, str(tmp_path), {"train.lr": 0.01})
  after = json.loads((tmp_path / "config.json").read_text())["config"]
  assert after == before and after["train"]["lr"] == 0.003
  assert os.path.exists(tmp_path / "results.json")


def _parse(monkeypatch, argv):
  """experiments.main's command line parsed into a fresh FlagValues (config_flags reads sys.argv)."""
  import sys

  from absl import flags
  from ml_collections import config_flags
  monkeypatch.setattr(sys, "argv", ["main", *argv])
  values = flags.FlagValues()
  config = config_flags.DEFINE_config_file("config", None, "", flag_values=values)
  values(["main", *argv])
  return config.value, values


def test_empty_tuple_override_is_an_override_and_quick_still_applies(monkeypatch):
  """--config.xla_chunks=() was not seen as given, so --config.quick=True ran the full version."""
  config, values = _parse(monkeypatch, ["--config=experiments/configs/blocks.py", "--config.quick=True",
                                        "--config.xla_chunks=()"])
  overrides = main.command_line_overrides(values)
  assert overrides == {"quick": True, "xla_chunks": ()}
  config, _ = main.prepare(config, overrides)
  assert config.quick and config.seq_lens == (64,) and config.heads == 2 and config.xla_chunks == ()


def test_a_field_given_twice_is_named():
  """a repeated --config.FIELD kept its last value (a tuple: both joined), silently."""
  argv = ["main", "--config=x.py", "--config.seq_lens=(64,)", "--config.heads=3", "--config.seq_lens=(128,)",
          "--config.mesh.fsdp", "--noconfig.mesh.fsdp", "--", "--config.heads=4"]
  assert main.repeated_fields(argv) == ["--config.mesh.fsdp", "--config.seq_lens"]
  assert main.repeated_fields(["main", "--config.heads=3", "--config.head_dim=3"]) == []
  assert main.repeated_fields(["main", "--config=a.py", "--workdir=w", "--config=b.py", "--workdir", "v"]) == [
      "--config", "--workdir"]


@pytest.mark.parametrize("field,value,named", [
    ("settings", (("a", 64, 32, 0.3), ("a", 16, 8, 3.0)), "settings"),
    ("num_features", (16, 16), "num_features"), ("kernels", ("positive", "positive"), "kernels")])
def test_approximation_refuses_repeated_sweep_values(field, value, named):
  """two settings with one name: the summary showed the first one's numbers for both."""
  from experiments.configs import approximation as approximation_config
  from experiments.studies import approximation
  config = common.set_fields(approximation_config.get_config("quick"), {field: value})
  with pytest.raises(ValueError, match=f"config.{named}.* must not repeat"):
    approximation.check_study(config)
  approximation.check_study(approximation_config.get_config("quick"))


@pytest.mark.parametrize("fields,named", [
    ({"attention.type": "favor", "attention.kernel": "taylor", "attention.num_features": 7},
     "attention.num_features=7.*no random projection"),
    ({"mesh.fsdp": True}, "mesh.fsdp=True.*mesh.data is 1"),
    ({"attention.kernel": "relu"}, "attention.kernel='relu'.*softmax attention has no FAVOR fields"),
    ({"quick": True}, "quick=True"), ({"experiment": "speed"}, "experiment='speed'"), ({"only": "x"}, "only='x'")])
def test_variant_field_its_run_does_not_read_stops(fields, named):
  """the command line's "read by none of the runs" check, for a variant's own fields."""
  from experiments.train import sweep
  config = tiny_config.get_config()
  config.variants = (("v", fields),)
  with pytest.raises(ValueError, match=f"variant 'v' sets {named}"):
    sweep.variant_configs(config)


@pytest.mark.slow
def test_the_shipped_configs_variants_read_every_field_they_set():
  from experiments.configs import listops, mqar, quickstart, shakespeare
  from experiments.train import sweep
  for module in (mqar, shakespeare, listops, quickstart):
    for arg in (None, "quick"):
      config = module.get_config(arg)
      config.only = ""
      assert sweep.variant_configs(config)


def test_a_second_command_on_a_run_directory_stops(tmp_path):
  """two commands training in one run directory interleaved their metrics and checkpoints."""
  with training.run_lock(str(tmp_path)):
    with pytest.raises(ValueError, match=f"{tmp_path} is being written by another command \\(pid {os.getpid()}"):
      training.train(tiny_config.get_config(), str(tmp_path))
  with training.run_lock(str(tmp_path)):  # released
    pass


@pytest.mark.slow
def test_resume_without_the_metrics_of_the_restored_steps_stops(tmp_path):
  """metrics.jsonl lost, the run resumed and reported best_eval_accuracy over the last steps only."""
  stopped = common.set_fields(tiny_config.get_config(), {"train.stop_after": 4})
  with pytest.raises(training.Stopped):
    main.run(stopped, str(tmp_path), {"train.stop_after": 4})
  os.remove(tmp_path / "run" / "metrics.jsonl")
  with pytest.raises(ValueError, match="metrics.jsonl lacks the records of the steps through 4"):
    main.run(tiny_config.get_config(), str(tmp_path))


def test_speed_refuses_causal_only_methods_without_causal_mode(monkeypatch):
  """favor_scan with causal=(False,) was dropped silently (alone: IndexError in summarize)."""
  from experiments.configs import speed as speed_config
  from experiments.studies import speed
  monkeypatch.setattr(speed, "matmul_ceiling", lambda *a: pytest.fail("measured despite bad input"))
  config = common.set_fields(speed_config.get_config("quick"),
                             {"methods": ("favor", "favor_scan"), "causal": (False,)})
  with pytest.raises(ValueError, match=r"config.methods \['favor_scan'\] time causal attention only"):
    speed.run(config)


def _lines_drawn(monkeypatch, plot, *args):
  from experiments.train import plotting
  drawn = []
  monkeypatch.setattr(plotting, "save", lambda fig, path, **k: drawn.append(
      sum(len(ax.get_lines()) for ax in fig.axes)) or path)
  plot(*args)
  return drawn[0]


def test_speed_and_blocks_plots_draw_every_series(monkeypatch, tmp_path):
  """the speed plot raised KeyError beyond ten methods; the blocks plot dropped series beyond ten."""
  from experiments.configs import blocks as blocks_config
  from experiments.configs import speed as speed_config
  from experiments.studies import blocks, speed
  methods = ("softmax", "jax_dot_product_attention", "favor", "favor_sharp", "taylor", "taylor_d16", "hybrid_w64",
             "positive", "hyperbolic", "relu", "elu_plus_one")
  config = common.set_fields(speed_config.get_config("quick"),
                             {"methods": methods, "causal": (False,), "passes": ("fwd",), "seq_lens": (64, 128)})
  records = [dict(method=m, causal=False, seq_len=n, status="ok", median_s=1e-3, peak_bytes=2**20, **{"pass": "fwd"})
             for m in methods for n in (64, 128)]
  assert _lines_drawn(monkeypatch, speed.plot, records, config, str(tmp_path)) == 2 * len(methods)  # time, memory
  config = common.set_fields(blocks_config.get_config("quick"),
                             {"num_warps": (1, 2, 4, 8), "block_fs": (16, 32, 64), "pallas_chunks": (16, 32)})
  records = [dict(path="pallas", chunk=c, num_warps=w, block_f=f, seq_len=64, pass_="fwd", status="ok", median_s=1e-3)
             for c in (16, 32) for w in (1, 2, 4, 8) for f in (16, 32, 64)]
  records += [dict(path="xla", chunk=c, num_warps=0, block_f=0, seq_len=64, pass_="fwd", status="ok", median_s=1e-3)
              for c in (16, 32)]
  assert _lines_drawn(monkeypatch, blocks.plot, records, config, str(tmp_path)) == 13  # 12 launch choices + XLA


def test_negative_seed_and_infinite_lr_are_named():
  """train.seed=-1 died in numpy's generator ("expected non-negative integer") after the run began."""
  with pytest.raises(ValueError, match="train.seed must be an int >= 0.*got -1"):
    training.check_config(common.set_fields(tiny_config.get_config(), {"train.seed": -1}))
  with pytest.raises(ValueError, match="train.lr must be a finite number > 0, got inf"):
    training.check_config(common.set_fields(tiny_config.get_config(), {"train.lr": float("inf")}))


def test_variant_setting_a_whole_block_is_named():
  """{'train': {'lr': 0.5}} replaced the block and failed later with AttributeError: 'steps'."""
  from experiments.train import sweep
  config = tiny_config.get_config()
  config.variants = (("a", {"train": {"lr": 0.5}}),)
  with pytest.raises(ValueError, match="variant 'a' overrides 'train' with .* is a block of fields"):
    sweep.variant_configs(config)


def test_mqar_power_law_exponent_must_be_finite():
  """data.power_a=inf passed the check (> 0); the power law p(g) ∝ g^(a-1) is then NaN at g=1."""
  from experiments import tasks
  from experiments.configs import mqar as mqar_config
  for bad in (0.0, float("inf"), float("nan")):
    config = common.set_fields(mqar_config.get_config("quick"), {"data.power_a": bad})
    with pytest.raises(ValueError, match="data.power_a must be a finite number > 0"):
      tasks.check_data(config)


def test_peers_needs_two_draws_for_its_interval():
  """approx_draws=1: the mean error's 95% interval was NaN (a standard deviation of one draw); named before
  torch is even looked for."""
  from experiments.configs import peers as peers_config
  from experiments.studies import peers
  config = common.set_fields(peers_config.get_config("quick"), {"approx_draws": 1})
  with pytest.raises(ValueError, match="config.approx_draws must be >= 2"):
    peers.run(config)


@pytest.mark.parametrize("field, value, named", [("kernels", ("positive", "nope"), "config.kernels"),
                                                  ("scales", (1.0, 1.0), "config.scales"),
                                                  ("scales", (0.0,), "config.scales"),
                                                  ("num_draws", 0, "config.num_draws")])
def test_precision_study_names_a_bad_field_before_measuring(field, value, named):
  from experiments.configs import precision as cfg
  from experiments.studies import precision
  config = cfg.get_config("quick")
  config[field] = value
  with pytest.raises(ValueError, match=named):
    precision.run(config, progress=None)
