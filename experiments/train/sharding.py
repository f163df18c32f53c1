"""The training mesh and where the state and the batches live on it (every process places its shards)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import tasks
from experiments.train.steps import TrainState

ALL = -1  # mesh.data = ALL: every device the sequence axis leaves


def mesh_shape(m, device_count: int) -> tuple[int, int]:
  """(data, sequence) of the mesh ``m`` asks for among ``device_count`` devices: ``mesh.data = -1`` takes all
  the devices ``mesh.sequence`` leaves (``device_count // mesh.sequence``); a ValueError where they do not fit."""
  if m.data == ALL:
    if device_count % m.sequence:
      raise ValueError(f"mesh.data=-1 takes every device, but mesh.sequence={m.sequence} does not divide the "
                       f"{device_count} devices: give mesh.data explicitly, or a mesh.sequence that divides them")
    return device_count // m.sequence, m.sequence
  if m.data * m.sequence > device_count:
    raise ValueError(f"mesh.data × mesh.sequence = {m.data * m.sequence} devices, but only {device_count} exist")
  return m.data, m.sequence


def make_mesh(m) -> Mesh:
  """A ("data", "sequence") mesh over the first data·sequence devices (all of them under several processes,
  and under ``mesh.data = -1``); checked against what exists. :func:`idle_devices` says what it leaves out."""
  data, sequence = mesh_shape(m, jax.device_count())
  needed = data * sequence
  if jax.process_count() > 1 and needed != jax.device_count():  # a process outside the mesh would idle
    raise ValueError(f"mesh.data × mesh.sequence = {needed} devices, but {jax.process_count()} processes "
                     f"need a mesh over all {jax.device_count()} devices (each process holds part of it): "
                     "mesh.data=-1 takes them all")
  devices = np.asarray(jax.devices()[:needed]).reshape(data, sequence)
  return Mesh(devices, ("data", "sequence"), axis_types=(AxisType.Auto, AxisType.Auto))


def idle_devices(mesh: Mesh, m) -> str:
  """A sentence saying how many devices present ``mesh`` leaves idle (and how to use them), or "" when it
  uses every one."""
  used, present = mesh.devices.size, jax.device_count()
  if used >= present:
    return ""
  return (f"the mesh uses {used} of the {present} devices present (mesh.data={m.data} × mesh.sequence="
          f"{m.sequence}); {present - used} stay idle: mesh.data=-1 takes every device")


def state_shardings(state, mesh: Mesh, fsdp: bool):
  """Replicated leaves, or (``fsdp``) each leaf split over "data" along its largest divisible axis."""
  data = mesh.shape["data"]

  def spec(x):
    shape = np.shape(x)
    if fsdp and data > 1:
      for axis in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if shape[axis] % data == 0:
          return NamedSharding(mesh, P(*([None] * axis + ["data"])))
    return NamedSharding(mesh, P())

  shardings = jax.tree.map(spec, state)
  if isinstance(state, TrainState):  # the metric sums are read every log window: one copy on every device
    shardings = shardings._replace(sums_3=NamedSharding(mesh, P()))
  return shardings


def place(tree, shardings):
  """``tree`` as global arrays laid out by ``shardings`` (a matching tree, or one sharding for every leaf):
  every process holds the same values and places only the shards its devices hold. Not ``jax.device_put``:
  with one device per process (jax 0.10.2) its replicated arrays report broken shards to orbax."""
  def put(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  if isinstance(shardings, NamedSharding):
    return jax.tree.map(lambda x: put(x, shardings), tree)
  return jax.tree.map(put, tree, shardings)


def put_batch(batch: tasks.Batch, mesh: Mesh, split: bool = True) -> tasks.Batch:
  """The global batch as arrays split over "data" (else replicated); every process computes the same
  batch (a pure function of its position) and places its shards."""
  return place(batch, NamedSharding(mesh, P("data") if split else P()))
