"""Side by side with the PyTorch peer, performer-pytorch's ``FastAttention``.

Every (library, mode, length, pass) runs in its own process, so peak memory
(VmHWM) is that configuration's alone and both libraries get the same CPU
threads. The approximation part feeds both the same inputs and compares each
with exact softmax attention, each drawing its own orthogonal features.
Needs the optional extra ``peers`` (torch CPU + performer-pytorch).
"""

from __future__ import annotations

import math
import os

import numpy as np

from experiments.studies import isolation
from experiments.studies.timing import check_timing, median_of
from experiments.train import plotting

INSTALL_HINT = "pip install -e '.[peers]'  (torch CPU and performer-pytorch)"


def peers_available() -> bool:
  try:
    import performer_pytorch  # noqa: F401
    import torch  # noqa: F401
  except ImportError:
    return False
  return True


def _torch_case(job):
  import torch
  from performer_pytorch import FastAttention

  torch.set_num_threads(job["threads"])
  b, h, length, d = job["batch"], job["heads"], job["seq_len"], job["head_dim"]
  attn = FastAttention(dim_heads=d, nb_features=job["num_features"], causal=job["causal"])
  q, k, v = (torch.randn(b, h, length, d, requires_grad=job["pass"] == "fwd_bwd") for _ in range(3))

  def run():
    if job["pass"] == "fwd":
      with torch.no_grad():
        attn(q, k, v)
    else:
      (attn(q, k, v) ** 2).sum().backward()

  return run


def _jax_case(job):
  import jax
  import jax.numpy as jnp

  from favor_jax import core

  b, h, length, d = job["batch"], job["heads"], job["seq_len"], job["head_dim"]
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(kk, (b, length, h, d)) for kk in ks[:3])
  p = core.orthogonal_projection(ks[3], job["num_features"], d)
  fwd = lambda q, k, v, p: core.favor_attention(q, k, v, p, causal=job["causal"])
  fn = jax.jit(fwd if job["pass"] == "fwd" else jax.grad(
      lambda *a: jnp.sum(fwd(*a) ** 2), argnums=(0, 1, 2))).lower(q, k, v, p).compile()
  return lambda: jax.block_until_ready(fn(q, k, v, p))


def _measure(job):
  """Runs one timing job in this process; returns its record."""
  thunk = (_torch_case if job["library"] == "performer_pytorch" else _jax_case)(job)
  # JAX compiled ahead of time above: its compiler's memory is not the attention's. Runs
  # (warm-up included) start from here for both libraries.
  base = isolation.reset_peak_rss()
  seconds = median_of(thunk, job["repeats"])
  peak = isolation.peak_rss()
  return dict(job, median_s=seconds, peak_rss_bytes=peak, baseline_rss_bytes=base, peak_bytes=peak - base)


def approximation(config):
  """MSE against exact softmax of both libraries on the same inputs, and the peer's causal leak."""
  import jax
  import torch
  from performer_pytorch import FastAttention

  from favor_jax import core

  rng = np.random.default_rng(config.seed)
  b, h, length, d, m = 1, config.heads, config.approx_seq_len, config.head_dim, config.num_features
  q, k, v = (rng.standard_normal((b, length, h, d)).astype(np.float32) * s for s in (0.5, 0.5, 1.0))
  records = []
  for causal in config.causal:
    exact = np.asarray(core.softmax_attention(q, k, v, causal=causal), np.float64)
    ours = [np.asarray(core.favor_attention(q, k, v, core.orthogonal_projection(jax.random.PRNGKey(i), m, d),
                                            causal=causal)) for i in range(config.approx_draws)]
    to_t = lambda x: torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, 1, 2)))
    theirs = []
    for i in range(config.approx_draws):
      torch.manual_seed(i)
      with torch.no_grad():
        out = FastAttention(dim_heads=d, nb_features=m, causal=causal)(to_t(q), to_t(k), to_t(v))
      theirs.append(np.moveaxis(out.numpy(), 1, 2))
    for library, outs in (("favor_jax", ours), ("performer_pytorch", theirs)):
      mse = [float(np.mean((o - exact) ** 2)) for o in outs]
      records.append(dict(kind="approximation", library=library, causal=causal, seq_len=length,
                          num_features=m, head_dim=d, mse=float(np.mean(mse)),
                          mse_ci95=float(1.96 * np.std(mse, ddof=1) / math.sqrt(len(mse)))))
  # Causality: scale one future key ×100; how much do earlier outputs move?
  t = length // 2
  k2 = k.copy()
  k2[:, t + 1] *= 100.0
  w = core.orthogonal_projection(jax.random.PRNGKey(0), m, d)
  ours = [np.asarray(core.favor_attention(q, kk, v, w, causal=True)) for kk in (k, k2)]
  torch.manual_seed(0)
  peer = FastAttention(dim_heads=d, nb_features=m, causal=True)
  with torch.no_grad():
    theirs = [np.moveaxis(peer(to_t(q), to_t(kk), to_t(v)).numpy(), 1, 2) for kk in (k, k2)]
  for library, (a, bb) in (("favor_jax", ours), ("performer_pytorch", theirs)):
    records.append(dict(kind="causal_leak", library=library, seq_len=length, future_key_scale=100.0,
                        max_abs_change_before_t=float(np.max(np.abs(a[:, : t + 1] - bb[:, : t + 1])))))
  return records


def unread(config) -> dict:
  """{field: why}: each mode's lengths when that mode is not compared."""
  modes = tuple(config.causal) if isinstance(config.causal, (tuple, list)) else ()  # a bad one: named in run
  return {**({} if True in modes else {"causal_seq_lens": "True is not in config.causal"}),
          **({} if False in modes else {"seq_lens": "False is not in config.causal"})}


def run(config, progress=print, workdir=None):
  check_timing(config)
  if config.approx_draws < 2:  # an int >= 1 by check_timing
    raise ValueError(f"config.approx_draws must be >= 2 (the mean error's 95% interval needs two draws), got "
                     f"{config.approx_draws}")
  if not peers_available():
    raise SystemExit(f"the peers study needs torch and performer-pytorch: {INSTALL_HINT}")
  records = []
  for causal in config.causal:
    for length in (config.causal_seq_lens if causal else config.seq_lens):
      for pass_ in config.passes:
        for library in ("favor_jax", "performer_pytorch"):
          job = dict(kind="timing", library=library, causal=causal, seq_len=length, batch=config.batch,
                     heads=config.heads, head_dim=config.head_dim, num_features=config.num_features,
                     threads=config.threads or os.cpu_count(), repeats=config.repeats, **{"pass": pass_})
          threads = {"OMP_NUM_THREADS": str(job["threads"])}
          records.append(isolation.spawn("experiments.studies.peers", job, threads))
          progress(f"{library:>17} {'causal' if causal else 'bidir':>6} L={length:<6} {pass_:>7} "
                   f"{records[-1]['median_s']:.4f}s  {records[-1]['peak_bytes'] / 2**20:.0f} MB")
  records += approximation(config)
  return records


def summarize(records, config) -> str:
  lines = ["# favor_jax vs performer-pytorch (CPU)", "",
           f"B={config.batch}, H={config.heads}, D={config.head_dim}, M={config.num_features}, float32, "
           f"{config.threads or os.cpu_count()} threads each, median of {config.repeats}, each case in its "
           "own process; memory = peak RSS over the runs (warm-up included) − RSS before them "
           "(JAX compiled ahead).", "",
           "| mode | L | pass | favor_jax (s) | performer-pytorch (s) | speed-up | memory ratio (ours/theirs) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  timing = {(r["library"], r["causal"], r["seq_len"], r["pass"]): r for r in records if r["kind"] == "timing"}
  for (library, causal, length, pass_), ours in sorted(timing.items()):
    if library != "favor_jax":
      continue
    theirs = timing[("performer_pytorch", causal, length, pass_)]
    lines.append(f"| {'causal' if causal else 'bidirectional'} | {length} | {pass_} | {ours['median_s']:.4f} | "
                 f"{theirs['median_s']:.4f} | {theirs['median_s'] / ours['median_s']:.1f}× | "
                 f"{ours['peak_bytes'] / max(theirs['peak_bytes'], 1):.2f} |")
  lines += ["", "## Approximation on the same inputs (q, k ~ N(0,1)×0.5)", "",
            "| library | causal | MSE vs exact softmax (±95% CI) |", "| --- | --- | --- |"]
  lines += [f"| {r['library']} | {r['causal']} | {r['mse']:.3e} ± {r['mse_ci95']:.1e} |"
            for r in records if r["kind"] == "approximation"]
  lines += ["", "## Causality: one future key ×100", ""]
  lines += [f"- {r['library']}: max |change| of outputs at or before t: {r['max_abs_change_before_t']:.2e}"
            for r in records if r["kind"] == "causal_leak"]
  return "\n".join(lines) + "\n"


def plot(records, config, workdir):
  fig, ax = plotting.subplots(figsize=(6, 4))
  for library in ("favor_jax", "performer_pytorch"):
    for causal in config.causal:
      for pass_ in config.passes:
        pts = sorted((r["seq_len"], r["median_s"]) for r in records if r["kind"] == "timing" and
                     (r["library"], r["causal"], r["pass"]) == (library, causal, pass_))
        ax.plot(*zip(*pts), marker="o", ms=3, label=f"{library} {'causal' if causal else 'bidir'} {pass_}")
  ax.set(xscale="log", yscale="log", xlabel="L", ylabel="time (s)")
  ax.legend(fontsize=6)
  path = f"{workdir}/peers_time.png"
  return [plotting.save(fig, path)]


if __name__ == "__main__":
  isolation.child_main(_measure)
