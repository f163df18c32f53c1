"""The one place a layer calls into core (or the sequence-parallel pass) for its attention."""

from __future__ import annotations

from favor_jax import core, parallel
from favor_jax.layers import gates, statistic
from favor_jax.layers.settings import FavorSettings, is_data_dependent


def attend(query, key, value, projection, settings: FavorSettings, *, causal: bool | None = None, key_mask=None,
           query_mask=None, rho=None, log_gate=None, segment_ids=None):
  """Attention of a layer of ``settings`` (checked when they were built, so nothing is checked again here).

  ``core.favor_attention``, or ``core.hybrid_attention`` (exact softmax within ``settings.window``) if the
  window is > 0, or with ``settings.sequence_axis`` ``parallel.sequence_parallel_attention`` over
  ``settings.mesh`` (a data-dependent kernel's statistic, if ``rho`` is not given, from the whole batch and
  sequence: XLA reduces it across devices).

  Args:
    query, key, value: [..., L, H, D] (value [..., L, H, Dv]).
    projection: the layer's projection, learned map, or None.
    settings: the layer's settings.
    causal: this call's direction (None: ``settings.causal``; ``make_attention_fn`` reads NNX's ``is_causal``).
    key_mask, query_mask: [..., L] padding (False: padded).
    rho: a data-dependent kernel's statistic (None: computed from this batch).
    log_gate: [..., L, H] the layer's log forget gate (``layers.gates.layer_log_gate``; None: ungated).
    segment_ids: [..., L] packed documents (a segment is a run of equal consecutive ids).

  Returns:
    [..., L, H, Dv].
  """
  causal = settings.causal if causal is None else causal
  kwargs = dict(kernel=settings.kernel, causal=causal, key_mask=key_mask, rho=rho, chunk_size=settings.chunk_size,
                precision=settings.precision)
  kwargs.update(gates.gate_kwargs(log_gate, segment_ids))
  if settings.sequence_axis is not None:
    if rho is None and is_data_dependent(settings.kernel):
      kwargs["rho"] = statistic.statistic_of(settings.kernel, query, key, key_mask, query_mask, settings.precision)
    return parallel.sequence_parallel_attention(query, key, value, projection, mesh=settings.mesh,
                                                axis_name=settings.sequence_axis, batch_axis=settings.batch_axis,
                                                **kwargs)
  if settings.window:
    return core.hybrid_attention(query, key, value, projection, window=settings.window, query_mask=query_mask,
                                 control_variate=settings.control_variate, **kwargs)
  return core.favor_attention(query, key, value, projection, causal_method=settings.causal_method,
                              query_mask=query_mask, **kwargs)
