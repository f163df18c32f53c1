import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_approximation_quick_run_writes_all_outputs(tmp_path):
  from experiments import main
  from experiments.configs import approximation as cfg

  records = main.run(cfg.get_config("quick"), str(tmp_path))
  for name in ("config.json", "results.json", "summary.md", "error_vs_m_seed.png", "seed_experiment.png"):
    assert (tmp_path / name).exists(), name
  fields = {"kernel", "projection", "num_features", "dim", "input_scale", "seq_len", "mse", "mse_ci95",
            "rel_error", "kernel_mse"}
  assert all(fields <= set(r) for r in records)
  assert json.loads((tmp_path / "results.json").read_text()) == records
  pos = {r["num_features"]: r["mse"] for r in records
         if r["kernel"] == "positive" and r["projection"] == "orthogonal"}
  assert pos[512] < pos[32] / 4  # error falls with M
  assert "The papers' claims" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_command_line_overrides_and_bad_experiment(tmp_path):
  cmd = [sys.executable, "-m", "experiments.main", "--config=experiments/configs/approximation.py",
         f"--workdir={tmp_path}", "--config.quick=True", "--config.experiment=nonsense"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  assert out.returncode != 0 and "--config.experiment='nonsense' cannot take effect" in out.stderr
  assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("flag,wrong,right", [("train.stepz", "stepz", "steps"), ("trian.steps", "trian", "train")])
def test_a_misspelled_field_ends_the_command_with_a_suggestion_not_a_traceback(flag, wrong, right, tmp_path):
  cmd = [sys.executable, "-m", "experiments.main", "--config=experiments/configs/tiny.py",
         f"--workdir={tmp_path / 'out'}", f"--config.{flag}=5"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 1 and "Traceback" not in out.stderr
  assert (f"a --config.FIELD names no field of the config: '{wrong}' Did you mean \"{right}\" instead of "
          f"\"{wrong}\"? (given: --config.{flag}=5)") in out.stderr
  assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_speed_quick_run_records_every_method(tmp_path):
  from experiments import main
  from experiments.configs import speed as cfg

  config = cfg.get_config("quick")
  config.memory = "compiled"  # one process; the per-process mode is tested below
  config.dtype = "bfloat16"
  config.seq_lens = (256,)  # one length: each configuration is a compilation
  config.methods += ("elu_plus_one",)  # a kernel of the records by its name (no entry in speed.ESTIMATORS)
  config.memory_limit_gb = 0.0025  # 2.5 MB: exact attention's fwd+bwd at L=256 (2.6-2.8 MB) is "out of memory"
  records = main.run(config, str(tmp_path))
  assert {r["method"] for r in records} == set(config.methods)
  ok = [r for r in records if r["status"] == "ok"]
  assert ok and all(r["median_s"] > 0 and r["gflops_per_s"] > 0 for r in ok)
  assert any(r["status"] == "out_of_memory" for r in records)
  assert all((r["status"] == "out_of_memory") == (r["compiled_bytes"] > r["memory_limit_bytes"]) for r in records)
  # bf16 in, float32 inside: every forward output within bf16 rounding of the float32 computation.
  errors = {(r["method"], r["causal"], r["seq_len"]): r["rel_error"] for r in ok if r["pass"] == "fwd"}
  assert errors and all(0 < e < 2e-2 for e in errors.values()), errors
  assert (tmp_path / "speed_memory_vs_length.png").exists()
  assert len((tmp_path / "records.jsonl").read_text().splitlines()) == len(records)


@pytest.mark.slow
def test_speed_memory_is_measured_in_a_fresh_process():
  from experiments.studies import isolation

  job = dict(seq_len=4096, batch=1, heads=2, head_dim=16, num_features=32, dtype="float32", repeats=1,
             memory="process", memory_limit_bytes=2 ** 34, scan_max_len=4096, matmul_gflops_per_s=1.0,
             causal=False, **{"pass": "fwd"})
  exact = isolation.spawn("experiments.studies.speed", dict(job, method="softmax"))
  favor = isolation.spawn("experiments.studies.speed", dict(job, method="favor"))
  # [H, L, L] float32 logits: exact attention holds them at least once (134 MB, far above the
  # ~10 MB the runtime's first run adds); FAVOR needs no [L, L] array.
  logits = 4096 * 4096 * 2 * 4
  assert exact["status"] == favor["status"] == "ok"
  assert exact["peak_bytes"] >= logits > favor["peak_bytes"] > 3 * 4096 * 2 * 16 * 4  # > its inputs


def _job(**fields):
  job = dict(batch=1, heads=1, head_dim=1, num_features=4, dtype="float32", repeats=1, memory="compiled",
             memory_limit_bytes=2 ** 62, scan_max_len=4096, matmul_gflops_per_s=1.0, causal=False,
             method="softmax", **{"pass": "fwd"})
  return dict(job, **fields)


@pytest.mark.slow
def test_speed_records_an_allocation_failure_and_raises_other_errors(monkeypatch):
  from experiments.studies import speed

  # [L, L] logits at L = 2**23 (256 TiB, beyond a 47-bit address space even where the kernel overcommits):
  # XLA's allocation fails with RESOURCE_EXHAUSTED, which is a result.
  assert speed.measure(_job(seq_len=2 ** 23))["status"] == "out_of_memory"

  def wrong_memory_kind(*args, **kwargs):  # a real JAX error that mentions memory, not an allocation failure
    import jax
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_hots")
    return jax.device_put(args[1], sharding)

  monkeypatch.setattr(speed, "median_seconds", wrong_memory_kind)
  with pytest.raises(ValueError, match="Could not find memory"):
    speed.measure(_job(seq_len=64))


def test_speed_names_the_kernels_it_can_time_when_a_method_is_unknown():
  from experiments import main
  from experiments.configs import speed as cfg
  from experiments.studies import speed

  assert "elu_plus_one" not in speed.ESTIMATORS  # timed by its record's name in the quick run above
  config = cfg.get_config("quick")
  config.methods = ("favor", "elu_pluss_one")
  with pytest.raises(ValueError, match=r"unknown \['elu_pluss_one'\].*kernel of core.KERNELS.*elu_plus_one"):
    main.run(config, "/nonexistent/never/written")


@pytest.mark.slow  # the speed study's baselines, not a guarantee of the library
@pytest.mark.parametrize("variant", ["relu", "elu_plus_one", "taylor_d16"])
def test_plain_passes_equal_the_explicit_causal_form_of_the_raw_features(variant):
  """The unstabilised baselines (trax's per-token scan; chunks of 8, rematerialised or not) against the masked
  quadratic form of the same raw features in float64; their names parse, a bidirectional request is refused,
  and a misspelled form is an unknown method."""
  import jax
  import numpy as np

  from experiments import main
  from experiments.configs import speed as cfg
  from experiments.studies import plain_passes, speed

  q, k, v, p = speed.inputs(24, heads=2, head_dim=16, num_features=32)
  e = speed.estimator(variant)
  fq, fk = (np.asarray(f, np.float64) for f in core_kernel_features(e, q, k, p))
  a = np.einsum("blhf,bjhf->bhlj", fq, fk) * np.tril(np.ones((24, 24)))
  want = np.einsum("bhlj,bjhd->blhd", a, np.asarray(v, np.float64)) / a.sum(-1).transpose(0, 2, 1)[..., None]
  for form in plain_passes.FORMS:
    assert plain_passes.split(f"{variant}_plain_{form}") == (variant, form)
    got = plain_passes.attention(e.kernel, form, q, k, v, p, qk_dim=e.qk_dim, chunk=8)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=form)
  assert plain_passes.split(f"{variant}_plain_cumsum") is None
  if variant == "relu":  # positively homogeneous: the same attention at any input scale, which ours keeps
    from favor_jax import core

    tiny = 1e-19  # the raw products underflow: 0/0 in the rows whose features all do
    assert not np.isfinite(plain_passes.attention("relu", "chunked", tiny * q, tiny * k, v, p, chunk=8)).all()
    ours = jax.jit(lambda q, k: core.favor_attention(q, k, v, p, kernel="relu", causal=True, chunk_size=8))(
        tiny * q, tiny * k)
    np.testing.assert_allclose(ours, want, rtol=2e-5, atol=2e-5)
  config = cfg.get_config("quick")
  config.methods, config.causal = (f"{variant}_plain_scan",), (False,)
  with pytest.raises(ValueError, match="time causal attention only"):
    main.run(config, "/nonexistent/never/written")
  config.methods, config.causal = (f"{variant}_plain_cumsum",), (True,)
  with pytest.raises(ValueError, match=r"unknown .*NAME_plain_FORM, FORM one of \('scan', 'chunked'"):
    main.run(config, "/nonexistent/never/written")
  config.methods = ("hybrid_w64_plain_scan", "favor_gated_plain_chunked")  # nothing of a window or gate is there
  with pytest.raises(ValueError, match=r"\['hybrid_w64_plain_scan', 'favor_gated_plain_chunked'\]: the plain"):
    main.run(config, "/nonexistent/never/written")


def core_kernel_features(e, q, k, p):
  """A speed-study variant's raw features [B, L, H, F], from its core record."""
  from favor_jax import core

  kern = core.get_kernel(e.kernel)
  q, k = (q[..., :e.qk_dim], k[..., :e.qk_dim]) if e.qk_dim else (q, k)
  return kern(q, k, p if kern.needs_projection else None, stabilize=False)


def test_speed_summary_states_a_crossover_only_for_baselines_the_run_timed():
  from experiments.configs import speed as cfg
  from experiments.studies import speed

  def record(method, seq_len, seconds):
    return _job(method=method, seq_len=seq_len, status="ok", median_s=seconds, peak_bytes=2 ** 20,
                gflops_per_s=1.0, fraction_of_matmul=0.1)

  favor_only = [record("favor", 256, 0.2), record("favor", 1024, 0.3)]
  summary = speed.summarize(favor_only, cfg.get_config())
  assert "crossover" not in summary  # softmax was not timed: no claim either way
  with_softmax = favor_only + [record("softmax", 256, 0.1), record("softmax", 1024, 0.9)]
  summary = speed.summarize(with_softmax, cfg.get_config())
  assert "- crossover: FAVOR+ bidirectional fwd beats softmax from L=1024" in summary
  assert "jax_dot_product_attention" not in summary


def test_peers_without_torch_exits_with_install_hint(monkeypatch):
  from experiments.configs import peers as cfg
  from experiments.studies import peers

  monkeypatch.setattr(peers, "peers_available", lambda: False)
  with pytest.raises(SystemExit, match=r"pip install -e '.\[peers\]'"):
    peers.run(cfg.get_config())


def test_peers_quick_run(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("performer_pytorch")
  from experiments import main
  from experiments.configs import peers as cfg

  records = main.run(cfg.get_config("quick"), str(tmp_path))
  leak = {r["library"]: r["max_abs_change_before_t"] for r in records if r["kind"] == "causal_leak"}
  assert leak["favor_jax"] == 0.0  # ours is causal; the peer's global key max is not (recorded, not asserted)
  assert {r["library"] for r in records if r["kind"] == "timing"} == {"favor_jax", "performer_pytorch"}


@pytest.mark.slow
def test_showcase_quick_run_writes_one_table_one_figure_and_the_finding(tmp_path):
  import math

  from experiments import main
  from experiments.configs import common
  from experiments.configs import showcase as cfg
  from experiments.studies import showcase

  excerpt = str(ROOT / "tests" / "data" / "shakespeare")
  overrides = {"data.text_dir": excerpt, "data.valid_plays": ("tempest",), "model.num_layers": 1,
               "train.steps": 6, "train.log_every": 3, "train.eval_every": 3, "train.checkpoint_every": 3,
               "long.length": 64}
  config = common.set_fields(cfg.get_config("quick"), overrides)
  records = main.run(config, str(tmp_path), overrides)
  assert [r["name"] for r in records] == ["softmax", "favor_positive_window"]
  for r in records:
    assert r["long_length"] == 64 and r["long_step_s"] > 0 and r["long_bytes"] > 0 and math.isfinite(r["eval_bpc"])
  summary = (tmp_path / "summary.md").read_text()
  assert summary.count("| run |") == 1 and "| softmax | softmax |" in summary and "s/step at L=64" in summary
  assert showcase.finding(records) in summary and summary.count("After 6 steps, positive M=64 + window 16") == 1
  assert (tmp_path / "showcase.png").exists() and not list(tmp_path.glob("*/run_config.json"))[0].read_text().count(
      "long")  # the study's own fields are not a run's: resuming does not depend on them
  with pytest.raises(ValueError, match="config.long.repeats must be an int >= 1"):
    main.run(common.set_fields(cfg.get_config("quick"), {"long.repeats": 0}), str(tmp_path / "bad"))


def test_showcase_finding_names_the_best_linear_time_run_against_softmax():
  from experiments.studies import showcase
  base = dict(task="shakespeare", kernel="positive", num_features=64, redraw_every=0, window=0, qk_head_dim=0,
              short_conv=0, steps=300, seed=0, long_length=8192)
  records = [dict(base, name="softmax", attention="softmax", eval_bpc=2.80, long_step_s=10.0, long_bytes=8 * 2**30),
             dict(base, name="favor", attention="favor", eval_bpc=3.10, long_step_s=0.5, long_bytes=2**30),
             dict(base, name="window", attention="favor", window=16, eval_bpc=2.79, long_step_s=0.4, long_bytes=2**29)]
  text = showcase.finding(records)
  # Within showcase.TIE: a tie on one seed, said as such, never "matches" or "equal".
  assert text.startswith("After 300 steps, positive M=64 + window 16 is within 0.4% of softmax's bits/char "
                         "(2.790 against 2.800, 0.996×, one seed): a gap under the 3% this study counts as a tie, "
                         "not a claim of equal quality;")
  assert "0.40 s against softmax's 10.00 s (25× faster) in 16.0× less memory" in text
  assert text.endswith("; the others' bits/char: positive M=64 1.107× softmax's.")
  assert "match" not in text and "equal quality;" in text
  records[2]["eval_bpc"] = 2.70  # only a gap beyond TIE is a difference, with its size and its evidence
  assert "window 16 is 3.6% better than softmax in bits/char (2.700 against 2.800, 0.964×, one seed)" in (
      showcase.finding(records))
  records[2]["eval_bpc"], records[1]["eval_bpc"] = 2.90, 3.00
  assert "window 16 is 3.6% worse than softmax in bits/char" in showcase.finding(records)
  for r in records:  # settings averaged over seeds (sweep.mean_over_seeds) say so
    r["seeds"] = [0, 1]
  assert "the mean of 2 seeds" in showcase.finding(records)


def test_committed_showcase_summary_states_what_the_finding_rule_says():
  """summary.md of the committed main job carries the sentence the finding rule makes of its results.json (a
  rule changed without regenerating the summary, or a hand-edited summary, fails here)."""
  from experiments.studies import showcase
  results = ROOT / "experiments" / "results" / "showcase_cpu"
  text = showcase.finding(json.loads((results / "results.json").read_text()))
  assert text in (results / "summary.md").read_text()
  assert "one seed" in text and "not a claim of equal quality" in text


def test_the_speed_study_times_softmax_through_jax_beside_ours():
  """jax.nn.dot_product_attention is a method of the study (XLA on a CPU): its output is the float64 explicit form's,
  its FLOPs the counting module's, and the summary sets our reference against it."""
  import jax.numpy as jnp
  import numpy as np

  from experiments.configs import speed as cfg
  from experiments.studies import speed

  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((1, 16, 2, 8)) for _ in range(3))
  s = np.einsum("blhd,bmhd->bhlm", q, k) / np.sqrt(8) + np.where(np.tri(16, dtype=bool), 0, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  expected = np.einsum("bhlm,bmhd->blhd", w / w.sum(-1, keepdims=True), v)
  got = speed.method("jax_dot_product_attention", False)(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), None, True)
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5)
  # XLA on a CPU forms the whole product: counted whole; cuDNN skips the blocks above the diagonal
  assert speed.flops("jax_dot_product_attention", True, 1, 16, 2, 8, 0) == 16 * 2 * (4 * 16 * 8)  # B·L·H·4LD
  assert speed.flops("jax_dot_product_attention", True, 1, 16, 2, 8, 0, on_gpu=True) == 16 * 2 * (2 * 16 * 8)

  def record(method, seconds, nbytes):
    return _job(method=method, seq_len=256, status="ok", median_s=seconds, peak_bytes=nbytes, gflops_per_s=1.0,
                fraction_of_matmul=0.1)
  summary = speed.summarize([record("softmax", 0.3, 2 ** 21), record("jax_dot_product_attention", 0.2, 2 ** 20)],
                            cfg.get_config())
  assert "- L=256 bidirectional fwd: our softmax / jax.nn.dot_product_attention = 1.50× time, 2.00× memory" in summary


@pytest.mark.slow
def test_a_tiny_speed_job_times_jax_dot_product_attention():
  from experiments.studies import speed
  from experiments.train import flops

  rec = speed.measure(_job(method="jax_dot_product_attention", seq_len=16, heads=2, head_dim=8, causal=True))
  work = 16 * 2 * flops.softmax_flops(16, 8, causal=True)
  assert rec["status"] == "ok" and rec["gflops_per_s"] == pytest.approx(work / rec["median_s"] / 1e9)
