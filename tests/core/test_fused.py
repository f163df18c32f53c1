"""The fused Pallas causal pass (``causal_method="pallas"``), run here in Pallas's interpreter: outputs
against the explicit float64 quadratic form, gradients against the per-token scan's, every kernel with
exponential features, masks, odd lengths, Dv ≠ D, ×20 inputs, causal invariance, bfloat16, and that the
kernels lower to Triton for a GPU (what a GPU compiles; the run itself needs one)."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from favor_jax import core
from favor_jax.core import attention, causal_xla, fused, kernels
from favor_jax.core import causal as causal_lib
from favor_jax.core import gates as gates_lib
from favor_jax.core import state as state_lib
from tests.core import test_gates as gate_tests
from tests.core.test_numerics import explicit

B, L, H, D, DV, M = 2, 37, 2, 8, 12, 16  # odd length (three chunks of 16, padded), Dv ≠ D
# Whether each kernel's features are pure exponentials (the fused kernels' condition), stated from its formula:
# the reference the library's reading of the records is checked against. A new kernel states it here.
EXPONENTIAL = {"positive": True, "hyperbolic": True, "optimal_positive": True, "saderf": True, "hedgehog": True,
               "elu_plus_one": True, "trigonometric": False, "relu": False, "taylor": False}


def _inputs(scale=1.0, length=L, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, k = (scale * jax.random.normal(kk, (B, length, H, D)) for kk in ks[:2])
  v = jax.random.normal(ks[2], (B, length, H, DV))
  mask = jax.random.bernoulli(ks[3], 0.75, (B, length)).at[1, :3].set(False)  # row 0..2 of example 1 see nothing
  return q, k, v, mask


def _params(name, q, k, mask):
  kern = kernels.KERNELS[name]
  proj = core.orthogonal_projection(jax.random.PRNGKey(5), M, D)
  if kern.learned:  # a trained map (Hedgehog): any [M, D] matrix, not an orthogonal draw
    proj = 0.3 * jax.random.normal(jax.random.PRNGKey(6), (M, D))
  if not kern.takes_projection:
    proj = None
  rho = kern.compute_statistic(q, k, mask) if kern.data_dependent else None
  return proj, rho


@functools.cache
def _fused(name, fallback=True, chunk=16):
  """(q, k, v, proj, rho, mask) -> (num, den, scale) through the fused kernels, jitted."""

  def run(q, k, v, proj, rho, mask):
    feature_fn = attention._feature_fn(name, proj, rho, q, k, mask, True)
    return fused.causal(feature_fn, q, k, v, mask, chunk_size=chunk, return_scale=True, fallback=fallback)

  return jax.jit(run)


@jax.jit
def _pallas_positive(q, k, v, proj, mask):
  """Causal FAVOR+ through the fused kernels, chunks of 16, jitted (eagerly the interpreter runs op by op)."""
  return core.favor_attention(q, k, v, proj, causal=True, key_mask=mask, causal_method="pallas", chunk_size=16)


def _ratio(num, den):
  den = np.asarray(den)[..., None]
  return np.where(den == 0, 0.0, np.asarray(num) / np.where(den == 0, 1.0, den))


def _takes_fused(name) -> bool:
  """The library's reading of a kernel's record: a log per feature and no multiplier."""
  q, k, _, mask = _inputs(length=16)
  proj, rho = _params(name, q, k, mask)
  return causal_lib.exponential_features(attention._feature_fn(name, proj, rho, q, k, mask, True), q, k)


# Every kernel the fused path takes (a new one included, without naming it here).
FUSED = tuple(name for name in sorted(kernels.KERNELS) if _takes_fused(name))


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("name", FUSED)
def test_fused_kernels_equal_the_explicit_form_and_the_scan_gradients(name):
  q, k, v, mask = _inputs()
  proj, rho = _params(name, q, k, mask)
  num, den, scale = _fused(name, fallback=False)(q, k, v, proj, rho, mask)
  assert not np.any(fused.lost_rows(den, scale)), "the fused path itself must be what is checked at ×1"
  want, _ = explicit(name, q, k, v, proj, rho, mask, causal=True)
  np.testing.assert_allclose(_ratio(num, den), want, atol=1e-5 * np.max(np.abs(want)))
  # Rows that see no key: zero, with scale −∞.
  assert np.all(np.asarray(den)[1, :3] == 0) and np.all(np.isneginf(np.asarray(scale)[1, :3]))
  weights = jnp.cos(jnp.arange(B * L * H * DV).reshape(B, L, H, DV))

  def loss(method, q, k, v, proj):
    out = core.favor_attention(q, k, v, proj, kernel=name, causal=True, key_mask=mask, rho=rho,
                               causal_method=method, chunk_size=16)
    return jnp.sum(out * weights)

  argnums = (0, 1, 2, 3) if proj is not None else (0, 1, 2)
  grads = lambda method: jax.jit(jax.grad(functools.partial(loss, method), argnums=argnums))(q, k, v, proj)
  for got, ref, what in zip(grads("pallas"), grads("scan"), ("query", "key", "value", "projection")):
    np.testing.assert_allclose(got, ref, atol=2e-5 * np.max(np.abs(ref)), err_msg=what)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["positive", "elu_plus_one"])
def test_a_single_feature_is_taken_and_exact(name):
  """One feature (FAVOR+ with a one-row projection; ELU+1 with D = 1): its log has width 1, as a per-row
  scale of multiplied features has; with no multiplier it is the feature itself, and the fused pass takes
  it (it refused it as "not exponentials", audit of 2026-12-03). Outputs against the explicit form,
  gradients against the per-token scan."""
  q, k, v, mask = _inputs()
  if name == "elu_plus_one":
    q, k, proj = q[..., :1], k[..., :1], None
  else:
    proj = core.orthogonal_projection(jax.random.PRNGKey(5), 1, D)

  def loss(method, q, k, v, proj):
    out = core.favor_attention(q, k, v, proj, kernel=name, causal=True, key_mask=mask, causal_method=method,
                               chunk_size=16)
    return jnp.sum(jnp.sin(out)), out

  argnums = (0, 1, 2) if proj is None else (0, 1, 2, 3)
  run = lambda method: jax.jit(jax.grad(functools.partial(loss, method), argnums=argnums, has_aux=True))(
      q, k, v, proj)
  (got, out), (want, _) = run("pallas"), run("scan")
  ref, _ = explicit(name, q, k, v, proj, None, mask, causal=True)
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=1e-5 * np.max(np.abs(ref)))
  # One feature cancels from each row (φ(q_t) multiplies numerator and denominator): the query's gradient is
  # 0, and float32 leaves ~1e-7 of it.
  for g, w, what in zip(got, want, ("query", "key", "value", "projection")):
    np.testing.assert_allclose(g, w, atol=2e-5 * np.max(np.abs(w)) + 1e-6, err_msg=what)


@pytest.mark.slow
def test_large_inputs_lose_rows_that_the_kernels_recompute_alone_never_zero_rows():
  """At ×20 a later key inside a chunk outgrows the rows before it by hundreds of e-folds (one key dominates
  each row); at ×1 with the keys before position 29 made 8 times longer, their log features spread by tens of
  e-folds and rows lose their terms while those stay comparable among themselves (the gated tests recompute
  rows that read the state too): the Triton kernels detect those rows (denominator below its largest term's
  floor), compute them again alone at their exact scale, forward and backward, and count them; nothing is
  left for the XLA redo (run without it here). ×4: none recomputed. Outputs against the explicit form,
  gradients of q, k, v and the projection against the per-token scan's (5e-5 of the largest: at ×20 the
  float32 rounding of exponents near ±600, as for the Mosaic kernels in
  test_gradients_at_x4_and_x20_in_float32_and_bfloat16_match_the_scan)."""
  weights = jnp.cos(jnp.arange(B * L * H * DV).reshape(B, L, H, DV))

  def run(q, k, v, proj, mask):
    feature_fn = attention._feature_fn("positive", proj, None, q, k, mask, True)
    return fused.causal(feature_fn, q, k, v, mask, chunk_size=16, return_scale=True, return_recomputed=True)

  def loss(method, q, k, v, proj, mask):
    if method == "scan":
      out = core.favor_attention(q, k, v, proj, causal=True, key_mask=mask, causal_method="scan")
    else:
      out = state_lib.divide(*run(q, k, v, proj, mask)[:2])
    return jnp.sum(out * weights)

  grads = {method: jax.jit(jax.grad(functools.partial(loss, method), argnums=(0, 1, 2, 3)))
           for method in ("pallas", "scan")}
  for scale, key in ((4.0, None), (20.0, None), (1.0, 29)):
    q, k, v, mask = _inputs(scale)
    if key is not None:
      k, mask = k.at[:, :key].multiply(8.0), mask.at[:, key].set(True)
    proj, rho = _params("positive", q, k, mask)
    want, _ = explicit("positive", q, k, v, proj, rho, mask, causal=True)
    num, den, row_scale, recomputed = jax.jit(run)(q, k, v, proj, mask)
    got, what = _ratio(num, den), f"×{scale}, key {key}"
    np.testing.assert_allclose(got, want, atol=1e-5 * scale ** 2 * np.max(np.abs(want)), err_msg=what)
    assert not np.any(np.all(got == 0, -1) & ~np.all(want == 0, -1))
    assert not np.any(fused.lost_rows(den, row_scale)), f"{what}: a row left lost"
    assert (np.sum(recomputed) > 0) == (scale != 4.0), (what, recomputed)
    if scale != 4.0:
      for g, r, name in zip(grads["pallas"](q, k, v, proj, mask), grads["scan"](q, k, v, proj, mask),
                            ("query", "key", "value", "projection")):
        np.testing.assert_allclose(g, r, atol=5e-5 * np.max(np.abs(r)), err_msg=f"d/d{name} {what}")


@pytest.mark.slow
def test_a_huge_future_key_changes_no_earlier_row_and_gets_no_gradient_from_it():
  t = 29  # inside the second chunk
  q, k, v, mask = _inputs(length=48)
  mask = mask.at[:, t].set(True)
  proj, _ = _params("positive", q, k, mask)
  run = lambda k: core.favor_attention(q, k, v, proj, causal=True, key_mask=mask, causal_method="pallas",
                                       chunk_size=16)
  before = jax.jit(run)(k)
  after = jax.jit(run)(k.at[:, t].multiply(100.0))
  # Float32 rounding only (as for the XLA pass): a chunk's key products are scaled by its largest key.
  np.testing.assert_allclose(np.asarray(after)[:, :t], np.asarray(before)[:, :t], rtol=1e-5, atol=1e-6)
  assert not np.allclose(np.asarray(after)[:, t:], np.asarray(before)[:, t:])
  grad_k = jax.jit(jax.grad(lambda k: jnp.sum(run(k)[:, :t] ** 2)))(k)
  assert np.all(np.asarray(grad_k)[:, t:] == 0.0) and np.any(np.asarray(grad_k)[:, :t] != 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tol", [(jnp.bfloat16, 2e-2), (jnp.float16, 4e-3)])
@pytest.mark.parametrize("scale", [1.0, 3.0, 20.0])
def test_half_precision_inputs_stay_within_their_rounding_of_the_explicit_form(dtype, tol, scale):
  """Bfloat16 and float16 inputs against the explicit float64 form of the same rounded inputs. Float16 once
  gave exact-zero rows and rows 100% off at ×3: its features were multiplied as float16, which flushes
  terms below e^{−17} that the row's largest term does not dwarf. At ×20 rows are handed to the XLA pass."""
  q, k, v, mask = _inputs(scale)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  proj, _ = _params("positive", q, k, mask)
  got = _pallas_positive(q, k, v, proj, mask)
  assert got.dtype == dtype
  want, _ = explicit("positive", q.astype(jnp.float32), k.astype(jnp.float32), v, proj, None, mask, causal=True)
  got = np.asarray(got, np.float64)
  assert np.max(np.abs(got - want)) < tol * np.max(np.abs(want))
  assert not np.any(np.all(got == 0, -1) & ~np.all(want == 0, -1))  # no silent zero row


def test_mixed_dtypes_keep_the_float32_inputs_exact():
  """A bfloat16 query with float32 keys and values gives a float32 output, computed in float32: as exact
  as the XLA pass (the kernels once rounded the float32 values to bfloat16 because the query was)."""
  q, k, v, mask = _inputs()
  proj, _ = _params("positive", q, k, mask)
  q = q.astype(jnp.bfloat16)
  got = _pallas_positive(q, k, v, proj, mask)
  assert got.dtype == jnp.float32
  want, _ = explicit("positive", q.astype(jnp.float32), k, v, proj, None, mask, causal=True)
  assert np.max(np.abs(np.asarray(got, np.float64) - want)) < 1e-5 * np.max(np.abs(want))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["positive", "hedgehog"])
def test_gradients_at_x4_and_x20_in_float32_and_bfloat16_match_the_scan(name):
  """Gradients of q, k, v and the feature parameters where the fused pass keeps its chunk (×4) and where rows
  lose their terms in it (×20 positive: the Mosaic kernels, interpreted here, recompute them alone): against
  the per-token scan's in float32 on the same (rounded) inputs; bfloat16 within 2e-2 of the largest gradient
  (measured ≤ 0.8%, both kernels, since their bfloat16 weights are rounded once for numerator and denominator:
  2.1% before; at ×20 0.4%, as the XLA passes' own on bfloat16 inputs). At ×20 float32
  within 5e-5 of the largest: the kernels' ∂v reads a suffix state whose exponents, near ±600, are rounded
  apart by e^{±6e-5} even for a row's dominant key (the scan's dominant term is exactly 1); measured
  2026-12-05 against float64: ∂v 3.2e-5, ∂q 1.9e-5, ∂k 2.6e-6 (the scan's 4e-7, 2.1e-5, 5e-6). Before
  issue 51's item 4 the XLA pass redid these calls."""
  weights = jnp.cos(jnp.arange(B * L * H * DV).reshape(B, L, H, DV))

  def loss(method, q, k, v, proj, mask):
    out = core.favor_attention(q, k, v, proj, kernel=name, causal=True, key_mask=mask, causal_method=method,
                               chunk_size=16)
    return jnp.sum(out.astype(jnp.float32) * weights)

  # compiled once per method (and dtype), not per scale
  grads = {m: jax.jit(jax.grad(functools.partial(loss, m), argnums=(0, 1, 2, 3))) for m in ("pallas", "scan")}
  for scale in (4.0, 20.0):
    q, k, v, mask = _inputs(scale)
    proj, _ = _params(name, q, k, mask)
    for dtype, tol in ((jnp.float32, 1e-5 if scale < 20 else 5e-5), (jnp.bfloat16, 2e-2)):
      args = tuple(x.astype(dtype) for x in (q, k, v))
      got = grads["pallas"](*args, proj, mask)
      ref = grads["scan"](*(x.astype(jnp.float32) for x in args), proj, mask)
      for g, r, what in zip(got, ref, ("query", "key", "value", "projection")):
        g, r = np.asarray(g, np.float32), np.asarray(r)
        assert np.max(np.abs(r)) > 0, what
        np.testing.assert_allclose(g, r, atol=tol * np.max(np.abs(r)), err_msg=f"{what} ×{scale} {dtype.__name__}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["positive", "hyperbolic", "optimal_positive", "saderf"])
def test_the_triton_backward_from_q_and_k_matches_the_scan_gradients(name):
  """The Triton kernels' own backward, ungated (they compute the log features from q, k and the projection,
  forward and backward, and give ∂q, ∂k and the projection's gradient themselves): against the per-token
  scan's gradients of q, k, v and the projection at ×1 and ×4 in float32 (2e-5 of the largest) and bfloat16
  (its rounding, 2e-2; the scan on the same rounded inputs; q, k, v only: the kernel then leaves the
  projection's gradient out), a masked key and rows that see none; a projection shared by the heads
  (positive, FAVOR#) or one per head (hyperbolic, FAVOR++); FAVOR++ and FAVOR# with their statistic given
  (a projection and normaliser per (sequence, head), and FAVOR#'s scales of q and k); head dim 8 padded to 16
  in the kernels."""
  q0, k0, v, mask = _inputs()
  proj, rho = _params(name, q0, k0, mask)
  if name in ("hyperbolic", "optimal_positive"):
    proj = jnp.stack([proj, core.orthogonal_projection(jax.random.PRNGKey(7), M, D)])  # [H, M, D]
  cot = jnp.cos(jnp.arange(B * L * H * DV).reshape(B, L, H, DV))

  def fused_loss(q, k, v, proj):
    num, den, scale = _fused(name, fallback=False)(q, k, v, proj, rho, mask)  # the kernels' own backward
    return jnp.sum(state_lib.divide(num, den).astype(jnp.float32) * cot), jnp.sum(fused.lost_rows(den, scale))

  def scan_loss(q, k, v, proj):
    out = core.favor_attention(q, k, v, proj, kernel=name, causal=True, key_mask=mask, rho=rho,
                               causal_method="scan")
    return jnp.sum(out * cot)

  grads = {n: jax.jit(jax.grad(fused_loss, argnums=tuple(range(n)), has_aux=True)) for n in (3, 4)}  # compiled once
  reference = jax.jit(jax.grad(scan_loss, argnums=(0, 1, 2, 3)))
  for scale, dtype, tol in ((1.0, jnp.float32, 2e-5), (4.0, jnp.float32, 2e-5), (1.0, jnp.bfloat16, 2e-2)):
    args = tuple(x.astype(dtype) for x in (scale * q0, scale * k0, v))
    got, lost = grads[4 if dtype == jnp.float32 else 3](*args, proj)
    assert lost == 0, f"×{scale}: the fused backward itself must be what is checked"
    want = reference(*(x.astype(jnp.float32) for x in args), proj)
    for what, a, b in zip(("query", "key", "value", "projection"), got, want):
      a, b = np.asarray(a, np.float32), np.asarray(b)
      assert np.max(np.abs(b)) > 0, what
      np.testing.assert_allclose(a, b, atol=tol * np.max(np.abs(b)), err_msg=f"d/d{what} ×{scale} {dtype}")


def test_unsupported_feature_maps_and_chunks_are_refused():
  q, k, v, mask = _inputs()
  with pytest.raises(ValueError, match="causal_method='chunked'"):
    core.favor_attention(q, k, v, None, kernel="taylor", causal=True, causal_method="pallas")
  with pytest.raises(ValueError, match="power of two >= 16, got 24"):
    core.favor_attention(q, k, v, _params("positive", q, k, mask)[0], causal=True, causal_method="pallas",
                         chunk_size=24)


@pytest.mark.slow
def test_the_backward_keeps_the_inputs_and_chunk_states_not_the_features():
  """What ``grad`` holds between the forward and the backward pass (the leaves of ``jax.vjp``'s function):
  no array as large as half of one side's log features [N, H, L, F] (float32; the old code kept both
  sides'); they are recomputed from q and k in the backward. Kept: inputs, one [F, Dv] state per chunk."""
  length, features = 1024, 64
  q, k, v, mask = _inputs(length=length)
  proj = core.orthogonal_projection(jax.random.PRNGKey(5), features, D)
  run = lambda q, k, v, proj: core.favor_attention(q, k, v, proj, causal=True, key_mask=mask,
                                                   causal_method="pallas", chunk_size=64)
  _, backward = jax.vjp(jax.jit(run), q, k, v, proj)  # jit: the interpreter runs eagerly op by op
  kept = [x for x in jax.tree.leaves(backward) if hasattr(x, "size")]
  one_side = B * H * length * features
  assert max(x.size for x in kept) < one_side // 2, sorted((x.shape for x in kept), key=np.prod)[-3:]


@pytest.mark.slow
def test_second_derivatives_are_refused_by_name_and_first_ones_still_run():
  q, k, v, mask = _inputs(length=20)
  proj, _ = _params("positive", q, k, mask)
  total = lambda p: jnp.sum(core.favor_attention(q, k, v, p, causal=True, key_mask=mask, causal_method="pallas",
                                                 chunk_size=16))
  assert np.all(np.isfinite(jax.jit(jax.grad(total))(proj)))  # jit: the interpreter runs eagerly op by op
  message = r"causal_method='pallas' has first derivatives only .* use causal_method='chunked'"
  seconds = [(jax.grad(lambda p: jnp.sum(jax.grad(total)(p) ** 2)), proj), (jax.hessian(total), proj),
             (jax.grad(lambda c: jnp.sum(jax.vjp(total, proj)[1](c)[0])), 1.0)]  # through the cotangent only
  for second, at in seconds:
    with pytest.raises(ValueError, match=message):
      jax.jit(second).trace(at)  # refused while tracing, before anything runs


@pytest.mark.slow
def test_forward_and_backward_lower_to_triton_for_a_gpu():
  """What a GPU compiles: Pallas lowers every kernel to Triton here too (unsupported operations fail now),
  plain and gated (the gate's running sums inside a chunk are a Triton scan), at each precision."""
  q, k, v, mask = (x[:1] for x in _inputs(length=128))
  proj, _ = _params("positive", q, k, mask)
  blocks = fused.blocks_for(64, interpret=False)
  gate = jnp.log(jnp.linspace(0.5, 1.0, 128 * H)).reshape(1, 128, H).at[0, 70].set(-jnp.inf)

  def loss(q, k, v, proj, gate, precision):
    feature_fn = attention._feature_fn("positive", proj, None, q, k, mask, True)
    num, den = fused.causal(feature_fn, q, k, v, mask, blocks=blocks, gate=gate, precision=precision)
    return jnp.sum(num / den[..., None])

  for dtype, g, precision in ((jnp.float32, None, None), (jnp.bfloat16, None, None), (jnp.float32, gate, None),
                              (jnp.bfloat16, gate, jax.lax.Precision.HIGHEST)):
    args = tuple(x.astype(dtype) for x in (q, k, v)) + (proj, g)
    # The gradient: forward (states, outputs), then backward (states recomputed: nothing of size F·E per chunk
    # kept between them), suffix states, gradients.
    for fn, kernels_in_it in ((loss, 2), (jax.grad(loss, argnums=(0, 1, 2, 3, 4)), 5)):
      fn = functools.partial(fn, precision=precision)
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      assert text.count("__gpu$xla.gpu.triton") == kernels_in_it
  # A head dim that is not a power of two: the forward kernels read q and k padded to one (Triton's blocks).
  q48, k48 = (jnp.tile(x, (1, 1, 1, 6)) for x in (q, k))  # D = 48
  proj48 = jnp.tile(proj, (1, 6))
  text = jax.jit(functools.partial(loss, precision=None)).trace(q48, k48, v, proj48, None).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_auto_takes_the_fused_kernels_only_for_exponential_features_on_a_gpu(name, monkeypatch):
  """Which kernels the fused path takes is read off the feature map (a log per feature, no multiplier);
  off a GPU "auto" is the XLA chunked pass whatever the kernel."""
  q, k, v, mask = _inputs(length=16)
  proj, rho = _params(name, q, k, mask)
  feature_fn = attention._feature_fn(name, proj, rho, q, k, mask, True)
  assert name in EXPONENTIAL, f"state in EXPONENTIAL whether kernel {name!r}'s features are pure exponentials"
  assert causal_lib.exponential_features(feature_fn, q, k) == EXPONENTIAL[name] == (name in FUSED)
  taken = []
  for method in ("chunked", "_fused"):  # _fused: the kernel of the platform lowered for (platform_dependent)
    monkeypatch.setitem(causal_lib.__dict__, method, lambda *a, m=method, **kw: taken.append(m))
  causal_lib.auto(feature_fn, q, k, v, mask, chunk_size=16)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  causal_lib.auto(feature_fn, q, k, v, mask, chunk_size=16)
  causal_lib.auto(feature_fn, q, k, v, mask, chunk_size=24)  # not a power of two: the XLA pass
  assert taken == ["chunked", "_fused" if name in FUSED else "chunked", "chunked"]


# Gated and packed calls (issue 46): a forget gate from no decay to exact zeros (log 0 = −∞, a reset), and
# segments starting inside a chunk (5, 27) and on a chunk's first row (16); L = 37 is not a multiple of 16.
GATE_VALUES = (1.0, 0.97, 0.5, 1e-3, 1e-30, 0.0)
SEGMENTS = np.repeat(np.asarray([[0, 1, 2, 3], [4, 5, 6, 7]]), [5, 11, 11, 10], axis=1)  # starts 5, 16, 27


def _gates(finite=False):
  """log f [B, L, H] drawn from GATE_VALUES (``finite``: without the exact zeros) with a reset at 16."""
  rng = np.random.default_rng(3)
  values = np.asarray(GATE_VALUES[:-1] if finite else GATE_VALUES)
  p = np.linspace(3.0, 1.0, len(values))
  f = rng.choice(values, size=(B, L, H), p=p / p.sum())
  with np.errstate(divide="ignore"):
    return jnp.asarray(np.log(f), jnp.float32)


@functools.cache
def _gated(fallback):
  """(q, k, v, proj, mask, log gate, segment ids) -> (num, den, scale, rows recomputed) of the fused pass with
  gates, jitted."""

  def run(q, k, v, proj, mask, log_gate, segment_ids):
    feature_fn = attention._feature_fn("positive", proj, None, q, k, mask, True)
    gate = gates_lib.prepare(log_gate, segment_ids, q, True).log  # segment starts become −∞ gates
    back = functools.partial(causal_xla.chunked, block_chunks=1)
    return fused.causal(feature_fn, q, k, v, mask, chunk_size=16, return_scale=True, return_recomputed=True,
                        gate=gate, fallback=back if fallback else None)

  return jax.jit(run)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gated_and_packed_calls_equal_the_explicit_gated_form(dtype):
  """Outputs at ×1/×7/×20 against the float64 gated quadratic form (tests/core/test_gates.py's, on the same
  rounded inputs): the kernels alone (no XLA redo), which recompute rows that lost their terms in their
  chunk's product (×20: asserted to happen) and leave none lost; and the same with the redo in place. Rows cut
  off from every key by a reset and a masked key are 0 with scale −∞; no other row is a silent zero."""
  q0, k0, v, mask = _inputs()
  proj, _ = _params("positive", q0, k0, mask)
  for scale in (1.0, 7.0, 20.0):
    no_gate, one_segment = jnp.zeros((B, L, H)), np.zeros((B, L), np.int32)  # (arrays: one compilation)
    for log_gate, segment_ids in ((_gates(), one_segment), (no_gate, SEGMENTS), (_gates(), SEGMENTS)):
      q, k, vv = (x.astype(dtype) for x in (scale * q0, scale * k0, v))
      args = (q, k, vv, proj, mask, log_gate, segment_ids)
      bias = gate_tests.decay(log_gate, segment_ids)
      rounded = (np.asarray(x, np.float32) for x in (q, k, vv))
      want, _ = gate_tests.explicit("positive", *rounded, proj, None, mask, bias)
      tol = (2e-2 if dtype == jnp.bfloat16 else 1e-5) * scale ** 2 * np.max(np.abs(want))
      what = f"×{scale} gate={log_gate is not no_gate} segments={segment_ids is not one_segment}"
      num, den, row_scale, _ = _gated(True)(*args)
      got = _ratio(num, den)
      np.testing.assert_allclose(got, want, atol=tol, err_msg=what)
      assert not np.any(np.all(got == 0, -1) & ~np.all(want == 0, -1)), what
      num, den, row_scale, recomputed = _gated(False)(*args)
      assert not np.any(fused.lost_rows(den, row_scale)), what  # lost rows are recomputed in the kernel
      assert np.sum(recomputed) > 0 or scale < 20.0, what  # ×20: some are
      np.testing.assert_allclose(_ratio(num, den), want, atol=tol, err_msg=what + " (the kernels alone)")
      empty = np.all(want == 0, -1)
      assert np.all(np.isneginf(np.asarray(row_scale))[empty] | np.asarray(~mask)[:, :, None].repeat(H, 2)[empty])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gated_gradients_including_the_gates_equal_the_explicit_forms(dtype):
  """∂q, ∂k, ∂v, ∂projection and ∂log-gate of a gated, packed call through the kernels' own backward (×1 and
  ×4; ×20, where rows lose their terms in their chunk's product and the kernels recompute them alone:
  asserted; a row whose nearer keys decayed by far is recomputed at any scale) against the explicit float32
  form's (each row's largest term held constant; tests/core/test_gates.py), on the same rounded inputs:
  float32 to 2e-4 of the largest, bfloat16 within its rounding (4e-2). Gates are finite (an exact zero has no
  derivative of its log) but for the segment starts."""
  q0, k0, v, mask = _inputs()
  proj, _ = _params("positive", q0, k0, mask)
  log_gate, segment_ids = _gates(finite=True), jnp.asarray(SEGMENTS)
  cot = jnp.cos(jnp.arange(B * L * H * DV).reshape(B, L, H, DV))

  def fused_loss(q, k, v, proj, g):
    num, den, scale, redone = _gated(False)(q, k, v, proj, mask, g, segment_ids)  # the kernels' own backward
    return jnp.sum(state_lib.divide(num, den).astype(jnp.float32) * cot), (jnp.sum(fused.lost_rows(den, scale)),
                                                                          jnp.sum(redone))

  def reference(q, k, v, proj, g):
    bias = gate_tests.decay(g, segment_ids, xp=jnp)
    return jnp.sum(gate_tests.explicit("positive", q, k, v, proj, None, mask, bias, xp=jnp)[0] * cot)

  grads = jax.jit(jax.grad(fused_loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
  for scale in (1.0, 4.0, 20.0):
    args = tuple(x.astype(dtype) for x in (scale * q0, scale * k0, v))
    got, (lost, redone) = grads(*args, proj, log_gate)
    assert lost == 0 and (redone > 0 or scale < 20.0), f"×{scale}: {lost} lost, {redone} recomputed"
    want = jax.grad(reference, argnums=(0, 1, 2, 3, 4))(*(x.astype(jnp.float32) for x in args), proj, log_gate)
    for what, a, b in zip(("query", "key", "value", "projection", "gate"), got, want):
      a, b = np.asarray(a, np.float32), np.asarray(b)
      assert np.all(np.isfinite(a)) and np.max(np.abs(b)) > 0, what
      tol = 4e-2 if dtype == jnp.bfloat16 else 2e-4
      np.testing.assert_allclose(a, b, atol=tol * np.max(np.abs(b)), err_msg=f"d/d{what} ×{scale}")


def test_a_future_gate_or_key_changes_no_past_row_and_a_bad_gate_shape_or_precision_is_refused():
  q, k, v, mask = _inputs()
  proj, _ = _params("positive", q, k, mask)
  t = 20  # inside the second chunk
  g = _gates()
  run = _gated(False)
  segments = jnp.zeros((B, L), jnp.int32)
  base = run(q, k, v, proj, mask, g, segments)
  moved = run(q, k.at[:, t + 1].multiply(30.0), v.at[:, t + 1:].add(7.0), proj, mask,
              g.at[:, t + 1:].set(-50.0).at[:, t + 3].set(-jnp.inf), segments.at[:, t + 2].set(1))
  # the outputs (num and den carry a per-row factor e^{−scale}, whose scale may take the chunk's later keys)
  np.testing.assert_allclose(_ratio(*moved[:2])[:, :t + 1], _ratio(*base[:2])[:, :t + 1], rtol=1e-5, atol=1e-6)
  feature_fn = attention._feature_fn("positive", proj, None, q, k, mask, True)
  with pytest.raises(ValueError, match=r"gate must have shape \[N, L, H\]"):
    fused.causal(feature_fn, q, k, v, mask, chunk_size=16, gate=g[:, :, :1])
  with pytest.raises(ValueError, match="precision must be None or a jax.lax.Precision"):
    fused.causal(feature_fn, q, k, v, mask, chunk_size=16, precision="quick")


def _kernel_dots(jaxpr):
  """Every dot_general inside the pallas_calls of ``jaxpr`` (their loops included)."""
  found = []

  def walk(jx, inside):
    for eqn in jx.eqns:
      if inside and eqn.primitive.name == "dot_general":
        found.append(eqn)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub, inside or eqn.primitive.name == "pallas_call")

  walk(jaxpr.jaxpr, False)
  return found


@pytest.mark.slow
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_precision_reaches_every_product_of_the_kernels_forward_and_backward(gated):
  """``precision=HIGHEST``: every product of the four kernels (forward and backward) is asked at HIGHEST with
  float32 operands, bfloat16 inputs included; None (with no global default set): the backend's default, and
  bfloat16 inputs multiply their features as bfloat16."""
  q, k, v, mask = (x[:1] for x in _inputs(length=32))
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  proj, _ = _params("positive", q, k, mask)
  g = _gates()[:1, :32] if gated else None

  def loss(precision, q, k, v, proj):
    feature_fn = attention._feature_fn("positive", proj, None, q, k, mask, True)
    num, den = fused.causal(feature_fn, q, k, v, mask, chunk_size=16, gate=g, precision=precision)
    return jnp.sum(state_lib.divide(num, den).astype(jnp.float32))

  for precision in (jax.lax.Precision.HIGHEST, None):
    with jax.default_matmul_precision(None):
      dots = _kernel_dots(jax.make_jaxpr(jax.grad(functools.partial(loss, precision), argnums=(0, 1, 2, 3)))(
          q, k, v, proj))
    assert len(dots) >= 4 * 2, len(dots)  # at least two products in each of the four kernels
    operands = {tuple(x.aval.dtype.name for x in eqn.invars) for eqn in dots}
    asked = {eqn.params["precision"] for eqn in dots}
    if precision is None:
      assert asked == {None} and ("bfloat16", "bfloat16") in operands, (asked, operands)
    else:
      assert asked == {(precision, precision)} and operands == {("float32", "float32")}, (asked, operands)
