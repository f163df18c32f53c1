"""Speed and memory study: every attention method against sequence length, fwd and fwd+bwd.

Timing: jit, arrays as arguments (never closed over: XLA would fold them), one
warm-up, median of ``config.repeats``. Memory (``config.memory``):
``"process"`` runs each configuration in a fresh process and reports its peak
resident memory while running (inputs included; compilation excluded);
``"compiled"`` reports XLA's accounting of the compiled program (arguments +
outputs + temporaries), which every record carries as ``compiled_bytes``.
A configuration whose compiled program needs more than the memory limit is
recorded as ``out_of_memory`` instead of run. A same-run dense matmul gives
the FLOP/s ceiling. In a low-precision run, ``rel_error`` compares each
method's forward output with the same computation in float32.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
from typing import NamedTuple

import jax
import jax.numpy as jnp

from experiments.studies import isolation, plain_passes, tpu_attention
from experiments.studies.speed_plot import plot  # noqa: F401  (the study's figure, as experiments.main calls it)
from experiments.studies.timing import check_timing, median_of
from experiments.train import flops as counts
from experiments.train import paths
from favor_jax import core

CHUNK = 64  # favor_attention's default chunk_size, for the FLOP count
# exact attention: ours, jax's (cuDNN on a GPU), jax's TPU flash and splash kernels (studies/tpu_attention.py)
EXACT = ("softmax", "jax_dot_product_attention") + tuple(tpu_attention.METHODS)


class Estimator(NamedTuple):
  """A linear-time method of the study: the core function and arguments it runs."""
  kernel: str
  causal_method: str = "chunked"
  qk_dim: int | None = None  # q/k head dim (the first qk_dim of D; values keep D), None: D
  window: int = 0  # > 0: hybrid_attention with this exact window
  gated: bool = False  # a forget gate per position and head (log_gate, issue 40), from the queries


ESTIMATORS = {
    "favor": Estimator("positive"),  # FAVOR+, favor_attention's defaults
    "favor_scan": Estimator("positive", causal_method="scan"),  # the paper's per-token recurrence
    "favor_cumsum": Estimator("positive", causal_method="cumsum"),  # materialised prefix states
    "favor_sharp": Estimator("saderf"),  # FAVOR# (dense-exponential features)
    "taylor": Estimator("taylor"),  # 2nd-order Taylor at D: 1 + D + D(D+1)/2 features
    "taylor_d16": Estimator("taylor", qk_dim=16),  # Based's shape: q/k head dim 16 (153 features), Dv = D
    "hybrid_w64": Estimator("positive", window=64),  # exact window of 64 + FAVOR+ beyond it
    "favor_pallas": Estimator("positive", causal_method="pallas"),  # the fused Pallas kernels (causal only)
    "favor_gated": Estimator("positive", gated=True),  # FAVOR+ with a forget gate (causal only)
    "favor_pallas_gated": Estimator("positive", causal_method="pallas", gated=True),  # gated, fused kernels
}


def estimator(name: str) -> Estimator:
  """A linear-time entry of ``config.methods``: a variant named in ESTIMATORS, or any kernel of
  ``core.KERNELS`` by its name with favor_attention's defaults (a kernel added to kernels.py is timed by
  naming it; a learned kernel runs with its map's initial value, which costs what a trained one does)."""
  return ESTIMATORS[name] if name in ESTIMATORS else Estimator(name)


CAUSAL_ONLY = ("favor_scan", "favor_cumsum", "favor_pallas", "favor_gated", "favor_pallas_gated")
causal_only = lambda name: name in CAUSAL_ONLY or plain_passes.split(name) is not None  # plain passes: causal
CHUNKED = ("chunked", "pallas")  # causal methods that compute the masked product inside chunks
CHECK_ROWS = 256  # query rows compared with the float32 exact reference


def median_seconds(fn, *args, repeats: int = 5) -> float:
  return median_of(lambda: jax.block_until_ready(fn(*args)), repeats)


def inputs(seq_len, *, batch=1, heads=8, head_dim=64, num_features=256, dtype=jnp.float32, seed=0):
  """q, k, v ~ N(0, 1) of shape [B, L, H, D] and an orthogonal [M, D] projection."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, k, v = (jax.random.normal(kk, (batch, seq_len, heads, head_dim), dtype) for kk in ks[:3])
  return q, k, v, core.orthogonal_projection(ks[3], num_features, head_dim)


def method(name, on_gpu):
  """fn(q, k, v, projection, causal) for one of ``config.methods``."""
  if name == "softmax":
    return lambda q, k, v, p, causal: core.softmax_attention(q, k, v, causal=causal)
  if name == "jax_dot_product_attention":
    def exact(q, k, v, p, causal):  # cuDNN's fused kernel takes half precision only
      impl = "cudnn" if on_gpu and q.dtype in (jnp.bfloat16, jnp.float16) else None
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
    return exact
  if name in tpu_attention.METHODS:
    return tpu_attention.METHODS[name]
  if plain_passes.split(name):  # a variant's raw features, no stabiliser (causal only)
    variant, form = plain_passes.split(name)
    e = estimator(variant)
    return lambda q, k, v, p, causal: plain_passes.attention(e.kernel, form, q, k, v, p, qk_dim=e.qk_dim, chunk=CHUNK)
  return functools.partial(_linear, estimator(name))


def _linear(e: Estimator, q, k, v, p, causal):
  kern = core.get_kernel(e.kernel)
  if e.qk_dim:
    q, k = q[..., :e.qk_dim], k[..., :e.qk_dim]
  proj = p if kern.needs_projection else None
  # Timing only: a causal model passes a statistic it keeps (e.g. a running average), not this one.
  rho = kern.compute_statistic(q, k) if kern.data_dependent and causal else None
  # A gate that depends on the input, as a learned one does (FoX's σ(w·x + b), here w·x = q's first coordinate,
  # b = 3: f ≈ 0.95), so that fwd+bwd includes its gradient.
  gate = {"log_gate": jax.nn.log_sigmoid(q[..., 0].astype(jnp.float32) + 3.0)} if e.gated else {}
  if e.window:
    return core.hybrid_attention(q, k, v, proj, window=e.window, kernel=kern, causal=causal, rho=rho, **gate)
  return core.favor_attention(q, k, v, proj, kernel=kern, causal=causal, causal_method=e.causal_method, rho=rho,
                              **gate)


def flops(name, causal, b, length, h, d, m, on_gpu=False):
  """Forward FLOPs as computed (``experiments.train.flops``, convention "whole"): XLA's exact attention computes
  the full L×L product even when causal; cuDNN's and jax's TPU kernels skip the blocks above the diagonal.
  Linear methods: features, state updates and read-outs, the masked product inside causal chunks, and a
  hybrid's exact blocks (bidirectional hybrids run the causal pass both ways)."""
  if name in EXACT:
    skips = (on_gpu and name == "jax_dot_product_attention") or name in tpu_attention.METHODS  # blocks above
    return b * h * length * counts.softmax_flops(length, d, causal=causal, skips_masked=skips)
  variant, form = plain_passes.split(name) or (name, None)
  e = estimator(variant)
  e = e._replace(causal_method="scan") if form == "scan" else e
  dq = e.qk_dim or d
  kern = core.get_kernel(e.kernel)
  rows = m if kern.needs_projection else None  # the study gives every kernel that takes one the [M, D] projection
  f = kern.num_features(rows, dq)
  chunk = CHUNK if e.causal_method in CHUNKED else None
  return b * h * length * counts.favor_flops(d, f, rows=rows, qk_dim=dq, causal=causal, chunk=chunk,
                                             window=e.window)


def matmul_ceiling(dtype, on_gpu):
  size = 8192 if on_gpu else 4096
  a = jax.random.normal(jax.random.PRNGKey(0), (size, size), dtype)
  seconds = median_seconds(jax.jit(jnp.matmul), a, a, repeats=10 if on_gpu else 3)
  return 2 * size ** 3 / seconds / 1e9


def memory_limit_bytes(limit_gb):
  """``limit_gb`` > 0 as given; otherwise 90% of the accelerator's memory, or 80% of this host's RAM."""
  if limit_gb > 0:
    return int(limit_gb * 2 ** 30)
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(0.9 * stats["bytes_limit"])
  return int(0.8 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _exact_rows(q, k, v, rows, causal):
  """float32 softmax attention for the query ``rows`` only: O(rows × L) memory at any L."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  s_BHRL = jnp.einsum("brhd,blhd->bhrl", q[:, rows], k) / math.sqrt(q.shape[-1])
  if causal:
    s_BHRL = jnp.where(jnp.arange(k.shape[1])[None, :] <= rows[:, None], s_BHRL, -jnp.inf)
  return jnp.einsum("bhrl,blhd->brhd", jax.nn.softmax(s_BHRL, axis=-1), v)


def _rel_error(name, causal, q, k, v, p, out):
  """‖out − out₃₂‖/‖out₃₂‖ on CHECK_ROWS query rows (the last one included), out₃₂ in float32."""
  length = q.shape[1]
  rows = jnp.unique(jnp.linspace(0, length - 1, min(CHECK_ROWS, length)).astype(jnp.int32))
  if name in EXACT:
    ref = jax.jit(_exact_rows, static_argnums=4)(q, k, v, rows, causal)
  else:
    f32 = lambda x: x.astype(jnp.float32)
    ref = jax.jit(method(name, False), static_argnums=4)(f32(q), f32(k), f32(v), p, causal)[:, rows]
  diff = out[:, rows].astype(jnp.float32) - ref
  return float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref))


def measure(job):
  """One configuration, in this process: compile, check the memory limit, time, measure memory."""
  on_gpu = jax.default_backend() == "gpu"
  b, length, h, d, m = (job[f] for f in ("batch", "seq_len", "heads", "head_dim", "num_features"))
  rec = dict(job)
  if job["method"] == "favor_scan" and length > job["scan_max_len"]:
    return dict(rec, status="skipped_too_slow")
  q, k, v, p = inputs(length, batch=b, heads=h, head_dim=d, num_features=m, dtype=jnp.dtype(job["dtype"]),
                      seed=length)
  fwd = functools.partial(method(job["method"], on_gpu), causal=job["causal"])
  fn = fwd if job["pass"] == "fwd" else jax.grad(
      lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
  try:
    compiled = jax.jit(fn).lower(q, k, v, p).compile()
    mem = compiled.memory_analysis()
    rec["compiled_bytes"] = int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes)
    if rec["compiled_bytes"] > job["memory_limit_bytes"]:
      return dict(rec, status="out_of_memory", peak_bytes=rec["compiled_bytes"])
    if job["memory"] == "process":
      base = isolation.reset_peak_rss()
    rec["median_s"] = median_seconds(compiled, q, k, v, p, repeats=job["repeats"])
    if job["memory"] == "process":  # what running added to the resident set, plus the inputs it was given
      rec["peak_bytes"] = isolation.peak_rss() - base + int(mem.argument_size_in_bytes)
    else:
      rec["peak_bytes"] = rec["compiled_bytes"]
    work = flops(job["method"], job["causal"], b, length, h, d, m, on_gpu)
    work *= 1 if job["pass"] == "fwd" else counts.MODEL_FWD_BWD
    rec["gflops_per_s"] = work / rec["median_s"] / 1e9
    rec["fraction_of_matmul"] = rec["gflops_per_s"] / job["matmul_gflops_per_s"]
    if job["pass"] == "fwd" and job["dtype"] != "float32":
      rec["rel_error"] = _rel_error(job["method"], job["causal"], q, k, v, p, compiled(q, k, v, p))
    return dict(rec, status="ok")
  except jax.errors.JaxRuntimeError as e:  # an allocation failure is a result here; any other error is not
    if not out_of_memory(e):
      raise
    return dict(rec, status="out_of_memory")


def out_of_memory(error: Exception) -> bool:
  """Whether ``error`` is XLA's allocation failure: a runtime error with status RESOURCE_EXHAUSTED."""
  return isinstance(error, jax.errors.JaxRuntimeError) and str(error).startswith("RESOURCE_EXHAUSTED")


def jobs(config, ceiling, limit):
  """Every (L, method, causal, pass) the config asks for, as a job ``measure`` takes."""
  for length in config.seq_lens:
    for name in config.methods:
      for causal in config.causal:
        if causal_only(name) and not causal:
          continue
        for pass_ in config.passes:
          yield dict(method=name, causal=causal, seq_len=length, num_features=config.num_features,
                     head_dim=config.head_dim, heads=config.heads, batch=config.batch, dtype=config.dtype,
                     repeats=config.repeats, memory=config.memory, memory_limit_bytes=limit,
                     scan_max_len=config.scan_max_len, matmul_gflops_per_s=ceiling, **{"pass": pass_})


def unread(config) -> dict:
  """{field: why}: ``scan_max_len`` without the per-token scan among the methods."""
  return {} if "favor_scan" in config.methods else {"scan_max_len": "'favor_scan' is not in config.methods"}


def run(config, progress=print, workdir=None):
  check_timing(config)
  if config.memory_limit_gb < 0:
    raise ValueError(f"config.memory_limit_gb must be >= 0 (0: auto), got {config.memory_limit_gb!r}")
  if config.memory not in ("process", "compiled"):
    raise ValueError(f"config.memory must be 'process' or 'compiled', got {config.memory!r}")
  linear = lambda m: m in ESTIMATORS or m in core.KERNELS
  unknown = [m for m in config.methods if m not in EXACT and not linear((plain_passes.split(m) or (m,))[0])]
  if unknown:
    raise ValueError(f"config.methods has unknown {unknown}; choose from {list(EXACT) + list(ESTIMATORS)}, a "
                     f"kernel of core.KERNELS {sorted(core.KERNELS)}, or either as NAME_plain_FORM, FORM one of "
                     f"{plain_passes.FORMS} (its raw features, no stabiliser: experiments/studies/plain_passes.py)")
  plain = {m: estimator(plain_passes.split(m)[0]) for m in config.methods if plain_passes.split(m)}
  windowed = [m for m, e in plain.items() if e.window or e.gated]
  if windowed:  # the plain passes have no exact window and no gate: they would time something else
    raise ValueError(f"config.methods {windowed}: the plain passes run a variant's features only; a window or a "
                     f"gate has none there (use the kernel's name, e.g. positive_plain_scan)")
  causal = [m for m in config.methods if causal_only(m)]
  if causal and True not in config.causal:
    raise ValueError(f"config.methods {causal} time causal attention only, but config.causal="
                     f"{tuple(config.causal)} asks for none: add True to config.causal, or drop them")
  on_gpu = jax.default_backend() == "gpu"
  ceiling = matmul_ceiling(jnp.dtype(config.dtype), on_gpu)
  limit = memory_limit_bytes(config.memory_limit_gb)
  progress(f"matmul ceiling {ceiling:.1f} GFLOP/s ({config.dtype}); memory limit {limit / 2**30:.1f} GiB; "
           f"memory measured: {config.memory}")
  records = []
  if workdir:  # this run's records only (an earlier run's in the same directory are replaced)
    paths.write_text(os.path.join(workdir, "records.jsonl"), "")
  for job in jobs(config, ceiling, limit):
    if config.memory == "process":
      try:
        rec = isolation.spawn("experiments.studies.speed", job)
      except subprocess.CalledProcessError as e:
        if e.returncode != -9:  # anything but the OOM killer is a bug, not a result
          raise RuntimeError(f"speed case {job} failed:\n{e.stderr[-3000:]}") from e
        rec = dict(job, status="out_of_memory", killed=True)
    else:
      rec = measure(job)
    records.append(rec)
    if workdir:  # partial results survive an interrupted run (the file written whole: it may be on a bucket)
      paths.write_text(os.path.join(workdir, "records.jsonl"), "".join(json.dumps(r) + "\n" for r in records))
    progress(f"L={rec['seq_len']:<7} {rec['method']:>26} {'causal' if rec['causal'] else 'bidir':>6} "
             f"{rec['pass']:>7} {rec.get('median_s', float('nan')):9.4f}s "
             f"{rec.get('peak_bytes', 0) / 2**20:9.0f} MB  {rec['status']}")
  return records


def summarize(records, config) -> str:
  ok = [r for r in records if r["status"] == "ok"]
  t = {(r["method"], r["causal"], r["seq_len"], r["pass"]): r for r in records}
  where = ("peak resident memory of the configuration's own process" if config.memory == "process"
           else "XLA's compiled accounting")
  err = any("rel_error" in r for r in records)
  lines = ["# Speed and memory study", "",
           f"B={config.batch}, H={config.heads}, D={config.head_dim}, M={config.num_features}, "
           f"{config.dtype}; median of {config.repeats}; matmul ceiling "
           f"{records[0]['matmul_gflops_per_s']:.1f} GFLOP/s; memory: {where}; out_of_memory = the compiled "
           f"program needs more than {records[0]['memory_limit_bytes'] / 2**30:.1f} GiB (its need in MB).", "",
           "| L | method | causal | pass | time (s) | memory (MB) | GFLOP/s | of matmul |"
           + (" rel. error |" if err else ""),
           "| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if err else "")]
  for r in records:
    head = f"| {r['seq_len']} | {r['method']} | {r['causal']} | {r['pass']} |"
    tail = (f" {r['rel_error']:.1e} |" if "rel_error" in r else " |") if err else ""
    if r["status"] == "ok":
      lines.append(f"{head} {r['median_s']:.4f} | {r['peak_bytes'] / 2**20:.0f} | {r['gflops_per_s']:.1f} | "
                   f"{r['fraction_of_matmul']:.0%} |{tail}")
    else:
      need = f"{r['peak_bytes'] / 2**20:.0f}" if "peak_bytes" in r else ""  # no need known: compiling failed
      lines.append(f"{head} {r['status']} | {need} | | |{tail}")
  lines += ["", "## Ratios measured in this run", ""]
  for r in ok:
    key = (r["method"], r["causal"], r["seq_len"], r["pass"])
    if r["method"] in EXACT and not r["causal"]:
      fav = t.get(("favor", False, r["seq_len"], r["pass"]))
      if fav and fav["status"] == "ok":
        lines.append(f"- L={key[2]} {key[3]}: {r['method']} / FAVOR+ bidirectional = "
                     f"{r['median_s'] / fav['median_s']:.1f}×")
    if r["method"] == "softmax":  # our reference against jax's (XLA on a CPU, cuDNN on a GPU): how fair a baseline
      jax_ = t.get(("jax_dot_product_attention",) + key[1:])
      if jax_ and jax_["status"] == "ok":
        lines.append(f"- L={key[2]} {'causal' if key[1] else 'bidirectional'} {key[3]}: our softmax / "
                     f"jax.nn.dot_product_attention = {r['median_s'] / jax_['median_s']:.2f}× time, "
                     f"{r['peak_bytes'] / jax_['peak_bytes']:.2f}× memory")
    if r["method"] == "favor_scan":
      fav = t.get(("favor", True, r["seq_len"], r["pass"]))
      if fav and fav["status"] == "ok":
        lines.append(f"- L={key[2]} {key[3]}: scan / chunked causal = {r['median_s'] / fav['median_s']:.1f}×")
    if plain_passes.split(r["method"]):  # the library's stabilised pass against the same features without one
      ours = t.get((plain_passes.split(r["method"])[0],) + key[1:])
      if ours and ours["status"] == "ok":
        lines.append(f"- L={key[2]} causal {key[3]}: {ours['method']} (stabilised) / {r['method']} = "
                     f"{ours['median_s'] / r['median_s']:.2f}× time, "
                     f"{ours['peak_bytes'] / r['peak_bytes']:.2f}× memory")
    elif r["method"] not in EXACT + ("favor",) and estimator(r["method"]).causal_method == "chunked":
      fav = t.get(("favor",) + key[1:])
      if fav and fav["status"] == "ok":
        lines.append(f"- L={key[2]} {'causal' if key[1] else 'bidirectional'} {key[3]}: {r['method']} / FAVOR+ = "
                     f"{r['median_s'] / fav['median_s']:.1f}× time, "
                     f"{r['peak_bytes'] / fav['peak_bytes']:.1f}× memory")
    if r["method"] in ("favor_pallas", "favor_pallas_gated"):
      for base in ("favor_gated",) if r["method"] == "favor_pallas_gated" else ("favor", "jax_dot_product_attention"):
        other = t.get((base,) + key[1:])
        if other and other["status"] == "ok":
          lines.append(f"- L={key[2]} causal {key[3]}: {base} / fused Pallas = "
                       f"{other['median_s'] / r['median_s']:.2f}× (above 1: the fused kernels are faster)")
  timed = {(r["method"], r["causal"], r["pass"]) for r in records}
  for exact in EXACT:
    if not {("favor", False, "fwd"), (exact, False, "fwd")} <= timed:
      continue  # this run did not time both (a crossover that was not measured is not "none")
    cross = [length for length in sorted({r["seq_len"] for r in ok})
             if all(t.get((meth, False, length, "fwd"), {}).get("status") == "ok" for meth in ("favor", exact))
             and t[("favor", False, length, "fwd")]["median_s"] < t[(exact, False, length, "fwd")]["median_s"]]
    lines.append(f"- crossover: FAVOR+ bidirectional fwd beats {exact} from L={cross[0]}" if cross
                 else f"- crossover: FAVOR+ bidirectional fwd does not beat {exact} in this sweep")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  isolation.child_main(measure)
