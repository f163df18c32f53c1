"""``precision``: it reaches every dot of a call, forward and backward, and the library's rules hold under a TPU's
default (each dot's operands rounded to bfloat16, float32 sums: ``experiments.studies.emulation``), not only under the
suite's global "highest" (tests/conftest.py), which these tests undo (``jax.default_matmul_precision(None)``)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core
from jax.sharding import Mesh
from scipy.special import softmax

from experiments.studies.emulation import bfloat16_dots, tensorfloat32_dots
from favor_jax import core, layers, parallel
from favor_jax.layers import linen as favor_linen
from favor_jax.layers import nnx as favor_nnx
from tests.core.float64_weights import log_pair_weights

HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
L, H, D, M, CHUNK = 24, 2, 4, 8, 8


@pytest.fixture(autouse=True)
def backend_default():
  with jax.default_matmul_precision(None):  # what a user gets: no global precision
    yield


def _inputs(scale=1.0, seed=0):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  q, k = (scale * jax.random.normal(key, (1, L, H, D)) for key in (kq, kk))
  return q, k, jax.random.normal(kv, (1, L, H, D))


W = core.orthogonal_projection(jax.random.PRNGKey(1), num_features=M, dim=D)


def _dots(jaxpr):
  """Every dot_general of ``jaxpr`` and of the jaxprs inside it (scan, cond, while, jit, remat, custom rules)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple) else (value,):
        if isinstance(sub, jax_core.ClosedJaxpr):
          yield from _dots(sub.jaxpr)
        elif isinstance(sub, jax_core.Jaxpr):
          yield from _dots(sub)


def _precisions(fn, *args):
  return [eqn.params["precision"] for eqn in _dots(jax.make_jaxpr(fn)(*args).jaxpr)]


def _decode(q, k, v, precision, length):
  state = core.favor_decode_init(q[:, :1], v[:, :1], W)
  return core.favor_decode_step(state, q[:, :length], k[:, :length], v[:, :length], W, chunk_size=CHUNK,
                                precision=precision)[1]


def _parallel(q, k, v, precision):
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  return parallel.sequence_parallel_attention(q, k, v, W, mesh=mesh, axis_name="seq", causal=True, chunk_size=CHUNK,
                                              precision=precision)


GATE = -0.1 * jnp.ones((1, L, H))
CALLS = {
    **{f"favor_causal_{m}": lambda q, k, v, p, m=m: core.favor_attention(
        q, k, v, W, causal=True, causal_method=m, chunk_size=CHUNK, precision=p)
       for m in ("chunked", "scan", "cumsum")},
    "favor_gated_chunked": lambda q, k, v, p: core.favor_attention(
        q, k, v, W, causal=True, causal_method="chunked", chunk_size=CHUNK, log_gate=GATE, precision=p),
    "favor_oprf_bidirectional": lambda q, k, v, p: core.favor_attention(
        q, k, v, W, kernel="optimal_positive", precision=p),
    "favor_segments": lambda q, k, v, p: core.favor_attention(
        q, k, v, W, segment_ids=jnp.arange(L) // 10, precision=p),
    "linear_causal": lambda q, k, v, p: core.linear_attention(
        jnp.exp(q), jnp.exp(k), v, causal=True, chunk_size=CHUNK, precision=p),
    "hybrid_causal": lambda q, k, v, p: core.hybrid_attention(
        q, k, v, W, window=3, causal=True, chunk_size=CHUNK, precision=p),
    "hybrid_taylor": lambda q, k, v, p: core.hybrid_attention(q, k, v, None, window=3, kernel="taylor", precision=p),
    "softmax_causal": lambda q, k, v, p: core.softmax_attention(q, k, v, causal=True, precision=p),
    "weights_taylor": lambda q, k, v, p: core.attention_weights(q, k, kernel="taylor", causal=True, precision=p),
    "weights_positive": lambda q, k, v, p: core.attention_weights(q, k, W, kernel="positive", window=2, precision=p),
    "decode_token": lambda q, k, v, p: _decode(q, k, v, p, 1),
    "decode_prompt": lambda q, k, v, p: _decode(q, k, v, p, L),
    "sequence_parallel": _parallel,
}


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("name", sorted(CALLS))
def test_precision_reaches_every_dot_forward_and_backward(name):
  call = CALLS[name]
  q, k, v = _inputs()
  for precision, want in (("highest", HIGHEST), (None, None)):
    loss = lambda q, k, v: jnp.sum(call(q, k, v, precision) ** 2)
    fns = [loss, jax.grad(loss, argnums=(0, 1, 2))]
    if name in ("favor_causal_chunked", "hybrid_causal"):  # jit inside grad: the custom rules of a jitted call
      fns.append(jax.grad(jax.jit(loss), argnums=(0, 1, 2)))  # are traced by grad, outside the call's scope
    for fn in fns:
      found = _precisions(fn, q, k, v)
      assert found and all(p == want for p in found), (name, precision, sorted(set(map(str, found))))


def test_precision_takes_every_spelling_of_one_precision():
  q, k, v = _inputs()
  for precision in (jax.lax.Precision.HIGHEST, "float32", (jax.lax.Precision.HIGHEST, "highest")):
    found = _precisions(lambda q: core.favor_attention(q, k, v, W, precision=precision), q)
    assert found and all(p == HIGHEST for p in found)
  preset = jax.lax.DotAlgorithmPreset.BF16_BF16_F32
  found = _precisions(lambda q: core.softmax_attention(q, k, v, precision=preset), q)
  assert found and all(p == preset for p in found)


@pytest.mark.parametrize("precision", ["fast", ("highest", "default"), 3, jax.lax.DotAlgorithmPreset.DEFAULT])
def test_a_bad_precision_is_refused_by_name(precision):
  q, k, v = _inputs()
  with pytest.raises(ValueError, match="precision must be"):
    core.favor_attention(q, k, v, W, precision=precision)
  with pytest.raises(ValueError, match="precision must be"):
    layers.FavorSettings.build(precision=precision)


def test_layers_pass_flax_precision_to_every_dot():
  x = jax.ShapeDtypeStruct((1, 12, 8), jnp.float32)  # traced only: abstract parameters, nothing compiled
  for precision, want in (("highest", HIGHEST), (None, None)):
    linen = favor_linen.FavorAttention(num_heads=2, qkv_features=8, num_features=8, causal=True, chunk_size=4,
                                       precision=precision)
    mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, precision=precision,
                                          attention_fn=layers.make_attention_fn(W[:, :4]))
    graph, state = nnx.split(nnx.eval_shape(lambda: favor_nnx.FavorAttention(
        2, 8, qkv_features=8, num_features=8, causal=True, chunk_size=4, precision=precision, rngs=nnx.Rngs(0))))
    cases = [(lambda p, x, m=m: jnp.sum(m.apply(p, x) ** 2), jax.eval_shape(m.init, jax.random.PRNGKey(0), x))
             for m in (linen, mha)]
    cases.append((lambda s, x: jnp.sum(nnx.merge(graph, s)(x) ** 2), state))
    # a running statistic updated in training (FAVOR++'s ρ: dots on the data outside the attention call)
    oprf = favor_linen.FavorAttention(num_heads=2, qkv_features=8, num_features=8, causal=True, chunk_size=4,
                                      kernel="optimal_positive", precision=precision, deterministic=False)
    cases.append((lambda p, x: jnp.sum(oprf.apply(p, x, mutable=["favor"])[0] ** 2),
                  jax.eval_shape(oprf.init, jax.random.PRNGKey(0), x)))
    q, k, _ = _inputs()  # Hedgehog's distillation: the fitted map's gradient
    cases.append((lambda w, x: layers.distillation_loss(q, k, w, causal=True, precision=precision), W))
    for loss, params in cases:
      found = _precisions(jax.grad(loss, argnums=1), params, x)  # the forward's dots and their transposes
      assert found and all(p == want for p in found), (precision, sorted(set(map(str, found))))


# ---- the rules under an emulated TPU default (bfloat16 passes) ----

CAUSAL = bfloat16_dots(lambda q, k, v, mask: core.favor_attention(q, k, v, W, causal=True, key_mask=mask,
                                                                   chunk_size=CHUNK))
ALL = jnp.ones((1, L), bool)


def test_emulation_rounds_default_dots_only():
  a, b = (jax.random.normal(jax.random.PRNGKey(i), (16, 16)) for i in (4, 5))
  rounded = lambda x: np.asarray(x.astype(jnp.bfloat16), np.float64)
  want = rounded(a) @ rounded(b)  # products of bfloat16 operands, summed in float64 here
  for precision in (None, "default", jax.lax.Precision.DEFAULT):
    emulated = bfloat16_dots(lambda a, b, p=precision: jnp.dot(a, b, precision=p))(a, b)
    np.testing.assert_allclose(emulated, want, rtol=1e-5, atol=1e-5)
  exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  assert np.max(np.abs(want - exact)) > 1e-3  # the rounding is visible at this size
  # TF32: 10 explicit bits, rounded to nearest even (float32's low 13 bits dropped), in numpy's bits
  bits = np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32)
  tf32 = [((x + 0xFFF + ((x >> 13) & 1)) & ~np.uint32(0x1FFF)).view(np.float32).astype(np.float64) for x in bits]
  np.testing.assert_allclose(tensorfloat32_dots(jnp.dot)(a, b), tf32[0] @ tf32[1], rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(tf32[0] @ tf32[1] - exact)) > 1e-4
  for precision in ("highest", "high"):  # an explicit precision is left as it is
    kept = bfloat16_dots(lambda a, b, p=precision: jnp.dot(a, b, precision=p))(a, b)
    np.testing.assert_allclose(kept, exact, rtol=1e-5, atol=1e-5)
  # inside the library's scans and conds too: the whole causal pass moves by about a bfloat16 rounding
  q, k, v = _inputs()
  highest = jax.jit(lambda q, k, v: core.favor_attention(q, k, v, W, causal=True, key_mask=ALL, chunk_size=CHUNK,
                                                         precision="highest"))(q, k, v)
  assert 1e-4 < float(jnp.max(jnp.abs(CAUSAL(q, k, v, ALL) - highest))) < 5e-2


@pytest.mark.parametrize("scale", [1.0, 20.0])
def test_bfloat16_passes_keep_causality_nan_masks_and_no_silent_zero(scale):
  q, k, v = _inputs(scale)
  out = CAUSAL(q, k, v, ALL)
  assert jnp.isfinite(out).all() and (jnp.abs(out).sum(-1) > 0).all()  # never a silent zero row
  # a future key 100× larger: the past stays within the pass's rounding (the chunk's one product is scaled by
  # its largest key, a later one included), and its gradient is exactly 0
  later = CAUSAL(q, k.at[:, 10].multiply(100.0), v, ALL)
  np.testing.assert_allclose(later[:, :10], out[:, :10], rtol=2e-2, atol=2e-2 * float(jnp.abs(v).max()))
  np.testing.assert_array_equal(later[:, :8], out[:, :8])  # earlier chunks: to the bit
  past = lambda k: jnp.sum(core.favor_attention(q, k, v, W, causal=True, chunk_size=CHUNK)[:, :10])
  grad_k = bfloat16_dots(jax.grad(past))(k)  # the backward pass's dots emulated too
  assert jnp.isfinite(grad_k).all() and (grad_k[:, 10:] == 0).all()
  # a NaN key: NaN from its position on, in its head only
  bad = CAUSAL(q, k.at[:, 10, 0].set(jnp.nan), v, ALL)
  assert jnp.isfinite(bad[:, :10]).all() and jnp.isnan(bad[:, 10:, 0]).all() and jnp.isfinite(bad[:, :, 1]).all()
  # a masked key is absent whatever it holds: as the sequence without it
  mask = ALL.at[:, 10].set(False)
  masked = CAUSAL(q, k.at[:, 10, 0].set(jnp.nan), v.at[:, 10].set(1e6), mask)
  np.testing.assert_array_equal(masked, CAUSAL(q, k, v, mask))
  # a query that can see no key gives 0, and only it
  first_out = CAUSAL(q, k, v, ALL.at[:, 0].set(False))
  assert (first_out[:, 0] == 0).all() and (jnp.abs(first_out[:, 1:]).sum(-1) > 0).all()


def _float64_output(kernel, q, k, v, w):
  """The estimator's output in float64 from its explicit quadratic form (causal)."""
  log_w, _ = log_pair_weights(kernel, np.asarray(q), np.asarray(k), None if w is None else np.asarray(w))
  log_w = np.where(np.tril(np.ones((L, L), bool)), log_w, -np.inf)
  return np.einsum("bhqk,bkhd->bqhd", softmax(log_w, axis=-1), np.asarray(v, np.float64))


# Relative error (Frobenius) bound of one bfloat16 pass vs the float64 form, causal, L=24 (docs/guarantees.md);
# measured 2026-12-04: positive 0.24% (x1), 0.45% (x7), 0.35% (x20); taylor 0.23-0.25%; "highest": < 5e-7.
BF16_BOUND = 1e-2


@pytest.mark.parametrize("kernel", ["positive", "taylor"])
def test_bfloat16_passes_stay_within_the_documented_bound_of_the_float64_form(kernel):
  w = None if kernel == "taylor" else W
  attend = lambda q, k, v, precision=None: core.favor_attention(q, k, v, w, kernel=kernel, causal=True,
                                                               chunk_size=CHUNK, precision=precision)
  emulated, highest = bfloat16_dots(attend), jax.jit(lambda q, k, v: attend(q, k, v, "highest"))
  for scale in (1.0, 7.0, 20.0):
    q, k, v = _inputs(scale, seed=3)
    want = _float64_output(kernel, q, k, v, w)
    rel = lambda out: np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
    high = highest(q, k, v)
    assert rel(high) < 1e-5, (scale, rel(high))
    assert rel(high) < rel(emulated(q, k, v)) < BF16_BOUND, (scale, rel(emulated(q, k, v)))
