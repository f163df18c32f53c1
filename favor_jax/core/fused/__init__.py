"""The fused causal programs: causal FAVOR compiled as one Pallas program per target (internal; chosen by
:mod:`favor_jax.core.causal`, where the program is lowered).

Here "program" means a GPU or TPU program (its Pallas kernel bodies included); "kernel" in
:mod:`favor_jax.core.kernels` means the estimator's feature map. One module per target, plus what they share:

- :mod:`~favor_jax.core.fused.tpu`: the Mosaic programs (TPU), features computed on chip where the kernel
  record's ``fused_map`` says how, a row that lost its terms in its chunk's product computed again alone
  inside the kernels (bodies in :mod:`~favor_jax.core.fused.tpu_bodies`);
- :mod:`~favor_jax.core.fused.gpu`: the Triton programs (GPU; Pallas's interpreter elsewhere), features
  computed in the kernels for the same maps, with their kernel bodies in
  :mod:`~favor_jax.core.fused.gpu_bodies` and their inputs as rows in :mod:`~favor_jax.core.fused.gpu_rows`;
- :mod:`~favor_jax.core.fused.rows`: what both share: the inputs as padded head-major rows, the
  :class:`~favor_jax.core.fused.rows.Program` record, and the one custom VJP around the target's program and the
  redo of lost rows by the XLA pass (:func:`~favor_jax.core.fused.rows.run`).

The GPU names stay importable from here (``fused.causal``, ``fused.blocks_for``, ``fused.GPU_DEFAULTS``, as
before the package).
"""

from favor_jax.core.fused.gpu import GPU_DEFAULTS, Blocks, blocks_for, causal, lost_rows, pallas_block

__all__ = ["Blocks", "GPU_DEFAULTS", "blocks_for", "causal", "lost_rows", "pallas_block"]
