"""Distillation losses: fitting a learned feature map (and a per-head decay) to a softmax layer's attention,
by the weights' cross-entropy (Hedgehog) or the outputs' squared error (LoLCATs' attention transfer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from favor_jax import core

OBJECTIVES = ("cross_entropy", "output_mse")  # distillation_loss's objective


def distillation_loss(
    query: Float[Array, "... L H D"],
    key: Float[Array, "... L H D"],
    feature_map: Float[Array, "M D"] | Float[Array, "H M D"],
    *,
    kernel="hedgehog",
    causal: bool = False,
    key_mask: Bool[Array, "... L"] | None = None,
    query_mask: Bool[Array, "... L"] | None = None,
    rho: Float[Array, "... H"] | Float[Array, "... H D+1"] | None = None,
    precision: jax.lax.PrecisionLike = None,
    objective: str = "cross_entropy",
    value: Float[Array, "... L H Dv"] | None = None,
    log_decay: Float[Array, " H"] | None = None,
    window: int = 0,
) -> Float[Array, ""]:
  """Computes a distillation loss of the kernel's attention against softmax's: weights' cross-entropy or outputs' MSE.

  .. code-block:: text

     A = core.attention_weights(query, key, feature_map, kernel=kernel, window=window,
                                log_gate=log_decay broadcast over positions)   (the student)
     cross_entropy: loss = −mean over rows (batch, head, query) of Σ_j softmax_ij · log A_ij     (Hedgehog)
     output_mse:    loss = mean over rows (batch, query, head) of ‖(A v)_i − (softmax v)_i‖²    (LoLCATs)

  over the rows that see at least one key and whose query is not padding; softmax is the teacher's
  softmax(q kᵀ/√d), ungated. ``log_decay`` (causal only): a learned per-head decay, the student's constant
  log forget gate log f_h ≤ 0 (the pair (t, j) is weighed by e^{(t − j)·log f_h} besides its kernel; a positive
  value gives NaN, as any positive log gate: parametrise it as −softplus(θ_h)); it gets a gradient, as
  ``feature_map`` does.
  ``output_mse`` needs ``value`` (held fixed, as query and key). ``query`` and ``key`` (a trained
  softmax layer's, on real inputs: NNX ``layer.query(x)``, ``layer.key(x)``; Linen
  ``apply(..., capture_intermediates=True)``) are held fixed: only ``feature_map`` gets a gradient, so
  ``jax.grad`` with respect to it drives a plain optax loop; the fitted map is then the hedgehog layer's
  ``feature_map`` parameter. The loss minus softmax's entropy is the mean KL divergence, ≥ 0, 0 when the
  weights match. log A is taken in log domain (a weight below float32's range keeps its log).
  Both sides are taken in log domain (softmax's too), so a teacher weight below float32's range still
  counts: where the student gives a key weight exactly 0 and the teacher does not, the loss is +inf, as in
  float64. Non-finite inputs follow the rule of every attention function: a non-finite query, or an unmasked
  non-finite key a row may see, makes that row's cross-entropy NaN, and so the loss (its gradient then NaN
  too); a padded query or a masked key is absent whatever it holds.

  Args:
    query: queries, shape [..., L, H, D] (held fixed).
    key: keys, shape [..., L, H, D] (held fixed).
    feature_map: the map being fitted, [M, D] or [H, M, D] (a hedgehog layer's ``feature_map``).
    kernel: a name in ``core.KERNELS`` or a :class:`~favor_jax.core.kernels.Kernel` record whose weights are positive
      (not ``"softmax"``).
    causal: whether query t sees only keys j ≤ t.
    key_mask: optional bool [..., L]; False leaves a key out.
    query_mask: optional bool [..., L]; False leaves a query (padding) out of the mean and of a
      data-dependent kernel's statistic, whatever it holds.
    rho: a data-dependent kernel's statistic, as in :func:`~favor_jax.core.attention_weights`.
    precision: the precision of every dot product, forward and backward, as in
      :func:`~favor_jax.core.favor_attention` (both sides' weights).
    objective: ``"cross_entropy"`` (the weights', Hedgehog's) or ``"output_mse"`` (the outputs' squared error,
      LoLCATs' attention transfer).
    value: values [..., L, H, Dv] (held fixed); ``output_mse`` only, which needs them.
    log_decay: optional [H], the student's learned per-head log forget gate (≤ 0), causal only.
    window: W ≥ 0, the student's exact window (:func:`~favor_jax.core.hybrid_attention`'s).

  Returns:
    The loss, a float32 scalar.

  Raises:
    ValueError: if ``kernel`` is ``"softmax"``, unknown, or a record whose weights can be 0 or negative
      (``relu``, ``trigonometric``), ``objective`` is not one of ``OBJECTIVES``, ``value`` is missing for
      ``output_mse`` (or given for ``cross_entropy``), ``log_decay`` is not of shape [H] or given without
      ``causal``, or as :func:`~favor_jax.core.attention_weights` raises.
    TypeError: if ``query_mask`` is not bool, or as :func:`~favor_jax.core.attention_weights` raises.

  References:
    Zhang et al. 2024, "The Hedgehog & the Porcupine: Expressive Linear Attentions with Softmax Mimicry"
    (ICLR).
    Zhang et al. 2025, "LoLCATs: On Low-Rank Linearizing of Large Language Models" (ICLR).
  """
  if objective not in OBJECTIVES:
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
  if (value is None) == (objective == "output_mse"):
    raise ValueError(f"objective={objective!r} {'needs' if value is None else 'takes no'} value (the outputs' "
                     "squared error compares A v with softmax's; the cross-entropy compares weights only)")
  log_gate = None
  if log_decay is not None:
    if jnp.shape(log_decay) != query.shape[-2:-1]:
      raise ValueError(f"log_decay must have shape [H] = {query.shape[-2:-1]}, got {jnp.shape(log_decay)}")
    if not causal:
      raise ValueError("log_decay is a forget gate: it needs causal=True (bidirectional attention has no before)")
    log_gate = jnp.broadcast_to(log_decay, query.shape[:-1])
  if kernel == "softmax":
    raise ValueError("kernel must be a feature map to fit to softmax, got 'softmax'")
  record = core.get_kernel(kernel)
  if isinstance(record, core.kernels.Kernel) and not record.positive_weights:
    raise ValueError(f"kernel {record.name!r} has weights that can be 0 or negative, where the cross-entropy "
                     "against softmax is infinite or undefined: distil a kernel with positive weights")
  core.checks.check_key_mask(query_mask, query.shape, "query_mask")
  query, key = jax.lax.stop_gradient(query), jax.lax.stop_gradient(key)
  if query_mask is not None:  # a padded query's values (NaN included) reach neither the loss nor its gradient
    query = jnp.where(query_mask[..., None, None], query, jnp.zeros((), query.dtype))
  log_target = jax.lax.stop_gradient(
      core.attention_weights(query, key, kernel="softmax", causal=causal, key_mask=key_mask, log=True,
                             precision=precision))
  log_weights = core.attention_weights(query, key, feature_map, kernel=kernel, causal=causal, key_mask=key_mask,
                                       rho=rho, query_mask=query_mask, log=True, precision=precision,
                                       window=window, log_gate=log_gate)
  rows = jnp.any(~jnp.isneginf(log_target), axis=-1)  # [..., H, L]: sees a key (a NaN row included: NaN loss)
  if query_mask is not None:
    rows = rows & jnp.expand_dims(query_mask, -2)
  if objective == "output_mse":
    v = jax.lax.stop_gradient(value).astype(jnp.float32)
    out = lambda log_a: jnp.einsum("...hqk,...khe->...hqe", jnp.exp(log_a), v)  # [..., H, L, Dv]
    error = jnp.sum(jnp.square(out(log_weights) - out(log_target)), axis=-1)  # [..., H, L]
    return jnp.sum(jnp.where(rows, error, 0.0)) / jnp.maximum(jnp.sum(rows), 1)
  seen = rows[..., None] & ~jnp.isneginf(log_target)  # the keys a row weighs (NaN ones too)
  # t·log A, with t = e^{log t} > 0 and log A = −inf (a key the student drops) giving −inf, not 0·(−inf).
  dropped = seen & jnp.isneginf(log_weights) & ~jnp.isnan(log_target)
  terms = jnp.exp(jnp.where(seen, log_target, 0.0)) * jnp.where(seen & ~dropped, log_weights, 0.0)
  cross = -jnp.sum(jnp.where(dropped, -jnp.inf, jnp.where(seen, terms, 0.0)), axis=-1)
  return jnp.sum(jnp.where(rows, cross, 0.0)) / jnp.maximum(jnp.sum(rows), 1)
