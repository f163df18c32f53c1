"""The speed study's figure: time and memory against sequence length (``experiments.studies.speed``)."""

from experiments.train import plotting

STATUS_WORDS = {"out_of_memory": "out of memory", "skipped_too_slow": "skipped as too slow"}
PASS_STYLE = {"fwd": dict(linestyle="-", marker="o"), "fwd_bwd": dict(linestyle="--", marker="s")}


def _not_shown(records) -> list[str]:
  """Which points are missing and why, one line per method, e.g.
  "softmax: out of memory (fwd from L=64k, fwd+bwd from L=16k)"."""
  first = {}
  for r in records:
    if r["status"] != "ok":
      key = (r["method"], STATUS_WORDS.get(r["status"], r["status"]), r["pass"].replace("_", "+"))
      first[key] = min(first.get(key, r["seq_len"]), r["seq_len"])
  lines = {}
  for (name, status, pass_), length in sorted(first.items()):
    lines.setdefault((name, status), []).append(f"{pass_} from L={plotting.short_number(length)}")
  return [f"{name}: {status} ({', '.join(where)})" for (name, status), where in lines.items()]


def plot(records, config, workdir):
  """Time and memory against L: a row for each of bidirectional and causal the run timed, colour = method, line
  style = pass."""
  import matplotlib.lines as mlines
  modes = [causal for causal in (False, True) if causal in tuple(config.causal)]  # a row per mode the run timed
  fig, axes = plotting.subplots(len(modes), 2, figsize=(11, 3.5 * len(modes) + 0.5), sharex=True, squeeze=False)
  color = dict(zip(config.methods, plotting.distinct_colors(len(config.methods))))
  memory = "peak memory, own process (MB)" if config.memory == "process" else "compiled memory (MB)"
  for row, causal in enumerate(modes):
    for name in config.methods:
      for pass_ in config.passes:
        pts = sorted((r["seq_len"], r) for r in records if (r["method"], r["causal"], r["pass"]) ==
                     (name, causal, pass_) and r["status"] == "ok")
        if not pts:
          continue
        lengths = [x for x, _ in pts]
        behind = len(config.methods) - 1 - config.methods.index(name)  # wider underneath: equal values show
        style = dict(color=color[name], lw=1.2 + 0.4 * behind, ms=3 + behind, **PASS_STYLE[pass_])
        axes[row][0].plot(lengths, [r["median_s"] for _, r in pts], **style)
        axes[row][1].plot(lengths, [r["peak_bytes"] / 2**20 for _, r in pts], **style)
    mode = "causal" if causal else "bidirectional"
    for ax, what in zip(axes[row], ("time (s)", memory)):
      ax.set(title=f"{mode}: {what.split(' (')[0]}", ylabel=what)
      plotting.log2_ticks(ax, config.seq_lens)
      plotting.plain_log(ax)
      ax.grid(alpha=0.3)
  for ax in axes[-1]:
    ax.set_xlabel("sequence length L")
  handles = [mlines.Line2D([], [], color=color[m], label=m) for m in config.methods]
  handles += [mlines.Line2D([], [], color="black", label="fwd+bwd" if p == "fwd_bwd" else p, **PASS_STYLE[p])
              for p in config.passes]
  plotting.legend_right(fig, handles, [h.get_label() for h in handles])
  fig.suptitle(f"B={config.batch} H={config.heads} D={config.head_dim} M={config.num_features} {config.dtype}")
  missing = _not_shown(records)
  if missing:
    fig.text(0.01, 0, "Not shown: " + "; ".join(missing), fontsize=8, va="top", wrap=True)
  path = f"{workdir}/speed_memory_vs_length.png"
  return [plotting.save(fig, path)]
