"""The gated softmax layer (the Forgetting Transformer; ALiBi) decodes through its key-value cache, each cached
key's log-gate decay kept beside it: a prompt then one token at a time equals an explicit float64 reference,
w_tj ∝ exp(q_t·k_j/√D)·Π_{j<l≤t} f_l, and the layer's own full causal pass (f32, small shapes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import common
from experiments.configs import tiny as tiny_config
from experiments.train import models, training

B, L, DM, H, KV = 2, 9, 16, 4, 2
PROMPT = 4


def _reference(params, x, forget_gate, alibi):
  """The layer's output in float64 numpy from its parameters: explicit gated softmax weights."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)
  dense = lambda name: np.einsum("bld,dhe->blhe", x, p[name]["kernel"]) + p[name]["bias"]
  q, k, v = dense("query"), np.repeat(dense("key"), H // KV, 2), np.repeat(dense("value"), H // KV, 2)
  log_f = np.zeros((B, L, H))
  if forget_gate:
    logit = x @ p["forget_gate"]["kernel"] + p["forget_gate"]["bias"]
    log_f += -np.log1p(np.exp(-logit))  # log σ
  if alibi:
    log_f -= 2.0 ** (-8.0 * np.arange(1, H + 1) / H)  # ALiBi's slopes m_h = 2^(-8h/H)
  c = np.cumsum(log_f, 1)
  logits = np.einsum("bthd,bjhd->bhtj", q, k) / np.sqrt(q.shape[-1])
  logits += np.moveaxis(c, 1, 2)[..., :, None] - np.moveaxis(c, 1, 2)[..., None, :]  # Σ_{j<l≤t} log f_l
  logits = np.where(np.tril(np.ones((L, L), bool)), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  out = np.einsum("bhtj,bjhd->bthd", w / w.sum(-1, keepdims=True), v)
  return np.einsum("bthd,hde->bte", out, p["out"]["kernel"]) + p["out"]["bias"]


@pytest.mark.slow
@pytest.mark.parametrize("forget_gate, alibi", [pytest.param(True, False, marks=pytest.mark.slow), (True, True),
                                                pytest.param(False, True, marks=pytest.mark.slow)])
def test_gated_softmax_decodes_as_the_explicit_reference_and_the_full_pass(forget_gate, alibi):
  x = jax.random.normal(jax.random.PRNGKey(0), (B, L, DM))
  layer = lambda decode: models.SoftmaxAttention(H, rotary=False, forget_gate=forget_gate, alibi=alibi,
                                                 num_kv_heads=KV, decode=decode, cache_len=L)
  params = jax.jit(layer(False).init)(jax.random.PRNGKey(1), x)["params"]
  leaves, tree = jax.tree.flatten(params)  # moved at random: a forget gate's weight is zero at init
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  params = jax.tree.unflatten(tree, [a + 0.3 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])
  full = jax.jit(layer(False).apply)({"params": params}, x)
  decoder = layer(True)
  cache = jax.jit(decoder.init)(jax.random.PRNGKey(1), x[:, :1])["cache"]
  assert cache["log_decay"].shape == (B, L, H) and cache["keys"].shape == (B, L, KV, DM // H)
  step = jax.jit(lambda c, x: decoder.apply({"params": params, "cache": c}, x, mutable=["cache"]))
  outs = []
  for lo, hi in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, L)]:
    out, mutated = step(cache, x[:, lo:hi])
    cache = mutated["cache"]
    outs.append(out)
  got = jnp.concatenate(outs, 1)
  want = _reference(params, x, forget_gate, alibi)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(full, want, rtol=1e-4, atol=1e-5)


def test_a_configuration_that_cannot_decode_is_refused_when_training_starts(monkeypatch, tmp_path):
  """The forget-gated softmax LM passes the start's decoding check (it decodes); a layer whose decoding raises
  (as the softmax cache did for gates) stops ``training.train`` before anything is written."""
  config = common.set_fields(tiny_config.get_config(), {"attention.type": "softmax", "attention.forget_gate": True})
  training.check_decodes(config)  # MQAR is a causal LM: the decoder of one block is traced, and it decodes

  def refuse(self, *args):
    raise ValueError("the softmax key-value cache decodes ungated models only")

  monkeypatch.setattr(models.SoftmaxAttention, "_cached", refuse)
  with pytest.raises(ValueError, match=r"attention.type='softmax' with these settings trains but cannot be sampled "
                                       r"\(experiments.generate .*\): the softmax key-value cache decodes ungated"):
    training.train(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
