"""Sequence-parallel FAVOR attention on JAX's own machinery (``Mesh``, ``shard_map``, collectives).

Queries, keys and values are split along the sequence over one mesh axis; no
device ever holds the whole sequence, and communication is independent of L:

- bidirectional: local feature sums, one ``pmax`` of the per-feature key
  scales and one ``psum`` of Σφ(k)vᵀ and Σφ(k) — H·M·(Dv+2) numbers per example;
- causal: each device summarises its keys into a constant-size state (μ, S),
  one ``all_gather`` of those states (devices·H·M·(Dv+2) numbers per example),
  an exclusive prefix over the *earlier* devices' states only (rescaled by the
  running maximum, so no device sees a later device's keys), then the local
  chunked causal pass starting from that prefix.

Works under ``jit`` and ``grad`` (the collectives' transposes are collectives).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from favor_jax.core import bidirectional as bidirectional_lib
from favor_jax.core import causal_xla, checks, inputs
from favor_jax.core import features as features_lib
from favor_jax.core import gates as gates_lib
from favor_jax.core import hybrid as hybrid_lib
from favor_jax.core import precision as precision_lib
from favor_jax.core import state as state_lib

__all__ = ["sequence_parallel_attention", "communication_bytes"]


def _check_axis(mesh: Mesh, axis, argument: str = "axis_name") -> int:
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if not isinstance(axis, str) or axis not in mesh.axis_names:
    raise ValueError(f"{argument} {axis!r} is not an axis of the mesh; its axes are {mesh.axis_names}")
  return mesh.shape[axis]


@precision_lib.honoured
def sequence_parallel_attention(
    query: Float[Array, "... L H D"],
    key: Float[Array, "... L H D"],
    value: Float[Array, "... L H Dv"],
    projection: Float[Array, "M D"] | Float[Array, "H M D"] | None,
    *,
    mesh: Mesh,
    axis_name: str,
    batch_axis: str | None = None,
    kernel="positive",
    causal: bool = False,
    key_mask: Bool[Array, "... L"] | None = None,
    rho: Float[Array, "... H"] | Float[Array, "... H D+1"] | None = None,
    chunk_size: int = 64,
    log_gate: Float[Array, "... L H"] | None = None,
    segment_ids: Int[Array, "... L"] | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> Float[Array, "... L H Dv"]:
  """Computes :func:`~favor_jax.core.favor_attention` with the sequence split over a mesh axis.

  The same formula, kernels and stabiliser as ``favor_attention``::

      out_t = Σ_j φ(q_t)ᵀφ(k_j) v_j / Σ_j φ(q_t)ᵀφ(k_j),

  j over all unmasked keys (j ≤ t if ``causal``). Self-attention layout: query,
  key and value share the length L. An L that the axis size does not divide is
  padded at the end with masked keys (and the padded rows dropped), which
  changes no output. The sharded computation runs compiled (``jit``) even when
  called eagerly (``shard_map`` executed op by op is far slower); eager calls
  with the same shapes, mesh and choices reuse one compilation. Works under
  ``jit`` and ``grad``.

  Args:
    query: queries, shape [..., L, H, D].
    key: keys, shape [..., L, H, D].
    value: values, shape [..., L, H, Dv].
    projection: ω, shape [M, D] (shared by the heads) or [H, M, D] (one per
      head), or None for a kernel that takes none; replicated on every device.
    mesh: the ``jax.sharding.Mesh`` to run on.
    axis_name: the mesh axis the sequence L is split over.
    batch_axis: optional mesh axis (not ``axis_name``) the flattened batch is
      split over when its size divides the batch (replicated otherwise: the
      result is the same either way).
    kernel: a name in ``KERNELS`` or a :class:`~favor_jax.core.kernels.Kernel` record, or
      a callable with a kernel's signature. A plain callable (not a ``Kernel``
      record) is called with ``stabilize=False`` here, causal or not (each
      device sees part of the keys): its features must stay within float32's
      range.
    causal: whether query t sees only keys j ≤ t.
    key_mask: optional bool [..., L]; False leaves a key out.
    rho: the statistic of a data-dependent kernel ([..., H] for FAVOR++
      ``optimal_positive``, [..., H, D+1] for FAVOR# ``saderf``); required for
      them, since computing it would be one more collective over the sequence.
    chunk_size: C, the chunk length of the local causal pass.
    log_gate: optional float [..., L, H], the log of a forget gate per position and head, causal
      only, as in :func:`~favor_jax.core.favor_attention`.
    segment_ids: optional int [..., L], packed documents, as in :func:`~favor_jax.core.favor_attention`.
    precision: the precision of every dot product of the call, as in :func:`~favor_jax.core.favor_attention`.

  Returns:
    The attention output, shape [..., L, H, Dv], in the inputs' dtype; sharded
    along L over ``axis_name`` (not along L when L had to be padded on a mesh
    with explicit axes, which cannot shard such a length) and, with
    ``batch_axis``, along the batch.

  Raises:
    TypeError: if ``mesh`` is not a ``Mesh``, ``causal`` is not a bool, or an
      array has the wrong dtype (a mask not bool, inputs not floating).
    ValueError: if ``axis_name`` or ``batch_axis`` is not an axis of ``mesh``,
      they are equal, shapes disagree (query and key lengths included), a
      data-dependent kernel gets no ``rho`` or a concrete invalid one, the
      kernel is unknown or needs a projection and gets none, ``chunk_size``
      is not a positive int, or ``precision`` is invalid (as in ``favor_attention``).

  References:
    Choromanski et al. 2021, "Rethinking Attention with Performers" (ICLR).
  """
  _check_axis(mesh, axis_name)
  if batch_axis is not None:
    _check_axis(mesh, batch_axis, "batch_axis")
    if batch_axis == axis_name:
      raise ValueError(f"batch_axis must differ from axis_name (the sequence's axis), got {batch_axis!r} for both")
  inputs.validate(query, key, value, key_mask, causal)
  if query.shape[-3] != key.shape[-3]:
    raise ValueError(f"sequence-parallel attention needs query and key of one length; got query "
                     f"{query.shape} and key {key.shape}")
  kern, data_dependent = features_lib.resolve_kernel(kernel, projection, rho, query)
  if data_dependent and rho is None:
    raise ValueError(f"kernel {kernel!r} needs an explicit rho {kern.statistic_shape(query.shape)} under "
                     f"sequence parallelism (e.g. kernels.{kern.compute_statistic.__name__}(query, key) "
                     "computed by the caller, or a running one)")
  if rho is not None and not isinstance(rho, jax.core.Tracer):
    # The kernel's own checks of a concrete statistic (finite, in range): inside the compiled shard_map it
    # is traced and they cannot run. Traced here with ρ a constant (nothing computed; one token a row).
    one = jax.ShapeDtypeStruct(query.shape[:-3] + (1,) + query.shape[-2:], jnp.float32)
    jax.eval_shape(lambda q: kern.log_features(q, q, projection, **{kern.statistic: rho}), one)
  chunk_size = checks.check_chunk_size(chunk_size)
  gates = gates_lib.prepare(log_gate, segment_ids, query, causal)

  rho_NH = features_lib.flat_rho(rho, query, kern)
  if batch_axis is not None and math.prod(query.shape[:-3]) % mesh.shape[batch_axis]:
    batch_axis = None  # a layout hint only: a batch the axis does not divide (e.g. at init) is replicated
  seq = P(batch_axis, axis_name)
  # q, k, v, mask split along the sequence (and batch); the projection on every device; ρ [N, H, ...] split
  # like the batch.
  specs = (seq,) * 4 + (P(), P(batch_axis))
  try:
    hash(kern)
  except TypeError:  # e.g. a callable dataclass: a static argument must hash (compiled per call instead)
    kern = _ByIdentity(kern)
  run = functools.partial(_sharded, projection=projection, rho_NH=rho_NH, mesh=mesh, axis_name=axis_name,
                          specs=specs, kern=kern, chunk_size=chunk_size)

  def flat(q, k, v, mask):
    if gates is None:
      return run(q, k, v, mask, None, causal=bool(causal)), None
    if causal:  # the call's own gates, bad entries flagged (gates.prepare): one rule on every device
      return run(q, k, v, mask, gates, causal=True), None
    # Keys j ≤ t with a reset at each segment start, keys j > t over the reversed sequence (delayed by one).
    forward = jnp.broadcast_to(jnp.where(gates.start, -jnp.inf, 0.0)[..., None], q.shape[:3])
    back = jnp.broadcast_to(hybrid_lib.reverse_gate(gates.start), q.shape[:3])
    rev = lambda x: jnp.flip(x, axis=1)
    shift = lambda x, fill=0: hybrid_lib._delayed(rev(x), 1, fill)
    as_gates = lambda log: gates_lib.Gates(log, None, None)
    parts = (run(q, k, v, mask, as_gates(forward), causal=True, terms=True),
             tuple(map(rev, run(rev(q), shift(k), shift(v), shift(mask, False), as_gates(back), causal=True,
                                terms=True, key_offset=back))))
    bad = inputs.split_nonfinite(q, k, v, mask, causal=False, gates=gates)[3]
    return inputs.poison(state_lib.divide(*hybrid_lib.merge(*parts)), bad), None

  return inputs.over_batch(flat, query, key, value, key_mask)[0]


class _ByIdentity:
  """An unhashable user kernel, hashed and compared by identity."""

  def __init__(self, kern):
    self.kern = kern


@functools.partial(jax.jit, static_argnames=("mesh", "axis_name", "specs", "kern", "causal", "chunk_size", "terms"))
def _sharded(q, k, v, mask, gates, projection, rho_NH, *, mesh, axis_name, specs, kern, causal, chunk_size,
             terms=False, key_offset=None):
  """The per-device computation under ``shard_map``, the padding of L to a multiple of the axis size and its
  removal around it; compiled (once per shape and static choice) even when the caller is eager: ``shard_map``
  executed op by op is far slower, and the padding's transpose on an explicit mesh needs the compiler.
  ``gates``: a flattened ``gates.Gates`` (causal; None: none), split along L like the inputs (its bad entries
  poison the rows that see them, by ``inputs.split_nonfinite``'s one rule); ``key_offset`` as in
  ``causal_xla.chunked``; ``terms``: return
  (num, den, log-scale) for a merge (non-finite inputs not marked: the caller's other pass is their rule)."""
  kern = kern.kern if isinstance(kern, _ByIdentity) else kern
  length = q.shape[1]
  padded = -(-length // mesh.shape[axis_name]) * mesh.shape[axis_name]
  q, k, v = (inputs.pad_to(x, padded) for x in (q, k, v))
  mask = inputs.pad_to(mask, padded, False)
  gated = gates is not None
  gates = jax.tree.map(lambda x: inputs.pad_to(x, padded, jnp.zeros((), x.dtype)), gates)  # padding: no reset
  key_offset = None if key_offset is None else inputs.pad_to(key_offset, padded)
  args = (q, k, v, mask, projection, rho_NH, gates, key_offset)
  specs = specs + (specs[0],) * 2
  explicit = jax.sharding.AxisType.Explicit in mesh.axis_types
  if explicit:  # explicit meshes want inputs laid out as the specs say
    args = [jax.tree.map(lambda x: jax.reshard(x, NamedSharding(mesh, spec)), x) for x, spec in zip(args, specs)]

  def local(q, k, v, mask, projection, rho_NH, gates, key_offset):
    # Row-local feature stabilisation only: a max over "all positions" would differ per device.
    features = features_lib.of_kernel(kern, projection, rho_NH, causal=True)
    gate = gates.log if gated else None

    def algorithm(q, k, v, mask, _):
      v = v.astype(jnp.float32)
      if gated:
        a, summary = gates_lib.key_state(features, k, v, mask, gate, key_offset)
        prefix = gates_lib.exclusive_prefix(a, summary, axis_name)
        return causal_xla.chunked(features, q, k, v, mask, chunk_size=chunk_size, state=prefix, gate=gate,
                                  key_offset=key_offset, return_scale=terms, divide=not terms), None
      if causal:
        prefix = causal_xla.exclusive_prefix(state_lib.key_state(features, k, v, mask), axis_name)
        return causal_xla.chunked(features, q, k, v, mask, chunk_size=chunk_size, state=prefix, divide=True), None
      return bidirectional_lib.bidirectional(features, q, k, v, mask, axis_name=axis_name, divide=True), None

    if terms:  # inputs zeroed, rows not marked (see above)
      q, k, v, _, _ = inputs.split_nonfinite(q, k, v, mask, causal=True, axis_name=axis_name, gates=gates)
      return algorithm(q, k, v, mask, None)[0]
    return inputs.without_nonfinite(algorithm, q, k, v, mask, causal=causal, axis_name=axis_name, gates=gates)[0]

  out = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(specs[0],) * 3 if terms else specs[0])(*args)
  if padded != length:
    if explicit:  # an explicit sharding cannot describe a length the axis does not divide: the batch's stays
      out = jax.tree.map(lambda x: jax.reshard(x, NamedSharding(mesh, P(specs[0][0]))), out)  # P(batch, sequence)
    out = jax.tree.map(lambda x: x[:, :length], out)
  return out


def communication_bytes(batch: int, heads: int, num_features: int, value_dim: int, devices: int,
                        causal: bool, bytes_per_number: int = 4) -> int:
  """Computes the bytes each device receives per forward call of :func:`sequence_parallel_attention`.

  Independent of L. Bidirectional: a ring all-reduce of Σφ(k)vᵀ, Σφ(k) and the
  key scales moves 2·(P−1)/P of their size, B·H·F·(Dv+2) numbers. Causal: an
  all-gather of every other device's (μ, S) state, (P−1)·B·H·F·(Dv+2) numbers.
  Not counted: the collective of one flag per example and head (per device,
  causal) that spreads a non-finite key or value's NaN.

  Args:
    batch: B, the batch (all batch dims flattened).
    heads: H, the number of heads.
    num_features: F, features per head.
    value_dim: Dv, the head dim of value.
    devices: P, devices along the sequence axis.
    causal: whether the call is causal.
    bytes_per_number: bytes of one number (4 for float32).

  Returns:
    The number of bytes, an int.

  Raises:
    ValueError: if a size is not a positive int.
    TypeError: if ``causal`` is not a bool.
  """
  sizes = dict(batch=batch, heads=heads, num_features=num_features, value_dim=value_dim, devices=devices,
               bytes_per_number=bytes_per_number)
  batch, heads, num_features, value_dim, devices, bytes_per_number = (
      checks.check_positive_int(name, x) for name, x in sizes.items())
  checks.check_bool("causal", causal)
  state = batch * heads * num_features * (value_dim + 2)  # S: [F, Dv+1] and μ: [F]
  if causal:
    return (devices - 1) * state * bytes_per_number
  return math.ceil(2 * (devices - 1) / devices * state) * bytes_per_number

