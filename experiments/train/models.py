"""A small pre-norm Transformer (Linen) whose attention comes from the config: softmax or FAVOR.

Softmax uses ``flax.linen.MultiHeadDotProductAttention``; FAVOR uses
``favor_jax.layers.linen.FavorAttention``, a subclass with the same parameter
tree, so a softmax model's ``params`` load unchanged into a FAVOR model (the
backward-compatibility experiment relies on it). The FAVOR projection lives in
the ``favor`` collection.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import Mesh
from jaxtyping import Float, Int

from experiments.train.qk_maps import QK_MAPS, TEMPERATURE_INIT, MappedFavorAttention, QKMap  # noqa: F401
from favor_jax import core
from favor_jax.core import gates as gates_lib
from favor_jax.layers import gates, inputs
from favor_jax.layers import linen as favor_linen
from favor_jax.layers.projection import layer_projection
from favor_jax.layers.settings import FavorSettings, check_num_kv_heads

ATTENTION_TYPES = ("softmax", "favor")
# "learned": absolute embeddings (cannot run past max_len); "rotary": applied to q, k; "none": no positions
# (a causal model still orders tokens, and a forget gate adds recency).
POSITIONS = ("learned", "rotary", "none")
ANY_LENGTH = ("rotary", "none")  # the positions whose parameters do not depend on the length
DTYPES = ("float32", "bfloat16")  # model.dtype: the compute dtype (activations, matmul inputs)
PARAM_DTYPES = ("float32",)  # model.param_dtype: parameters (and so AdamW's moments) stay float32
REMAT = ("none", "block")  # model.remat: "block" recomputes each block's activations in the backward pass


class AttentionSpec(NamedTuple):
  """The config's attention as the model reads it (hashable, unlike a ConfigDict)."""
  type: str  # "softmax" or "favor"
  favor: FavorSettings | None = None  # FAVOR layers' settings (``favor_settings``); None for softmax
  forget_gate: bool = False  # softmax: FoX's learned forget gate (FAVOR: in ``favor``)
  alibi: bool = False  # softmax: ALiBi's fixed gate (FAVOR: in ``favor``)
  packed: bool = False  # the model is given segment ids (packed documents)
  num_kv_heads: int | None = None  # grouped-query attention's key/value heads (None: one per query head)
  decode: bool = False  # token by token from a cache: FAVOR's constant-size state, softmax's key-value cache
  cache_len: int = 0  # decode: the softmax key-value cache's length (the most tokens a sequence reaches)
  qk_map: str = "none"  # FAVOR: a learned map of q, k before the features (``QK_MAPS``, ``qk_maps.QKMap``)


def rotary(x_BLHD: Float[Array, "B L H D"], base: float = 10000.0,
           positions_L: Int[Array, " L"] | None = None) -> Float[Array, "B L H D"]:
  """Rotary position embedding (Su et al. 2021): rotates feature pairs (i, i + D/2) by angle t·base^(-2i/D) at
  position t, ``positions_L`` (None: 0..L-1; decoding: where the new tokens are)."""
  length, dim = x_BLHD.shape[-3], x_BLHD.shape[-1]
  half = dim // 2
  inv_freq_F = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  t_L = jnp.arange(length) if positions_L is None else positions_L
  angle_LF = t_L.astype(jnp.float32)[:, None] * inv_freq_F
  cos_L1F, sin_L1F = jnp.cos(angle_LF)[:, None, :], jnp.sin(angle_LF)[:, None, :]
  x1, x2 = x_BLHD[..., :half].astype(jnp.float32), x_BLHD[..., half:2 * half].astype(jnp.float32)
  rotated = jnp.concatenate([x1 * cos_L1F - x2 * sin_L1F, x1 * sin_L1F + x2 * cos_L1F, x_BLHD[..., 2 * half:]], -1)
  return rotated.astype(x_BLHD.dtype)


def _rotary_qk(query, key, positions=None):
  return rotary(query, positions_L=positions), rotary(key, positions_L=positions)


def _rotary_softmax(query, key, value, mask=None, dropout_rng=None, dropout_rate=0.0, broadcast_dropout=True,
                    deterministic=False, dtype=None, precision=None, force_fp32_for_softmax=False):
  # Named arguments, not **kwargs: Flax passes an attention_fn only the keywords its signature names.
  return nn.dot_product_attention(
      rotary(query), rotary(key), value, mask=mask, dropout_rng=dropout_rng, dropout_rate=dropout_rate,
      broadcast_dropout=broadcast_dropout, deterministic=deterministic, dtype=dtype, precision=precision,
      force_fp32_for_softmax=force_fp32_for_softmax)


def favor_settings(config, causal: bool, mesh: Mesh | None = None, decode: bool = False) -> FavorSettings:
  """The settings of the config's FAVOR layers, checked once (errors name the config's ``attention.FIELD``).

  Args:
    config: a training config (its ``attention`` and ``model.positions``).
    causal: whether the model is a causal LM (``tasks.is_causal``).
    mesh: the training mesh: with more than one device on "sequence" the layers split the sequence over it
      (and the batch over "data").
    decode: the layers decode token by token from their constant-size state (generation).

  Returns:
    The layers' settings. A kernel without a random projection (Taylor, Hedgehog's learned map) gets neither
    ``num_features`` nor ``projection``: the config holds them for every kernel.
  """
  a = config.attention
  parallel = mesh is not None and mesh.shape.get("sequence", 1) > 1
  return FavorSettings.build(
      kernel=a.kernel, num_features=a.num_features, projection=a.projection, causal=causal,
      chunk_size=a.chunk_size, window=a.window, qk_head_dim=a.qk_head_dim or None, decode=decode,
      qk_transform=_rotary_qk if config.model.positions == "rotary" else None, mesh=mesh if parallel else None,
      sequence_axis="sequence" if parallel else None, batch_axis="data" if parallel else None,
      forget_gate=a.get("forget_gate", False), alibi=a.get("alibi", False), unused_projection="drop",
      control_variate=a.get("control_variate", 0.0) if a.window else 0.0, prefix="attention.")


class SoftmaxAttention(nn.Module):
  """Exact causal softmax attention through ``core.softmax_attention``, with the FAVOR layers' forget gate,
  ALiBi, segment ids and grouped-query heads: the Forgetting Transformer (``forget_gate``) and ALiBi as
  reference models. The parameter tree is ``nn.MultiHeadDotProductAttention``'s (``query``, ``key``,
  ``value``, ``out``), plus ``forget_gate`` (``layers.gates``: the FAVOR layers' parameterisation and init).

  ``decode``: a key-value cache of ``cache_len`` positions per sequence (``cache`` collection: ``keys``,
  ``values`` [B, cache_len, Hkv, D], rotated keys; ``index``, the tokens cached; gated (``forget_gate``,
  ``alibi``): ``log_decay`` [B, cache_len, H] float32 beside them, each cached key's running sum of the log
  gates since it came, Σ_{j<l≤t} log f_l, the bias of its logit for the current query t). A call of l > 1
  tokens is a prompt into the empty cache (the causal pass over it, its gates included); one token attends to
  every cached key, each key/value head read once for its group's query heads (:meth:`_one_token`, the decays
  as the logits' bias). Each cached decay grows by the new token's log gate every step, summed from
  the key forward as the full pass sums from the query back (terms ≤ 0: no cancellation, unlike a difference of
  two prefix sums, which would lose the bias of nearby keys to float32 rounding once the prefix sum is large).
  Packed documents (``segment_ids``) are not decoded: generation gives none.
  """
  num_heads: int
  rotary: bool
  forget_gate: bool = False
  alibi: bool = False
  num_kv_heads: int | None = None
  decode: bool = False
  cache_len: int = 0
  dtype: jnp.dtype = jnp.float32  # compute dtype
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BLD, mask=None, deterministic=True, segment_ids=None):
    del mask, deterministic  # causal (no padding in an LM), no dropout
    d_model = x_BLD.shape[-1]
    kinds = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    kv_heads = self.num_kv_heads or self.num_heads
    dense = lambda name, heads: nn.DenseGeneral((heads, d_model // self.num_heads), name=name, **kinds)
    q_BLHD, k_BLKD, v_BLKD = (dense("query", self.num_heads)(x_BLD), dense("key", kv_heads)(x_BLD),
                              dense("value", kv_heads)(x_BLD))
    logit_BLH = None
    if self.forget_gate:
      kernel_init, bias_init = gates.forget_gate_init()
      logit_BLH = nn.DenseGeneral(self.num_heads, kernel_init=kernel_init, bias_init=bias_init, dtype=jnp.float32,
                                  param_dtype=self.param_dtype, name="forget_gate")(x_BLD)
    log_gate = gates.layer_log_gate(logit_BLH, self.alibi, q_BLHD.shape[:-1])
    if self.decode:
      if segment_ids is not None:
        raise ValueError("the softmax key-value cache decodes one document per sequence: segment_ids (packed "
                         "documents) are not cached")
      out_BLHD = self._cached(q_BLHD, k_BLKD, v_BLKD, log_gate)
      return nn.DenseGeneral(d_model, axis=(-2, -1), name="out", **kinds)(out_BLHD)
    if self.rotary:
      q_BLHD, k_BLKD = rotary(q_BLHD), rotary(k_BLKD)
    k_BLHD, v_BLHD = inputs.repeat_kv_heads(k_BLKD, v_BLKD, self.num_heads)
    out_BLHD = core.softmax_attention(q_BLHD, k_BLHD, v_BLHD, causal=True,
                                      **gates.gate_kwargs(log_gate, segment_ids))
    return nn.DenseGeneral(d_model, axis=(-2, -1), name="out", **kinds)(out_BLHD)

  def _cached(self, q_BlHD, k_BlKD, v_BlKD, log_gate_BlH=None):
    """Decoding: the new tokens' keys and values written at ``index`` (and, gated, every cached key's decay grown
    by the new log gates, the new keys' set), the queries read against the cache."""
    batch, new = q_BlHD.shape[0], q_BlHD.shape[1]
    shape = (batch, self.cache_len) + k_BlKD.shape[2:]
    keys = self.variable("cache", "keys", jnp.zeros, shape, k_BlKD.dtype)
    values = self.variable("cache", "values", jnp.zeros, shape, v_BlKD.dtype)
    index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    gated = {} if log_gate_BlH is None else {"log_gate": log_gate_BlH}
    if gated:
      decay = self.variable("cache", "log_decay", jnp.zeros, (batch, self.cache_len, self.num_heads), jnp.float32)
    t_l = index.value + jnp.arange(new, dtype=jnp.int32)
    if self.rotary:
      q_BlHD, k_BlKD = rotary(q_BlHD, positions_L=t_l), rotary(k_BlKD, positions_L=t_l)
    prompt = lambda: core.softmax_attention(q_BlHD, *inputs.repeat_kv_heads(k_BlKD, v_BlKD, self.num_heads),
                                            causal=True, **gated)
    if self.is_initializing():
      return prompt()
    keys.value = jax.lax.dynamic_update_slice(keys.value, k_BlKD, (0, index.value, 0, 0))
    values.value = jax.lax.dynamic_update_slice(values.value, v_BlKD, (0, index.value, 0, 0))
    if gated:  # the keys before grow by every new gate; key j of the new ones by the gates after it
      grown_BCH = decay.value + jnp.sum(log_gate_BlH, axis=1, keepdims=True)
      decay.value = jax.lax.dynamic_update_slice(grown_BCH, gates_lib.to_end(log_gate_BlH), (0, index.value, 0))
    index.value = index.value + new
    if new > 1:  # a prompt into the empty cache: the causal pass over it
      return prompt()
    return self._one_token(q_BlHD, keys.value, values.value, index.value, decay.value if gated else None)

  def _one_token(self, q_B1HD, k_BCKD, v_BCKD, seen, decay_BCH=None):
    """One query per sequence against the first ``seen`` cached keys: grouped-query attention reads each cached
    key/value head once for the G = H/Hkv query heads of its group (no copy of the cache repeated to H heads),
    logits in the cache's dtype, softmax in float32 (as Flax's ``dot_product_attention``, lean: the reference's
    input checks would cost more than the step)."""
    batch, _, heads, dim = q_B1HD.shape
    kv_heads = k_BCKD.shape[2]
    q_BKGD = q_B1HD.reshape(batch, kv_heads, heads // kv_heads, dim) / math.sqrt(dim)
    logits_BKGC = jnp.einsum("bkgd,bckd->bkgc", q_BKGD, k_BCKD).astype(jnp.float32)
    if decay_BCH is not None:  # each key's decay Σ_{j<l≤t} log f_l: the bias of its logit
      logits_BKGC = logits_BKGC + jnp.moveaxis(decay_BCH, 1, 2).reshape(logits_BKGC.shape)
    logits_BKGC = jnp.where(jnp.arange(k_BCKD.shape[1]) < seen, logits_BKGC, -jnp.inf)
    weights_BKGC = jax.nn.softmax(logits_BKGC, axis=-1).astype(v_BCKD.dtype)
    out_BKGD = jnp.einsum("bkgc,bckd->bkgd", weights_BKGC, v_BCKD)
    return out_BKGD.reshape(batch, 1, heads, dim).astype(q_B1HD.dtype)


def flax_softmax(attention: AttentionSpec) -> bool:
  """Whether the softmax layer is Flax's own (needs an explicit causal mask): not gated, packed, grouped-query
  or decoding, which :class:`SoftmaxAttention` does."""
  return attention.type == "softmax" and not (attention.forget_gate or attention.alibi or attention.packed
                                              or attention.decode or attention.num_kv_heads)


def attention_layer(attention: AttentionSpec, num_heads: int, positions: str, name: str,
                    dtype=jnp.float32, param_dtype=jnp.float32) -> nn.Module:
  """The attention module named by ``attention.type`` ("softmax" or "favor"); gated, packed, grouped-query or
  decoding softmax: :class:`SoftmaxAttention` (the same parameters as Flax's). ``dtype`` is the compute dtype
  of its projections (attention inside follows the library's precision policy), ``param_dtype`` its
  parameters'."""
  kinds = dict(dtype=dtype, param_dtype=param_dtype)
  if attention.type == "softmax":
    rope = positions == "rotary"
    if not flax_softmax(attention):
      return SoftmaxAttention(num_heads, rope, attention.forget_gate, attention.alibi, attention.num_kv_heads,
                              attention.decode, attention.cache_len, name=name, **kinds)
    return nn.MultiHeadDotProductAttention(
        num_heads=num_heads, attention_fn=_rotary_softmax if rope else nn.dot_product_attention, name=name,
        **kinds)
  if attention.qk_map != "none":
    return MappedFavorAttention(attention, num_heads, name=name, **kinds)
  fields = {f.name: getattr(attention.favor, f.name) for f in dataclasses.fields(attention.favor)}
  return favor_linen.FavorAttention(num_heads=num_heads, num_kv_heads=attention.num_kv_heads, name=name, **fields,
                                    **kinds)


class ShortConv(nn.Module):
  """Causal depthwise convolution over the last ``width`` positions, per channel (Based's and Zoology's short
  convolution; H3's shift): position t mixes tokens t-width+1..t, so the residual stream carries the
  previous tokens' identity, which recall's induction step needs and a linear-attention layer cannot
  single out. Decoding keeps the last width-1 inputs (``cache/inputs``)."""
  width: int
  decode: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BLD):
    d_model, past = x_BLD.shape[-1], self.width - 1
    conv = lambda padding: nn.Conv(d_model, kernel_size=(self.width,), padding=padding,
                                   feature_group_count=d_model, dtype=self.dtype, param_dtype=self.param_dtype,
                                   name="conv")
    if not self.decode:
      return conv(((past, 0),))(x_BLD)
    cached = self.variable("cache", "inputs", jnp.zeros, x_BLD.shape[:1] + (past, d_model), x_BLD.dtype)
    x_BPD = jnp.concatenate([cached.value.astype(x_BLD.dtype), x_BLD], axis=1)  # the inputs before, then these
    if not self.is_initializing():
      cached.value = x_BPD[:, x_BPD.shape[1] - past:]
    return conv("VALID")(x_BPD)


class Block(nn.Module):
  attention: AttentionSpec
  num_heads: int
  mlp_dim: int
  positions: str
  short_conv: int = 0  # > 0: a residual ShortConv of this width before attention (0 = none)
  dtype: jnp.dtype = jnp.float32  # compute dtype
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BLD, mask, train: bool, segment_ids=None):
    kinds = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    norm = lambda name: nn.LayerNorm(name=name, **kinds)
    if self.short_conv:
      conv = ShortConv(self.short_conv, self.attention.decode, name="short_conv", **kinds)
      x_BLD = x_BLD + conv(norm("ln_conv")(x_BLD))
    attend = attention_layer(self.attention, self.num_heads, self.positions, "attention", **kinds)
    packed = {} if segment_ids is None else {"segment_ids": segment_ids}
    x_BLD = x_BLD + attend(norm("ln_attention")(x_BLD), mask=mask, deterministic=not train, **packed)
    h_BLF = nn.gelu(nn.Dense(self.mlp_dim, name="mlp_in", **kinds)(norm("ln_mlp")(x_BLD)))
    return x_BLD + nn.Dense(x_BLD.shape[-1], name="mlp_out", **kinds)(h_BLF)


class Transformer(nn.Module):
  """Causal LM (``num_classes == 0``: logits [B, L, vocab]) or encoder classifier (logits [B, classes]).

  The classifier mean-pools the non-padding positions (token 0 is padding).
  ``train=True`` lets causal FAVOR++ layers update their running ρ (``favor``
  collection mutable); there is no dropout. ``segment_ids`` [B, L]: packed documents, no attention across a
  boundary (positions must be relative: rotary or none); None: one document per row. ``dtype``: the compute
  dtype (parameters in ``param_dtype``); the logits are float32 whatever it is. ``remat="block"``: each block's
  activations are recomputed in the backward pass instead of kept (memory for compute).

  ``attention.decode`` (a causal LM): each call continues the sequences of the ``cache`` collection (made by
  ``init`` on one token) by its tokens, giving their logits: FAVOR layers through their constant-size state,
  softmax through its key-value cache, learned positions from ``cache/next_position``.
  """
  vocab_size: int
  num_classes: int
  max_len: int
  d_model: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  positions: str
  attention: AttentionSpec
  short_conv: int = 0  # > 0: each block starts with a residual causal depthwise convolution of this width
  dtype: jnp.dtype = jnp.float32  # compute dtype: float32 or bfloat16
  param_dtype: jnp.dtype = jnp.float32
  remat: str = "none"  # "none" or "block"

  @nn.compact
  def __call__(self, tokens_BL: Int[Array, "B L"], train: bool = False,
               segment_ids: Int[Array, "B L"] | None = None) -> Array:
    causal = self.num_classes == 0
    length = tokens_BL.shape[-1]
    if length > self.max_len:
      raise ValueError(f"tokens has length {length}, more than the model's max_len {self.max_len}")
    kinds = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    x_BLD = nn.Embed(self.vocab_size, self.d_model, name="embed", **kinds)(tokens_BL)
    if self.positions == "learned":
      t_L = jnp.arange(length)
      if self.attention.decode:
        index = self.variable("cache", "next_position", lambda: jnp.zeros((), jnp.int32))
        t_L = t_L + index.value
        if not self.is_initializing():
          index.value = index.value + length
      x_BLD = x_BLD + nn.Embed(self.max_len, self.d_model, name="position", **kinds)(t_L)
    pad_BL = tokens_BL != 0
    if causal:  # LM: no padding; Flax's softmax needs an explicit causal mask, FAVOR and SoftmaxAttention not
      mask = nn.make_causal_mask(tokens_BL) if flax_softmax(self.attention) else None
    else:  # classifier: remove padding keys for every query (the only mask FAVOR can honour)
      mask = pad_BL[:, None, None, :]
    # static_argnums count the module: (self, x, mask, train, segment_ids) -> train is static
    block_class = nn.remat(Block, static_argnums=(3,)) if self.remat == "block" else Block
    block = functools.partial(block_class, self.attention, self.num_heads, self.mlp_dim, self.positions,
                              self.short_conv, **kinds)
    for i in range(self.num_layers):
      x_BLD = block(name=f"block_{i}")(x_BLD, mask, train, segment_ids)
    x_BLD = nn.LayerNorm(name="ln_final", **kinds)(x_BLD)
    # The head in float32 (and so the logits and the loss): bfloat16's 8 bits would round log-probabilities.
    head = lambda n: nn.Dense(n, name="head", dtype=jnp.float32, param_dtype=self.param_dtype)
    if causal:
      return head(self.vocab_size)(x_BLD)
    weights_BL1 = pad_BL[..., None].astype(x_BLD.dtype)
    pooled_BD = (x_BLD * weights_BL1).sum(-2) / jnp.maximum(weights_BL1.sum(-2), 1.0)
    return head(self.num_classes)(pooled_BD)


def make_model(config, vocab_size: int, num_classes: int, max_len: int, mesh: Mesh | None = None,
               decode: bool = False, cache_len: int = 0) -> Transformer:
  """The config's model; FAVOR layers run sequence-parallel over ``mesh``'s "sequence" axis if it has > 1 device.
  Softmax reads ``attention.forget_gate`` and ``attention.alibi`` too; ``data.pack`` (if the task has it) builds
  a model that takes segment ids. ``model.num_kv_heads`` (0: one per query head) groups the key/value heads.
  ``decode`` (a causal LM): the model that decodes token by token (:class:`Transformer`), a softmax key-value
  cache of ``cache_len`` positions."""
  m, a = config.model, config.attention
  kv_heads = m.get("num_kv_heads", 0) or None
  try:
    check_num_kv_heads(kv_heads, m.num_heads)
  except ValueError as e:
    raise ValueError(f"model.{e}") from None
  if decode and num_classes:
    raise ValueError("decode=True needs a causal language model (num_classes 0), got a classifier")
  favor = favor_settings(config, num_classes == 0, mesh, decode) if a.type == "favor" else None
  spec = AttentionSpec(a.type, favor, forget_gate=a.get("forget_gate", False), alibi=a.get("alibi", False),
                       packed=bool(config.data.get("pack", False)), num_kv_heads=kv_heads, decode=decode,
                       cache_len=cache_len, qk_map=a.get("qk_map", "none") if a.type == "favor" else "none")
  return Transformer(vocab_size=vocab_size, num_classes=num_classes, max_len=max_len, d_model=m.d_model,
                     num_layers=m.num_layers, num_heads=m.num_heads, mlp_dim=m.mlp_dim,
                     positions=m.positions, short_conv=m.short_conv, attention=spec,
                     dtype=jnp.dtype(m.get("dtype", "float32")), param_dtype=jnp.dtype(m.get("param_dtype", "float32")),
                     remat="none" if decode else m.get("remat", "none"))  # decoding has no backward pass


def decode_state_size(config, seq_len: int) -> int:
  """Numbers one attention layer keeps per sequence to decode the next token after ``seq_len`` tokens.

  Softmax: its key-value cache, L·Hkv·2·D (grows with L; Hkv = ``model.num_kv_heads`` or H), and with a forget
  gate or ALiBi each cached key's decay, L·H more. FAVOR: the arrays of ``core.favor_decode_init`` for the
  config's kernel, features and window (the recurrent state F·(Dv+1) and running maximum F per head; with a
  window also its W keys and values), read off their shapes, independent of L; per key/value head where the
  layer keeps it so (grouped-query attention where exact: ``FavorSettings.kv_state``), else per query head. A
  short convolution of width K adds the block's last K-1 inputs, (K-1)·d_model.
  """
  m, a = config.model, config.attention
  heads, head_dim = m.num_heads, m.d_model // m.num_heads
  kv_heads = m.get("num_kv_heads", 0) or heads
  conv = max(m.short_conv - 1, 0) * m.d_model
  if a.type == "softmax":  # grouped-query attention caches its key/value heads only; a gate's decays per head
    gated = a.get("forget_gate", False) or a.get("alibi", False)
    return conv + seq_len * (kv_heads * 2 * head_dim + (heads if gated else 0))
  qk_dim = a.qk_head_dim or head_dim
  settings = favor_settings(config, causal=True)
  state_heads = kv_heads if settings.kv_state(heads, kv_heads)[0] else heads
  settings = dataclasses.replace(settings, per_head_projection=False)

  def empty_state():
    projection = layer_projection(jax.random.PRNGKey(0), settings, heads, qk_dim)
    return core.favor_decode_init(jnp.zeros((1, 1, heads, qk_dim)), jnp.zeros((1, 1, state_heads, head_dim)),
                                  projection, kernel=a.kernel, window=a.window)

  return conv + sum(math.prod(x.shape) for x in jax.tree.leaves(jax.eval_shape(empty_state)))
