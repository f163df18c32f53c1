"""Exact softmax attention (the reference), normalised linear attention and FAVOR attention.

Layout: query ``[..., Lq, H, D]``, key ``[..., Lk, H, D]``, value ``[..., Lk, H, Dv]``, output ``[..., Lq, H, Dv]``
in the inputs' dtype; float32 inside. Each public function checks its arguments once, here, resolves its kernel
into a ``features.Features`` record, and runs its algorithm inside the input envelope (``inputs.envelope``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from favor_jax.core import bidirectional as bidirectional_lib
from favor_jax.core import causal as causal_lib
from favor_jax.core import checks, inputs
from favor_jax.core import features as features_lib
from favor_jax.core import gates as gates_lib
from favor_jax.core import hybrid as hybrid_lib
from favor_jax.core import precision as precision_lib
from favor_jax.core import state as state_lib
from favor_jax.core.features import for_call as _feature_fn  # (tests and experiments/studies/blocks.py read it here)

__all__ = [
    "softmax_attention", "linear_attention", "favor_attention", "hybrid_attention",
]


@precision_lib.honoured
def softmax_attention(
    query: Float[Array, "... Lq H D"],
    key: Float[Array, "... Lk H D"],
    value: Float[Array, "... Lk H Dv"],
    *,
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    log_gate: Float[Array, "... L H"] | None = None,
    segment_ids: Int[Array, "... L"] | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> Float[Array, "... Lq H Dv"]:
  """Computes exact attention softmax(q kᵀ/√d) v, the reference FAVOR estimates.

  A query that can see no key (all masked) returns 0. ``log_gate`` (causal only): log f_l ≤ 0 of a forget
  gate per position and head (−∞: a reset); logits + Σ_{j<l≤t} log f_l (Forgetting Transformer, Lin et al.
  2025; constant: ALiBi, :func:`alibi_log_gate`). ``segment_ids``: packed documents, pairs within a run of
  equal ids only. A NaN, +∞ or positive log gate gives NaN in the rows that may see it (as a NaN key).

  Args:
    query: queries, shape [..., Lq, H, D].
    key: keys, shape [..., Lk, H, D].
    value: values, shape [..., Lk, H, Dv].
    causal: whether query t sees only keys j ≤ t (needs Lq = Lk).
    key_mask: optional bool [..., Lk] (broadcastable); False leaves a key out.
    log_gate: optional float [..., L, H], the log of a forget gate per position and head, causal
      only, as in :func:`~favor_jax.core.favor_attention`.
    segment_ids: optional int [..., L], packed documents, as in :func:`~favor_jax.core.favor_attention`.
    precision: the precision of every dot product of the call, as in :func:`favor_attention`.

  Returns:
    The output, shape [..., Lq, H, Dv], in the inputs' dtype; 0 in a row that can see no key (all masked).

  Raises:
    TypeError: if an input is not a floating array, ``key_mask`` not bool or ``causal`` not a bool.
    ValueError: if the shapes disagree, a length is 0, ``causal`` with Lq ≠ Lk, or ``precision`` is invalid (as
      :func:`favor_attention` raises).

  References:
    Vaswani et al. 2017, "Attention Is All You Need" (NeurIPS).
  """
  inputs.validate(query, key, value, key_mask, causal)
  gates = gates_lib.prepare(log_gate, segment_ids, query, causal)

  def exact(q, k, v, mask):
    f32 = jnp.float32
    logits = jnp.einsum("nqhd,nkhd->nhqk", q.astype(f32), k.astype(f32)) / math.sqrt(query.shape[-1])
    allowed = mask[:, None, None, :]
    if causal:
      allowed = allowed & jnp.tril(jnp.ones(logits.shape[-2:], bool))
    logits = jnp.where(allowed, gates_lib.biased(logits, gates, causal), -jnp.inf)
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
    num = jnp.einsum("nhqk,nkhd->nqhd", weights, v.astype(f32))
    return state_lib.divide(num, jnp.moveaxis(jnp.sum(weights, axis=-1), -2, -1))

  return inputs.envelope(exact, query, key, value, key_mask, causal=causal, in_range=False, gates=gates)


def _linear(features, query, key, value, key_mask, causal, causal_method, chunk_size, in_range=True, gates=None,
            precision=None):
  """Normalised linear attention by ``features`` in the input envelope: the bidirectional pass (within
  segments: ``hybrid.segmented``), or the causal one ``causal_method`` chooses (arguments checked by the
  caller); ``gates`` a ``gates.Gates``; ``precision`` (checked) handed to the causal pass."""
  def algorithm(q, k, v, mask):
    if not (causal and causal_method in ("pallas", "auto")):  # the fused kernels read v in its own dtype
      v = v.astype(jnp.float32)
    if not causal and gates is not None:
      return state_lib.divide(*hybrid_lib.segmented(features, q, k, v, mask, gates.start, chunk_size))
    if not causal:
      return bidirectional_lib.bidirectional(features, q, k, v, mask, divide=True)
    return causal_lib.attend(features, q, k, v, mask, causal_method=causal_method, chunk_size=chunk_size,
                             gate=None if gates is None else gates.log, precision=precision)

  return inputs.envelope(algorithm, query, key, value, key_mask, causal=causal, in_range=in_range, gates=gates)


@precision_lib.honoured
def linear_attention(
    query_features: Float[Array, "... Lq H F"],
    key_features: Float[Array, "... Lk H F"],
    value: Float[Array, "... Lk H Dv"],
    *,
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    causal_method: str = "auto",
    chunk_size: int = 64,
    log_gate: Float[Array, "... L H"] | None = None,
    segment_ids: Int[Array, "... L"] | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> Float[Array, "... Lq H Dv"]:
  """Computes normalised linear attention from given features: ``out_t = Σ_j (φ_tᵀψ_j) v_j / Σ_j φ_tᵀψ_j``.

  The sum is over unmasked j (j ≤ t if causal): ``(A v) / (A 1)`` with ``A = φ ψᵀ`` (lower-triangular if
  causal), without forming A. Rows with a zero denominator return 0. Features are used as given.
  ``log_gate`` and ``segment_ids`` as in :func:`favor_attention`.

  Args:
    query_features: φ, shape [..., Lq, H, F].
    key_features: ψ, shape [..., Lk, H, F].
    value: values, shape [..., Lk, H, Dv].
    causal: whether query t sees only keys j ≤ t (needs Lq = Lk).
    key_mask: optional bool [..., Lk] (broadcastable); False leaves a key out.
    causal_method: the causal pass, as in :func:`favor_attention`.
    chunk_size: C, the chunk length of the causal pass (checked, unused when not causal).
    log_gate: optional float [..., L, H], the log of a forget gate per position and head, causal
      only, as in :func:`~favor_jax.core.favor_attention`.
    segment_ids: optional int [..., L], packed documents, as in :func:`~favor_jax.core.favor_attention`.
    precision: the precision of every dot product of the call, as in :func:`favor_attention`.

  Returns:
    The output, shape [..., Lq, H, Dv], in the inputs' dtype.

  Raises:
    TypeError: if an input is not a floating array, ``key_mask`` not bool or ``causal`` not a bool.
    ValueError: if shapes disagree, a length is 0, ``causal`` with Lq ≠ Lk, or as :func:`favor_attention`
      raises for ``causal_method``, ``chunk_size`` and ``precision``.

  References:
    Katharopoulos et al. 2020, "Transformers are RNNs" (ICML).
  """
  inputs.validate(query_features, key_features, value, key_mask, causal, "query_features", "key_features")
  checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS, causal)
  chunk_size = checks.check_chunk_size(chunk_size)
  gates = gates_lib.prepare(log_gate, segment_ids, query_features, causal)
  return _linear(features_lib.as_given(), query_features, key_features, value, key_mask, causal, causal_method,
                 chunk_size, in_range=False, gates=gates, precision=precision)


@precision_lib.honoured
def favor_attention(
    query: Float[Array, "... Lq H D"],
    key: Float[Array, "... Lk H D"],
    value: Float[Array, "... Lk H Dv"],
    projection: Float[Array, "M D"] | Float[Array, "H M D"] | None,
    *,
    kernel="positive",
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    rho: Float[Array, "... H"] | Float[Array, "... H D+1"] | None = None,
    causal_method: str = "auto",
    chunk_size: int = 64,
    query_mask: Bool[Array, "... Lq"] | None = None,
    log_gate: Float[Array, "... L H"] | None = None,
    segment_ids: Int[Array, "... L"] | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> Float[Array, "... Lq H Dv"]:
  """Computes FAVOR attention in linear time: ``out = D⁻¹ (φ(Q) (φ(K)ᵀ V))``, ``D = diag(φ(Q) (φ(K)ᵀ 1))``.

  With a softmax kernel this estimates :func:`softmax_attention` from an unbiased estimate of its kernel. Keys
  are stabilised in log domain by a running maximum over past keys only (for ``Kernel`` records), so causal
  outputs never depend, even numerically, on later tokens. A query that sees no unmasked key gives 0; a
  non-finite query NaN in its own row; a non-finite unmasked key or value NaN in the rows that may see it (in
  no earlier row); masked keys are ignored whatever they hold. Other edges: docs/guarantees.md.

  Args:
    query: queries, shape [..., Lq, H, D].
    key: keys, shape [..., Lk, H, D].
    value: values, shape [..., Lk, H, Dv].
    projection: ω, [M, D] (shared by the heads) or [H, M, D] (one per head); None if the kernel takes none.
    kernel: a name in ``KERNELS`` or a :class:`~favor_jax.core.kernels.Kernel` record (a feature map of your own: its
      ``log_features`` checked once, at trace time; docs/estimators.md), or a plain callable
      ``kernel(q, k, projection, *, stabilize) -> (φq, φk)`` (linear-domain features: causal passes and
      ``favor_jax.parallel`` call it with ``stabilize=False``, so they must stay in float32's range).
    causal: whether query t sees only keys j ≤ t (needs Lq = Lk).
    key_mask: optional bool [..., Lk] (broadcastable); False leaves a key out.
    rho: a data-dependent kernel's statistic, FAVOR++'s ρ [..., H] or FAVOR#'s [..., H, D+1] (log Ψ, then ρ);
      required if ``causal``, else computed here over the unmasked keys and the queries of ``query_mask``.
    causal_method: the causal pass: ``"auto"`` (the fused kernel where lowered for a TPU or GPU and the
      kernel's features allow it, else ``"chunked"``), ``"chunked"`` (exact causal chunks with carried state,
      XLA), ``"pallas"`` (the same chunks as fused Pallas kernels, chosen where lowered: Mosaic on a TPU, Triton
      on a GPU, interpreted on a CPU; ``chunk_size`` a power of two ≥ 16, run as that many rows on a GPU and a
      CPU and rounded up to a multiple of 128 by Mosaic on a TPU, the lane width of its [C, C] products:
      ``chunk_size=64`` runs chunks of 128 rows there, the same estimate with another summation order;
      first derivatives only),
      ``"scan"`` (per-token recurrence) or ``"cumsum"`` (prefix states). ``"chunked"`` and ``"pallas"`` are
      reverse-mode only (JAX raises TypeError under ``jax.jvp``). Unused (``"pallas"`` refused) when not causal.
    chunk_size: C, the chunk length of the causal pass (checked, unused when not causal).
    query_mask: optional bool [..., Lq]; False leaves a query (padding) out of a data-dependent kernel's
      statistic, nothing else. Pass a padded self-attention's mask as both masks.
    log_gate: optional float [..., L, H]: the log of a forget gate f ∈ (0, 1] per position and head (≤ 0;
      −inf resets), causal only: key j's weight for query t is multiplied by exp(Σ_{j<l≤t} log f_l)
      (Forgetting Transformer; ALiBi: :func:`~favor_jax.core.alibi_log_gate`). A NaN, +inf or positive
      entry makes the rows that may see it NaN.
    segment_ids: optional int [..., L]: packed documents; a segment is a run of equal consecutive ids, and
      no query attends across a segment boundary.
    precision: the precision of every dot product of the call, forward and backward (a
      ``jax.lax.PrecisionLike``: ``"highest"``, ``jax.lax.Precision.HIGH``, a ``jax.lax.DotAlgorithmPreset``);
      None: the backend's default (one bfloat16 pass for float32 on TPU, TF32 on recent GPUs; what that does
      to each estimator: docs/guarantees.md).

  Returns:
    The output, shape [..., Lq, H, Dv], in the inputs' dtype.

  ``log_gate``, ``segment_ids``: as in :func:`softmax_attention` (unbiased for its weights: the state decays
  by f_t in its log-scale before key t joins, RFA's gate, Peng et al. 2021; bidirectional segments: a causal
  pass with resets and a reversed one; a data-dependent kernel's statistic stays the whole row's); the fused
  kernels of ``"pallas"`` and ``"auto"`` take them too.

  Raises:
    TypeError: if an input is not a floating array, a mask not bool or ``causal`` not a bool.
    ValueError: if shapes disagree, a length is 0, ``causal`` with Lq ≠ Lk, the kernel is unknown or gets a
      projection it does not take or lacks one it needs, a causal data-dependent kernel lacks ``rho``, a
      concrete ``rho`` is invalid, ``causal_method`` is unknown (or ``"pallas"`` when not causal),
      ``chunk_size`` is not a positive int, ``precision`` is not a ``jax.lax.PrecisionLike`` one call's dots can
      all take (a pair of different precisions), or a second derivative is taken through ``"pallas"``.

  References:
    Choromanski et al. 2021, "Rethinking Attention with Performers" (ICLR).
  """
  inputs.validate(query, key, value, key_mask, causal, query_mask=query_mask)
  checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS, causal)
  chunk_size = checks.check_chunk_size(chunk_size)
  gates = gates_lib.prepare(log_gate, segment_ids, query, causal)
  features = _feature_fn(kernel, projection, rho, query, key, key_mask, causal, blocked=gates is not None,
                         query_mask=query_mask)
  return _linear(features, query, key, value, key_mask, causal, causal_method, chunk_size, gates=gates,
                 precision=precision)


@precision_lib.honoured
def hybrid_attention(
    query: Float[Array, "... Lq H D"],
    key: Float[Array, "... Lk H D"],
    value: Float[Array, "... Lk H Dv"],
    projection: Float[Array, "M D"] | Float[Array, "H M D"] | None,
    *,
    window: int,
    kernel="positive",
    causal: bool = False,
    key_mask: Bool[Array, "... Lk"] | None = None,
    rho: Float[Array, "... H"] | Float[Array, "... H D+1"] | None = None,
    chunk_size: int = 64,
    query_mask: Bool[Array, "... Lq"] | None = None,
    log_gate: Float[Array, "... L H"] | None = None,
    segment_ids: Int[Array, "... L"] | None = None,
    precision: jax.lax.PrecisionLike = None,
    control_variate: float | Float[Array, ""] | Float[Array, " H"] | None = None,
) -> Float[Array, "... Lq H Dv"]:
  """Computes attention with exact softmax weights near each query and a kernel's estimate elsewhere.

  ``out_t = Σ_j w_tj v_j / Σ_j w_tj``, ``w_tj = exp(q_t·k_j/√d)`` if j is in t's window (``t − window < j ≤ t``
  when causal, ``abs(t − j) < window`` otherwise), else ``φ(q_t)ᵀφ(k_j)``: with an unbiased softmax kernel each
  w_tj is an unbiased estimate of exp(q_t·k_j/√d). ``window=0`` is :func:`favor_attention`; a window covering
  the sequence is :func:`softmax_attention`. O(L·(window + F)·(D + Dv)) time, no [L, L] array; the causal
  stabiliser never looks ahead. Needs Lq = Lk (positions are shared). Masks, non-finite inputs, ``rho``,
  ``query_mask``, ``log_gate`` and ``segment_ids`` behave as in :func:`favor_attention`; the exact window gets
  the same bias as the kernel's part. Causal with ``window ≤ chunk_size``, the exact window is computed inside
  the chunked pass (each block of rows computes its own window beside its kernel part): one pass over the
  sequence; otherwise a separate blocked pass beside it.

  The kernel's part covers exactly the keys beyond the window, so each weight beyond it is the kernel's own
  (unbiased) estimate and each weight inside it exact: this is Scatterbrain's sparse + low-rank − (low-rank on
  the sparse support), term by term. ``control_variate`` β ≠ 0 adds a control variate (EVA, Zheng et al.
  2023): the window's kernel estimate Ŝ_W, whose expectation is the exact window S_W computed here, corrects
  the estimate beyond the window Ŝ_F (sums of w_tj·[v_j, 1] over the keys of W or F; gates included):

  .. code-block:: text

     numerator, denominator = S_W + Ŝ_F − β·(Ŝ_W − S_W) = (1 + β)·(S_W + Ŝ_F) − β·Ŝ_{W∪F}

  unbiased for every β fixed with respect to the random features (E[Ŝ_W] = S_W): a window weight's estimate is
  (1 + β)·w − β·ŵ, a weight beyond it ŵ. The errors of Ŝ_W and Ŝ_F share φ(q_t), so a β near
  Cov(Ŝ_F, Ŝ_W)/Var(Ŝ_W) lowers the variance of the sum; β = −1 is :func:`favor_attention`'s estimate. Weights
  can then be negative (as the denominator, rarely). It costs a second state (every key), in the same pass
  where the window is. One
  coefficient per head (an array [H]) may be learned; a coefficient estimated from the same draw (EVA's
  per-chunk one) would add a bias of order 1/M and is not offered.

  Args:
    query: queries, shape [..., Lq, H, D].
    key: keys, shape [..., Lk, H, D].
    value: values, shape [..., Lk, H, Dv].
    projection: ω, [M, D] or [H, M, D]; None for a kernel that takes none.
    window: W ≥ 0, the exact window's width in positions (0: none).
    kernel: as in :func:`favor_attention`.
    causal: whether query t sees only keys j ≤ t.
    key_mask: optional bool [..., Lk]; False leaves a key out.
    rho: a data-dependent kernel's statistic, as in :func:`favor_attention`.
    chunk_size: C, the chunk length of the causal pass.
    query_mask: optional bool [..., Lq], as in :func:`favor_attention`.
    log_gate: optional float [..., L, H], the log of a forget gate per position and head, causal
      only, as in :func:`~favor_jax.core.favor_attention`.
    segment_ids: optional int [..., L], packed documents, as in :func:`~favor_jax.core.favor_attention`.
    precision: the precision of every dot product of the call, as in :func:`favor_attention`.
    control_variate: β, None or 0 (the plain hybrid), a real number, or a floating array of shape () or [H]
      (one per head; may be traced, e.g. learned); needs ``window`` > 0.

  Returns:
    The output, shape [..., Lq, H, Dv], in the inputs' dtype.

  Raises:
    TypeError: as :func:`favor_attention` raises, and if ``control_variate`` is neither a number nor a floating
      array.
    ValueError: as :func:`favor_attention` raises, and if Lq ≠ Lk, ``window`` is not an int ≥ 0, or
      ``control_variate`` is not finite, of another shape than () or [H], or not 0 with ``window=0``.

  References:
    Chen et al. 2021, "Scatterbrain: Unifying Sparse and Low-rank Attention" (NeurIPS).
    Zheng et al. 2023, "Efficient Attention via Control Variates" (ICLR).
    Arora et al. 2024, "Simple linear attention language models balance the recall-throughput tradeoff".
  """
  inputs.validate(query, key, value, key_mask, causal, query_mask=query_mask)
  checks.check_causal_lengths(query, key, "hybrid attention (its window is positions t − j, causal or not)")
  window = checks.check_window(window)
  chunk_size = checks.check_chunk_size(chunk_size)
  control = checks.check_control_variate(control_variate, window, query.shape[-2])
  gates = gates_lib.prepare(log_gate, segment_ids, query, causal)
  # Window 0 is favor_attention with causal_method "auto", its other arguments checked above.
  features = _feature_fn(kernel, projection, rho, query, key, key_mask, causal,
                         blocked=window > 0 or gates is not None, query_mask=query_mask)
  if window == 0:
    return _linear(features, query, key, value, key_mask, causal, "auto", chunk_size, gates=gates,
                   precision=precision)

  def algorithm(q, k, v, mask):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    return state_lib.divide(*hybrid_lib.hybrid(features, q, k, v, mask, window, causal, chunk_size, gates,
                                               control))

  return inputs.envelope(algorithm, query, key, value, key_mask, causal=causal, gates=gates)
