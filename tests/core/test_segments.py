"""Packed documents (issue 40): a packed row equals each document run alone — softmax, every kernel and causal
method, bidirectional, hybrid, decode across a boundary — and gated hybrid, decode and explicit weights equal
the float64 gated form of tests/core/test_gates.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import kernels
from tests.core.test_gates import B, L, _log_gate, _mask, _proj, _qkv, decay, explicit

# Three documents per row; ids repeat (7, 3, 7): a segment is a run of equal ids, not an id. Both boundaries
# fall inside a chunk of 8; the last two documents have one length, so a document alone compiles twice, not
# three times.
DOCS = ((0, 12), (12, 26), (26, 40))
IDS = jnp.asarray([7] * 12 + [3] * 14 + [7] * 14, jnp.int32)


def _rho(name, q):
  kern = kernels.KERNELS[name]
  return jnp.full(kern.statistic_shape(q.shape), 0.7) if kern.data_dependent else None


def _assert_packed_equals_alone(fn, q, k, v, g=None, **kw):
  """fn(q, k, v, segment_ids=..., log_gate=...) on the packed rows vs on each document alone."""
  extra = {} if g is None else {"log_gate": g}
  packed = fn(q, k, v, segment_ids=jnp.broadcast_to(IDS, (B, L)), **extra, **kw)
  for a, b in DOCS:
    doc = {} if g is None else {"log_gate": g[:, a:b]}
    alone = fn(q[:, a:b], k[:, a:b], v[:, a:b], **doc, **kw)
    # float32 rounding (a chunk's scale differs): relative to the document's largest output (trigonometric
    # rows whose denominator cancels reach ~10³)
    np.testing.assert_allclose(packed[:, a:b], alone, rtol=0, atol=1e-4 * max(np.max(np.abs(alone)), 1.0),
                               err_msg=f"document {a}:{b}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_softmax_equals_each_document_alone(causal):
  q, k, v = _qkv()
  fn = jax.jit(functools.partial(core.softmax_attention, causal=causal))
  _assert_packed_equals_alone(fn, q, k, v, _log_gate() if causal else None)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_packed_favor_equals_each_document_alone_every_kernel(name):
  q, k, v = _qkv()
  proj, rho = _proj(name), _rho(name, q)
  for method in ("chunked", "scan", "cumsum") if name == "positive" else ("chunked",):
    fn = jax.jit(lambda q, k, v, **kw: core.favor_attention(q, k, v, proj, kernel=name, causal=True, rho=rho,
                                                            causal_method=method, chunk_size=8, **kw))
    _assert_packed_equals_alone(fn, q, k, v, _log_gate())
  fn = jax.jit(lambda q, k, v, **kw: core.favor_attention(q, k, v, proj, kernel=name, rho=rho, chunk_size=8, **kw))
  _assert_packed_equals_alone(fn, q, k, v)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_hybrid_equals_each_document_alone(causal):
  q, k, v = _qkv()
  fn = jax.jit(lambda q, k, v, **kw: core.hybrid_attention(q, k, v, _proj(), window=5, causal=causal, chunk_size=8,
                                                           **kw))
  _assert_packed_equals_alone(fn, q, k, v, _log_gate() if causal else None)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_segments_equal_the_explicit_block_diagonal_form(causal, masked):
  q, k, v = (7.0 * x for x in _qkv())
  mask = _mask() if masked else jnp.ones((B, L), bool)
  ids = jnp.broadcast_to(IDS, (B, L))
  g = _log_gate() if causal else None
  bias = decay(g if causal else None, np.asarray(ids), causal)
  proj = _proj()
  for name, got in (  # each one jitted program (op by op, each call compiles some 300)
      ("softmax", jax.jit(lambda q, k, v: core.softmax_attention(q, k, v, causal=causal, key_mask=mask,
                                                                 segment_ids=ids, log_gate=g))(q, k, v)),
      ("positive", jax.jit(lambda q, k, v: core.favor_attention(q, k, v, proj, causal=causal, key_mask=mask,
                                                                segment_ids=ids, log_gate=g, chunk_size=8))(q, k, v))):
    want, _ = explicit(name, q, k, v, proj, None, mask, bias)
    np.testing.assert_allclose(got, want, atol=2e-4 * np.max(np.abs(want)), rtol=0, err_msg=name)


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_gated_hybrid_equals_the_explicit_form(causal):
  """The exact window gets the same bias: check against the explicit weights e^{bias}·(exact or kernel)."""
  q, k, v = (4.0 * x for x in _qkv())
  ids = jnp.broadcast_to(IDS, (B, L))
  g = _log_gate() if causal else None
  mask = _mask()
  window = 5
  bias = decay(g, np.asarray(ids), causal)
  got = jax.jit(lambda q, k, v: core.hybrid_attention(q, k, v, _proj(), window=window, causal=causal, key_mask=mask,
                                                      log_gate=g, segment_ids=ids, chunk_size=8))(q, k, v)
  # explicit: A_tj = e^{bias}·(exp(q·k/√d) if near else φ(q)ᵀφ(k)), from the kernel's log-features
  fq, fk = kernels.KERNELS["positive"].log_features(q, k, _proj())
  lq, lk = np.asarray(fq.log, np.float64), np.asarray(fk.log, np.float64)
  kern = np.log(np.sum(np.exp(lq[:, :, None] + lk[:, None, :]), -1))  # [B, t, j, H]
  soft = np.einsum("bthd,bjhd->btjh", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(q.shape[-1])
  gap = np.arange(L)[:, None] - np.arange(L)[None]
  near = (((gap >= 0) & (gap < window)) if causal else (np.abs(gap) < window))[None, :, :, None]
  logw = np.where(near, soft, kern) + bias
  logw = np.where(np.asarray(mask)[:, None, :, None], logw, -np.inf)
  seen = np.isfinite(logw.max(2))  # a row that sees no key (all masked): output 0
  w = np.exp(logw - np.where(seen, logw.max(2), 0.0)[:, :, None])
  want = np.einsum("btjh,bjhd->bthd", w / np.where(seen, w.sum(2), 1.0)[:, :, None], np.asarray(v, np.float64))
  np.testing.assert_allclose(got, want, atol=2e-4 * np.max(np.abs(want)), rtol=0)
  weights = jax.jit(lambda q, k: core.attention_weights(q, k, _proj(), kernel="positive", window=window, causal=causal,
                                                        key_mask=mask, log_gate=g, segment_ids=ids))(q, k)
  np.testing.assert_allclose(np.einsum("bhtj,bjhd->bthd", weights, v), want, atol=2e-4 * np.max(np.abs(want)))


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("prompt", [1, 6])
def test_decode_across_boundaries_with_gates_equals_the_packed_pass(window, prompt):
  """Steps of ``prompt`` tokens (a prompt runs the chunked pass) with gates and segment ids equal one packed
  gated call; a new id resets the state whatever came before, also at a step's first token."""
  q, k, v = _qkv()
  ids = jnp.broadcast_to(IDS, (B, L))
  g = _log_gate()
  proj = _proj()
  want = jax.jit(lambda q, k, v: core.hybrid_attention(q, k, v, proj, window=window, causal=True, log_gate=g,
                                                       segment_ids=ids, chunk_size=8))(q, k, v)
  step = jax.jit(functools.partial(core.favor_decode_step, window=window, chunk_size=8))
  state = core.favor_decode_init(q[:, :1], v[:, :1], proj, window=window)
  outs = []
  for t in range(0, L, prompt):
    sl = slice(t, t + prompt)
    state, out = step(state, q[:, sl], k[:, sl], v[:, sl], proj, log_gate=g[:, sl], segment_ids=ids[:, sl])
    outs.append(out)
  assert np.all(np.asarray(state.segment) == 7)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), want, rtol=2e-5, atol=2e-5)


def test_decode_after_a_non_finite_key_recovers_at_a_new_segment():
  q, k, v = _qkv()
  proj = _proj()
  state = core.favor_decode_init(q[:, :1], v[:, :1], proj)
  state, out = core.favor_decode_step(state, q[:, :3], k[:, :3].at[:, 1].set(jnp.nan), v[:, :3], proj,
                                      segment_ids=jnp.zeros((B, 3), jnp.int32))
  assert np.all(np.isnan(out[:, 1:])) and not np.any(np.isnan(out[:, 0]))
  state, out = core.favor_decode_step(state, q[:, 3:4], k[:, 3:4], v[:, 3:4], proj,
                                      segment_ids=jnp.ones((B, 1), jnp.int32))
  np.testing.assert_allclose(out, v[:, 3:4], rtol=1e-6)  # alone in its document: its own value


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_softmax_weights_and_linear_attention_take_the_same_bias(causal):
  q, k, v = (3.0 * x for x in _qkv())
  ids = jnp.broadcast_to(IDS, (B, L))
  g = _log_gate() if causal else None
  bias = decay(g, np.asarray(ids), causal)  # [B, t, j, H]
  logits = np.einsum("bthd,bjhd->btjh", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(q.shape[-1])
  logw = logits + bias
  w = np.exp(logw - logw.max(2, keepdims=True))
  want = np.moveaxis(w / w.sum(2, keepdims=True), 3, 1)  # [B, H, t, j]
  got = core.attention_weights(q, k, causal=causal, log_gate=g, segment_ids=ids)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  # linear attention on positive features φ = e^{x}: A_tj = e^{bias}·φ(q_t)ᵀφ(k_j)
  qf, kf = jnp.exp(0.3 * q), jnp.exp(0.3 * k)
  a = np.einsum("bthf,bjhf->btjh", np.asarray(qf, np.float64), np.asarray(kf, np.float64)) * np.exp(bias)
  lin_want = np.einsum("btjh,bjhd->bthd", a / a.sum(2, keepdims=True), np.asarray(v, np.float64))
  lin = core.linear_attention(qf, kf, v, causal=causal, log_gate=g, segment_ids=ids, chunk_size=8)
  np.testing.assert_allclose(lin, lin_want, atol=2e-5 * np.max(np.abs(lin_want)), rtol=0)
