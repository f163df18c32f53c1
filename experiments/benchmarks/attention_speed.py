"""Times FAVOR+ against exact attention and writes JSON + a plot.

    python -m experiments.benchmarks.attention_speed --out=experiments/results/attention_speed_cpu

Every timing is jitted, takes its arrays as arguments (XLA cannot fold them),
is warmed up once, and reports the median of ``--repeats`` runs. Memory is the
compiled program's temporary buffers (XLA's own accounting), plus the peak RSS
of a separate process for the causal fwd+bwd case.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from experiments.timing import median_of
from favor_jax import core


def median_seconds(fn, *args, repeats: int = 5) -> float:
  return median_of(lambda: jax.block_until_ready(fn(*args)), repeats)


def temp_bytes(fn, *args) -> int:
  return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def inputs(seq_len, *, batch=1, heads=8, head_dim=64, num_features=256, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, k, v = (jax.random.normal(kk, (batch, seq_len, heads, head_dim), dtype) for kk in ks[:3])
  return q, k, v, core.orthogonal_projection(ks[3], num_features, head_dim)


METHODS = {
    "softmax": lambda causal: jax.jit(
        lambda q, k, v, p: core.softmax_attention(q, k, v, causal=causal)),
    "jax_dot_product_attention": lambda causal: jax.jit(
        lambda q, k, v, p: jax.nn.dot_product_attention(q, k, v, is_causal=causal)),
    "favor_chunked": lambda causal: jax.jit(
        lambda q, k, v, p: core.favor_attention(q, k, v, p, causal=causal)),
    "favor_scan": lambda causal: jax.jit(
        lambda q, k, v, p: core.favor_attention(q, k, v, p, causal=causal, causal_method="scan")),
}


def fwd_bwd(fn):
  return jax.jit(jax.grad(lambda q, k, v, p: jnp.sum(fn(q, k, v, p).astype(jnp.float32) ** 2),
                          argnums=(0, 1, 2)))


def peak_rss_child(seq_len: int) -> int:
  """Peak RSS (bytes) of a fresh process running causal FAVOR+ fwd+bwd at ``seq_len``."""
  code = (
      "import jax\n"
      "from experiments.benchmarks.attention_speed import inputs, fwd_bwd, METHODS\n"
      f"q, k, v, p = inputs({seq_len})\n"
      "jax.block_until_ready(fwd_bwd(METHODS['favor_chunked'](True))(q, k, v, p))\n"
      # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork/exec.
      "print(int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return int(out.stdout.strip().splitlines()[-1])


def run(seq_lens, exact_max_len, memory_len, repeats):
  records = []
  for seq_len in seq_lens:
    args = inputs(seq_len)
    for name, make in METHODS.items():
      for causal in (False, True):
        if name == "favor_scan" and (not causal or seq_len > 16384):
          continue  # the per-token scan is causal only, and slow at long L
        if name in ("softmax", "jax_dot_product_attention") and seq_len > exact_max_len:
          continue
        fn = make(causal)
        rec = dict(method=name, causal=causal, seq_len=seq_len, batch=1, heads=8, head_dim=64,
                   num_features=256, dtype="float32", **{"pass": "fwd"})
        rec["median_s"] = median_seconds(fn, *args, repeats=repeats)
        rec["temp_bytes"] = temp_bytes(fn, *args)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    grad_fn = fwd_bwd(METHODS["favor_chunked"](True))
    rec = dict(method="favor_chunked", causal=True, seq_len=seq_len, **{"pass": "fwd_bwd"},
               median_s=median_seconds(grad_fn, *args, repeats=repeats),
               temp_bytes=temp_bytes(grad_fn, *args))
    records.append(rec)
    print(json.dumps(rec), flush=True)
  if memory_len:
    grad_fn = fwd_bwd(METHODS["favor_chunked"](True))
    args = inputs(memory_len)
    records.append(dict(method="favor_chunked", causal=True, seq_len=memory_len, **{"pass": "fwd_bwd"},
                        median_s=median_seconds(grad_fn, *args, repeats=1),
                        temp_bytes=temp_bytes(grad_fn, *args), peak_rss_bytes=peak_rss_child(memory_len)))
    print(json.dumps(records[-1]), flush=True)
  return records


def ratios(records):
  """Speed-ups measured in this run: exact/FAVOR bidirectional, and causal/bidirectional FAVOR."""
  t = {(r["method"], r["causal"], r["seq_len"], r["pass"]): r["median_s"] for r in records}
  out = {}
  for (method, causal, seq_len, p), sec in t.items():
    bi = t.get(("favor_chunked", False, seq_len, "fwd"))
    if bi and p == "fwd" and method in ("softmax", "jax_dot_product_attention") and not causal:
      out[f"{method}_over_favor_bidirectional@{seq_len}"] = sec / bi
    if bi and p == "fwd" and method == "favor_chunked" and causal:
      out[f"favor_causal_over_bidirectional@{seq_len}"] = sec / bi
    if p == "fwd" and method == "favor_scan":
      out[f"favor_scan_over_chunked_causal@{seq_len}"] = sec / t[("favor_chunked", True, seq_len, "fwd")]
  return out


def plot(records, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for (method, causal) in sorted({(r["method"], r["causal"]) for r in records if r["pass"] == "fwd"}):
    pts = sorted((r["seq_len"], r["median_s"]) for r in records
                 if r["method"] == method and r["causal"] == causal and r["pass"] == "fwd")
    ax.plot(*zip(*pts), marker="o", label=f"{method} {'causal' if causal else 'bidir'}")
  ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="forward time (s)",
         title="B=1, H=8, D=64, M=256, float32")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="workdir/attention_speed", help="output directory")
  parser.add_argument("--seq-lens", default="1024,4096,8192,16384", help="comma-separated lengths")
  parser.add_argument("--exact-max-len", type=int, default=16384, help="longest L for exact attention")
  parser.add_argument("--memory-len", type=int, default=65536, help="L of the fwd+bwd memory check (0: skip)")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  records = run([int(x) for x in args.seq_lens.split(",")], args.exact_max_len, args.memory_len,
                args.repeats)
  meta = dict(date=time.strftime("%Y-%m-%d"), machine=platform.platform(), cpu_count=os.cpu_count(),
              jax=jax.__version__, backend=jax.default_backend(),
              devices=[d.device_kind for d in jax.devices()],
              command="python -m experiments.benchmarks.attention_speed " + " ".join(argv or sys.argv[1:]))
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(dict(meta=meta, ratios=ratios(records), records=records), f, indent=1)
  plot(records, os.path.join(args.out, "attention_speed.png"))
  print(json.dumps(ratios(records), indent=1))


if __name__ == "__main__":
  main()
