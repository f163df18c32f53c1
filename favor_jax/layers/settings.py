"""The settings of a FAVOR attention layer: one frozen record, validated once, where it is built.

Linen's and NNX's ``FavorAttention``, ``make_attention_fn`` and the experiments' model config all build a
:class:`FavorSettings` with :meth:`FavorSettings.build`, which runs every rule below once; nothing checks
them again per call (the core functions check their own arguments at their public boundary).
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from favor_jax import core
from favor_jax.core import causal as causal_lib
from favor_jax.core import precision as precision_lib

PROJECTIONS = tuple(core.PROJECTIONS)  # the order that a layer's stored projection_kind indexes
DEFAULT_NUM_FEATURES = 256  # M of a random projection when the layer is not given num_features
DEFAULT_PROJECTION = "orthogonal"  # the kind drawn when the layer is not given projection
RHO_MOMENTUM = 0.99  # the running statistic's weight on its past, where rho_momentum is not given
# Why decoding honours "auto" and "chunked" only (``check_causal_method``; NNX also asks at call time).
DECODE_RUNS_CHUNKED = "decode=True (a prompt runs the chunked pass, a token one recurrence step)"


def projection_role(kernel) -> str:
  """What a layer keeps for ``kernel``: ``"random"`` (a drawn projection in the ``favor`` collection),
  ``"learned"`` (a trained ``feature_map`` parameter, initialised to the identity) or ``"none"``."""
  kern = core.get_kernel(kernel)
  if not isinstance(kern, core.kernels.Kernel):
    return "random"  # a user callable is given a projection, as favor_attention gives it one
  if kern.learned:
    return "learned"
  return "random" if kern.needs_projection else "none"


def per_head(kernel, per_head_projection) -> bool:
  """Whether the layer's projection is [H, M, D]: as asked, else per head for learned kernels only."""
  if per_head_projection is None:
    return projection_role(kernel) == "learned"
  return per_head_projection


def is_data_dependent(kernel) -> bool:
  """Whether ``kernel`` takes a statistic of the data (FAVOR++'s ρ): causal layers keep a running one."""
  kern = core.get_kernel(kernel)
  return isinstance(kern, core.kernels.Kernel) and kern.data_dependent


def keeps_statistic(kernel, causal: bool) -> bool:
  """Whether a layer keeps a running statistic: causal, with a data-dependent kernel (FAVOR++, FAVOR#)."""
  return causal and is_data_dependent(kernel)


def _named(prefix: str, error: Exception) -> Exception:
  """``error`` with its message naming the field as the caller knows it (``prefix`` + the argument's name)."""
  return type(error)(prefix + str(error)) if prefix else error


def check_kernel(kernel, prefix: str = "") -> None:
  """A kernel name of ``core.KERNELS`` or a callable."""
  try:
    core.get_kernel(kernel)
  except ValueError:
    raise ValueError(f"unknown kernel {kernel!r}: {prefix}kernel must be one of {sorted(core.KERNELS)} or a "
                     "callable") from None


def check_flags(causal, decode) -> None:
  """``causal`` a bool; ``decode`` a bool or None (NNX's default, as Flax's: not decoding), and only causal."""
  core.checks.check_bool("causal", causal)
  if decode is not None:
    core.checks.check_bool("decode", decode)
  if decode and not causal:
    raise ValueError("decode=True needs causal=True: decoding is autoregressive")


def check_causal_method(causal_method, only_chunked_because: str | None = None, causal: bool = True) -> None:
  """A known causal method; where only the XLA chunked pass runs (hybrid, sequence-parallel, decoding),
  "auto" or "chunked" only: another choice would be ignored there. "pallas" needs causal attention."""
  core.checks.check_causal_method(causal_method, causal_lib.CAUSAL_METHODS, causal)
  if only_chunked_because and causal_method not in ("auto", "chunked"):
    raise ValueError(f"causal_method={causal_method!r} cannot apply with {only_chunked_because}, which runs the "
                     "XLA chunked pass: use causal_method='auto' or 'chunked'")


def check_projection_fields(kernel, num_features, projection, per_head_projection, *, unused: str = "refuse",
                            prefix: str = "") -> None:
  """``num_features`` and ``projection`` well-formed, and given only to a kernel with a random projection
  (``unused="drop"``: the caller leaves them out of such a kernel's settings itself); ``per_head_projection``
  None or a bool, True only for a kernel with a projection."""
  role = projection_role(kernel)
  core.checks.check_positive_int(prefix + "num_features", num_features, optional=True)
  if projection is not None and projection not in PROJECTIONS:
    raise ValueError(f"{prefix}projection must be one of {PROJECTIONS}, got {projection!r}")
  if role != "random" and unused == "refuse":
    what = ("learns its feature map (a [head_dim, head_dim] parameter per head, initialised to the identity)"
            if role == "learned" else "uses no projection (its features are a fixed function of q and k)")
    for name, value in (("num_features", num_features), ("projection", projection)):
      if value is not None:
        raise ValueError(f"kernel {kernel!r} {what}, so {name} has no meaning for it; got {name}={value!r}: "
                         "leave it None")
  if per_head_projection is not None and not isinstance(per_head_projection, (bool, np.bool_)):
    raise ValueError(f"per_head_projection must be None, True or False, got {per_head_projection!r}")
  if role == "none" and per_head_projection:
    raise ValueError(f"per_head_projection=True: kernel {kernel!r} uses no projection to make per head")


def check_sizes(window, chunk_size, qk_head_dim, prefix: str = "") -> None:
  """``window`` an int >= 0, ``chunk_size`` a positive int, ``qk_head_dim`` a positive int or None."""
  try:
    core.checks.check_window(window)
  except ValueError as e:
    raise _named(prefix, e) from None
  core.checks.check_positive_int(prefix + "chunk_size", chunk_size)
  core.checks.check_positive_int(prefix + "qk_head_dim", qk_head_dim, optional=True)


def takes_positions(qk_transform) -> bool:
  """Whether ``qk_transform`` takes a ``positions`` keyword (or ``**kwargs``): decoding passes it the tokens'
  absolute positions, [l] int32."""
  try:
    params = inspect.signature(qk_transform).parameters.values()
  except (TypeError, ValueError):  # a callable without an inspectable signature
    return False
  return any(p.name == "positions" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.kind == p.VAR_KEYWORD
             for p in params)


def check_decode(decode, *, qk_transform, sequence_axis) -> None:
  """What decoding (token by token, from the state of the tokens before) cannot do with: a ``qk_transform``
  that cannot be told where the decoded tokens are, sequence parallelism."""
  if decode and qk_transform is not None and not takes_positions(qk_transform):
    raise ValueError("qk_transform with decode=True must take the tokens' positions: decoding calls "
                     "qk_transform(query, key, positions=...) with positions [l] int32, the absolute index of each "
                     "new token (a full pass is positions 0..L-1); a transform of (query, key) alone cannot see "
                     "where a decoded token is")
  if decode and sequence_axis is not None:
    raise ValueError("decode=True is token by token; it cannot be sequence-parallel (drop sequence_axis)")


def check_sequence_parallel(mesh, sequence_axis, *, window, batch_axis=None) -> None:
  """``mesh``/``sequence_axis``: both or neither, and not with a window, which the sequence-parallel pass
  ignores; ``batch_axis`` only with them."""
  if (mesh is None) != (sequence_axis is None):
    raise ValueError("sequence-parallel attention needs both mesh and sequence_axis (or neither)")
  if sequence_axis is None:
    if batch_axis is not None:
      raise ValueError(f"batch_axis={batch_axis!r} splits the batch of sequence-parallel attention: it needs "
                       "mesh and sequence_axis too (or drop batch_axis)")
    return
  if window:
    raise ValueError(f"window={window}: hybrid attention is not sequence-parallel (drop sequence_axis "
                     "or use window=0)")


def check_control_variate(control_variate, window, prefix: str = "") -> float:
  """The hybrid's control-variate coefficient β (``core.hybrid_attention``): a finite real number, not 0 only
  with a window > 0 (the decode step takes it too: ``core.favor_decode_step``)."""
  if isinstance(control_variate, bool) or not isinstance(control_variate, numbers.Real) or not np.isfinite(
      control_variate):
    raise ValueError(f"{prefix}control_variate must be a finite real number (the hybrid's control-variate "
                     f"coefficient β; 0: none), got {control_variate!r}")
  if control_variate and not window:
    raise ValueError(f"{prefix}control_variate={control_variate!r} corrects a hybrid's estimate with its exact "
                     f"window: it needs {prefix}window > 0")
  return float(control_variate)


def check_num_kv_heads(num_kv_heads, num_heads) -> int:
  """The key/value heads of grouped-query attention: None (``num_heads``) or a positive int dividing
  ``num_heads`` (query head h reads key/value head ``h // (num_heads // num_kv_heads)``, as Flax's NNX
  attention groups them). Returns the count."""
  if num_kv_heads is None:
    return num_heads
  core.checks.check_positive_int("num_kv_heads", num_kv_heads)
  if num_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} (each key/value head serves "
                     "num_heads // num_kv_heads query heads)")
  return num_kv_heads


def check_qk_transform(qk_transform) -> None:
  """A layer's ``qk_transform``: None or a callable ``(query, key) -> (query, key)``."""
  if qk_transform is not None and not callable(qk_transform):
    raise TypeError(f"qk_transform must be a callable (query, key) -> (query, key), got {type(qk_transform).__name__}")


def check_gates(forget_gate, alibi, causal: bool, prefix: str = "") -> None:
  """``forget_gate`` and ``alibi`` bools, True only for causal attention (a gate decays what came before:
  bidirectional attention has no before)."""
  for name, value in (("forget_gate", forget_gate), ("alibi", alibi)):
    core.checks.check_bool(prefix + name, value)
    if value and not causal:
      raise ValueError(f"{prefix}{name}=True needs causal attention (a forget gate decays the keys before a query; "
                       f"bidirectional attention has no before): build the layer with causal=True or drop "
                       f"{prefix}{name}")


def resolve_rho_momentum(rho_momentum, kernel, causal: bool) -> float | None:
  """The momentum of the layer's running statistic: ``RHO_MOMENTUM`` if not given. Only causal layers of a
  data-dependent kernel (FAVOR++, FAVOR#) keep one; a value given to any other layer is refused, not
  ignored (None there)."""
  keeps = keeps_statistic(kernel, causal)
  if rho_momentum is None:
    return RHO_MOMENTUM if keeps else None
  if not keeps:
    raise ValueError(f"rho_momentum={rho_momentum!r} weighs a running statistic, which only a causal layer of "
                     f"a data-dependent kernel keeps (one of {core.kernels.data_dependent_names()}); this layer "
                     f"(kernel={kernel!r}, causal={causal}) keeps none: drop rho_momentum")
  if isinstance(rho_momentum, bool) or not isinstance(rho_momentum, numbers.Real) or not 0 <= rho_momentum <= 1:
    raise ValueError(f"rho_momentum must be a float in [0, 1] (the running statistic's weight on its past), "
                     f"got {rho_momentum!r}")
  return rho_momentum


@dataclasses.dataclass(frozen=True)
class FavorSettings:
  """What a FAVOR attention layer computes, fixed when it is built (see :meth:`build`; not for direct use).

  Attributes:
    kernel: a name in ``core.KERNELS`` or a :class:`~favor_jax.core.kernels.Kernel` record, or a callable given the
      projection.
    num_features: M of the random projection (None: ``DEFAULT_NUM_FEATURES``; None for kernels without one).
    projection: the random projection's kind (None: ``DEFAULT_PROJECTION``; None for kernels without one).
    per_head_projection: [H, M, D], one projection per head (None: per head for learned kernels only).
    causal: causal attention.
    causal_method: as in ``core.favor_attention``.
    chunk_size: the causal pass's chunk length.
    window: > 0: exact softmax within ``window`` positions (``core.hybrid_attention``).
    qk_head_dim: query/key head dim when it differs from the value's (None: the same).
    rho_momentum: the running statistic's weight on its past (None: the layer keeps no statistic).
    decode: token by token from a constant-size state.
    qk_transform: ``(query, key) -> (query, key)`` before the features (e.g. rotary embeddings); to decode it
      also takes ``positions`` ([l] int32, the tokens' absolute indices).
    mesh: the mesh of sequence-parallel attention (with ``sequence_axis``).
    sequence_axis: ``mesh``'s axis splitting the sequence.
    batch_axis: ``mesh``'s axis splitting the batch.
    forget_gate: a learned per-head forget gate from the layer's input (FoX; ``layers.gates``), causal only.
    alibi: ALiBi's fixed per-head gate log f = −m_h (``core.alibi_slopes``), causal only.
    precision: of every dot of the attention core (the core functions' ``precision``; the layer's Flax
      ``precision``, which its projections take too), as its name; None: the backend's default.
    control_variate: β of the hybrid's control variate (``core.hybrid_attention``; 0: the plain hybrid), with a
      window only.
  """
  kernel: str | Callable[..., Any] = "positive"
  num_features: int | None = None
  projection: str | None = None
  per_head_projection: bool | None = None
  causal: bool = False
  causal_method: str = "auto"
  chunk_size: int = 64
  window: int = 0
  qk_head_dim: int | None = None
  rho_momentum: float | None = None
  decode: bool = False
  qk_transform: Callable[..., Any] | None = None
  mesh: Any = None
  sequence_axis: str | None = None
  batch_axis: str | None = None
  forget_gate: bool = False
  alibi: bool = False
  precision: str | None = None
  control_variate: float = 0.0

  @classmethod
  def build(cls, *, kernel="positive", num_features=None, projection=None, per_head_projection=None,
            causal=False, causal_method="auto", chunk_size=64, window=0, qk_head_dim=None, rho_momentum=None,
            decode=False, qk_transform=None, mesh=None, sequence_axis=None, batch_axis=None,
            forget_gate=False, alibi=False, precision=None, control_variate=0.0, causal_at_call: bool = False,
            unused_projection: str = "refuse", prefix: str = "") -> FavorSettings:
    """The settings of these arguments, each rule checked once (ValueError/TypeError naming the argument).

    Args:
      kernel, num_features, projection, per_head_projection, causal, causal_method, chunk_size, window,
        qk_head_dim, rho_momentum, decode, qk_transform, mesh, sequence_axis, batch_axis, forget_gate, alibi,
        precision, control_variate: the fields (``precision`` any ``jax.lax.PrecisionLike``, stored as its name)
        (``rho_momentum`` None: ``RHO_MOMENTUM`` where the layer keeps a statistic; ``decode`` None: False).
      causal_at_call: the call may still ask for causal attention (``make_attention_fn``'s ``is_causal``),
        so "pallas" and ``alibi`` are not refused for ``causal=False`` here: the call refuses them if still
        bidirectional.
      unused_projection: "refuse" ``num_features``/``projection`` for a kernel without a random projection;
        "drop": leave them out of its settings (a config holds them for every kernel; they are still
        checked for form).
      prefix: put before each argument's name in the errors (the experiments' config: "attention.").

    Returns:
      The frozen, validated settings.

    Raises:
      ValueError, TypeError: an argument or a combination the layer cannot honour.
    """
    check_flags(causal, decode)
    check_kernel(kernel, prefix)
    only_chunked = ("window > 0 (hybrid attention)" if window else DECODE_RUNS_CHUNKED if decode
                    else "sequence_axis (sequence-parallel attention)" if sequence_axis is not None else None)
    check_causal_method(causal_method, only_chunked, causal or causal_at_call)
    check_projection_fields(kernel, num_features, projection, per_head_projection, unused=unused_projection,
                            prefix=prefix)
    check_sizes(window, chunk_size, qk_head_dim, prefix)
    check_decode(decode, qk_transform=qk_transform, sequence_axis=sequence_axis)
    check_sequence_parallel(mesh, sequence_axis, window=window, batch_axis=batch_axis)
    check_qk_transform(qk_transform)
    check_gates(forget_gate, alibi, causal or causal_at_call, prefix)
    momentum = resolve_rho_momentum(rho_momentum, kernel, causal)
    control_variate = check_control_variate(control_variate, window, prefix)
    if unused_projection == "drop" and projection_role(kernel) != "random":
      num_features = projection = None
    return cls(kernel=kernel, num_features=num_features, projection=projection,
               per_head_projection=per_head_projection, causal=causal, causal_method=causal_method,
               chunk_size=chunk_size, window=window, qk_head_dim=qk_head_dim, rho_momentum=momentum,
               decode=bool(decode), qk_transform=qk_transform, mesh=mesh, sequence_axis=sequence_axis,
               batch_axis=batch_axis, forget_gate=bool(forget_gate), alibi=bool(alibi),
               precision=precision_lib.check(precision, prefix + "precision"), control_variate=control_variate)

  def check_decode_at_call(self) -> None:
    """NNX's ``decode=True`` given at the call to a layer built without it: what decoding cannot do with
    (a layer built with ``decode=True`` was checked when built)."""
    if not self.decode:
      check_decode(True, qk_transform=self.qk_transform, sequence_axis=self.sequence_axis)
      check_causal_method(self.causal_method, DECODE_RUNS_CHUNKED, self.causal)

  @property
  def role(self) -> str:
    """What the layer keeps for its kernel (:func:`projection_role`)."""
    return projection_role(self.kernel)

  @property
  def per_head(self) -> bool:
    """Whether the projection is [H, M, D] (:func:`per_head`)."""
    return per_head(self.kernel, self.per_head_projection)

  @property
  def features(self) -> int:
    """M of the random projection drawn (``DEFAULT_NUM_FEATURES`` when not given)."""
    return DEFAULT_NUM_FEATURES if self.num_features is None else self.num_features

  @property
  def projection_kind(self) -> str:
    """The projection kind drawn (``DEFAULT_PROJECTION`` when not given)."""
    return DEFAULT_PROJECTION if self.projection is None else self.projection

  @property
  def gated(self) -> bool:
    """Whether the layer's attention is gated (``forget_gate`` or ``alibi``)."""
    return self.forget_gate or self.alibi

  def kv_state(self, num_heads: int, num_kv_heads: int | None) -> tuple[bool, str]:
    """Whether a decode state per key/value head is exact for these heads, and why (not).

    One state per key/value head (grouped-query attention, ``num_kv_heads < num_heads``) holds what the keys
    give (Σφ(k)[v, 1]ᵀ, its running maximum, a window's keys and their decays): the group's query heads can
    read one state when the keys' features and gates are the same for all of them, i.e. a projection shared by
    every head (or no projection), a kernel without a statistic of the data (FAVOR++'s and FAVOR#'s ρ is per
    query head), a :class:`~favor_jax.core.kernels.Kernel` record (a callable's key features might depend on
    the query heads) and no gate (the layers' forget gate and ALiBi's slopes are per query head).

    Args:
      num_heads: H, the query heads.
      num_kv_heads: Hkv (None: H).

    Returns:
      (exact, reason): ``exact`` True where the layer keeps one state per key/value head; ``reason`` says why
      a grouped layer keeps one per query head instead ("" where exact or not grouped).
    """
    if num_kv_heads is None or num_kv_heads == num_heads:
      return False, ""
    kern = core.get_kernel(self.kernel)
    why = ("the projection is per query head (per_head_projection)" if self.per_head and self.role != "none"
           else "the kernel is a callable, not a Kernel record" if not isinstance(kern, core.kernels.Kernel)
           else f"kernel {kern.name!r} takes a statistic of the data per query head" if kern.data_dependent
           else "the forget gate is per query head" if self.forget_gate
           else "ALiBi's slopes are per query head" if self.alibi else "")
    return not why, why

  @property
  def keeps_statistic(self) -> bool:
    """Whether the layer keeps a running statistic (:func:`keeps_statistic`)."""
    return keeps_statistic(self.kernel, self.causal)
