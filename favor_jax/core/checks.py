"""Input validation shared by kernels and attention: errors at trace time, from static shapes."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

# The arguments of the public attention functions that choose the computation's structure, so must be Python
# values under ``jax.jit`` (``kernel`` and ``causal_method`` are not arrays at all; JAX refuses them itself).
STATIC_ARGNAMES = ("kernel", "causal", "causal_method", "chunk_size", "window")


def _traced_hint(name: str, x) -> str:
  """For a traced ``x`` (an argument of a jitted function not marked static), how to mark it; else ''."""
  if not isinstance(x, jax.core.Tracer):
    return ""
  return (f": jax.jit traced {name} because it was not marked static. Give jax.jit's static_argnames those of "
          f"{', '.join(STATIC_ARGNAMES)} that the function takes, e.g. jax.jit(core.favor_attention, "
          "static_argnames=('kernel', 'causal', 'causal_method', 'chunk_size')), or bind them with "
          "functools.partial before jax.jit")


def check_bool(name: str, x) -> None:
  """``x`` a bool (Python or NumPy): a string such as "False" or an int would be read by its truth value,
  and an array cannot choose the computation's structure."""
  if not isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool (True or False), got {x!r} ({type(x).__name__}){_traced_hint(name, x)}")


def check_float(name: str, x) -> None:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(f"{name} must be an array (jax or NumPy), got {type(x).__name__}")
  dtype = x.dtype
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")


def check_qk(query, key) -> None:
  """query `[..., Lq, H, D]`, key `[..., Lk, H, D]` with the same batch dims, heads and D."""
  check_float("query", query)
  check_float("key", key)
  if query.ndim < 3:
    raise ValueError(f"query must have rank >= 3 ([..., L, H, D]), got shape {query.shape}")
  if key.ndim != query.ndim:
    raise ValueError(
        f"key must have the rank of query ({query.ndim}), got key shape {key.shape} "
        f"and query shape {query.shape}")
  if key.shape[-1] != query.shape[-1]:
    raise ValueError(
        f"key head_dim {key.shape[-1]} != query head_dim {query.shape[-1]} "
        f"(key shape {key.shape}, query shape {query.shape})")
  if key.shape[-2] != query.shape[-2]:
    raise ValueError(
        f"key has {key.shape[-2]} heads but query has {query.shape[-2]} "
        f"(key shape {key.shape}, query shape {query.shape})")
  if key.shape[:-3] != query.shape[:-3]:
    raise ValueError(
        f"key batch dims {key.shape[:-3]} != query batch dims {query.shape[:-3]} "
        f"(key shape {key.shape}, query shape {query.shape})")
  if query.shape[-1] == 0:
    raise ValueError(f"query and key have head_dim 0 (query shape {query.shape}); need head_dim >= 1")


def check_projection(projection, head_dim: int, heads: int | None = None) -> None:
  """projection ``[M, D]`` (shared by the heads) or ``[H, M, D]`` (one per head), M >= 1."""
  want = f"[num_features, {head_dim}] or [{'H' if heads is None else heads}, num_features, {head_dim}]"
  if projection is None:
    raise ValueError(f"this kernel needs a projection {want}, got None")
  check_float("projection", projection)
  if projection.ndim not in (2, 3) or projection.shape[-1] != head_dim:
    raise ValueError(f"projection must have shape {want} (head_dim of query), got {projection.shape}")
  if projection.ndim == 3 and heads is not None and projection.shape[0] != heads:
    raise ValueError(f"a per-head projection needs one matrix per head: shape {want}, got {projection.shape} "
                     f"for {heads} heads")
  if projection.shape[-2] <= 0:
    raise ValueError(f"projection needs num_features > 0, got shape {projection.shape}")


def check_value(key, value) -> None:
  check_float("value", value)
  if value.ndim != key.ndim or value.shape[:-1] != key.shape[:-1] or value.shape[-1] == 0:
    raise ValueError(
        f"value must have shape {key.shape[:-1] + ('Dv',)} ([..., Lk, H, Dv] matching key, Dv >= 1), "
        f"got {value.shape}")


def check_key_mask(key_mask, key_shape, name: str = "key_mask") -> None:
  """key_mask (or the mask ``name`` of the rows of ``key_shape``): boolean `[..., L]`, broadcastable to
  the batch dims."""
  if key_mask is None:
    return
  need = tuple(key_shape[:-3]) + (key_shape[-3],)
  mask_dtype = getattr(key_mask, "dtype", None)
  if mask_dtype is None or mask_dtype != jnp.bool_:
    raise TypeError(f"{name} must be a boolean array of shape {need}, got dtype {mask_dtype}")
  ok = key_mask.ndim >= 1 and key_mask.ndim <= len(need) and key_mask.shape[-1] == need[-1]
  if ok:
    try:
      jnp.broadcast_shapes(key_mask.shape, need)
    except ValueError:
      ok = False
  if not ok or jnp.broadcast_shapes(key_mask.shape, need) != need:
    length = "Lq" if name == "query_mask" else "Lk"
    raise ValueError(f"{name} must have shape {need} (batch dims..., {length}), got {key_mask.shape}")


def check_lengths(query, key) -> None:
  """Attention (not a feature map) needs at least one query and one key."""
  for name, x in (("query", query), ("key", key)):
    if x.shape[-3] == 0:
      raise ValueError(f"{name} has length 0 (shape {x.shape}); attention needs at least one position")


def check_causal_lengths(query, key, what: str = "causal attention") -> None:
  """Lq = Lk where query t and key t share a position (``what`` says who needs it)."""
  if query.shape[-3] != key.shape[-3]:
    raise ValueError(
        f"{what} needs equal query and key lengths, got Lq={query.shape[-3]} "
        f"(query shape {query.shape}) and Lk={key.shape[-3]} (key shape {key.shape})")


def check_positive_int(name: str, x, *, optional: bool = False) -> int | None:
  """``x`` as a Python int: any positive integer (numpy's too), never a bool; ``optional``: None passes."""
  if optional and x is None:
    return None
  if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x <= 0:
    raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {x!r}"
                     + _traced_hint(name, x))
  return int(x)


def check_chunk_size(chunk_size) -> int:
  return check_positive_int("chunk_size", chunk_size)


def check_causal_method(causal_method, choices, causal: bool = True) -> None:
  """Checked whether or not the call is causal: an argument we cannot honour is never ignored. Not causal,
  the other methods name causal passes that bidirectional attention has no use for, but "pallas" asks for
  fused kernels it does not have."""
  if causal_method not in choices:
    raise ValueError(f"unknown causal_method {causal_method!r}; choose one of {list(choices)}")
  if causal_method == "pallas" and not causal:
    raise ValueError("causal_method='pallas' asks for the fused causal kernels; bidirectional attention "
                     "(causal=False) has no fused kernel and runs its XLA pass: use causal_method='auto'")


def check_window(window) -> int:
  """window as a Python int >= 0 (0: no exact window), never a bool."""
  if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
    raise ValueError(f"window must be an int >= 0 (positions of exact attention; 0: none), got {window!r}"
                     + _traced_hint("window", window))
  return int(window)


def check_control_variate(control_variate, window: int, num_heads: int):
  """The hybrid's control-variate coefficient β: None or a Python 0 (no correction: returns None), a finite real
  number, or a floating array of shape () or [H] (may be traced: one learned coefficient per head); not 0
  only with a window > 0 (the correction uses the exact window). Returns β or None."""
  if control_variate is None:
    return None
  if isinstance(control_variate, numbers.Real) and not isinstance(control_variate, bool):
    if not np.isfinite(control_variate):
      raise ValueError(f"control_variate must be finite, got {control_variate!r}")
    if control_variate == 0:
      return None
  elif not (hasattr(control_variate, "shape") and hasattr(control_variate, "dtype")
            and jnp.issubdtype(control_variate.dtype, jnp.floating)):
    raise TypeError(f"control_variate must be a real number or a floating array of shape () or [H], got "
                    f"{control_variate!r} ({type(control_variate).__name__})")
  elif jnp.shape(control_variate) not in ((), (num_heads,)):
    raise ValueError(f"control_variate must have shape () or [H] = ({num_heads},), got {jnp.shape(control_variate)}")
  if not window:
    raise ValueError(f"control_variate={control_variate!r} corrects the kernel's estimate with the exact window's "
                     "own estimate: it needs window > 0 (window=0 is favor_attention)")
  return control_variate
