"""The quality study's pieces: decoding state sizes, feature counts, seed means, query/key head dim in
configs, and the real-activation capture and measurements (against the model's own outputs and exact
attention)."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import main, tasks
from experiments.configs import activations as activations_config
from experiments.configs import common
from experiments.configs import tiny as tiny_config
from experiments.studies import activations
from experiments.train import models, sweep, training
from favor_jax import core

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXCERPT = os.path.join(REPO, "tests", "data", "shakespeare")


def tiny(**fields):
  return common.set_fields(tiny_config.get_config(), fields)  # d_model 32, 2 heads: head dim 16


def favor(kernel, **fields):
  return tiny(**{"attention.type": "favor", "attention.kernel": kernel,
                 **{f"attention.{k}": v for k, v in fields.items()}})


H, D, L = 2, 16, 32  # the tiny config's heads, head dim and length


@pytest.mark.parametrize("config, want", [
    (tiny(), L * H * 2 * D),  # softmax: the key-value cache at length L
    # S [H, F, Dv+1], μ [H, F] and the last segment id (one int: decoding resets at a new document)
    (favor("positive", num_features=16), H * 16 * (D + 1) + H * 16 + 1),
    (favor("hyperbolic", num_features=16), H * 32 * (D + 1) + H * 32 + 1),  # F = 2M
    # + the window's keys and values, their mask and count, and each slot's accumulated log gate [W, H]
    (favor("positive", num_features=16, window=5), H * 16 * (D + 1) + H * 16 + 5 * H * 2 * D + 5 + 1 + 5 * H + 1),
    # F = 1 + 4 + 10; a maximum per feature (features with a multiplier carry their size in the log: state.parts)
    (favor("taylor", qk_head_dim=4), H * 15 * (D + 1) + H * 15 + 1),
    (tiny(**{"model.short_conv": 4}), 3 * H * D + L * H * 2 * D),  # + the last 3 inputs of width d_model
    (common.set_fields(favor("positive", num_features=16), {"model.short_conv": 3}),
     2 * H * D + H * 16 * (D + 1) + H * 16 + 1),
    # grouped-query attention: one state per key/value head where exact (ungated, a shared projection) ...
    (common.set_fields(favor("positive", num_features=16), {"model.num_kv_heads": 1}), 16 * (D + 1) + 16 + 1),
    # ... one per query head where the gate is per query head; softmax caches its key/value heads (+ decays)
    (common.set_fields(favor("positive", num_features=16, forget_gate=True), {"model.num_kv_heads": 1}),
     H * 16 * (D + 1) + H * 16 + 1),
    (tiny(**{"attention.forget_gate": True, "model.num_kv_heads": 1}), L * 1 * 2 * D + L * H),
])
def test_decode_state_size_closed_forms(config, want):
  assert models.decode_state_size(config, L) == want


@pytest.mark.parametrize("scale", [1.0, 20.0])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_short_conv_is_the_causal_per_channel_sum_over_the_last_width_inputs(scale, dtype, tol):
  x_BLD = (scale * jax.random.normal(jax.random.PRNGKey(0), (2, 9, 5))).astype(dtype)
  conv = models.ShortConv(width=3)
  variables = conv.init(jax.random.PRNGKey(1), x_BLD)
  kernel_K1D, bias_D = (np.asarray(variables["params"]["conv"][n], np.float64) for n in ("kernel", "bias"))
  assert kernel_K1D.shape == (3, 1, 5)  # depthwise: one filter of width 3 per channel
  x = np.pad(np.asarray(x_BLD, np.float64), ((0, 0), (2, 0), (0, 0)))  # zeros before the first token
  want = bias_D + sum(kernel_K1D[j, 0] * x[:, j:j + 9] for j in range(3))  # y_t = b + Σ_j w_j x_{t-2+j}
  got = np.asarray(conv.apply(variables, x_BLD), np.float64)
  np.testing.assert_allclose(got, want, atol=tol * scale * 4)  # |y| ≲ Σ|w||x| ~ a few × scale


@pytest.mark.parametrize("config, want", [
    (tiny(), 0), (favor("positive", num_features=16), 16), (favor("hyperbolic", num_features=16), 32),
    (favor("taylor", qk_head_dim=4), 15), (favor("taylor"), 1 + D + D * (D + 1) // 2), (favor("hedgehog"), 2 * D),
    (favor("saderf", num_features=24), 24)])
def test_feature_dimension_per_head(config, want):
  assert sweep.features(config) == want


@pytest.mark.slow
def test_qk_head_dim_reaches_the_layers_and_bad_values_stop():
  config = favor("taylor", qk_head_dim=4)
  training.check_config(config)
  model = models.make_model(config, 64, 0, L)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, L), jnp.int32))["params"]
  attention = params["block_0"]["attention"]
  assert attention["query"]["kernel"].shape == attention["key"]["kernel"].shape == (32, H, 4)
  assert attention["value"]["kernel"].shape == (32, H, D)
  for bad, match in ((tiny(**{"attention.qk_head_dim": 4}), "for FAVOR layers"),
                     (favor("taylor", qk_head_dim=3), "even attention.qk_head_dim"),
                     (favor("taylor", qk_head_dim=-1), "int >= 0"), (favor("taylor", qk_head_dim=True), "int >= 0")):
    with pytest.raises(ValueError, match=match):
      training.check_config(bad)


def _record(name, seed, accuracy, **setting):
  base = dict(name=name, task="mqar", attention="favor", kernel="positive", num_features=64, projection="orthogonal",
              redraw_every=0, window=0, qk_head_dim=0, short_conv=0, seq_len=128, num_kv_pairs=8, steps=10, features=64,
              state_size=100, seed=seed, eval_loss=1.0, eval_accuracy=accuracy, best_eval_accuracy=accuracy,
              steps_per_s=1.0)
  return {**base, **setting}


def test_mean_over_seeds_groups_settings_not_names():
  records = [_record("a", 0, 0.5), _record("a_s1", 1, 0.7), _record("b", 0, 0.9, window=16),
             _record("c", 0, 0.2, num_kv_pairs=16), _record("softmax", 0, 1.0, attention="softmax", kernel=""),
             _record("a_conv", 0, 0.95, short_conv=4),
             _record("softmax_conv", 0, 0.5, attention="softmax", kernel="", short_conv=4)]
  rows = {r["name"]: r for r in sweep.mean_over_seeds(records, "eval_accuracy")}
  assert set(rows) == {"a", "b", "c", "softmax", "a_conv", "softmax_conv"}
  assert rows["a"]["eval_accuracy"] == pytest.approx(0.6) and rows["a"]["seeds"] == [0, 1]
  assert rows["a"]["spread"] == pytest.approx(0.2) and rows["b"]["eval_accuracy"] == 0.9
  text = sweep.summarize(records, tiny())
  assert "| a | positive M=64 | 8 | 2 | 0.6000 | 0.2000 |" in text
  # accuracies against softmax's 100% with the same kv pairs: both, and the difference in points
  assert "- a: 60.0% against softmax's 100.0% (-40.0 points), mean over 2 seeds" in text
  assert "- b: 90.0% against softmax's 100.0% (-10.0 points)" in text
  assert "- c:" not in text  # 16 pairs: no softmax run at 16 pairs to compare with
  # a model with a short convolution is compared with softmax in the same model, and only with it
  assert text.count("- a_conv:") == 1 and "- a_conv: 95.0% against softmax's 50.0% (+45.0 points)" in text
  assert text.count("- a:") == 1 and "| a_conv | positive M=64 + conv 4 |" in text
  assert "Finding: the best run without softmax, a_conv (positive M=64 + conv 4), reaches eval_accuracy 95.0%" in text


def _bpc(name, seed, bpc, **setting):
  return _record(name, seed, 0.5, task="shakespeare", num_kv_pairs=0, eval_bpc=bpc, **setting)


def test_summary_says_mean_over_seeds_only_over_several_seeds():
  one_seed = [_bpc("softmax", 0, 2.0, attention="softmax", kernel="", features=0), _bpc("favor", 0, 2.2)]
  text = sweep.summarize(one_seed, tiny())
  assert "mean over" not in text.lower() and "Mean over seeds" not in text
  assert "- favor: 1.100" in text
  two = one_seed + [_bpc("softmax_seed1", 1, 2.2, attention="softmax", kernel="", features=0)]
  text = sweep.summarize(two, tiny())
  assert "Relative to softmax (softmax, mean over 2 seeds)" in text and "- favor: 1.048\n" in text
  assert "## Mean over seeds" in text


def test_conversion_summary_gives_each_variants_mean_and_every_seed_against_its_own_control():
  from experiments.configs import backward_compat as backward_compat_config
  from experiments.studies import backward_compat
  run = lambda name, seed, loss, attention="favor": dict(
      name=name, seed=seed, attention=attention, kernel="hedgehog", distill_objective="output_mse",
      distill_decay=False, pretrain_steps=10, finetune_steps=5, softmax_eval_loss=2.0, after_swap_eval_loss=3.0,
      after_distill_eval_loss=2.5, after_finetune_eval_loss=loss, curve=[(0, 3.0)])
  records = [run("softmax_control", 0, 1.0, "softmax"), run("softmax_control_seed1", 1, 2.0, "softmax"),
             run("hedgehog", 0, 1.1), run("hedgehog_seed1", 1, 2.4)]
  config = backward_compat_config.get_config("quick")
  rows = {line.split(" | ")[0].strip("| "): line for line in backward_compat.summarize(records, config).splitlines()
          if line.startswith("| ") and " | 2 | " in line}
  # mean 1.75 over the control's mean 1.5; seed by seed 1.1/1.0 and 2.4/2.0, each against its own control
  assert rows["hedgehog"].endswith("| 2 | 1.7500 | 1.1000 / 2.4000 | 1.167× | 1.100× / 1.200× |"), rows
  assert set(rows) == {"softmax_control", "hedgehog"}
  # one seed per variant: no such table
  assert "Mean over seeds" not in backward_compat.summarize(records[::2], config)


def test_summary_drops_columns_empty_in_every_row():
  records = [_bpc("softmax", 0, 2.0, attention="softmax", kernel="", features=0), _bpc("favor", 0, 2.2)]
  header = next(line for line in sweep.summarize(records, tiny()).splitlines() if line.startswith("| run |"))
  columns = [c.strip() for c in header.strip("|").split("|")]
  assert "kv pairs" not in columns and "F" in columns  # no run has kv pairs; F: softmax "–", FAVOR its 64
  row = next(line for line in sweep.summarize(records, tiny()).splitlines() if line.startswith("| softmax |"))
  assert len(row.strip("|").split("|")) == len(columns) and "| – |" in row
  mqar = [_record("softmax", 0, 1.0, attention="softmax", kernel="", features=0), _record("a", 0, 0.5)]
  assert "kv pairs" in sweep.summarize(mqar, tiny())


def test_near_chance_accuracies_are_not_compared():
  # The MQAR quick summary printed "positive_m64: 1.286" for 1.8% against 1.4% (8 pairs: chance 12.5%).
  records = [_record("softmax", 0, 0.014, attention="softmax", kernel="", features=0),
             _record("positive_m64", 0, 0.018)]
  text = sweep.summarize(records, tiny())
  assert "1.286" not in text and "ratio" not in text
  assert "neither has learned the task: no comparison" in text
  assert "Finding: no run learns the task" in text


# --- real activations ----------------------------------------------------------------------------------


def activations_tiny(**fields):
  config = activations_config.get_config("quick")
  config.model = common.set_fields(tiny_config.shrink(config.model), {
      "data.text_dir": EXCERPT, "data.valid_plays": ("tempest",), "data.seq_len": L, "data.num_eval_batches": 4,
      "train.steps": 2, "train.warmup_steps": 1, "train.eval_every": 2, "train.checkpoint_every": 2})
  config.update(fit_batches=2, measure_batches=1, fit_steps=3, num_draws=1, features=(16,),
                estimators=("favor+", "favor#", "favor+ + window 16", "taylor (fitted)"))
  return common.set_fields(config, fields)


@pytest.mark.slow
def test_captured_qkv_reproduce_the_models_attention_output():
  config = activations_tiny()
  source = activations.model_config(config)
  task = tasks.make_task(source)
  model = models.make_model(source, task.vocab_size, task.num_classes, task.max_len)
  batch = task.eval_batches[0]
  params = model.init(jax.random.PRNGKey(3), batch.tokens)["params"]
  (q, k, v), = activations.capture(source, params, [batch])
  # The attention module's own output, captured separately; rebuilt from q, k, v by exact causal attention.
  _, inter = model.apply({"params": params}, batch.tokens, mutable=["intermediates"],
                         capture_intermediates=lambda m, _: m.name == "attention")
  want = inter["intermediates"]["block_0"]["attention"]["__call__"][0]
  out = params["block_0"]["attention"]["out"]
  heads = core.softmax_attention(q, k, v, causal=True)
  got = jnp.einsum("blhd,hde->ble", heads, out["kernel"]) + out["bias"]
  np.testing.assert_allclose(got, want, atol=2e-5)
  # q itself: the layer's input (embedding, then its LayerNorm) times the query kernel, rotated.
  x = nn.LayerNorm().apply({"params": params["block_0"]["ln_attention"]}, params["embed"]["embedding"][batch.tokens])
  q_raw = jnp.einsum("ble,ehd->blhd", x, params["block_0"]["attention"]["query"]["kernel"])
  np.testing.assert_allclose(q, models.rotary(q_raw + params["block_0"]["attention"]["query"]["bias"]), atol=2e-5)


def test_fitted_rows_stay_within_the_feature_budget():
  assert activations.fitted_rows("hedgehog", 64) == 32
  for features, rows in ((64, 9), (128, 14), (256, 21)):  # 1 + R + R(R+1)/2: 55, 120, 253
    assert activations.fitted_rows("taylor", features) == rows
    assert core.kernels.num_features("taylor", rows + 1, 1) > features


@pytest.mark.slow
def test_measurements_against_exact_attention_and_fitting_lowers_the_loss():
  q, k, v = (jax.random.normal(key, (2, L, H, D)) * 2.0 for key in jax.random.split(jax.random.PRNGKey(0), 3))
  w = core.draw_projection(jax.random.PRNGKey(1), "orthogonal", 16, D)
  rel, kl = activations.errors(q, k, v, w, "positive", None, window=L)  # a window covering all: exact
  assert rel < 1e-5 and abs(kl) < 1e-5
  rel, kl = activations.errors(q, k, v, w, "positive", None, window=0)
  assert rel > 0.05 and kl > 0.01
  _, _, before = activations.fit_map("hedgehog", 8, q, k, 0, 1e-2, jax.random.PRNGKey(2))
  _, _, after = activations.fit_map("hedgehog", 8, q, k, 30, 1e-2, jax.random.PRNGKey(2))
  assert after < before - 0.05


@pytest.mark.slow
def test_study_runs_end_to_end_on_the_excerpt(tmp_path):
  config = activations_tiny()
  records = main.run(config, str(tmp_path))
  names = {r["estimator"] for r in records}
  assert names == set(config.estimators) and all(r["layer"] == 0 for r in records)
  assert all(np.isfinite(r["rel_error"]) and r["kl"] >= -1e-6 and r["features"] <= 16 for r in records)
  assert (tmp_path / "error_vs_features.png").exists()
  assert "vs FAVOR+" in (tmp_path / "summary.md").read_text()
  again = main.run(config, str(tmp_path))  # the trained model is resumed, not retrained: same numbers
  assert [r["rel_error"] for r in again] == [r["rel_error"] for r in records]
  with pytest.raises(ValueError, match="measure_batches"):
    main.run(activations_tiny(measure_batches=5), str(tmp_path / "x"))


@pytest.mark.slow
def test_tradeoff_reads_a_training_study_and_times_each_run(tmp_path):
  from experiments.configs import tradeoff as tradeoff_config
  study = tiny(**{"train.steps": 2, "train.warmup_steps": 1, "train.eval_every": 2, "train.checkpoint_every": 2})
  taylor = {"attention.type": "favor", "attention.kernel": "taylor", "attention.qk_head_dim": 4}
  study.variants = (("taylor", taylor), ("taylor_seed1", {**taylor, "train.seed": 1}),
                    ("taylor_kv2", {**taylor, "data.num_kv_pairs": 2}))  # another task: not placed
  trained = main.run(study, str(tmp_path / "study"))
  config = tradeoff_config.get_config("quick")
  config.studies = (("tiny", str(tmp_path / "study")),)
  records = main.run(config, str(tmp_path / "tradeoff"))
  assert [(r["name"], r["value"], r["state_size"]) for r in records] == [
      (r["name"], r["eval_accuracy"], r["state_size"]) for r in trained[:2]]
  assert all(r["steps_per_s"] > 0 and r["long_step_s"] > 0 and r["long_length"] == 256 for r in records)
  assert records[0]["long_step_s"] == records[1]["long_step_s"]  # seeds share their setting's times
  assert (tmp_path / "tradeoff" / "tradeoff.png").exists()
  config.studies = (("none", str(tmp_path)),)
  with pytest.raises(ValueError, match="config.json, .*results.json missing"):
    main.run(config, str(tmp_path / "x"))
  learned = json.loads((tmp_path / "study" / "config.json").read_text())  # a model tied to its length
  learned["config"]["model"]["positions"] = "learned"
  (tmp_path / "study" / "config.json").write_text(json.dumps(learned))
  config.studies = (("tiny", str(tmp_path / "study")),)
  with pytest.raises(ValueError, match="long_length=256: study 'tiny' .*learned positions"):
    main.run(config, str(tmp_path / "y"))


@pytest.mark.slow
def test_conversion_distils_a_learned_map_before_fine_tuning(tmp_path, capsys):
  from experiments.configs import backward_compat as backward_compat_config
  from experiments.studies import backward_compat
  config = tiny_config.shrink(backward_compat_config.get_config("quick"))
  config.data.update(text_dir=EXCERPT, valid_plays=("tempest",), seq_len=L, num_eval_batches=2)
  config.train.steps = 20  # a softmax model with some structure in its attention to distil
  config.finetune.update(steps=2, warmup_steps=1, eval_every=1, distill_steps=40, distill_lr=3e-2, distill_batches=1)
  transfer = {"attention.kernel": "hedgehog", "attention.window": 2, "attention.forget_gate": True,
              "finetune.distill_objective": "output_mse", "finetune.distill_decay": True}
  config.variants = (("hedgehog", {"attention.kernel": "hedgehog"}), ("softmax_control", {"attention.type": "softmax"}),
                     ("transfer", transfer))
  hedgehog, control, moved = main.run(config, str(tmp_path))
  progress = capsys.readouterr().out.splitlines()
  # Right after the swap the map is the identity; distillation moves it towards softmax's weights, by either
  # objective; the output-MSE run with a window and a fitted decay starts its gate from that decay.
  for r in (hedgehog, moved):
    assert r["after_distill_eval_loss"] < r["after_swap_eval_loss"], r["name"]
  assert (hedgehog["distill_objective"], moved["distill_objective"]) == ("cross_entropy", "output_mse")
  assert (hedgehog["distill_decay"], moved["distill_decay"]) == (False, True)
  decays = [m for m in progress if "transfer layer" in m and "per-head decay" in m]
  assert len(decays) == config.model.num_layers and "output_mse to softmax" in decays[0]
  assert np.isnan(control["after_distill_eval_loss"])
  assert control["after_swap_eval_loss"] == control["softmax_eval_loss"]
  # Every softmax parameter went into the swapped model unchanged; the map is new.
  _, finetune = backward_compat.phase_configs(config)
  c = dict(finetune)["hedgehog"]
  pretrained = {"block_0": {"attention": {"query": {"kernel": jnp.ones((32, H, D))}}}}
  with pytest.raises(ValueError, match="no place for the softmax parameters"):
    backward_compat.swapped_params(c, {**pretrained, "extra": {"w": jnp.ones(1)}})
  assert "after distillation" in (tmp_path / "summary.md").read_text()
  assert "| output_mse + per-head decay |" in (tmp_path / "summary.md").read_text()
