"""Figures a reader can read: distinct series, legends off the data, tick labels apart, one unit per figure."""

import math

import ml_collections
import pytest

from experiments import approximation, plotting, speed

matplotlib = pytest.importorskip("matplotlib")


@pytest.fixture
def kept_figures(monkeypatch):
  """plotting.save keeps the figure (drawn, not written) so a test can inspect it."""
  figs = []

  def keep(fig, path, dpi=120):
    fig.canvas.draw()
    figs.append(fig)
    return path

  monkeypatch.setattr(plotting, "save", keep)
  return figs


def _overlap(a, b):
  return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _tick_labels_apart(ax, axis):
  renderer = ax.figure.canvas.get_renderer()
  boxes = [t.get_window_extent(renderer) for t in getattr(ax, f"get_{axis}ticklabels")(which="both")
           if t.get_visible() and t.get_text()]
  return all(not _overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _speed_records(config):
  out = []
  for job in speed.jobs(config, 100.0, 2 ** 34):
    if job["method"] in speed.CAUSAL_ONLY and job["seq_len"] > 1024:
      out.append(dict(job, status="skipped_too_slow"))
    else:
      out.append(dict(job, status="ok", median_s=1e-3 * job["seq_len"], peak_bytes=2 ** 20 * job["seq_len"]))
  return out


def test_speed_figure_series_are_distinct_and_legend_covers_no_panel(kept_figures):
  from experiments.configs import speed as cfg
  config = cfg.get_config()
  speed.plot(_speed_records(config), config, "/nonexistent")
  (fig,) = kept_figures
  renderer = fig.canvas.get_renderer()
  for ax in fig.axes:
    styles = [(line.get_color(), line.get_linestyle()) for line in ax.get_lines()]
    assert len(styles) == len(set(styles)) > 0
    assert _tick_labels_apart(ax, "x") and _tick_labels_apart(ax, "y")
  (legend,) = fig.legends  # one legend for all four panels (time and memory)
  assert all(not _overlap(legend.get_window_extent(renderer), ax.get_window_extent(renderer)) for ax in fig.axes)
  assert "skipped as too slow" in " ".join(t.get_text() for t in fig.texts)


def test_approximation_m_axis_labels_are_apart(kept_figures):
  config = ml_collections.ConfigDict(dict(kernels=("positive", "hyperbolic"), projections=("iid", "orthogonal"),
                                          num_features=(16, 32, 64, 128, 256, 512, 1024), num_draws=2,
                                          settings=(("moderate", 256, 64, 0.5),)))
  records = [dict(setting="moderate", kernel="uniform", projection="none", num_features=0, mse=1e-3)]
  records += [dict(setting="moderate", kernel=k, projection=p, num_features=m, mse=1.0 / m, mse_ci95=0.1 / m)
              for k in config.kernels for p in config.projections for m in config.num_features]
  approximation.plot(records, config, "/nonexistent")
  (fig,) = kept_figures
  for ax in fig.axes:
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "32", "64", "128", "256", "512", "1k"]
    assert _tick_labels_apart(ax, "x") and _tick_labels_apart(ax, "y")


def test_training_curves_use_one_unit(kept_figures):
  records = [dict(kind="eval", step=0, eval_loss=5.0, eval_bpc=5.0 / math.log(2), eval_accuracy=0.1),
             dict(kind="train", step=10, train_loss=4.0), dict(kind="train", step=20, train_loss=3.0),
             dict(kind="eval", step=20, eval_loss=2.9, eval_bpc=2.9 / math.log(2), eval_accuracy=0.3)]
  plotting.training_curves({"softmax": records}, "/nonexistent")
  (fig,) = kept_figures
  train, evals = (ax.get_lines()[0].get_ydata() for ax in fig.axes)
  assert list(train) == pytest.approx([4.0 / math.log(2), 3.0 / math.log(2)])  # bits/char, as the eval panel
  assert list(evals) == pytest.approx([5.0 / math.log(2), 2.9 / math.log(2)])
  assert "bits/char" in fig.axes[0].get_ylabel() and "bits/char" in fig.axes[1].get_ylabel()
