"""Diagnostics of the sharp-attention study (issue 53): each trained run's attention on its own activations.

For a run of ``experiments/configs/sharp.py`` (a training sweep), after training: the q, k, v (after its q/k map)
and forget gates of every layer on the first held-out batch, then

- ``attention_entropy``: the mean entropy (nats) of the exact gated softmax rows those activations give;
- ``peak_logit``: the mean over rows of the largest logit q·k/√d among the keys a row sees (its scale);
- ``peak_pair_sq``: the mean over rows of ‖x + y‖² (x = q·d^{-1/4}, y = k·d^{-1/4}) at the row's heaviest key: one
  positive feature pair's relative variance there is e^{‖x+y‖²} − 1;
- ``own_error``: for a FAVOR run, ‖out − exact‖/‖exact‖ of its own estimator (its projection, window and
  control variate) against the exact gated softmax of the same activations (0 for softmax).

Each averaged over layers. Quadratic in L (the explicit weights): at the training length only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from experiments import tasks
from experiments.train import models
from favor_jax import core
from favor_jax.layers import gates

CAPTURED = ("query", "key", "value", "forget_gate", "qk_map")  # the modules whose outputs are read


def _find(tree, name):
  """The first subtree called ``name`` in a nested dict (depth first), or None."""
  if not isinstance(tree, dict):
    return None
  if name in tree:
    return tree[name]
  for value in tree.values():
    found = _find(value, name)
    if found is not None:
      return found
  return None


@jax.jit  # one program per shape, reused by every layer (op by op: hundreds of small compilations per layer)
def _stats(q, k, log_gate, segment_ids):
  """(entropy, peak logit, ‖x+y‖² at the heaviest key) of the exact gated softmax rows, means over rows."""
  log_w = core.attention_weights(q, k, kernel="softmax", causal=True, log=True, log_gate=log_gate,
                                 segment_ids=segment_ids)  # [B, H, L, L]
  w = jnp.exp(log_w)
  entropy = -jnp.sum(jnp.where(w > 0, w * log_w, 0.0), -1)
  seen = jnp.isfinite(log_w)
  logits = jnp.einsum("blhd,bjhd->bhlj", q, k) / math.sqrt(q.shape[-1])
  peak = jnp.max(jnp.where(seen, logits, -jnp.inf), -1)
  heaviest = jnp.argmax(log_w, -1)  # [B, H, L]
  scale = q.shape[-1] ** -0.25
  k_top = jnp.take_along_axis(jnp.moveaxis(k, 2, 1), heaviest[..., None], axis=2)  # [B, H, L, D]
  pair = jnp.sum(jnp.square(scale * (jnp.moveaxis(q, 2, 1) + k_top)), -1)
  return jnp.mean(entropy), jnp.mean(peak), jnp.mean(pair)


def _own_error(attention, q, k, v, projection, log_gate, segment_ids):
  """‖estimate − exact‖/‖exact‖ of a FAVOR run's own estimator (``attention``: its config) on q, k, v."""
  exact = core.softmax_attention(q, k, v, causal=True, log_gate=log_gate, segment_ids=segment_ids)
  kw = dict(kernel=attention.kernel, causal=True, log_gate=log_gate, segment_ids=segment_ids,
            chunk_size=attention.chunk_size)
  if attention.window:
    estimate = core.hybrid_attention(q, k, v, projection, window=attention.window,
                                     control_variate=attention.get("control_variate", 0.0) or None, **kw)
  else:
    estimate = core.favor_attention(q, k, v, projection, **kw)
  return jnp.linalg.norm(estimate - exact) / jnp.linalg.norm(exact)


def own_activations(config, state) -> dict:
  """The diagnostics above for one finished run (``config`` its training config, ``state`` its final state)."""
  task = tasks.make_task(config)
  model = models.make_model(config, task.vocab_size, task.num_classes, task.max_len)
  batch = task.eval_batches[0]
  packed = {} if batch.segment_ids is None else {"segment_ids": batch.segment_ids}
  variables = {"params": state.params, **({"favor": state.favor} if state.favor else {})}
  _, captured = jax.jit(lambda v, t: model.apply(
      v, t, capture_intermediates=lambda module, method: module.name in CAPTURED, mutable=["intermediates"],
      **packed))(variables, batch.tokens)
  a = config.attention
  # One program per run, reused by every layer (the same shapes), as _stats: called op by op, the causal passes
  # would compile hundreds of small programs per layer.
  own_error = jax.jit(lambda *args: _own_error(a, *args)) if a.type == "favor" else None
  out = dict(attention_entropy=[], peak_logit=[], peak_pair_sq=[], own_error=[])
  for i in range(config.model.num_layers):
    got = captured["intermediates"][f"block_{i}"]["attention"]
    q, k, v = (_find(got, n)["__call__"][0] for n in ("query", "key", "value"))
    if _find(got, "qk_map") is not None:
      q, k = _find(got, "qk_map")["__call__"][0]
    logit = _find(got, "forget_gate")
    log_gate = gates.layer_log_gate(None if logit is None else logit["__call__"][0], False, q.shape[:-1])
    seg = packed.get("segment_ids")
    for name, value in zip(("attention_entropy", "peak_logit", "peak_pair_sq"), _stats(q, k, log_gate, seg)):
      out[name].append(float(value))
    if own_error is None:
      out["own_error"].append(0.0)
      continue
    projection = _find(state.favor, f"block_{i}")
    projection = None if projection is None else _find(projection, "projection")
    out["own_error"].append(float(own_error(q, k, v, projection, log_gate, seg)))
  return {name: float(np.mean(values)) for name, values in out.items()}
