"""Baselines for features without a dynamic-range problem: causal linear attention on a kernel's raw features
(``stabilize=False``) with no stabiliser at all, as trax and the Performer's own code compute it.

A method ``"<variant>_plain_<form>"`` of the speed study (``<variant>``: a kernel of ``core.KERNELS`` or an entry
of ``speed.ESTIMATORS``, e.g. ``relu``, ``elu_plus_one``, ``taylor_d16``) runs that variant's features through
``form``: ``"scan"``, trax's per-token recurrence (prefix sums of φ(k)[v, 1]ᵀ carried by ``lax.scan``);
``"chunked"``, the same chunks of ``speed.CHUNK`` rows as ``favor_attention``'s chunked pass (masked products
inside a chunk, the carried state across), its backward keeping every chunk's intermediates; or
``"chunked_remat"``, the same with each chunk recomputed in the backward (one state per chunk kept, as the
library's pass keeps one per block of chunks: the like-for-like baseline in memory). Only what the estimator
computes: no row scale, no lost-row check, no masks; a row whose sums over- or underflow float32 is wrong here
(the library's passes exist for those).
Shape letters: B batch, L length, H heads, F features, E = Dv + 1 (values and the ones column), C chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from favor_jax import core

FORMS = ("scan", "chunked", "chunked_remat")


def split(name: str) -> tuple[str, str] | None:
  """(variant, form) of a plain method's name, None if ``name`` is not one."""
  variant, sep, form = name.rpartition("_plain_")
  return (variant, form) if sep and variant and form in FORMS else None


def _features(kernel, q, k, p, qk_dim):
  kern = core.get_kernel(kernel)
  if qk_dim:
    q, k = q[..., :qk_dim], k[..., :qk_dim]
  fq, fk = kern(q, k, p if kern.needs_projection else None, stabilize=False)
  return jnp.swapaxes(fq, 1, 2), jnp.swapaxes(fk, 1, 2)  # [B, H, L, F]


def _scan(fq_BHLF, fk_BHLF, v1_BHLE):
  def step(s_BHFE, x):
    q_BHF, k_BHF, v_BHE = x
    s_BHFE = s_BHFE + jnp.einsum("bhf,bhe->bhfe", k_BHF, v_BHE)
    return s_BHFE, jnp.einsum("bhf,bhfe->bhe", q_BHF, s_BHFE)

  b, h, _, f = fq_BHLF.shape
  s0 = jnp.zeros((b, h, f, v1_BHLE.shape[-1]), jnp.float32)
  _, y_LBHE = jax.lax.scan(step, s0, tuple(jnp.moveaxis(x, 2, 0) for x in (fq_BHLF, fk_BHLF, v1_BHLE)))
  return jnp.moveaxis(y_LBHE, 0, 2)


def _chunked(fq_BHLF, fk_BHLF, v1_BHLE, chunk, remat):
  b, h, length, f = fq_BHLF.shape
  chunks = lambda x: jnp.moveaxis(x.reshape(b, h, length // chunk, chunk, x.shape[-1]), 2, 0)
  below = jnp.tril(jnp.ones((chunk, chunk), jnp.float32))

  def step(s_BHFE, x):
    q_BHCF, k_BHCF, v_BHCE = x
    w_BHCC = jnp.einsum("bhtf,bhjf->bhtj", q_BHCF, k_BHCF) * below
    y_BHCE = jnp.einsum("bhtf,bhfe->bhte", q_BHCF, s_BHFE) + jnp.einsum("bhtj,bhje->bhte", w_BHCC, v_BHCE)
    return s_BHFE + jnp.einsum("bhjf,bhje->bhfe", k_BHCF, v_BHCE), y_BHCE

  s0 = jnp.zeros((b, h, f, v1_BHLE.shape[-1]), jnp.float32)
  _, y = jax.lax.scan(jax.checkpoint(step) if remat else step, s0, tuple(map(chunks, (fq_BHLF, fk_BHLF, v1_BHLE))))
  return jnp.moveaxis(y, 0, 2).reshape(b, h, length, -1)


def attention(kernel, form, q, k, v, p, *, qk_dim=None, chunk=64):
  """Causal attention [B, L, H, Dv] of ``kernel``'s raw features by ``form`` (one of ``FORMS``; the chunked
  forms need L divisible by ``chunk``)."""
  fq, fk = _features(kernel, q, k, p, qk_dim)
  v1 = jnp.swapaxes(v.astype(jnp.float32), 1, 2)
  v1 = jnp.concatenate([v1, jnp.ones(v1.shape[:-1] + (1,), jnp.float32)], -1)
  y = _scan(fq, fk, v1) if form == "scan" else _chunked(fq, fk, v1, min(chunk, q.shape[1]), form == "chunked_remat")
  return jnp.swapaxes(y[..., :-1] / y[..., -1:], 1, 2).astype(v.dtype)
