"""Decode speed: FAVOR+'s constant-size state against softmax's key-value cache, after prompts of growing length.

One causal LM (``config.model``), decoding with FAVOR+ layers (their constant-size state) and with softmax
attention (a key-value cache), at the same size. After a prompt of L tokens, the median wall-clock time of one
decode step (one token per sequence) over ``config.repeats`` steps, tokens/s, and the bytes of the decode state
per sequence (every layer's cache collection). FAVOR's state comes from a real prefill of the prompt (in calls of
``config.prefill_chunk`` tokens, timed); softmax's cache is filled with random keys and values and its index set
to L without a prefill: a step reads every cached key and value whatever they hold, so its time depends on the
cache's length, not its content.

``config.kv_heads`` (e.g. ``(1, 2, 4)``, the ``:gqa`` config): each case is run once per number of key/value heads
(grouped-query attention, ``model.num_kv_heads``): softmax caches the key/value heads only; FAVOR+ (ungated, one
projection shared by the heads) keeps one state per key/value head, which the group's query heads read.
"""

from __future__ import annotations

import copy
import os
import time

import jax
import jax.numpy as jnp

from experiments.studies.timing import median_of
from experiments.train import generation, models, plotting

VOCAB = 256  # bytes
TYPES = ("favor", "softmax")


def check(config) -> None:
  """The study's own fields, each named when bad, before anything is compiled."""
  lens = config.prompt_lens
  if isinstance(lens, (str, int)) or not lens or not all(isinstance(n, int) and n >= 1 for n in lens):
    raise ValueError(f"config.prompt_lens must be a tuple of one or more ints >= 1, got {lens!r}")
  types = config.types
  if isinstance(types, str) or not types or any(t not in TYPES for t in types):
    raise ValueError(f"config.types must be a tuple of one or more of {TYPES}, got {types!r}")
  for name in ("batch", "repeats", "prefill_chunk"):
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"config.{name} must be an int >= 1, got {value!r}")
  kv_heads, heads = config.get("kv_heads", ()), config.model.num_heads
  if isinstance(kv_heads, (str, int)) or not all(
      isinstance(n, int) and not isinstance(n, bool) and n >= 1 and heads % n == 0 for n in kv_heads):
    raise ValueError(f"config.kv_heads must be a tuple of ints dividing model.num_heads={heads} (empty: "
                     f"model.num_kv_heads as set), got {kv_heads!r}")


def _typed(config, attention_type, kv_heads=None):
  c = copy.deepcopy(config)
  c.attention.type = attention_type
  if kv_heads is not None:
    c.model.num_kv_heads = 0 if kv_heads == c.model.num_heads else kv_heads
  return c


def _bytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _synthetic_cache(cache, length, key):
  """Softmax's cache as after ``length`` tokens: random keys and values in the first ``length`` slots, index L."""
  def fill(path, x):
    name = path[-1].key
    if name == "index":
      return jnp.full_like(x, length)
    if name in ("keys", "values"):
      return jax.random.normal(jax.random.fold_in(key, hash(jax.tree_util.keystr(path)) % 2**31), x.shape, x.dtype)
    return x
  return jax.tree_util.tree_map_with_path(fill, cache)


def _prefill(model, variables, cache, tokens_BL, chunk):
  """FAVOR's state after ``tokens_BL``, fed in calls of ``chunk`` tokens (the last call takes the remainder)."""
  for start in range(0, tokens_BL.shape[1], chunk):
    _, cache = generation.decode_step(model, variables, cache, tokens_BL[:, start:start + chunk])
  return jax.block_until_ready(cache)


def run(config, progress=print, workdir=None) -> list[dict]:
  check(config)
  key = jax.random.PRNGKey(config.seed)
  records = []
  cases = [(t, n) for t in config.types for n in (config.get("kv_heads", ()) or (None,))]
  for attention_type, kv_heads in cases:
    c = _typed(config, attention_type, kv_heads)
    favor = attention_type == "favor"
    num_kv_heads = c.model.get("num_kv_heads", 0) or c.model.num_heads
    init_model = models.make_model(c, VOCAB, 0, 1, decode=True, cache_len=1)
    variables = jax.jit(init_model.init)(key, jnp.zeros((config.batch, 1), jnp.int32))
    variables = {"params": variables["params"], "favor": variables.get("favor", {})}
    params_bytes = _bytes(variables["params"])
    longest = max(config.prompt_lens) + config.repeats + 2  # the model's max_len: one FAVOR+ decoder for every L
    for length in config.prompt_lens:
      cache_len = length + config.repeats + 2  # softmax: the prompt, the warm-up step and the timed steps
      model = models.make_model(c, VOCAB, 0, longest, decode=True, cache_len=0 if favor else cache_len)
      tokens = jax.random.randint(jax.random.fold_in(key, length), (config.batch, length + 1), 0, VOCAB)
      prefill_s = None
      if favor:
        chunk = min(config.prefill_chunk, length)
        _prefill(model, variables, generation.empty_cache(model, config.batch), tokens[:, :chunk], chunk)  # compile
        start = time.perf_counter()
        cache = _prefill(model, variables, generation.empty_cache(model, config.batch), tokens[:, :length], chunk)
        prefill_s = time.perf_counter() - start
      else:
        cache = _synthetic_cache(generation.empty_cache(model, config.batch), length, key)
      state_bytes = _bytes(cache) // config.batch
      holder = [cache]
      token = tokens[:, length:length + 1]

      def step():
        logits, holder[0] = generation.decode_step(model, variables, holder[0], token)
        jax.block_until_ready(logits)

      load = os.getloadavg()[0]  # the machine's 1-minute load: other processes share the cores
      seconds = median_of(step, config.repeats)
      del holder[0]
      records.append(dict(attention=attention_type, prompt_len=length, per_token_ms=1e3 * seconds,
                          tokens_per_s=config.batch / seconds, state_bytes_per_sequence=state_bytes,
                          prefill_s=prefill_s, filled="prefill" if favor else "synthetic", batch=config.batch,
                          repeats=config.repeats, params_bytes=params_bytes, d_model=c.model.d_model,
                          num_layers=c.model.num_layers, num_heads=c.model.num_heads, num_kv_heads=num_kv_heads,
                          num_features=c.attention.num_features if favor else None, load_1min=load))
      progress(f"{attention_type} L={length} Hkv={num_kv_heads}: {1e3 * seconds:.2f} ms/token, state "
               f"{state_bytes / 2**20:.2f} MiB"
               + (f", prefill {prefill_s:.1f} s" if favor else " (cache filled without a prefill)"))
  return records


def _mib(n) -> str:
  return f"{n / 2**20:,.2f} MiB" if n >= 2**16 else f"{n / 2**10:,.1f} KiB"


def _summarize_gqa(records, config) -> str:
  """The grouped-query table: per attention and key/value heads, the state's bytes and the per-token time."""
  m = config.model
  lines = ["# Decode state per key/value head: grouped-query attention\n",
           f"Model: {m.num_layers} layers × d_model {m.d_model}, {m.num_heads} heads, MLP {m.mlp_dim}, byte "
           f"vocabulary, rotary positions; FAVOR+ positive kernel, M={config.attention.num_features}, one projection "
           f"shared by the heads, ungated; batch {config.batch}; median of {config.repeats} decode steps after the "
           "prompt.\n",
           "| attention | prompt L | key/value heads | state per sequence | state / all heads' | ms/token | tokens/s |",
           "|---|---|---|---|---|---|---|"]
  full = {(r["attention"], r["prompt_len"]): r["state_bytes_per_sequence"] for r in records
          if r["num_kv_heads"] == r["num_heads"]}
  for r in sorted(records, key=lambda r: (r["attention"], r["prompt_len"], r["num_kv_heads"])):
    ref = full.get((r["attention"], r["prompt_len"]))
    share = f"{r['state_bytes_per_sequence'] / ref:.3f}" if ref else "–"
    lines.append(f"| {'FAVOR+' if r['attention'] == 'favor' else 'softmax'} | {r['prompt_len']:,} | "
                 f"{r['num_kv_heads']} of {r['num_heads']} | {_mib(r['state_bytes_per_sequence'])} | {share} | "
                 f"{r['per_token_ms']:.2f} | {r['tokens_per_s']:.1f} |")
  lines.append("\nState: bytes per sequence of every layer's decode cache. FAVOR+ keeps one state (S, its running "
               "maximum) per key/value head, read by the group's query heads (exact: the keys' features do not "
               "depend on the query head), plus each layer's last segment id; softmax caches the key/value heads' "
               "keys and values. FAVOR+'s state comes from a real prefill of the prompt; softmax's cache is filled "
               "with random keys and values (see the main study).")
  loads = [r["load_1min"] for r in records]
  lines.append(f"\nThe machine's 1-minute load average while timing: {min(loads):.1f} to {max(loads):.1f} on "
               f"{os.cpu_count()} cores (a shared machine: absolute times are inflated).")
  return "\n".join(lines) + "\n"


def summarize(records, config) -> str:
  if config.get("kv_heads", ()):
    return _summarize_gqa(records, config)
  by = {(r["attention"], r["prompt_len"]): r for r in records}
  m = config.model
  lines = ["# Decode speed: FAVOR+ state vs softmax key-value cache\n",
           f"Model: {m.num_layers} layers × d_model {m.d_model}, {m.num_heads} heads, MLP {m.mlp_dim}, byte "
           f"vocabulary, rotary positions; FAVOR+ positive kernel, M={config.attention.num_features}; batch "
           f"{config.batch}; median of {config.repeats} decode steps after the prompt.\n",
           "| prompt L | FAVOR+ ms/token | softmax ms/token | softmax / FAVOR+ | FAVOR+ tokens/s | softmax tokens/s "
           "| FAVOR+ state | softmax cache | cache / state | FAVOR+ prefill |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for length in config.prompt_lens:
    f, s = by.get(("favor", length)), by.get(("softmax", length))
    cell = lambda r, k, fmt: fmt.format(r[k]) if r else "–"
    ratio = lambda a, b: f"{a / b:.2f}×" if f and s else "–"
    lines.append(
        f"| {length:,} | {cell(f, 'per_token_ms', '{:.2f}')} | {cell(s, 'per_token_ms', '{:.2f}')} | "
        f"{ratio(s and s['per_token_ms'], f and f['per_token_ms'])} | {cell(f, 'tokens_per_s', '{:.1f}')} | "
        f"{cell(s, 'tokens_per_s', '{:.1f}')} | {_mib(f['state_bytes_per_sequence']) if f else '–'} | "
        f"{_mib(s['state_bytes_per_sequence']) if s else '–'} | "
        f"{ratio(s and s['state_bytes_per_sequence'], f and f['state_bytes_per_sequence'])} | "
        f"{cell(f, 'prefill_s', '{:.1f} s')} |")
  lines.append("\nState: bytes per sequence of every layer's decode cache (FAVOR+: the recurrent state and running "
               "maximum per head, the same at every L; softmax: keys and values per layer, float32, for L + "
               f"{config.repeats + 2} positions, the prompt's and the decoded tokens'). FAVOR+'s "
               "state comes from a real prefill of the prompt (random bytes, in calls of "
               f"{config.prefill_chunk} tokens). Softmax's cache is filled with random keys and values and its "
               "index set to L without a prefill: a decode step reads every cached key and value whatever they "
               "hold, so its time depends on the cache's length, not its content.")
  loads = [r["load_1min"] for r in records]
  lines.append(f"\nThe machine's 1-minute load average while timing: {min(loads):.1f} to {max(loads):.1f} on "
               f"{os.cpu_count()} cores (a shared machine: absolute times are inflated, both attentions alike).")
  return "\n".join(lines) + "\n"


def plot(records, config, workdir) -> list[str]:
  """decode.png (latency and state against the prompt length) or, for the ``kv_heads`` sweep, decode_gqa.png
  (the same against the number of key/value heads)."""
  if config.get("kv_heads", ()):
    lengths = ", ".join(f"{n:,}" for n in config.prompt_lens)
    return _plot(records, config, f"{workdir}/decode_gqa.png", "num_kv_heads", "key/value heads", f" (L = {lengths})")
  return _plot(records, config, f"{workdir}/decode.png", "prompt_len", "prompt length L (tokens)", "")


def _plot(records, config, path, x, xlabel, latency_note) -> list[str]:
  """Per-token latency and state per sequence of each attention type against the records' field ``x``."""
  fig, (ax_t, ax_m) = plotting.subplots(1, 2, figsize=(10, 4))
  for attention_type in config.types:
    rs = sorted((r for r in records if r["attention"] == attention_type), key=lambda r: r[x])
    label = {"favor": "FAVOR+ state", "softmax": "softmax KV cache"}[attention_type]
    xs = [r[x] for r in rs]
    ax_t.plot(xs, [r["per_token_ms"] for r in rs], marker="o", label=label)
    ax_m.plot(xs, [r["state_bytes_per_sequence"] / 2**20 for r in rs], marker="o", label=label)
  ax_t.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="ms per decoded token",
           title=f"Per-token decode latency{latency_note}")
  ax_m.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="MiB per sequence", title="Decode state memory")
  for ax in (ax_t, ax_m):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  return [plotting.save(fig, path)]
