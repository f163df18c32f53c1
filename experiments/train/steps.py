"""The training state and what one step computes: the optimiser, the metric sums, the jitted train step."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from experiments import tasks
from favor_jax.layers import linen as favor_linen
from favor_jax.layers.projection import redraw_due


class TrainState(NamedTuple):
  step: Any  # int32 []: optimizer steps taken
  data_position: Any  # int32 []: training batches consumed
  params: Any
  favor: Any  # FAVOR projections and running statistics ({} for softmax)
  opt_state: Any
  sums_3: Any  # f32 [3]: Σ w·loss, Σ w·correct, Σ w over the current logging window
  nonfinite_step: Any  # int32 []: first step whose loss was not finite, -1 if none


def make_optimizer(t) -> optax.GradientTransformation:
  """AdamW with linear warmup then cosine decay to ``final_lr_fraction``·lr, after global-norm clipping."""
  clip = optax.clip_by_global_norm(t.clip_norm) if t.clip_norm > 0 else optax.identity()
  return optax.chain(clip, optax.adamw(make_lr(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay))


def make_lr(t) -> optax.Schedule:
  """Linear warmup from lr/warmup_steps (not 0: the first step must move) to lr, then cosine decay."""
  start = t.lr / max(t.warmup_steps, 1)
  return optax.warmup_cosine_decay_schedule(start, t.lr, t.warmup_steps, t.steps, t.lr * t.final_lr_fraction)


def metric_sums(logits, batch) -> jax.Array:
  """[Σ w·cross-entropy, Σ w·[argmax correct], Σ w] in f32."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch.targets)
  correct = (jnp.argmax(logits, -1) == batch.targets).astype(jnp.float32)
  w = batch.weights
  return jnp.stack([(ce * w).sum(), (correct * w).sum(), w.sum()])


@functools.partial(jax.jit, static_argnums=0)  # one compilation per model (equal models hash equal)
def _init_variables(model, key, tokens):
  return model.init(key, tokens)  # eagerly, a FAVOR model's init dispatches op by op: several times slower


def init_state(config, model, task, optimizer, params=None) -> TrainState:
  """A fresh state; ``params`` (e.g. a softmax model's) replace the initial ones when given."""
  init_key = jax.random.PRNGKey(config.train.seed)
  variables = _init_variables(model, init_key, jnp.zeros((1, task.max_len), jnp.int32))
  if params is not None:
    if jax.tree.structure(params) != jax.tree.structure(variables["params"]):
      raise ValueError("params do not match the model's parameter tree")
    variables = {**variables, "params": params}
  return TrainState(jnp.int32(0), jnp.int32(0), variables["params"], variables.get("favor", {}),
                    optimizer.init(variables["params"]), jnp.zeros(3, jnp.float32), jnp.int32(-1))


def make_train_step(model, optimizer, redraw_every: int, redraw_key, shardings=None, accum_steps: int = 1):
  """The jitted step; ``shardings`` = (state shardings, batch sharding) pins the layout on a mesh.

  ``accum_steps`` > 1 splits the batch into that many microbatches (rows ``i::accum_steps``, so each stays
  split over the data axis like the whole batch), run one after another: the gradient is the sum of theirs
  over the whole batch's loss weight, the whole batch's gradient up to float32 rounding, with one
  microbatch's activations in memory at a time. Layers' running statistics (FAVOR++'s ρ) pass from one
  microbatch to the next.
  """
  def micro_grads(params, favor, batch: tasks.Batch):
    """(Σ w·loss, Σ w·correct, Σ w) of ``batch`` and the gradient of its Σ w·loss; the layers' updated state."""
    def summed_loss(params):
      packed = {} if batch.segment_ids is None else {"segment_ids": batch.segment_ids}
      logits, updated = model.apply({"params": params, "favor": favor}, batch.tokens, train=True,
                                    mutable=["favor"], **packed)
      sums = metric_sums(logits, batch)
      return sums[0], (sums, updated.get("favor", favor))

    (_, (sums, favor)), grads = jax.value_and_grad(summed_loss, has_aux=True)(params)
    return sums, grads, favor

  def train_step(state: TrainState, batch: tasks.Batch):
    favor = state.favor
    if favor:  # a new projection before the steps where the schedule says so (pure in the step)
      due = redraw_due(state.step, redraw_every)
      favor = favor_linen.redraw({"favor": favor}, jax.random.fold_in(redraw_key, state.step), due)["favor"]
    if accum_steps == 1:
      sums, grads, favor = micro_grads(state.params, favor, batch)
    else:
      # [B, ...] -> [accum, B/accum, ...]: microbatch i holds rows i, i + accum, ...
      split = lambda x: None if x is None else x.reshape(-1, accum_steps, *x.shape[1:]).swapaxes(0, 1)
      micro = tasks.Batch(*(split(x) for x in batch))

      def accumulate(carry, one):
        sums, grads, favor = carry
        one_sums, one_grads, favor = micro_grads(state.params, favor, one)
        return (sums + one_sums, jax.tree.map(jnp.add, grads, one_grads), favor), None

      zeros = (jnp.zeros(3, jnp.float32), jax.tree.map(jnp.zeros_like, state.params), favor)
      (sums, grads, favor), _ = jax.lax.scan(accumulate, zeros, micro)
    weight = jnp.maximum(sums[2], 1.0)
    grads = jax.tree.map(lambda g: g / weight, grads)  # the gradient of the mean loss over the whole batch
    loss = sums[0] / weight
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    nonfinite = (state.nonfinite_step < 0) & ~jnp.isfinite(loss)
    return TrainState(state.step + 1, state.data_position + 1, optax.apply_updates(state.params, updates),
                      favor, opt_state, state.sums_3 + sums,
                      jnp.where(nonfinite, state.step + 1, state.nonfinite_step))

  if shardings is None:
    return jax.jit(train_step)
  return jax.jit(train_step, in_shardings=shardings, out_shardings=shardings[0])
