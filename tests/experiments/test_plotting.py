"""Figures a reader can read: distinct series, legends off the data, tick labels apart, one unit per figure."""

import json
import math

import ml_collections
import pytest

from experiments.studies import approximation, speed
from experiments.train import plotting

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


def test_loss_figure_ticks_enclose_the_curve(kept_figures):
  # A curve ending at 2.47 under ticks 2.5, 3.0, ...: the lowest tick sat above the curve's end.
  records = [dict(kind="eval", step=0, eval_loss=4.0, eval_bpc=5.6, eval_accuracy=0.1)]
  records += [dict(kind="train", step=s, train_loss=(2.47 + 3.0 / s) * math.log(2)) for s in range(10, 310, 10)]
  records += [dict(kind="eval", step=300, eval_loss=1.7, eval_bpc=2.47, eval_accuracy=0.4)]
  plotting.training_curves({"softmax": records}, "/nonexistent")
  (fig,) = kept_figures
  for ax in fig.axes:
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    visible = [t for t in ax.get_yticks() if ax.get_ylim()[0] - 1e-9 <= t <= ax.get_ylim()[1] + 1e-9]
    assert min(visible) <= min(ys) and max(visible) >= max(ys), (visible, min(ys), max(ys))


def _study(tmp_path):
  """Records and metrics.jsonl of a four-run study: three FAVOR runs share their state size and nearly their
  quality (their points would sit on one another), softmax has two seeds."""
  runs = [("softmax", "softmax", 0, 32768, 2.60), ("softmax_seed1", "softmax", 1, 32768, 2.62),
          ("favor", "favor", 0, 8704, 2.700), ("hedgehog", "favor", 0, 8704, 2.701), ("sharp", "favor", 0, 8704, 2.702)]
  records = []
  for name, attention, seed, state, bpc in runs:
    kernel = {"favor": "positive", "hedgehog": "hedgehog", "sharp": "saderf"}.get(name, "")
    records.append(dict(name=name, task="shakespeare", attention=attention, kernel=kernel,
                        num_features=64 if kernel in ("positive", "saderf") else 0, projection="", redraw_every=0,
                        window=0, qk_head_dim=0, short_conv=0, seq_len=128, num_kv_pairs=0, steps=20, features=64,
                        state_size=state, seed=seed, eval_loss=bpc * math.log(2), eval_bpc=bpc, eval_accuracy=0.4,
                        best_eval_accuracy=0.4, steps_per_s=1.0))
    (tmp_path / name).mkdir()
    lines = [dict(kind="eval", step=0, eval_loss=4.0, eval_bpc=5.8, eval_accuracy=0.1),
             dict(kind="train", step=10, train_loss=3.0), dict(kind="train", step=20, train_loss=2.0),
             dict(kind="eval", step=20, eval_loss=bpc * math.log(2), eval_bpc=bpc, eval_accuracy=0.4)]
    (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
  return records


def test_a_run_keeps_its_colour_marker_and_label_in_every_figure_of_a_study(kept_figures, tmp_path):
  from experiments.train import sweep
  sweep.plot(_study(tmp_path), ml_collections.ConfigDict(dict(task="shakespeare")), str(tmp_path))
  curves, state = kept_figures
  eval_panel = curves.axes[1]
  in_curves = {line.get_label(): (matplotlib.colors.to_hex(line.get_color()), line.get_marker())
               for line in eval_panel.get_lines()}
  in_state = {}
  for collection in state.axes[0].collections:
    marker = next(m for m, path in _marker_paths().items() if _same_path(collection.get_paths()[0], path))
    in_state[collection.get_label()] = (matplotlib.colors.to_hex(collection.get_facecolor()[0]), marker)
  assert set(in_state) == {"softmax", "favor", "hedgehog", "sharp"}  # one point per setting: seeds averaged
  assert all(in_curves[name] == in_state[name] for name in in_state), (in_curves, in_state)
  assert len(set(in_curves.values())) == len(in_curves)  # and no two runs alike


def test_points_of_equal_state_do_not_hide_each_other(kept_figures, tmp_path):
  from experiments.train import sweep
  sweep.plot(_study(tmp_path), ml_collections.ConfigDict(dict(task="shakespeare")), str(tmp_path))
  state = kept_figures[1]
  ax = state.axes[0]
  centres = [ax.transData.transform(c.get_offsets()[0]) for c in ax.collections]
  diameter = 2 * math.sqrt(40 / math.pi) * state.dpi / 72  # s=40 points² markers, in pixels
  assert all(math.dist(a, b) >= diameter for i, a in enumerate(centres) for b in centres[i + 1:])


def _same_path(a, b):
  return a.vertices.shape == b.vertices.shape and (abs(a.vertices - b.vertices) < 1e-9).all()


def _marker_paths():
  from matplotlib.markers import MarkerStyle
  return {m: MarkerStyle(m).get_path().transformed(MarkerStyle(m).get_transform()) for m in plotting.MARKERS}


def test_a_token_runs_curves_are_labelled_bits_per_token_and_per_byte(kept_figures):
  """A tokenizer's run: the train panel in bits per token, the eval panel in its held-out bits per byte (not
  "bits/char"); without the bytes, bits per token on both."""
  evals = [dict(kind="eval", step=s, eval_loss=loss, eval_bits_per_token=loss / math.log(2),
                eval_bits_per_byte=loss / math.log(2) / 2.5, eval_perplexity=math.exp(loss), eval_accuracy=0.1)
           for s, loss in ((0, 6.0), (20, 4.0))]
  records = [evals[0], dict(kind="train", step=10, train_loss=5.0), dict(kind="train", step=20, train_loss=4.5),
             evals[1]]
  plotting.training_curves({"bpe": records}, "/nonexistent")
  unknown = [{k: v for k, v in r.items() if k != "eval_bits_per_byte"} for r in records]
  plotting.training_curves({"ids": unknown}, "/nonexistent")
  with_bytes, without = kept_figures
  assert list(with_bytes.axes[0].get_lines()[0].get_ydata()) == pytest.approx([5.0 / math.log(2), 4.5 / math.log(2)])
  assert list(with_bytes.axes[1].get_lines()[0].get_ydata()) == pytest.approx([6.0 / math.log(2) / 2.5,
                                                                               4.0 / math.log(2) / 2.5])
  assert with_bytes.axes[0].get_ylabel().startswith("train loss (bits/token")
  assert with_bytes.axes[1].get_ylabel() == "eval bits/byte"
  assert without.axes[1].get_ylabel() == "eval bits/token" and "bits/char" not in without.axes[0].get_ylabel()
