"""The chunk size of causal FAVOR+ on the machine at hand, through ``favor_attention`` itself: the XLA chunked
pass and ``causal_method="pallas"`` (on a TPU the fused Mosaic kernels, on a GPU Triton's, elsewhere Pallas's
interpreter), each chunk timed forward and forward + backward at each L. ``experiments/tpu_check.sh`` runs it
(the GPU's launch sweep, with Triton's warps and feature blocks, is ``experiments/blocks.py``).

    python -m experiments.studies.tpu_blocks --out workdir/tpu/blocks --lens 4096,16384 --chunks 64,128,256,512
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib

import jax
import jax.numpy as jnp

from experiments.studies import speed
from favor_jax import core


def time_one(method, chunk, length, passes, *, heads, head_dim, num_features, dtype, repeats):
  """One record: median seconds (or the error's first line) of FAVOR+ causal by ``method`` at this chunk."""
  q, k, v, p = speed.inputs(length, heads=heads, head_dim=head_dim, num_features=num_features,
                            dtype=jnp.dtype(dtype), seed=length)
  fwd = functools.partial(core.favor_attention, causal=True, causal_method=method, chunk_size=chunk)
  fn = fwd if passes == "fwd" else jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
  rec = dict(method=method, chunk=chunk, seq_len=length, passes=passes, heads=heads, head_dim=head_dim,
             num_features=num_features, dtype=dtype, backend=jax.default_backend())
  try:
    compiled = jax.jit(fn).lower(q, k, v, p).compile()
    return dict(rec, median_s=speed.median_seconds(compiled, q, k, v, p, repeats=repeats), status="ok")
  except Exception as e:  # noqa: BLE001 — a configuration that cannot run is a result of the sweep
    return dict(rec, status="error", error=str(e).splitlines()[0][:300])


def summary(records) -> str:
  lines = ["# Chunk sizes of causal FAVOR+ (favor_attention)", "", f"backend: {records[0]['backend']}; "
           f"H={records[0]['heads']} D={records[0]['head_dim']} M={records[0]['num_features']} {records[0]['dtype']}",
           "", "| method | L | pass | chunk | time (ms) |", "| --- | --- | --- | --- | --- |"]
  for r in records:
    t = f"{1e3 * r['median_s']:.3f}" if r["status"] == "ok" else r["error"]
    lines.append(f"| {r['method']} | {r['seq_len']} | {r['passes']} | {r['chunk']} | {t} |")
  best = {}
  for r in records:
    key = (r["method"], r["seq_len"], r["passes"])
    if r["status"] == "ok" and (key not in best or r["median_s"] < best[key]["median_s"]):
      best[key] = r
  lines += ["", "Fastest chunk:", ""] + [f"- {m} L={n} {ps}: {r['chunk']}" for (m, n, ps), r in sorted(best.items())]
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ints = lambda s: tuple(int(x) for x in s.split(","))
  parser.add_argument("--out", required=True, help="directory for results.json and summary.md")
  parser.add_argument("--lens", type=ints, default=(4096, 16384), help="L, comma-separated")
  parser.add_argument("--chunks", type=ints, default=(64, 128, 256, 512), help="chunk sizes (powers of two >= 16)")
  parser.add_argument("--methods", default="chunked,pallas", help="causal methods, comma-separated")
  parser.add_argument("--passes", default="fwd,fwd_bwd", help="fwd and/or fwd_bwd")
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--num_features", type=int, default=256)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  for name in args.passes.split(","):
    if name not in ("fwd", "fwd_bwd"):
      raise ValueError(f"--passes takes fwd and fwd_bwd, got {name!r}")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  records = []
  for length in args.lens:
    for method in args.methods.split(","):
      for passes in args.passes.split(","):
        for chunk in args.chunks:
          records.append(time_one(method, chunk, length, passes, heads=args.heads, head_dim=args.head_dim,
                                  num_features=args.num_features, dtype=args.dtype, repeats=args.repeats))
          print(json.dumps(records[-1]), flush=True)
  (out / "results.json").write_text(json.dumps(records, indent=1))
  (out / "summary.md").write_text(summary(records))
  print(summary(records))


if __name__ == "__main__":
  main()
