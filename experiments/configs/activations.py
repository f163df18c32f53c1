"""Approximation on real activations: every estimator's error on a trained Shakespeare model's q, k, v vs F.

    python -m experiments.main --config=experiments/configs/activations.py --workdir=workdir/activations
    python -m experiments.main --config=experiments/configs/activations.py:quick --workdir=/tmp/act

The model (the Shakespeare quick config's softmax run, 1200 steps, about 8 min on 2 CPU cores) is trained in
``WORKDIR/model`` on the first run and resumed from there after; ``--config.model_dir=DIR`` uses another run
directory of the same model config (e.g. the Shakespeare sweep's ``softmax`` run).
"""

import ml_collections

from experiments.configs import common, shakespeare


def get_config(arg=None):
  """The study; ``arg="quick"``: a smoke version (a model trained 100 steps, F = 64 only, short fits)."""
  quick = common.is_quick(arg)
  config = ml_collections.ConfigDict()
  config.experiment = "activations"  # which study experiments.main runs
  config.quick = quick  # True: the quick version (FILE.py:quick); set on the full one, asks for it
  config.seed = 0  # seed of the projection draws and of the fitted maps' initialisation
  config.model = shakespeare.get_config("quick")  # the captured model's training config: one softmax run
  config.model.variants, config.model.only = (), ""  # (attention.type is softmax, Shakespeare's default)
  config.model_dir = ""  # run directory of the trained model ("" = WORKDIR/model, trained there if needed)
  config.fit_batches = 2  # held-out batches (of model.train.batch_size) that fit maps and statistics
  config.measure_batches = 2  # the next held-out batches, on which the errors are measured
  config.features = (64, 128, 256)  # F: features per head each estimator may use (at most)
  config.num_draws = 4  # random projections averaged per estimator and F
  config.fit_sequences = 8  # of those, the sequences the maps are distilled on (the weights cost B·H·L²·F)
  config.fit_steps = 60  # Adam steps fitting Hedgehog's and Taylor's maps (distillation loss)
  config.fit_lr = 3e-2  # their learning rate
  # Names in experiments.studies.activations.ESTIMATORS.
  config.estimators = ("favor+", "hyperbolic", "favor++", "favor#", "favor+ + window 16", "taylor (fitted)",
                       "hedgehog (fitted)")
  if quick:
    config.model.train.update(steps=100, warmup_steps=10, eval_every=50, checkpoint_every=50)
    config.features = (64,)
    config.num_draws = 2
    config.fit_steps = 10
  return config
