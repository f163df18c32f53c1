"""Gated and packed sequence-parallel cases on 8 devices; run by test_multidevice.py in a process of its own
(8 forced CPU devices). Not collected directly (the file name does not start with ``test_``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from favor_jax import core, parallel
from tests.core.test_gates import B, D, H, _log_gate, decay, explicit

L = 48  # 6 positions per device
# Segments: a boundary inside device 2 (position 13) and one on the edge of device 4 (position 24).
IDS = jnp.broadcast_to(jnp.asarray([0] * 13 + [1] * 11 + [2] * 24, jnp.int32), (B, L))


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
  if jax.device_count() != 8:
    pytest.fail(f"run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (have {jax.device_count()})")


def _inputs(scale=1.0):
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(kk, (B, L, H, D)) for kk in ks[:3])
  return scale * q, scale * k, v, core.orthogonal_projection(ks[3], 16, D)


def _mesh():
  return jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("scale", [1.0, 7.0])
def test_gated_packed_sequence_parallel_equals_the_explicit_form_and_one_device(causal, scale):
  q, k, v, w = _inputs(scale)
  g = _log_gate(length=L) if causal else None
  mask = jax.random.bernoulli(jax.random.PRNGKey(9), 0.8, (B, L))
  sp = jax.jit(lambda q, k, v, g: parallel.sequence_parallel_attention(
      q, k, v, w, mesh=_mesh(), axis_name="seq", causal=causal, key_mask=mask, chunk_size=4, log_gate=g,
      segment_ids=IDS))
  one = jax.jit(lambda q, k, v, g: core.favor_attention(q, k, v, w, causal=causal, key_mask=mask, chunk_size=4,
                                                        log_gate=g, segment_ids=IDS))
  got = sp(q, k, v, g)
  want, _ = explicit("positive", q, k, v, w, None, mask, decay(g, np.asarray(IDS), causal))
  np.testing.assert_allclose(got, want, atol=1e-5 * scale ** 2 * np.max(np.abs(want)), rtol=0)
  np.testing.assert_allclose(got, one(q, k, v, g), atol=1e-5 * scale ** 2, rtol=1e-5)
  # gradients, also with respect to the gate, equal those on one device
  cot = jax.random.normal(jax.random.PRNGKey(4), v.shape)
  argnums = (0, 1, 2, 3) if causal else (0, 1, 2)
  grads = lambda f: jax.grad(lambda *x: jnp.sum(f(*x) * cot), argnums=argnums)(q, k, v, g)
  for a, b in zip(grads(sp), grads(one)):
    np.testing.assert_allclose(a, b, atol=2e-5 * max(np.max(np.abs(b)), 1.0), rtol=0)


def test_no_device_sees_a_later_devices_keys_or_gates():
  q, k, v, w = _inputs()
  g = _log_gate(length=L)
  sp = jax.jit(functools.partial(parallel.sequence_parallel_attention, mesh=_mesh(), axis_name="seq", causal=True,
                                 chunk_size=4, segment_ids=IDS))
  base = sp(q, k, v, w, log_gate=g)
  t = 29  # device 4's last-but-one position: the rest of device 4 and devices 5..7 change
  moved = sp(q, k.at[:, t + 1:].multiply(100.0), v.at[:, t + 1:].add(3.0), w,
             log_gate=g.at[:, t + 1:].set(-30.0).at[:, 40].set(-jnp.inf))
  np.testing.assert_allclose(moved[:, :t + 1], base[:, :t + 1], rtol=1e-5, atol=1e-6)


def test_a_packed_row_equals_each_document_alone_across_devices():
  q, k, v, w = _inputs()
  g = _log_gate(length=L)
  alone_fn = jax.jit(functools.partial(core.favor_attention, chunk_size=4), static_argnames="causal")
  for causal in (True, False):
    gate = g if causal else None
    packed = parallel.sequence_parallel_attention(q, k, v, w, mesh=_mesh(), axis_name="seq", causal=causal,
                                                  chunk_size=4, log_gate=gate, segment_ids=IDS)
    for a, b in ((0, 13), (13, 24), (24, 48)):
      alone = alone_fn(q[:, a:b], k[:, a:b], v[:, a:b], w, causal=causal,
                       log_gate=None if gate is None else gate[:, a:b])
      np.testing.assert_allclose(packed[:, a:b], alone, rtol=2e-5, atol=2e-5, err_msg=f"{causal} {a}:{b}")


def test_bad_gates_poison_the_rows_one_device_poisons(length=45):
  """A NaN, +inf or positive log gate (issue 48): NaN in exactly the rows favor_attention on one device makes NaN
  (those that may see it: up to the next reset, across devices), every other row equal to it. L = 45: padded
  to 48 on 8 devices."""
  q, k, v, w = (x[:, :length] if x.ndim == 4 else x for x in _inputs())
  ids = IDS[:, :length]
  g = (_log_gate(length=length).at[0, 3, 0].set(jnp.nan)  # device 0, before the segment boundary at 13
       .at[0, 20, 1].set(jnp.inf)  # device 3, inside segment 1: rows 20..23 of head 1, not segment 2
       .at[1, 30, 0].set(0.25)  # device 5: rows up to the next reset of head 0
       .at[1, 35, 0].set(-jnp.inf)  # ... which is here
       .at[1, length - 1, 1].set(jnp.nan))  # the last position: its own row only
  mask = jax.random.bernoulli(jax.random.PRNGKey(9), 0.8, (B, length))
  for segment_ids in (None, ids):
    sp = parallel.sequence_parallel_attention(q, k, v, w, mesh=_mesh(), axis_name="seq", causal=True,
                                              key_mask=mask, chunk_size=4, log_gate=g, segment_ids=segment_ids)
    one = core.favor_attention(q, k, v, w, causal=True, key_mask=mask, chunk_size=4, log_gate=g,
                               segment_ids=segment_ids)
    rows_sp, rows_one = np.isnan(sp).any(-1), np.isnan(one).any(-1)
    assert rows_one.sum() >= 4 + (segment_ids is None) * 8, rows_one.sum()  # the cases above poison rows
    np.testing.assert_array_equal(rows_sp, rows_one)
    np.testing.assert_array_equal(np.isnan(sp), np.isnan(one))  # a poisoned row is NaN whole
    np.testing.assert_allclose(np.where(rows_one[..., None], 0.0, sp), np.where(rows_one[..., None], 0.0, one),
                               rtol=1e-5, atol=1e-5)
