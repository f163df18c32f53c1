"""Your own tokenizer end to end (issue 52): the byte-level BPE learned by ``experiments.tokenize`` encodes any
bytes and decodes them back, its token file trains the text task with bits per byte (= bits per token × tokens ÷
bytes of the held-out text), and ``experiments.generate`` takes text in and gives text out with it."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import generate, main, tokenize
from experiments.configs import common, text
from experiments.tasks import tokenizer
from experiments.train import metrics

tokenizers = pytest.importorskip("tokenizers")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ("the", "king", "queen", "speaks", "to", "a", "fool", "and", "his", "crown", "falls", "now", "thou", "art")


def _prose(seed: int, words: int) -> bytes:
  rng = np.random.default_rng(seed)
  return (" ".join(WORDS[i] for i in rng.choice(len(WORDS), words)) + "\n").encode()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A folder of three ASCII documents and the tokenizer and token file ``experiments.tokenize`` makes of it."""
  root = tmp_path_factory.mktemp("tok")
  folder = root / "corpus"
  folder.mkdir()
  for i in range(3):
    (folder / f"doc{i}.txt").write_bytes(_prose(i, 1500))
  record = tokenize.run(str(folder), 300, str(root / "bpe"))
  return folder, root / "bpe", record


def test_the_byte_alphabet_is_the_librarys():
  """GPT-2's byte table, as the ByteLevel pre-tokenizer maps every byte of UTF-8 text (all 256 byte values occur
  in the characters below U+0800, U+FFFF and U+10FFFF's encodings but C0, C1, F5–FF: the set covers those)."""
  alphabet = tokenizer.byte_alphabet()
  assert sorted(alphabet) == list(range(256))
  assert set(alphabet.values()) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  sample = "".join(map(chr, [*range(1, 0x800), 0xFFFF, 0x10FFFF, 0x1F600]))
  assert "".join(t for t, _ in level.pre_tokenize_str(sample)) == "".join(alphabet[b] for b in sample.encode())


def test_any_bytes_encode_and_decode_back(corpus):
  _, out, record = corpus
  learned = tokenizer.load(str(out / "tokenizer.json"))
  assert learned.get_vocab_size() == record["vocab_size"] <= 300
  sizes = tokenizer.token_bytes(learned)
  rng = np.random.default_rng(0)
  cases = [bytes(rng.integers(0, 256, 400, dtype=np.uint8)), b"the king \xff\xfe speaks", "h\u00e9 \u2713".encode(),
           b"text that spells <|endoftext|> is text", b""]
  for data in cases:
    ids = tokenizer.encode(learned, data)
    assert tokenizer.decode(learned, ids) == data
    assert int(sizes[ids].sum()) == len(data)  # every id's bytes counted, the special token's name included
    assert 0 not in ids  # the end-of-document id comes only from the token file's writer
  beyond = learned.get_vocab_size()  # a padded model vocabulary's id: no bytes, shown as itself
  assert tokenizer.decode(learned, [0, beyond]) == f"<|endoftext|><{beyond}>".encode()
  ascii_text = _prose(9, 50).decode()
  assert tokenizer.encode(learned, ascii_text.encode()) == learned.encode(ascii_text).ids  # the library's BPE


def test_the_token_file_holds_each_documents_ids_and_an_end(corpus):
  folder, out, record = corpus
  learned = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
  tokens = np.load(out / "tokens.npy")
  documents = [learned.encode((folder / f"doc{i}.txt").read_text()).ids + [0] for i in range(3)]
  assert tokens.dtype == np.uint16 and tokens.tolist() == sum(documents, [])
  assert record["bytes"] == sum(len((folder / f"doc{i}.txt").read_bytes()) for i in range(3))
  assert record["tokens"] == len(tokens) and record["bytes_per_token"] > 1.5  # merges learned


def _tiny_token_config(out, **fields):
  config = text.get_config("quick")
  config.data.update(token_file=str(out / "tokens.npy"), tokenizer=str(out / "tokenizer.json"), document_separator=0,
                     seq_len=32, num_eval_batches=2, valid_fraction=0.2)
  config.model.update(d_model=32, num_layers=1, num_heads=2, mlp_dim=64)
  config.attention.update(num_features=16, window=0, chunk_size=8)
  config.train.update(steps=8, batch_size=4, warmup_steps=1, log_every=4, eval_every=8, checkpoint_every=8)
  return common.set_fields(config, fields)


def test_held_out_bytes_are_the_decoded_targets(corpus):
  """The denominator of bits per byte: the held-out targets' text as the library decodes it (ASCII, so each
  token decodes alone; the end-of-document id, a special token, decodes to nothing)."""
  _, out, record = corpus
  from experiments import tasks
  config = _tiny_token_config(out)
  task = tasks.make_task(config)
  assert task.metric == "eval_bits_per_byte" and task.vocab_size == len(task.token_bytes) == record["vocab_size"]
  learned = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
  want = sum(w * len(learned.decode([int(t)]).encode()) for b in task.eval_batches
             for w, t in zip(b.weights.ravel(), b.targets.ravel()))
  assert metrics.held_out_bytes(task.eval_batches, task.token_bytes) == want > 0
  got = metrics.lm_metrics(loss_sum=123.0, weight_sum=40.0, num_bytes=100.0)
  assert got["eval_bits_per_token"] == pytest.approx(123.0 / 40.0 / math.log(2))
  assert got["eval_perplexity"] == pytest.approx(math.exp(123.0 / 40.0))
  assert got["eval_bits_per_byte"] == pytest.approx(123.0 / math.log(2) / 100.0)
  assert "eval_bits_per_byte" not in metrics.lm_metrics(1.0, 1.0, float("nan"))  # bytes unknown: none


def test_a_tokenizer_without_its_token_file_or_too_small_a_vocabulary_is_refused(corpus, tmp_path):
  _, out, _ = corpus
  from experiments import tasks
  config = _tiny_token_config(out, **{"data.token_file": "", "data.document_separator": -1})
  with pytest.raises(ValueError, match="data.tokenizer=.* names the tokenizer of a data.token_file"):
    tasks.check_data(config)
  with pytest.raises(ValueError, match="data.vocab_size=100 is smaller than data.tokenizer's vocabulary"):
    tasks.make_task(_tiny_token_config(out, **{"data.vocab_size": 100}))
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(ValueError, match="data.tokenizer=.*bad.json.* is not a tokenizers JSON file"):
    tasks.make_task(_tiny_token_config(out, **{"data.tokenizer": str(tmp_path / "bad.json")}))
  with pytest.raises(ValueError, match="vocab_size must be an int >= 257"):
    tokenize.run(str(tmp_path / "bad.json"), 200, str(tmp_path / "o"))


@pytest.mark.slow
def test_the_tokenizer_trains_a_run_and_generate_takes_text_in_and_gives_text_out(corpus, tmp_path):
  _, out, _ = corpus
  workdir = tmp_path / "study"
  config = _tiny_token_config(out)
  main.run(config, str(workdir))
  run = workdir / "run"
  assert (run / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()  # kept in the run
  with open(run / "metrics.jsonl") as f:
    evals = [r for r in map(json.loads, f) if r["kind"] == "eval"]
  from experiments import tasks
  task = tasks.make_task(config)
  tokens = sum(float(b.weights.sum()) for b in task.eval_batches)
  learned = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
  num_bytes = sum(w * len(learned.decode([int(t)]).encode()) for b in task.eval_batches
                  for w, t in zip(b.weights.ravel(), b.targets.ravel()))
  for r in evals:
    assert "eval_bpc" not in r  # bits per token are not bits per character
    assert r["eval_bits_per_token"] == pytest.approx(r["eval_loss"] / math.log(2))
    assert r["eval_bits_per_byte"] == pytest.approx(r["eval_bits_per_token"] * tokens / num_bytes)
    assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
  assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
  summary = (workdir / "summary.md").read_text()
  assert "eval_bits_per_byte" in summary and f"{evals[-1]['eval_bits_per_byte']:.4f}" in summary
  # Text in, text out: the prompt's tokens are the tokenizer's, the continuation decodes with it.
  (prompt, new), = generate.sample_run(str(run), ["the king"], 6, temperature=0.0)
  assert prompt == b"the king" and len(new) > 0
  ids = generate.sample_run(str(run), [tokenizer.encode(learned, b"the king")], 6, temperature=0.0)
  assert ids == [(prompt, new)]  # --prompt_ids gives the same as the text it encodes
  assert generate.run(str(run), ["the king"], 6, temperature=0.0) == [new.decode("utf-8", "replace")]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-m", "experiments.generate", f"--workdir={run}", "--prompt=the king",
                         "--prompt_ids=5,6", "--max_new_tokens=6", "--temperature=0"], cwd=REPO, env=env,
                        capture_output=True)
  assert done.returncode == 0, done.stderr.decode()[-3000:]
  assert done.stdout.startswith(b"--- 'the king'\n" + prompt + new + b"\n--- [5, 6]\n"), done.stdout
  bad = subprocess.run([sys.executable, "-m", "experiments.generate", f"--workdir={run}", "--prompt=x",
                        "--top_k=100000"], cwd=REPO, env=env, capture_output=True, text=True)
  assert bad.returncode == 1 and bad.stdout == ""
  assert bad.stderr.strip().splitlines() == [f"error: top_k must be an int in [0, {task.vocab_size}] (0: every "
                                             "token), got 100000"]


def test_the_run_keeps_its_tokenizer_and_a_resume_must_give_the_same(corpus, tmp_path):
  from experiments.train import checkpointing
  _, out, _ = corpus
  run = tmp_path / "run"
  run.mkdir()
  checkpointing.record_tokenizer(str(run), _tiny_token_config(out), fresh=True)
  assert (run / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
  moved = tmp_path / "moved.json"
  moved.write_bytes((out / "tokenizer.json").read_bytes())
  checkpointing.record_tokenizer(str(run), _tiny_token_config(out, **{"data.tokenizer": str(moved)}), fresh=False)
  tokenizer.train([b"other text entirely"], 300).save(str(tmp_path / "other.json"))
  other = _tiny_token_config(out, **{"data.tokenizer": str(tmp_path / "other.json")})
  with pytest.raises(ValueError, match="is not the tokenizer .* was trained with"):
    checkpointing.record_tokenizer(str(run), other, fresh=False)
  checkpointing.record_tokenizer(str(run), other, fresh=True)  # a fresh start replaces it
  assert (run / "tokenizer.json").read_bytes() == (tmp_path / "other.json").read_bytes()
