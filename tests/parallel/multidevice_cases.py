"""Cases that need 8 devices; run by test_multidevice.py in a process of their own with 8 forced CPU devices.

Not collected directly (the file name does not start with ``test_``), so the
rest of the suite keeps one device.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from favor_jax import core, parallel


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
  if jax.device_count() != 8:
    pytest.fail(f"run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (have {jax.device_count()})")


def _inputs(length=100, batch=2, heads=2, dim=16, features=32):
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  q = 0.5 * jax.random.normal(ks[0], (batch, length, heads, dim))
  k = 0.5 * jax.random.normal(ks[1], (batch, length, heads, dim))
  v = jax.random.normal(ks[2], (batch, length, heads, dim))
  w = core.orthogonal_projection(ks[3], features, dim)
  mask = jax.random.uniform(ks[4], (batch, length)) > 0.2
  return q, k, v, w, mask


# Every kernel family (log-domain: positive, hyperbolic; plain: relu, trigonometric), both directions,
# with and without masks, jit and eager — a covering set rather than the full product, to keep CI short.
CASES = [("positive", False, False, True), ("positive", False, True, True), ("positive", True, False, True),
         ("positive", True, True, True), ("positive", True, True, False), ("hyperbolic", False, True, True),
         ("relu", True, True, True), ("trigonometric", True, False, True)]


def _out_and_grads(f):
  """f's output and the gradients of Σ f(q, k, v)² with respect to q, k, v, in one pass."""
  def loss(q, k, v):
    out = f(q, k, v)
    return jnp.sum(out ** 2), out

  def run(q, k, v):
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads
  return run


@functools.cache
def _single_device(kernel, causal, masked):
  """One device's output and gradients on ``_inputs(length=100)``, jitted once per kernel, direction and masking
  (the eager and the jitted split of a case compare against the same program)."""
  _, _, _, w, mask = _inputs(length=100)
  return jax.jit(_out_and_grads(lambda q, k, v: core.favor_attention(
      q, k, v, w, kernel=kernel, causal=causal, key_mask=mask if masked else None, chunk_size=8)))


@pytest.mark.parametrize("kernel,causal,masked,jit", CASES)
def test_sequence_parallel_equals_single_device(kernel, causal, masked, jit):
  q, k, v, w, mask = _inputs(length=100)  # 100: divisible by neither the 8 devices nor the chunk size 8
  key_mask = mask if masked else None
  mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))
  split = lambda q, k, v: parallel.sequence_parallel_attention(
      q, k, v, w, mesh=mesh, axis_name="seq", kernel=kernel, causal=causal, key_mask=key_mask, chunk_size=8)
  split = _out_and_grads(split)
  split = jax.jit(split) if jit else split  # eager: the shard_map still runs compiled, everything around it not
  (out_split, g_split), (out_single, g_single) = split(q, k, v), _single_device(kernel, causal, masked)(q, k, v)
  np.testing.assert_allclose(out_split, out_single, atol=1e-5, rtol=1e-5)
  for a, b in zip(g_split, g_single):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()), rtol=1e-5)


def test_sequence_parallel_with_the_new_estimators_per_head_and_dv_not_d():
  """Per-head projections [H, M, D], Taylor (no projection) and Hedgehog, Dv ≠ D, over 8 devices."""
  q, k, _, _, mask = _inputs(length=100)
  v = jax.random.normal(jax.random.PRNGKey(3), q.shape[:-1] + (5,))
  w = jnp.stack([core.orthogonal_projection(jax.random.PRNGKey(h), 32, 16) for h in range(2)])
  mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))
  for kernel, causal in (("positive", True), ("hedgehog", False), ("taylor", True)):
    p = None if kernel == "taylor" else w
    split = jax.jit(lambda q, k, v: parallel.sequence_parallel_attention(
        q, k, v, p, mesh=mesh, axis_name="seq", kernel=kernel, causal=causal, key_mask=mask, chunk_size=8))
    single = jax.jit(lambda q, k, v: core.favor_attention(q, k, v, p, kernel=kernel, causal=causal, key_mask=mask,
                                                          chunk_size=8))(q, k, v)
    np.testing.assert_allclose(split(q, k, v), single, atol=1e-5, rtol=1e-5, err_msg=kernel)
  # Hedgehog's map is learned: its gradient reaches the projection every device holds (summed over devices).
  loss = lambda attend: jax.jit(jax.grad(lambda p: jnp.sum(attend(q, k, v, p, kernel="hedgehog", key_mask=mask,
                                                                   chunk_size=8) ** 2)))(w)
  g_split = loss(functools.partial(parallel.sequence_parallel_attention, mesh=mesh, axis_name="seq"))
  g_single = loss(core.favor_attention)
  np.testing.assert_allclose(g_split, g_single, atol=1e-5 * float(jnp.abs(g_single).max()), rtol=1e-5)


def test_sequence_parallel_on_an_explicit_mesh_with_batch_sharding():
  q, k, v, w, _ = _inputs(length=64, batch=4)
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    out = jax.jit(lambda q, k, v: parallel.sequence_parallel_attention(
        q, k, v, w, mesh=mesh, axis_name="seq", batch_axis="data", causal=True))(q, k, v)
  single = jax.jit(lambda q, k, v: core.favor_attention(q, k, v, w, causal=True))(q, k, v)
  np.testing.assert_allclose(out, single, atol=1e-5, rtol=1e-5)
  assert out.sharding.spec[:2] == ("data", "seq")


@pytest.mark.parametrize("scale,dtype", [(1, jnp.float32), (40, jnp.float32), (1, jnp.bfloat16),
                                         (40, jnp.bfloat16)])
def test_an_eager_gradient_on_an_explicit_mesh_pads_a_length_the_axis_does_not_divide(scale, dtype):
  """L=13 over 4 devices under ``jax.set_mesh``: the eager gradient failed (the padding's transpose on a
  sharded axis, outside the compiled part); the batch keeps its sharding on the padded path. Inputs ×1 and
  ×20 (a standard normal's), float32 and bfloat16, against one device's float32 pass of the same (rounded)
  inputs. Tolerances, relative to the largest entry: float32 ×1 1e-5; ×20 causal, rows put their weight on
  one key and the exact gradient of such a row vanishes (1e-70 in float64): both float32 passes leave up to
  4e-3·max there (one device 4.2e-3, the split 2.1e-3, every causal method alike; measured against a float64
  form), so 1e-2; bfloat16 (measured ≤ 3.5e-3) 1e-2. A wrong shard or padding is off by O(1)."""
  q, k, v, w, mask = _inputs(length=13, batch=2)
  q, k, v = (x.astype(dtype) for x in (scale * q, scale * k, v))
  f32 = lambda x: x.astype(jnp.float32)
  tol = 1e-5 if (scale, dtype) == (1, jnp.float32) else 1e-2
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
  for causal in (False, True):
    split = lambda q: parallel.sequence_parallel_attention(q, k, v, w, mesh=mesh, axis_name="seq",
                                                           batch_axis="data", causal=causal, key_mask=mask)
    single = lambda q: core.favor_attention(q, f32(k), f32(v), w, causal=causal, key_mask=mask)
    with jax.set_mesh(mesh):
      out, grad = split(q), jax.grad(lambda q: jnp.sum(f32(split(q)) ** 2))(q)
    assert out.dtype == grad.dtype == dtype and out.sharding.spec[0] == "data"
    for got, want in ((out, single(f32(q))), (grad, jax.grad(lambda q: jnp.sum(single(q) ** 2))(f32(q)))):
      want = np.asarray(want, np.float64)
      np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tol * np.abs(want).max(),
                                 err_msg=f"causal={causal}")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_favor_plus_plus_with_batch_sharding_splits_rho_like_the_batch(axis_type):
  """ρ [B, H] travels with its examples: each device pairs its batch rows with their own ρ."""
  q, k, v, w, mask = _inputs(length=64, batch=4)
  rho = core.oprf_rho(q, k, mask) * jnp.array([1.0, 0.5, 2.0, 1.5])[:, None]  # a different ρ per example
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(axis_type,) * 2)
  for causal in (False, True):
    out = parallel.sequence_parallel_attention(q, k, v, w, mesh=mesh, axis_name="seq", batch_axis="data",
                                               kernel="optimal_positive", rho=rho, causal=causal, key_mask=mask)
    single = jax.jit(lambda q, k, v: core.favor_attention(q, k, v, w, kernel="optimal_positive", rho=rho,
                                                          causal=causal, key_mask=mask))(q, k, v)
    np.testing.assert_allclose(out, single, atol=1e-5, rtol=1e-5, err_msg=f"causal={causal}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_favor_plus_plus_with_batch_sharding_at_x20_and_in_bfloat16(dtype):
  """q, k ×20 (a standard normal's ×20), per-example ρ, float32 and bfloat16 inputs over a (data 2, seq 4) mesh:
  the single-device pass's output, never a zero row where a key is seen, bfloat16 within its rounding of
  the float32 computation."""
  q, k, v, w, mask = _inputs(length=64, batch=4)
  q, k = 40.0 * q, 40.0 * k
  rho = core.oprf_rho(q, k, mask) * jnp.array([1.0, 0.5, 2.0, 1.5])[:, None]
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  seen = np.asarray(jax.lax.associative_scan(jnp.logical_or, mask, axis=1))[..., None]  # [B, L, 1]
  for causal in (False, True):
    attend = lambda q, k, v: core.favor_attention(q, k, v, w, kernel="optimal_positive", rho=rho, causal=causal,
                                                  key_mask=mask)
    qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
    # The float32 computation of the same (rounded) inputs: at ×20, rounding q and k to bfloat16 moves the
    # logits by O(1), a change of the inputs rather than an error of the pass.
    f32 = np.asarray(jax.jit(attend)(*(x.astype(jnp.float32) for x in (qd, kd, vd))), np.float64)
    out = parallel.sequence_parallel_attention(qd, kd, vd, w, mesh=mesh, axis_name="seq", batch_axis="data",
                                               kernel="optimal_positive", rho=rho, causal=causal, key_mask=mask)
    assert out.dtype == dtype
    got, single = np.asarray(out, np.float64), np.asarray(jax.jit(attend)(qd, kd, vd), np.float64)
    what, scale = f"causal={causal}", np.abs(f32).max()
    # float32: measured 3e-5·max apart (the split's own stabilisers); bfloat16: one rounding of the output.
    np.testing.assert_allclose(got, single, rtol=0, atol=(1e-4 if dtype == jnp.float32 else 8e-3) * scale,
                               err_msg=what)
    if dtype == jnp.bfloat16:  # measured ≤ 2.7e-3·max, the speed study's bfloat16 error
      np.testing.assert_allclose(got, f32, rtol=0, atol=5e-3 * scale, err_msg=what)
    zero = np.all(got == 0, -1)
    expected_zero = ~seen if causal else ~np.asarray(mask).any(1)[:, None, None]
    np.testing.assert_array_equal(zero, np.broadcast_to(expected_zero, zero.shape), err_msg=what)


def test_layers_over_data_and_sequence_axes_equal_the_layers_on_one_device():
  """FAVOR++ in the Linen and NNX layers (ρ computed from the whole batch) over a (data 2, seq 4) mesh:
  outputs, and for NNX the parameters' gradients."""
  from flax import nnx

  from favor_jax.layers import linen as flin
  from favor_jax.layers import nnx as fnnx
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 40, 32))
  mask = (jax.random.uniform(jax.random.PRNGKey(2), (4, 40)) > 0.2)[:, None, None, :]
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  common = dict(num_features=16, kernel="optimal_positive", causal=True, chunk_size=8)
  over_mesh = dict(mesh=mesh, sequence_axis="seq", batch_axis="data")

  one = flin.FavorAttention(num_heads=2, **common)
  params = one.init(jax.random.PRNGKey(0), x)
  split = flin.FavorAttention(num_heads=2, **common, **over_mesh)
  want = jax.jit(lambda p: one.apply(p, x, mask=mask))(params)
  np.testing.assert_allclose(jax.jit(lambda p: split.apply(p, x, mask=mask))(params), want, atol=1e-5, rtol=1e-5)

  layers = [fnnx.FavorAttention(2, 32, **common, **extra, rngs=nnx.Rngs(0)) for extra in ({}, over_mesh)]
  outputs = [nnx.jit(lambda m: m(x, mask=mask, deterministic=True))(m) for m in layers]
  np.testing.assert_allclose(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
  loss = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, mask=mask, deterministic=True) ** 2)))
  grads = [jax.tree.leaves(nnx.state(loss(m), nnx.Param)) for m in layers]
  for a, b in zip(*grads):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()), rtol=1e-5)


def _compilations(f, *args):
  """f(*args) and how many XLA compilations it ran (JAX's compile-time event, a public monitoring hook)."""
  events = []
  listener = lambda event, duration, **kw: events.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    out = jax.block_until_ready(f(*args))
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return out, events.count("/jax/core/compile/backend_compile_duration")


def test_eager_calls_with_the_same_shapes_compile_once():
  q, k, v, w, mask = _inputs(length=48)  # a length no other case uses: the first call compiles
  mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))
  call = lambda q, w: parallel.sequence_parallel_attention(q, k, v, w, mesh=mesh, axis_name="seq", causal=True,
                                                           key_mask=mask, chunk_size=8)
  _, first = _compilations(call, q, w)
  assert first >= 1  # the event is counted (a renamed event would make the next assertion vacuous)
  other_q, other_w = 2.0 * q, core.orthogonal_projection(jax.random.PRNGKey(7), 32, 16)
  out, again = _compilations(call, other_q, other_w)
  assert again == 0  # new values, same shapes: nothing compiles, inside shard_map or around it
  np.testing.assert_allclose(out, jax.jit(lambda q: core.favor_attention(
      q, k, v, other_w, causal=True, key_mask=mask, chunk_size=8))(other_q), atol=1e-5, rtol=1e-5)


def test_an_unhashable_user_kernel_runs():
  """A callable dataclass (unhashable: eq without frozen) as the kernel: no static-argument error."""
  @dataclasses.dataclass
  class ShiftedRelu:
    eps: float = 1e-3

    def __call__(self, q, k, w, stabilize=True):
      return jax.nn.relu(q @ w.T) + self.eps, jax.nn.relu(k @ w.T) + self.eps

  q, k, v, w, mask = _inputs(length=40)
  mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))
  out = parallel.sequence_parallel_attention(q, k, v, w, mesh=mesh, axis_name="seq", kernel=ShiftedRelu(),
                                             causal=True, key_mask=mask, chunk_size=8)
  single = core.favor_attention(q, k, v, w, kernel=ShiftedRelu(), causal=True, key_mask=mask, chunk_size=8)
  np.testing.assert_allclose(out, single, atol=1e-5, rtol=1e-5)


def test_no_device_sees_a_later_devices_keys():
  q, k, v, w, _ = _inputs(length=64)
  mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))
  attend = jax.jit(lambda k: parallel.sequence_parallel_attention(q, k, v, w, mesh=mesh, axis_name="seq",
                                                                  causal=True))
  base = attend(k)
  louder = attend(k.at[:, 60].multiply(100.0))  # a key on the last device, 100× larger
  np.testing.assert_array_equal(base[:, :56], louder[:, :56])  # devices 0-6: bit-identical
  grad_k = jax.grad(lambda k: jnp.sum(attend(k)[:, :56]))(k)
  assert float(jnp.abs(grad_k[:, 56:]).max()) == 0.0


def test_bad_mesh_axis_and_missing_rho_are_rejected():
  q, k, v, w, _ = _inputs(length=16)
  mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))
  with pytest.raises(ValueError, match="axis_name 'sequence' is not an axis of the mesh"):
    parallel.sequence_parallel_attention(q, k, v, w, mesh=mesh, axis_name="sequence")
  with pytest.raises(ValueError, match="needs an explicit rho"):
    parallel.sequence_parallel_attention(q, k, v, w, mesh=mesh, axis_name="seq", kernel="optimal_positive")
  rho = core.oprf_rho(q, k)
  out = parallel.sequence_parallel_attention(q, k, v, w, mesh=mesh, axis_name="seq", kernel="optimal_positive",
                                             rho=rho)
  np.testing.assert_allclose(out, core.favor_attention(q, k, v, w, kernel="optimal_positive", rho=rho),
                             atol=1e-5, rtol=1e-5)


# --- data- and sequence-parallel training ------------------------------------------------------------


def _train(tmp_path, name, *, data=1, sequence=1, fsdp=False, stop_after=0, attention="favor", accum=1):
  from experiments.configs import common, tiny
  from experiments.train import training
  config = common.set_fields(tiny.get_config(), {
      "attention.type": attention, "mesh.data": data, "mesh.sequence": sequence, "mesh.fsdp": fsdp,
      "train.stop_after": stop_after, "train.log_every": 1, "train.grad_accum_steps": accum})
  records, _ = training.train(config, str(tmp_path / name), progress=lambda m: None)
  return records


def _losses(records):
  return np.array([[r["step"], r.get("train_loss", r.get("eval_loss"))] for r in records])


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory):
  return _losses(_train(tmp_path_factory.mktemp("one"), "one"))


@pytest.mark.parametrize("data,sequence,fsdp,accum", [(8, 1, False, 1), (4, 2, True, 1), (1, 8, False, 1),
                                                       (4, 1, True, 2)])
def test_training_on_8_devices_matches_1_device(tmp_path, one_device_losses, data, sequence, fsdp, accum):
  """Also with 2 microbatches per update (lm_base.py's data + FSDP mesh with accumulation): the same updates."""
  eight = _losses(_train(tmp_path, "eight", data=data, sequence=sequence, fsdp=fsdp, accum=accum))
  np.testing.assert_array_equal(eight[:, 0], one_device_losses[:, 0])
  np.testing.assert_allclose(eight[:, 1], one_device_losses[:, 1], rtol=1e-5)


@pytest.mark.parametrize("first,second", [(8, 1), (1, 8)])
def test_checkpoint_moves_between_8_and_1_devices(tmp_path, one_device_losses, first, second):
  from experiments.train import training
  with pytest.raises(training.Stopped, match="at step 3 of 6"):
    _train(tmp_path, "moved", data=first, stop_after=3)
  moved = _losses(_train(tmp_path, "moved", data=second))
  np.testing.assert_array_equal(moved[:, 0], one_device_losses[:, 0])
  np.testing.assert_allclose(moved[:, 1], one_device_losses[:, 1], rtol=1e-5)


def test_bad_meshes_are_rejected_before_training(tmp_path):
  with pytest.raises(ValueError, match="only 8 exist"):
    _train(tmp_path, "big", data=8, sequence=2)
  with pytest.raises(ValueError, match="needs attention.type='favor'"):
    _train(tmp_path, "softmax", sequence=2, attention="softmax")


def test_sequence_parallel_benchmark_quick(tmp_path):
  from experiments import main
  from experiments.configs import sequence_parallel
  config = sequence_parallel.get_config()
  config.quick = True
  records = main.run(config, str(tmp_path))
  assert {r["method"] for r in records} == {"single_device", "sequence_parallel"}
  assert all(r["max_abs_diff_vs_single"] < 1e-4 for r in records)
  comm = {r["causal"]: r["comm_bytes"] for r in records if r["method"] == "sequence_parallel"}
  assert comm[True] == 7 * 1 * 2 * 32 * 66 * 4  # (devices − 1) · B · H · M · (Dv + 2) · 4 bytes
  assert (tmp_path / "sequence_parallel.png").exists()


# --- large q·k: the sequence-parallel path against an explicit float64 form -----------------------------


def _explicit_positive(q, k, v, w, mask, causal):
  """Σ_j A_tj v_j / Σ_j A_tj with A_tj = φ(q_t)ᵀφ(k_j) (positive features), in float64, over unmasked keys
  (j ≤ t if causal), with each row's largest log-term taken out; 0 for a row that sees no key."""
  d = q.shape[-1]
  x, y = (np.asarray(a, np.float64) * d ** -0.25 for a in (q, k))
  w = np.asarray(w, np.float64)
  log_phi = lambda z: z @ w.T - 0.5 * np.sum(z * z, -1, keepdims=True)  # [B, L, H, M]
  logits = log_phi(x)[:, :, None] + log_phi(y)[:, None, :]  # [B, t, j, H, M]
  allowed = np.asarray(mask)[:, None, :, None, None] & np.ones(logits.shape, bool)
  if causal:
    allowed &= np.tril(np.ones(logits.shape[1:3], bool))[None, :, :, None, None]
  logits = np.where(allowed, logits, -np.inf)
  peak = logits.max(axis=(2, 4), keepdims=True)
  a = np.exp(logits - np.where(np.isfinite(peak), peak, 0.0)).sum(-1)  # [B, t, j, H]
  den = a.sum(2)[..., None]
  num = np.einsum("btjh,bjhd->bthd", a, np.asarray(v, np.float64))
  return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def test_sequence_parallel_at_large_scale_equals_the_explicit_form():
  """q, k ×20, where a causal pass can underflow to exact-zero rows (a row must never be 0 unless it sees
  no key). L = 76: padded to 80 over the 8 devices, three chunks of 4 on each."""
  q, k, v, w, mask = _inputs(length=76, heads=2, dim=8, features=16)
  q, k = 40.0 * q, 40.0 * k  # _inputs draws 0.5·N(0, 1): ×20 of a standard normal
  mask = mask.at[1, 0].set(False)  # example 1's first query sees no key: its row is 0
  mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))
  for causal in (True, False):
    for key_mask in (None, mask):
      full = np.ones(q.shape[:2], bool) if key_mask is None else np.asarray(key_mask)
      want = _explicit_positive(q, k, v, w, full, causal)
      chunk_size = 4 if key_mask is None else np.int64(4)  # a numpy integer is an int
      got = np.asarray(jax.jit(lambda q, k, v: parallel.sequence_parallel_attention(
          q, k, v, w, mesh=mesh, axis_name="seq", causal=causal, key_mask=key_mask,
          chunk_size=chunk_size))(q, k, v), np.float64)
      what = f"causal={causal} masked={key_mask is not None}"
      zero = np.all(got == 0, -1) & ~np.all(want == 0, -1)
      assert not zero.any(), f"{what}: {zero.sum()} of {zero.size} rows are 0"
      # float32 log-features of size ~20² carry ~1e-7 relative error each; measured ≤ 2e-5·max|want|.
      atol = 1e-3 * np.abs(want).max()
      np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=what)
      if causal:
        scan = jax.jit(lambda q, k, v: core.favor_attention(q, k, v, w, causal=True, causal_method="scan",
                                                            key_mask=key_mask))(q, k, v)
        np.testing.assert_allclose(got, scan, rtol=0, atol=atol, err_msg=what)
