"""A call's feature map: the kernel resolved against its arguments, and the facts its algorithms read (internal).

:class:`Features` is what every attention algorithm receives: the map
``fn(q_NlHD, k_NlHD) -> (fq, fk)`` (two :class:`~favor_jax.core.kernels.LogFeatures`,
φ = mult · exp(log)) and, beside it, its layout facts as fields of a record.
Shape letters: see :mod:`favor_jax.core`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from favor_jax.core import checks
from favor_jax.core import kernels as kernels_lib


@dataclasses.dataclass(frozen=True)
class Features:
  """A feature map on flattened [N, l, H, D] slices and the layout facts the algorithms read.

  ``layout_free``: the map is per row, so it may be fed [N, H, l, 1, D] (heads as a batch dimension; see
  :func:`head_major`). ``whole_sequence``: the map stabilises its keys over the positions it is given
  (a user callable called with ``stabilize=True``), so bidirectional attention takes all of them at once.
  """
  fn: Callable  # (q, k) -> (LogFeatures, LogFeatures)
  layout_free: bool = False
  whole_sequence: bool = False
  params: tuple = ()  # the arrays fn reads (projection, statistic), None where absent
  rebuild: Callable | None = None  # (*params) -> this record, its fn reading those arrays
  kernel: object = None  # the resolved kernel (a Kernel record or a callable); None: features used as given


def resolve_kernel(kernel, projection, rho, query):
  """(kernel, whether it is data-dependent), after checking projection and rho against it."""
  kern = kernels_lib.get_kernel(kernel)
  record = isinstance(kern, kernels_lib.Kernel)
  name = kern.name if record else getattr(kern, "__name__", repr(kern))
  if projection is not None:
    if record:
      kern.check_projection_given(projection)
    checks.check_projection(projection, query.shape[-1], query.shape[-2])
  elif not record or kern.needs_projection:
    raise ValueError(f"kernel {name!r} needs a projection [M, {query.shape[-1]}], got None")
  data_dependent = record and kern.data_dependent
  if record and not any(kern is ours for ours in kernels_lib.KERNELS.values()):  # a record of one's own
    statistic = {} if not data_dependent else {kern.statistic: jnp.zeros(kern.statistic_shape(query.shape))}
    kern.check_features(query, query, projection, **statistic)
  if rho is not None and not data_dependent:
    raise ValueError(f"rho passes the statistic of a data-dependent kernel (one of "
                     f"{kernels_lib.data_dependent_names()}); kernel {name!r} takes none")
  return kern, data_dependent


def flat_rho(rho, query, kern):
  """The statistic ``rho`` broadcast to ``kern.statistic_shape`` and flattened to [N, H, ...] like the
  batch; None stays None."""
  if rho is None:
    return None
  shape = kern.statistic_shape(query.shape)
  rho = jnp.asarray(rho, jnp.float32)
  try:
    rho = jnp.broadcast_to(rho, shape)
  except ValueError:
    raise ValueError(f"rho must broadcast to {kern.name}'s statistic shape {shape}, got shape "
                     f"{rho.shape}") from None
  return rho.reshape((-1,) + shape[query.ndim - 3:])


def of_kernel(kern, projection, rho_NH, causal) -> Features:
  """The :class:`Features` of a resolved kernel on flattened [N, l, H, D] slices.

  Our kernels with a shared (or no) projection are ``layout_free`` (per row, ρ
  aligned with the heads axis whatever the leading dims); a user callable with its own key
  stabiliser (a max over all positions) is ``whole_sequence`` unless ``causal``.
  """
  if isinstance(kern, kernels_lib.Kernel):
    def fn(q, k):
      trailing = () if rho_NH is None else rho_NH.shape[2:]  # the statistic's shape beyond [N, H]
      given = {} if rho_NH is None else {kern.statistic: rho_NH.reshape(q.shape[:-3] + q.shape[-2:-1] + trailing)}
      return kern.log_features(q, k, projection, **given)

    # A per-head projection [H, M, D] pairs ω with the heads axis, so the rows keep their layout.
    return Features(fn, layout_free=projection is None or projection.ndim == 2, params=(projection, rho_NH),
                    rebuild=functools.partial(_rebuilt, kern, causal=causal), kernel=kern)

  def fn(q, k):
    # stabilize=True would scale keys by a max over all positions, future ones included.
    qf, kf = kern(q, k, projection, stabilize=not causal)
    return (kernels_lib.LogFeatures(None, qf.astype(jnp.float32)),
            kernels_lib.LogFeatures(None, kf.astype(jnp.float32)))

  return Features(fn, whole_sequence=not causal, params=(projection, rho_NH),
                  rebuild=functools.partial(_rebuilt, kern, causal=causal), kernel=kern)


def _rebuilt(kern, projection, rho_NH, *, causal):
  return of_kernel(kern, projection, rho_NH, causal)


def split(features: Features):
  """(the record without its arrays, its arrays): a custom VJP takes the arrays as arguments (their
  gradients flow) and rebuilds the record from them with :func:`rebuilt`."""
  if features.rebuild is None:
    raise ValueError("these Features cannot be rebuilt from their arrays (made without features.of_kernel "
                     "or features.as_given)")
  return dataclasses.replace(features, fn=None, params=()), tuple(features.params)


def rebuilt(static: Features, params) -> Features:
  """The record :func:`split` took apart, its fn reading ``params``."""
  return static.rebuild(*params)


def as_given() -> Features:
  """Features used as given (:func:`favor_jax.core.linear_attention`'s arguments are features), per row."""
  def fn(qf, kf):
    as_is = lambda x: kernels_lib.LogFeatures(None, x.astype(jnp.float32))
    return as_is(qf), as_is(kf)

  return Features(fn, layout_free=True, rebuild=as_given)


def for_call(kernel, projection, rho, query, key, key_mask, causal, blocked=False, query_mask=None) -> Features:
  """The kernel's :class:`Features` for one attention call, with its statistic from the whole sequence (its
  unmasked keys, the queries of ``query_mask``) unless causal (then given).

  ``blocked``: the features are taken block by block even when not causal, so a
  user callable must not stabilise its keys over the call's positions.
  """
  kern, data_dependent = resolve_kernel(kernel, projection, rho, query)
  if data_dependent and rho is None:
    if causal:
      raise kernels_lib.causal_statistic_error(kern, query)
    rho = kern.compute_statistic(query, key, key_mask, query_mask)
  return of_kernel(kern, projection, flat_rho(rho, query, kern), causal or blocked)


def head_major(features: Features, q, k):
  """The features of [N, l, H, D] slices, returned head-major: log/mult [N, H, l, F] (log may be [..., 1]).

  Layout-free feature maps (``features.layout_free``) are fed [N, H, l, 1, D]: heads become a
  batch dimension, so the projection and every later product are plain batched matrix products.
  """
  if features.layout_free:
    to_hm = lambda x: jnp.swapaxes(x, 1, 2)[..., None, :]
    back = lambda a: None if a is None else a[..., 0, :]
    fq, fk = features.fn(to_hm(q), to_hm(k))
  else:
    back = lambda a: None if a is None else jnp.swapaxes(a, 1, 2)
    fq, fk = features.fn(q, k)
  return tuple(type(f)(back(f.log), back(f.mult)) for f in (fq, fk))


def exponential_features(features: Features, q, k) -> bool:
  """Whether φ = exp(log) with a log per feature and no multiplier, for queries and keys (what the fused
  kernels take: of ``KERNELS``, positive, hyperbolic, FAVOR++, FAVOR#, Hedgehog, ELU+1 do; trigonometric, ReLU,
  Taylor do not; a record of your own is read the same way).
  With no multiplier a log of width 1 is one feature (a one-row projection, ELU+1 with D = 1), not a
  per-row scale."""
  fq, fk = jax.eval_shape(features.fn, q[:, :1], k[:, :1])
  return all(f.mult is None and f.log is not None for f in (fq, fk))
