"""Wall-clock timing shared by the benchmarks (imports no framework, so torch-only processes stay clean)."""

from __future__ import annotations

import time

import numpy as np


def median_of(thunk, repeats: int = 5) -> float:
  """Median seconds of ``thunk()`` over ``repeats`` runs, after one warm-up run (compilation)."""
  thunk()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    thunk()
    times.append(time.perf_counter() - start)
  return float(np.median(times))
