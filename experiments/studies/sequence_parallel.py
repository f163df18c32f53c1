"""Sequence-parallel FAVOR+ against single-device FAVOR+ at long L: time, agreement, communication.

Communication is computed from the shapes (``parallel.communication_bytes``):
it does not grow with L. On forced CPU devices (XLA_FLAGS=
--xla_force_host_platform_device_count=8) every "device" shares the same
cores, so the ratio measures the overhead of splitting, not a speed-up; on a
real multi-chip mesh the same command measures the speed-up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from experiments.studies.speed import inputs, median_seconds
from experiments.studies.timing import check_timing
from experiments.train import plotting
from favor_jax import core, parallel


def run(config, progress=print, workdir=None):
  check_timing(config)
  if jax.device_count() < config.devices:
    raise ValueError(f"config.devices={config.devices} but JAX sees {jax.device_count()} device(s); on a CPU run "
                     f"with XLA_FLAGS=--xla_force_host_platform_device_count={config.devices}")
  mesh = jax.make_mesh((config.devices,), ("seq",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:config.devices])
  records = []
  for length in config.seq_lens:
    q, k, v, w = inputs(length, batch=config.batch, heads=config.heads, head_dim=config.head_dim,
                        num_features=config.num_features, dtype=jnp.dtype(config.dtype))
    for causal in config.causal:
      fns = {"single_device": lambda q, k, v, causal=causal: core.favor_attention(q, k, v, w, causal=causal),
             "sequence_parallel": lambda q, k, v, causal=causal: parallel.sequence_parallel_attention(
                 q, k, v, w, mesh=mesh, axis_name="seq", causal=causal)}
      comm = parallel.communication_bytes(config.batch, config.heads, config.num_features, config.head_dim,
                                          config.devices, causal)
      outs = {name: np.asarray(jax.jit(fn)(q, k, v), np.float32) for name, fn in fns.items()}  # agreement
      for name, fn in fns.items():
        split = name == "sequence_parallel"
        for pass_ in config.passes:
          f = fn if pass_ == "fwd" else jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                                                 argnums=(0, 1, 2))
          f = jax.jit(f)
          seconds = median_seconds(f, q, k, v, repeats=config.repeats)
          records.append(dict(method=name, causal=causal, seq_len=length, devices=config.devices if split else 1,
                              num_features=config.num_features, head_dim=config.head_dim, heads=config.heads,
                              batch=config.batch, dtype=config.dtype, **{"pass": pass_}, median_s=seconds,
                              comm_bytes=comm if split else 0))
          progress(f"L={length} causal={causal} {name} {pass_}: {seconds:.3f} s")
      diff = float(np.abs(outs["sequence_parallel"] - outs["single_device"]).max())
      for r in records[-2 * len(config.passes):]:
        r["max_abs_diff_vs_single"] = diff
  return records


def summarize(records, config) -> str:
  lines = [f"# Sequence-parallel FAVOR+ on {config.devices} devices vs one device\n",
           "| L | causal | pass | single device | sequence-parallel | ratio | comm bytes/device | max abs diff |",
           "|---|---|---|---|---|---|---|---|"]
  by = {(r["seq_len"], r["causal"], r["pass"], r["method"]): r for r in records}
  for (length, causal, pass_, method), r in by.items():
    if method != "sequence_parallel":
      continue
    single = by[(length, causal, pass_, "single_device")]
    lines.append(f"| {length} | {causal} | {pass_} | {single['median_s']:.3f} s | {r['median_s']:.3f} s | "
                 f"{r['median_s'] / single['median_s']:.2f}× | {r['comm_bytes']:,} | "
                 f"{r['max_abs_diff_vs_single']:.1e} |")
  lines.append(f"\nCommunication is per device per call, from the shapes; it is independent of L. Devices: "
               f"{sorted({d.device_kind for d in jax.devices()})} ({jax.device_count()} visible).")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir):
  fig, ax = plotting.subplots(figsize=(6, 4))
  for method in ("single_device", "sequence_parallel"):
    for causal in config.causal:
      for pass_ in config.passes:
        rs = [r for r in records if (r["method"], r["causal"], r["pass"]) == (method, causal, pass_)]
        ax.plot([r["seq_len"] for r in rs], [r["median_s"] for r in rs], marker="o",
                ls="-" if method == "single_device" else "--",
                label=f"{method} {'causal' if causal else 'bidir'} {pass_}")
  ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="median seconds",
         title=f"FAVOR+ on 1 vs {config.devices} devices")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=6)
  path = f"{workdir}/sequence_parallel.png"
  return [plotting.save(fig, path)]
