"""The sharp-attention study's pieces (issue 53): the q/k maps of the training model (RFA's bounded logits, a
learned per-head map), the control variate through the layers' settings, and the study's config."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.configs import common
from experiments.configs import sharp as sharp_config
from experiments.train import models, sweep, training
from favor_jax.layers import linen as favor_linen
from favor_jax.layers import nnx as favor_nnx
from favor_jax.layers.settings import FavorSettings

B, L, H, D = 2, 12, 3, 8


def _qk(seed=0, scale=5.0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 2)
  return tuple(scale * jax.random.normal(kk, (B, L, H, D)) for kk in ks)


def test_bounded_map_gives_logits_within_the_learned_temperature():
  q, k = _qk()
  qk_map = models.QKMap("bounded")
  params = qk_map.init(jax.random.PRNGKey(0), q, k)
  np.testing.assert_allclose(jnp.exp(params["params"]["log_temperature"]), models.TEMPERATURE_INIT, rtol=1e-6)
  tau = np.array([0.5, 2.0, 9.0])
  params = {"params": {"log_temperature": jnp.log(tau)}}
  mq, mk = qk_map.apply(params, q, k)
  logits = np.einsum("blhd,bjhd->bhlj", mq, mk) / math.sqrt(D)
  qn, kn = (np.asarray(x, np.float64) / np.linalg.norm(np.asarray(x, np.float64), axis=-1, keepdims=True)
            for x in (q, k))
  cosine = np.einsum("blhd,bjhd->bhlj", qn, kn)
  np.testing.assert_allclose(logits, tau[None, :, None, None] * cosine, rtol=1e-4, atol=1e-5)
  assert np.all(np.abs(logits) <= tau[None, :, None, None] * (1 + 1e-5))


def test_learned_map_is_the_identity_at_init_and_a_per_head_matrix_after():
  q, k = _qk(1)
  qk_map = models.QKMap("learned")
  params = qk_map.init(jax.random.PRNGKey(0), q, k)
  mq, mk = qk_map.apply(params, q, k)
  np.testing.assert_array_equal(mq, q)
  np.testing.assert_array_equal(mk, k)
  a = np.random.default_rng(0).standard_normal((H, D, D)).astype(np.float32)
  mq, _ = qk_map.apply({"params": {"map": jnp.asarray(a)}}, q, k)
  np.testing.assert_allclose(mq, np.einsum("hed,blhd->blhe", a, np.asarray(q)), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_layers_pass_the_control_variate_to_the_hybrid():
  """β = −1 is FAVOR's estimate over every key: the layer with a window and β = −1 equals the layer without a
  window (same parameters, same projection), and β = 0.3 differs from both."""
  x = jax.random.normal(jax.random.PRNGKey(2), (B, L, 16))
  make = lambda **kw: favor_linen.FavorAttention(num_heads=2, num_features=16, causal=True, chunk_size=4, **kw)
  variables = jax.jit(make().init)(jax.random.PRNGKey(0), x)
  out = lambda **kw: jax.jit(make(**kw).apply)(variables, x)
  np.testing.assert_allclose(out(window=3, control_variate=-1.0), out(), atol=2e-5)
  assert not np.allclose(out(window=3, control_variate=0.3), out(window=3), atol=1e-4)
  layer = favor_nnx.FavorAttention(2, 16, num_features=16, causal=True, window=3, control_variate=-1.0,
                                   rngs=nnx.Rngs(0))
  assert layer.control_variate == -1.0 and nnx.jit(lambda m, x: m(x))(layer, x).shape == x.shape


@pytest.mark.parametrize("kwargs,match", [
    (dict(control_variate=0.5), "needs window > 0"),
    (dict(control_variate=float("inf"), window=2), "finite real number"),
    (dict(control_variate="0.5", window=2), "finite real number"),
    (dict(control_variate=True, window=2), "finite real number")])
def test_bad_control_variate_settings_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    FavorSettings.build(**kwargs)


def test_every_study_variant_passes_the_config_checks_and_is_labelled_apart():
  config = sharp_config.get_config()
  runs = sweep.variant_configs(config)
  assert len(runs) == len(config.variants) == 2 * 17
  labels = set()
  for name, c in runs:
    training.check_config(c)
    if name.endswith("_seed1"):
      continue
    record = sweep.attention_fields(c)
    labels.add(sweep.setting({**record, "num_features": c.attention.num_features if c.attention.type == "favor"
                              else 0}))
  assert len(labels) == 17  # every setting its own label (the q/k maps named)
  assert config.train.steps == 300 and config.only == ""  # the study as committed: every run, 300 steps
  bad = dict(runs)["favor_m64"]
  bad.attention.qk_map = "sharp"
  with pytest.raises(ValueError, match="attention.qk_map must be one of"):
    training.check_config(bad)


@pytest.mark.slow
def test_quick_study_reports_each_run_against_fox_on_its_own_activations(tmp_path):
  import os

  from experiments import main
  from experiments.configs import common
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  config = common.set_fields(sharp_config.get_config("quick"), {
      "data.text_dir": os.path.join(repo, "tests", "data", "shakespeare"), "data.valid_plays": ("tempest",)})
  records = main.run(config, str(tmp_path))
  assert [r["name"] for r in records] == ["softmax_forget_gate", "favor_m64_window4", "favor_m64_bounded"]
  for r in records:
    assert np.isfinite([r["attention_entropy"], r["peak_logit"], r["peak_pair_sq"], r["own_error"]]).all()
    assert 0 < r["attention_entropy"] <= math.log(config.data.seq_len)
  assert records[0]["own_error"] == 0 and records[1]["own_error"] > 0
  bounded = records[2]  # RFA: |logit| ≤ τ, ‖x+y‖² ≤ 4τ (τ learned from TEMPERATURE_INIT over 4 steps)
  assert bounded["peak_logit"] <= 1.1 * models.TEMPERATURE_INIT
  assert bounded["peak_pair_sq"] <= 4.4 * models.TEMPERATURE_INIT
  summary = (tmp_path / "summary.md").read_text()
  assert "## Against FoX" in summary and "window 4" in summary and "qk bounded" in summary
  assert (tmp_path / "step_time.png").exists()


@pytest.mark.slow
def test_a_control_variate_model_decodes_as_its_full_pass():
  """The control-variate hybrid can be sampled: training's start check passes, and a decoding layer (prompt, then
  a token a step) gives the full causal layer's outputs with the same β."""
  config = common.set_fields(sharp_config.get_config("quick"), common.favor_variant(
      "positive", forget_gate=True, num_features=16, window=4, control_variate=0.1))
  training.check_decodes(config)  # raises for a model that cannot be sampled
  layer = functools.partial(favor_linen.FavorAttention, num_heads=2, num_features=16, causal=True, window=4,
                            control_variate=0.3, forget_gate=True, chunk_size=4)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 11, 16))
  variables = jax.jit(layer().init)(jax.random.PRNGKey(1), x)
  full = jax.jit(layer().apply)(variables, x)
  decoder = layer(decode=True)
  step = jax.jit(lambda v, x: decoder.apply(v, x, mutable=["cache"]))
  out, mut = step({**variables, "cache": jax.jit(decoder.init)(jax.random.PRNGKey(1), x[:, :1])["cache"]}, x[:, :6])
  outs = [out]
  for t in range(6, 11):
    out, mut = step({**variables, "cache": mut["cache"]}, x[:, t:t + 1])
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=1e-4, atol=1e-5)
