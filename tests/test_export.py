"""Lowering for accelerators from this CPU (``jax.export`` / ``lower(lowering_platforms=...)``): the fused causal
pass picks its kernel where the program is lowered (the Mosaic kernel for "tpu", plain, gated and packed,
forward and gradient; the Triton one for "cuda"), what cannot run on a platform names itself, and every public
path lowers for "tpu" (the attention functions, the decode step, the Linen and NNX layers, a gated train
step). Lowering only: nothing here runs on an accelerator."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from favor_jax import core
from favor_jax.core import attention, fused
from favor_jax.core import causal as causal_lib
from favor_jax.layers import linen as favor_linen
from favor_jax.layers import nnx as favor_nnx

B, L, H, D = 1, 40, 2, 8  # L not a multiple of the chunk
MOSAIC = "tpu_custom_call"
TRITON = "__gpu$xla.gpu.triton"


def _qkv():
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  return tuple(jax.random.normal(kk, (B, L, H, D)) for kk in ks)


PROJ = core.orthogonal_projection(jax.random.PRNGKey(5), 16, D)
GATE = jnp.full((B, L, H), -0.05).at[:, 11].set(-jnp.inf)
SEGMENTS = jnp.asarray([[0] * 23 + [1] * (L - 23)], jnp.int32)  # a boundary inside the second chunk


def _tpu_text(fn, *args):
  return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


def _pallas(**kw):
  return lambda q, k, v: core.favor_attention(q, k, v, PROJ, causal=True, causal_method="pallas", chunk_size=16,
                                              **kw).astype(jnp.float32)


def _grad(fn):
  return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))


@pytest.mark.slow(default_tier_covers=())
@pytest.mark.parametrize("what", ["plain", "gated", "packed"])
def test_pallas_exported_for_tpu_holds_the_mosaic_kernels_forward_and_gradient(what):
  """The gradient's program holds the three Mosaic kernels (forward, ∂ℓq, ∂ℓk/∂v), none of Triton's; the plain
  forward alone holds one."""
  kw = {"plain": {}, "gated": {"log_gate": GATE}, "packed": {"segment_ids": SEGMENTS}}[what]
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv()) if what == "gated" else _qkv()
  if what == "plain":
    forward = _tpu_text(_pallas(**kw), q, k, v)
    assert forward.count(MOSAIC) == 1 and TRITON not in forward
  backward = _tpu_text(_grad(_pallas(**kw)), q, k, v)
  assert backward.count(MOSAIC) == 3 and TRITON not in backward


def test_pallas_lowered_for_cuda_holds_the_triton_kernels_and_gates_say_what_they_need():
  """For CUDA the Triton kernels (Triton's custom calls carry no compatibility guarantee, so this lowers
  rather than serialises); gates there (CUDA, ROCm), while ``fused.causal`` takes none, fail when lowered,
  naming why."""
  q, k, v = _qkv()
  text = jax.jit(_pallas()).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count(TRITON) == 2 and MOSAIC not in text
  gated = jax.jit(_pallas(log_gate=GATE)).trace(q, k, v)
  for platform in ("cuda", "rocm"):
    if "gate" in inspect.signature(fused.causal).parameters:
      assert TRITON in gated.lower(lowering_platforms=(platform,)).as_text()
    else:
      with pytest.raises(ValueError, match=f"the Triton kernels take no gate.*lowering for {platform}"):
        gated.lower(lowering_platforms=(platform,))


def test_every_public_path_lowers_for_tpu():
  """The public attention functions, the decode step, the Linen and NNX layers' apply and one gated optax train
  step lower for TPU (XLA paths: no kernel needed)."""
  q, k, v = _qkv()
  mask = jnp.arange(L)[None] < 30
  calls = {
      "favor": lambda q, k, v: core.favor_attention(q, k, v, PROJ, causal=True, key_mask=mask, log_gate=GATE),
      "linear": lambda q, k, v: core.linear_attention(jax.nn.elu(q) + 1, jax.nn.elu(k) + 1, v, causal=True),
      "hybrid": lambda q, k, v: core.hybrid_attention(q, k, v, PROJ, window=4, causal=True, segment_ids=SEGMENTS),
      "softmax": lambda q, k, v: core.softmax_attention(q, k, v, causal=True, log_gate=GATE),
      "weights": lambda q, k, v: core.attention_weights(q, k, PROJ, kernel="positive", causal=True),
      "decode": lambda q, k, v: core.favor_decode_step(core.favor_decode_init(q[:, :1], v[:, :1], PROJ), q[:, :1],
                                                       k[:, :1], v[:, :1], PROJ)[0],
  }
  for name, fn in calls.items():
    assert "func.func public @main" in _tpu_text(fn, q, k, v), name

  x = jax.random.normal(jax.random.PRNGKey(1), (B, L, H * D))
  linen = favor_linen.FavorAttention(num_heads=H, qkv_features=H * D, num_features=16, causal=True,
                                     forget_gate=True, chunk_size=16)
  params = linen.init(jax.random.PRNGKey(2), x)
  assert "func.func public @main" in _tpu_text(lambda p, x: linen.apply(p, x), params, x)
  layer = favor_nnx.FavorAttention(H, H * D, num_features=16, causal=True, rngs=nnx.Rngs(3))
  graph, state = nnx.split(layer)
  assert "func.func public @main" in _tpu_text(lambda s, x: nnx.merge(graph, s)(x), state, x)

  class Model(nn.Module):  # a gated attention layer, packed, with a readout: enough for an optax step
    @nn.compact
    def __call__(self, x, ids):
      attention = favor_linen.FavorAttention(num_heads=H, qkv_features=H * D, num_features=16, causal=True,
                                             forget_gate=True, chunk_size=16)
      return nn.Dense(1)(attention(x, segment_ids=ids))

  model = Model()
  variables = model.init(jax.random.PRNGKey(4), x, SEGMENTS)
  mp, rest = variables["params"], {name: c for name, c in variables.items() if name != "params"}
  opt = optax.adam(1e-3)

  def step(p, o, x):
    loss, g = jax.value_and_grad(lambda p: jnp.mean(model.apply({**rest, "params": p}, x, SEGMENTS) ** 2))(p)
    updates, o = opt.update(g, o, p)
    return optax.apply_updates(p, updates), o, loss

  assert "func.func public @main" in _tpu_text(step, mp, opt.init(mp), x)


def _residuals_for_tpu(fn, *shapes):
  """The residuals a gradient of ``fn`` keeps from its forward to its backward, as lowered for TPU (abstract
  inputs: nothing allocated): [(shape, dtype, is an input)], read off the exported program's results."""
  exported = jax.export.export(jax.jit(lambda *x: jax.vjp(fn, *x)[1]), platforms=["tpu"])(*shapes)
  text = exported.mlir_module()
  main = text[text.index("func.func public @main"):]
  end = main.find("func.func", 1)
  main = main if end < 0 else main[:end]
  returned = [o.strip() for o in re.findall(r"\breturn (%[^:]*?) :", main)[-1].split(",")]
  assert len(returned) == len(exported.out_avals)
  return [(a.shape, a.dtype, o.startswith("%arg")) for o, a in zip(returned, exported.out_avals)]


def _bytes(shape, dtype):
  return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


RES_B, RES_L, RES_H, RES_D, RES_M = 1, 1024, 2, 64, 256  # 8 chunks of 128, the geometry the TPU runs


@pytest.mark.slow  # an export of a gradient: seconds
def test_a_fused_gradient_keeps_the_inputs_and_row_statistics_only():
  """The fused call's residuals, lowered for TPU: its inputs, the projection, the row scales [N, L, H] and the
  redo's flag; nothing of the XLA pass that redoes lost rows (not taken: never zero-filled), of another
  target's kernels, or of size L×F. (Before issue 51: 9.6 MB of residuals for 1.6 MB of inputs here.)"""
  qkv = jax.ShapeDtypeStruct((RES_B, RES_L, RES_H, RES_D), jnp.float32)
  proj = jax.ShapeDtypeStruct((RES_M, RES_D), jnp.float32)

  def fn(q, k, v, p):
    features = attention._feature_fn("positive", p, None, q, k, None, True)
    return causal_lib.pallas(features, q, k, v, jnp.ones((RES_B, RES_L), bool), chunk_size=128)

  found = _residuals_for_tpu(fn, qkv, qkv, qkv, proj)
  extra = sum(_bytes(s, d) for s, d, is_input in found if not is_input)
  rows = RES_B * RES_L * RES_H
  assert extra <= 6 * rows, found  # the scale (float32) per row, the mask per position, one flag


@pytest.mark.slow  # an export of a gradient: seconds
def test_favor_attention_gradient_keeps_nothing_of_feature_size():
  """The public call with gates, bfloat16, lowered for TPU: no residual as large as the features (N·L·H·M/2
  elements or more; the envelope's masks and the division's output are what remains besides the inputs)."""
  qkv = jax.ShapeDtypeStruct((RES_B, RES_L, RES_H, RES_D), jnp.bfloat16)
  proj = jax.ShapeDtypeStruct((RES_M, RES_D), jnp.float32)
  gate = jnp.full((RES_B, RES_L, RES_H), -0.05)

  def fn(q, k, v, p):
    return core.favor_attention(q, k, v, p, causal=True, causal_method="pallas", chunk_size=128, log_gate=gate)

  found = _residuals_for_tpu(fn, qkv, qkv, qkv, proj)
  features = RES_B * RES_L * RES_H * RES_M // 2
  assert all(int(np.prod(s)) < features for s, _, _ in found), found


ACCEPT = dict(B=2, L=16384, H=8, D=64, M=256)  # issue 51's acceptance shape (abstract: nothing allocated)
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "ui32": 4, "i1": 1, "i8": 1, "i64": 8, "f64": 8, "index": 8}


def _tensor(t):
  """(elements, bytes) of an MLIR ``tensor<AxBx...xT>`` type."""
  dims, dtype = re.fullmatch(r"tensor<((?:\d+x)*)(\w+)>", t).groups()
  n = int(np.prod([int(d) for d in dims.split("x") if d]))
  return n, n * _DTYPE_BYTES[dtype]


def _mosaic_traffic(text):
  """(bytes the Mosaic calls read and write, their count, the largest array's elements anywhere) of an exported
  program: each ``tpu_custom_call``'s operands and results, as typed on its line."""
  moved, calls = 0, 0
  for line in text.splitlines():
    if "stablehlo.custom_call @tpu_custom_call" in line:
      calls += 1
      moved += sum(_tensor(t)[1] for t in re.findall(r"tensor<[^>]*>", line[line.rindex(": (") + 2:]))
  largest = max(_tensor(t)[0] for t in re.findall(r"tensor<[\dx]*\w+>", text))
  return moved, calls, largest


@pytest.mark.slow  # two lowerings at L=16384
def test_the_triton_kernels_compute_the_features_themselves_forward_and_backward():
  """Lowered for CUDA at issue 51's shape (bfloat16, kernel "positive"): the gradient's program (the forward's
  kernels in it) holds no array with as many elements as the features (the Triton kernels compute them from q, k
  and the projection, forward and backward: ∂q and ∂k come out of the kernel), and their Triton calls read q
  and k in bfloat16. The gradient kernel gives the projection's gradient (one [F, D] per chunk and row) only
  where the projection is differentiated. Measured 2026-12-06 (``programs.export_traffic``): 4209 B per token
  and head forward (8664 with XLA's features), 12207 B in the gradient of q, k, v (25085 with XLA's
  features in both passes, 20626 with the forward's own)."""
  b, length, h, d, m = (ACCEPT[x] for x in "BLHDM")
  qkv = jax.ShapeDtypeStruct((b, length, h, d), jnp.bfloat16)
  fn = lambda q, k, v, p: core.favor_attention(q, k, v, p, causal=True, causal_method="pallas")
  loss = lambda *x: jnp.sum(fn(*x).astype(jnp.float32) ** 2)
  # a gradient's program holds the forward's kernels too (the states', then the outputs': num, den, m, recomputed)
  for what, program, results in (("∂q, ∂k, ∂v", jax.grad(loss, argnums=(0, 1, 2)), 3),
                                 ("∂q, ∂k, ∂v, ∂ω", jax.grad(loss, argnums=(0, 1, 2, 3)), 4)):
    text = jax.jit(program).trace(qkv, qkv, qkv, jax.ShapeDtypeStruct((m, d), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    # an array over both tokens and features ([R, L, F] or [B, H, L, F] in any order), not the chunk states
    # [R, L/C + 1, F, Dv], which at this shape (F·Dv/C = M) happen to have as many elements
    dims = [t.split("x")[:-1] for t in re.findall(r"tensor<([\dx]*\w+)>", text)]
    assert not [d_ for d_ in dims if str(length) in d_ and str(m) in d_], f"{what}: an array of the features"
    calls = [line for line in text.splitlines() if TRITON in line]
    assert calls and all(f"tensor<{b * h}x{length}x{d}xbf16>" in line for line in calls), what
    kernel_results = [len(re.findall(r"tensor<", call[call.rindex("->"):])) for call in calls]
    assert kernel_results[1] == 4 and kernel_results[-1] == results, (what, kernel_results)  # ∂q, ∂k, ∂v(, ∂ω)


@pytest.mark.slow  # two exports at L=16384 per case: seconds each
@pytest.mark.parametrize("what", ["plain", "gated", "packed", "favor++", "favor#"])
def test_mosaic_calls_move_under_a_kilobyte_per_token_and_head_forward(what):
  """Issue 51's acceptance, exported for TPU (bfloat16 q, k, v, kernel "positive", "pallas", B=2, L=16384, H=8,
  D=64, M=256): no array with as many elements as the features (B·L·H·M/2) in the forward program; the Mosaic
  calls move ≤ 1 KiB per token and head forward and ≤ 4 KiB in the gradient program. Measured 2026-12-05:
  652 / 2733 B plain, 656 / 2753 B gated and packed (before issue 51: 3076 / 11788 B, and the forward held
  [16, 16384, 256] float32 features). FAVOR++ (its ρ given, as causal calls take it) computes its features on
  chip too, from a projection and a normaliser per (sequence, head): 656 / 2744 B; FAVOR# (its statistic given)
  from those and a scale of q and of k per (sequence, head): 656 / 2744 B (measured 2026-12-06)."""
  b, length, h, d, m = (ACCEPT[x] for x in "BLHDM")
  qkv = jax.ShapeDtypeStruct((b, length, h, d), jnp.bfloat16)
  proj = jax.ShapeDtypeStruct((m, d), jnp.float32)
  gate = jax.ShapeDtypeStruct((b, length, h), jnp.float32)
  ids = jax.ShapeDtypeStruct((b, length), jnp.int32)
  rho = jax.ShapeDtypeStruct((b, h) + ((d + 1,) if what == "favor#" else ()), jnp.float32)

  def forward(q, k, v, p, g, s, r):
    kw = {"plain": {}, "gated": {"log_gate": g}, "packed": {"segment_ids": s},
          "favor++": {"kernel": "optimal_positive", "rho": r}, "favor#": {"kernel": "saderf", "rho": r}}[what]
    return core.favor_attention(q, k, v, p, causal=True, causal_method="pallas", chunk_size=128, **kw)

  gradient = jax.grad(lambda *x: jnp.sum(forward(*x).astype(jnp.float32)), argnums=(0, 1, 2, 3))
  per = b * length * h
  for fn, budget, n_calls in ((forward, 1024, 1), (gradient, 4096, 3)):
    text = jax.export.export(jax.jit(fn), platforms=["tpu"])(qkv, qkv, qkv, proj, gate, ids, rho).mlir_module()
    moved, calls, largest = _mosaic_traffic(text)
    assert calls == n_calls and moved / per <= budget, (fn, calls, moved / per)
    if fn is forward:
      assert largest < b * length * h * m // 2, largest
