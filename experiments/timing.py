"""Wall-clock timing shared by the benchmarks (imports no framework, so torch-only processes stay clean)."""

from __future__ import annotations

import time

import numpy as np

PASSES = ("fwd", "fwd_bwd")  # forward only; forward + backward


def check_timing(config) -> None:
  """A benchmark's ``config.passes`` (one or more of ``PASSES``) and ``config.repeats`` (an int >= 1), named
  when bad: before anything is compiled or timed."""
  passes = config.passes
  if isinstance(passes, str) or not passes or any(p not in PASSES for p in passes):
    raise ValueError(f"config.passes must be a tuple of one or more of {PASSES}, got {passes!r}")
  if not isinstance(config.repeats, int) or isinstance(config.repeats, bool) or config.repeats < 1:
    raise ValueError(f"config.repeats must be an int >= 1 (timed runs per case), got {config.repeats!r}")


def median_of(thunk, repeats: int = 5) -> float:
  """Median seconds of ``thunk()`` over ``repeats`` (>= 1) runs, after one warm-up run (compilation)."""
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  thunk()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    thunk()
    times.append(time.perf_counter() - start)
  return float(np.median(times))
