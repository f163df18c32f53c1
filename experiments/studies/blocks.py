"""Block sizes of the causal pass, from measurement: the XLA pass's chunk size and the fused Pallas
kernels' (chunk, Triton warps, feature block), each timed forward and forward + backward at each L.

The library's GPU defaults (``favor_jax.core.fused.GPU_DEFAULTS``) come from this table, committed under
experiments/results/. Timing as in the speed study (jit, arrays as arguments, one warm-up, median); the
fused kernels are timed without the XLA re-run they fall back to (it runs only when rows lost their
terms, never on these inputs), so a configuration compiles in seconds. A configuration that fails to
compile or run is recorded with its error, not dropped.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

from experiments import tasks
from experiments.studies import speed
from experiments.studies.timing import check_timing
from experiments.train import plotting
from favor_jax import core
from favor_jax.core import attention, fused
from favor_jax.core import state as shared


def _pallas_attention(blocks, q, k, v, p):
  """FAVOR+ causal through the fused kernels with these launch choices (what favor_attention runs)."""
  feature_fn = attention._feature_fn("positive", p, None, q, k, None, True)
  mask = jnp.ones(q.shape[:2], bool)
  num, den = fused.causal(feature_fn, q, k, v.astype(jnp.float32), mask, blocks=blocks, fallback=False)
  return shared.divide(num, den).astype(q.dtype)


def configurations(config):
  """(path, chunk, num_warps, block_f) for every launch choice the config asks for."""
  yield from (("xla", chunk, 0, 0) for chunk in config.xla_chunks)
  yield from (("pallas",) + c for c in itertools.product(config.pallas_chunks, config.num_warps, config.block_fs))


def _fn(path, chunk, num_warps, block_f):
  if path == "xla":
    return lambda q, k, v, p: core.favor_attention(q, k, v, p, causal=True, chunk_size=chunk)
  return functools.partial(_pallas_attention, fused.blocks_for(chunk, num_warps=num_warps, block_f=block_f))


def unread(config) -> dict:
  """{field: why}: the fused kernels' block fields when no Pallas chunk is swept."""
  if config.pallas_chunks:
    return {}
  return {f: "config.pallas_chunks is empty: no fused configuration is timed" for f in ("num_warps", "block_fs")}


def check(config) -> None:
  """The sweep's fields, named when bad, before the first configuration compiles."""
  check_timing(config)  # seq_lens and the other sizes too
  for chunk in config.xla_chunks:
    tasks.positive_int("config.xla_chunks", chunk)
  for warps in config.num_warps:
    tasks.positive_int("config.num_warps", warps)
  for chunk, block_f in itertools.product(config.pallas_chunks, config.block_fs):
    try:
      fused.blocks_for(chunk, block_f=block_f)
    except ValueError as e:
      raise ValueError(f"config.pallas_chunks / config.block_fs: {e}") from None
  if not (config.xla_chunks or config.pallas_chunks):
    raise ValueError("config.xla_chunks and config.pallas_chunks are both empty: nothing to measure")


def run(config, progress=print, workdir=None):
  del workdir
  check(config)
  records = []
  for length, pass_, (path, chunk, warps, bf) in itertools.product(config.seq_lens, config.passes,
                                                                    configurations(config)):
    rec = dict(path=path, chunk=chunk, num_warps=warps, block_f=bf, seq_len=length, pass_=pass_)
    q, k, v, p = speed.inputs(length, batch=config.batch, heads=config.heads, head_dim=config.head_dim,
                              num_features=config.num_features, dtype=jnp.dtype(config.dtype), seed=length)
    fwd = _fn(path, chunk, warps, bf)
    fn = fwd if pass_ == "fwd" else jax.grad(lambda *a, f=fwd: jnp.sum(f(*a).astype(jnp.float32) ** 2),
                                             argnums=(0, 1, 2))
    try:
      compiled = jax.jit(fn).lower(q, k, v, p).compile()
      rec.update(median_s=speed.median_seconds(compiled, q, k, v, p, repeats=config.repeats), status="ok")
    except Exception as e:  # noqa: BLE001 — a launch choice the compiler refuses is a result of the sweep
      rec.update(status="failed", error=f"{type(e).__name__}: {str(e)[:300]}")
    records.append(rec)
    progress(f"L={length:<6} {pass_:>7} {path:>6} C={chunk:<4} warps={warps} F-block={bf:<3} "
             f"{rec.get('median_s', float('nan')) * 1e3:9.3f} ms {rec['status']}")
  return records


def best(records):
  """{(path, L, pass): the fastest ok record}."""
  out = {}
  for r in records:
    key = (r["path"], r["seq_len"], r["pass_"])
    if r["status"] == "ok" and (key not in out or r["median_s"] < out[key]["median_s"]):
      out[key] = r
  return out


def summarize(records, config) -> str:
  lines = ["# Causal block sizes", "",
           f"B={config.batch}, H={config.heads}, D={config.head_dim}, M={config.num_features}, {config.dtype}; "
           f"median of {config.repeats}; FAVOR+ causal.", "",
           "| L | pass | path | chunk | warps | feature block | time (ms) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in records:
    time = f"{r['median_s'] * 1e3:.3f}" if r["status"] == "ok" else r["status"] + ": " + r["error"][:80]
    lines.append(f"| {r['seq_len']} | {r['pass_']} | {r['path']} | {r['chunk']} | {r['num_warps'] or ''} | "
                 f"{r['block_f'] or ''} | {time} |")
  lines += ["", "## Fastest per path", ""]
  fastest = best(records)
  for (path, length, pass_), r in sorted(fastest.items()):
    other = fastest.get(("xla" if path == "pallas" else "pallas", length, pass_))
    vs = f"; XLA / fused = {other['median_s'] / r['median_s']:.2f}×" if path == "pallas" and other else ""
    lines.append(f"- L={length} {pass_} {path}: chunk {r['chunk']}" +
                 (f", {r['num_warps']} warps, feature block {r['block_f']}" if path == "pallas" else "") +
                 f": {r['median_s'] * 1e3:.3f} ms{vs}")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir):
  """Time against chunk size, one panel per (L, pass); a line per path and launch choice."""
  panels = list(itertools.product(config.seq_lens, config.passes))
  fig, axes = plotting.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
  for ax, (length, pass_) in zip(axes[0], panels):
    groups = {}
    for r in records:
      if (r["seq_len"], r["pass_"]) == (length, pass_) and r["status"] == "ok":
        label = "XLA" if r["path"] == "xla" else f"Pallas, {r['num_warps']} warps, F-block {r['block_f']}"
        groups.setdefault(label, []).append((r["chunk"], r["median_s"] * 1e3))
    for (label, pts), color in zip(sorted(groups.items()), plotting.distinct_colors(len(groups))):
      pts.sort()
      ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", color=color, label=label)
    plotting.log2_ticks(ax, [r["chunk"] for r in records])
    plotting.plain_log(ax)
    ax.set(xlabel="chunk size", ylabel="time (ms)", title=f"L={plotting.short_number(length)}, {pass_}")
  plotting.legend_right(fig)
  return [plotting.save(fig, f"{workdir}/blocks.png")]
