"""The training stack: models, the train step, the loop, checkpointing, metrics, sharding, config checks,
generation, the sweep over variants and its figures. Imports ``experiments.tasks`` and ``experiments.configs``,
never the studies."""
