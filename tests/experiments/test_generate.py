"""Generation: decoding an experiments LM (FAVOR's constant-size state, softmax's key-value cache) gives the full
forward pass's next-token distributions (rotary positions, grouped-query heads, a forget gate, a window, a short
convolution), and ``experiments.generate`` samples N tokens from a run directory's checkpoint."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments import generate, main
from experiments.configs import common
from experiments.configs import shakespeare as cfg
from experiments.train import checkpointing, generation, models, training

ROOT = pathlib.Path(__file__).resolve().parents[2]
L, PROMPT = 12, 5
TINY = {"data.text_dir": str(ROOT / "tests" / "data" / "shakespeare"), "data.valid_plays": ("tempest",),
        "data.seq_len": 16, "data.num_eval_batches": 1, "model.d_model": 32, "model.num_layers": 2,
        "model.num_heads": 4, "model.mlp_dim": 64, "model.num_kv_heads": 2, "attention.num_features": 16,
        "attention.chunk_size": 4, "train.batch_size": 2}
CASES = {
    "favor_rotary_gqa_gated_window_conv": {"attention.type": "favor", "attention.forget_gate": True,
                                           "attention.window": 3, "model.short_conv": 3},
    "favor_learned_positions_alibi": {"attention.type": "favor", "attention.alibi": True,
                                      "model.positions": "learned", "model.num_kv_heads": 1},
    "softmax_rotary_gqa_kv_cache": {"attention.type": "softmax"},
    # the Forgetting Transformer: the cache keeps each key's decay (its log gates' running sum) beside it
    "softmax_rotary_gqa_forget_gate_kv_cache": {"attention.type": "softmax", "attention.forget_gate": True},
    "softmax_learned_positions_alibi_kv_cache": {"attention.type": "softmax", "attention.alibi": True,
                                                 "model.positions": "learned"},
    # one FAVOR state per key/value head (ungated, a shared projection: exact)
    "favor_rotary_gqa_state_per_kv_head": {"attention.type": "favor"},
}


def _config(fields):
  return common.set_fields(cfg.get_config("quick"), {**TINY, **fields})


def _variables(model, seed=0):
  """Initial variables with every parameter moved at random (a forget gate's weight is zero at init)."""
  variables = jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, L), jnp.int32))
  leaves, tree = jax.tree.flatten(variables["params"])
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  return {"params": params, "favor": variables.get("favor", {})}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_decoding_gives_the_full_passes_next_token_distributions(case):
  config = _config(CASES[case])
  full_model = models.make_model(config, 256, 0, L)
  variables = _variables(full_model)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, L), 0, 256)
  want = jax.nn.softmax(jax.jit(full_model.apply)(variables, tokens), -1)
  model = generation.decoder(config, variables, L)
  cache = generation.empty_cache(model, 2)
  logits, cache = generation.decode_step(model, variables, cache, tokens[:, :PROMPT])
  got = [logits]
  for t in range(PROMPT, L):
    logits, cache = generation.decode_step(model, variables, cache, tokens[:, t:t + 1])
    got.append(logits)
  np.testing.assert_allclose(jax.nn.softmax(jnp.concatenate(got, 1), -1), want, atol=2e-5)
  def sizes(n):  # the cache's shapes for sequences of n tokens (traced, not compiled)
    decoder = generation.decoder(config, variables, n)
    return [x.shape for x in jax.tree.leaves(jax.eval_shape(decoder.init, jax.random.PRNGKey(0),
                                                            jnp.zeros((2, 1), jnp.int32))["cache"])]
  if config.attention.type == "favor":  # the state does not grow with the length decoded
    assert sizes(L) == sizes(L // 2)
  else:  # the key-value cache has one key and value per position, of the key/value heads only
    assert cache["block_0"]["attention"]["keys"].shape == (2, L, 2, 8) and sizes(L) != sizes(L // 2)


def _greedy_by_full_pass(model, variables, prompt, tokens):
  """Whether each token is the argmax of the full forward pass over the prompt and the tokens before it (one
  causal pass over the whole sequence gives every position's next-token logits)."""
  logits = jax.jit(model.apply)(variables, jnp.asarray([list(prompt) + tokens]))[0]
  return [int(t) for t in jnp.argmax(logits[len(prompt) - 1:-1], -1)] == tokens


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A FAVOR run's directory as training leaves it (config.json above it, run_config.json, a checkpoint), its
  state the initial one with the parameters moved at random."""
  workdir = tmp_path_factory.mktemp("study")
  config = _config(CASES["favor_rotary_gqa_gated_window_conv"])
  setup = training.build(config)
  state = setup.state._replace(params=_variables(setup.model)["params"], step=jnp.int32(3))
  run = workdir / "favor"
  run.mkdir()
  checkpoints = ocp.CheckpointManager(str(run / "checkpoints"))
  checkpoints.save(3, args=ocp.args.StandardSave(state))
  checkpoints.wait_until_finished()
  main.write_config(config, str(workdir))
  checkpointing.record_run_config(str(run), config)
  return str(run), setup.model, {"params": state.params, "favor": state.favor}


@pytest.mark.slow
def test_generate_gives_n_tokens_greedy_as_the_full_pass_for_a_ragged_batch(run_dir):
  workdir, model, variables = run_dir
  config, loaded, step = generation.load_run(workdir)
  assert step == 3 and config.model.num_kv_heads == 2 and config.attention.forget_gate
  prompts = [list(b"ROMEO:"), list(b"To")]
  new = generation.generate(config, loaded, prompts, 4, temperature=0.0)
  assert [len(t) for t in new] == [4, 4]
  for prompt, tokens in zip(prompts, new):
    assert _greedy_by_full_pass(model, variables, prompt, tokens)
  assert generation.generate(config, loaded, prompts, 4, temperature=0.7, top_k=1) == new  # top-1 is greedy
  texts = generate.run(workdir, ["ROMEO:", "To"], 4, temperature=1.0, seed=3)
  assert texts == generate.run(workdir, ["ROMEO:", "To"], 4, temperature=1.0, seed=3)  # a seed repeats
  assert texts == [generation.decode(t) for t in generation.generate(config, loaded, prompts, 4, seed=3)]


@pytest.mark.slow
def test_generate_refuses_bad_arguments_by_name(run_dir, tmp_path):
  workdir, _, _ = run_dir
  config, loaded, _ = generation.load_run(workdir)
  for kwargs, message in [(dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
                          (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
                          (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
                          (dict(top_k=300), r"top_k must be an int in \[0, 256\]")]:
    with pytest.raises(ValueError, match=message):
      generation.generate(config, loaded, [[1, 2]], **{"max_new_tokens": 2, **kwargs})
  with pytest.raises(ValueError, match="every prompt needs at least one token"):
    generation.generate(config, loaded, [[1], []], 2)
  with pytest.raises(ValueError, match="holds no checkpoint"):
    generation.load_run(str(tmp_path))
  with pytest.raises(ValueError, match="has 64 ids, not 256 bytes, and the run holds no tokenizer"):
    generation.encode("hi", 64)
  assert os.path.exists(os.path.join(os.path.dirname(workdir), "config.json"))


def test_temperatures_whose_quotient_overflows_sample_the_most_likely_token():
  """Below float32's smallest normal number 1/temperature overflows (and the temperature itself rounds to 0 below
  ~7e-46); such temperatures, and any small one over large logits, give the argmax, as temperature 0 does."""
  logits = jnp.asarray([[3.0, 50.0, -2.0, 49.0], [100.0, -100.0, 0.0, 99.0]])
  greedy = np.argmax(np.asarray(logits), -1).tolist()
  for temperature in (1e-30, generation.MIN_TEMPERATURE, 1e-39, 1e-45, 5e-324):
    for top_k in (0, 2):
      for seed in range(3):
        got = generation.sample(logits, jax.random.PRNGKey(seed), temperature, top_k)
        assert np.asarray(got).tolist() == greedy, (temperature, top_k, seed)
  generation.check_sampling(4, 1e-39, 0, 256)  # accepted: it behaves as greedy
  for bad in (float("nan"), float("inf"), -1e-39):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
      generation.check_sampling(4, bad, 0, 256)


def test_a_prompt_of_any_bytes_encodes_as_its_bytes():
  raw = bytes([0x52, 0xFF, 0xC3, 0x80, 0xFE, 0x00])
  as_argv = raw.decode("utf-8", "surrogateescape")  # how Python hands a command line's bytes to the program
  assert generation.encode(as_argv, 256) == list(raw) == generation.encode(raw, 256)
  assert generation.decode_bytes(list(raw)) == raw
  assert generation.decode(list(raw)) == raw.decode("utf-8", "replace")


@pytest.mark.slow
def test_generation_skips_a_damaged_newest_checkpoint_as_training_does(run_dir, tmp_path):
  """A newer checkpoint whose manifest is zeroed (orbax: OUT_OF_RANGE) is named and skipped; the one before it
  is loaded, and nothing is moved (generation only reads the run)."""
  import shutil
  workdir, model, variables = run_dir
  study = tmp_path / "study"
  shutil.copytree(os.path.dirname(workdir), study)
  run = study / os.path.basename(workdir)
  shutil.copytree(run / "checkpoints" / "3", run / "checkpoints" / "7")
  manifest = run / "checkpoints" / "7" / "default" / "manifest.ocdbt"
  manifest.write_bytes(bytes(manifest.stat().st_size))
  said = []
  config, loaded, step = generation.load_run(str(run), said.append)
  assert step == 3 and len(said) == 1 and said[0].startswith("the checkpoint at step 7 cannot be restored")
  for a, b in zip(jax.tree.leaves(loaded["params"]), jax.tree.leaves(variables["params"])):
    np.testing.assert_array_equal(a, b)
  assert sorted(os.listdir(run / "checkpoints")) == ["3", "7"]
  manifest3 = run / "checkpoints" / "3" / "default" / "manifest.ocdbt"
  manifest3.write_bytes(bytes(manifest3.stat().st_size))
  with pytest.raises(ValueError, match=r"no checkpoint in .* can be restored \(step 7: .*; step 3: "):
    generation.load_run(str(run))
