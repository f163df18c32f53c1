"""The decode-speed study's quick version runs through ``experiments.main`` and measures what it says: FAVOR+'s
state the same size after every prompt (its closed form), softmax's cache one key and value per position."""

import json

import pytest

from experiments import main
from experiments.configs import common
from experiments.configs import decode as cfg

LENS = (64, 128)


@pytest.mark.slow
def test_decode_study_quick_reports_constant_favor_state_and_a_growing_cache(tmp_path):
  overrides = {"prompt_lens": LENS}
  config = common.set_fields(cfg.get_config("quick"), overrides)
  records = main.run(config, str(tmp_path), overrides)
  m, a = config.model, config.attention
  heads, head_dim, features, layers = m.num_heads, m.d_model // m.num_heads, a.num_features, m.num_layers
  by = {(r["attention"], r["prompt_len"]): r for r in records}
  assert sorted(by) == sorted((t, n) for t in ("favor", "softmax") for n in LENS)
  for n in LENS:
    # FAVOR+ (positive kernel: M features): S [H, M, Dv+1] and μ [H, M] float32, a segment id and the rotary
    # index (int32) per layer, whatever the prompt's length
    assert by["favor", n]["state_bytes_per_sequence"] == layers * (4 * heads * features * (head_dim + 2) + 8)
    # softmax: keys and values [cache length, H, D] float32 and the index, the cache length the prompt's plus
    # the warm-up and timed steps
    cache_len = n + config.repeats + 2
    assert by["softmax", n]["state_bytes_per_sequence"] == layers * (4 * cache_len * heads * 2 * head_dim + 4)
    for t in ("favor", "softmax"):
      r = by[t, n]
      assert r["per_token_ms"] > 0 and r["tokens_per_s"] == pytest.approx(1e3 / r["per_token_ms"])
    assert by["favor", n]["prefill_s"] > 0 and by["softmax", n]["filled"] == "synthetic"
  summary = (tmp_path / "summary.md").read_text()
  assert "| 128 |" in summary and "without a prefill" in summary and (tmp_path / "decode.png").exists()
  assert json.loads((tmp_path / "results.json").read_text()) == records
  with pytest.raises(ValueError, match=r"config.prompt_lens must be a tuple of one or more ints >= 1, got \(\)"):
    main.run(common.set_fields(cfg.get_config("quick"), {"prompt_lens": ()}), str(tmp_path / "bad"))
  with pytest.raises(ValueError, match=r"config.types must be a tuple of one or more of"):
    main.run(common.set_fields(cfg.get_config("quick"), {"types": ("linear",)}), str(tmp_path / "bad"))


@pytest.mark.slow
def test_decode_study_gqa_rows_keep_one_state_per_key_value_head(tmp_path):
  """The ``:gqa`` rows: FAVOR+'s state and softmax's cache shrink with the key/value heads, by their closed forms
  (FAVOR+ ungated with one projection: one state per key/value head)."""
  overrides = {"prompt_lens": (64,)}
  config = common.set_fields(cfg.get_config("gqa_quick"), overrides)
  assert config.kv_heads == (1, 2) and config.model.num_heads == 2
  records = main.run(config, str(tmp_path), overrides)
  m, a = config.model, config.attention
  head_dim, features, layers = m.d_model // m.num_heads, a.num_features, m.num_layers
  cache_len = 64 + config.repeats + 2
  by = {(r["attention"], r["num_kv_heads"]): r["state_bytes_per_sequence"] for r in records}
  for kv in (1, 2):
    assert by["favor", kv] == layers * (4 * kv * features * (head_dim + 2) + 8)
    assert by["softmax", kv] == layers * (4 * cache_len * kv * 2 * head_dim + 4)
  summary = (tmp_path / "summary.md").read_text()
  assert "| FAVOR+ | 64 | 1 of 2 |" in summary and (tmp_path / "decode_gqa.png").exists()
  with pytest.raises(ValueError, match=r"config.kv_heads must be a tuple of ints dividing model.num_heads=2"):
    main.run(common.set_fields(cfg.get_config("gqa_quick"), {"kv_heads": (3,)}), str(tmp_path / "bad"))
