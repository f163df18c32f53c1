"""A gated FAVOR+ language model with an exact window, on your text or token file (Shakespeare when none is given).

    python -m experiments.main --config=experiments/configs/text.py --workdir=workdir/text \
        --config.data.path=/data/my_corpus/          # a UTF-8/bytes file or a folder of them
    python -m experiments.main --config=experiments/configs/text.py --workdir=workdir/text \
        --config.data.token_file=/data/tokens.bin --config.data.vocab_size=50257   # raw uint16 ids
    python -m experiments.tokenize --corpus=/data/my_corpus/ --vocab_size=8192 --out=/data/bpe8k   # your tokenizer
    python -m experiments.main --config=experiments/configs/text.py --workdir=workdir/text \
        --config.data.token_file=/data/bpe8k/tokens.npy --config.data.tokenizer=/data/bpe8k/tokenizer.json \
        --config.data.document_separator=0
    python -m experiments.main --config=experiments/configs/text.py:quick --workdir=/tmp/text   # CPU size

One run (named "run"); more are variants as in every training config, e.g.
``--config.variants='(("favor", {}), ("softmax", {"attention.type": "softmax"}))'``. docs/training.md is the guide.
"""

from experiments.configs import common


def get_config(arg=None):
  """An accelerator-sized small LM (4 × 256, 512 tokens); ``arg="quick"``: CPU size (2 × 128, 128 tokens)."""
  quick = common.is_quick(arg)
  config = common.training_config("text", "text", quick)
  config.data.path = ""  # a file or folder of files read as bytes (vocab 256); "" (and no token_file): Shakespeare
  # data.glob: keep only the data.path folder's files whose path relative to it matches (fnmatch; * also crosses
  # folders): "*.txt" takes every .txt file below it; "" takes every file that is not hidden
  config.data.glob = ""
  config.data.token_file = ""  # token ids instead: a .npy array, or raw data.token_dtype with data.vocab_size
  config.data.token_dtype = "uint16"  # a raw token file's ids: "uint16" or "uint32" (little-endian)
  config.data.vocab_size = 0  # the token file's vocabulary (0: bytes' 256, data.tokenizer's, a .npy's largest id + 1)
  config.data.document_separator = -1  # the token id that ends a document in the token file (-1: none)
  config.data.tokenizer = ""  # the token file's tokenizer JSON (experiments.tokenize): bits per byte, text prompts
  config.data.valid_files = ()  # files of the data.path folder held out (names relative to it); () = a fraction
  config.data.valid_fraction = 0.05  # without valid_files: the last this fraction of the tokens is held out
  config.data.seq_len = 512  # tokens per training window
  config.data.num_eval_batches = 16  # held-out windows per evaluation = this × train.batch_size
  config.data.pack = True  # windows carry segment ids: no attention across a document boundary
  config.data.eval_lengths = ()  # final evaluation also at these lengths (as many tokens each)
  config.model.update(d_model=256, num_layers=4, num_heads=4, mlp_dim=1024)  # 3.2M parameters at vocab 256
  config.attention.update(type="favor", kernel="positive", num_features=64, window=64, forget_gate=True)
  config.mesh.data = -1  # the batch split over every device present (a number: that many; the rest idle, said so)
  config.train.update(steps=5000, batch_size=32, lr=1e-3, warmup_steps=200, eval_every=500, checkpoint_every=500)
  if quick:
    config.data.update(seq_len=128, num_eval_batches=4)
    config.model.update(d_model=128, num_layers=2, num_heads=4, mlp_dim=256)
    config.attention.update(num_features=32, window=16)
    config.train.update(steps=200, batch_size=16, lr=3e-3, warmup_steps=20, log_every=25, eval_every=100,
                        checkpoint_every=100)
    config.mesh.data = 1  # one device, as the committed CPU run (experiments/results/text_cpu) trained
  return config
