"""Speed and memory study: every attention method against sequence length, fwd and fwd+bwd.

Timing: jit, arrays as arguments, one warm-up, median of ``config.repeats``.
Memory: XLA's accounting of the compiled program (arguments + outputs +
temporaries). A configuration whose compiled program would need more than
``config.memory_limit_gb`` is recorded as ``out_of_memory`` instead of run.
A same-run dense matmul gives the machine's FLOP/s ceiling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from experiments.benchmarks.attention_speed import median_seconds
from favor_jax import core
from experiments import plotting

CHUNK = 64  # favor_attention's default chunk_size, for the FLOP count


def _methods(on_gpu):
  exact = functools.partial(jax.nn.dot_product_attention, implementation="cudnn" if on_gpu else None)
  favor = lambda method: (lambda q, k, v, p, causal: core.favor_attention(
      q, k, v, p, causal=causal, causal_method=method))
  return {
      "softmax": lambda q, k, v, p, causal: core.softmax_attention(q, k, v, causal=causal),
      "jax_dot_product_attention": lambda q, k, v, p, causal: exact(q, k, v, is_causal=causal),
      "favor": favor("chunked"),
      "favor_scan": favor("scan"),
      "favor_cumsum": favor("cumsum"),
  }


def flops(method, causal, b, length, h, d, m):
  """Forward FLOPs as computed (exact attention computes the full L×L product even when causal)."""
  if method in ("softmax", "jax_dot_product_attention"):
    return 4 * b * h * length * length * d
  per_token = 2 * 2 * m * d + 2 * 2 * m * (d + 1)  # features of q and k; state update and read-out
  if causal and method == "favor":
    per_token += 2 * CHUNK * (m + d + 1)  # masked quadratic product inside a chunk
  return b * h * length * per_token


def matmul_ceiling(dtype, size=4096, repeats=3):
  a = jax.random.normal(jax.random.PRNGKey(0), (size, size), dtype)
  seconds = median_seconds(jax.jit(jnp.matmul), a, a, repeats=repeats)
  return 2 * size ** 3 / seconds / 1e9


def run(config, progress=print, workdir=None):
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.dtype(config.dtype)
  methods = _methods(on_gpu)
  ceiling = matmul_ceiling(dtype)
  progress(f"matmul ceiling {ceiling:.1f} GFLOP/s ({config.dtype})")
  b, h, d, m = config.batch, config.heads, config.head_dim, config.num_features
  records = []
  for length in config.seq_lens:
    ks = jax.random.split(jax.random.PRNGKey(length), 4)
    q, k, v = (jax.random.normal(kk, (b, length, h, d), dtype) for kk in ks[:3])
    p = core.orthogonal_projection(ks[3], m, d)
    for name in config.methods:
      for causal in config.causal:
        if name in ("favor_scan", "favor_cumsum") and not causal:
          continue  # causal algorithms only
        for pass_ in config.passes:
          fwd = functools.partial(methods[name], causal=causal)
          fn = fwd if pass_ == "fwd" else jax.grad(
              lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
          rec = dict(method=name, causal=causal, seq_len=length, num_features=m, head_dim=d, heads=h,
                     batch=b, dtype=config.dtype, **{"pass": pass_}, matmul_gflops_per_s=ceiling)
          try:
            compiled = jax.jit(fn).lower(q, k, v, p).compile()
            mem = compiled.memory_analysis()
            rec["peak_bytes"] = int(mem.temp_size_in_bytes + mem.argument_size_in_bytes
                                    + mem.output_size_in_bytes)
            if rec["peak_bytes"] > config.memory_limit_gb * 2 ** 30:
              rec["status"] = "out_of_memory"
            elif name == "favor_scan" and length > config.scan_max_len:
              rec["status"] = "skipped_too_slow"
            else:
              rec["median_s"] = median_seconds(compiled, q, k, v, p, repeats=config.repeats)
              work = flops(name, causal, b, length, h, d, m) * (1 if pass_ == "fwd" else 3)
              rec["gflops_per_s"] = work / rec["median_s"] / 1e9
              rec["fraction_of_matmul"] = rec["gflops_per_s"] / ceiling
              rec["status"] = "ok"
          except Exception as e:  # noqa: BLE001 — an allocation failure is a result here
            if "RESOURCE_EXHAUSTED" not in str(e) and "memory" not in str(e).lower():
              raise
            rec["status"] = "out_of_memory"
          records.append(rec)
          progress(f"L={length:<7} {name:>26} {'causal' if causal else 'bidir':>6} {pass_:>7} "
                   f"{rec.get('median_s', float('nan')):9.4f}s  {rec['status']}")
  return records


def summarize(records, config) -> str:
  ok = [r for r in records if r["status"] == "ok"]
  t = {(r["method"], r["causal"], r["seq_len"], r["pass"]): r for r in records}
  lines = ["# Speed and memory study", "",
           f"B={config.batch}, H={config.heads}, D={config.head_dim}, M={config.num_features}, "
           f"{config.dtype}; median of {config.repeats}; matmul ceiling "
           f"{records[0]['matmul_gflops_per_s']:.1f} GFLOP/s.", "",
           "| L | method | causal | pass | time (s) | memory (MB) | GFLOP/s | of matmul |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in records:
    if r["status"] == "ok":
      lines.append(f"| {r['seq_len']} | {r['method']} | {r['causal']} | {r['pass']} | {r['median_s']:.4f} | "
                   f"{r['peak_bytes'] / 2**20:.0f} | {r['gflops_per_s']:.1f} | {r['fraction_of_matmul']:.0%} |")
    else:
      lines.append(f"| {r['seq_len']} | {r['method']} | {r['causal']} | {r['pass']} | {r['status']} | "
                   f"{r.get('peak_bytes', 0) / 2**20:.0f} | | |")
  lines += ["", "## Ratios measured in this run", ""]
  for r in ok:
    key = (r["method"], r["causal"], r["seq_len"], r["pass"])
    if r["method"] == "softmax" and not r["causal"]:
      fav = t.get(("favor", False, r["seq_len"], r["pass"]))
      if fav and fav["status"] == "ok":
        lines.append(f"- L={key[2]} {key[3]}: exact softmax / FAVOR+ bidirectional = "
                     f"{r['median_s'] / fav['median_s']:.1f}×")
    if r["method"] == "favor_scan":
      fav = t.get(("favor", True, r["seq_len"], r["pass"]))
      if fav and fav["status"] == "ok":
        lines.append(f"- L={key[2]} {key[3]}: scan / chunked causal = {r['median_s'] / fav['median_s']:.1f}×")
  cross = [length for length in sorted({r["seq_len"] for r in ok})
           if all(t.get((meth, False, length, "fwd"), {}).get("status") == "ok" for meth in ("favor", "softmax"))
           and t[("favor", False, length, "fwd")]["median_s"] < t[("softmax", False, length, "fwd")]["median_s"]]
  lines.append(f"- crossover: FAVOR+ bidirectional beats exact softmax from L={cross[0]}" if cross
               else "- crossover: not reached in this sweep")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir):
  fig, axes = plotting.subplots(1, 2, figsize=(11, 4))
  series = sorted({(r["method"], r["causal"], r["pass"]) for r in records})
  for method, causal, pass_ in series:
    pts = sorted((r["seq_len"], r) for r in records if (r["method"], r["causal"], r["pass"]) ==
                 (method, causal, pass_) and r["status"] == "ok")
    if not pts:
      continue
    label = f"{method} {'causal' if causal else 'bidir'} {pass_}"
    axes[0].plot([x for x, _ in pts], [r["median_s"] for _, r in pts], marker="o", ms=3, label=label)
    axes[1].plot([x for x, _ in pts], [r["peak_bytes"] / 2**20 for _, r in pts], marker="o", ms=3, label=label)
  axes[0].set(xscale="log", yscale="log", xlabel="L", ylabel="time (s)")
  axes[1].set(xscale="log", yscale="log", xlabel="L", ylabel="compiled memory (MB)")
  axes[0].legend(fontsize=6)
  fig.suptitle(f"B={config.batch} H={config.heads} D={config.head_dim} M={config.num_features} {config.dtype}")
  path = f"{workdir}/speed_memory_vs_length.png"
  return [plotting.save(fig, path)]
