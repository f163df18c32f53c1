"""A 12 × 768 gated FAVOR+ language model in bfloat16, context 4096, for a TPU slice (data + FSDP over every chip).

    python -m experiments.main --config=experiments/configs/lm_base.py --workdir=/mnt/shared/lm_base \
        --config.data.token_file=/data/tokens.bin --config.data.vocab_size=32000 --config.mesh.distributed=True
    python -m experiments.main --config=experiments/configs/lm_base.py:quick --workdir=/tmp/lm_base   # CPU smoke

On a multi-host slice every host runs the same command (docs/training.md: the launch). Size: 85M parameters
with bytes (vocab 256), 110M with a 16k vocabulary, 134M with 32k (12 blocks of 7.1M; embedding and head
2·V·768). Cost (experiments/train/flops.py, docs/training.md): 0.70 GFLOP per trained token at vocab 256
(train = 3 × forward, attention included, causal blocks counted whole as computed; 0.84 at 32k), so a step of
64 × 4096 = 262,144 tokens is 182 TFLOP: 0.29 s on a v5e-8 (8 × 197 TFLOP/s) at an assumed 40% MFU, 0.12 s on 8
v5p chips (8 × 459); none measured. Memory per
chip with FSDP over 8: parameters, gradients and AdamW's two moments in float32, 16 bytes × 85M / 8 = 170 MB;
activations with model.remat="block": each block's bfloat16 input kept, microbatch 2 per chip × 4096 × 768 ×
2 B × 12 blocks = 150 MB, plus one block recomputed at a time (its float32 features [2, 4096, 12, 256] and MLP
hidden [2, 4096, 3072]: about 0.2 GB): under 1 GB of a v5e's 16 GB, room for a longer context or a larger batch.
"""

from experiments.configs import common, text


def get_config(arg=None):
  """The slice's run; ``arg="quick"``: the same model shrunk to 2 × 64 (seconds on a CPU, for the tests)."""
  quick = common.is_quick(arg)
  config = text.get_config()  # the text task's data fields: data.path / data.token_file, split, packing
  config.config_name = "lm_base"  # this file
  config.quick = quick
  config.data.update(seq_len=4096, num_eval_batches=4, pack=True,
                     eval_lengths=(16384,))  # the final evaluation also at 4× the training context
  config.model.update(d_model=768, num_layers=12, num_heads=12, mlp_dim=3072, positions="rotary",
                      dtype="bfloat16", param_dtype="float32", remat="block")
  config.attention.update(type="favor", kernel="positive", num_features=256, window=256, forget_gate=True,
                          chunk_size=256)  # M = 256 features per head (head dim 64); exact window of 256 keys
  config.train.update(steps=20000, batch_size=64, grad_accum_steps=4,  # 64 × 4096 tokens per update, 4 microbatches
                      lr=6e-4, warmup_steps=1000, b2=0.95, weight_decay=0.1, log_every=50, eval_every=1000,
                      checkpoint_every=500)
  config.mesh.update(data=-1, fsdp=True)  # the batch and every parameter split over all the chips (-1: every device)
  if quick:
    config.data.update(seq_len=64, num_eval_batches=1, eval_lengths=(128,))
    config.model.update(d_model=64, num_layers=2, num_heads=2, mlp_dim=128)
    config.attention.update(num_features=16, window=8, chunk_size=16)
    config.train.update(steps=4, batch_size=8, grad_accum_steps=2, warmup_steps=1, log_every=2, eval_every=4,
                        checkpoint_every=2)
    config.mesh.update(data=1, fsdp=False)
  return config
