"""Wall-clock timing shared by the benchmarks (imports no framework, so torch-only processes stay clean)."""

from __future__ import annotations

import time

import numpy as np

PASSES = ("fwd", "fwd_bwd")  # forward only; forward + backward


SIZES = ("batch", "heads", "head_dim", "num_features", "devices", "timing_steps", "timing_repeats", "approx_seq_len",
         "approx_draws")  # a benchmark's fields that must be ints >= 1 where it has them
DTYPES = ("float32", "bfloat16", "float16")


def _int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def check_sizes(config) -> None:
  """A benchmark's shape fields where the config has them, each named when bad, before anything is compiled
  or timed: those of ``SIZES``, ``seq_lens``/``causal_seq_lens`` (ints >= 1; seq_lens not empty), ``causal``
  (one or more bools), ``dtype``, and ``seed``, ``threads``, ``long_length``, ``scan_max_len`` (ints >= 0)."""
  for name in SIZES:
    if name in config and not (_int(config[name]) and config[name] >= 1):
      raise ValueError(f"config.{name} must be an int >= 1, got {config[name]!r}")
  for name in ("seed", "threads", "long_length", "scan_max_len"):
    if name in config and not (_int(config[name]) and config[name] >= 0):
      raise ValueError(f"config.{name} must be an int >= 0, got {config[name]!r}")
  for name in ("seq_lens", "causal_seq_lens"):
    lens = config.get(name, (1,))
    if isinstance(lens, (str, int)) or not all(_int(n) and n >= 1 for n in lens) or (name == "seq_lens" and not lens):
      raise ValueError(f"config.{name} must be a tuple of ints >= 1{' (one or more)' * (name == 'seq_lens')}, "
                       f"got {lens!r}")
  causal = config.get("causal", (False,))
  if isinstance(causal, (str, bool)) or not causal or not all(isinstance(c, bool) for c in causal):
    raise ValueError(f"config.causal must be a tuple of one or more of True, False, got {causal!r}")
  if "dtype" in config and config.dtype not in DTYPES:
    raise ValueError(f"config.dtype must be one of {DTYPES}, got {config.dtype!r}")


def check_timing(config) -> None:
  """A benchmark's ``config.passes`` (one or more of ``PASSES``), ``config.repeats`` (an int >= 1) and
  sizes (:func:`check_sizes`), named when bad: before anything is compiled or timed."""
  passes = config.passes
  if isinstance(passes, str) or not passes or any(p not in PASSES for p in passes):
    raise ValueError(f"config.passes must be a tuple of one or more of {PASSES}, got {passes!r}")
  if not isinstance(config.repeats, int) or isinstance(config.repeats, bool) or config.repeats < 1:
    raise ValueError(f"config.repeats must be an int >= 1 (timed runs per case), got {config.repeats!r}")
  check_sizes(config)


def median_of(thunk, repeats: int = 5, warmup: bool = True) -> float:
  """Median seconds of ``thunk()`` over ``repeats`` (>= 1) runs, after one warm-up run (compilation) unless
  ``warmup`` is False (a thunk calling an already compiled program)."""
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  if warmup:
    thunk()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    thunk()
    times.append(time.perf_counter() - start)
  return float(np.median(times))
