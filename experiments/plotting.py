"""Figures for the studies: a headless matplotlib figure, saved and closed in one call."""

from __future__ import annotations


def subplots(*args, **kwargs):
  """``plt.subplots`` on the Agg backend (no display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt.subplots(*args, **kwargs)


def save(fig, path: str, dpi: int = 120) -> str:
  import matplotlib.pyplot as plt
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return path
